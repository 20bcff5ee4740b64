"""CPO on toy preference pairs (reference-free; TRL 1.16's CPOTrainer defaults: β = 0.1, sigmoid loss, NLL
weight cpo_alpha = 1). AlphaPO: ``--config alphapo``; SimPO-CPO: ``--config.objective.params.loss_type=simpo``."""

from jaxalign.configs import base, presets


def get_config(arg=None):
    config = base.get_config()
    config.workdir = "runs/cpo"
    base.use_toy(config, "toy:preferences")
    config.objective.name = "cpo"
    config.objective.params.beta = 0.1
    config.objective.params.loss_type = "sigmoid"
    config.objective.params.cpo_alpha = 1.0
    config.optim.lr = 1e-3
    return presets.apply(config, arg)
