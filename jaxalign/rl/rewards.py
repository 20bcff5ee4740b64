"""Verifiable rewards for online RL: ``reward(prompts, completions, **fields) -> list[float | None]``.

A reward is any callable taking the batch's prompts and completions (lists of strings, one entry per completion;
a prompt repeats for each of its completions) and, as keyword lists of the same length, the record's other
columns (``answer``, ``test``, ``entry_point`` ...) plus ``completion_lengths`` (completion tokens). It returns one
float per completion, or ``None`` where it cannot score one (TRL's semantics: such a completion is left out of the
group statistics and gets advantage 0). Rewards are named in a config by built-in name or dotted path
(``resolve``) and combined with weights (``score``).

Built in: ``exact_number`` (toy arithmetic, GSM8K's ``#### 42``), ``math`` (equivalence with the ``math-verify``
package, as TRL's ``accuracy_reward``), ``think_answer_format`` and ``regex_format(pattern)``,
``soft_overlong_penalty(max_length, cache)`` (DAPO, Eq. 13), ``reward_model:PATH`` (a trained reward model's
score, ``jaxalign.rl.reward_model``) and ``code_tests`` (a completion run against its
record's tests in a subprocess with a time and memory limit; HumanEval's ``prompt`` / ``test`` / ``entry_point``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np

Reward = Callable[..., Sequence[float | None]]


class RewardError(ValueError):
    """A reward function raised or returned something that is not one float (or None) per completion; the message
    names the reward, the record and the problem."""


# ---------------------------------------------------------------------------------------------- exact numbers
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> Decimal | None:
    """The first number after the last ``####`` (GSM8K), else the last number in ``text``; commas dropped."""
    numbers = _NUMBER.findall(text.rsplit("####", 1)[1])[:1] if "####" in text else _NUMBER.findall(text)[-1:]
    if not numbers:
        return None
    try:
        return Decimal(numbers[0].replace(",", ""))
    except InvalidOperation:
        return None


def exact_number(prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[Any] | None = None,
                 **_fields) -> list[float | None]:
    """1.0 when the completion's final number equals the record's ``answer`` (a number, or text ending in one or
    in ``#### N``), else 0.0; None for a record without a usable answer."""
    if answer is None:
        return [None] * len(completions)
    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        target = None if gold is None else final_number(str(gold))
        if target is None:
            out.append(None)
            continue
        got = final_number(completion)
        out.append(float(got is not None and got == target))
    return out


# ------------------------------------------------------------------------------------------------ math-verify
def math_equivalence(prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[Any] | None = None,
                     **_fields) -> list[float | None]:
    """1.0 when ``math-verify`` finds the completion's answer (``\\boxed{}`` first, then LaTeX or plain
    expressions) equivalent to the record's ``answer``, else 0.0; None where the gold answer does not parse.
    math-verify's own timeouts use ``signal.alarm``, so they apply in the main thread only."""
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise ImportError("the 'math' reward needs the math-verify package: pip install 'jaxalign[rl]'") from err
    if answer is None:
        return [None] * len(completions)
    main = threading.current_thread() is threading.main_thread()
    timeout = {"parsing_timeout": 5 if main else None}
    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        target = (parse(str(gold), **timeout) or parse(f"${gold}$", **timeout)) if gold is not None else []
        if not target:
            out.append(None)
            continue
        got = parse(completion, **timeout)
        out.append(float(bool(got) and verify(target, got, timeout_seconds=5 if main else None)))
    return out


