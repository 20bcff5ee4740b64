"""Model-level GPU benchmark: jaxalign vs PyTorch transformers, side by side in one run.

Measures, on one accelerator:
  1. the bf16 matmul peak (8192^3, JAX) used as the MFU denominator;
  2. logit parity of jaxalign vs transformers on the GPU (random tiny Llama, float32, highest precision);
  3. train-step throughput (forward + backward + AdamW, next-token cross-entropy, f32 params, bf16 compute)
     of jaxalign (einsum attention and cuDNN attention) and of transformers (f32 params, bf16 autocast,
     SDPA attention, fused AdamW) on the same config, batch and length; MFU for each;
  4. greedy generation throughput (batch 1 and 8) of jaxalign.sampling.generate vs transformers generate.

Each section prints one JSON line and appends it to --out (JSON lines) as soon as it finishes, so a run cut
short still reports what it measured. `--smoke` runs tiny shapes on CPU to check the script itself.

Model FLOPs per token follow the PaLM formula 6 * N + 12 * L * H * hd * T, where N counts every parameter
except an untied input-embedding table (a tied table counts once, as the LM head) and T is the sequence length.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxalign.models import LlamaConfig, create_model, load_hf
from jaxalign.sampling import generate

SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, tie_word_embeddings=True, rope_theta=100000.0),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                     num_kv_heads=8, tie_word_embeddings=True, rope_theta=500000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2),
}


def emit(out_path: str, record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(out_path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def timed(fn, reps: int) -> float:
    """Median seconds per call after one warm-up call (fn must block until done)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def matmul_peak(size: int, reps: int) -> float:
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    seconds = timed(lambda: f(a, b).block_until_ready(), reps)
    return 2 * size**3 / seconds


def parity_check(tmp: str) -> dict:
    import torch
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf = HFConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    ref = LlamaForCausalLM(hf).eval()
    ref.save_pretrained(tmp)
    tokens = np.random.RandomState(0).randint(0, 256, (2, 32))
    mask = np.ones_like(tokens)
    mask[1, :7] = 0
    with torch.no_grad():
        expected = ref(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(jax.jit(lambda m, t, a: m(t, a))(load_hf(tmp), jnp.asarray(tokens), jnp.asarray(mask)))
    return {"max_abs_dlogit": float(np.abs(got - expected)[mask == 1].max()), "device": str(jax.devices()[0])}


def jax_train_step_time(cfg: LlamaConfig, batch: int, seq: int, reps: int) -> tuple[float, float]:
    model = create_model(cfg, seed=0)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size)

    @nnx.jit(donate_argnums=(0, 1))
    def step(model, optimizer, tokens):
        def loss_fn(model):
            logits = model(tokens).astype(jnp.float32)
            logps = jax.nn.log_softmax(logits[:, :-1], axis=-1)
            return -jnp.take_along_axis(logps, tokens[:, 1:, None], axis=-1).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    start = time.perf_counter()
    step(model, optimizer, tokens).block_until_ready()
    compile_s = time.perf_counter() - start
    seconds = timed(lambda: step(model, optimizer, tokens).block_until_ready(), reps)
    return seconds, compile_s


def torch_train_step_time(cfg: LlamaConfig, batch: int, seq: int, reps: int) -> float:
    import torch
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    hf = HFConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, tie_word_embeddings=cfg.tie_word_embeddings,
                  rope_theta=cfg.rope_theta, attn_implementation="sdpa")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = LlamaForCausalLM(hf).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    return timed(step, reps)


def empty_torch_cache() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def generation(cfg: LlamaConfig, batch: int, prompt_len: int, new_tokens: int) -> dict:
    import torch
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    model = create_model(cfg, seed=0)
    prompts = np.random.RandomState(0).randint(0, cfg.vocab_size, (batch, prompt_len))
    jax_s = timed(lambda: np.asarray(generate(model, prompts, max_new_tokens=new_tokens)), 2)
    hf = HFConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, tie_word_embeddings=cfg.tie_word_embeddings,
                  rope_theta=cfg.rope_theta)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ref = LlamaForCausalLM(hf).to(device=device, dtype=dtype).eval()
    inputs = torch.tensor(prompts, device=device)

    def torch_generate():
        with torch.no_grad():
            ref.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()

    torch_s = timed(torch_generate, 2)
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "jaxalign_tok_s": batch * new_tokens / jax_s, "transformers_tok_s": batch * new_tokens / torch_s,
            "speedup": torch_s / jax_s}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="model_gpu.jsonl")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, to test the script")
    parser.add_argument("--only", default="", help="comma list of shape:impl train runs (default: all), "
                                                   "impl in transformers|xla|cudnn; skips parity and generation")
    args = parser.parse_args()
    smoke = args.smoke
    reps = 2 if smoke else 10

    def section(name, fn):
        start = time.perf_counter()
        try:
            record = {"section": name, **fn()}
        except Exception as err:  # a failed section must not lose the others
            record = {"section": name, "error": f"{type(err).__name__}: {err}",
                      "trace": traceback.format_exc()[-1500:]}
        record["wall_s"] = round(time.perf_counter() - start, 1)
        emit(args.out, record)
        return record

    peak = section("matmul_peak", lambda: {"bf16_tflops": matmul_peak(512 if smoke else 8192, reps) / 1e12,
                                           "device": jax.devices()[0].device_kind, "jax": jax.__version__})
    peak_flops = peak.get("bf16_tflops", float("nan")) * 1e12
    if not args.only:
        section("parity", lambda: parity_check("/tmp/jaxalign_parity"))

    runs = ([("tiny", 4, 64)] if smoke else [("smollm2-135m", 16, 2048), ("llama-1b", 8, 1024)])
    dtype = "float32" if smoke else "bfloat16"
    impls = ["transformers"] + (["xla"] if smoke else ["xla", "cudnn"])
    # PyTorch first: JAX's allocator keeps the memory it has used, PyTorch's gives it back.
    for impl in impls:
        for shape, batch, seq in runs:
            if args.only and f"{shape}:{impl}" not in args.only.split(","):
                continue
            cfg = LlamaConfig(**SHAPES[shape], dtype=dtype, param_dtype="float32",
                              attention_impl="xla" if impl == "transformers" else impl)

            def run(cfg=cfg, batch=batch, seq=seq, shape=shape, impl=impl):
                record = {"shape": shape, "batch": batch, "seq": seq}
                if impl == "transformers":
                    seconds = torch_train_step_time(cfg, batch, seq, reps)
                    empty_torch_cache()
                    record["impl"] = "transformers/sdpa+autocast"
                else:
                    seconds, record["compile_s"] = jax_train_step_time(cfg, batch, seq, reps)
                    record["impl"] = f"jaxalign/{impl}"
                tokens_s = batch * seq / seconds
                return {**record, "step_s": seconds, "tokens_s": tokens_s,
                        "mfu": tokens_s * cfg.flops_per_token(seq) / peak_flops}

            section("train_step", run)

    gen_cfg = LlamaConfig(**SHAPES["tiny" if smoke else "smollm2-135m"], dtype=dtype, param_dtype=dtype)
    for batch in () if args.only else (1, 8):
        section("generate", lambda batch=batch: generation(gen_cfg, batch, 16 if smoke else 128,
                                                           8 if smoke else 128))


if __name__ == "__main__":
    main()
