"""IFT (Hua et al., ACL 2025) with the official defaults: λ = 0.2, γ = 0.95, RMSprop as in the paper."""

from jaxalign.configs import base, presets


def get_config(arg=None):
    config = base.get_config()
    config.workdir = "runs/ift"
    base.use_toy(config)
    config.objective.name = "ift"
    config.objective.params.max_lambda = 0.2
    config.objective.params.gamma = 0.95
    config.optim.name = "rmsprop"
    config.optim.lr = 1e-3
    return presets.apply(config, arg)
