"""The command line on a tiny local model: generate, convert, info, and error messages."""

import json

import pytest
from test_gguf import TEMPLATE, train_bpe, write_gguf
from transformers import PreTrainedTokenizerFast

from jaxalign.cli import main
from jaxalign.models import create_model, save_hf


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_config):
    folder = tmp_path_factory.mktemp("tiny")
    bpe = train_bpe("gpt2")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        chat_template=TEMPLATE)
    config = tiny_config.replace(vocab_size=bpe.get_vocab_size())
    save_hf(create_model(config, seed=3), folder, tokenizer=tokenizer)
    return folder, config, bpe


def test_generate_batch_json(tiny_folder, capsys):
    folder, _, _ = tiny_folder
    code = main(["generate", "--model", str(folder), "--prompt", "Hello", "--prompt", "The capital of France",
                 "--max-new-tokens", "5", "--json"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello", "The capital of France"]
    assert all(isinstance(line["completion"], str) for line in lines)


def test_generate_prompts_file_errors_name_the_record(tiny_folder, tmp_path, capsys):
    folder, _, _ = tiny_folder
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hi"}\n{"question": "no prompt here"}\n')
    assert main(["generate", "--model", str(folder), "--prompts-file", str(prompts)]) == 2
    assert "prompts.jsonl, record 2: field 'prompt'" in capsys.readouterr().err


def test_missing_model_is_a_message(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "no such model folder" in err and "Traceback" not in err


def test_convert_and_info(tiny_folder, tmp_path, capsys):
    folder, config, bpe = tiny_folder
    write_gguf(tmp_path / "tiny.gguf", folder, config, bpe, "gpt2")
    assert main(["convert", str(tmp_path / "tiny.gguf"), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").exists()
    capsys.readouterr()
    assert main(["info", "--model", str(tmp_path / "out")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_params"] == config.num_params() and info["vocab_size"] == config.vocab_size


def test_data_toy_and_inspect(tmp_path, capsys):
    path = tmp_path / "arith.jsonl"
    assert main(["data", "toy", "arithmetic", "--out", str(path), "--n", "20", "--style", "verbose"]) == 0
    assert main(["data", "inspect", str(path), "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "[[" in out and "The answer is" in out and "20 of 20 records usable" in out
    with path.open("a") as handle:
        handle.write('{"messages": [{"role": "user", "content": "no answer"}]}\n')
    assert main(["data", "inspect", str(path), "-n", "0"]) == 0
    assert "record 20, field 'messages': has no assistant turn" in capsys.readouterr().out
    assert main(["data", "inspect", str(path), "--objective", "dpo"]) == 2
    assert "field 'chosen': missing" in capsys.readouterr().err


def test_route_writes_table_and_plot(tiny_folder, tmp_path, capsys):
    from jaxalign.data.toy import arithmetic, write_jsonl

    data = write_jsonl(arithmetic(6, seed=1), tmp_path / "eval.jsonl")
    folder, _, _ = tiny_folder
    assert main(["route", "--small", str(folder), "--data", str(data), "--out", str(tmp_path / "route"),
                 "--taus", "0.2,0.8", "--cascade-samples", "2", "--max-new-tokens", "4"]) == 0
    report = json.loads((tmp_path / "route" / "route.json").read_text())
    assert len(report["curves"]["pre_generation"]) == 2 and len(report["curves"]["cascade"]) == 11
    assert report["large_alone"]["accuracy"] == 1.0  # the exact solver
    assert (tmp_path / "route" / "route.png").stat().st_size > 1000
    assert "| small alone |" in capsys.readouterr().out
