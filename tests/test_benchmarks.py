"""The benchmarks end to end at smoke size (jaxalign side only): every row is there, with sane numbers."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign.models import LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
OBJECTIVES = ("sft", "dpo", "simpo", "orpo", "ift", "mpo")


@pytest.mark.slow
def test_cpu_benchmark_smoke_writes_every_row(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as in a real run
    done = subprocess.run([sys.executable, "benchmarks/cpu.py", "--smoke", "--no-torch", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = tmp_path.glob("cpu-*-smoke.json")
    result = json.loads(path.read_text())

    assert Path(result["machine"]["jaxalign_path"]) == ROOT / "jaxalign"  # this checkout's package, not another
    assert result["torch_interpreter"] == "skipped: --no-torch"
    assert result["peak"]["jaxalign"]["gflops"] > 0
    rows = {(r["objective"], r["logps_chunk_size"]): r for r in result["train"]}
    assert set(rows) == {(name, -1) for name in OBJECTIVES} | {("sft", 0), ("dpo", 0)}
    for row in rows.values():
        assert "error" not in row, row
        assert row["side"] == "jaxalign" and row["shape"] == "tiny"
        assert row["step_s"] > 0 and row["compile_s"] > 0 and row["memory_bytes"] > 0
        assert 0 < row["mfu"] < 1 and row["policy_mfu"] <= row["mfu"]
        assert 0 < row["real_tokens"] <= row["padded_tokens"]
        assert len(row["losses"]) == len(row["step_times_s"]) and all(map(math.isfinite, row["losses"]))
    # the reference starts equal to the policy, so DPO's first loss is ln 2
    assert rows[("dpo", -1)]["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[("dpo", 0)]["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    # SFT: (6N + 12·L·H·hd·T) per real token, N without the untied input table; IFT adds a forward (a third)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2)
    per_token = 6 * (config.num_params() - 512 * 64) + 12 * 2 * 4 * 16 * 32
    sft, ift = rows[("sft", -1)], rows[("ift", -1)]
    assert sft["model_gflop"] == pytest.approx(per_token * sft["real_tokens"] / 1e9)
    assert ift["model_gflop"] == pytest.approx(sft["model_gflop"] * 4 / 3)
    assert rows[("dpo", -1)]["real_tokens"] > sft["real_tokens"]  # chosen + rejected

    sampling = {r["batch"]: r for r in result["sampling"]}
    assert set(sampling) == {1, 8}
    assert all(len(r["tokens"]) == batch and r["tokens_per_s"] > 0 for batch, r in sampling.items())
    # the extras: bandwidth, the GRPO step, the shared-prefix rows (their losses equal the unshared ones)
    assert 0 < result["bandwidth"]["limit_gbs"] == max(result["bandwidth"]["jax_sum_read_gbs"],
                                                       result["bandwidth"]["jax_matvec_read_gbs"])
    fractions = {r["batch"]: r for r in result["decode_fraction"]}  # decoding against that limit
    assert set(fractions) == {1, 8} and all(r["fraction"] > 0 for r in fractions.values())
    assert fractions[1]["read_gbs"] == pytest.approx(sampling[1]["tokens_per_s"] * sampling[1]["step_bytes"] / 1e9)
    assert fractions[8]["step_bytes"] > fractions[1]["step_bytes"]  # eight rows of KV cache
    assert "% of the measured limit**" in done.stdout
    grpo, shared = result["grpo"]["rows"]
    assert (grpo["side"], shared["side"]) == ("jax", "jax-shared")
    assert grpo["step_s"] == pytest.approx(grpo["rollout_s"] + grpo["train_s"], rel=0.5)
    dpo = result["shared_prefix"]["dpo"]["sets"]["prompt-heavy"]
    assert len(dpo["rows"]) == 6 and all(r["tokens_per_s"] > 0 for r in dpo["rows"].values())
    for row in result["shared_prefix"]["grpo"]["rows"]:
        assert row["shared"]["loss"] == pytest.approx(row["repeated"]["loss"], rel=1e-4, abs=1e-7)
    assert "**Shared prefix**" in done.stdout and "**GRPO step, tiny**" in done.stdout


@pytest.mark.slow
def test_grpo_benchmark_smoke_runs_the_jaxalign_side():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "benchmarks/grpo_cpu.py", "--smoke", "--no-torch"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.splitlines()[0])
    assert row["side"] == "jax" and row["shape"] == "tiny"
    assert row["rollout_s"] > 0 and row["train_s"] > 0
    assert row["step_s"] == pytest.approx(row["rollout_s"] + row["train_s"], rel=0.5)  # medians of each
    assert json.loads(done.stdout.splitlines()[1])["side"] == "jax-shared"
    assert "| tiny | jaxalign, a row per completion |" in done.stdout
    assert "| tiny | jaxalign, shared prefix (the default here) |" in done.stdout  # per-block attention: "auto"
    assert 'The default (`shared_prefix="auto"`) trains a group as the layout of fewer model FLOPs' in done.stdout


@pytest.mark.slow
def test_scan_layers_benchmark_smoke_compares_both_arms():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    done = subprocess.run([sys.executable, "benchmarks/scan_layers.py", "--smoke", "--shapes", "gemma2-26"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| gemma2-26 (plan (0, 2, 3)) |" in done.stdout
    assert done.stdout.rstrip().endswith("| True |")  # both arms decode the same tokens


@pytest.mark.slow
def test_compile_cache_benchmark_smoke_reads_programs_back(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/compile_cache.py", "--smoke", "--out", str(tmp_path / "r.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert row["off"]["summary"].startswith("off") and row["entries"] >= 1
    cold = row["cold"]["summary"]
    assert cold.startswith("0 program(s) read back") and cold.endswith(f" {row['entries']} written"), cold
    assert row["warm"]["summary"].startswith(f"{row['entries']} program(s) read back")


@pytest.mark.slow
def test_decode_benchmark_smoke_measures_every_arm(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "benchmarks/decode.py", "--smoke", "--profile", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = tmp_path.glob("decode-*-smoke.json")
    result = json.loads(path.read_text())
    assert result["bandwidth"]["limit_gbs"] > 0
    assert {(r["layers"], r["weights"], r["batch"]) for r in result["decode"]} == {
        (layers, weights, batch) for layers, weights in (("scanned", "model"), ("unrolled", "model"),
                                                          ("unrolled", "bfloat16"), ("unrolled", "int8"))
        for batch in (1, 4)}
    assert all(r["bytes_per_step"] > 0 and math.isfinite(r["bandwidth_fraction"]) for r in result["decode"])
    for agreement in (result["bf16_agreement"], result["int8_agreement"]):
        assert 0 <= agreement["free_running_same_tokens"] <= 1 and 0 <= agreement["teacher_forced_same_argmax"] <= 1
    profile = result["profile"]  # XLA:CPU's operations per decode step
    assert profile["ops_at_once"] >= 0.99 and profile["ops_ms_per_step"] <= profile["wall_ms_per_step"] * 1.01
    assert any(k["kind"].startswith("dot") for k in profile["kinds"])
    assert all(0 <= r["position"] < 8 and r["float32_top2_margin"] >= 0 for r in agreement["rows_parted_at"])
    assert len(agreement["rows_parted_at"]) == 4 - agreement["rows_identical"]


@pytest.mark.slow
def test_decode_benchmark_long_section_compares_two_checkouts(tmp_path):
    """Section 5 with --against: both checkouts (here the same one twice) in turn, in child processes."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "benchmarks/decode.py", "--smoke", "--long", "--against", str(ROOT),
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = tmp_path.glob("decode-*-long-smoke.json")
    long = json.loads(path.read_text())["long_prompts"]
    assert len(long["rows"]) == 4 and {r["checkout"] for r in long["rows"]} == {str(ROOT.resolve())}
    assert all(math.isfinite(r["seconds_per_step"]) and r["prefill_s"] > 0 for r in long["rows"])
    assert math.isfinite(long["decode_speedup"]) and long["prefill_speedup"] > 0


