"""KV-cache generation against the plain full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign.models import create_model
from jaxalign.sampling import generate, sample_logits


@pytest.fixture(scope="module")
def model(tiny_config):
    return create_model(tiny_config, seed=11)


def left_padded_prompts():
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, 128, (3, 7))
    mask = np.ones_like(tokens)
    mask[1, :2] = 0
    mask[2, :5] = 0
    return np.where(mask == 1, tokens, 0), mask


def greedy_without_cache(model, tokens, mask, steps):
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    out = []
    for _ in range(steps):
        next_token = jnp.argmax(model(tokens, mask)[:, -1], axis=-1)
        out.append(next_token)
        tokens = jnp.concatenate([tokens, next_token[:, None]], axis=1)
        mask = jnp.concatenate([mask, jnp.ones_like(mask[:, :1])], axis=1)
    return np.stack(out, axis=1)


def test_greedy_matches_full_forward(model):
    tokens, mask = left_padded_prompts()
    got = generate(model, tokens, prompt_mask=mask, max_new_tokens=6)
    np.testing.assert_array_equal(got, greedy_without_cache(model, tokens, mask, 6))


def test_eos_pads_the_rest(model):
    tokens, mask = left_padded_prompts()
    free = np.asarray(generate(model, tokens, prompt_mask=mask, max_new_tokens=6))
    eos = int(free[0, 2])
    got = np.asarray(generate(model, tokens, prompt_mask=mask, max_new_tokens=6, eos_id=eos, pad_id=-1))
    for row in range(3):
        hits = np.flatnonzero(free[row] == eos)
        stop = hits[0] + 1 if len(hits) else 6
        np.testing.assert_array_equal(got[row, :stop], free[row, :stop])
        assert (got[row, stop:] == -1).all()


def test_sampling_settings(model):
    tokens, mask = left_padded_prompts()
    greedy = generate(model, tokens, prompt_mask=mask, max_new_tokens=5)
    top1 = generate(model, tokens, prompt_mask=mask, max_new_tokens=5, temperature=1.0, top_k=1, seed=3)
    nucleus = generate(model, tokens, prompt_mask=mask, max_new_tokens=5, temperature=0.7, top_p=1e-6, seed=4)
    np.testing.assert_array_equal(top1, greedy)
    np.testing.assert_array_equal(nucleus, greedy)
    a = generate(model, tokens, prompt_mask=mask, max_new_tokens=5, temperature=1.0, seed=5)
    b = generate(model, tokens, prompt_mask=mask, max_new_tokens=5, temperature=1.0, seed=5)
    np.testing.assert_array_equal(a, b)


def test_sample_logits_support():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 2000)

    def draw(keys, **settings):
        return jax.vmap(lambda k: sample_logits(logits, k, temperature=1.0, **settings)[0])(keys)

    assert set(np.unique(draw(keys, top_k=2)).tolist()) == {0, 1}
    assert set(np.unique(draw(keys, top_p=0.7)).tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8
    counts = np.bincount(np.asarray(draw(keys)), minlength=4) / 2000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.04)


def test_sample_logits_draws_the_tempered_distribution_and_never_an_excluded_token():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(64))
    logits = np.log(probs).astype(np.float32)
    logits[[0, 17, 63]] = -np.inf  # excluded ends and middle (as top-k / top-p exclude them)
    rows = 100_000
    draws = np.asarray(sample_logits(jnp.asarray(np.tile(logits, (rows, 1))), jax.random.key(1), temperature=0.5))
    expected = np.exp(2 * logits) / np.exp(2 * logits).sum()
    counts = np.bincount(draws, minlength=64) / rows
    assert counts[[0, 17, 63]].sum() == 0
    assert np.max(np.abs(counts - expected) / np.sqrt(expected * (1 - expected) / rows + 1e-12)) < 5  # 5 sigma


def test_bad_inputs_are_reported(model):
    tokens, mask = left_padded_prompts()
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, tokens, prompt_mask=mask[:, ::-1], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, tokens, max_new_tokens=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral",
                                  "qwen3_moe"])
def test_greedy_equals_transformers_generate(arch, tmp_path):
    torch = pytest.importorskip("torch")
    from torch_reference import make_reference

    from jaxalign.models import load_hf

    reference = make_reference(arch, tmp_path, seed=4)
    model = load_hf(tmp_path)
    rng = np.random.RandomState(1)
    lengths = [9, 5, 7]
    tokens = np.zeros((3, 9), np.int64)
    mask = np.zeros((3, 9), np.int64)
    for row, n in enumerate(lengths):
        tokens[row, 9 - n:] = rng.randint(3, 128, n)
        mask[row, 9 - n:] = 1
    reference.generation_config.eos_token_id = None  # run all 32 steps, with no EOS suppression either
    with torch.no_grad():
        expected = reference.generate(torch.tensor(tokens), attention_mask=torch.tensor(mask), max_new_tokens=32,
                                      do_sample=False, pad_token_id=0)[:, 9:].numpy()
    got = np.asarray(generate(model, tokens, prompt_mask=mask, max_new_tokens=32))
    np.testing.assert_array_equal(got, expected)


def test_decoding_compiles_once_for_any_length(model):
    from jaxalign.sampling.generate import _generate

    tokens, mask = left_padded_prompts()
    generate(model, tokens, prompt_mask=mask, max_new_tokens=16)
    compiled = _generate._cache_size()
    long = generate(model, tokens, prompt_mask=mask, max_new_tokens=64)
    generate(model, tokens, prompt_mask=mask, max_new_tokens=3)
    assert _generate._cache_size() == compiled
    assert long.shape == (3, 64)


def test_samples_logps_and_top1(model):
    from jaxalign.sampling import sample

    tokens, mask = left_padded_prompts()
    greedy = sample(model, tokens, prompt_mask=mask, max_new_tokens=5)
    np.testing.assert_allclose(np.exp(greedy.logps), greedy.top1_probs, rtol=1e-5)  # greedy picks the top token
    full = model(jnp.asarray(np.concatenate([tokens, np.asarray(greedy.tokens)], 1)),
                 jnp.asarray(np.concatenate([mask, np.ones((3, 5), mask.dtype)], 1)))
    expected = jax.nn.log_softmax(full[:, 6:-1], -1)
    chosen = jnp.take_along_axis(expected, greedy.tokens[:, :, None], -1)[..., 0]
    np.testing.assert_allclose(greedy.logps, chosen, atol=1e-5)
    many = sample(model, tokens, prompt_mask=mask, max_new_tokens=6, temperature=1.0, seed=7, num_samples=4)
    again = sample(model, tokens, prompt_mask=mask, max_new_tokens=6, temperature=1.0, seed=7, num_samples=4)
    assert many.tokens.shape == (12, 6)
    np.testing.assert_array_equal(many.tokens, again.tokens)
    assert len({tuple(r) for r in np.asarray(many.tokens[:4])}) > 1  # different samples of one prompt
    eos = int(greedy.tokens[0, 1])
    stopped = sample(model, tokens, prompt_mask=mask, max_new_tokens=5, eos_id=eos)
    assert int(stopped.lengths[0]) == int(np.flatnonzero(np.asarray(greedy.tokens[0]) == eos)[0]) + 1


def test_truncate_at_stop():
    from jaxalign.sampling import truncate_at_stop

    assert truncate_at_stop("The answer is 5.\nUser: hi", ["\nUser:", "###"]) == "The answer is 5."
    assert truncate_at_stop("no stops here", ["###"]) == "no stops here"


def test_sampling_logps_and_entropy_are_of_the_tempered_distribution(model):
    from jaxalign.sampling import sample

    tokens, mask = left_padded_prompts()
    out = sample(model, tokens, prompt_mask=mask, max_new_tokens=4, temperature=0.7, seed=3)
    full = model(jnp.asarray(np.concatenate([tokens, np.asarray(out.tokens)], 1)),
                 jnp.asarray(np.concatenate([mask, np.ones((3, 4), mask.dtype)], 1)))[:, 6:-1]
    tempered = jax.nn.log_softmax(full / 0.7, -1)
    chosen = jnp.take_along_axis(tempered, out.tokens[:, :, None], -1)[..., 0]
    np.testing.assert_allclose(out.sampling_logps, chosen, atol=1e-5)
    np.testing.assert_allclose(out.entropy, -(jnp.exp(tempered) * tempered).sum(-1), atol=1e-4)
    np.testing.assert_allclose(out.logps, jnp.take_along_axis(jax.nn.log_softmax(full, -1),
                                                              out.tokens[:, :, None], -1)[..., 0], atol=1e-5)


def test_stop_string_lengths_cut_after_the_token_that_completes_a_stop():
    from jaxalign.sampling import stop_string_lengths

    vocab = {1: "The", 2: " answer", 3: "\n", 4: "User", 5: ":", 6: " hi", 7: "#", 8: "x"}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    tokens = np.array([[1, 2, 3, 4, 5, 6], [1, 2, 7, 7, 8, 8], [1, 2, 8, 8, 0, 0], [7, 7, 7, 0, 0, 0]])
    lengths = np.array([6, 6, 4, 2])
    got = stop_string_lengths(tokens, lengths, ["\nUser:", "##"], decode)
    # "\nUser:" is complete with token 5 (index 4); "##" with the second "#"; no stop; the stop lies past the length
    np.testing.assert_array_equal(got, [5, 4, 4, 2])
    np.testing.assert_array_equal(stop_string_lengths(tokens, lengths, [], decode), lengths)


def test_cache_buckets_are_few_and_leave_at_most_a_third_unused():
    from jaxalign.sampling.generate import cache_bucket

    sizes = [cache_bucket(n) for n in range(1, 5000)]
    assert sorted(set(sizes))[:7] == [128, 192, 256, 384, 512, 768, 1024]
    assert len(set(sizes)) == 12  # 128 ... 6144: two sizes per doubling
    assert all(size >= n and (n <= 128 or 3 * (size - n) <= size) for n, size in enumerate(sizes, 1))
    assert sizes == sorted(sizes)


def test_int8_weights_quantize_per_output_channel_and_decode():
    from flax import nnx

    from jaxalign.models import LlamaConfig, lora
    from jaxalign.models.llama import int8_weights
    from jaxalign.sampling import decoding_model, sample

    kernel = jax.random.normal(jax.random.key(0), (16, 3, 4)) * jnp.arange(1, 13).reshape(3, 4)
    q, scale = int8_weights(kernel, 1)
    assert q.dtype == jnp.int8 and scale.shape == (3, 4)
    assert int(jnp.abs(q).max()) == 127  # each channel's largest weight maps to +-127
    assert bool(jnp.all(jnp.abs(q * scale - kernel) <= scale / 2 + 1e-6))  # rounding: half a step at most
    q, scale = int8_weights(jnp.zeros((4, 2)), 1)
    assert float(jnp.abs(q).max()) == 0 and np.all(np.asarray(scale) == 1)

    for tied, scanned in ((True, True), (False, True), (True, False)):  # scanned layers: int8 unrolls them
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                             num_kv_heads=2, scan_layers=scanned, tie_word_embeddings=tied)
        model = create_model(config, seed=3)
        int8 = decoding_model(model, weights="int8")
        leaves = jax.tree.leaves(nnx.state(int8))
        float_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
        assert sum(x.nbytes for x in leaves) < 0.3 * float_bytes  # int8 kernels and float32 scales, norms
        tokens, mask = left_padded_prompts()
        full, quantized = model(tokens, mask), int8(tokens, mask)
        assert float(jnp.abs(quantized - full).max()) < 0.1 * float(jnp.abs(full).max())
        expected = greedy_without_cache(int8, tokens, mask, 6)  # the int8 model's own function, with a cache
        np.testing.assert_array_equal(sample(model, tokens, prompt_mask=mask, max_new_tokens=6,
                                             weights="int8").tokens, expected)
        assert str(model.embed_tokens[...].dtype) == "float32"  # the model itself is untouched

    with_adapters = lora.attach(model, lora.LoRAConfig(rank=2, targets=("q_proj",)), nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"int8.*LoRA"):
        decoding_model(with_adapters, weights="int8")
    with pytest.raises(ValueError, match="int8"):
        decoding_model(create_model(config.replace(scan_layers=True), seed=3), weights="int8", layers="scanned")
