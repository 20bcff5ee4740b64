"""Deterministic toy data in the same formats as real data (seeded, sized by the caller).

* ``arithmetic``: "What is a + b?" chat records with verifiable answers, short or verbose answers.
* ``arithmetic_preferences``: the same questions with a correct (chosen) and a wrong (rejected) answer.
* ``mpo_records``: a dominant "language" and a target one made by a fixed letter cipher (MPO layout).
* ``multitask``: addition, subtraction, reversal and copy, tagged with ``task`` (for CPI-FT).
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from collections.abc import Iterable
from pathlib import Path

import numpy as np

ANSWER_STYLES = ("short", "verbose", "mixed")
# Fixed pools of the arithmetic question space, by a hash of the operation: the studies draw their training data
# from "train", tune on "validation" and report on "test"; the shared pretrained start sees "train" only
POOLS = ("all", "train", "validation", "test")
_POOL_SHARES = (("test", 30), ("validation", 15))  # percent of the question space; the rest is "train"
TASKS = ("add", "sub", "reverse", "copy")
_CIPHER_SEED = 20250531


def pool_of(a: int, op: str, b: int) -> str:
    """The fixed pool ("train", "validation" or "test") of the operation ``a op b``, whatever its wording."""
    bucket = int.from_bytes(hashlib.sha256(f"{a}{op}{b}".encode()).digest()[:4], "big") % 100
    for pool, share in _POOL_SHARES:
        if bucket < share:
            return pool
        bucket -= share
    return "train"


def _check_pool(pool: str) -> None:
    if pool not in POOLS:
        raise ValueError(f"pool={pool!r}; expected one of {POOLS}")


def _operands(rng: np.random.Generator, max_operand: int, ops: str, pool: str) -> tuple[int, str, int]:
    while True:  # rejection sampling: the same draws as before for pool="all"
        a, b = (int(x) for x in rng.integers(0, max_operand + 1, 2))
        op = ops[int(rng.integers(len(ops)))]
        if pool == "all" or pool_of(a, op, b) == pool:
            return a, op, b


def _question(rng: np.random.Generator, max_operand: int, ops: str, pool: str = "all") -> tuple[str, int]:
    a, op, b = _operands(rng, max_operand, ops, pool)
    return f"What is {a} {op} {b}?", a + b if op == "+" else a - b


def arithmetic_pool(pool: str, *, max_operand: int = 20, ops: str = "+-") -> list[dict]:
    """Every question of ``pool`` once (short answers), in a fixed order: a study's whole test or validation set."""
    _check_pool(pool)
    records = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            for op in ops:
                if pool == "all" or pool_of(a, op, b) == pool:
                    answer = a + b if op == "+" else a - b
                    records.append({"messages": [{"role": "user", "content": f"What is {a} {op} {b}?"},
                                                 {"role": "assistant", "content": str(answer)}],
                                    "answer": str(answer)})
    return records


def answer_text(question: str, answer: int, style: str) -> str:
    """``short``: just the number; ``verbose``: the working, then the number."""
    if style == "short":
        return str(answer)
    expression = question.removeprefix("What is ").removesuffix("?")
    return f"{expression} = {answer}. The answer is {answer}."


def arithmetic(n: int, seed: int = 0, *, style: str = "short", max_operand: int = 20, ops: str = "+-",
               fmt: str = "messages", pool: str = "all") -> list[dict]:
    """Chat SFT records; each has ``answer`` (the number, as text) for exact-match evaluation.

    ``fmt``: ``messages`` or ``prompt_completion`` (conversational prompt/completion). ``pool``: draw only
    questions of that fixed pool (``pool_of``); ``all`` draws from the whole question space.
    """
    if style not in ANSWER_STYLES:
        raise ValueError(f"style={style!r}; expected one of {ANSWER_STYLES}")
    _pool_checked(pool, n, max_operand, ops)
    rng = np.random.default_rng([seed, 1])
    records = []
    for i in range(n):
        question, answer = _question(rng, max_operand, ops, pool)
        chosen_style = style if style != "mixed" else ("short", "verbose")[i % 2]
        user = {"role": "user", "content": question}
        assistant = {"role": "assistant", "content": answer_text(question, answer, chosen_style)}
        if fmt == "messages":
            record = {"messages": [user, assistant]}
        elif fmt == "prompt_completion":
            record = {"prompt": [user], "completion": [assistant]}
        else:
            raise ValueError(f"fmt={fmt!r}; expected 'messages' or 'prompt_completion'")
        records.append({**record, "answer": str(answer)})
    return records


