"""Writes tests/assets/trl_dpo_golden.json (+ two tiny safetensors models) from TRL's DPOTrainer.

Run in an environment with torch and trl (e.g. `pip install torch==2.13.0 trl==1.16.0`):

    python tests/assets/make_trl_dpo_golden.py

A tiny random Llama policy and a *different* random reference are saved next to this file; TRL's
`DPOTrainer` tokenises a small arithmetic preference set, collates one batch, and computes its first-step
loss and `rewards/*` metrics for each loss variant. The JSON stores the collated token ids and masks so the
jaxalign test replays exactly the same batch without TRL.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer

HERE = Path(__file__).parent
WORDS = ["<pad>", "<eos>", "what", "is", "plus", "minus", "?", "the", "answer", "=", *[str(i) for i in range(20)]]
VARIANTS = [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.1)]


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def records() -> list[dict]:
    rows = []
    for i, (a, b) in enumerate([(2, 3), (4, 5), (7, 1), (6, 6), (9, 3), (8, 2)]):
        answer = a + b if i % 2 == 0 else a - b
        op = "plus" if i % 2 == 0 else "minus"
        rows.append({"prompt": f"what is {a} {op} {b} ?",
                     "chosen": f" the answer = {answer}" if i < 3 else f" {answer}",
                     "rejected": f" the answer = {answer + 1}"})
    return rows


def main() -> None:
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    policy = LlamaForCausalLM(config)
    torch.manual_seed(1)
    reference = LlamaForCausalLM(config)
    policy.save_pretrained(HERE / "trl_dpo_policy")
    reference.save_pretrained(HERE / "trl_dpo_reference")
    tok = tokenizer()
    dataset = Dataset.from_list(records())
    golden: dict = {"beta": 0.1, "variants": {}}
    for loss_type, smoothing in VARIANTS:
        with tempfile.TemporaryDirectory() as out:
            args = DPOConfig(output_dir=out, per_device_train_batch_size=len(dataset), beta=0.1, loss_type=loss_type,
                             label_smoothing=smoothing, max_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                             logging_steps=1, bf16=False)  # f32 throughout (bf16 autocasts the reference)
            trainer = DPOTrainer(model=LlamaForCausalLM.from_pretrained(HERE / "trl_dpo_policy"),
                                 ref_model=LlamaForCausalLM.from_pretrained(HERE / "trl_dpo_reference"),
                                 args=args, train_dataset=dataset, processing_class=tok)
            batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(dataset))])
            batch = {k: v.to(trainer.model.device) if hasattr(v, "to") else v for k, v in batch.items()}
            trainer.model.train()  # as in the training loop (metrics are filed under "train"; no dropout here)
            with torch.no_grad():
                loss = trainer.compute_loss(trainer.model, batch)
            metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith(("rewards/", "logps/"))}
            golden["variants"][f"{loss_type}_{smoothing}"] = {"loss_type": loss_type, "label_smoothing": smoothing,
                                                              "loss": float(loss), **metrics}
            golden["batch"] = {k: batch[k].tolist() for k in ("input_ids", "attention_mask", "completion_mask")}
    golden["versions"] = {"trl": __import__("trl").__version__, "torch": torch.__version__,
                          "transformers": __import__("transformers").__version__}
    (HERE / "trl_dpo_golden.json").write_text(json.dumps(golden, indent=1))
    print(json.dumps({k: v for k, v in golden.items() if k != "batch"}, indent=1))


if __name__ == "__main__":
    main()
