"""The PyTorch half of ``benchmarks/cpu.py``: runs in its own virtualenv (torch, transformers, trl), reads a JSON spec
of one task (``python _torch_side.py spec.json``: the matmul peak, one train-step row, or sampling; a fresh process
for each) and prints one ``RESULT {json}`` line per measurement.

Every model is a transformers ``LlamaForCausalLM`` in float32 (SDPA attention, the default) built from the spec's
config with ``torch.manual_seed(0)``; the batches are the spec's token ids, right-padded exactly as on the jaxalign
side. Optimiser everywhere: AdamW (lr 1e-5, betas 0.9/0.95, no weight decay) after global-norm clipping at 1.0,
as in jaxalign's step. What is timed (median over ``reps`` steps after one warm-up step, batches already built):

* ``PyTorch`` SFT: ``model(input_ids, attention_mask, labels).loss`` (prompt and padding labelled -100),
  ``backward``, ``clip_grad_norm_``, ``optimizer.step``, ``zero_grad``.
* ``PyTorch`` DPO, hand-written: one forward of the policy on [chosen; rejected], float32 ``log_softmax`` of the
  full logits, gather, masked sum; the same for a frozen copy under ``torch.no_grad``; sigmoid loss (beta 0.1);
  backward, clipping, AdamW.
* ``TRL DPOTrainer`` (trl 1.16): ``trainer.train()`` for reps + 1 steps on a dataset of exactly one batch, timed by
  a callback from ``on_step_begin`` to ``on_step_end`` (TRL's forward of policy and reference, backward, clipping,
  optimizer and scheduler step, ``zero_grad``; the data loader and collator run before ``on_step_begin`` and are
  not timed). ``DPOConfig``: float32 (``bf16=False``), ``gradient_checkpointing=False`` (TRL's default is True; off
  here, as on the jaxalign side), sigmoid loss, beta 0.1, the reference a separate frozen copy. The text is a
  word-level tokenizer whose word ``t<i>`` is id ``i``, so TRL tokenises the spec's ids back to the same ids.

Sampling: ``AutoModelForCausalLM.from_pretrained(folder)`` (weights written by jaxalign's ``save_hf``),
``generate(do_sample=False, max_new_tokens=N)`` with EOS disabled, median of ``reps`` calls after a warm-up call.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time
import traceback

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, TrainerCallback

BETA, LR, BETAS, CLIP = 0.1, 1e-5, (0.9, 0.95), 1.0


def emit(record: dict) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def padded(examples: list[dict], side: str, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, completion_mask)`` ``[n, length]`` of prompt + ``side``, right-padded with 0."""
    n = len(examples)
    ids, attention, completion = (torch.zeros((n, length), dtype=torch.long) for _ in range(3))
    for row, example in enumerate(examples):
        prompt, answer = example["prompt"], example[side]
        end = len(prompt) + len(answer)
        ids[row, :end] = torch.tensor(prompt + answer)
        attention[row, :end] = 1
        completion[row, len(prompt):end] = 1
    return ids, attention, completion


def make_model(config: dict) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**config)).float().train()


def make_optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=0.0)


def timed(step, reps: int) -> list[float]:
    """Seconds of ``reps + 1`` calls of ``step`` (the first is the warm-up)."""
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def sft_step(config: dict, examples: list[dict], length: int):
    """The PyTorch SFT step on the chosen sequences, a function of no arguments (``benchmarks/step_profile.py``
    profiles it too)."""
    model = make_model(config)
    optimizer = make_optimizer(model)
    ids, attention, completion = padded(examples, "chosen", length)
    labels = ids.masked_fill(completion == 0, -100)

    def step():
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def sft_times(config: dict, examples: list[dict], length: int, reps: int) -> tuple[list[float], dict]:
    return timed(sft_step(config, examples, length), reps), {}


def sequence_logps(model, ids, attention, completion) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    per_token = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (per_token * completion[:, 1:]).sum(-1)


