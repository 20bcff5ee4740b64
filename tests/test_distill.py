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


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize(("temperature", "softcap"), [(1.0, 0.0), (2.0, 0.0), (0.9, 3.0)])
def test_blocked_generalized_jsd_equals_trl_through_the_heads(beta, temperature, softcap):
    """The memory-light loss (blocks of 4 positions over 11, a closed-form gradient) against TRL's
    ``generalized_jsd_loss`` on logits ``softcap(hidden @ kernel)`` of a student and a wider teacher: the loss, the
    gradients of the student's hidden states and head, and the NLL sums."""
    rng = np.random.RandomState(int(beta * 10 + temperature * 3 + softcap))
    batch, length, vocab = 3, 11, 37
    hs, ks = rng.randn(batch, length, 8), rng.randn(8, vocab) * 0.7
    ht, kt = rng.randn(batch, length, 12), rng.randn(12, vocab) * 0.7
    targets = rng.randint(0, vocab, (batch, length))
    labels = np.where(rng.rand(batch, length) > 0.3, targets, -100)
    labels[:, :5] = -100  # a block with nothing trained in any row is skipped

    def capped(x):
        return softcap * torch.tanh(x / softcap) if softcap else x

    h, k = torch.tensor(hs, requires_grad=True), torch.tensor(ks, requires_grad=True)
    expected = trl_generalized_jsd_loss(capped(h @ k), capped(torch.tensor(ht) @ torch.tensor(kt)),
                                        torch.tensor(labels), beta=beta, temperature=temperature)
    expected.backward()
    weights = jnp.asarray(labels != -100, jnp.float32)

    def ours(h, k):
        sums = losses.blocked_generalized_jsd(h, k, jnp.asarray(ht, jnp.float32), jnp.asarray(kt, jnp.float32),
                                              jnp.asarray(targets), weights, beta, temperature, 4, softcap, softcap)
        return sums[0] / weights.sum(), sums

    (loss, sums), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1), has_aux=True))(
        jnp.asarray(hs, jnp.float32), jnp.asarray(ks, jnp.float32))
    assert float(loss) == pytest.approx(expected.item(), rel=1e-5)
    for ours_grad, torch_grad in zip(grads, (h.grad.numpy(), k.grad.numpy()), strict=True):
        assert np.linalg.norm(np.asarray(ours_grad) - torch_grad) / np.linalg.norm(torch_grad) <= 1e-5
    for total, (hidden, kernel) in zip(sums[1:], ((hs, ks), (ht, kt)), strict=True):
        logits = capped(torch.tensor(hidden) @ torch.tensor(kernel))
        nll = F.cross_entropy(logits.reshape(-1, vocab), torch.tensor(labels).reshape(-1), reduction="sum")
        assert float(total) == pytest.approx(nll.item(), rel=1e-5)
    assert losses.blocked_generalized_jsd(jnp.asarray(hs), jnp.asarray(ks), jnp.asarray(ht), jnp.asarray(kt),
                                          jnp.asarray(targets), weights * 0)[0] == 0.0


