"""Loss functions against hand-computed numbers and NumPy re-derivations written from the formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign import losses

SEEDS = range(6)


# ------------------------------------------------------------------------------------------- references
def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_log_sigmoid(x):
    return -np.logaddexp(0, -x)


def np_token_logps(logits, tokens, mask):
    out = np.zeros(tokens.shape)
    lsm = np_log_softmax(logits.astype(np.float64))
    for b in range(tokens.shape[0]):
        for t in range(1, tokens.shape[1]):
            if mask[b, t]:
                out[b, t] = lsm[b, t - 1, tokens[b, t]]
    return out


def np_ift(losses_, mask, gamma):
    """Loops straight from ALGORITHMS.md §1(b) step 4-5."""
    per_seq = []
    for ell, m in zip(losses_, mask, strict=True):
        m = m.astype(float).copy()
        m[0] = 0
        n = m.sum()
        u = m * ell / n
        g = np.array([sum(gamma ** (k - t) * u[k] for k in range(t, len(u))) for t in range(len(u))]) * m
        w = m if gamma == 0 else m * g * n / (m * g).sum()
        per_seq.append((m * w * ell).sum() / n)
    return np.array(per_seq)


def random_logits(seed, b=3, t=7, v=11):
    rng = np.random.RandomState(seed)
    logits = rng.randn(b, t, v).astype(np.float32) * 2
    tokens = rng.randint(0, v, (b, t))
    mask = (rng.rand(b, t) > 0.3).astype(np.int32)
    return logits, tokens, mask


# ----------------------------------------------------------------------------------------------- logps
@pytest.mark.parametrize("seed", SEEDS)
def test_token_and_sequence_logps(seed):
    logits, tokens, mask = random_logits(seed)
    expected = np_token_logps(logits, tokens, mask)
    got = losses.token_logps(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(mask))
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert (np.asarray(got)[:, 0] == 0).all()
    total, count = losses.sequence_logps(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(mask))
    np.testing.assert_allclose(total, expected.sum(1), atol=1e-5)
    np.testing.assert_array_equal(count, mask[:, 1:].sum(1))


def test_token_logps_jit_and_bf16():
    logits, tokens, mask = random_logits(0)
    plain = losses.token_logps(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(mask))
    jitted = jax.jit(losses.token_logps)(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(mask))
    np.testing.assert_allclose(jitted, plain, atol=1e-6)
    half = losses.token_logps(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(tokens), jnp.asarray(mask))
    assert half.dtype == jnp.float32
    np.testing.assert_allclose(half, plain, atol=0.1)


@pytest.mark.parametrize("chunk", [1, 3, 4, 16])
def test_chunked_logps_equal_plain(chunk):
    rng = np.random.RandomState(chunk)
    hidden = jnp.asarray(rng.randn(2, 9, 8), jnp.float32)
    kernel = jnp.asarray(rng.randn(8, 13), jnp.float32)
    tokens = jnp.asarray(rng.randint(0, 13, (2, 9)))
    mask = jnp.asarray(rng.rand(2, 9) > 0.2)
    plain = lambda h, k: losses.token_logps(h @ k, tokens, mask)
    chunked = lambda h, k: losses.token_logps_from_hidden(h, k, tokens, mask, chunk_size=chunk)
    np.testing.assert_allclose(jax.jit(chunked)(hidden, kernel), plain(hidden, kernel), atol=1e-5)
    grad_plain = jax.grad(lambda h, k: plain(h, k).sum(), argnums=(0, 1))(hidden, kernel)
    grad_chunked = jax.grad(lambda h, k: chunked(h, k).sum(), argnums=(0, 1))(hidden, kernel)
    for a, b in zip(grad_chunked, grad_plain, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_array_equal(losses.greedy_from_hidden(hidden, kernel, chunk_size=chunk),
                                  jnp.argmax(hidden @ kernel, -1))


# ------------------------------------------------------------------------------------------------- SFT
@pytest.mark.parametrize("seed", SEEDS)
def test_sft(seed):
    logits, tokens, mask = random_logits(seed)
    mask[0] = 0  # a sequence with nothing to train on
    logps = np_token_logps(logits, tokens, mask)
    per_seq, metrics = losses.sft(jnp.asarray(logps, jnp.float32), jnp.asarray(mask))
    n = mask[:, 1:].sum(1)
    np.testing.assert_allclose(per_seq, -logps.sum(1) / np.maximum(n, 1), atol=1e-5)
    np.testing.assert_array_equal(metrics["len/completion"], n)
    assert per_seq[0] == 0


# ------------------------------------------------------------------------------------------ preference
def random_pairs(seed, b=8):
    rng = np.random.RandomState(seed)
    pc, pr, rc, rr = (-rng.rand(4, b) * 30).astype(np.float32)
    lc, lr = rng.randint(1, 20, (2, b)).astype(np.float32)
    return pc, pr, rc, rr, lc, lr


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("loss_type", "smoothing"), [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0),
                                                      ("hinge", 0.0), ("robust", 0.1)])
def test_dpo(seed, loss_type, smoothing):
    pc, pr, rc, rr, _, _ = random_pairs(seed)
    beta = 0.3
    h = (pc.astype(np.float64) - rc) - (pr - rr)
    expected = {
        "sigmoid": -(1 - smoothing) * np_log_sigmoid(beta * h) - smoothing * np_log_sigmoid(-beta * h),
        "ipo": (h - 1 / (2 * beta)) ** 2,
        "hinge": np.maximum(0, 1 - beta * h),
        "robust": (-(1 - smoothing) * np_log_sigmoid(beta * h) + smoothing * np_log_sigmoid(-beta * h))
        / (1 - 2 * smoothing),
    }[loss_type]
    loss, metrics = jax.jit(lambda *a: losses.dpo(*a, beta=beta, label_smoothing=smoothing, loss_type=loss_type))(
        pc, pr, rc, rr)
    np.testing.assert_allclose(loss, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(metrics["rewards/margins"], beta * h, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(metrics["rewards/accuracies"], (beta * (pc - rc) > beta * (pr - rr)))


def test_dpo_at_reference_is_ln2_and_reference_free():
    logps = jnp.array([-3.0, -7.5])
    loss, metrics = losses.dpo(logps, logps - 1, logps, logps - 1)
    np.testing.assert_allclose(loss, np.log(2), rtol=1e-6)
    np.testing.assert_allclose(metrics["rewards/chosen"], 0)
    free, _ = losses.dpo(logps, logps - 1, jnp.zeros(2), jnp.zeros(2), beta=0.5)
    np.testing.assert_allclose(free, -np_log_sigmoid(0.5 * np.ones(2)), rtol=1e-6)
    with pytest.raises(ValueError, match="loss_type"):
        losses.dpo(logps, logps, logps, logps, loss_type="kto")


@pytest.mark.parametrize("seed", SEEDS)
def test_simpo(seed):
    pc, pr, _, _, lc, lr = random_pairs(seed)
    beta, ratio = 2.0, 0.8
    z = beta * (pc / lc - pr / lr - ratio)
    loss, metrics = losses.simpo(pc, pr, lc, lr, beta=beta, gamma_beta_ratio=ratio, label_smoothing=0.1)
    np.testing.assert_allclose(loss, -0.9 * np_log_sigmoid(z) - 0.1 * np_log_sigmoid(-z), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["rewards/chosen"], beta * pc / lc, rtol=1e-5)
    hinge, _ = losses.simpo(pc, pr, lc, lr, loss_type="hinge")
    np.testing.assert_allclose(hinge, np.maximum(0, 1 - 2.0 * (pc / lc - pr / lr - 0.8)), rtol=1e-5, atol=1e-6)


def test_simpo_without_margin_is_reference_free_dpo_on_averages():
    pc, pr, _, _, _, _ = random_pairs(0)
    length = np.full_like(pc, 7.0)
    simpo, _ = losses.simpo(pc, pr, length, length, beta=2.0, gamma_beta_ratio=0.0)
    dpo, _ = losses.dpo(pc / 7, pr / 7, np.zeros_like(pc), np.zeros_like(pc), beta=2.0)
    np.testing.assert_allclose(simpo, dpo, rtol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_orpo(seed):
    pc, pr, _, _, lc, lr = random_pairs(seed)
    a_c, a_r = (pc / lc).astype(np.float64), (pr / lr).astype(np.float64)
    log_odds = (a_c - np.log(1 - np.exp(a_c))) - (a_r - np.log(1 - np.exp(a_r)))
    loss, metrics = losses.orpo(pc, pr, lc, lr, lam=0.25)
    np.testing.assert_allclose(loss, -a_c - 0.25 * np_log_sigmoid(log_odds), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(metrics["log_odds_chosen"], log_odds, rtol=1e-4, atol=1e-5)


def test_orpo_is_finite_at_certainty_and_is_sft_without_odds_term():
    zero = jnp.zeros(3)
    loss, _ = losses.orpo(zero, jnp.array([-1.0, 0.0, -50.0]), jnp.ones(3), jnp.ones(3))
    grads = jax.grad(lambda c: losses.orpo(c, jnp.array([-1.0, 0.0, -50.0]), jnp.ones(3), jnp.ones(3))[0].sum())(zero)
    assert np.isfinite(loss).all() and np.isfinite(grads).all()
    pc, pr, _, _, lc, lr = random_pairs(1)
    np.testing.assert_allclose(losses.orpo(pc, pr, lc, lr, lam=0.0)[0], -pc / lc, rtol=1e-6)
    np.testing.assert_allclose(losses.log1mexp(jnp.array([-1e-8, -0.5, -40.0])),
                               np.log(-np.expm1(np.array([-1e-8, -0.5, -40.0]))), rtol=1e-5, atol=1e-12)


# ------------------------------------------------------------------------------------------------- IFT
def test_ift_worked_example():
    ell = jnp.array([[0.0, 1.0, 2.0, 3.0]])
    mask = jnp.array([[0, 1, 1, 1]])
    np.testing.assert_allclose(losses.ift_weights(ell, mask, gamma=0.95)[0, 1:], [1.25005, 1.08118, 0.66877],
                               atol=1e-5)
    loss, _ = losses.ift(ell, mask, gamma=0.95)
    np.testing.assert_allclose(loss, [1.80624], atol=1e-5)
    grad = jax.grad(lambda x: losses.ift(x, mask, gamma=0.95)[0].sum())(ell)
    np.testing.assert_allclose(grad[0, 1:], [0.35677, 0.31788, 0.27124], atol=1e-5)
    grad = jax.grad(lambda x: losses.ift(x, mask, gamma=0.95, detach_weights=True)[0].sum())(ell)
    np.testing.assert_allclose(grad[0, 1:], [0.41668, 0.36039, 0.22292], atol=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.95, 1.0])
def test_ift_random(seed, gamma):
    rng = np.random.RandomState(seed)
    ell = rng.rand(4, 9).astype(np.float32) * 3
    mask = (rng.rand(4, 9) > 0.25).astype(np.int32)
    mask[:, 1] = 1
    loss, _ = jax.jit(lambda x, m: losses.ift(x, m, gamma=gamma))(ell, mask)
    np.testing.assert_allclose(loss, np_ift(ell.astype(np.float64), mask, gamma), rtol=1e-5, atol=1e-6)
    weights = losses.ift_weights(jnp.asarray(ell), jnp.asarray(mask), gamma=gamma)
    trained = mask.copy()
    trained[:, 0] = 0
    np.testing.assert_allclose((np.asarray(weights) * trained).sum(1) / trained.sum(1), 1.0, rtol=1e-5)
    assert (np.asarray(weights)[trained == 0] == 0).all()


def test_ift_gamma_zero_is_sft():
    logits, tokens, mask = random_logits(2)
    logps = losses.token_logps(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(mask))
    np.testing.assert_allclose(losses.ift(-logps, mask, gamma=0.0)[0], losses.sft(logps, mask)[0], rtol=1e-6)


def test_reverse_discounted_cumsum_long_sequences_stay_finite():
    values = jnp.ones((1, 4096))
    out = losses.reverse_discounted_cumsum(values, 0.95)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[0, 0], 1 / (1 - 0.95), rtol=1e-4)
    np.testing.assert_allclose(out[0, -3:], [1 + 0.95 + 0.95**2, 1.95, 1.0], rtol=1e-6)


# ------------------------------------------------------------------------------------------------- MPO
@pytest.mark.parametrize("seed", SEEDS)
def test_mpo(seed):
    pc, pr, rc, rr, lc, lr = random_pairs(seed)
    rng = np.random.RandomState(seed)
    h_policy, h_ref = rng.randn(2, 8, 2, 5).astype(np.float32)
    ref_gap = rc / lc - rr / lr
    loss, metrics = losses.mpo(pc, pr, lc, lr, ref_gap, beta=1.5, policy_hidden=h_policy, ref_hidden=h_ref)
    gap = pc / lc - pr / lr
    expected = (1.5 * gap - ref_gap) ** 2 + ((h_policy - h_ref) ** 2).reshape(8, -1).mean(1)
    np.testing.assert_allclose(loss, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["reward_gap/target"], gap, rtol=1e-5, atol=1e-6)
    # the batch mean equals the official nn.MSELoss(β·RG_t, RG_d) + nn.MSELoss(h, h_ref)
    np.testing.assert_allclose(loss.mean(), np.mean((1.5 * gap - ref_gap) ** 2) + np.mean((h_policy - h_ref) ** 2),
                               rtol=1e-5)


def test_mpo_fixed_point_has_zero_loss_and_gradient():
    beta = 1.5
    pc, pr, lc, lr = jnp.array([-6.0, -9.0]), jnp.array([-12.0, -10.0]), jnp.array([3.0, 4.0]), jnp.array([4.0, 2.0])
    dominant = beta * (pc / lc - pr / lr)
    hidden = jnp.ones((2, 2, 4))

    def total(chosen, h):
        return losses.mpo(chosen, pr, lc, lr, dominant, beta=beta, policy_hidden=h, ref_hidden=hidden)[0].sum()

    assert float(total(pc, hidden)) == pytest.approx(0.0, abs=1e-10)
    grads = jax.grad(total, argnums=(0, 1))(pc, hidden)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in grads)
    with pytest.raises(ValueError, match="both"):
        losses.mpo(pc, pr, lc, lr, dominant, policy_hidden=hidden)


@pytest.mark.parametrize("name", ["dpo", "simpo", "orpo", "mpo", "ift", "sft"])
def test_jit_matches_eager(name):
    pc, pr, rc, rr, lc, lr = random_pairs(3)
    ell = np.abs(np.random.RandomState(3).randn(8, 6)).astype(np.float32)
    mask = np.ones((8, 6), np.int32)
    calls = {
        "dpo": lambda: losses.dpo(pc, pr, rc, rr, beta=0.2, label_smoothing=0.1),
        "simpo": lambda: losses.simpo(pc, pr, lc, lr),
        "orpo": lambda: losses.orpo(pc, pr, lc, lr),
        "mpo": lambda: losses.mpo(pc, pr, lc, lr, rc / lc - rr / lr, beta=1.5),
        "ift": lambda: losses.ift(ell, mask),
        "sft": lambda: losses.sft(-ell, mask),
    }
    eager_loss, eager_metrics = calls[name]()
    jit_loss, jit_metrics = jax.jit(calls[name])()
    np.testing.assert_allclose(jit_loss, eager_loss, rtol=1e-6)
    assert eager_loss.dtype == jnp.float32 and eager_loss.shape == (8,)
    for key in eager_metrics:
        np.testing.assert_allclose(jit_metrics[key], eager_metrics[key], rtol=1e-6)


@pytest.mark.parametrize(("tile", "block", "scale", "cap", "logit_scale"),
                         [(5, 4, 1.0, 0.0, 1.0), (13, 23, 1.0, 0.0, 1.0), (64, 1024, 1.0, 0.0, 1.0),
                          (7, 6, 30.0, 0.0, 1.0), (5, 4, 1.0, 2.0, 1.0), (13, 6, 3.0, 5.0, 1 / 0.7)])
def test_fused_head_matches_pytorch_log_softmax_and_autograd(tile, block, scale, cap, logit_scale):
    """``fused_head_logps`` (valid rows gathered into blocks, vocabulary tiles, online log-sum-exp, hand-written
    backward) against PyTorch's log_softmax + gather and its autograd, with tiles and blocks that do not divide
    V and N and (scale 30) logits in the hundreds, where a naive exp overflows; with Gemma 2's final soft-cap
    (``cap · tanh(z / cap)``, at logits well past the cap) and a temperature after it. Invalid rows give 0 and no
    gradient."""
    torch = pytest.importorskip("torch")
    rng = np.random.RandomState(tile)
    hidden = rng.randn(23, 8).astype(np.float32) * scale
    kernel = rng.randn(8, 61).astype(np.float32)
    targets = rng.randint(0, 61, 23)
    valid = rng.rand(23) > 0.3
    upstream = rng.randn(23).astype(np.float32)

    logps, vjp = jax.vjp(lambda h, k: losses.fused_head_logps(h, k, jnp.asarray(targets), jnp.asarray(valid), tile,
                                                              block, cap, logit_scale),
                         jnp.asarray(hidden), jnp.asarray(kernel))
    grad_hidden, grad_kernel = vjp(jnp.asarray(upstream))

    th, tk = torch.tensor(hidden, requires_grad=True), torch.tensor(kernel, requires_grad=True)
    logits = th @ tk
    if cap:  # as transformers' Gemma2ForCausalLM: logits / cap, tanh, * cap
        logits = torch.tanh(logits / cap) * cap
    expected = torch.log_softmax(logits * logit_scale, -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]
    expected = expected * torch.tensor(valid)
    expected.backward(torch.tensor(upstream))
    np.testing.assert_allclose(logps, expected.detach().numpy(), rtol=1e-5, atol=1e-4 * scale)
    np.testing.assert_allclose(grad_hidden, th.grad.numpy(), rtol=1e-4, atol=1e-4 * scale)
    np.testing.assert_allclose(grad_kernel, tk.grad.numpy(), rtol=1e-4, atol=1e-4 * scale)
    assert np.all(np.asarray(logps)[~valid] == 0) and np.all(np.asarray(grad_hidden)[~valid] == 0)
    if cap:
        assert np.abs((th.detach() @ tk.detach()).numpy()).max() > 2 * cap  # the cap bends the logits here


def test_fused_head_in_bfloat16_follows_the_plain_path():
    rng = np.random.RandomState(0)
    hidden = jnp.asarray(rng.randn(2, 16, 32), jnp.bfloat16)
    kernel = jnp.asarray(rng.randn(32, 300) * 0.2, jnp.float32)
    tokens = jnp.asarray(rng.randint(0, 300, (2, 16)))
    mask = jnp.ones((2, 16), jnp.int32)
    plain = lambda h, k: losses.token_logps((h @ k.astype(h.dtype)).astype(jnp.float32), tokens, mask)
    fused = lambda h, k: losses.token_logps_from_hidden(h, k, tokens, mask, chunk_size=128)
    assert fused(hidden, kernel).dtype == jnp.float32
    np.testing.assert_allclose(fused(hidden, kernel), plain(hidden, kernel), atol=0.1)
    grads = jax.grad(lambda h, k: fused(h, k).sum(), argnums=(0, 1))(hidden, kernel)
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32
    reference = jax.grad(lambda h, k: plain(h.astype(jnp.float32), k).sum(), argnums=(0, 1))(hidden, kernel)
    np.testing.assert_allclose(grads[1], reference[1], atol=0.1, rtol=0.05)


def test_tiled_greedy_breaks_ties_like_argmax():
    hidden = jnp.ones((1, 2, 1))
    kernel = jnp.asarray([[0.0, 3.0, 1.0, 3.0, 3.0, 2.0]])  # the maximum at ids 1, 3 and 4, across tiles of 2
    assert losses.greedy_from_hidden(hidden, kernel, chunk_size=2).tolist() == [[1, 1]]
    assert losses.greedy_from_hidden(-hidden, kernel, chunk_size=4).tolist() == [[0, 0]]


def test_fused_head_on_a_mesh_equals_one_device():
    """On a mesh of 8 devices (batch sharded) the fused head keeps rows in place in one block; values and
    gradients equal the single-device path, which gathers the trained rows into blocks."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxalign.parallel import make_mesh

    rng = np.random.RandomState(0)
    hidden = jnp.asarray(rng.randn(8, 12, 16), jnp.float32)
    kernel = jnp.asarray(rng.randn(16, 70) * 0.3, jnp.float32)
    tokens = jnp.asarray(rng.randint(0, 70, (8, 12)))
    mask = jnp.asarray(np.arange(12)[None, :] >= rng.randint(1, 8, (8, 1)))  # prompts of different lengths
    loss = lambda h, k: (losses.token_logps_from_hidden(h, k, tokens, mask, chunk_size=32) ** 2).sum()
    single = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(hidden, kernel)
    mesh = make_mesh({"data": -1})
    with jax.set_mesh(mesh):
        sharded = jax.device_put(hidden, NamedSharding(mesh, PartitionSpec("data")))
        on_mesh = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(sharded, kernel)
    for a, b in zip(jax.tree.leaves(on_mesh), jax.tree.leaves(single), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cap", [0.0, 1.5])
def test_log_sum_sq_probs_tiled_equals_whole_with_and_without_a_soft_cap(cap):
    """WPO's ``log Σ p²``: vocabulary tiles (7 columns, not dividing V) equal the whole logits, soft-capped alike."""
    rng = np.random.RandomState(3)
    hidden = jnp.asarray(rng.randn(2, 5, 8) * 2, jnp.float32)
    kernel = jnp.asarray(rng.randn(8, 61), jnp.float32)
    whole = losses.log_sum_sq_probs(hidden, kernel, softcap=cap)
    np.testing.assert_allclose(losses.log_sum_sq_probs(hidden, kernel, chunk_size=7, softcap=cap), whole, rtol=1e-5,
                               atol=1e-6)
    logits = np.asarray(hidden[:, :-1] @ kernel, np.float64)
    logits = cap * np.tanh(logits / cap) if cap else logits
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(whole[:, 1:], np.log((probs ** 2).sum(-1)), rtol=1e-5, atol=1e-6)
