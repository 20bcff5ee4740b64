"""Training: the path config -> run spec (``spec``) -> builder (``build``) -> jitted step (``step``) -> loop
(``loop``, with ``inputs`` and ``checkpoints``), plus evaluation, metric writers and the reference-log-prob cache."""

from jaxalign.train.build import Engine, build, load_model, model_config, restore_model
from jaxalign.train.config import apply_override, load_config
from jaxalign.train.loop import TrainingHalted, train
from jaxalign.train.spec import ConfigError, RunSpec, effective_config, validate
from jaxalign.train.step import TrainState, make_optimizer, make_train_step

__all__ = ["ConfigError", "Engine", "RunSpec", "TrainState", "TrainingHalted", "apply_override", "build",
           "effective_config", "load_config", "load_model", "make_optimizer", "make_train_step", "model_config",
           "restore_model", "train", "validate"]