def dpo_times(config: dict, examples: list[dict], length: int, reps: int) -> tuple[list[float], dict]:
    model = make_model(config)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = make_optimizer(model)
    chosen, rejected = padded(examples, "chosen", length), padded(examples, "rejected", length)
    ids, attention, completion = (torch.cat([c, r]) for c, r in zip(chosen, rejected, strict=True))
    n = len(examples)

    def step():
        policy = sequence_logps(model, ids, attention, completion)
        with torch.no_grad():
            ref = sequence_logps(reference, ids, attention, completion)
        margin = (policy[:n] - ref[:n]) - (policy[n:] - ref[n:])
        loss = -F.logsigmoid(BETA * margin).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(step, reps), {}


class StepTimer(TrainerCallback):
    """Seconds of each optimizer step, ``on_step_begin`` to ``on_step_end``."""

    def __init__(self):
        self.times, self.start = [], 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.start)


SPECIAL_WORDS = ("<pad>", "<unk>", "</s>")  # ids 0, 1, 2; other ids are the words t<i>


def word(i: int) -> str:
    return SPECIAL_WORDS[i] if i < len(SPECIAL_WORDS) else f"t{i}"


def word_tokenizer(vocab_size: int):
    """A tokenizer whose whitespace-separated ``word(i)`` is id ``i`` (pad 0, unknown 1, EOS 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({word(i): i for i in range(vocab_size)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")


def trl_times(config: dict, examples: list[dict], length: int, reps: int) -> tuple[list[float], dict]:
    import datasets
    from trl import DPOConfig, DPOTrainer

    datasets.disable_progress_bars()

    def text(ids):
        return " ".join(word(i) for i in ids)

    data = datasets.Dataset.from_list([{"prompt": text(e["prompt"]), "chosen": " " + text(e["chosen"]),
                                        "rejected": " " + text(e["rejected"])} for e in examples])

    model = make_model(config)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, per_device_train_batch_size=len(examples), max_steps=reps + 1,
                         learning_rate=LR, lr_scheduler_type="constant", adam_beta1=BETAS[0], adam_beta2=BETAS[1],
                         weight_decay=0.0, max_grad_norm=CLIP, beta=BETA, loss_type=["sigmoid"],
                         gradient_checkpointing=False, bf16=False, use_cpu=True, report_to=[], save_strategy="no",
                         logging_steps=10_000, disable_tqdm=True, max_length=max(length, 1024), seed=0,
                         dataloader_num_workers=0)
        trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=data,
                             processing_class=word_tokenizer(config["vocab_size"]), callbacks=[timer])
        batch = next(iter(trainer.get_train_dataloader()))
        expected = sum(len(e["prompt"]) + len(e[side]) for e in examples for side in ("chosen", "rejected"))
        if int(batch["attention_mask"].sum()) != expected or batch["input_ids"].shape[1] != length:
            raise RuntimeError(f"TRL's batch differs from the spec: {int(batch['attention_mask'].sum())} real tokens "
                               f"of {tuple(batch['input_ids'].shape)}, expected {expected} of length {length}")
        trainer.train()
    details = {"gradient_checkpointing": args.gradient_checkpointing, "bf16": args.bf16,
               "attn_implementation": model.config._attn_implementation}
    return timer.times, details


def trl_grpo(spec: dict) -> None:
    """TRL's ``GRPOTrainer`` for ``reps + 1`` steps on ``prompts`` prompts (the spec's ids as words), timed per step
    (``on_step_begin`` to ``on_step_end``) and inside ``_generate_and_score_completions`` (the rollout); see
    ``benchmarks/grpo_cpu.py``."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    datasets.disable_progress_bars()
    g, length, reps = spec["generations"], spec["completion_length"], spec["reps"]
    prompts = [" ".join(word(i) for i in ids) for ids in spec["prompt_ids"]]
    data = datasets.Dataset.from_list([{"prompt": text} for text in prompts] * (reps + 1))

    def even_share(completions, completion_ids, **_):
        return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]

    timer, rollouts, lengths = StepTimer(), [], []
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=len(prompts) * g, num_generations=g,
                          max_completion_length=length, generation_kwargs={"min_new_tokens": length},
                          temperature=1.0, max_steps=reps + 1, learning_rate=LR, lr_scheduler_type="constant",
                          adam_beta1=BETAS[0], adam_beta2=BETAS[1], weight_decay=0.0, max_grad_norm=CLIP,
                          gradient_checkpointing=False, bf16=False, use_cpu=True, report_to=[], save_strategy="no",
                          logging_steps=10_000, disable_tqdm=True, seed=0, dataloader_num_workers=0,
                          shuffle_dataset=False)
        trainer = GRPOTrainer(model=make_model(spec["config"]), reward_funcs=even_share, args=args,
                              train_dataset=data, processing_class=word_tokenizer(spec["config"]["vocab_size"]),
                              callbacks=[timer])
        generate = trainer._generate_and_score_completions

        def timed_generate(*a, **k):
            start = time.perf_counter()
            output = generate(*a, **k)
            rollouts.append(time.perf_counter() - start)
            lengths.append(int(output["completion_mask"].sum()))
            return output

        trainer._generate_and_score_completions = timed_generate
        trainer.train()
    expected = len(prompts) * g * length
    if any(n != expected for n in lengths):
        raise RuntimeError(f"TRL generated {lengths} completion tokens per step, expected {expected}")
    rollout_s, train_s = rollouts, [t - r for t, r in zip(timer.times, rollouts, strict=True)]
    emit({"side": "torch", "shape": spec["shape"], "step_s": float(np.median(timer.times[1:])),
          "rollout_s": float(np.median(rollout_s[1:])), "train_s": float(np.median(train_s[1:])),
          "warmup_step_s": timer.times[0], "step_times_s": timer.times, "trl": versions()["trl"],
          "attn_implementation": trainer.model.config._attn_implementation})