def test_blocked_generalized_jsd_on_a_mesh_equals_one_device():
    """On the 8-device mesh (batch over fsdp, the heads' hidden axis over fsdp as the rules place them) the loss and
    gradients equal the single-device ones: the head's gradient is summed per batch shard in the loop and reduced
    once after it."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxalign.parallel import make_mesh

    rng = np.random.RandomState(3)
    hs, ks = rng.randn(8, 9, 16), rng.randn(16, 40)
    ht, kt = rng.randn(8, 9, 24), rng.randn(24, 40)
    targets, weights = rng.randint(0, 40, (8, 9)), (rng.rand(8, 9) > 0.3).astype(np.float32)

    def loss(h, k, *rest):
        return losses.blocked_generalized_jsd(h, k, *rest, 0.4, 1.0, 4)[0]

    args = [jnp.asarray(x) for x in (hs, ks, ht, kt, targets, weights)]
    expected = jax.value_and_grad(loss, argnums=(0, 1))(*args)
    batch_axes = {"fsdp": ("fsdp",), "mixed": (("data", "fsdp"),)}
    for name, shape in (("fsdp", {"fsdp": 8}), ("mixed", {"data": 2, "fsdp": 2, "tensor": 2})):
        mesh = make_mesh(shape)  # mixed: the batch in 4 shards, the vocabulary over tensor
        rows, head = PartitionSpec(*batch_axes[name]), PartitionSpec("fsdp", "tensor" if name == "mixed" else None)
        placed = [jax.device_put(x, NamedSharding(mesh, spec))
                  for x, spec in zip(args, (rows, head, rows, head, rows, rows), strict=True)]
        with jax.set_mesh(mesh):
            got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*placed)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_the_distill_objective_in_blocks_equals_whole_logits():
    """``logits_block`` changes how the logits are formed, not what is trained: loss, metrics and every parameter's
    gradient of a student against a larger, soft-capped teacher; the automatic choice by size."""
    from dataclasses import replace

    from flax import nnx
    from test_objectives import run, sft_batch

    from jaxalign.models import LlamaConfig, create_model
    from jaxalign.objectives import DistillParams
    from jaxalign.objectives.distill import resolve_logits_block

    student_config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                 num_kv_heads=1)
    student = create_model(student_config, seed=1)
    teacher = create_model(replace(student_config, hidden_size=64, num_layers=2, final_softcap=5.0), seed=2)
    batch = sft_batch(b=4, t=12)
    batch["example_weight"] = np.array([1.0, 0.0, 1.0, 1.0], np.float32)
    outputs = {}
    for block in (0, 1, 5):
        hparams = DistillParams(beta=0.5, temperature=0.8, logits_block=block)

        def loss_fn(m, hparams=hparams):
            return run("distill", m, batch, hparams, reference=teacher)

        (loss, metrics), grads = jax.jit(nnx.value_and_grad(loss_fn, has_aux=True))(student)
        outputs[block] = (loss, {k: float(v.total) for k, v in metrics.items()}, jax.tree.leaves(grads))
    whole = outputs.pop(0)
    for loss, metrics, grads in outputs.values():
        assert float(loss) == pytest.approx(float(whole[0]), rel=1e-5)
        assert metrics == pytest.approx(whole[1], rel=1e-5)
        for a, b in zip(grads, whole[2], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))
    # automatic: whole logits while they are small, then blocks of about the target's size
    assert resolve_logits_block(-1, 4, 64, 128, backend="cpu") == 0
    assert resolve_logits_block(-1, 4, 1024, 49152, backend="cpu") == 42
    assert resolve_logits_block(-1, 8, 2048, 151936, backend="gpu") == 13
    assert resolve_logits_block(7, 4, 1024, 49152) == 7


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A larger teacher (2 layers x 64 against the students' 1 x 32), its run folder."""
    from test_train import small_config

    from jaxalign.train import train

    folder = tmp_path_factory.mktemp("teacher")
    train(small_config("sft", folder, "--config.model.shape.hidden_size=64", "--config.model.shape.num_layers=2",
                       "--config.train.steps=12", "--config.optim.lr=3e-3"))
    return folder


@pytest.mark.slow  # end to end; the default suite keeps its parts
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
def test_blocked_logits_train_as_whole_logits_on_the_mesh(teacher, tmp_path):
    """Three steps on the 8-device mesh (batch sharded) with the blocked loss end at the weights of whole logits."""
    from test_distributed import params_of
    from test_train import small_config

    from jaxalign.train import train

    flags = [f"--config.objective.params.teacher={teacher}", "--config.train.steps=3", "--config.optim.lr=3e-3",
             "--config.eval.generate=0", "--config.objective.params.beta=0.3"]
    for block in (0, 3):
        train(small_config("distill", tmp_path / f"block{block}", *flags,
                           f"--config.objective.params.logits_block={block}"))
    (_, whole), (_, blocked) = params_of(tmp_path / "block0"), params_of(tmp_path / "block3")
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(blocked), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


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


