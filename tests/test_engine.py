"""The run's one path: config -> spec -> build -> step -> loop. The saved config reruns a run, the builder is the only
place a model is made from a config, prompts are encoded one way for training and evaluation, the loop's prefetch
keeps the data position exact, parameters carry Flax's sharding metadata, and the precomputed reference fits in the
step's memory."""

import inspect
import json
import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from chat_tokenizers import FAMILIES, make_tokenizer
from flax import nnx

from jaxalign.data import DataPipeline, PipelineConfig, TokenizeConfig, Tokenizer, tokenize_record, validate_record
from jaxalign.data.tokenize import ZEPHYR_TEMPLATE
from jaxalign.data.toy import toy_tokenizer
from jaxalign.models import LlamaConfig, abstract_model, create_model, param_shardings
from jaxalign.objectives import OBJECTIVES
from jaxalign.parallel import DEFAULT_RULES, format_rules, parse_rules
from jaxalign.plan import plan
from jaxalign.train import ConfigError, RunSpec, build, load_config, train, validate
from jaxalign.train import evaluate as evaluate_module
from jaxalign.train.build import run_mesh
from jaxalign.train.inputs import Prefetcher

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--config.model.shape.hidden_size=32", "--config.model.shape.intermediate_size=64",
         "--config.model.shape.num_layers=1", "--config.model.shape.num_heads=2", "--config.model.shape.num_kv_heads=1",
         "--config.data.toy_size=200", "--config.data.toy_eval_size=16", "--config.data.max_length=48",
         "--config.train.batch_size=8", "--config.train.log_every=2", "--config.train.eval_every=0",
         "--config.eval.batches=1", "--config.eval.generate=0", "--config.logging.tensorboard=False",
         "--config.logging.plot=False", "--config.optim.warmup_steps=2", "--config.train.steps=4"]


def train_losses(workdir: Path) -> list[float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if row["split"] == "train"]


def test_config_json_records_every_value_and_reruns_the_run(tmp_path):
    train(load_config("dpo", [*SMALL, f"--config.workdir={tmp_path / 'a'}"]))
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved["objective"]["params"] == {
        "beta": 0.1, "label_smoothing": 0.0, "loss_type": "sigmoid", "loss_weights": [], "rpo_alpha": 0.0,
        "reference_free": False, "ipo_average": True, "ld_alpha": 1.0, "use_weighting": False, "discopop_tau": 0.05,
        "f_divergence_type": "reverse_kl", "f_alpha_divergence_coef": 0.5, "logps_chunk_size": -1}
    assert saved["mesh"]["rules"] == format_rules(DEFAULT_RULES)
    rerun = load_config(str(tmp_path / "a" / "config.json"), [f"--config.workdir={tmp_path / 'b'}"])
    assert RunSpec.from_config(rerun).objective.params == RunSpec.from_config(
        load_config("dpo", [*SMALL, f"--config.workdir={tmp_path / 'a'}"])).objective.params
    train(rerun)
    assert train_losses(tmp_path / "b") == train_losses(tmp_path / "a") and len(train_losses(tmp_path / "a")) == 2


def test_a_broken_config_json_is_a_clear_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"train": {"stepz": 3}}')
    with pytest.raises(ConfigError, match=r"train.stepz: the config has no such field"):
        load_config(str(path))
    path.write_text("{oops")
    with pytest.raises(ConfigError, match=r"config.json: not valid JSON"):
        load_config(str(path))


BUILDERS = re.compile(r"\b(create_model|load_pretrained|load_hf|load_gguf|LlamaConfig|make_optimizer)\(")


