"""``nudge``'s default order against a restatement of the official ``completion_with_nudging`` (fywalter/nudging @
2ffbf1f, ``utils.py``), run on the same two tiny local models through an OpenAI-completions-shaped shim.

The restatement keeps the official control flow line for line (its variable names, its stage-1 acceptance test,
``complete_with_base``'s chunk loop, its repetition heuristics and ``remove_redundant_repetitions``); only the
API calls go to the local models, and token budgets are counted with the base model's tokenizer instead of
GPT-3.5's ``tiktoken`` (the one deliberate difference, also jaxalign's).
"""
# the official lines are kept as written, so the linter's simplifications are not applied here
# ruff: noqa: SIM103, SIM108, SIM210, RUF015

import math
import types

import numpy as np
import pytest
from test_nudging import PROMPT, models  # noqa: F401 (fixture)

from jaxalign.sampling import nudge


# ------------------------------------------------------------------ the API, served by a local TextModel
class Completions:
    def __init__(self, text_model):
        self.text_model = text_model

    def create(self, model, prompt, max_tokens, temperature, logprobs, top_p=None):
        assert temperature == 0.0
        out = self.text_model.continue_text(prompt, max_tokens)
        # as vLLM's OpenAI server answers: the EOS is the last listed token (decoded as ""), not in the text
        tokens = [*out.token_texts, ""] if out.ended else out.token_texts
        top_logprobs = [{token: math.log(max(p, 1e-30))} for token, p in zip(tokens, out.top1, strict=True)]
        choice = types.SimpleNamespace(text=out.text, finish_reason="stop" if out.ended else "length",
                                       logprobs=types.SimpleNamespace(tokens=tokens, top_logprobs=top_logprobs))
        return types.SimpleNamespace(choices=[choice])


class Client:
    def __init__(self, text_model):
        self.completions = Completions(text_model)


# ------------------------------------------------------------------------- official utils.py, restated
NUM_LOGPROBS = {"top_prob": 1}


class Encoding:
    def __init__(self, text_model):
        self.text_model = text_model

    def encode(self, text):
        return [0] * self.text_model.count_tokens(text)


def find_longest_repeated_suffix(s):
    def has_repeated(s, length):
        if length < 30:
            return False
        suffix = s[-length:]
        return s[:-length].endswith(suffix)

    left, right = 0, len(s)
    result = 0
    while left <= right:
        mid = (left + right) // 2
        if has_repeated(s, mid):
            result = mid
            left = mid + 1
        else:
            right = mid - 1
    if result > 0:
        return s[-result:]
    return None


def remove_redundant_repetitions(s):
    s = s.strip()
    longest_repeated_suffix = find_longest_repeated_suffix(s)
    while longest_repeated_suffix:
        s = s[:-len(longest_repeated_suffix)]
        longest_repeated_suffix = find_longest_repeated_suffix(s)
    return s


def repetition_check(new_completion, full_prefix, subseq_len=5):
    words = new_completion.split(" ")
    if len(words) > subseq_len and new_completion in full_prefix:
        return True
    return False


def check_need_nudging(nudging_method, base_token_id, current_base_info, thresholds):
    sorted_base_top_logprobs = {k: v for k, v in sorted(current_base_info["top_logprobs"][base_token_id].items(),
                                                        key=lambda item: item[1], reverse=True)}
    base_top_prob = np.exp(list(sorted_base_top_logprobs.values())[0])
    return base_top_prob < thresholds["top_prob"]


