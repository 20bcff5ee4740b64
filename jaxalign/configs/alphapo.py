"""AlphaPO on toy preference pairs: CPO's ``alphapo`` loss type (SimPO's margin loss on the reward shape
``(1 − p^(−α)) / α`` of the length-averaged probability, no NLL term), as TRL 1.16 runs it. α = 0.25 and
γ = 0.5 are starting points to tune (AlphaPO, Gupta et al., 2025, arXiv 2501.03884), β = 2.0 as SimPO's."""

from jaxalign.configs import base, presets


def get_config(arg=None):
    config = base.get_config()
    config.workdir = "runs/alphapo"
    base.use_toy(config, "toy:preferences")
    config.objective.name = "cpo"
    config.objective.params.loss_type = "alphapo"
    config.objective.params.beta = 2.0
    config.objective.params.simpo_gamma = 0.5
    config.objective.params.alpha = 0.25
    config.optim.lr = 1e-3
    return presets.apply(config, arg)
