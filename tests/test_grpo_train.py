"""The GRPO trainer: shared-prefill rollouts, the objective's micro-batch exactness for every loss type, an end-to-end
run through ``train()`` (SFT start, samples, metrics, export), exact resume, and config validation."""

import dataclasses
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_train import SMALL

from jaxalign.data.batching import group_rows, group_rows_cost
from jaxalign.models import create_model
from jaxalign.objectives import GRPOParams, get_objective
from jaxalign.sampling import sample
from jaxalign.sampling.generate import left_pad
from jaxalign.train import ConfigError, load_config, train, validate
from jaxalign.train.export import export, restore_model

GRPO = [*SMALL, "--config.objective.params.prompts_per_step=4", "--config.objective.params.num_generations=4",
        "--config.train.batch_size=16", "--config.objective.params.max_completion_length=4",
        "--config.objective.params.sft_steps=10", "--config.train.steps=4", "--config.train.save_every=2",
        "--config.train.log_every=1", "--config.train.eval_every=2", "--config.eval.generate=8",
        "--config.objective.params.samples_every=2", "--config.logging.plot=True"]


def grpo_config(workdir, *extra):
    return load_config("grpo", [*GRPO, f"--config.workdir={workdir}", *extra])


def test_samples_from_one_prefill_equal_samples_from_repeated_prompts(tiny_config):
    model = create_model(tiny_config, seed=3)
    tokens, mask = left_pad([[5, 6, 7, 8], [9, 10], [11, 12, 13]], 0)
    shared = sample(model, tokens, prompt_mask=mask, max_new_tokens=7, temperature=1.0, seed=11, num_samples=4)
    repeated = sample(model, np.repeat(tokens, 4, 0), prompt_mask=np.repeat(mask, 4, 0), max_new_tokens=7,
                      temperature=1.0, seed=11)
    np.testing.assert_array_equal(np.asarray(shared.tokens), np.asarray(repeated.tokens))
    np.testing.assert_allclose(np.asarray(shared.logps), np.asarray(repeated.logps), atol=1e-5)
    assert len(set(map(tuple, np.asarray(shared.tokens)[:4].tolist()))) > 1  # the 4 samples of a prompt differ


def rollout_batch(seed=0, rows=8, prompt=5, completion=4, vocab=128):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, completion + 1, rows)
    lengths[0] = 0  # a completion with no token (masked row)
    valid = (np.arange(completion)[None] < lengths[:, None]).astype(np.int32)
    tokens = rng.integers(3, vocab, (rows, prompt + completion)).astype(np.int32)
    return {"tokens": tokens, "attention_mask": np.concatenate([np.ones((rows, prompt), np.int32), valid], 1),
            "loss_mask": np.concatenate([np.zeros((rows, prompt), np.int32), valid], 1),
            "advantages": rng.normal(size=rows).astype(np.float32),
            "old_logps": rng.normal(-4.6, 0.3, (rows, prompt + completion)).astype(np.float32)}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
def test_grpo_objective_micro_batches_give_the_whole_batch_update(tiny_config, loss_type):
    model = create_model(tiny_config, seed=1)
    graphdef, params = nnx.split(model)
    hp = GRPOParams(loss_type=loss_type, beta=0.04, max_completion_length=4, logps_chunk_size=0,
                    epsilon_high=5.0 if loss_type == "cispo" else 0.28)
    objective = get_objective("grpo").fn
    reference = create_model(tiny_config, seed=2)
    batch = {k: jnp.asarray(v) for k, v in rollout_batch().items()}

    def summed(p, part):
        loss, metrics = objective(nnx.merge(graphdef, p), part, hp, reference=reference)
        return loss * metrics["loss"].count, metrics["loss"].count

    full_grads, full_count = jax.grad(summed, has_aux=True)(params, batch)
    grads, count = None, 0.0
    for rows in (slice(0, 3), slice(3, 8)):
        g, c = jax.grad(summed, has_aux=True)(params, {k: v[rows] for k, v in batch.items()})
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        count += c
    assert float(count) == pytest.approx(float(full_count))
    split = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)]) / float(count)
    whole = np.concatenate([np.ravel(g) for g in jax.tree.leaves(full_grads)]) / float(full_count)
    assert np.max(np.abs(split - whole)) <= 1e-5 * np.max(np.abs(whole))  # float32 sums in another order


