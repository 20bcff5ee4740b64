"""Each model family added to the decoder trains end to end: an IFT run (full fine-tuning) and a LoRA DPO run on a
tiny random checkpoint built with transformers' own config class, each checkpointed, exported, loaded by
transformers with the run's logits."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

FAMILIES = ["qwen3", "phi3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe"]
ATTENTION = "--config.lora.target_modules=q_proj,k_proj,v_proj,o_proj"


@pytest.mark.slow
@pytest.mark.parametrize("arch", FAMILIES)
def test_ift_and_lora_dpo_train_checkpoint_and_export(arch, tmp_path):
    from test_train import small_config
    from torch_reference import make_reference, torch_logits
    from transformers import AutoModelForCausalLM

    from jaxalign.models import load_hf
    from jaxalign.train import train
    from jaxalign.train.export import export

    make_reference(arch, tmp_path / "base", vocab_size=320)
    common = [f"--config.model.path={tmp_path / 'base'}", "--config.tokenizer=toy", "--config.train.steps=3",
              "--config.train.save_every=3", "--config.optim.lr=1e-3", "--config.eval.generate=0"]
    tokens = np.random.RandomState(0).randint(3, 320, (2, 10))
    mask = np.ones_like(tokens)
    mask[1, 7:] = 0
    for name, extra in (("ift", []), ("dpo", ["--config.lora.enabled=True", ATTENTION])):
        workdir = tmp_path / name
        summary = train(small_config(name, workdir, *common, *extra))
        assert summary["step"] == 3 and (workdir / "checkpoints" / "3").exists()
        rows = [json.loads(r) for r in (workdir / "metrics.jsonl").read_text().splitlines()]
        assert all(np.isfinite(r["loss"]) for r in rows if r["split"] == "train")
        out = export(workdir, tmp_path / f"{name}_hf")
        reference = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
        expected = torch_logits(reference, tokens, mask)
        got = np.asarray(load_hf(out)(jnp.asarray(tokens), jnp.asarray(mask)))
        assert np.abs(got - expected)[mask.astype(bool)].max() <= 1e-4, name
