"""GRPO-family objective: one forward pass over prompt + sampled completion, ``losses.grpo_terms`` on the
completion tokens. The rollouts, rewards and advantages that fill the batch come from ``jaxalign.rl.trainer``."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp

from jaxalign import losses
from jaxalign.losses.grpo import ESTIMATORS, SAMPLING_CORRECTIONS, SCALE_REWARDS, check_grpo_options
from jaxalign.objectives.common import SHARED_FIELDS, EngineParams, Metric, policy_token_logps, require

ROLLOUT_WEIGHTS = ("model", "bfloat16", "int8")  # sampling.decoding_model's weight-only choices for rollouts


@dataclasses.dataclass(frozen=True)
class GRPOParams(EngineParams):
    """The loss (TRL 1.16's names and defaults: ``loss_type="dapo"``, ``beta=0``, ``epsilon=0.2``), the rollouts
    and the rewards of a GRPO-family run; ``docs/grpo.md`` describes every field.

    ``delta=0`` turns two-sided clipping off. ``steps_per_generation``: optimizer steps per generation batch (each
    on an equal share of its completions); ``num_iterations``: passes over each generation batch (TRL's mu).
    ``sft_steps``: for a randomly initialised model (no ``model.path``), SFT steps on the same data first, in the
    same run folder (``sft/``), so the policy can already answer; with ``sft_share > 0`` the SFT start sees only
    that share of the training questions (by a hash of the prompt) and GRPO samples only the others.
    ``dynamic_sampling`` (DAPO): groups whose rewards are all equal are dropped and more prompts sampled, up to
    ``max_refills`` times, to fill the batch. ``stop_strings``: one string, or a JSON list of strings (starting
    ``["``); a
    completion ends after the token that completes one (it stays in the text). ``sampling_correction``: TRL's
    truncated / masked importance sampling for the sampler-trainer mismatch (``losses.sampling_correction``;
    the sampling policy's log-probs are then always recomputed by the trainer), bounds ``sampling_clip_min``
    (0 = none) and ``sampling_clip_max`` (0 = none). ``shared_prefix``: the training forward passes take each
    group's prompt once (one row per group, ``data.batching.group_rows``); the same loss and gradients. "auto"
    (default): decided when the run starts, on when whole groups fit each micro-batch, shard, step and process and
    the grouped rows cost fewer model FLOPs (``data.batching.group_rows_cost``: always with the dense path's
    per-block attention, only for completions short next to the prompt where attention spans the row); ``True``:
    always (a layout that splits groups is an error); ``False``: never.
    ``rollout_weights``: the weights the rollouts decode with (``sampling.sample``'s ``weights``: "model",
    "bfloat16", "int8"); other than "model", the sampling policy's log-probs are recomputed by the trainer."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float = 0.0
    importance_sampling_level: str = "token"
    scale_rewards: str = "group"
    estimator: str = "grpo"
    num_generations: int = 8
    prompts_per_step: int = 8
    max_completion_length: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    num_iterations: int = 1
    steps_per_generation: int = 1
    rewards: str = "exact_number"
    reward_weights: str = ""
    samples_every: int = 25
    sft_steps: int = 0
    sft_share: float = 0.0
    dynamic_sampling: bool = False
    max_refills: int = 4
    stop_strings: str | tuple[str, ...] = ""
    sampling_correction: str = "none"
    sampling_clip_min: float = 0.0
    sampling_clip_max: float = 3.0
    shared_prefix: bool | str = "auto"
    rollout_weights: str = "model"

    @property
    def reference_free(self) -> bool:  # the frozen reference is held only for the KL term
        return self.beta == 0.0

    @property
    def stops(self) -> tuple[str, ...]:
        """``stop_strings`` as a tuple (a list given on the command line arrives parsed)."""
        value = self.stop_strings
        if not value:
            return ()
        if isinstance(value, str):
            text = value.strip()
            if not text.startswith('["'):  # one stop string, which may itself look like "[END]"
                return (value,)
            value = json.loads(text)  # a JSON list of strings; a malformed one is an error, not a stop string
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"stop_strings={self.stop_strings!r}: a JSON list must hold non-empty strings")
        return tuple(value)

    @property
    def recompute_old_logps(self) -> bool:
        """Whether the trainer computes the sampling policy's log-probs with a forward pass of its own."""
        return (self.num_iterations > 1 or self.steps_per_generation > 1 or self.sampling_correction != "none"
                or self.rollout_weights != "model")

    def __post_init__(self):
        check_grpo_options(self.loss_type, self.importance_sampling_level, self.max_completion_length)
        problems = []
        spelled = {"auto": "auto", "true": True, "false": False}.get(str(self.shared_prefix).lower())
        if spelled is None:
            problems.append(f"shared_prefix={self.shared_prefix!r}; choose auto, true or false")
        else:
            object.__setattr__(self, "shared_prefix", spelled)
        try:
            if not isinstance(self.stop_strings, str):  # hashable, and written back as a JSON list
                object.__setattr__(self, "stop_strings", self.stops)
            self.stops  # noqa: B018 (parses)
        except ValueError as err:  # json.JSONDecodeError is a ValueError
            problems.append(f"stop_strings={self.stop_strings!r} is neither one string nor a JSON list of "
                            f"strings ({err})")
        if self.sampling_correction not in SAMPLING_CORRECTIONS:
            problems.append(f"sampling_correction={self.sampling_correction!r}; choose one of "
                            f"{SAMPLING_CORRECTIONS}")
        if self.sampling_clip_min < 0 or self.sampling_clip_max < 0 or (
                self.sampling_clip_max and self.sampling_clip_min > self.sampling_clip_max):
            problems.append(f"sampling_clip_min={self.sampling_clip_min}, sampling_clip_max="
                            f"{self.sampling_clip_max}: need 0 <= min <= max (0 = no bound)")
        if self.rollout_weights not in ROLLOUT_WEIGHTS:
            problems.append(f"rollout_weights={self.rollout_weights!r}; choose one of {ROLLOUT_WEIGHTS}")
        if self.scale_rewards not in SCALE_REWARDS:
            problems.append(f"scale_rewards={self.scale_rewards!r}; choose one of {SCALE_REWARDS}")
        if self.estimator not in ESTIMATORS:
            problems.append(f"estimator={self.estimator!r}; choose one of {ESTIMATORS}")
        for name in ("num_generations", "prompts_per_step", "max_completion_length", "num_iterations",
                     "steps_per_generation"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_generations < 2:
            problems.append("num_generations must be >= 2: advantages compare completions of the same prompt")
        if (self.prompts_per_step * self.num_generations) % self.steps_per_generation:
            problems.append(f"prompts_per_step x num_generations = {self.prompts_per_step * self.num_generations} "
                            f"completions do not split into steps_per_generation={self.steps_per_generation} steps")
        elif self.shared_prefix is True and self.prompts_per_step % self.steps_per_generation:
            problems.append(f"shared_prefix trains whole groups: prompts_per_step={self.prompts_per_step} must be a "
                            f"multiple of steps_per_generation={self.steps_per_generation}")
        if self.temperature <= 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            problems.append(f"temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}: need "
                            "temperature > 0 (greedy completions of a prompt are all equal), 0 < top_p <= 1, "
                            "top_k >= 0")
        if not 0 <= self.sft_share < 1:
            problems.append(f"sft_share={self.sft_share} must be in [0, 1)")
        if self.beta < 0 or self.delta < 0 or self.sft_steps < 0 or self.max_refills < 0:
            problems.append("beta, delta, sft_steps and max_refills must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))


def completion_logps(model, batch, *, chunk_size: int = 0, temperature: float = 1.0) -> jax.Array:
    """Per-token log-probs ``[N, P+C]`` of the batch's ``tokens`` (0 where nothing is trained). With the
    ``group_*`` fields of shared-prefix rows (``data.batching.group_rows``) the forward pass runs on those, each
    group's prompt once, and the completions' log-probs are laid back out in the ``[N, P+C]`` rows."""
    tokens, attention_mask, loss_mask = require(batch, "tokens", "attention_mask", "loss_mask", objective="grpo")
    if "group_tokens" not in batch:
        return policy_token_logps(model, tokens, attention_mask, loss_mask, chunk_size=chunk_size,
                                  temperature=temperature)
    rows, width = loss_mask.shape
    groups, slots = batch["group_tokens"].shape
    size = rows // groups
    completion = (slots - width) // (size - 1)
    shared = {name: batch[f"group_{name}"] for name in SHARED_FIELDS}
    prompt = width - completion
    logps = policy_token_logps(model, batch["group_tokens"], batch["group_attention_mask"],
                               batch["group_loss_mask"], segment_ids=batch["group_segment_ids"], shared=shared,
                               chunk_size=chunk_size, temperature=temperature,
                               group_layout=(prompt, size, completion))
    completions = logps[:, prompt:].reshape(rows, completion)
    return jnp.concatenate([jnp.zeros((rows, prompt), completions.dtype), completions], axis=1)


def grpo(model, batch, hparams: GRPOParams = GRPOParams(), *, reference=None, **_):
    """Batch fields: ``tokens``, ``attention_mask``, ``loss_mask`` ``[B, T]`` (prompt + completion; the loss mask
    marks completion tokens up to and including EOS), ``advantages [B]``; optional ``old_logps [B, T]`` (the
    sampling policy's, when the batch is trained on more than once; otherwise the ratio is exactly 1),
    ``sampling_logps [B, T]`` (the sampler's own, for ``sampling_correction``), ``loss_share [B]`` (each row's
    share of the loss denominator, for ``steps_per_generation > 1``) and the ``group_*`` rows of
    ``shared_prefix`` (``completion_logps``). Log-probs are of ``softmax(logits / temperature)``, as TRL trains
    them."""
    loss_mask, advantages = require(batch, "loss_mask", "advantages", objective="grpo")
    options = {"chunk_size": hparams.logps_chunk_size, "temperature": hparams.temperature}
    with jax.named_scope("policy"):
        logps = completion_logps(model, batch, **options)
    old = batch.get("old_logps")
    old = jax.lax.stop_gradient(logps) if old is None else old
    ref = None
    if hparams.beta != 0.0:
        with jax.named_scope("reference"):
            ref = jax.lax.stop_gradient(completion_logps(reference, batch, **options))
    weights = None
    if hparams.sampling_correction != "none":
        sampled = require(batch, "sampling_logps", objective="grpo (sampling_correction)")[0]
        weights = losses.sampling_correction(old, sampled, loss_mask, mode=hparams.sampling_correction,
                                             clip_min=hparams.sampling_clip_min or None,
                                             clip_max=hparams.sampling_clip_max or None)
    numerator, denominator, sums = losses.grpo_terms(
        logps, old, advantages, loss_mask, ref_logps=ref, beta=hparams.beta, epsilon_low=hparams.epsilon_low,
        epsilon_high=hparams.epsilon_high, delta=hparams.delta or None, loss_type=hparams.loss_type,
        importance_sampling_level=hparams.importance_sampling_level,
        max_completion_length=hparams.max_completion_length, sampling_weights=weights)
    if "loss_share" in batch and hparams.loss_type in ("dapo", "cispo"):
        denominator = jnp.asarray(batch["loss_share"], jnp.float32).sum()  # TRL: generation tokens / steps
    metrics = {name: Metric(jax.lax.stop_gradient(total), count) for name, (total, count) in sums.items()}
    metrics["loss"] = Metric(jax.lax.stop_gradient(numerator), denominator)
    return numerator / jnp.maximum(denominator, 1.0), metrics
