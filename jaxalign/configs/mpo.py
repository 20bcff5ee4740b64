"""MPO on toy two-"language" records (target = dominant under a letter cipher); β = 1.0, mean pooling."""

from jaxalign.configs import base, presets


def get_config(arg=None):
    config = base.get_config()
    config.workdir = "runs/mpo"
    base.use_toy(config, "toy:mpo")
    config.objective.name = "mpo"
    config.objective.params.beta = 1.0
    config.objective.params.pooling = "mean"
    config.optim.lr = 1e-3
    return presets.apply(config, arg)