def grouped_rollout_batch(seed=0, groups=2, size=4, prompt=6, completion=5, vocab=128):
    """``rollout_batch`` as the trainer makes it: each group's rows start with the same left-padded prompt."""
    rng = np.random.default_rng(seed)
    batch = rollout_batch(seed, groups * size, prompt, completion, vocab)
    for g in range(groups):
        rows = slice(g * size, (g + 1) * size)
        pad = rng.integers(0, prompt - 1)  # left padding of this group's prompt
        batch["tokens"][rows, :prompt] = np.where(np.arange(prompt) < pad, 0, rng.integers(3, vocab, prompt))
        batch["attention_mask"][rows, :prompt] = np.arange(prompt) >= pad
    return batch


def test_group_rows_hold_each_prompt_once():
    batch = grouped_rollout_batch()
    rows = group_rows(batch["tokens"], batch["attention_mask"], batch["loss_mask"], 4, 5)
    assert rows["group_tokens"].shape == (2, 6 + 4 * 5)
    for g in range(2):
        for j in range(4):  # completion j of group g reads back with its prompt, positions and predictors
            row = g * 4 + j
            real = np.flatnonzero(batch["attention_mask"][row])
            slots = np.concatenate([real[real < 6], 6 + j * 5 + real[real >= 6] - 6])
            np.testing.assert_array_equal(rows["group_tokens"][g, slots], batch["tokens"][row, real])
            np.testing.assert_array_equal(rows["group_positions"][g, slots], np.arange(len(real)))
            np.testing.assert_array_equal(rows["group_predictor_index"][g, slots[1:]], slots[:-1])
            assert set(rows["group_segment_ids"][g, slots[slots >= 6]]) <= {j + 1}
            assert set(rows["group_prefix_ids"][g, slots[slots >= 6]]) <= {5}


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_group_layout_attention_equals_the_general_mask(tiny_config, softcap):
    """``group_layout``: attention per block (prompt; each completion over prompt + itself) gives the general
    segment / prefix mask's hidden states at every real token and its gradients."""
    config = tiny_config.replace(attn_softcap=softcap)
    batch = grouped_rollout_batch(seed=3)
    rows = {k: jnp.asarray(v) for k, v in
            group_rows(batch["tokens"], batch["attention_mask"], batch["loss_mask"], 4, 5).items()}
    graphdef, params = nnx.split(create_model(config, seed=1))
    real = rows["group_attention_mask"][:, :, None] > 0

    def hidden(p, layout):
        out, _ = nnx.merge(graphdef, p).hidden_states(
            rows["group_tokens"], rows["group_attention_mask"], segment_ids=rows["group_segment_ids"],
            prefix_ids=rows["group_prefix_ids"], positions=rows["group_positions"], group_layout=layout)
        return jnp.where(real, out, 0.0)

    np.testing.assert_allclose(hidden(params, (6, 4, 5)), hidden(params, None), atol=1e-5)
    weights = jnp.asarray(np.random.default_rng(0).normal(size=(2, 26, config.hidden_size)), jnp.float32)
    grads = [jax.grad(lambda p, layout=layout: jnp.sum(hidden(p, layout) * weights))(params)
             for layout in ((6, 4, 5), None)]
    for x, y in zip(*(jax.tree.leaves(g) for g in grads), strict=True):  # float32 sums in another order
        np.testing.assert_allclose(x, y, atol=1e-5 * float(jnp.max(jnp.abs(y))))
    with pytest.raises(ValueError, match="does not describe rows of 26 slots"):
        hidden(params, (6, 4, 4))


@pytest.mark.parametrize("hp", [dict(loss_type="dapo", beta=0.04), dict(loss_type="grpo",
                                                                        importance_sampling_level="sequence")])