def matmul_peak(sizes: list[int]) -> dict:
    by_size = {}
    for size in sizes:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)
        times = []
        for _ in range(10):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        by_size[str(size)] = 2 * size**3 / float(np.median(times)) / 1e9
    return {"side": "torch", "gflops_by_size": by_size, "gflops": max(by_size.values())}


def sampling(spec: dict) -> None:
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # random weights: always generate the full length, as jaxalign does
    new = spec["new_tokens"]
    for prompts in spec["prompts"]:
        ids = torch.tensor(prompts)

        def run(ids=ids):
            with torch.no_grad():
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                      pad_token_id=0)

        tokens = run()  # warm-up
        times = []
        for _ in range(spec["reps"]):
            start = time.perf_counter()
            tokens = run()
            times.append(time.perf_counter() - start)
        seconds = float(np.median(times))
        emit({"side": "torch", "batch": len(prompts), "seconds": seconds, "tokens_per_s": len(prompts) * new / seconds,
              "tokens": tokens[:, ids.shape[1]:].tolist()})


TRAIN_RUNS = {("sft", "PyTorch"): sft_times, ("dpo", "PyTorch"): dpo_times, ("dpo", "TRL DPOTrainer"): trl_times}


def versions() -> dict:
    try:
        import trl
    except ImportError:
        trl = None
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "trl": trl.__version__ if trl else None, "threads": torch.get_num_threads()}


def train(spec: dict) -> None:
    record = {"side": "torch", "shape": spec["shape"], "objective": spec["objective"],
              "implementation": spec["implementation"], "logps_chunk_size": 0}
    try:
        run = TRAIN_RUNS[spec["objective"], spec["implementation"]]
        times, details = run(spec["config"], spec["examples"], spec["length"], spec["reps"])
        record.update(step_s=float(np.median(times[1:])), step_times_s=times, **details)
    except ImportError as err:
        record["error"] = f"{err} (run benchmarks/cpu.py once without --smoke to create the virtualenv)"
    except Exception as err:  # reported as a row, not a crash
        record["error"] = f"{type(err).__name__}: {err}"[:500]
        print(traceback.format_exc(), file=sys.stderr)
    emit(record)


def main() -> None:
    """One task per process (``peak``, ``train``, ``grpo`` or ``sampling``), so no measurement inherits another's
    heap."""
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    torch.set_num_threads(spec["threads"])
    if spec["task"] == "peak":
        emit({**matmul_peak(spec["peak_sizes"]), "versions": versions()})
    elif spec["task"] == "train":
        train(spec)
    elif spec["task"] == "grpo":
        trl_grpo(spec)
    else:
        sampling(spec)


if __name__ == "__main__":
    main()