def test_no_module_outside_the_builder_makes_a_model_from_a_config():
    allowed = {ROOT / "jaxalign" / "train" / "build.py", ROOT / "jaxalign" / "train" / "step.py"}
    offenders = []
    for path in sorted((ROOT / "jaxalign").rglob("*.py")):
        if path in allowed or path.is_relative_to(ROOT / "jaxalign" / "models"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if BUILDERS.search(line) and not line.lstrip().startswith(("def ", "#")):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_objective_facts_come_from_the_registry():
    assert [o.data_kind for o in OBJECTIVES.values()] == ["sft", "sft", "preference", "preference", "preference",
                                                          "preference", "unpaired", "preference", "sft", "mpo",
                                                          "prompt"]
    # grpo: with beta > 0
    assert {name for name, o in OBJECTIVES.items() if o.uses_reference} == {"dpo", "kto", "mpo", "grpo"}
    assert [name for name, o in OBJECTIVES.items() if o.head == "reward"] == ["reward"]
    for objective in OBJECTIVES.values():  # the engine setting is defined once, inherited by every Params class
        assert objective.params().logps_chunk_size == -1
        assert "logps_chunk_size" not in inspect.get_annotations(objective.params)
    from jaxalign.cli import build_parser

    data_inspect = build_parser()._subparsers._group_actions[0].choices["data"]._subparsers._group_actions[0]
    assert data_inspect.choices["inspect"]._option_string_actions["--objective"].choices == [
        name for name in OBJECTIVES if name != "grpo"]  # grpo samples its completions: nothing to inspect


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prompt_encoder_gives_exactly_the_prompt_tokens_training_sees(family):
    hf = make_tokenizer(family)
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    for template in (None, "zephyr"):
        tok = Tokenizer(hf, TokenizeConfig(max_length=128, chat_template=template))
        example = tokenize_record(tok, validate_record({"messages": messages}, source="m", index=0, kind="sft"))
        prompt = tok.encode_prompt(messages[:1])
        assert example["tokens"][: len(prompt)].tolist() == prompt
        assert not example["loss_mask"][: len(prompt)].any() and example["loss_mask"][len(prompt)] == 1


def test_a_chat_template_override_changes_eval_prompts_as_it_changes_training(tmp_path, monkeypatch):
    spec = validate(load_config("sft", [*SMALL, f"--config.workdir={tmp_path}", "--config.data.chat_template=zephyr"]),
                    num_devices=jax.device_count())
    engine = build(spec, run_mesh(spec))
    assert engine.tokenizer.chat_template == ZEPHYR_TEMPLATE != toy_tokenizer().chat_template
    fed = []

    def spy(model, tokens, **kwargs):
        fed.append(np.asarray(tokens))
        return np.zeros((tokens.shape[0], kwargs["max_new_tokens"]), np.int32)

    monkeypatch.setattr(evaluate_module, "generate", spy)
    record = {"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}],
              "answer": "5"}
    evaluate_module.exact_match(engine.policy(), engine.tokenizer, [record])
    example = tokenize_record(engine.tokenizer, validate_record(record, source="m", index=0, kind="sft"))
    prompt = engine.tokenizer.encode_prompt(record["messages"][:1])
    assert fed[0][0, -len(prompt):].tolist() == prompt == example["tokens"][: len(prompt)].tolist()
    assert "<|user|>" in toy_tokenizer().decode(prompt)


def test_prefetcher_keeps_the_order_the_position_and_the_errors():
    examples = [{"tokens": np.arange(2 + i % 5, dtype=np.int32), "loss_mask": np.ones(2 + i % 5, np.int8)}
                for i in range(40)]
    config = PipelineConfig(batch_size=4, seed=3)
    direct, prefetched = DataPipeline([examples], "sft", config), DataPipeline([examples], "sft", config)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    prefetch = Prefetcher(prefetched, sharding, depth=3)
    for _ in range(12):  # past an epoch boundary
        batch, tokens, position = next(prefetch)
        expected = next(direct)
        assert position == direct.state() and tokens == int(expected["attention_mask"].sum())
        for key, value in expected.items():
            np.testing.assert_array_equal(np.asarray(batch[key]), value)
    prefetch.close()

    class Broken(DataPipeline):
        def __next__(self):
            raise ValueError("record 7 is bad")

    failing = Prefetcher(Broken([examples], "sft", config), sharding)
    with pytest.raises(ValueError, match="record 7 is bad"):
        next(failing)
    failing.close()


def test_parameters_carry_flax_sharding_metadata_and_the_rules_are_config(mesh8):
    model = abstract_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                                       num_heads=4, num_kv_heads=2))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model)))
    assert tuple(specs["embed_tokens"]) == ("vocab", "embed")
    assert tuple(specs["layers"][0]["self_attn"]["q_proj"]) == ("embed", "heads", "head_dim")
    assert parse_rules(format_rules(DEFAULT_RULES)) == DEFAULT_RULES and parse_rules("") == DEFAULT_RULES
    default = nnx.to_pure_dict(param_shardings(model, mesh8))
    replicated = nnx.to_pure_dict(param_shardings(model, mesh8, parse_rules("embed=,mlp=fsdp+tensor")))
    assert default["layers"][0]["self_attn"]["q_proj"].spec[0] == "fsdp"
    assert replicated["layers"][0]["self_attn"]["q_proj"].spec[0] is None
    assert replicated["layers"][0]["mlp"]["up_proj"].spec[1] == ("fsdp", "tensor")
    with pytest.raises(ConfigError, match=r"mesh.rules='embed=model': entry 'embed=model': unknown mesh axis model"):
        validate(load_config("sft", ["--config.mesh.rules=embed=model"]), num_devices=8)
    with jax.set_mesh(mesh8):  # building inside a mesh context works (Flax's metadata is not applied to it)
        created = create_model(model.config, mesh=mesh8, rules=parse_rules("embed="))
    assert created.layers[0].self_attn.q_proj.get_value().sharding.spec[0] is None


def test_precomputed_reference_needs_no_more_memory_than_the_step():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from reference_memory import SMOKE, measure

    result = measure(SMOKE, 4, 64)
    assert 0 < result["reference_pass"]["total"] <= result["policy_step"]["total"]
    config = load_config("dpo", ["--config.reference.kind=precomputed"])
    report = plan(config, 8)
    assert "reference model" not in report.bytes
    assert any("reference.kind=precomputed" in note and "below the step's" in note for note in report.notes)
