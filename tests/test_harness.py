"""lm-evaluation-harness over jaxalign models: the harness's scoring conventions checked against a direct
computation, rolling windows, generation, and simple_evaluate on local YAML tasks."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from jaxalign.cli import main  # noqa: E402
from jaxalign.data.toy import toy_tokenizer  # noqa: E402
from jaxalign.harness import JaxalignLM, evaluate  # noqa: E402
from jaxalign.models import LlamaConfig, create_model, save_hf  # noqa: E402
from jaxalign.sampling import generate  # noqa: E402

CONFIG = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def lm():
    return JaxalignLM(create_model(CONFIG, seed=1), toy_tokenizer(), batch_size=4, max_length=64)


def request(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def direct_logprob(model, context, continuation):
    """log p(continuation | context) and greedy, from one forward pass over the concatenation (numpy)."""
    tokens = np.asarray(context + continuation)
    logits = np.asarray(model(jnp.asarray(tokens[None])), np.float64)[0]
    logps = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    positions = range(len(context) - 1, len(tokens) - 1)
    total = sum(logps[p, tokens[p + 1]] for p in positions)
    return total, all(logits[p].argmax() == tokens[p + 1] for p in positions)


def test_loglikelihood_follows_the_harness_conventions(lm):
    _, continuation = lm.encode_pair("Question: 2 + 2 = ", "4")
    assert lm.tokenizer.decode(continuation).startswith(" ")  # the trailing space moved to the continuation
    assert lm.encode_pair("", "hi")[0] == [lm.eot_token_id]
    requests = [request("loglikelihood", "Question: 2 + 2 = ", "4"), request("loglikelihood", "", "hello"),
                request("loglikelihood", "A" * 80, " long context")]  # cut from the left to max_length
    results = lm.loglikelihood(requests)
    for (logp, greedy), req in zip(results[:2], requests[:2], strict=True):
        expected, expected_greedy = direct_logprob(lm.model, *lm.encode_pair(*req.args))
        assert logp == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy
    cut_context, cont = lm.encode_pair(*requests[2].args)
    expected, _ = direct_logprob(lm.model, (cut_context + cont)[-65:][: -len(cont)], cont)
    assert results[2][0] == pytest.approx(expected, abs=1e-4)


def test_rolling_loglikelihood_is_the_sum_over_windows(lm):
    text = "The quick brown fox jumps over the lazy dog."
    [whole] = lm.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    expected, _ = direct_logprob(lm.model, [lm.eot_token_id], lm.tok_encode(text))
    assert whole == pytest.approx(expected, abs=1e-4)
    short = JaxalignLM(lm.model, lm.tokenizer, batch_size=4, max_length=16)
    [windowed] = short.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    assert np.isfinite(windowed) and windowed < 0


def test_generate_until_is_greedy_decoding_cut_at_the_stop(lm):
    prompt = "Question: what is 3 + 4?"
    [text] = lm.generate_until([request("generate_until", prompt, {"until": ["\n"], "max_gen_toks": 12})])
    ids = lm.tok_encode(prompt)
    out = np.asarray(generate(lm.model, np.asarray([ids]), max_new_tokens=12, eos_id=lm.tokenizer.eos_token_id,
                              pad_id=lm.pad_id))
    assert text == lm.tokenizer.decode(out[0], skip_special_tokens=True).split("\n")[0]


@pytest.mark.slow
def test_simple_evaluate_runs_local_yaml_tasks(lm, tmp_path):
    rows = [{"question": f"What is {a} + {b}?", "choices": [str(a + b), str(a + b + 1)], "answer": 0}
            for a, b in [(1, 2), (3, 4), (5, 6), (7, 1)]]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "sums_choice.yaml").write_text(
        "task: sums_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}} Answer:'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    (tmp_path / "sums_gen.yaml").write_text(
        "task: sums_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: generate_until\n"
        "doc_to_text: '{{question}} Answer:'\ndoc_to_target: '{{choices[0]}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 4\n"
        "metric_list:\n  - metric: exact_match\n")
    results = evaluate(lm.model, lm.tokenizer, ["sums_choice", "sums_gen"], include_path=str(tmp_path),
                       batch_size=4, max_length=64)["results"]
    assert 0 <= results["sums_choice"]["acc,none"] <= 1 and 0 <= results["sums_gen"]["exact_match,none"] <= 1

    save_hf(lm.model, tmp_path / "model", tokenizer=lm.tokenizer)  # the same through the command line
    out = tmp_path / "results.json"
    assert main(["eval", "--lm-eval", "sums_choice", "--include-path", str(tmp_path), "--model",
                 str(tmp_path / "model"), "--batch-size", "4", "--max-length", "64", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["results"]["sums_choice"]["acc,none"] == results["sums_choice"]["acc,none"]
