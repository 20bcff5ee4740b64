"""Tokenisation throughput: validate + chat-template tokenise toy records, records per second.

    python benchmarks/data_throughput.py [--n 10000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from jaxalign.data import DataPipeline, PipelineConfig, TokenizeConfig, Tokenizer, load_examples
from jaxalign.data.toy import arithmetic, arithmetic_preferences, toy_tokenizer, write_jsonl


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=10_000)
    args = parser.parse_args()
    tok = Tokenizer(toy_tokenizer(), TokenizeConfig(max_length=128))
    with tempfile.TemporaryDirectory() as folder:
        for name, generator, kind in (("arithmetic chat (SFT)", arithmetic, "sft"),
                                      ("arithmetic preferences", arithmetic_preferences, "preference")):
            path = write_jsonl(generator(args.n, 0), Path(folder) / f"{kind}.jsonl")
            start = time.perf_counter()
            examples, _ = load_examples(path, tok, kind=kind)
            tokenise_s = time.perf_counter() - start
            pipeline = DataPipeline([examples], kind, PipelineConfig(batch_size=32, packing=kind == "sft",
                                                                     row_length=256))
            start = time.perf_counter()
            steps = min(pipeline.steps_per_epoch, 200)
            for _ in range(steps):
                next(pipeline)
            batch_s = (time.perf_counter() - start) / steps
            print(f"{name}: {args.n} records tokenised in {tokenise_s:.2f} s ({args.n / tokenise_s:,.0f} records/s); "
                  f"{batch_s * 1e3:.2f} ms per batch of 32")


if __name__ == "__main__":
    main()
