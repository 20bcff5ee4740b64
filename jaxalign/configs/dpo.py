"""DPO on toy preference pairs (correct vs wrong answer). The reference is the initial policy.

A real run starts from an SFT model: set `model.path` to it (and `data.train` to your pairs).
"""

from jaxalign.configs import base, presets


def get_config(arg=None):
    config = base.get_config()
    config.workdir = "runs/dpo"
    base.use_toy(config, "toy:preferences")
    config.objective.name = "dpo"
    config.objective.params.beta = 0.1
    config.objective.params.loss_type = "sigmoid"
    config.optim.lr = 1e-3
    return presets.apply(config, arg)