def test_distill_logits_benchmark_smoke_compares_every_setting():
    """Whole against blocked logits for the distillation loss: every setting compiled and timed, the blocked
    ones with less temporary memory than whole logits (in-process: a small, quick shape)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from distill_logits import measure
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    result = measure("smoke", [0, 16], repeats=2)
    rows = result["settings"]
    assert set(rows) == {"decoders only", "logits_block=0", "logits_block=16"}
    assert rows["logits_block=16"]["block"] == 16 and rows["logits_block=0"]["block"] == 0
    assert all(row["step_s"] > 0 and row["temp_bytes"] > 0 for row in rows.values())
    assert rows["logits_block=16"]["temp_bytes"] < rows["logits_block=0"]["temp_bytes"]


def test_matvec_fusion_probe_chains_agree():
    """The batch-1 product probe at 2 layers: its four ways of writing a layer compute the same values."""
    done = subprocess.run([sys.executable, "benchmarks/matvec_fusion.py", "--layers", "2", "--rounds", "1", "--calls",
                           "3", "--widths", "1536", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["max_difference"] < 1e-5 and len(result["chains"]) == 4
    assert all(row["best_gbs"] > 0 for row in result["chains"].values())


def test_step_profile_categorizes_hlo_and_profiles_both_sides(tmp_path):
    """The train-step profile: HLO instructions fall in the right categories (a dot, what ran under the model's
    ``attention_core`` name scope, pure data movement, reductions), PyTorch's ops by name, and a tiny run of both
    sides accounts for the step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_profile

    hlo = """HloModule m

%fused_dot (p0: f32[4,8], p1: f32[8,16]) -> f32[4,16] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,16]{1,0} parameter(1)
  ROOT %d = f32[4,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_scores (p0: f32[2,2,64,16]) -> f32[2,2,64,16] {
  %p0 = f32[2,2,64,16]{3,2,1,0} parameter(0)
  ROOT %e = f32[2,2,64,16]{3,2,1,0} exponential(%p0), metadata={op_name="jit(f)/attention_core/exp"}
}

%fused_move (p0: f32[16,4]) -> f32[4,16] {
  %p0 = f32[16,4]{1,0} parameter(0)
  ROOT %t = f32[4,16]{0,1} transpose(%p0), dimensions={1,0}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[4,8], w: f32[8,16], s: f32[2,2,64,16]) -> f32[4] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,16]{1,0} parameter(1)
  %s = f32[2,2,64,16]{3,2,1,0} parameter(2)
  %ynn_fusion.1 = f32[4,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot
  %loop_fusion = f32[2,2,64,16]{3,2,1,0} fusion(%s), kind=kLoop, calls=%fused_scores
  %copy_fusion = f32[4,16]{0,1} fusion(%ynn_fusion.1), kind=kLoop, calls=%fused_move
  %zero = f32[] constant(0)
  ROOT %reduce.3 = f32[4]{0} reduce(%copy_fusion, %zero), dimensions={1}, to_apply=%add
}
"""
    kinds = step_profile.hlo_categories(hlo)
    assert kinds["ynn_fusion.1"] == "matmuls" and kinds["loop_fusion"] == "attention"
    assert kinds["copy_fusion"] == "data movement" and kinds["reduce.3"] == "reductions"
    unscoped = step_profile.hlo_categories(hlo.replace("attention_core", "elsewhere"))
    assert unscoped["loop_fusion"] == "elementwise"
    assert [step_profile.torch_category(k) for k in ("aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu",
                                                     "aten::_log_softmax", "aten::transpose", "aten::silu",
                                                     "aten::_foreach_mul_")] == \
        ["matmuls", "attention", "reductions", "data movement", "elementwise", "optimizer"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    options = [] if _has_torch() else ["--no-torch"]
    done = subprocess.run([sys.executable, "benchmarks/step_profile.py", "--shape", "tiny", "--reps", "2", "--out",
                           str(tmp_path / "p.json"), *options], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "p.json").read_text())
    for side in result["sides"]:
        assert side["wall_ms_per_step"] > 0 and side["summed_ms_per_step"] > 0
        assert side["categories"]["matmuls"] > 0 and side["categories"].get("attention", 0) > 0
    assert result["sides"][0]["side"] == "jaxalign" and not result["sides"][0]["unmatched_events"]


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def test_attention_ab_times_the_three_attention_variants(tmp_path):
    """The A/B of the causal blocks' backward: its restated XLA-derived block computes the same forward as the
    model's block, and a tiny run (2 forced blocks) times all three variants and writes their ratios."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import attention_ab

    from jaxalign.models.llama import causal_block_attention

    rng = np.random.RandomState(0)
    queries = jnp.asarray(rng.randn(2, 2, 2, 4, 8), jnp.float32)
    keys, values = (jnp.asarray(rng.randn(2, 2, 6, 8), jnp.float32) for _ in range(2))
    mask = jnp.asarray(np.tril(np.ones((4, 6), bool), 2)[None].repeat(2, 0))
    np.testing.assert_allclose(attention_ab.xla_derivative_block(queries, keys, values, mask, 0.3, 0.0),
                               causal_block_attention(queries, keys, values, mask, 0.3, 0.0), atol=1e-6)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "benchmarks/attention_ab.py", "--shape", "tiny", "--blocks", "2",
                           "--rounds", "2", "--out", str(tmp_path / "ab.json")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "ab.json").read_text())
    assert result["blocks"] == 2 and set(result["variants"]) == {"hand-written", "xla-derivative", "dense"}
    assert all(len(v["seconds"]) == 2 and v["median_ms"] > 0 for v in result["variants"].values())
    assert result["variants"]["xla-derivative"]["ratio_to_xla_derivative"] == [1.0, 1.0, 1.0]
