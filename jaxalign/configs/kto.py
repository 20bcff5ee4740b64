"""KTO on toy data: the toy preference pairs unpaired into desirable (correct answer) and undesirable (wrong
answer) completions, as TRL unpairs a preference dataset; β = 0.1, λ_D = λ_U = 1 (TRL 1.16's KTOConfig). The
reference is the initial policy. A real run takes TRL's unpaired format: ``prompt``, ``completion``, ``label``."""

from jaxalign.configs import base, presets


def get_config(arg=None):
    config = base.get_config()
    config.workdir = "runs/kto"
    base.use_toy(config, "toy:preferences")
    config.objective.name = "kto"
    config.objective.params.beta = 0.1
    config.objective.params.desirable_weight = 1.0
    config.objective.params.undesirable_weight = 1.0
    config.optim.lr = 1e-3
    return presets.apply(config, arg)
