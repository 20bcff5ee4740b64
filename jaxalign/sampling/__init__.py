"""Sampling: KV-cache generation (greedy / temperature / top-k / top-p)."""

from jaxalign.sampling.generate import generate, sample_logits

__all__ = ["generate", "sample_logits"]