def test_shared_prefix_groups_give_the_repeated_prompt_loss_and_gradients(tiny_config, hp):
    model, reference = create_model(tiny_config, seed=1), create_model(tiny_config, seed=2)
    graphdef, params = nnx.split(model)
    hp = GRPOParams(**hp, max_completion_length=5, logps_chunk_size=0)
    objective = get_objective("grpo").fn
    batch = grouped_rollout_batch()
    shared = {**batch, **group_rows(batch["tokens"], batch["attention_mask"], batch["loss_mask"], 4, 5)}

    def loss(p, b):
        value, metrics = objective(nnx.merge(graphdef, p), {k: jnp.asarray(v) for k, v in b.items()}, hp,
                                   reference=reference)
        return value, metrics

    (a, metrics_a), grads_a = jax.value_and_grad(loss, has_aux=True)(params, batch)
    (b, metrics_b), grads_b = jax.value_and_grad(loss, has_aux=True)(params, shared)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    for key in metrics_a:
        np.testing.assert_allclose(metrics_b[key].value, metrics_a[key].value, rtol=1e-5, atol=1e-6)
    for x, y in zip(jax.tree.leaves(grads_b), jax.tree.leaves(grads_a), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6)


def final_params(workdir):
    model, _, step = restore_model(workdir)
    return step, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("grpo") / "run"
    summary = train(grpo_config(workdir))
    return workdir, summary


@pytest.mark.slow  # end to end; the default suite keeps its parts
def test_grpo_run_end_to_end(uninterrupted, tmp_path):
    workdir, summary = uninterrupted
    assert summary["step"] == 4 and (workdir / "sft" / "hf" / "config.json").exists()  # trained SFT first
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    for key in ("loss", "reward", "reward_std", "frac_reward_zero_std", "completion/mean_length",
                "completion/clipped_ratio", "clip_ratio/region_mean", "rollout_tokens_per_s", "train_tokens_per_s",
                "rewards/exact_number/mean", "grad_norm"):
        assert key in train_rows[-1], key
    assert [r["step"] for r in rows if r["split"] == "eval"] == [0, 2, 4]
    samples = [json.loads(line) for line in (workdir / "samples.jsonl").read_text().splitlines()]
    assert samples and len(samples[0]["completions"]) == 4 and "What is" in samples[0]["prompt"]
    assert (workdir / "curves.png").stat().st_size > 0
    out = export(workdir, tmp_path / "hf")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)  # loads in transformers


@pytest.mark.slow  # end to end; the default suite keeps its parts
def test_a_shared_prefix_run_equals_the_repeated_prompt_run(uninterrupted, tmp_path, capsys):
    reference_dir, _ = uninterrupted  # 4 groups over 8 data shards: "auto" trains a row per completion
    workdir = tmp_path / "run"
    summary = train(grpo_config(workdir, "--config.mesh.data=4", "--config.mesh.tensor=2"))  # 4 groups: 4 shards
    assert summary["step"] == 4
    assert "shared prefix: on" in capsys.readouterr().out  # "auto" (the default) groups short completions
    (_, a), (_, b) = final_params(workdir), final_params(reference_dir)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, atol=2e-5)


@pytest.mark.slow  # end to end; the default suite keeps its parts
def test_grpo_resume_equals_the_uninterrupted_run(uninterrupted, tmp_path):
    reference_dir, _ = uninterrupted
    workdir = tmp_path / "run"
    train(grpo_config(workdir, "--config.train.steps=2"))  # stops at the checkpoint of step 2
    summary = train(grpo_config(workdir))  # the same command with the full length resumes
    assert summary["step"] == 4
    (step_a, a), (step_b, b) = final_params(workdir), final_params(reference_dir)
    assert step_a == step_b == 4
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    keys = [(r["step"], r["split"]) for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())]
    assert len(keys) == len(set(keys))


