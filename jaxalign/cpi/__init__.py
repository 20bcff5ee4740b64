"""CPI-FT (Core Parameter Isolation Fine-Tuning, Wang, Liang & Peng, EMNLP 2025): core masks, task grouping,
core transplant + SLERP fusion, and an optimizer that keeps frozen entries fixed. ``jaxalign.cpi.pipeline`` runs
the whole method."""

from jaxalign.cpi.fusion import fuse, slerp
from jaxalign.cpi.grouping import group_tasks, jaccard, jaccard_matrix
from jaxalign.cpi.masks import core_mask, kth_largest, mask_size, update_magnitudes
from jaxalign.cpi.optimizer import freeze, union

__all__ = ["core_mask", "freeze", "fuse", "group_tasks", "jaccard", "jaccard_matrix", "kth_largest", "mask_size",
           "slerp", "union", "update_magnitudes"]
