"""Sampling: KV-cache generation (greedy / temperature / top-k / top-p, several samples, per-step probabilities)
and Nudging (inference-time guidance of a base model by a small aligned model)."""

from jaxalign.sampling.generate import (
                                       Generation,
                                       decoding_model,
                                       generate,
                                       left_pad,
                                       sample,
                                       sample_logits,
                                       stop_string_lengths,
                                       truncate_at_stop,
)
from jaxalign.sampling.nudging import NudgingResult, TextModel, nudge, nudge_cached

__all__ = ["Generation", "NudgingResult", "TextModel", "decoding_model", "generate", "left_pad", "nudge",
           "nudge_cached", "sample", "sample_logits", "stop_string_lengths", "truncate_at_stop"]