# ------------------------------------------------------------------------------------ GKD: sampled completions
def trl_on_policy_layout(prompts, prompt_mask, completion_ids, eos_token_id):
    """TRL 1.16 ``GKDTrainer.generate_on_policy_outputs`` after ``model.generate``: (input_ids, attention_mask,
    labels) from the left-padded prompts and the generated columns (pad after EOS)."""
    generated_tokens = torch.cat([prompts, completion_ids], dim=1)
    prompt_length = prompts.shape[1]
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_id))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    sequence_indices = torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1)
    completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()
    new_attention_mask = torch.ones_like(generated_tokens)
    new_attention_mask[:, prompt_length:] = completion_mask
    new_attention_mask[:, :prompt_length] = prompt_mask
    new_labels = generated_tokens.clone()
    new_labels[new_attention_mask == 0] = -100
    new_labels[:, :prompt_length] = -100
    return generated_tokens, new_attention_mask, new_labels


def test_sampled_rows_equal_trls_on_policy_layout():
    """The rows GKD trains on: the prompt's real tokens, then the completion up to and including its first EOS,
    the loss on the completion only: TRL's tokens, attention and labels with the padding squeezed out."""
    from jaxalign.sampling.generate import left_pad
    from jaxalign.train.onpolicy import completion_rows, prompts_of

    # a data batch: prompts of 2-6 tokens; row 1 is a two-turn conversation (its last turn is the completion)
    batch = {"tokens": np.array([[5, 6, 7, 20, 21, 0, 0, 0, 0], [8, 9, 22, 23, 10, 11, 24, 25, 26],
                                 [12, 13, 27, 0, 0, 0, 0, 0, 0]], np.int32),
             "attention_mask": np.array([[1] * 5 + [0] * 4, [1] * 9, [1] * 3 + [0] * 6], np.int32),
             "loss_mask": np.array([[0, 0, 0, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0, 1, 1, 1],
                                    [0, 0, 1, 0, 0, 0, 0, 0, 0]], np.int32)}
    prompts = prompts_of(batch)
    assert [p.tolist() for p in prompts] == [[5, 6, 7], [8, 9, 22, 23, 10, 11], [12, 13]]
    ids, mask = left_pad([p.tolist() for p in prompts], 0, 8)
    eos = 3
    # the sampler's output: EOS at column 2 (then padding), no EOS (the budget ran out), EOS first
    completion = np.array([[30, 31, eos, 0, 0, 0, 0, 0, 0, 0, 0, 0], list(range(10, 22)),
                           [eos] + [0] * 11], np.int32)
    lengths = np.array([3, 12, 1])  # up to and including EOS (``Generation.lengths``)
    rows = completion_rows(ids, mask, completion, lengths, pad_id=0, max_length=64, buckets=(16, 32, 64))
    tokens, attention, labels = trl_on_policy_layout(torch.tensor(ids), torch.tensor(mask), torch.tensor(completion),
                                                     [eos])
    for i in range(3):
        real = attention[i].numpy().astype(bool)
        np.testing.assert_array_equal(rows["tokens"][i][rows["attention_mask"][i] > 0], tokens[i].numpy()[real])
        np.testing.assert_array_equal(rows["loss_mask"][i][rows["attention_mask"][i] > 0],
                                      (labels[i].numpy() != -100)[real])
    assert rows["tokens"].shape == (3, 32)  # the smallest bucket holding prompt + completion
    cut = completion_rows(ids, mask, completion, lengths, pad_id=0, max_length=5, buckets=(4, 5))
    assert cut["attention_mask"].sum(1).max() == 5  # cut to data.max_length
    with pytest.raises(ValueError, match="row 0 of the batch has no prompt tokens"):
        prompts_of({**batch, "loss_mask": np.ones_like(batch["loss_mask"])})


def test_gkd_step_sources_follow_lmbda_and_seq_kd():
    """TRL's choice per step: the student with probability lmbda, else the teacher with seq_kd, else the data;
    a function of (seed, step) only."""
    from jaxalign.objectives import DistillParams
    from jaxalign.train.onpolicy import completion_source

    def shares(**kw):
        hp = DistillParams(teacher="t", **kw)
        drawn = [completion_source(hp, 3, step) for step in range(4000)]
        return {s: drawn.count(s) / len(drawn) for s in ("student", "teacher", "data")}

    assert shares(lmbda=1.0) == {"student": 1.0, "teacher": 0.0, "data": 0.0}
    assert shares(seq_kd=True) == {"student": 0.0, "teacher": 1.0, "data": 0.0}
    mixed = shares(lmbda=0.3, seq_kd=True)
    assert abs(mixed["student"] - 0.3) < 0.03 and mixed["data"] == 0.0
    assert abs(shares(lmbda=0.5)["student"] - 0.5) < 0.03
    hp = DistillParams(teacher="t", lmbda=0.5)
    assert [completion_source(hp, 3, s) for s in range(50)] == [completion_source(hp, 3, s) for s in range(50)]
    with pytest.raises(ValueError, match=r"lmbda=1.5 must be in \[0, 1\]"):
        DistillParams(lmbda=1.5)


