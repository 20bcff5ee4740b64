"""What `jaxalign train` runs with no flags: a tiny Llama learns toy arithmetic with IFT.

λ warms up linearly from 0 (plain SFT with propagation weights) to 0.2, so the temporal-residual mixing starts
once the model's own guesses mean something; held-out exact-match accuracy is printed before and after.

The model starts from random weights, so its input-embedding table learns (``embedding_grad="ground_truth"``; with
λ = γ = 0 this is SFT exactly). The official code's frozen input table (``"none"``) suits a pretrained table and
kept this job's inputs at their random values; pointed at a pretrained model (``model.path``, a model preset) the
job goes back to it. The loss is averaged per token (``normalization="token"``, as ``--config sft`` averages it):
from random weights, IFT averaged per sequence (the official code's averaging) trailed SFT at equal steps, and per
token it does not (``experiments/default_job.py``, docs/results.md "The default job").
"""

from jaxalign.configs import base, presets


def get_config(arg=None):
    config = base.get_config()
    config.workdir = "runs/default"
    config.train.steps = 1500
    config.train.eval_every = 500
    config.train.save_every = 500
    base.use_toy(config)
    config.objective.name = "ift"
    config.objective.params.max_lambda = 0.2
    config.objective.params.min_lambda = 0.0
    config.objective.params.lambda_schedule = "linear"
    config.objective.params.warmup_steps = 300
    config.objective.params.gamma = 0.95
    config.objective.params.embedding_grad = "ground_truth"
    config.objective.params.normalization = "token"
    return presets.apply(config, arg)
