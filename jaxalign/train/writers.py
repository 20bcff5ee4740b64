"""Where metrics go: JSONL (always), TensorBoard event files, Weights & Biases (optional), a PNG of the curves.

Only process 0 writes; other processes get a writer that does nothing.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax


class MetricWriter:
    def __init__(self, workdir: str | Path, *, tensorboard: bool = True, wandb: bool = False,
                 wandb_project: str = "jaxalign", config: dict | None = None):
        self.enabled = jax.process_index() == 0
        self.path = Path(workdir) / "metrics.jsonl"
        self._tb = self._wandb = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(workdir) / "tensorboard"))
        if wandb:
            try:
                import wandb as wandb_module
            except ImportError as err:
                raise ImportError("logging.wandb=True needs the wandb package (pip install wandb)") from err
            self._wandb = wandb_module.init(project=wandb_project, config=config, dir=str(workdir))

    def write(self, step: int, metrics: dict[str, float], prefix: str = "train") -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": step, "split": prefix, **clean}) + "\n")
        if self._tb is not None:
            for name, value in clean.items():
                self._tb.add_scalar(f"{prefix}/{name}", value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"{prefix}/{k}": v for k, v in clean.items()}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def progress_bar(total: int, initial: int):
    """A tqdm bar on process 0 when stderr is a terminal, else None (the loop then prints log lines)."""
    if not sys.stderr.isatty() or jax.process_index() != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, dynamic_ncols=True)


def console_line(step: int, steps: int, values: dict[str, float], headline: tuple[str, ...], eta: float) -> str:
    """``step 25/600 loss 0.6931 rewards/margins 0.0123 ... tokens/s 1234 ETA 40s`` (the objective's headline
    metrics, from the registry)."""
    shown = "".join(f" {name} {values[name]:.4f}" for name in headline if name in values)
    return f"step {step}/{steps}{shown} tokens/s {values['tokens_per_s']:.0f} ETA {eta:.0f}s"


def show(line: str, progress, log) -> None:
    """On the progress bar when there is one (the part after the step), else as a log line."""
    if progress is not None:
        progress.set_postfix_str(line.split(" ", 2)[2])
    else:
        log(line)


def write_run_files(workdir: str | Path, effective: dict, hf_tokenizer, model_config) -> None:
    """What a run folder says about its run (process 0): ``config.json`` (every effective value), ``tokenizer/``
    and ``model_config.json``."""
    if jax.process_index() != 0:
        return
    from jaxalign.train.build import write_model_config

    atomic_write(Path(workdir) / "config.json", json.dumps(effective, indent=2))
    hf_tokenizer.save_pretrained(str(Path(workdir) / "tokenizer"))
    write_model_config(Path(workdir), model_config)


def write_summary(workdir: str | Path, summary: dict) -> dict:
    """``summary.json`` in the run folder (process 0); returns ``summary``."""
    if jax.process_index() == 0:
        atomic_write(Path(workdir) / "summary.json", json.dumps(summary, indent=2))
    return summary


def atomic_write(path: Path, text: str) -> None:
    """``text`` into ``path``, written aside and renamed: a kill mid-write leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``. A torn last line (what a kill mid-write leaves) is skipped; any other line
    that is not a JSON row is an error naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a row with an integer step")
        except ValueError as err:
            if number == len(lines):  # no newline after it: the write was cut
                break
            raise ValueError(f"{path}, line {number}: not a metrics row ({err})") from None
        rows.append(row)
    return rows


def rewind_metrics(path: str | Path, step: int, *, final: bool = False) -> int:
    """Before a run (re)starts at ``step``: drops a torn last line and every row after ``step`` (and, with
    ``final``, the closing evaluation at ``step`` itself, which the run is about to repeat), so appending never
    duplicates a step. Returns the number of rows dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    rows = read_metrics(path)
    kept = [r for r in rows if r["step"] < step or (r["step"] == step and not (final and r["split"] == "eval"))]
    if len(kept) != len(rows) or not path.read_text(errors="replace").endswith("\n"):
        atomic_write(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(rows) - len(kept)


def known_evaluations(path: str | Path) -> tuple[dict | None, dict | None]:
    """(first, last) evaluation rows in ``metrics.jsonl`` (with their ``step``), or None."""
    evals = [r for r in read_metrics(path) if r["split"] == "eval"]
    strip = lambda r: {k: v for k, v in r.items() if k != "split"}
    return (strip(evals[0]), strip(evals[-1])) if evals else (None, None)


def plot_curves(metrics_path: str | Path, out: str | Path, title: str = "", metrics: tuple[str, ...] = ("loss",),
                ) -> Path:
    """One panel per headline metric (``metrics``: the objective's, from the registry; train and eval), and one
    for held-out exact-match accuracy when present, against step. Every point is marked, so a run with one log
    step still shows its curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [r for r in rows if r["split"] == "train"]
    evals = [r for r in rows if r["split"] == "eval"]
    panels = [name for name in dict.fromkeys(("loss", *metrics)) if any(name in r for r in rows)]
    if any("accuracy" in r for r in evals):
        panels.append("accuracy")
    columns = min(len(panels), 3) or 1
    lines = -(-len(panels) // columns) or 1
    fig, axes = plt.subplots(lines, columns, figsize=(4.6 * columns, 3.6 * lines), squeeze=False)
    for ax, name in zip(axes.flat, panels, strict=False):
        scale = 100 if name == "accuracy" else 1
        for split, points, style in (("train", train, ".-"), ("eval", evals, "o-")):
            points = [r for r in points if name in r]
            if points:
                ax.plot([r["step"] for r in points], [scale * r[name] for r in points], style, label=split)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out exact match (%)" if name == "accuracy" else name)
        if name == "accuracy":
            ax.set_ylim(0, 100)
        ax.legend()
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)
