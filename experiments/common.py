"""Shared pieces of the studies: argument parsing, training a toy model through the public trainer, and writing
results (JSON with the raw numbers, a Markdown table, PNG plots) into ``docs/results/``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from jaxalign import compilation_cache  # noqa: E402
from jaxalign.configs import base  # noqa: E402
from jaxalign.data.tokenize import as_tokenizer  # noqa: E402
from jaxalign.train import train  # noqa: E402
from jaxalign.train.export import restore_model  # noqa: E402
from jaxalign.train.writers import atomic_write  # noqa: E402

# the persistent compilation cache, as the CLI has it (docs/training.md): a study's runs share their shapes, so
# every run after the first reads its programs back (JAXALIGN_COMPILATION_CACHE=off turns it off)
compilation_cache.enable()

# model shapes: the bundled tiny preset, a smaller "small" model, and the one-layer smoke size
SHAPES = {
    "tiny": dict(vocab_size=320, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2),
    "small": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1),
    "smoke": dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1),
}


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0], epilog=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code (used by the tests)")
    p.add_argument("--out", default=str(REPO / "docs" / "results"), help="where the JSON, table and plots go")
    p.add_argument("--workdir", default="", help="training runs (default: runs/experiments/<study>)")
    p.add_argument("--seeds", default="", help="comma-separated seeds (default: the study's own)")
    p.add_argument("--sweep-seeds", default="", help="comma-separated seeds that choose each arm's learning rate "
                   "(default: the first seeds of --seeds); seeds outside --seeds tune without being evaluated, so "
                   "two evaluation seed sets can share one choice")
    return p


def rate_options(p: argparse.ArgumentParser, recorded: dict, where: str) -> None:
    """``--tune``, for a study whose published learning-rate choice is recorded in the script (``recorded``: ``{arm:
    rate}``, the choice of the sweep ``where`` names): by default every arm runs at its recorded rate, without the
    sweep's runs, and a rerun with other ``--seeds`` differs from the published set in its evaluation seeds alone;
    ``--tune`` (or ``--sweep-seeds``) runs the sweep again."""
    rates = ", ".join(f"{arm} {lr:g}" for arm, lr in recorded.items())
    p.add_argument("--tune", action="store_true", help=f"run the learning-rate sweep (on --sweep-seeds) instead of "
                   f"the rates the published sweep chose ({where}: {rates})")


def recorded_rates(args, recorded: dict) -> dict | None:
    """The rates a study runs at without a sweep, or ``None`` where it sweeps: ``--tune``, ``--sweep-seeds`` and
    ``--smoke`` (whose grid is the smoke one) sweep."""
    return None if args.tune or args.sweep_seeds or args.smoke else dict(recorded)


def rates_or_sweep(args, seeds: list[int], recorded: dict | None,
                   sweep_seeds: tuple[int, ...] | None = (100, 101)) -> tuple[dict | None, list[int]]:
    """``(rates, sweep seeds)`` of a study with recorded rates: the recorded rates and no sweep by default, else
    ``None`` and the seeds to sweep on: ``--sweep-seeds``, the first seeds at smoke size, otherwise ``sweep_seeds``
    (the published sweep's; ``None``: the first two of ``seeds``). ``recorded=None``: no choice recorded at this
    size, so it sweeps."""
    rates = None if recorded is None else recorded_rates(args, recorded)
    if rates:
        return rates, []
    if args.sweep_seeds or args.smoke or sweep_seeds is None:
        return None, sweep_seeds_of(args, seeds)
    return None, list(sweep_seeds)


def seeds_of(args, default: tuple[int, ...], smoke: tuple[int, ...] = (0,)) -> list[int]:
    if args.seeds:
        return [int(s) for s in args.seeds.split(",")]
    return list(smoke if args.smoke else default)


def sweep_seeds_of(args, seeds: list[int], count: int = 2) -> list[int]:
    """The seeds of a study's learning-rate sweep: ``--sweep-seeds``, or the first ``count`` of ``seeds``."""
    if getattr(args, "sweep_seeds", ""):
        return [int(s) for s in args.sweep_seeds.split(",")]
    return list(seeds[:count])


def workdir_of(args, study: str) -> Path:
    return Path(args.workdir) if args.workdir else REPO / "runs" / "experiments" / study


def toy_config(workdir: Path, train_path, *, objective: str = "sft", steps: int, shape: str = "tiny",
               seed: int = 0, batch_size: int = 32, lr: float = 3e-3, max_length: int = 64, warmup: int = 50,
               params: dict | None = None, eval_path: str = "", reference: str = "model", start=None):
    """A training config on local JSONL files with the toy tokenizer, no mid-run evals, quiet. ``start``: a model
    folder to fine-tune (a pretrained start or an earlier stage's export), with its own (toy) tokenizer."""
    config = base.get_config()
    config.seed = seed
    config.workdir = str(workdir)
    config.tokenizer = "toy"
    if start is not None:
        config.model.path, config.tokenizer = str(start), ""
    config.model.shape.update(SHAPES[shape])
    config.data.train = str(train_path)
    config.data.eval = str(eval_path)
    config.data.max_length = max_length
    config.objective.name = objective
    for key, value in (params or {}).items():
        config.objective.params[key] = value
    config.reference.kind = reference
    config.optim.lr = lr
    config.optim.warmup_steps = min(warmup, max(steps // 5, 1))
    config.train.update(steps=steps, batch_size=batch_size, log_every=max(steps // 4, 1), eval_every=0,
                        save_every=steps, keep_checkpoints=1, resume=False)
    config.eval.generate = 0
    config.logging.update(tensorboard=False, plot=False, progress=False)
    return config


def train_model(config):
    """Trains from scratch (a stale run folder is cleared) and returns ``(model, tokenizer, summary)``."""
    import shutil

    shutil.rmtree(config.workdir, ignore_errors=True)
    summary = train(config)
    model, tokenizer, _ = restore_model(config.workdir)
    return model, tokenizer, summary


def mean_std(values) -> tuple[float, float]:
    values = np.asarray(values, np.float64)
    return float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0


def t_interval(values) -> tuple[float, float, float]:
    """(mean, low, high): the 95 % t confidence interval of the mean (the mean alone for one value)."""
    from scipy import stats

    values = np.asarray(values, np.float64)
    mean = float(values.mean())
    if len(values) < 2:
        return mean, mean, mean
    half = float(stats.t.ppf(0.975, len(values) - 1)) * float(values.std(ddof=1)) / np.sqrt(len(values))
    return mean, mean - half, mean + half


def paired_difference(method, baseline) -> dict:
    """``method − baseline`` per seed (same seeds, same order): the mean, its 95 % t interval and the two-sided
    paired t-test's p-value. One seed has no interval (low = high = the mean) and no p-value (NaN); when every
    difference is the same non-zero number the interval has no width and p is 0 (1 when they are all 0)."""
    from scipy import stats

    diff = np.asarray(method, np.float64) - np.asarray(baseline, np.float64)
    mean, low, high = t_interval(diff)
    if len(diff) < 2:
        p = float("nan")
    elif diff.std(ddof=1) > 0:
        p = float(stats.ttest_rel(np.asarray(method, np.float64), np.asarray(baseline, np.float64)).pvalue)
    else:
        p = 0.0 if mean != 0 else 1.0
    return {"per_seed": diff.tolist(), "mean": mean, "low": low, "high": high, "p": p, "n": len(diff)}


def verdict(diff: dict) -> str:
    """For a claim "method > baseline": reproduced when the 95 % interval of the paired difference lies above 0,
    not reproduced when it lies below 0 (the opposite holds), inconclusive when it contains 0; no verdict from
    one seed (no interval)."""
    if diff["n"] < 2:
        return "no verdict (one seed)"
    if diff["low"] > 0:
        return "reproduced"
    if diff["high"] < 0:
        return "not reproduced"
    return "inconclusive"


def ci_text(values, scale: float = 1.0, digits: int = 1) -> str:
    """``mean [low, high]`` of the 95 % t interval."""
    mean, low, high = (scale * v for v in t_interval(values))
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def runs_note(runs) -> str:
    """How many training runs a study's numbers come from and their summed time (an interrupted study that is
    started again reuses finished runs, so its own wall time can be far shorter)."""
    runs = list(runs)
    return f"{len(runs)} training runs, {sum(r['seconds'] for r in runs):,.0f} s of training and evaluation summed."


def differences_table(comparisons: dict, *, scale: float = 100.0, digits: int = 1, unit: str = "points",
                      verdicts: bool = False) -> str:
    """A Markdown table of ``{name: paired_difference(...)}``, by default in points (scores in [0, 1]); with
    ``verdicts`` a last column gives each row's ``verdict``."""
    def row(name, d):
        low, high = (f"{scale * d[k]:+.{digits}f}" for k in ("low", "high"))
        cells = [name, f"{scale * d['mean']:+.{digits}f}", f"[{low}, {high}]", f"{d['p']:.3f}"]
        return [*cells, verdict(d)] if verdicts else cells

    return table(["difference", f"mean, {unit}", "95 % CI", "paired t-test p", *(["verdict"] if verdicts else [])],
                 [row(name, d) for name, d in comparisons.items()])


def tuned_arms(arms, lrs, seeds, sweep_seeds, run_one, rank=None, recorded: dict | None = None) -> dict:
    """The studies' tuning protocol. For each arm, ``run_one(arm, lr, seed)`` (a dict with ``validation``) runs at
    every learning rate of ``lrs`` (one sequence for every arm, or ``{arm: rates}``) on ``sweep_seeds``; the rate
    with the best mean validation score is the arm's choice (``rank(runs)``, a sortable value, replaces the mean
    where ties need breaking), and the arm then runs at it on the rest of ``seeds`` (the sweep's runs at that rate
    are reused). ``recorded`` (``{arm: rate}``, see ``recorded_rates``) skips the sweep: each arm runs at its
    recorded rate. Returns ``{"sweep": {arm: {lr: [run, ...]}}, "chosen": {arm: lr}, "runs": {arm: [run per seed of
    seeds]}, "every": [each run once]}`` (an empty sweep per arm with ``recorded``)."""
    sweep, chosen, runs, every = {}, {}, {}, []
    run_one = _recording(run_one, every)
    rank = rank or (lambda done: np.mean([r["validation"] for r in done]))
    for arm in arms:
        rates = lrs[arm] if isinstance(lrs, dict) else lrs
        if recorded is not None:
            sweep[arm], chosen[arm] = {}, recorded[arm]
            runs[arm] = [run_one(arm, chosen[arm], seed) for seed in seeds]
            continue
        sweep[arm] = {lr: [run_one(arm, lr, seed) for seed in sweep_seeds] for lr in rates}
        chosen[arm] = max(rates, key=lambda lr, arm=arm: rank(sweep[arm][lr]))
        done = dict(zip(sweep_seeds, sweep[arm][chosen[arm]], strict=True))
        runs[arm] = [done[seed] if seed in done else run_one(arm, chosen[arm], seed) for seed in seeds]
    return {"sweep": sweep, "chosen": chosen, "runs": runs, "every": every}


def sweep_summary(tuned: dict) -> dict:
    """``{arm: {"<lr>": [validation score per sweep seed]}}`` of a ``tuned_arms`` result (JSON keys)."""
    return {arm: {f"{lr:g}": [r["validation"] for r in runs] for lr, runs in sweep.items()}
            for arm, sweep in tuned["sweep"].items()}


def sweep_table(results: dict, labels: dict) -> str:
    """The learning-rate sweep as a Markdown table: mean validation score (%) per arm and rate, and the choice
    (``sizes["lrs"]``: one grid for every arm, or ``{arm: grid}``; a rate outside an arm's grid shows "-")."""
    lrs = results["sizes"]["lrs"]
    every = sorted({lr for grid in lrs.values() for lr in grid}) if isinstance(lrs, dict) else lrs

    def cell(arm, lr):
        scores = results["sweep"][arm].get(f"{lr:g}")
        return "-" if scores is None else f"{100 * np.mean(scores):.1f}"

    return table(["arm", *[f"lr {lr:g}" for lr in every], "chosen"],
                 [[labels[arm], *[cell(arm, lr) for lr in every], f"{results['chosen'][arm]:g}"]
                  for arm in results["chosen"]])


def sweep_section(results: dict, labels: dict, score: str = "validation exact match %") -> str:
    """The sweep's heading and table (``sweep_table``), or, for a run at the recorded rates (an empty sweep), the
    sentence that says so and names each arm's rate."""
    if not any(results["sweep"].values()):
        return ("No sweep in this run: each arm ran at the rate the published sweep chose, recorded in the script "
                "(`--tune` runs the sweep again): " + ", ".join(f"{labels[arm]} {lr:g}"
                                                             for arm, lr in results["chosen"].items()) + ".")
    return (f"Learning-rate sweep ({score}, mean of seeds {results['sweep_seeds']}, {results['sizes']['validation']} "
            f"questions):\n\n" + sweep_table(results, labels))


def _recording(run_one, every: list):
    def run(*args):
        every.append(run_one(*args))
        return every[-1]

    return run


def cached_run(path: Path, fn) -> dict:
    """``fn()``'s JSON-able result, stored at ``path``: a study interrupted and started again skips finished runs."""
    path = Path(path)
    if path.exists():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as error:  # never trusted: the run is redone only where the user says so
            raise SystemExit(f"{path}: a finished run's record that is not valid JSON ({error}); delete the file to "
                             "run it again") from None
    result = fn()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(result) + "\n")  # a study killed mid-write leaves no half-written record
    return result


def pm(values, scale: float = 1.0, digits: int = 1) -> str:
    mean, std = mean_std(np.asarray(values) * scale)
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if len(values) > 1 else f"{mean:.{digits}f}"


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def environment() -> dict:
    return {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "cpu_cores": os.cpu_count(), "devices": jax.device_count(), "backend": jax.default_backend(),
            "jax": jax.__version__, "python": platform.python_version()}


def write(out: str | Path, study: str, *, command: str, results: dict, markdown: str, started: float) -> Path:
    """``<out>/<study>.json`` (raw numbers + environment) and ``<out>/<study>.md`` (the table), printed too."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {**environment(), "command": command, "seconds": round(time.time() - started, 1)}
    used = getattr(sys.modules.get("pretrained"), "USED", {})  # the pretrained starts this study read, if any
    if used:
        meta["pretrained_weights_sha256"] = dict(used)
    (out / f"{study}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    starts = "".join(f"; start `{name}`, weights sha256 {digest}" for name, digest in used.items())
    header = f"Command: `{command}` — {meta['date']}, {meta['seconds']:.0f} s on {meta['backend']}{starts}.\n\n"
    (out / f"{study}.md").write_text(header + markdown + "\n")
    print(header + markdown, flush=True)
    return out / f"{study}.md"


def command_line(study: str, argv: list[str]) -> str:
    return " ".join(["python", f"experiments/{study}.py", *argv])


def completion_logps(model, tokenizer, prompts: list[str], completions: list[str], batch_size: int = 64):
    """``(summed log-probs [N], token counts [N])`` of each completion (ending with EOS) after its chat prompt."""
    import jax.numpy as jnp

    from jaxalign.losses import sequence_logps

    rows, spans = [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        head = as_tokenizer(tokenizer).encode_prompt(prompt)
        tail = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(head + tail)
        spans.append((len(head), len(head) + len(tail)))
    width = max(len(r) for r in rows)
    sums, counts = [], []
    for start in range(0, len(rows), batch_size):
        real = len(rows[start:start + batch_size])
        ids, mask = np.zeros((batch_size, width), np.int32), np.zeros((batch_size, width), np.int32)
        for i, (r, (lo, hi)) in enumerate(zip(rows[start:start + real], spans[start:start + real], strict=True)):
            ids[i, : len(r)], mask[i, lo:hi] = r, 1  # right-padded; the unused rows of the last batch stay empty
        total, n = sequence_logps(model(jnp.asarray(ids)), jnp.asarray(ids), jnp.asarray(mask))
        sums.extend(np.asarray(total)[:real].tolist())
        counts.extend(np.asarray(n)[:real].tolist())
    return np.asarray(sums), np.asarray(counts)


def expected_calibration_error(confidence, correct, bins: int = 10) -> float:
    confidence, correct = np.asarray(confidence, float), np.asarray(correct, float)
    edges = np.linspace(0, 1, bins + 1)
    index = np.clip(np.digitize(confidence, edges[1:-1]), 0, bins - 1)
    return float(sum(abs(confidence[index == b].mean() - correct[index == b].mean()) * (index == b).mean()
                     for b in range(bins) if (index == b).any()))
