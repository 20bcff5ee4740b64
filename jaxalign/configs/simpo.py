"""SimPO on toy preference pairs (reference-free); β = 2.0, γ/β = 0.8 as in the IFT paper's baseline."""

from jaxalign.configs import base, presets


def get_config(arg=None):
    config = base.get_config()
    config.workdir = "runs/simpo"
    base.use_toy(config, "toy:preferences")
    config.objective.name = "simpo"
    config.objective.params.beta = 2.0
    config.objective.params.gamma_beta_ratio = 0.8
    config.optim.lr = 1e-3
    return presets.apply(config, arg)
