"""Online RL pieces: verifiable reward functions (``jaxalign.rl.rewards``). The GRPO-family losses are in
``jaxalign.losses``."""

from jaxalign.rl.rewards import (
    BUILTIN,
    CodeTests,
    NamedReward,
    RewardError,
    code_tests,
    combine,
    exact_number,
    final_number,
    load_reward,
    math_equivalence,
    regex_format,
    resolve,
    run_program,
    score,
    soft_overlong_penalty,
    think_answer_format,
)

__all__ = [
    "BUILTIN",
    "CodeTests",
    "NamedReward",
    "RewardError",
    "code_tests",
    "combine",
    "exact_number",
    "final_number",
    "load_reward",
    "math_equivalence",
    "regex_format",
    "resolve",
    "run_program",
    "score",
    "soft_overlong_penalty",
    "think_answer_format",
]
