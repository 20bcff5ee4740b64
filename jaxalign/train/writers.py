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


def plot_curves(metrics_path: str | Path, out: str | Path, title: str = "") -> Path:
    """Training and eval loss, and exact-match accuracy when present, against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [r for r in rows if r["split"] == "train" and "loss" in r]
    evals = [r for r in rows if r["split"] == "eval"]
    has_accuracy = any("accuracy" in r for r in evals)
    fig, axes = plt.subplots(1, 2 if has_accuracy else 1, figsize=(11 if has_accuracy else 6, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if any("loss" in r for r in evals):
        ax.plot([r["step"] for r in evals if "loss" in r], [r["loss"] for r in evals if "loss" in r], "o-",
                label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    if has_accuracy:
        ax = axes[0][1]
        points = [r for r in evals if "accuracy" in r]
        ax.plot([r["step"] for r in points], [100 * r["accuracy"] for r in points], "o-", color="tab:green")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out exact match (%)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)
