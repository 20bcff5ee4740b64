"""Objectives by name, with their hyper-parameter classes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from jaxalign.objectives import ift, mpo, preference, sft


class Objective(NamedTuple):
    fn: Callable
    params: type
    uses_reference: bool


OBJECTIVES: dict[str, Objective] = {
    "sft": Objective(sft.sft, sft.SFTParams, False),
    "dpo": Objective(preference.dpo, preference.DPOParams, True),
    "simpo": Objective(preference.simpo, preference.SimPOParams, False),
    "orpo": Objective(preference.orpo, preference.ORPOParams, False),
    "ift": Objective(ift.ift, ift.IFTParams, False),
    "mpo": Objective(mpo.mpo, mpo.MPOParams, True),
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
    fields = {f.name for f in params_cls.__dataclass_fields__.values()}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"objective {name!r} has no hyper-parameters {unknown}; valid: {sorted(fields)}")
    return params_cls(**values)
