"""From a training run's checkpoint to a Hugging Face folder (safetensors + config + tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxalign.models import LlamaConfig, RopeScaling, abstract_model, save_hf
from jaxalign.models.tokenizer import load_tokenizer
from jaxalign.train.step import TrainState, init_state, make_optimizer


def run_dir_of(checkpoint: str | Path) -> tuple[Path, int | None]:
    """(run folder, step or None for the latest) from a run folder, its checkpoints/ folder or a step folder."""
    path = Path(checkpoint).resolve()
    if (path / "model_config.json").exists():
        return path, None
    if (path.parent / "model_config.json").exists() and path.name == "checkpoints":
        return path.parent, None
    if path.name.isdigit() and (path.parent.parent / "model_config.json").exists():
        return path.parent.parent, int(path.name)
    raise FileNotFoundError(f"{checkpoint}: not a jaxalign run folder (expected model_config.json, written by "
                            "`jaxalign train`, in it or above it)")


def load_model_config(run_dir: Path) -> LlamaConfig:
    values = json.loads((run_dir / "model_config.json").read_text())
    values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
    values["sliding_window_layers"] = tuple(values["sliding_window_layers"])
    if isinstance(values.get("eos_token_id"), list):
        values["eos_token_id"] = tuple(values["eos_token_id"])
    return LlamaConfig(**values)


def restore_model(checkpoint: str | Path):
    """(model, tokenizer, step) restored from a run's checkpoint (the latest unless a step folder is given)."""
    run_dir, step = run_dir_of(checkpoint)
    model_config = load_model_config(run_dir)
    optim_config = _optim_from_json(run_dir)
    steps = json.loads((run_dir / "config.json").read_text())["train"]["steps"]
    tx, _ = make_optimizer(optim_config, steps)
    graphdef, state = nnx.split(abstract_model(model_config))
    abstract_params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))
    # Restored onto this process's first device, whatever mesh (or number of hosts) wrote the checkpoint.
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here),
                          jax.eval_shape(lambda p: init_state(p, tx, 0, None), abstract_params))
    manager = ocp.CheckpointManager(run_dir / "checkpoints")
    step = manager.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"{run_dir / 'checkpoints'}: no checkpoint to export")
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    params = TrainState(*restored.state).params
    return nnx.merge(graphdef, params), load_tokenizer(run_dir / "tokenizer"), step


def _optim_from_json(run_dir: Path):
    import ml_collections

    return ml_collections.ConfigDict(json.loads((run_dir / "config.json").read_text())["optim"])


def export(checkpoint: str | Path, out: str | Path) -> Path:
    model, tokenizer, _ = restore_model(checkpoint)
    save_hf(model, out, tokenizer=tokenizer)
    return Path(out)