def _pool_checked(pool: str, n: int, max_operand: int, ops: str) -> None:
    _check_pool(pool)
    if pool != "all" and n > 0 and not arithmetic_pool(pool, max_operand=max_operand, ops=ops):
        raise ValueError(f"pool={pool!r} holds no question with max_operand={max_operand}, ops={ops!r}")


def arithmetic_preferences(n: int, seed: int = 0, *, max_operand: int = 20, ops: str = "+-",
                           pool: str = "all") -> list[dict]:
    """Preference records: chosen = correct short answer, rejected = an off-by-one (or off-by-ten) answer.
    ``pool`` as in ``arithmetic``."""
    _pool_checked(pool, n, max_operand, ops)
    rng = np.random.default_rng([seed, 2])
    records = []
    for _ in range(n):
        question, answer = _question(rng, max_operand, ops, pool)
        wrong = answer + int(rng.choice([-10, -1, 1, 10]))
        records.append({"prompt": [{"role": "user", "content": question}],
                        "chosen": [{"role": "assistant", "content": str(answer)}],
                        "rejected": [{"role": "assistant", "content": str(wrong)}],
                        "answer": str(answer)})
    return records


def cipher_table() -> dict[str, str]:
    """The fixed letter substitution that turns the dominant language into the target one."""
    letters = list(string.ascii_lowercase)
    shuffled = list(np.random.default_rng(_CIPHER_SEED).permutation(letters))
    table = dict(zip(letters, shuffled, strict=True))
    table.update({k.upper(): v.upper() for k, v in list(table.items())})
    return table


def encipher(text: str) -> str:
    table = cipher_table()
    return "".join(table.get(ch, ch) for ch in text)


def mpo_records(n: int, seed: int = 0, *, max_operand: int = 20, pool: str = "all") -> list[dict]:
    """MPO records in the official layout; the target side is the dominant side under ``encipher``. ``pool`` as
    in ``arithmetic`` (of the addition questions)."""
    _pool_checked(pool, n, max_operand, "+")
    rng = np.random.default_rng([seed, 3])
    records = []
    for _ in range(n):
        question, answer = _question(rng, max_operand, "+", pool)
        records.append(mpo_record(question, answer, answer + int(rng.choice([-1, 1]))))
    return records


def mpo_record(question: str, answer: int, wrong: int) -> dict:
    """One MPO record: ``question`` answered ``answer`` (chosen) or ``wrong`` (rejected), in both languages."""
    source = (question, f"The answer is {answer}.", f"The answer is {wrong}.")
    target = tuple(encipher(text) for text in source)
    record = {}
    for side, (prompt, chosen, rejected) in (("source", source), ("target", target)):
        record[f"{side}_conversations"] = [{"from": "human", "value": prompt}]
        record[f"{side}_chosen"] = {"from": "gpt", "value": chosen}
        record[f"{side}_rejected"] = {"from": "gpt", "value": rejected}
    return {**record, "answer": str(answer)}


def multitask(n: int, seed: int = 0, *, tasks: Iterable[str] = TASKS, max_operand: int = 20,
              word_length: int = 5, pool: str = "all") -> list[dict]:
    """Chat SFT records cycling through ``tasks``; each has ``task`` and ``answer``. ``pool``: the addition and
    subtraction questions come from that fixed pool of ``arithmetic`` (the same operation, in this wording)."""
    tasks = tuple(tasks)
    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown tasks {sorted(unknown)}; expected a subset of {TASKS}")
    for task, op in (("add", "+"), ("sub", "-")):
        if task in tasks:
            _pool_checked(pool, n, max_operand, op)
    rng = np.random.default_rng([seed, 4])
    records = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        a, b = (int(x) for x in rng.integers(0, max_operand + 1, 2))
        while pool != "all" and task in ("add", "sub") and pool_of(a, "+" if task == "add" else "-", b) != pool:
            a, b = (int(x) for x in rng.integers(0, max_operand + 1, 2))
        word = "".join(rng.choice(list(string.ascii_lowercase), word_length))
        question, answer = {
            "add": (f"Add {a} and {b}.", str(a + b)),
            "sub": (f"Subtract {b} from {a}.", str(a - b)),
            "reverse": (f"Reverse {word}.", word[::-1]),
            "copy": (f"Copy {word}.", word),
        }[task]
        records.append({"messages": [{"role": "user", "content": question},
                                     {"role": "assistant", "content": answer}], "task": task, "answer": answer})
    return records


def write_jsonl(records: Iterable[dict], path: str | os.PathLike) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed: processes of one job that share a folder never read a half-written file.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return out


GENERATORS = {"arithmetic": arithmetic, "preferences": arithmetic_preferences, "mpo": mpo_records,
              "multitask": multitask}
