"""Hub names resolve through the local Hugging Face cache, offline (HF_HUB_OFFLINE=1 in conftest): a fake cache
with one model and one dataset repository, as huggingface_hub lays it out."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign.data.toy import toy_tokenizer
from jaxalign.hub import HubError, is_repo_id, resolve_dataset, resolve_model
from jaxalign.models import LlamaConfig, create_model, load_pretrained, save_hf
from jaxalign.train import load_config, train

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CONFIG = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)


def fake_repo(cache, kind: str, repo: str):
    root = cache / f"{kind}s--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    model = create_model(CONFIG, seed=3)
    save_hf(model, fake_repo(cache, "model", "Org/Tiny"), tokenizer=toy_tokenizer())
    data = fake_repo(cache, "dataset", "Org/Chat") / "data"
    data.mkdir()
    for split, n in (("train", 40), ("test", 8)):
        rows = [{"prompt": f"Say {i}.", "completion": f"{i}"} for i in range(n)]
        (data / f"{split}-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return cache, model


def test_model_ids_and_dataset_names_resolve_offline_from_the_cache(hub_cache):
    _, model = hub_cache
    assert is_repo_id("Org/Tiny") and not is_repo_id("/abs/path") and is_repo_id("Org/Tiny@main")
    assert resolve_model("Org/Tiny@main").name == COMMIT
    loaded, tokenizer = load_pretrained("Org/Tiny")
    tokens = jnp.asarray([[1, 5, 9, 2]])
    np.testing.assert_allclose(np.asarray(loaded(tokens)), np.asarray(model(tokens)), atol=1e-6)
    assert len(tokenizer) == len(toy_tokenizer())
    assert [p.name for p in resolve_dataset("hf:Org/Chat")] == ["train-00000-of-00001.jsonl"]
    assert [p.name for p in resolve_dataset("hf:Org/Chat@main:test")] == ["test-00000-of-00001.jsonl"]
    with pytest.raises(HubError, match=r"Org/Missing: not a local path.*HF_HUB_OFFLINE is set"):
        resolve_model("Org/Missing")
    with pytest.raises(HubError, match=r"no 'validation' data file"):
        resolve_dataset("hf:Org/Chat:validation")


def test_training_from_a_hub_model_on_a_hub_dataset(hub_cache, tmp_path):
    config = load_config("sft", ["--config.model.path=Org/Tiny", "--config.data.train=hf:Org/Chat",
                                 "--config.data.eval=hf:Org/Chat:test", "--config.train.steps=2",
                                 "--config.train.batch_size=8", "--config.eval.generate=0",
                                 "--config.logging.tensorboard=False", "--config.logging.plot=False",
                                 f"--config.workdir={tmp_path / 'run'}"])
    assert config.tokenizer == ""  # the model's own (the repository's tokenizer)
    summary = train(config)
    assert summary["step"] == 2 and "loss" in summary["final_eval"]
