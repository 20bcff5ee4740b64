"""GKD on toy arithmetic (TRL's ``GKDTrainer`` defaults): half the steps train on the student's own samples of the
prompts (``lmbda = 0.5``), the others on the data's completions, by the generalized JSD (β = 0.5) at temperature 0.9.
Set the teacher: a model with the student's tokenizer, e.g. the run folder of
``jaxalign train --config sft --config.model.shape.num_layers=4 --config.workdir=runs/teacher``::

    jaxalign train --config gkd --config.objective.params.teacher=runs/teacher

``--config.objective.params.seq_kd=True`` replaces the data's completions by the teacher's samples (sequence-level
KD); ``lmbda=1`` trains on the student's samples only.
"""

from jaxalign.configs import distill, presets


def get_config(arg=None):
    config = distill.get_config()
    config.workdir = "runs/gkd"
    config.objective.params.lmbda = 0.5
    config.objective.params.seq_kd = False
    config.objective.params.max_new_tokens = 32
    config.objective.params.temperature = 0.9
    return presets.apply(config, arg)
