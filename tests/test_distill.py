"""Distillation: the generalized JSD against TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` restated in PyTorch, and
training a student from a frozen teacher of another size (full fine-tuning and LoRA)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign import losses

torch = pytest.importorskip("torch")
F = torch.nn.functional


def trl_generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0):
    """``generalized_jsd_loss`` (reduction ``batchmean`` with labels: the mean over tokens whose label != -100)."""
    student_logits = student_logits / temperature
    teacher_logits = teacher_logits / temperature
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta = torch.tensor(beta, dtype=student_log_probs.dtype)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log1p(-beta), teacher_log_probs + torch.log(beta)]), dim=0)
        kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
        jsd = beta * kl_teacher + (1 - beta) * kl_student
    if labels is not None:
        mask = labels != -100
        jsd = jsd[mask]
    denom = mask.sum().clamp_min(1) if labels is not None else max(jsd.size(0), 1)
    return jsd.sum() / denom


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_generalized_jsd_equals_trl(beta, temperature):
    rng = np.random.RandomState(int(beta * 10 + temperature))
    student, teacher = rng.randn(3, 7, 11) * 2, rng.randn(3, 7, 11) * 2
    labels = np.where(rng.rand(3, 7) > 0.3, 1, -100)
    s = torch.tensor(student, requires_grad=True)
    expected = trl_generalized_jsd_loss(s, torch.tensor(teacher), torch.tensor(labels), beta=beta,
                                        temperature=temperature)
    expected.backward()
    mask = jnp.asarray(labels != -100, jnp.float32)

    def ours(x):
        per = losses.generalized_jsd(x, jnp.asarray(teacher, jnp.float32), beta=beta, temperature=temperature)
        return (per * mask).sum() / mask.sum()

    loss, grad = jax.value_and_grad(ours)(jnp.asarray(student, jnp.float32))
    assert float(loss) == pytest.approx(expected.item(), rel=1e-5)
    err = np.linalg.norm(np.asarray(grad) - s.grad.numpy()) / np.linalg.norm(s.grad.numpy())
    assert err <= 1e-4
    assert float(losses.generalized_jsd(jnp.asarray(student), jnp.asarray(student), beta=beta).max()) < 1e-5


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A larger teacher (2 layers x 64 against the students' 1 x 32), its run folder."""
    from test_train import small_config

    from jaxalign.train import train

    folder = tmp_path_factory.mktemp("teacher")
    train(small_config("sft", folder, "--config.model.shape.hidden_size=64", "--config.model.shape.num_layers=2",
                       "--config.train.steps=12", "--config.optim.lr=3e-3"))
    return folder


def test_distill_trains_a_student_from_a_larger_teacher(teacher, tmp_path):
    from test_train import SMALL, small_config

    from jaxalign.train import ConfigError, load_config, train, validate

    student = [f"--config.objective.params.teacher={teacher}", "--config.train.steps=16",
               "--config.optim.lr=3e-3", "--config.eval.generate=0"]
    summary = train(small_config("distill", tmp_path / "student", *student))
    rows = [json.loads(r) for r in (tmp_path / "student" / "metrics.jsonl").read_text().splitlines()]
    losses_ = [r["loss"] for r in rows if r["split"] == "train"]
    assert losses_[-1] < losses_[0] and "teacher_nll/token" in rows[-1]
    assert summary["final_eval"]["loss"] < summary["initial_eval"]["loss"]
    from jaxalign.plan import plan

    planned = plan(load_config("distill", [*SMALL, f"--config.objective.params.teacher={teacher}"]), 8)
    student_bytes = planned.bytes["parameters"]
    assert planned.bytes["teacher model"] > 2 * student_bytes  # 2 x 64 against 1 x 32
    with pytest.raises(ConfigError, match=r"objective\.params\.teacher is empty"):
        validate(load_config("distill", SMALL))
    with pytest.raises(ConfigError, match="does not exist"):
        validate(load_config("distill", [*SMALL, f"--config.objective.params.teacher={tmp_path / 'nope'}"]))


@pytest.mark.slow
def test_an_exported_teacher_serves_lora_students_and_another_tokenizer_is_refused(teacher, tmp_path):
    from test_train import small_config

    from jaxalign.train import train
    from jaxalign.train.export import export

    # an exported teacher (Hugging Face folder) serves too; LoRA students keep the teacher beside their base
    export(teacher, tmp_path / "teacher_hf")
    train(small_config("distill", tmp_path / "lora", f"--config.objective.params.teacher={tmp_path / 'teacher_hf'}",
                       "--config.train.steps=2", "--config.lora.enabled=True", "--config.eval.generate=0"))
    other = ["--config.model.shape.vocab_size=300", "--config.train.steps=1"]
    train(small_config("sft", tmp_path / "other", *other))
    with pytest.raises(ValueError, match="differs from the student's"):
        train(small_config("distill", tmp_path / "bad", f"--config.objective.params.teacher={tmp_path / 'other'}",
                           "--config.train.steps=1"))