# ----------------------------------------------------------------------------------------------------- format
def regex_format(pattern: str, *, name: str = "regex_format") -> Reward:
    """A reward of 1.0 for completions that match ``pattern`` as a whole (``re.DOTALL``), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def reward(prompts, completions, **_fields):
        return [float(compiled.fullmatch(c) is not None) for c in completions]

    reward.__name__ = name
    return reward


think_answer_format = regex_format(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", name="think_answer_format")


# ---------------------------------------------------------------------------------------------------- length
def soft_overlong_penalty(max_length: int, cache: int) -> Reward:
    """DAPO's soft overlong punishment (Eq. 13) on ``completion_lengths`` (tokens): 0 up to ``max_length - cache``,
    then falling linearly to -1 at ``max_length``, -1 beyond."""
    if not 0 < cache <= max_length:
        raise ValueError(f"soft_overlong_penalty needs 0 < cache <= max_length (got cache={cache}, "
                         f"max_length={max_length})")

    def reward(prompts, completions, *, completion_lengths: Sequence[int], **_fields):
        free = max_length - cache
        return [0.0 if n <= free else (free - n) / cache if n <= max_length else -1.0 for n in completion_lengths]

    reward.__name__ = "soft_overlong_penalty"
    return reward


# ------------------------------------------------------------------------------------------------------- code
_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def program_of(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The program a completion is judged by: the completion's first fenced code block when it defines
    ``entry_point`` itself (after the prompt when the prompt is Python, as HumanEval's signature-and-docstring
    prompts are, so the prompt's imports and helpers stay defined and the block's function replaces the stub),
    else the prompt continued by the completion; then the record's ``test`` and ``check(entry_point)``."""
    block = _CODE_BLOCK.search(completion)
    if block and re.search(rf"def\s+{re.escape(entry_point)}\s*\(", block.group(1)):
        body = block.group(1)
        try:
            ast.parse(prompt)
            body = f"{prompt}\n{body}"
        except SyntaxError:
            pass
    else:
        body = prompt + completion
    return f"{body}\n\n{test}\n\ncheck({entry_point})\n"


# Run inside the child before the program: its own limits (no preexec_fn, which is unsafe with threads).
_BOOTSTRAP = """
import resource, sys
seconds, memory = float(sys.argv[1]), int(sys.argv[2])
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, int(seconds) + 1),
                     (resource.RLIMIT_FSIZE, 2**20), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
source = open("program.py").read()
sys.argv = ["program.py"]
exec(compile(source, "program.py", "exec"), {"__name__": "__main__"})
"""


def run_program(program: str, *, seconds: float = 5.0, memory_mb: int = 512) -> bool:
    """Whether ``program`` exits 0 within ``seconds`` (wall) in a fresh ``python -I`` subprocess, in an empty
    temporary folder, with a bare environment and limits on memory (``memory_mb`` of address space), CPU time,
    file size (1 MiB) and no core dumps, set by the child itself before the program runs; its whole process group
    is killed at the deadline. (No network isolation, and a process running as root could raise its own limits:
    run untrusted code inside a container or VM without network.)"""
    with tempfile.TemporaryDirectory(prefix="jaxalign-reward-") as folder:
        with open(os.path.join(folder, "program.py"), "w") as handle:
            handle.write(program)
        process = subprocess.Popen([sys.executable, "-I", "-c", _BOOTSTRAP, str(seconds), str(memory_mb * 2**20)],
                                   cwd=folder, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL,
                                   env={"PATH": "/usr/bin:/bin", "HOME": folder, "PYTHONHASHSEED": "0"},
                                   start_new_session=True)
        try:
            return process.wait(timeout=seconds) == 0
        except subprocess.TimeoutExpired:
            return False
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@dataclasses.dataclass(frozen=True)
class CodeTests:
    """1.0 when the completion passes its record's ``test`` (calling ``check(entry_point)``), else 0.0; None for a
    record without tests. Programs run in parallel subprocesses (``run_program``)."""

    seconds: float = 5.0
    memory_mb: int = 512
    workers: int = max(1, min(8, os.cpu_count() or 1))
    __name__ = "code_tests"

    def __call__(self, prompts, completions, *, test=None, entry_point=None, **_fields) -> list[float | None]:
        if test is None or entry_point is None:
            return [None] * len(completions)
        jobs = [(i, program_of(p, c, t, e)) for i, (p, c, t, e) in enumerate(zip(prompts, completions, test,
                                                                                 entry_point, strict=True))
                if t and e]
        out: list[float | None] = [None] * len(completions)
        with ThreadPoolExecutor(self.workers) as pool:
            results = pool.map(lambda job: run_program(job[1], seconds=self.seconds, memory_mb=self.memory_mb), jobs)
            for (i, _), passed in zip(jobs, results, strict=True):
                out[i] = float(passed)
        return out


code_tests = CodeTests()

BUILTIN: dict[str, Reward] = {"exact_number": exact_number, "math": math_equivalence,
                              "think_answer_format": think_answer_format, "code_tests": code_tests}


# ------------------------------------------------------------------------------------------------ resolution
@dataclasses.dataclass(frozen=True)
class NamedReward:
    name: str
    fn: Reward
    weight: float = 1.0


