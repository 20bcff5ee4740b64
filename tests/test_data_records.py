"""Records: every kind of bad input is reported with file, record index and field; skip mode keeps the rest."""

import json

import pytest

from jaxalign.data import DataError, TokenizeConfig, Tokenizer, load_examples, read_records, validate_record
from jaxalign.data.toy import arithmetic, arithmetic_preferences, mpo_records, toy_tokenizer, write_jsonl

GOOD = {"prompt": [{"role": "user", "content": "What is 1 + 1?"}],
        "chosen": [{"role": "assistant", "content": "2"}], "rejected": [{"role": "assistant", "content": "3"}]}
BAD = [  # (record, field named in the error, words in the message)
    ({"prompt": "Hi", "rejected": "no"}, "chosen", "missing"),
    ({"prompt": "Hi", "chosen": 5, "rejected": "x"}, "rejected", "both be strings"),
    ({"prompt": "Hi", "chosen": ["x"], "rejected": ["y"]}, "chosen[0]", "expected a message object"),
    ({"prompt": "Hi", "chosen": "   ", "rejected": "no"}, "chosen", "is empty"),
    ({"prompt": "Hi", "chosen": "same", "rejected": "same"}, "rejected", "identical to 'chosen'"),
    ({**GOOD, "prompt": [{"role": "wizard", "content": "Hi"}]}, "prompt[0].role", "unknown role 'wizard'"),
    ({**GOOD, "chosen": [{"role": "assistant", "content": "\ud800"}]}, "chosen[0].content", "invalid UTF-8"),
    ({**GOOD, "chosen": [{"role": "user", "content": "2"}]}, "chosen", "must end with an assistant message"),
    ({"prompt": "Hi " * 400, "chosen": "a", "rejected": "b"}, "chosen", "over-long"),
    ({"question": "q"}, "<record>", "unrecognised format"),
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(toy_tokenizer(), TokenizeConfig(max_length=128))


def write_mixed(path):
    """Valid records interleaved with each bad one, plus an invalid-UTF-8 line and a broken JSON line."""
    lines = []
    for record, _, _ in BAD:
        lines.append(json.dumps(GOOD).encode())
        lines.append(json.dumps(record).encode())
    lines.append(b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}')
    lines.append(b'{"prompt": "Hi", "chosen": ')
    path.write_bytes(b"\n".join(lines) + b"\n")
    return len(BAD) + 2


def test_each_bad_record_is_named(tmp_path, tok):
    path = tmp_path / "prefs.jsonl"
    n_bad = write_mixed(path)
    with pytest.raises(DataError) as info:
        load_examples(path, tok, kind="preference")
    message = str(info.value)
    assert f"{n_bad} invalid record(s) in {path}" in message
    for i, (_, field, words) in enumerate(BAD):
        assert f"{path}, record {2 * i + 1}, field '{field}'" in message, field
        assert words in message
    assert f"record {2 * len(BAD)}, field '<record>': line {2 * len(BAD) + 1} is not valid UTF-8" in message
    assert "is not valid JSON" in message


def test_skip_mode_counts_and_keeps_the_valid(tmp_path, tok):
    path = tmp_path / "prefs.jsonl"
    n_bad = write_mixed(path)
    examples, report = load_examples(path, tok, kind="preference", on_invalid="skip")
    assert report.skipped == n_bad and report.valid == len(BAD) == len(examples)
    assert report.total == len(BAD) + n_bad
    assert f"{len(BAD)} of {report.total} records usable, {n_bad} invalid skipped" in report.summary()


def test_mpo_sides_are_validated_together(tok):
    record = mpo_records(1)[0]
    record["target_rejected"] = {"from": "gpt", "value": record["target_chosen"]["value"]}
    with pytest.raises(ValueError, match="field 'target_rejected': identical"):
        validate_record(record, source="m.jsonl", index=3)
    record = mpo_records(1)[0]
    del record["source_conversations"]
    with pytest.raises(ValueError, match=r"m\.jsonl, record 0, field 'source_conversations': missing"):
        validate_record(record, source="m.jsonl", index=0)


def test_kind_conversions(tmp_path, tok):
    prefs = write_jsonl(arithmetic_preferences(5), tmp_path / "p.jsonl")
    examples, _ = load_examples(prefs, tok, kind="sft")  # SFT on the chosen answers (as the IFT paper does)
    assert len(examples) == 5 and set(examples[0]) == {"tokens", "loss_mask"}
    chat = write_jsonl(arithmetic(3), tmp_path / "c.jsonl")
    with pytest.raises(DataError, match="field 'chosen': missing"):
        load_examples(chat, tok, kind="preference")
    sater = write_jsonl([
        {"question": "1+1?", "gold_answer": "2", "samples": [{"text": "It is 2.", "correct": True},
                                                              {"text": "2", "correct": True},
                                                              {"text": "Maybe it is 3.", "correct": False}]},
        {"question": "2+2?", "samples": [{"text": "4", "correct": True}]},
        {"question": "3+3?", "tau": 0.3, "target": "6"},
    ], tmp_path / "s.jsonl")
    pairs, report = load_examples(sater, tok, kind="preference", on_invalid="skip")
    assert len(pairs) == 1 and report.degenerate == 1 and report.skipped == 1
    decoded = toy_tokenizer().decode(pairs[0]["chosen_tokens"][pairs[0]["chosen_loss_mask"] == 1])
    assert decoded == "2<|im_end|>"  # the shortest correct sample


@pytest.mark.parametrize("fmt", ["json", "parquet", "saved"])
def test_sources(tmp_path, fmt, tok):
    records = arithmetic(4, seed=2)
    if fmt == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps({"data": records}))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        from datasets import Dataset

        path = tmp_path / "saved"
        Dataset.from_list(records).save_to_disk(str(path))
    read = [record for _, record in read_records(path)]
    assert [r["answer"] for r in read] == [r["answer"] for r in records]
    examples, _ = load_examples(path, tok, kind="sft")
    assert len(examples) == 4


def test_unreadable_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="data file not found"):
        list(read_records(tmp_path / "missing.jsonl"))
    (tmp_path / "d.csv").write_text("a,b")
    with pytest.raises(ValueError, match=r"unsupported data file type '\.csv'"):
        list(read_records(tmp_path / "d.csv"))
    (tmp_path / "d.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        list(read_records(tmp_path / "d.json"))