GKD = ["--config.objective.params.lmbda=0.5", "--config.objective.params.seq_kd=True",
       "--config.objective.params.max_new_tokens=6", "--config.objective.params.temperature=0.9",
       "--config.optim.lr=3e-3", "--config.optim.schedule=constant", "--config.optim.warmup_steps=1",
       "--config.eval.generate=0", "--config.train.log_every=2"]  # a run cut at step 2 has the same schedule


@pytest.mark.slow  # end to end; the default suite keeps its parts
def test_gkd_samples_from_the_student_and_the_teacher_and_resumes_bit_for_bit(teacher, tmp_path):
    from test_distributed import params_of
    from test_train import SMALL, small_config

    from jaxalign.cli import main
    from jaxalign.data.batching import bucket_length
    from jaxalign.sampling import sample
    from jaxalign.sampling.generate import left_pad
    from jaxalign.train import ConfigError, train, validate
    from jaxalign.train.build import build, run_mesh
    from jaxalign.train.inputs import load_inputs
    from jaxalign.train.onpolicy import GKDBatches, completion_source, prompts_of, sampling_seed

    flags = [f"--config.objective.params.teacher={teacher}", *GKD]
    # the uninterrupted run through the CLI with the bundled gkd config; the other cut at step 2 and resumed
    assert main(["train", "--config", "gkd", *SMALL, f"--config.workdir={tmp_path / 'whole'}", *flags,
                 "--config.train.steps=4"]) in (0, None)
    train(small_config("gkd", tmp_path / "resumed", *flags, "--config.train.steps=2"))
    train(small_config("gkd", tmp_path / "resumed", *flags, "--config.train.steps=4"))

    (step_a, a), (step_b, b) = params_of(tmp_path / "whole"), params_of(tmp_path / "resumed")
    assert step_a == step_b == 4
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    rows = [json.loads(r) for r in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert all(r["gkd/student_steps"] + r["gkd/teacher_steps"] == 1.0 for r in train_rows)
    assert "completion/mean_length" in train_rows[-1]

    # the sampled rows come from the model the step's source names, with the step's key
    spec = validate(small_config("gkd", tmp_path / "probe", *flags))
    engine = build(spec, run_mesh(spec))
    batches = GKDBatches(engine, spec)
    (tmp_path / "probe").mkdir()
    data = next(load_inputs(spec, engine, tmp_path / "probe", lambda m: None).pipeline)
    steps = {completion_source(spec.objective.params, spec.seed, s): s for s in range(8)}
    prompts = [p.tolist() for p in prompts_of(data)]
    ids, mask = left_pad(prompts, batches.pad, bucket_length(max(map(len, prompts)), batches.buckets))
    with jax.set_mesh(engine.mesh), engine.rules_scope():
        for source, model in (("student", engine.policy()), ("teacher", engine.parts.reference(engine.frozen))):
            step = steps[source]
            made = batches(data, step)
            expected = sample(model, ids, prompt_mask=mask, max_new_tokens=6, temperature=0.9, eos_id=batches.eos,
                              pad_id=batches.pad, seed=sampling_seed(spec.seed, step))
            for i, prompt in enumerate(prompts_of(data)):
                n = int(np.asarray(expected.lengths)[i])
                row = made["tokens"][i][made["attention_mask"][i] > 0]
                np.testing.assert_array_equal(row, np.concatenate([prompt, np.asarray(expected.tokens)[i, :n]]))
                assert made["loss_mask"][i].sum() == n
    with pytest.raises(ConfigError, match=r"data\.packing cannot serve objective\.params\.lmbda"):
        validate(small_config("distill", tmp_path / "never", *flags, "--config.data.packing=True",
                              "--config.data.row_length=96"))