def complete_with_base(encoding, nudging_method, base_model, full_prefix_base, output, current_base_info,
                       max_completion_token, completion_token_num, client_base, thresholds, temperature, top_p):
    completion_base = "" if len(current_base_info["completion"]) == 0 else current_base_info["tokens"][0]
    found_nudging_token = False
    response = None
    has_acc_token_stage_1 = True if len(current_base_info["completion"]) > 0 else False
    while len(encoding.encode(completion_base)) < max_completion_token and not found_nudging_token:
        if current_base_info["completion"] == "":
            response = client_base.completions.create(model=base_model, prompt=full_prefix_base + output
                                                      + completion_base, max_tokens=completion_token_num,
                                                      temperature=temperature,
                                                      logprobs=current_base_info["num_logprobs"], top_p=top_p)
            current_base_info["tokens"] = response.choices[0].logprobs.tokens
            current_base_info["top_logprobs"] = response.choices[0].logprobs.top_logprobs
            current_base_info["completion"] = response.choices[0].text
        if has_acc_token_stage_1:
            current_base_info["tokens"] = current_base_info["tokens"][1:]
            current_base_info["top_logprobs"] = current_base_info["top_logprobs"][1:]
            current_base_info["completion"] = "".join(current_base_info["tokens"])
            has_acc_token_stage_1 = False
        completion = current_base_info["completion"]
        tokens = current_base_info["tokens"]
        if completion in completion_base:
            break
        nudging_position = -1
        for base_idx in range(len(tokens)):
            found_nudging_token = check_need_nudging(nudging_method=nudging_method, base_token_id=base_idx,
                                                     current_base_info=current_base_info, thresholds=thresholds)
            if found_nudging_token:
                nudging_position = base_idx
                break
        if nudging_position == -1:
            new_completion = "".join(tokens)
        else:
            new_completion = "".join(tokens[:nudging_position])
        if repetition_check(new_completion, output + completion_base):
            break
        else:
            completion_base += new_completion
        if response is not None and response.choices[0].finish_reason == "stop":
            break
        current_base_info["completion"] = ""
        current_base_info["tokens"] = []
        current_base_info["top_logprobs"] = []
    return completion_base


def completion_with_nudging(encoding, full_prefix_base, full_prefix_nudging, completion_token_num=16,
                            completion_token_num_nudging=16, max_token_total=256, client_base=None,
                            client_nudging=None, max_round=150, top_prob_thres=0.3, nudging_method="top_prob",
                            base_model="base", nudging_model="nudging", top_p=0.9):
    thresholds = {"top_prob": top_prob_thres}
    output = ""
    nudging_round = 0
    current_nudging_info = {"completion": "", "tokens": [], "top_logprobs": [], "stop_reason": None,
                            "num_logprobs": NUM_LOGPROBS[nudging_method]}
    repeat_nudging_word = 0
    last_nudging_word = ""
    while len(encoding.encode(output)) < max_token_total and nudging_round < max_round:
        nudging_round += 1
        if current_nudging_info["completion"] == "":
            response = client_nudging.completions.create(model=nudging_model, prompt=full_prefix_nudging + output,
                                                         max_tokens=completion_token_num_nudging, temperature=0.0,
                                                         logprobs=current_nudging_info["num_logprobs"])
            current_nudging_info["completion"] = response.choices[0].text
            current_nudging_info["tokens"] = response.choices[0].logprobs.tokens
            current_nudging_info["top_logprobs"] = response.choices[0].logprobs.top_logprobs
            current_nudging_info["stop_reason"] = response.choices[0].finish_reason
        if current_nudging_info["stop_reason"] == "stop":
            if len(current_nudging_info["completion"]) > 0:
                output += current_nudging_info["completion"]
            break
        found_acc_token = False
        current_base_info = {"completion": "", "tokens": [], "top_logprobs": [],
                             "num_logprobs": NUM_LOGPROBS[nudging_method]}
        nudging_text = current_nudging_info["completion"]
        num_whitespaces = len(nudging_text) - len(nudging_text.lstrip(" "))
        space_prefix = " " * num_whitespaces
        current_nudging_words = nudging_text.lstrip(" ").split(" ")
        nudging_word_id = 0 if len(current_nudging_words) > 1 else 1
        while not found_acc_token and nudging_word_id < len(current_nudging_words) - 1:
            nudging_word_id += 1
            nudging_gen_prefix = space_prefix + " ".join(current_nudging_words[:nudging_word_id])
            current_nudging_word = " " + current_nudging_words[nudging_word_id]
            if current_nudging_word == " ":
                continue
            prefix = full_prefix_base + output + nudging_gen_prefix
            response = client_base.completions.create(model=base_model, prompt=prefix,
                                                      max_tokens=completion_token_num, temperature=0.0,
                                                      logprobs=current_base_info["num_logprobs"], top_p=top_p)
            current_base_info["tokens"] = response.choices[0].logprobs.tokens
            current_base_info["top_logprobs"] = response.choices[0].logprobs.top_logprobs
            current_base_info["completion"] = response.choices[0].text
            first_base_token = current_base_info["tokens"][0]
            if current_nudging_word.startswith(first_base_token):
                found_acc_token = True
            else:
                found_acc_token = not check_need_nudging(nudging_method, base_token_id=0,
                                                         current_base_info=current_base_info,
                                                         thresholds=thresholds)
        nudging_words = space_prefix + " ".join(current_nudging_words[:nudging_word_id])
        if nudging_words == last_nudging_word:
            repeat_nudging_word += 1
            if repeat_nudging_word >= 3:
                break
        else:
            last_nudging_word = nudging_words
            repeat_nudging_word = 0
        output += nudging_words
        if not found_acc_token:
            current_nudging_info = {"completion": "", "tokens": [], "logprobs": [], "stop_reason": None,
                                    "num_logprobs": NUM_LOGPROBS[nudging_method]}
            continue
        if current_base_info["completion"] == "":
            current_nudging_info = {"completion": "", "tokens": [], "logprobs": [], "stop_reason": None,
                                    "num_logprobs": NUM_LOGPROBS[nudging_method]}
            continue
        max_completion_token = max_token_total - len(encoding.encode(output))
        completion_base = complete_with_base(encoding, nudging_method, base_model, full_prefix_base, output,
                                             current_base_info, max_completion_token, completion_token_num,
                                             client_base, thresholds, 0.0, top_p)
        # complete_with_base hands back EMPTY_INFO_DICT for top_prob: the next round asks the nudging model afresh
        current_nudging_info = {"completion": "", "tokens": [], "top_logprobs": [], "stop_reason": None,
                                "num_logprobs": NUM_LOGPROBS[nudging_method]}
        output += completion_base
    return remove_redundant_repetitions(output)


