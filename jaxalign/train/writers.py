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

    (Path(workdir) / "config.json").write_text(json.dumps(effective, indent=2))
    hf_tokenizer.save_pretrained(str(Path(workdir) / "tokenizer"))
    write_model_config(Path(workdir), model_config)


def write_summary(workdir: str | Path, summary: dict) -> dict:
    """``summary.json`` in the run folder (process 0); returns ``summary``."""
    if jax.process_index() == 0:
        (Path(workdir) / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