@pytest.mark.slow  # end to end
def test_grpo_resumes_across_a_change_of_layer_layout(uninterrupted, tmp_path):
    """Cut while scanned (its checkpoint written per layer), resumed unrolled: the uninterrupted run's weights."""
    reference_dir, _ = uninterrupted
    workdir = tmp_path / "run"
    train(grpo_config(workdir, "--config.train.steps=2", "--config.model.scan_layers=true"))
    summary = train(grpo_config(workdir, "--config.model.scan_layers=false"))
    assert summary["step"] == 4 and not (workdir / "broken-checkpoints").exists()
    (_, a), (_, b) = final_params(workdir), final_params(reference_dir)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_group_rows_cost_is_the_flop_count_of_each_layout(tiny_config):
    weights, per_score = tiny_config.flops_per_token(0), tiny_config.flops_per_token(1) - tiny_config.flops_per_token(0)
    separate, grouped = group_rows_cost(tiny_config, 8, 100, 4)
    assert separate == 8 * (104 * weights + 104**2 * per_score)
    assert grouped == 132 * weights + (100**2 + 8 * 4 * 104) * per_score  # per block (GroupLayout)
    assert group_rows_cost(tiny_config, 8, 4, 100)[1] < group_rows_cost(tiny_config, 8, 4, 100)[0]  # never more
    kernel = dataclasses.replace(tiny_config, attention_impl="pallas")  # attention over the whole row
    separate, grouped = group_rows_cost(kernel, 8, 100, 4)
    assert grouped == 132 * weights + 132**2 * per_score < separate  # long prompt, short completions: pays
    separate, grouped = group_rows_cost(kernel, 8, 4, 100)
    assert grouped > separate  # long completions: one row's attention over all of them costs more


def test_flops_per_token_counts_the_routed_experts_and_the_head_not_the_lookup(tiny_config):
    untied = dataclasses.replace(tiny_config, tie_word_embeddings=False)
    d, v = untied.hidden_size, untied.vocab_size
    assert untied.flops_per_token(0) == 6 * (untied.num_params() - v * d)
    moe = dataclasses.replace(untied, architecture="mixtral", num_experts=4, num_experts_per_tok=2)
    unused = moe.num_layers * 3 * d * moe.moe_intermediate_size * 2
    assert moe.flops_per_token(0) == 6 * (moe.num_params() - v * d - unused)
    heads = untied.num_layers * untied.num_heads * untied.head_dim
    assert untied.flops_per_token(10) - untied.flops_per_token(0) == 12 * heads * 10


@pytest.mark.parametrize(("given", "kept"), [("auto", "auto"), (True, True), ("true", True), ("False", False)])
def test_shared_prefix_is_auto_true_or_false(given, kept):
    assert GRPOParams().shared_prefix == "auto"
    assert GRPOParams(shared_prefix=given).shared_prefix == kept
    with pytest.raises(ValueError, match="shared_prefix='always'; choose auto, true or false"):
        GRPOParams(shared_prefix="always")


@pytest.mark.parametrize(("prompt", "overrides", "expected"), [
    (64, ["--config.mesh.data=4"], True),  # long prompts, 4 groups over 4 shards: grouped
    (8, ["--config.mesh.data=4", "--config.objective.params.max_completion_length=512",
         "--config.model.attention_impl=pallas"],
     False),  # the kernel's attention spans the row: with long completions 4 rows cost less
    (8, ["--config.mesh.data=4", "--config.objective.params.max_completion_length=512"],
     True),  # the dense path's per-block attention: grouped never costs more
    (64, ["--config.mesh.data=8"], False),  # 4 groups do not split over 8 shards
])
def test_auto_shared_prefix_weighs_the_layout_and_the_cost(prompt, overrides, expected):
    from jaxalign.rl.trainer import GRPORun
    from jaxalign.train.build import model_config

    spec = validate(grpo_config("/never", *overrides, "--config.mesh.tensor=-1"), num_devices=8)
    logged = []
    run = SimpleNamespace(hp=spec.objective.params, processes=1, prompt_ids=np.zeros((3, prompt), np.int32),
                          engine=SimpleNamespace(model_config=model_config(spec)))
    assert GRPORun.group_layout(run, spec, logged.append) is expected
    assert logged[0].startswith(f"shared prefix: {'on' if expected else 'off'} (")


