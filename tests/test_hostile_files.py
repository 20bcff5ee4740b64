"""Hostile and broken model files get one line naming the file and the tensor or field, fast, before anything big
is allocated: lying safetensors headers, impossible shapes, truncation, relabelled dtypes, absurd config values, cut
or inflated GGUF headers. Every case runs through the CLI (``jaxalign info --model PATH``) in one subprocess that
measures each case's time and peak-memory growth (VmHWM, reset before each case)."""

import json
import math
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_gguf import train_bpe, write_gguf

from jaxalign.models import create_model, save_hf


def _header(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _rewrite(file: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _case_folders(root: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """name -> (model path, text the one-line error must contain)."""
    cases = {}
    weights = "model.safetensors"
    tensor = "model.layers.0.self_attn.q_proj.weight"

    def variant(name, edit_header=None, edit_bytes=None, edit_config=None, expect=""):
        folder = _copy(good, root / name)
        if edit_header is not None:
            header, data = _header(folder / weights)
            edit_header(header)
            _rewrite(folder / weights, header, data)
        if edit_bytes is not None:
            (folder / weights).write_bytes(edit_bytes((folder / weights).read_bytes()))
        if edit_config is not None:
            config = json.loads((folder / "config.json").read_text())
            config.update(edit_config)
            (folder / "config.json").write_text(json.dumps(config))
        cases[name] = (folder, expect)

    def lie_offsets(h):
        h[tensor]["data_offsets"][1] += 10**9

    def huge_shape(h):
        h[tensor]["shape"] = [10**6, 10**6]

    def relabel(h):
        h[tensor]["dtype"] = "I32"

    variant("lying_offsets", lie_offsets, expect=f"tensor {tensor}: data_offsets")
    variant("shape_1e12", huge_shape, expect=f"tensor {tensor}: shape (1000000, 1000000) of F32 needs")
    variant("half_truncated", edit_bytes=lambda b: b[: len(b) // 2], expect="lie outside the file's")
    variant("huge_header_length", edit_bytes=lambda b: struct.pack("<Q", 2**60) + b[8:],
            expect="the header claims 1152921504606846976 bytes")
    variant("f32_labelled_i32", relabel, expect=f"tensor {tensor} has dtype I32; weights must be floating point")
    variant("zero_heads", edit_config={"num_attention_heads": 0},
            expect="num_attention_heads=0 must be an integer in [1, 1024]")
    variant("negative_layers", edit_config={"num_hidden_layers": -3},
            expect="num_hidden_layers=-3 must be an integer in [1, 1024]")
    variant("nan_eps", edit_config={"rms_norm_eps": math.nan}, expect="rms_norm_eps=nan must be a finite number")
    variant("layers_1e9", edit_config={"num_hidden_layers": 10**9},
            expect="num_hidden_layers=1000000000 must be an integer in [1, 1024]")
    return cases


def _gguf_cases(root: Path, tiny_config) -> dict[str, tuple[Path, str]]:
    tokenizer = train_bpe("gpt2")
    config = tiny_config.replace(vocab_size=tokenizer.get_vocab_size())
    save_hf(create_model(config, seed=1), root / "gguf_hf")
    good = root / "good.gguf"
    write_gguf(good, root / "gguf_hf", config, tokenizer, "gpt2")
    raw = good.read_bytes()
    (root / "cut.gguf").write_bytes(raw[:200])
    (root / "cut_later.gguf").write_bytes(raw[:1200])  # the counts fit; the metadata is cut
    (root / "counts.gguf").write_bytes(raw[:8] + struct.pack("<Q", 2**60) + raw[16:])
    return {"gguf_cut_in_header": (root / "cut.gguf", "metadata fields, more than a 200-byte file can hold"),
            "gguf_cut_in_metadata": (root / "cut_later.gguf", "not a readable GGUF file"),
            "gguf_huge_counts": (root / "counts.gguf", "the header claims 1152921504606846976 tensors")}


RUNNER = textwrap.dedent("""
    import contextlib, io, json, sys, time
    from jaxalign.cli import main

    def status(field):  # this process's own RSS figures in bytes (ru_maxrss would include the forked parent's)
        return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1]) * 1024

    def reset_peak():  # VmHWM restarts from the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return status("VmRSS")

    cases = json.loads(sys.argv[1])
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["info", "--model", cases.pop("good")]) == 0  # imports and compiles out of the way
    for name, path in cases.items():
        err = io.StringIO()
        before, start = reset_peak(), time.perf_counter()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(["info", "--model", path])
        seconds, grown = time.perf_counter() - start, status("VmHWM") - before
        print(json.dumps({"name": name, "code": code, "err": err.getvalue(), "seconds": seconds, "grown": grown}))
""")



def test_every_hostile_model_file_is_one_line_fast_and_small(tmp_path, tiny_config):
    good = tmp_path / "good"
    save_hf(create_model(tiny_config, seed=0), good)
    cases = {**_case_folders(tmp_path, good), **_gguf_cases(tmp_path, tiny_config)}
    paths = {"good": str(good), **{name: str(path) for name, (path, _) in cases.items()}}
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(paths)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["name"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert set(results) == set(cases)
    for name, (path, expect) in cases.items():
        result = results[name]
        lines = result["err"].strip().splitlines()
        assert result["code"] == 2, (name, result)
        assert len(lines) == 1 and lines[0].startswith(f"jaxalign info: error: {path}"), (name, lines)
        assert expect in lines[0], (name, lines[0])
        assert result["seconds"] < 5, (name, result["seconds"])
        assert result["grown"] < 100 * 2**20, (name, result["grown"])


@pytest.mark.parametrize("field", ["num_hidden_layers", "hidden_size", "vocab_size"])
def test_config_values_are_checked_before_the_model_is_built(tmp_path, tiny_config, field):
    from jaxalign.models import CheckpointError, load_hf

    save_hf(create_model(tiny_config), tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config[field] = 2**40
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"config.json: invalid LlamaConfig: {field}=1099511627776 must be"):
        load_hf(tmp_path / "m")
