"""Objectives by name, each with every fact the rest of jaxalign needs about it.

The data phase reads ``data_kind``, ``jaxalign plan`` reads ``rows_per_example``, the builder reads
``uses_reference``, the config reads ``params`` (and its defaults), the console reads ``console``, validation
reads ``packing``; the CLI's choices and the tests' lists come from ``OBJECTIVES`` too.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any

from jaxalign.objectives import distill, grpo, ift, kto, mpo, preference, reward, sft


@dataclasses.dataclass(frozen=True)
class Objective:
    """``fn(model, batch, hparams, *, reference=None, step=0, rng=None) -> (loss, metrics)``.

    ``data_kind``: the examples it trains on (``sft``, ``preference``, ``unpaired`` (KTO), ``mpo``; ``prompt``:
    prompts it samples completions for, online); ``rows_per_example``: sequences per example in the forward pass
    (chosen + rejected; KTO: completion + mismatched; MPO: both languages); ``uses_reference``: needs a frozen
    reference (unless its params say ``reference_free``); ``console``: the headline metrics, shown on the log
    line and drawn in ``curves.png``; ``packing``: supports ``data.packing`` (``packing_note`` says why not);
    ``head``: ``lm`` (a causal LM) or ``reward`` (a scalar score head, ``LlamaConfig.num_labels = 1``);
    ``uses_teacher``: a frozen teacher model (``params.teacher``) is loaded and passed in the reference slot."""

    fn: Callable
    params: type
    data_kind: str
    rows_per_example: int
    uses_reference: bool = False
    console: tuple[str, ...] = ("loss",)
    packing: bool = True
    packing_note: str = ""
    head: str = "lm"
    uses_teacher: bool = False


PAIR_METRICS = ("loss", "rewards/margins", "rewards/accuracies")

# in the order the docs and messages list them
OBJECTIVES: dict[str, Objective] = {
    "sft": Objective(sft.sft, sft.SFTParams, "sft", 1, console=("loss", "nll/token")),
    "ift": Objective(ift.ift, ift.IFTParams, "sft", 1, console=("loss", "nll/token", "ift/lambda")),
    "dpo": Objective(preference.dpo, preference.DPOParams, "preference", 2, uses_reference=True,
                     console=PAIR_METRICS),
    "simpo": Objective(preference.simpo, preference.SimPOParams, "preference", 2, console=PAIR_METRICS),
    "orpo": Objective(preference.orpo, preference.ORPOParams, "preference", 2, console=PAIR_METRICS),
    "cpo": Objective(preference.cpo, preference.CPOParams, "preference", 2, console=PAIR_METRICS),
    "kto": Objective(kto.kto, kto.KTOParams, "unpaired", 2, uses_reference=True,
                     console=("loss", "kl", "rewards/chosen", "rewards/rejected"), packing=False,
                     packing_note="its KL reference point pairs each prompt with another example's completion"),
    "reward": Objective(reward.reward, reward.RewardParams, "preference", 2,
                        console=PAIR_METRICS, packing=False,
                        packing_note="it scores each sequence at its last token", head="reward"),
    "distill": Objective(distill.distill, distill.DistillParams, "sft", 1, console=("loss", "nll/token"),
                         uses_teacher=True),
    "mpo": Objective(mpo.mpo, mpo.MPOParams, "mpo", 4, uses_reference=True,
                     console=("loss", "mpo/gap_loss", "rewards/accuracies"), packing=False,
                     packing_note="its preservation term pools hidden states per sequence"),
    "grpo": Objective(grpo.grpo, grpo.GRPOParams, "prompt", 1, uses_reference=True,
                      console=("loss", "reward", "completion/mean_length"), packing=False,
                      packing_note="it trains on completions it samples"),
}


def get_objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise KeyError(f"unknown objective {name!r}; available: {', '.join(sorted(OBJECTIVES))}")
    return OBJECTIVES[name]


def make_params(name: str, values: Mapping[str, Any] | None = None):
    """The hyper-parameter dataclass of objective ``name`` from a mapping; unknown keys are an error that
    lists the valid ones."""
    params_cls = get_objective(name).params
    values = dict(values or {})
    fields = {f.name for f in dataclasses.fields(params_cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        close = {u: difflib.get_close_matches(u, fields, n=1, cutoff=0.6) for u in unknown}
        hints = "".join(f"; did you mean {c[0]!r} for {u!r}?" for u, c in close.items() if c)
        raise ValueError(f"objective {name!r} has no hyper-parameters {unknown}; valid: {sorted(fields)}{hints}")
    return params_cls(**values)
