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


def test_bad_inputs_are_reported(model):
    tokens, mask = left_padded_prompts()
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, tokens, prompt_mask=mask[:, ::-1], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, tokens, max_new_tokens=0)
