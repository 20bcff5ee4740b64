"""Reward models: the scalar head against transformers' ``LlamaForSequenceClassification``, the Bradley-Terry loss
against a PyTorch restatement of TRL 1.16's ``RewardTrainer.compute_loss``, training, export, and use as a GRPO
reward."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxalign.models import load_hf
from jaxalign.objectives import RewardParams, get_objective

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
F = torch.nn.functional


def make_torch_reward_model(folder, seed=0):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0, num_labels=1)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.LlamaForSequenceClassification(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            if name == "score.weight":
                param.normal_(0, 0.5)
    model.save_pretrained(str(folder))
    return model


def pairs(seed=0, b=4, t=12):
    rng = np.random.RandomState(seed)
    out = {}
    for side in ("chosen", "rejected"):
        tokens, attention = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
        for row in range(b):
            n = rng.randint(5, t + 1)
            tokens[row, :n] = rng.randint(3, 128, n)
            tokens[row, n - 1] = 2  # EOS last, as the data pipeline appends it
            attention[row, :n] = 1
        out.update({f"{side}_tokens": tokens, f"{side}_attention_mask": attention, f"{side}_loss_mask": attention})
    return out


def trl_reward_loss(model, batch, center_rewards_coefficient=None):
    """``RewardTrainer.compute_loss``: chosen and rejected concatenated, ``outputs.logits.squeeze(-1)`` chunked,
    ``-logsigmoid(r_c - r_r [- margin]).mean()`` plus ``c · mean((r_c + r_r)²)``."""
    ids = torch.cat([torch.tensor(batch["chosen_tokens"]), torch.tensor(batch["rejected_tokens"])]).long()
    attention = torch.cat([torch.tensor(batch["chosen_attention_mask"]),
                           torch.tensor(batch["rejected_attention_mask"])]).long()
    outputs = model(input_ids=ids, attention_mask=attention, use_cache=False)
    rewards_chosen, rewards_rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
    if "margin" in batch:
        loss = -F.logsigmoid(rewards_chosen - rewards_rejected - torch.tensor(batch["margin"])).mean()
    else:
        loss = -F.logsigmoid(rewards_chosen - rewards_rejected).mean()
    if center_rewards_coefficient is not None:
        loss += center_rewards_coefficient * torch.mean((rewards_chosen + rewards_rejected) ** 2)
    return loss, rewards_chosen.detach().numpy(), rewards_rejected.detach().numpy()


@pytest.mark.parametrize(("margin", "center"), [pytest.param(False, None, marks=pytest.mark.slow),
                                               pytest.param(True, None, marks=pytest.mark.slow), (True, 0.01)])
def test_reward_loss_equals_trl_on_a_transformers_reward_model(margin, center, tmp_path):
    from torch_reference import assert_grads_match, jax_grads_by_hf_name

    torch_model = make_torch_reward_model(tmp_path, seed=1)
    batch = pairs(2)
    if margin:
        batch["margin"] = np.array([0.5, 0.0, 1.5, -0.2], np.float32)
    expected, chosen, rejected = trl_reward_loss(torch_model, batch, center)
    expected.backward()

    model = load_hf(tmp_path)
    assert model.config.num_labels == 1
    np.testing.assert_allclose(model.rewards(jnp.asarray(batch["chosen_tokens"]),
                                             jnp.asarray(batch["chosen_attention_mask"])), chosen, atol=1e-5)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    hparams = RewardParams(center_rewards_coefficient=center or 0.0)
    jbatch = {k: jnp.asarray(v) for k, v in batch.items()}

    def loss_fn(p):
        return get_objective("reward").fn(nnx.merge(graphdef, p, rest), jbatch, hparams)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    assert float(loss) == pytest.approx(expected.item(), rel=1e-5)
    assert float(metrics["rewards/accuracies"].value) == pytest.approx(float(np.mean(chosen > rejected)))
    assert_grads_match(torch_model, jax_grads_by_hf_name(grads), rtol=1e-4)


def test_pad_equal_to_eos_is_skipped_as_transformers_skips_it(tmp_path):
    torch_model = make_torch_reward_model(tmp_path, seed=2)
    torch_model.config.pad_token_id = 2  # pad = EOS, as many chat models ship
    torch_model.save_pretrained(str(tmp_path))
    tokens = np.array([[1, 5, 6, 7, 2, 2, 2], [1, 9, 8, 2, 6, 5, 2]])
    mask = np.array([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = torch_model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits[:, 0]
    got = load_hf(tmp_path).rewards(jnp.asarray(tokens), jnp.asarray(mask))
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-5)


def test_a_causal_lm_becomes_a_reward_model_and_objectives_check_the_head(tmp_path):
    from torch_reference import make_reference

    from jaxalign.train import ConfigError, load_config, validate
    from jaxalign.train.build import load_model

    make_reference("llama", tmp_path / "lm")
    a = load_hf(tmp_path / "lm", config_overrides={"num_labels": 1}, seed=3)
    b = load_hf(tmp_path / "lm", config_overrides={"num_labels": 1}, seed=3)
    assert not hasattr(a, "lm_head") and a.score[...].shape == (64, 1)
    np.testing.assert_array_equal(a.score[...], b.score[...])  # the new head is drawn from the seed
    assert float(jnp.std(a.score[...])) == pytest.approx(0.02, rel=0.3)
    with pytest.raises(ValueError, match="no LM head"):
        a.head_kernel()
    make_torch_reward_model(tmp_path / "rm")
    with pytest.raises(ValueError, match="is a reward model"):
        load_model(load_config("dpo", [f"--config.model.path={tmp_path / 'rm'}"]), head="lm")
    with pytest.raises(ConfigError, match="LoRA trains the adapters only"):
        validate(load_config("reward", ["--config.lora.enabled=True"]))


def test_margin_field_is_validated_and_batched(tmp_path):
    from jaxalign.data import DataError, TokenizeConfig, Tokenizer, load_examples
    from jaxalign.data.pipeline import DataPipeline, PipelineConfig
    from jaxalign.data.toy import toy_tokenizer

    tok = Tokenizer(toy_tokenizer(), TokenizeConfig(max_length=64))
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"{i} + 1 =", "chosen": f" {i + 1}", "rejected": f" {i + 2}", "margin": i / 2} for i in range(4)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    examples, _ = load_examples(path, tok, kind="preference")
    batch = next(DataPipeline([examples], "preference", PipelineConfig(batch_size=4, shuffle=False)))
    np.testing.assert_allclose(batch["margin"], [0, 0.5, 1.0, 1.5])
    path.write_text(json.dumps({**rows[0], "margin": "big"}))
    with pytest.raises(DataError, match="field 'margin': expected a finite number"):
        load_examples(path, tok, kind="preference")
    with pytest.raises(ValueError, match="give every record a margin"):
        DataPipeline([examples, [{k: v for k, v in examples[0].items() if k != "margin"}]], "preference",
                     PipelineConfig(batch_size=2))


@pytest.mark.slow  # end to end; the default suite keeps its parts
def test_reward_run_exports_a_sequence_classifier_and_serves_grpo(tmp_path):
    from test_grpo_train import grpo_config
    from test_train import small_config

    from jaxalign.rl.reward_model import RewardModelReward
    from jaxalign.train import train
    from jaxalign.train.export import export, restore_model

    summary = train(small_config("reward", tmp_path / "run", "--config.train.steps=24", "--config.optim.lr=3e-3"))
    assert summary["final_eval"]["loss"] < summary["initial_eval"]["loss"]  # held-out loss falls
    assert "rewards/accuracies" in summary["final_eval"] and "accuracy" not in summary["final_eval"]
    out = export(tmp_path / "run", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(out), local_files_only=True).eval()
    model, _, _ = restore_model(tmp_path / "run")
    tokens = np.array([[1, 50, 60, 70, 2], [1, 40, 41, 0, 0]])
    mask = (np.arange(5)[None] < np.array([[5], [3]])).astype(np.int64)
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits[:, 0].numpy()
    np.testing.assert_allclose(np.asarray(model.rewards(jnp.asarray(tokens), jnp.asarray(mask))), expected,
                               atol=1e-4)

    # as a GRPO reward: the run folder and the exported folder score alike
    prompts = [[{"role": "user", "content": "What is 2 + 3?"}]] * 2
    scorer, exported = RewardModelReward(str(tmp_path / "run")), RewardModelReward(str(out))
    a = scorer(["x", "x"], ["5", "7"], raw_prompts=prompts)
    np.testing.assert_allclose(a, exported(["x", "x"], ["5", "7"], raw_prompts=prompts), atol=1e-4)
    summary = train(grpo_config(tmp_path / "grpo", "--config.train.steps=2", "--config.eval.generate=0",
                                "--config.objective.params.sft_steps=0",
                                f"--config.objective.params.rewards=reward_model:{tmp_path / 'run'}"))
    assert summary["step"] == 2
    train_rows = [json.loads(r) for r in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["reward"]) for r in train_rows if r["split"] == "train")
