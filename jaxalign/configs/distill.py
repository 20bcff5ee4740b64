"""Distillation on toy arithmetic: a student learns a frozen teacher's next-token distributions on the SFT
completions (generalized JSD, GKD's β = 0.5). Set the teacher: a model with the student's tokenizer, e.g. the run
folder of ``jaxalign train --config sft --config.model.shape.num_layers=4 --config.workdir=runs/teacher``::

    jaxalign train --config distill --config.objective.params.teacher=runs/teacher
"""

from jaxalign.configs import base, presets


def get_config(arg=None):
    config = base.get_config()
    config.workdir = "runs/distill"
    base.use_toy(config, "toy:arithmetic")
    config.objective.name = "distill"
    config.objective.params.teacher = ""
    config.objective.params.beta = 0.5
    config.objective.params.temperature = 1.0
    config.optim.lr = 1e-3
    return presets.apply(config, arg)