# ------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("gamma", [0.0, 0.4, 0.7, 1.01])
def test_default_order_equals_the_official_code_text_for_text(models, gamma):  # noqa: F811
    base, nudger, nudger_prompt = models
    budget = 40
    official = completion_with_nudging(Encoding(base), PROMPT, nudger_prompt, completion_token_num=6,
                                       completion_token_num_nudging=8, max_token_total=budget,
                                       client_base=Client(base), client_nudging=Client(nudger), max_round=12,
                                       top_prob_thres=gamma)
    ours = nudge(base, nudger, PROMPT, nudger_prompt, gamma=gamma, lookahead=8, chunk=6, max_tokens=budget,
                 max_rounds=12)
    assert ours.text == official
    assert ours.rounds >= 1 and ours.nudger_tokens > 0  # the nudging model writes first, at every γ


def test_gamma_zero_takes_the_nudgers_first_word_then_the_base(models):  # noqa: F811
    base, nudger, nudger_prompt = models
    look = nudger.continue_text(nudger_prompt, 8)
    first = look.text.lstrip(" ").split(" ")[0]
    ours = nudge(base, nudger, PROMPT, nudger_prompt, gamma=0.0, lookahead=8, chunk=6, max_tokens=40, max_rounds=12)
    assert ours.text.startswith(first.strip() or ours.text[:1])
    with pytest.raises(ValueError, match="order="):
        nudge(base, nudger, PROMPT, nudger_prompt, order="interleaved")


def test_final_clean_up_equals_the_official_function():
    from jaxalign.sampling.nudging import remove_redundant_repetitions as ours

    unit = "and the answer is five, I am quite sure. "
    for text in ["  Start. " + unit * 4, "short short short", "x" * 70, " The answer is 5.\n", "ab" * 40 + "c"]:
        assert ours(text) == remove_redundant_repetitions(text), text
