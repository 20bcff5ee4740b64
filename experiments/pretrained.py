"""The shared pretrained start of the toy studies: a tiny Llama pretrained on raw toy transcripts, once.

    python experiments/pretrained.py            # builds (or finds) the cached start, prints its folder
    python experiments/pretrained.py --smoke    # the smoke-size start the tests use

The papers fine-tune pretrained models; the toy studies do the same from this start. The corpus is raw text (no
chat template) with the plain next-token loss on every token: arithmetic transcripts in three wordings ("What is
12 + 7? 19", "12 + 7 = 19", the verbose working), "Add 12 and 7. 19" / "Subtract 7 from 12. 5", and word reversal
and copying ("Reverse abcde. edcba"). Every arithmetic operation in it comes from the "train" pool of
``jaxalign.data.toy.pool_of`` (a fixed hash of the operation), so no study's validation or test question is ever
seen before fine-tuning, in any wording. The chat format itself is never seen either: fine-tuning teaches it.

Deterministic: the corpus, the model's initialisation and the data order are functions of the settings below, and
the result is cached under a content hash of the corpus and the training config
(``~/.cache/jaxalign/pretrained/<name>-<hash>/``, or ``$JAXALIGN_PRETRAINED_CACHE``). Rebuilt from scratch, the
tiny start came out bit-identical (weights SHA-256 ``6688eb3016492a76``) from three versions of the code (the first,
b411eb4; 95e688b of 2026-12-03; today's) on an AMD EPYC, and on 2026-12-06 in a session on an Intel Xeon. The name
still does not fix the weights: the copy the studies of 2026-12-03 used gave other results (docs/results.md,
"Nudging") and none of those rebuilds reproduces it. So every study records the SHA-256 of the start's weights it
used (``weights_digest``) in its JSON and in its table's first line. A study asks for it with
``pretrained_start(shape)``: the first call trains (5-10 minutes at the tiny shape on 2 CPU cores), later calls
return the folder. The folder is a Hugging Face export (``config.json``, safetensors, the toy tokenizer), given to a
run as ``model.path``.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import SHAPES, parser, toy_config

from jaxalign.data.toy import answer_text, pool_of, write_jsonl
from jaxalign.train import train
from jaxalign.train.export import export

# the pretraining run per shape: steps of batch_size packed rows of row_length tokens (documents of at most
# max_length); the smoke size only checks the code
RECIPES = {
    "tiny": dict(documents=20_000, steps=1200, lr=3e-3, batch_size=32, max_length=64, row_length=128, seed=1234),
    "small": dict(documents=20_000, steps=1200, lr=3e-3, batch_size=32, max_length=64, row_length=128, seed=1234),
    "smoke": dict(documents=200, steps=4, lr=3e-3, batch_size=8, max_length=64, row_length=128, seed=1234),
}
MAX_OPERAND = 20
USED: dict[str, str] = {}  # the starts this process used: folder name -> weights digest (common.write records it)


def transcript(rng: np.random.Generator) -> str:
    """One raw line: an arithmetic operation from the train pool in one of five wordings, or a word task."""
    kind = int(rng.integers(6))
    if kind == 5:
        word = "".join(rng.choice(list(string.ascii_lowercase), 5))
        return f"Reverse {word}. {word[::-1]}" if rng.integers(2) else f"Copy {word}. {word}"
    while True:  # "Add a and b" is a + b and "Subtract b from a" is a - b: the pool is the operation's
        a, b = (int(x) for x in rng.integers(0, MAX_OPERAND + 1, 2))
        op = {3: "+", 4: "-"}.get(kind, "+-"[int(rng.integers(2))])
        if pool_of(a, op, b) == "train":
            break
    value = a + b if op == "+" else a - b
    question = f"What is {a} {op} {b}?"
    return [f"{question} {value}", f"{a} {op} {b} = {value}", f"{question} {answer_text(question, value, 'verbose')}",
            f"Add {a} and {b}. {a + b}", f"Subtract {b} from {a}. {a - b}"][kind]


def corpus(documents: int, seed: int) -> list[dict]:
    """``documents`` raw-text records (``{"text": ...}``, TRL's language-modelling format) of 1-3 lines each."""
    rng = np.random.default_rng([seed, 7])
    return [{"text": "\n".join(transcript(rng) for _ in range(int(rng.integers(1, 4))))} for _ in range(documents)]


def weights_digest(folder: Path) -> str:
    """The first 16 hex digits of the SHA-256 of a start's ``model.safetensors``: which weights a name stood for."""
    digest = hashlib.sha256()
    with open(Path(folder) / "model.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    return Path(os.environ.get("JAXALIGN_PRETRAINED_CACHE") or Path.home() / ".cache" / "jaxalign" / "pretrained")


def _config(workdir: Path, data: Path, shape: str, recipe: dict):
    config = toy_config(workdir, data, objective="sft", steps=recipe["steps"], shape=shape, seed=recipe["seed"],
                        batch_size=recipe["batch_size"], lr=recipe["lr"], max_length=recipe["max_length"])
    config.data.update(packing=True, row_length=recipe["row_length"])
    return config


def pretrained_start(shape: str = "tiny", *, log=print) -> Path:
    """The cached pretrained start's Hugging Face folder for ``shape`` (trained on the first call)."""
    recipe = RECIPES[shape]
    records = corpus(recipe["documents"], recipe["seed"])
    text = "".join(json.dumps(r) + "\n" for r in records)
    probe = _config(Path("workdir"), Path("corpus.jsonl"), shape, recipe)
    key = hashlib.sha256(text.encode() + probe.to_json(sort_keys=True).encode()).hexdigest()[:16]
    final = cache_root() / f"toy-{shape}-{key}"
    if (final / "config.json").exists():
        USED[final.name] = weights_digest(final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".building-") as work:
        work = Path(work)
        data = write_jsonl(records, work / "corpus.jsonl")
        config = _config(work / "run", data, shape, recipe)
        train(config)
        export(work / "run", work / "hf")
        (work / "hf" / "pretraining.json").write_text(json.dumps(
            {"recipe": recipe, "shape": SHAPES[shape], "key": key, "seconds": round(time.time() - started, 1)},
            indent=2) + "\n")
        try:
            (work / "hf").rename(final)  # atomic; a process that finished first wins and ours is dropped
        except OSError:
            if not (final / "config.json").exists():
                raise
    log(f"pretrained start {final} ({time.time() - started:.0f} s)")
    USED[final.name] = weights_digest(final)
    return final


def main(argv: list[str] | None = None) -> Path:
    args = parser(__doc__).parse_args(sys.argv[1:] if argv is None else argv)
    path = pretrained_start("smoke" if args.smoke else "tiny")
    print(path)
    return path


if __name__ == "__main__":
    main()
