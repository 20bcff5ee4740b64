"""What the CLI's persistent compilation cache saves: each job run three times in fresh processes, one after the other.

    python benchmarks/compile_cache.py            # about 10 minutes on 2 CPU cores
    python benchmarks/compile_cache.py --smoke    # a tiny training job only: checks the script

For each job: (1) the cache off (``JAXALIGN_COMPILATION_CACHE=off``), (2) a cold run into an empty cache folder,
(3) a warm run reading that folder. Wall seconds of the whole command (start-up, loading, compilation, the work
itself) and, for ``jaxalign train``, its own summary line (programs read back, compile seconds saved, written).
Jobs: the default job (``jaxalign train``, shortened to 20 steps: the same programs as the full job), SFT on the
bundled SmolLM2-135M (``--config sft:smollm2``, 2 steps, its eval and final checkpoint) and greedy
``jaxalign generate`` on SmolLM2-135M (32 new tokens). ``--jobs smollm2,generate`` picks some.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--config.model.shape.hidden_size=32", "--config.model.shape.intermediate_size=64",
         "--config.model.shape.num_layers=1", "--config.model.shape.num_heads=2", "--config.model.shape.num_kv_heads=1",
         "--config.data.toy_size=200", "--config.data.toy_eval_size=16", "--config.data.max_length=48",
         "--config.train.batch_size=8", "--config.eval.generate=0", "--config.logging.tensorboard=False",
         "--config.logging.plot=False", "--config.train.steps=4"]


def jobs(smoke: bool) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "jaxalign.cli"]
    if smoke:
        return {"train (tiny, 4 steps)": [*cli, "train", "--config", "sft", *SMALL]}
    return {"train: the default job, 20 steps": [*cli, "train", "--config.train.steps=20",
                                                 "--config.logging.tensorboard=False"],
            "train: SFT on SmolLM2-135M, 2 steps": [*cli, "train", "--config", "sft:smollm2", "--config.train.steps=2",
                                                    "--config.eval.generate=8", "--config.eval.batches=1",
                                                    "--config.logging.tensorboard=False"],
            "generate: SmolLM2-135M, 32 tokens": [*cli, "generate", "--prompt", "What is the capital of France?",
                                                  "--max-new-tokens", "32"]}


def run(command: list[str], cache: str, workdir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS")}
    env.update(JAXALIGN_COMPILATION_CACHE=cache, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if command[3] == "train":
        command = [*command, f"--config.workdir={workdir}"]
    begun = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    seconds = time.perf_counter() - begun
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    line = next((x.removeprefix("compile cache").strip() for x in done.stdout.splitlines()
                 if x.startswith("compile cache")), "")
    if not line.startswith("off"):
        line = line.split(": ", 1)[-1]  # the folder is a temporary one
    return {"seconds": round(seconds, 1), "summary": line}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="", help="write the JSON here as well")
    p.add_argument("--jobs", default="", help="only the jobs whose name contains one of these comma-separated words")
    args = p.parse_args(argv)
    chosen = {name: command for name, command in jobs(args.smoke).items()
              if not args.jobs or any(word in name for word in args.jobs.split(","))}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, command in chosen.items():
            cache = Path(tmp) / f"cache-{len(rows)}"
            row = {"job": name}
            for arm, setting in (("off", "off"), ("cold", str(cache)), ("warm", str(cache))):
                row[arm] = run(command, setting, Path(tmp) / f"run-{len(rows)}-{arm}")
            row["entries"] = len(list(cache.glob("*-cache")))
            row["megabytes"] = round(sum(f.stat().st_size for f in cache.glob("*-cache")) / 2**20, 1)
            rows.append(row)
    result = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "python": platform.python_version(), "rows": rows}
    print("| job | cache off, s | cold (writes), s | warm (reads), s | warm / off | entries (MB) "
          "| warm run's summary |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['job']} | {r['off']['seconds']} | {r['cold']['seconds']} | {r['warm']['seconds']} | "
              f"{r['warm']['seconds'] / r['off']['seconds']:.2f} | {r['entries']} ({r['megabytes']}) | "
              f"{r['warm']['summary'] or '-'} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
