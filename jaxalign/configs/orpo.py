"""ORPO on toy preference pairs (reference-free); λ = 0.1 (TRL's default)."""

from jaxalign.configs import base, presets


def get_config(arg=None):
    config = base.get_config()
    config.workdir = "runs/orpo"
    base.use_toy(config, "toy:preferences")
    config.objective.name = "orpo"
    config.objective.params.lam = 0.1
    config.optim.lr = 1e-3
    return presets.apply(config, arg)
