"""From a training run's checkpoint to a Hugging Face folder (safetensors + config + tokenizer).

The checkpoint is restored by the builder (``jaxalign.train.build.restore_model``). A LoRA run's checkpoint holds
the adapters only; its base comes back from ``model.path`` (or, for the random toy preset, from the seed), and the
export either folds the adapters into the weights or writes a PEFT adapter folder.
"""

from __future__ import annotations

from pathlib import Path

from jaxalign.hub import is_repo_id
from jaxalign.models import lora, save_hf
from jaxalign.train.build import restore_model, run_dir_of, run_spec_of

__all__ = ["export", "restore_model", "run_dir_of"]


def export(checkpoint: str | Path, out: str | Path, *, adapter: bool = False, log=None) -> Path:
    """Writes a run's checkpoint as a Hugging Face folder. A LoRA run's adapters are folded into the weights
    (``W + (α/r)·A·B``), or, with ``adapter=True``, written as a PEFT adapter folder (``adapter_config.json`` +
    ``adapter_model.safetensors``) whose ``base_model_name_or_path`` is the run's ``model.path``; a random toy
    base is saved next to it as ``base/`` and named instead. The checkpoint is the newest that verifies
    (``log`` is told which)."""
    run_dir, _ = run_dir_of(checkpoint)
    spec = run_spec_of(run_dir)
    lora_config = spec.lora.config()
    model, tokenizer, _ = restore_model(checkpoint, log=log)
    out = Path(out)
    if not adapter:
        save_hf(model if lora_config is None else lora.merge_weights(model), out, tokenizer=tokenizer)
        return out
    if lora_config is None:
        raise ValueError(f"{run_dir}: not a LoRA run (lora.enabled is false), so there is no adapter to export; "
                         "export the full model without --adapter")
    base_path = spec.model.path
    if not base_path:
        base_path = str((out / "base").resolve())
        save_hf(lora.without_adapters(model), base_path, tokenizer=tokenizer)
    base_model = base_path if is_repo_id(base_path) else str(Path(base_path).resolve())
    return lora.save_peft(model, lora_config, out, base_model=base_model, tokenizer=tokenizer)
