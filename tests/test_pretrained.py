"""The toy studies' shared pretrained start (experiments/pretrained.py) and the fixed question pools it relies on."""

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxalign.data.toy import (
    POOLS,
    arithmetic,
    arithmetic_pool,
    arithmetic_preferences,
    mpo_records,
    multitask,
    pool_of,
)

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


@pytest.fixture(scope="module")
def pretrained():
    sys.path.insert(0, str(EXPERIMENTS))
    import pretrained

    yield pretrained
    sys.path.remove(str(EXPERIMENTS))


def test_pools_split_the_question_space_once():
    pools = {pool: arithmetic_pool(pool) for pool in POOLS}
    questions = {pool: [r["messages"][0]["content"] for r in records] for pool, records in pools.items()}
    assert len(questions["all"]) == 21 * 21 * 2
    parts = [set(questions[p]) for p in ("train", "validation", "test")]
    assert sum(map(len, parts)) == len(set().union(*parts)) == len(questions["all"])  # disjoint and complete
    assert 0.25 < len(parts[2]) / len(questions["all"]) < 0.35 and 0.1 < len(parts[1]) / len(questions["all"]) < 0.2
    for pool in ("train", "validation", "test"):
        drawn = arithmetic(300, 3, pool=pool)
        assert {r["messages"][0]["content"] for r in drawn} <= set(questions[pool])
        assert all(int(r["answer"]) == eval(r["messages"][0]["content"][8:-1]) for r in drawn)
    assert arithmetic(50, 7) == arithmetic(50, 7, pool="all")  # the whole space draws as before
    add_questions = {f"Add {a} and {b}.": f"What is {a} + {b}?" for a in range(21) for b in range(21)}
    sub_questions = {f"Subtract {b} from {a}.": f"What is {a} - {b}?" for a in range(21) for b in range(21)}
    for pool in ("train", "test"):
        drawn = multitask(200, 5, pool=pool)
        arithmetic_only = [r for r in drawn if r["task"] in ("add", "sub")]
        assert len(arithmetic_only) == 100 and {r["task"] for r in drawn} == {"add", "sub", "reverse", "copy"}
        assert {({**add_questions, **sub_questions})[r["messages"][0]["content"]] for r in arithmetic_only} \
            <= set(questions[pool])
    assert multitask(40, 5) == multitask(40, 5, pool="all")
    for make, key in ((arithmetic_preferences, lambda r: r["prompt"][0]["content"]),
                      (mpo_records, lambda r: r["source_conversations"][0]["value"])):
        assert make(40, 5) == make(40, 5, pool="all")
        for pool in ("train", "test"):
            assert {key(r) for r in make(200, 5, pool=pool)} <= set(questions[pool])
        with pytest.raises(ValueError, match="pool="):
            make(1, pool="held-out")
    with pytest.raises(ValueError, match="pool="):
        arithmetic(1, pool="held-out")
    empty = next(p for p in ("train", "validation", "test") if pool_of(0, "+", 0) != p)
    with pytest.raises(ValueError, match="holds no question"):  # no endless rejection sampling
        arithmetic(1, pool=empty, max_operand=0, ops="+")


def test_the_corpus_never_holds_a_validation_or_test_operation(pretrained):
    text = "\n".join(r["text"] for r in pretrained.corpus(3000, 1234))
    operations = re.findall(r"(\d+) ([+-]) (\d+)", text)
    operations += [(a, "+", b) for a, b in re.findall(r"Add (\d+) and (\d+)", text)]
    operations += [(a, "-", b) for b, a in re.findall(r"Subtract (\d+) from (\d+)", text)]
    assert len(operations) > 2000
    assert {pool_of(int(a), op, int(b)) for a, op, b in operations} == {"train"}
    assert "What is" in text and "Reverse" in text and "<|" not in text  # raw text: no chat template
    assert pretrained.corpus(50, 1) == pretrained.corpus(50, 1) != pretrained.corpus(50, 2)
    # the CPI-FT study's task wordings are the corpus's too
    assert {r["messages"][0]["content"].split()[0] for r in multitask(8)} <= {"Add", "Subtract", "Reverse", "Copy"}


@pytest.mark.slow
def test_the_start_is_deterministic_and_cached(pretrained, tmp_path, monkeypatch):
    folders = []
    for attempt in range(2):
        monkeypatch.setenv("JAXALIGN_PRETRAINED_CACHE", str(tmp_path / f"cache{attempt}"))
        folders.append(pretrained.pretrained_start("smoke"))
    assert folders[0].name == folders[1].name  # the same content hash
    first, second = (load_file(str(f / "model.safetensors")) for f in folders)
    assert first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first)
    stamp = (folders[1] / "config.json").stat().st_mtime_ns
    assert pretrained.pretrained_start("smoke") == folders[1]  # found, not trained again
    assert (folders[1] / "config.json").stat().st_mtime_ns == stamp
    assert json.loads((folders[1] / "pretraining.json").read_text())["key"] in folders[1].name
    assert not list(folders[1].parent.glob(".building-*"))
