"""Training: configs and validation, the sharded jitted step, the loop with Orbax checkpoints, evaluation,
metric writers and the reference-log-prob cache."""

from jaxalign.train.config import ConfigError, apply_override, load_config, validate
from jaxalign.train.loop import TrainingHalted, train
from jaxalign.train.step import TrainState, make_optimizer, make_train_step

__all__ = ["ConfigError", "TrainState", "TrainingHalted", "apply_override", "load_config", "make_optimizer",
           "make_train_step", "train", "validate"]