@pytest.mark.parametrize(("overrides", "message"), [
    (["--config.train.batch_size=32"], "a GRPO step trains on prompts_per_step x num_generations"),
    (["--config.objective.params.loss_type=dapo", "--config.objective.params.importance_sampling_level=sequence"],
     "needs loss_type='grpo'"),
    (["--config.objective.params.num_generations=1", "--config.train.batch_size=4"], "num_generations must be >= 2"),
    (["--config.objective.params.beta=0.1", "--config.reference.kind=precomputed"], "cannot serve GRPO"),
    (["--config.objective.params.stop_strings=[1, 2]"], "stop_strings=.* a JSON list must hold non-empty strings"),
    (["--config.objective.params.sampling_correction=token"], "sampling_correction='token'; choose one of"),
    (["--config.objective.params.temperature=0"], "temperature > 0"),
    (["--config.objective.params.rollout_weights=fp8"], "rollout_weights='fp8'; choose one of"),
    (["--config.objective.params.shared_prefix=True"], "make 4 groups of num_generations=4, which must be a whole "
                                                       "number divisible by the 8 data-parallel shards"),
    (["--config.objective.params.shared_prefix=True", "--config.objective.params.steps_per_generation=8",
      "--config.train.batch_size=2"], "prompts_per_step=4 must be a multiple of steps_per_generation=8"),
])
def test_bad_grpo_configs_are_refused(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        validate(grpo_config(tmp_path / "never", *overrides), num_devices=8)


@pytest.mark.slow
def test_grpo_kill9_mid_run_then_resume_equals_the_uninterrupted_run(uninterrupted, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    reference_dir, _ = uninterrupted
    workdir = tmp_path / "killed"
    command = [sys.executable, "-m", "jaxalign.cli", "train", "--config", "grpo", *GRPO,
               "--config.train.save_every=1", f"--config.workdir={workdir}"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while not (workdir / "checkpoints" / "2").exists():  # killed after its second GRPO step's checkpoint
        assert process.poll() is None and time.time() < deadline, process.stdout.read()[-3000:]
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "resumed from" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    (step_a, a), (step_b, b) = final_params(workdir), final_params(reference_dir)
    assert step_a == step_b == 4
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_dynamic_sampling_keeps_groups_with_unequal_rewards_first():
    from jaxalign.rl.trainer import Rollouts, select_groups

    def part(totals, tag):
        totals = np.asarray(totals, np.float32)
        n = len(totals)
        return Rollouts({"tokens": np.full((n, 3), tag)}, [f"{tag}{i}" for i in range(n)], ["p"] * n,
                        totals[:, None], totals, totals - totals.mean(), np.ones(n, int), np.zeros(n), 1.0)

    first = part([1, 1, 0, 1, 0, 0, 0, 0], 1)  # groups of 2: [1,1] equal, [0,1] mixed, [0,0] equal, [0,0] equal
    second = part([0, 1, 1, 1, 1, 0, 0, 0], 2)  # mixed, equal, mixed, equal
    chosen = select_groups([first, second], 4, 2)
    assert chosen.texts == ["12", "13", "20", "21", "24", "25", "10", "11"]  # 3 mixed groups, then an equal one
    assert chosen.batch["tokens"].shape == (8, 3) and chosen.seconds == 2.0


def test_dynamic_sampling_run_logs_its_refills(tmp_path):
    summary = train(grpo_config(tmp_path / "run", "--config.train.steps=2", "--config.eval.generate=0",
                                "--config.objective.params.dynamic_sampling=True",
                                "--config.objective.params.sft_steps=0"))
    assert summary["step"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("dynamic_sampling/refills" in r for r in rows if r["split"] == "train")


def test_plan_counts_the_rollout_kv_cache():
    from jaxalign.plan import plan

    config = load_config("grpo", ["--config.objective.params.num_iterations=2"])
    result = plan(config, 1)
    hp, arch = config.objective.params, config.model.shape
    head_dim = arch.hidden_size // arch.num_heads
    expected = 2 * arch.num_layers * 16 * 8 * 128 * arch.num_kv_heads * head_dim * 4  # 64 + 8 tokens -> bucket 128
    assert result.bytes["rollout KV cache"] == expected
    assert result.bytes["old log-probs"] == 128 * (64 + hp.max_completion_length) * 4
    assert result.sequence_length == 64 + hp.max_completion_length


def test_a_prompt_longer_than_max_length_is_an_error_naming_the_record(tmp_path):
    with pytest.raises(ValueError, match=r"train_arithmetic.jsonl, record \d+: the prompt takes \d+ tokens, over "
                                         r"data.max_length=16"):
        train(grpo_config(tmp_path / "run", "--config.data.max_length=16", "--config.objective.params.sft_steps=0"))


def test_sft_share_keeps_the_sft_questions_out_of_grpo(tmp_path):
    from jaxalign.rl.trainer import in_sft_share

    workdir = tmp_path / "run"
    train(grpo_config(workdir, "--config.objective.params.sft_share=0.5", "--config.train.steps=2",
                      "--config.eval.generate=0"))
    sft_rows = [json.loads(line) for line in (workdir / "data" / "sft_share.jsonl").read_text().splitlines()]
    assert sft_rows and all(in_sft_share(r, 0.5) for r in sft_rows)
    sampled = [json.loads(line) for line in (workdir / "samples.jsonl").read_text().splitlines()]
    questions = {r["messages"][0]["content"] for r in sft_rows}
    assert sampled and not any(q in s["prompt"] for s in sampled for q in questions)


def test_stop_strings_parse_one_string_or_a_json_list():
    assert GRPOParams(stop_strings="[END]").stops == ("[END]",)
    assert GRPOParams(stop_strings="\n\n").stops == ("\n\n",)
    assert GRPOParams(stop_strings='["a", "User:"]').stops == ("a", "User:")
    assert GRPOParams(stop_strings=["a", "b"]).stops == ("a", "b")  # a list from the command line
    with pytest.raises(ValueError, match="neither one string nor a JSON list"):
        GRPOParams(stop_strings='["a", "b"')


def test_stop_strings_and_the_sampling_correction_in_a_run(tmp_path):
    workdir = tmp_path / "run"
    summary = train(grpo_config(workdir, "--config.train.steps=2", "--config.eval.generate=0",
                                "--config.objective.params.sft_steps=40", "--config.objective.params.samples_every=1",
                                "--config.objective.params.max_completion_length=6",
                                '--config.objective.params.stop_strings=["1", "="]',
                                "--config.objective.params.sampling_correction=token_truncate",
                                "--config.objective.params.temperature=0.8"))
    assert summary["step"] == 2
    completions = [c for line in (workdir / "samples.jsonl").read_text().splitlines()
                   for c in json.loads(line)["completions"]]
    cut = [c for c in completions if "1" in c or "=" in c]
    assert cut and all(c.endswith(("1", "=")) and c.count("1") + c.count("=") == 1 for c in cut)  # ends at a stop
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    for row in train_rows:  # the sampler and the trainer are the same model in the same dtype: weights ~ 1
        assert row["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
        assert row["entropy"] > 0


def test_rollouts_with_int8_weights_train_with_recomputed_old_logps(tmp_path):
    from jaxalign.objectives import make_params

    assert make_params("grpo", {"rollout_weights": "bfloat16"}).recompute_old_logps
    workdir = tmp_path / "run"
    summary = train(grpo_config(workdir, "--config.train.steps=2", "--config.eval.generate=0",
                                "--config.objective.params.sft_steps=40",
                                "--config.objective.params.rollout_weights=int8",
                                "--config.objective.params.sampling_correction=token_truncate"))
    assert summary["step"] == 2
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    ratios = [r["sampling/importance_sampling_ratio/mean"] for r in rows if r["split"] == "train"]
    assert ratios and all(np.isfinite(ratios))
    assert any(abs(ratio - 1.0) > 1e-4 for ratio in ratios)  # int8 rollouts: the sampler is not the policy
    with pytest.raises(ConfigError, match="rollout_weights='int8' decodes merged weights"):
        validate(grpo_config(tmp_path / "lora", "--config.objective.params.rollout_weights=int8",
                             "--config.lora.enabled=True", "--config.model.path=somewhere"), num_devices=1)
