"""From a training run's checkpoint to a Hugging Face folder (safetensors + config + tokenizer).

A LoRA run's checkpoint holds the adapters only; its base comes back from ``model.path`` (or, for the random toy
preset, from the seed), and the export either folds the adapters into the weights or writes a PEFT adapter
folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxalign.models import LlamaConfig, RopeScaling, abstract_model, create_model, load_pretrained, lora, save_hf
from jaxalign.models.tokenizer import load_tokenizer
from jaxalign.parallel import make_mesh
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


def lora_of(run_dir: Path) -> lora.LoRAConfig | None:
    """The run's ``LoRAConfig``, or None for a full fine-tuning run."""
    section = json.loads((run_dir / "config.json").read_text()).get("lora") or {}
    return lora.LoRAConfig.from_config(section) if section.get("enabled") else None


def base_weights(run_dir: Path, model_config: LlamaConfig) -> dict:
    """The frozen base of a LoRA run (pure dict): ``model.path`` loaded again, or the random preset recreated
    from the seed exactly as training created it (jitted, so any device count gives the same numbers)."""
    run_config = json.loads((run_dir / "config.json").read_text())
    if run_config["model"]["path"]:
        model, _ = load_pretrained(run_config["model"]["path"], dtype=model_config.dtype,
                                   config_overrides={"attention_impl": model_config.attention_impl,
                                                     "remat": model_config.remat})
    else:
        here = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.local_devices()[:1])
        with jax.set_mesh(here):
            model = create_model(model_config, seed=run_config["seed"], mesh=here)
    return nnx.to_pure_dict(nnx.state(model))


def restore_model(checkpoint: str | Path):
    """(model, tokenizer, step) restored from a run's checkpoint (the latest unless a step folder is given).

    For a LoRA run the model is the base with the trained adapters attached."""
    run_dir, step = run_dir_of(checkpoint)
    model_config = load_model_config(run_dir)
    optim_config = _optim_from_json(run_dir)
    steps = json.loads((run_dir / "config.json").read_text())["train"]["steps"]
    tx, _ = make_optimizer(optim_config, steps)
    lora_config = lora_of(run_dir)
    if lora_config is None:
        graphdef, state = nnx.split(abstract_model(model_config))
    else:
        graphdef, state, _ = nnx.split(lora.abstract_lora_model(model_config, lora_config), nnx.LoRAParam, ...)
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
    model = nnx.merge(graphdef, params) if lora_config is None else nnx.merge(
        graphdef, base_weights(run_dir, model_config), params)
    return model, load_tokenizer(run_dir / "tokenizer"), step


def _optim_from_json(run_dir: Path):
    import ml_collections

    return ml_collections.ConfigDict(json.loads((run_dir / "config.json").read_text())["optim"])


def export(checkpoint: str | Path, out: str | Path, *, adapter: bool = False) -> Path:
    """Writes a run's checkpoint as a Hugging Face folder. A LoRA run's adapters are folded into the weights
    (``W + (α/r)·A·B``), or, with ``adapter=True``, written as a PEFT adapter folder (``adapter_config.json`` +
    ``adapter_model.safetensors``) whose ``base_model_name_or_path`` is the run's ``model.path``; a random toy
    base is saved next to it as ``base/`` and named instead."""
    run_dir, _ = run_dir_of(checkpoint)
    lora_config = lora_of(run_dir)
    model, tokenizer, _ = restore_model(checkpoint)
    out = Path(out)
    if not adapter:
        save_hf(model if lora_config is None else lora.merge_weights(model), out, tokenizer=tokenizer)
        return out
    if lora_config is None:
        raise ValueError(f"{run_dir}: not a LoRA run (lora.enabled is false), so there is no adapter to export; "
                         "export the full model without --adapter")
    base_path = json.loads((run_dir / "config.json").read_text())["model"]["path"]
    if not base_path:
        base_path = str((out / "base").resolve())
        save_hf(lora.without_adapters(model), base_path, tokenizer=tokenizer)
    return lora.save_peft(model, lora_config, out, base_model=str(Path(base_path).resolve()), tokenizer=tokenizer)
