"""Record formats and their validation: one place that knows what a valid record looks like.

Accepted formats (TRL's, plus the method-specific ones of the spec), by kind:

* ``lm``: ``text``.
* ``sft``: ``messages`` (conversational), or ``prompt`` + ``completion`` (both strings, or message lists).
* ``preference``: ``prompt`` + ``chosen`` + ``rejected`` (strings, or a message list and assistant message
  lists); without ``prompt`` the shared prefix of ``chosen`` and ``rejected`` becomes the prompt (in token space
  for strings, in message space for conversations); an optional numeric ``margin`` (reward models).
* ``unpaired`` (KTO): ``prompt`` + ``completion`` (strings, or a message list and assistant messages) + ``label``
  (``true`` = desirable, ``false`` = undesirable), TRL's unpaired preference format; preference pairs are also
  accepted (each becomes a desirable and an undesirable example, as TRL unpairs them).
* ``mpo``: ``source_conversations``/``source_chosen``/``source_rejected`` and the same ``target_*`` fields
  (the official LLaMA-Factory layout with ShareGPT ``from``/``value`` turns); both sides are validated together.
* ``sater``: stage I ``question``, ``gold_answer``, ``samples`` [{``text``, ``correct``}]; stage II
  ``question``, ``tau``, ``target``.

``validate_record`` returns a normalised record (messages as ``{"role", "content"}`` dicts) or raises
``RecordError`` naming the file, the record index and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
KINDS = ("lm", "sft", "preference", "unpaired", "mpo", "sater")


class RecordError(ValueError):
    """A record that cannot be used; ``str()`` names file, record index and field."""

    def __init__(self, source: str, index: int, field: str, message: str):
        self.source, self.index, self.field, self.message = source, index, field, message
        super().__init__(f"{source}, record {index}, field '{field}': {message}")


def detect_kind(record: Mapping[str, Any]) -> str:
    """The record kind from its fields (see the module table)."""
    if "source_conversations" in record or "target_conversations" in record:
        return "mpo"
    if "question" in record and ("samples" in record or "tau" in record):
        return "sater"
    if "chosen" in record or "rejected" in record:
        return "preference"
    if "label" in record and "completion" in record:
        return "unpaired"
    if "messages" in record or "completion" in record:
        return "sft"
    if "text" in record:
        return "lm"
    return "unknown"


class _Checker:
    """Field checks that raise ``RecordError`` with the location filled in."""

    def __init__(self, source: str, index: int):
        self.source, self.index = source, index

    def fail(self, field: str, message: str):
        raise RecordError(self.source, self.index, field, message)

    def text(self, value: Any, field: str, *, allow_empty: bool = False) -> str:
        if not isinstance(value, str):
            self.fail(field, f"expected a string, got {type(value).__name__}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            self.fail(field, "invalid UTF-8 (unpaired surrogate)")
        if not allow_empty and not value.strip():
            self.fail(field, "is empty")
        return value

    def require(self, record: Mapping[str, Any], field: str) -> Any:
        if field not in record or record[field] is None:
            self.fail(field, "missing")
        return record[field]

    def messages(self, value: Any, field: str, *, sharegpt: bool = False) -> list[dict[str, str]]:
        if isinstance(value, Mapping):
            value = [value]
        if not isinstance(value, list) or not value:
            self.fail(field, f"expected a non-empty list of messages, got {type(value).__name__}")
        out = []
        for i, message in enumerate(value):
            where = f"{field}[{i}]"
            if not isinstance(message, Mapping):
                self.fail(where, f"expected a message object, got {type(message).__name__}")
            if sharegpt:
                role_key, content_key, roles = "from", "value", SHAREGPT_ROLES
            else:
                role_key, content_key, roles = "role", "content", {r: r for r in ROLES}
            role = message.get(role_key)
            if not isinstance(role, str) or role not in roles:
                self.fail(f"{where}.{role_key}", f"unknown role {role!r} (expected one of {sorted(roles)})")
            content = self.text(message.get(content_key), f"{where}.{content_key}",
                                allow_empty=roles[role] != "assistant")
            out.append({"role": roles[role], "content": content})
        return out

    def completion_turns(self, value: Any, field: str, *, sharegpt: bool = False) -> list[dict[str, str]]:
        turns = self.messages(value, field, sharegpt=sharegpt)
        if turns[-1]["role"] != "assistant":
            self.fail(field, "must end with an assistant message")
        return turns


def _pair(check: _Checker, record: Mapping[str, Any], prefix: str = "", sharegpt: bool = False) -> dict[str, Any]:
    """prompt / chosen / rejected of a preference record (string or conversational)."""
    chosen_key, rejected_key = f"{prefix}chosen", f"{prefix}rejected"
    prompt_key = f"{prefix}conversations" if sharegpt else f"{prefix}prompt"
    chosen, rejected = check.require(record, chosen_key), check.require(record, rejected_key)
    prompt = record.get(prompt_key)
    if isinstance(chosen, str) != isinstance(rejected, str):
        check.fail(rejected_key, f"'{chosen_key}' and '{rejected_key}' must both be strings or both messages")
    if isinstance(chosen, str):
        out = {"chosen": check.text(chosen, chosen_key), "rejected": check.text(rejected, rejected_key)}
        if prompt is not None:
            out["prompt"] = check.text(prompt, prompt_key)
    else:
        out = {"chosen": check.completion_turns(chosen, chosen_key, sharegpt=sharegpt),
               "rejected": check.completion_turns(rejected, rejected_key, sharegpt=sharegpt)}
        if prompt is not None:
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}] if not sharegpt else [{"from": "human", "value": prompt}]
            out["prompt"] = check.messages(prompt, prompt_key, sharegpt=sharegpt)
    if out["chosen"] == out["rejected"]:
        check.fail(rejected_key, f"identical to '{chosen_key}' (a pair needs two different responses)")
    margin = record.get(f"{prefix}margin")
    if margin is not None:  # TRL's reward-model margin (how much better chosen is)
        if isinstance(margin, bool) or not isinstance(margin, int | float) or not math.isfinite(margin):
            check.fail(f"{prefix}margin", f"expected a finite number, got {margin!r}")
        out["margin"] = float(margin)
    if prompt is None and sharegpt:
        check.require(record, prompt_key)
    return out


def validate_record(record: Any, *, source: str, index: int, kind: str | None = None) -> dict[str, Any]:
    """Checks one record and returns it normalised, with ``"kind"`` set.

    ``kind`` forces a kind (e.g. ``sft`` for a preference file: its ``chosen`` becomes the completion).
    """
    check = _Checker(source, index)
    if not isinstance(record, Mapping):
        check.fail("<record>", f"expected a JSON object, got {type(record).__name__}")
    detected = detect_kind(record)
    if detected == "unknown":
        check.fail("<record>", f"unrecognised format with fields {sorted(record)}; expected one of: text | "
                               "messages | prompt+completion | prompt+chosen+rejected | prompt+completion+label | "
                               "source_*/target_* (MPO) | "
                               "question+samples / question+tau (SATER)")
    kind = kind or detected
    if kind not in KINDS:
        check.fail("<record>", f"unknown kind {kind!r}")
    if kind == "lm":
        return {"kind": "lm", "text": check.text(check.require(record, "text"), "text")}
    if kind == "sft" and detected == "preference":
        pair = _pair(check, record)
        return {"kind": "sft", **({"prompt": pair["prompt"]} if "prompt" in pair else {}),
                "completion": pair["chosen"]}
    if kind == "sft" and detected == "unpaired" and check.require(record, "label") is not True:
        check.fail("label", "false: an undesirable completion is not an SFT target (filter the file, or train "
                            "with kto)")
    if kind == "unpaired":
        if detected == "preference":  # unpaired into a desirable and an undesirable example by the loader
            return {"kind": "preference", **_pair(check, record)}
        if detected != "unpaired":
            check.fail("label", "missing (KTO needs prompt + completion + label, or prompt + chosen + rejected)")
        label = check.require(record, "label")
        if not isinstance(label, bool):
            check.fail("label", f"expected true (desirable) or false (undesirable), got {label!r}")
        return {**_prompt_completion(check, record, "unpaired"), "label": label}
    if kind == "sft":
        if "messages" in record:
            messages = check.messages(record["messages"], "messages")
            if not any(m["role"] == "assistant" for m in messages):
                check.fail("messages", "has no assistant turn to train on")
            return {"kind": "sft", "messages": messages}
        return _prompt_completion(check, record, "sft")
    if kind == "preference":
        if detected != "preference":
            check.fail("chosen", "missing (a preference objective needs chosen and rejected)")
        return {"kind": "preference", **_pair(check, record)}
    if kind == "mpo":
        if detected != "mpo":
            check.fail("source_conversations", "missing (MPO needs source_* and target_* triples)")
        return {"kind": "mpo", "dominant": _pair(check, record, "source_", sharegpt=True),
                "target": _pair(check, record, "target_", sharegpt=True)}
    return _sater(check, record)


def _prompt_completion(check: _Checker, record: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """``prompt`` + ``completion``: both strings, or a prompt (string or messages) and assistant messages."""
    prompt, completion = check.require(record, "prompt"), check.require(record, "completion")
    if isinstance(completion, str):
        return {"kind": kind, "prompt": check.text(prompt, "prompt", allow_empty=True),
                "completion": check.text(completion, "completion")}
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    return {"kind": kind, "prompt": check.messages(prompt, "prompt"),
            "completion": check.completion_turns(completion, "completion")}


def _sater(check: _Checker, record: Mapping[str, Any]) -> dict[str, Any]:
    question = check.text(check.require(record, "question"), "question")
    if "samples" in record:
        samples = check.require(record, "samples")
        if not isinstance(samples, list) or not samples:
            check.fail("samples", "expected a non-empty list of {text, correct}")
        parsed = []
        for i, sample in enumerate(samples):
            if not isinstance(sample, Mapping):
                check.fail(f"samples[{i}]", "expected an object with text and correct")
            if not isinstance(sample.get("correct"), bool):
                check.fail(f"samples[{i}].correct", "expected true or false")
            parsed.append({"text": check.text(sample.get("text"), f"samples[{i}].text"),
                           "correct": sample["correct"]})
        gold = record.get("gold_answer")
        return {"kind": "sater", "stage": 1, "question": question, "samples": parsed,
                "gold_answer": None if gold is None else str(gold)}
    tau = check.require(record, "tau")
    if not isinstance(tau, int | float) or isinstance(tau, bool) or not 0 <= tau <= 1:
        check.fail("tau", f"expected a number in [0, 1], got {tau!r}")
    return {"kind": "sater", "stage": 2, "question": question, "tau": float(tau),
            "target": check.text(check.require(record, "target"), "target")}
