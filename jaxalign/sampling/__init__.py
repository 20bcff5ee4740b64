"""Sampling: KV-cache generation (greedy / temperature / top-k / top-p, several samples, per-step probabilities)."""

from jaxalign.sampling.generate import Generation, generate, sample, sample_logits, truncate_at_stop

__all__ = ["Generation", "generate", "sample", "sample_logits", "truncate_at_stop"]
