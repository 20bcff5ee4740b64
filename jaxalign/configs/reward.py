"""A reward model on toy preference pairs (correct vs wrong answer): the decoder with a scalar score head,
Bradley-Terry loss (TRL 1.16's RewardTrainer). From a pretrained or SFT model: set ``model.path`` (its LM head is
replaced by a new score head). Export gives an ``AutoModelForSequenceClassification`` folder; GRPO uses it with
``--config.objective.params.rewards=reward_model:PATH``."""

from jaxalign.configs import base, presets


def get_config(arg=None):
    config = base.get_config()
    config.workdir = "runs/reward"
    base.use_toy(config, "toy:preferences")
    config.objective.name = "reward"
    config.objective.params.center_rewards_coefficient = 0.0
    config.optim.lr = 1e-3
    config.eval.generate = 0  # a reward model scores; it does not generate
    return presets.apply(config, arg)
