"""Objectives: ``(model, batch, hparams, *, reference=None, step=0, rng=None) -> (loss, metrics)``.

Each runs exactly the forward passes its method needs and calls ``jaxalign.losses``. ``loss`` is this batch's
mean; ``metrics`` maps names to ``Metric(total, count)`` with ``metrics["loss"]`` holding the loss as a sum and
its denominator, so a trainer accumulating micro-batches differentiates ``loss * metrics["loss"].count`` (the
sum) and divides by the summed counts: the exact full-batch mean.
"""

from jaxalign.objectives.common import Metric
from jaxalign.objectives.distill import DistillParams
from jaxalign.objectives.grpo import GRPOParams
from jaxalign.objectives.ift import IFTParams, ift_lambda, mixed_embeddings
from jaxalign.objectives.kto import KTOParams
from jaxalign.objectives.mpo import MPOParams, pool_hidden
from jaxalign.objectives.preference import CPOParams, DPOParams, ORPOParams, SimPOParams
from jaxalign.objectives.registry import OBJECTIVES, Objective, get_objective, make_params
from jaxalign.objectives.reward import RewardParams
from jaxalign.objectives.sft import SFTParams

__all__ = [
    "OBJECTIVES",
    "CPOParams",
    "DPOParams",
    "DistillParams",
    "GRPOParams",
    "IFTParams",
    "KTOParams",
    "MPOParams",
    "Metric",
    "ORPOParams",
    "Objective",
    "RewardParams",
    "SFTParams",
    "SimPOParams",
    "get_objective",
    "ift_lambda",
    "make_params",
    "mixed_embeddings",
    "pool_hidden",
]