def load_reward(name: str) -> Reward:
    """A built-in reward by name, or any callable by dotted path (``package.module:function`` or
    ``package.module.function``)."""
    if name in BUILTIN:
        return BUILTIN[name]
    if name.startswith("reward_model:"):  # a trained reward model (jaxalign.rl.reward_model)
        from jaxalign.rl.reward_model import RewardModelReward

        return RewardModelReward(name.removeprefix("reward_model:"))
    module_name, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"reward {name!r} is neither built in ({', '.join(BUILTIN)}) nor a dotted path "
                         "(package.module:function)")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward {name!r}: cannot import it ({type(err).__name__}: {err})") from None
    if not callable(fn):
        raise ValueError(f"reward {name!r} is not callable")
    return fn


def resolve(rewards: str | Sequence[str | Reward], weights: str | Sequence[float] | None = None,
            ) -> list[NamedReward]:
    """Rewards from a config (``"exact_number,think_answer_format"`` or a list of names and callables) with their
    weights (``"1.0,0.5"``, a list, or all 1.0)."""
    items = [r for r in (rewards.split(",") if isinstance(rewards, str) else rewards) if r != ""]
    if not items:
        raise ValueError("no reward function given (e.g. rewards='exact_number')")
    if isinstance(weights, str):
        weights = [float(w) for w in weights.split(",") if w.strip()] if weights.strip() else None
    weights = [1.0] * len(items) if weights is None else list(weights)
    if len(weights) != len(items):
        raise ValueError(f"{len(weights)} reward weights for {len(items)} rewards")
    out = []
    for item, weight in zip(items, weights, strict=True):
        fn = load_reward(item.strip()) if isinstance(item, str) else item
        name = item.strip() if isinstance(item, str) else getattr(item, "__name__", type(item).__name__)
        out.append(NamedReward(name, fn, float(weight)))
    return out


def _checked(reward: NamedReward, values, n: int, first_record: int) -> np.ndarray:
    if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != n:
        got = f"{len(values)} values" if hasattr(values, "__len__") else type(values).__name__
        raise RewardError(f"reward {reward.name!r} returned {got} for {n} completions (records {first_record}-"
                          f"{first_record + n - 1}); it must return one float or None per completion")
    out = np.empty(n, np.float32)
    for i, value in enumerate(values):
        if value is None:
            out[i] = np.nan
            continue
        try:
            out[i] = float(value)
        except (TypeError, ValueError):
            raise RewardError(f"reward {reward.name!r} returned {value!r} for record {first_record + i}; expected a "
                              "float or None") from None
        if not math.isfinite(out[i]):
            raise RewardError(f"reward {reward.name!r} returned {value!r} for record {first_record + i}; return None "
                              "for a completion it cannot score")
    return out


def score(rewards: Sequence[NamedReward], prompts: Sequence[str], completions: Sequence[str],
          fields: dict[str, Sequence[Any]], *, record_index: Sequence[int] | None = None) -> np.ndarray:
    """``[N, R]`` rewards (NaN = None) of every completion under every reward. ``fields``: column -> one value per
    completion (the record's columns and ``completion_lengths``). ``record_index`` names each completion's record in
    errors. A reward that raises is retried completion by completion to name the record it fails on."""
    n = len(completions)
    index = list(record_index) if record_index is not None else list(range(n))
    table = np.empty((n, len(rewards)), np.float32)
    for k, reward in enumerate(rewards):
        try:
            values = reward.fn(list(prompts), list(completions), **fields)
        except Exception as err:
            for i in range(n):  # find the record it fails on
                try:
                    reward.fn([prompts[i]], [completions[i]], **{key: [v[i]] for key, v in fields.items()})
                except Exception as single:
                    raise RewardError(f"reward {reward.name!r} failed on record {index[i]}: "
                                      f"{type(single).__name__}: {single}") from single
            raise RewardError(f"reward {reward.name!r} failed on the batch of records {index[0]}-{index[-1]} "
                              f"(each record alone passes): {type(err).__name__}: {err}") from err
        table[:, k] = _checked(reward, values, n, index[0])
    return table


def combine(table: np.ndarray, rewards: Sequence[NamedReward]) -> np.ndarray:
    """``[N]`` weighted sum over rewards (None-valued rewards count 0), NaN where every reward returned None (TRL's
    ``sum_then_normalize``: such a completion is unscorable)."""
    weights = np.asarray([r.weight for r in rewards], np.float32)
    total = np.nansum(table * weights[None], axis=1)
    return np.where(np.isnan(table).all(axis=1), np.nan, total).astype(np.float32)
