"""Fuzzing the record validators and tokenisation (hypothesis): every malformed record is rejected with a message
naming file, record and field, or dropped in ``skip`` mode; nothing else escapes."""

import contextlib
import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxalign.data import DataError, TokenizeConfig, Tokenizer, load_sources
from jaxalign.data.dataset import _as_kind, _requested_kind
from jaxalign.data.schema import RecordError, validate_record
from jaxalign.data.tokenize import tokenize_record
from jaxalign.data.toy import toy_tokenizer

TOK = Tokenizer(toy_tokenizer(), TokenizeConfig(max_length=48, max_prompt_length=24))
SEEN = {"records": 0, "rejected": 0}

VALID = {
    "sft": [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}]},
        {"prompt": "2+2?", "completion": "4"},
        {"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]},
        {"text": "plain text to model"},
        {"question": "2+2?", "tau": 0.5, "target": "4"},
    ],
    "preference": [
        {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
        {"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
         "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}]},
        {"question": "2+2?", "gold_answer": "4", "samples": [{"text": "4", "correct": True},
                                                             {"text": "five", "correct": False}]},
    ],
    "mpo": [
        {"source_conversations": [{"from": "human", "value": "Hi?"}], "source_chosen": {"from": "gpt", "value": "A"},
         "source_rejected": {"from": "gpt", "value": "B"},
         "target_conversations": [{"from": "human", "value": "Hola?"}],
         "target_chosen": {"from": "gpt", "value": "C"}, "target_rejected": {"from": "gpt", "value": "D"}},
    ],
}

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=200),
                      st.sampled_from(["", " ", "\x00", "user", "assistant", "system", "gpt", "human", "<|im_end|>",
                                       "{{ 7*7 }}", "\ud7ff" * 3, "a" * 500]))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                          max_leaves=12)


def paths_of(value, prefix=()):
    """Every location inside a JSON value (for mutations)."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths_of(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from paths_of(item, (*prefix, i))


@st.composite
def malformed(draw, kind):
    """A valid record of ``kind`` with 1-3 mutations (replace, delete, duplicate, retype), or random JSON."""
    if draw(st.integers(0, 9)) == 0:
        return draw(json_value)
    record = copy.deepcopy(draw(st.sampled_from(VALID[kind])))
    for _ in range(draw(st.integers(1, 3))):
        locations = [p for p in paths_of(record) if p]
        if not locations:
            break
        path = draw(st.sampled_from(locations))
        parent = record
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "empty", "wrap", "long"]))
        if action == "replace":
            parent[path[-1]] = draw(json_value)
        elif action == "delete":
            del parent[path[-1]]
        elif action == "empty":
            parent[path[-1]] = type(parent[path[-1]])() if isinstance(parent[path[-1]], str | list | dict) else None
        elif action == "wrap":
            parent[path[-1]] = [parent[path[-1]]]
        else:
            parent[path[-1]] = "9 " * 400
    return record


def check_one(record, kind: str, index: int) -> None:
    SEEN["records"] += 1
    try:
        valid = validate_record(record, source="fuzz.jsonl", index=index, kind=_requested_kind(record, kind))
        valid = _as_kind(valid, kind, TOK)
        if valid is not None:
            tokenize_record(TOK, valid, source="fuzz.jsonl", index=index)
    except RecordError as err:
        SEEN["rejected"] += 1
        assert str(err).startswith(f"fuzz.jsonl, record {index}, field '"), str(err)
        assert err.message
    except ValueError as err:  # load_examples turns these into RecordErrors for the record
        SEEN["rejected"] += 1
        assert str(err)


@pytest.mark.parametrize("kind", ["sft", "preference", "mpo"])
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_malformed_records_are_rejected_by_name(kind, data):
    check_one(data.draw(malformed(kind)), kind, data.draw(st.integers(0, 10**6)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(records=st.lists(malformed("sft"), min_size=1, max_size=12), garbage=st.lists(st.binary(max_size=30),
                                                                                     max_size=3))
def test_whole_files_in_skip_mode_keep_every_valid_record(tmp_path_factory, records, garbage):
    path = tmp_path_factory.mktemp("fuzz") / "data.jsonl"
    good = VALID["sft"][0]
    lines = [json.dumps(r).encode() for r in records] + garbage + [json.dumps(good).encode()]
    path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines) + b"\n")
    try:
        sources, (report,) = load_sources([path], TOK, kind="sft", on_invalid="skip")
    except DataError as err:  # only when no record at all is usable, which the appended good record prevents
        raise AssertionError(err) from None
    assert report.valid == len(sources[0]) >= 1
    assert report.valid + report.skipped + report.degenerate == report.total
    with pytest.raises(DataError, match="invalid record") if report.skipped else contextlib.nullcontext():
        load_sources([path], TOK, kind="sft", on_invalid="error")


def test_fuzzing_saw_over_a_thousand_records():
    """Runs after the fuzz tests above (file order): they generated and checked at least 1,000 records."""
    if not SEEN["records"]:
        pytest.skip("the fuzz tests above were not selected in this session")
    assert SEEN["records"] >= 1000, SEEN
    assert SEEN["rejected"] >= 500, SEEN
