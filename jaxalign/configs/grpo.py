"""GRPO-family online RL (TRL 1.16's defaults: DAPO loss, beta 0) on toy arithmetic with a verifiable reward.

With no `model.path`, the tiny random model is first trained with SFT on the same data for `sft_steps` steps (in
`<workdir>/sft`), so that sampling already finds right answers. The toy answers mix a short style ("28") and a
verbose one ("16 + 12 = 28. The answer is 28.") that does not fit the 8-token completion budget; GRPO with the
exact-number reward raises the held-out exact match above the SFT start, mostly by moving to the short style
(experiments/grpo_toy.py, docs/results.md). A real
run: `model.path` = your SFT model, `data.train` = prompts with an `answer` column, `objective.params.rewards` =
`exact_number`, `math`, `code_tests` or your own function (docs/grpo.md).
"""

from jaxalign.configs import base, presets


def get_config(arg=None):
    config = base.get_config()
    config.workdir = "runs/grpo"
    base.use_toy(config)
    config.data.toy_style = "mixed"  # answers "28" or "16 + 12 = 28. The answer is 28."; only the first fits 8 tokens
    config.objective.name = "grpo"
    params = config.objective.params
    params.loss_type = "dapo"
    params.beta = 0.0
    params.epsilon_low = 0.2
    params.epsilon_high = 0.28
    params.num_generations = 8
    params.prompts_per_step = 16
    params.max_completion_length = 8
    params.temperature = 1.0
    params.rewards = "exact_number"
    params.sft_steps = 600
    config.optim.lr = 1.5e-4
    config.optim.schedule = "constant"
    config.optim.warmup_steps = 0
    config.train.steps = 150
    config.train.batch_size = params.prompts_per_step * params.num_generations
    config.train.log_every = 10
    config.train.eval_every = 25
    config.train.save_every = 50
    return presets.apply(config, arg)
