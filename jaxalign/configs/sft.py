"""SFT on toy arithmetic chat data (swap `data.train` for your files and `model.path` for your model)."""

from jaxalign.configs import base, presets


def get_config(arg=None):
    config = base.get_config()
    config.workdir = "runs/sft"
    base.use_toy(config)
    config.objective.name = "sft"
    config.objective.params.normalization = "token"
    return presets.apply(config, arg)
