"""Frozen Lake (IFT paper §5.3): SFT, IFT, DPO and ORPO fine-tune a pretrained MLP policy towards the optimal one.

The paper gives no map, sizes or numbers (only a figure), so the setting is ours (spec §1(e)): a deterministic
5×5 lake whose frozen cells form a ring, the gift hanging below it, so exactly two hole-free simple routes lead
from the start to the gift: one of 6 moves (optimal: down the left edge) and one of 10 (round the right):

    S F F F F
    F H H H F
    F H H H F
    F F F F F
    H H G H H

The optimal policy table T* (uniform over the optimal actions of each state) comes from value iteration
(reward 1 at the gift, γ = 0.99). The policy is MLP(one-hot state → 64 ReLU → 4 logits).

**The shared start.** For each seed a randomly initialised policy is first pretrained to the *safe* policy (uniform
over the moves that neither hit a wall nor enter a hole, every non-terminal state): it knows the lake's physics but
not the way to the gift, as a pretrained language model knows language but not the task. Every method fine-tunes
that start, and it is DPO's reference.

**The data.** The chosen trajectory is the optimal route. Rejected trajectories (``--negatives``):
* ``sampled`` (the default, the paper's setting): 8 roll-outs of the start policy (temperature 1, at most 16 moves,
  ending at a hole, the gift or the move limit), any that repeat the optimal route dropped and redrawn;
* ``route``: the 10-move route as the single rejected trajectory (this study's earlier design).

**Methods** (same start, data and steps; each method's learning rate tuned):
* SFT: NLL of the optimal trajectory's actions;
* IFT: the input at step i is (1−λ)·onehot(s*_i) + λ·onehot(ŝ_i), ŝ_i the state the policy's greedy action
  reaches from s*_{i−1} (stop-gradient; ŝ_0 = s*_0), and the per-step NLLs are weighted by the reverse-discounted
  propagation weights (γ = 0.95, mean 1) of ``jaxalign.losses.ift``; λ = 0.2;
* DPO: each rejected trajectory paired with the chosen one, reference = the start, β = 0.1;
* ORPO: the same pairs, λ_OR = 0.25 (the IFT repository's value).

**Tuning.** Each method's learning rate from ``LRS`` by the mean MSE over two tuning seeds (100, 101: their own
initialisation, start and negatives, never the reported seeds); then 30 seeds (0-29) at the chosen rate (10
seeds gave verdicts that changed with the seed set; docs/results.md).

**Metrics** (lower is better): the paper's MSE between π_θ(·|s) and T*(·|s) over all non-terminal states, and the
same MSE over the *states where the data is right*: the optimal route's states and the states where a rejected
trajectory takes a sub-optimal action (on this map the 10-move route's last moves, along the bottom row towards
the gift, are optimal where taken, so a rejected trajectory also pushes down some optimal actions; the second
metric leaves those states out). Also the cells greedy roll-outs from the start visit ("explored grid").
Paired differences over seeds (mean and 95 % t interval, paired t-test) for the paper's orderings: IFT < SFT,
IFT < ORPO, DPO < IFT.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import (
    ci_text,
    command_line,
    differences_table,
    paired_difference,
    parser,
    seeds_of,
    table,
    verdict,
    write,
)

from jaxalign.losses import dpo, ift, orpo

STUDY = "frozen_lake"
# S start, F frozen, H hole, G gift. Frozen cells form a ring; the gift hangs below its bottom edge's middle.
MAP = ("SFFFF",
       "FHHHF",
       "FHHHF",
       "FFFFF",
       "HHGHH")
ACTIONS = ((0, -1), (1, 0), (0, 1), (-1, 0))  # left, down, right, up (Gymnasium's order)
ACTION_NAMES = "LDRU"
METHODS = ("SFT", "IFT", "DPO", "ORPO")
DESIGNS = ("sampled", "route")
HIDDEN = 64
LRS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
TUNING_SEEDS = (100, 101)
NEGATIVES, MAX_MOVES = 8, 16
# the paper's orderings, each as (better, worse): the claim is MSE(better) < MSE(worse)
CLAIMS = (("IFT", "SFT"), ("IFT", "ORPO"), ("DPO", "IFT"))


class Lake:
    def __init__(self, rows=MAP):
        self.rows = rows
        self.h, self.w = len(rows), len(rows[0])
        self.n = self.h * self.w
        self.start = next(r * self.w + c for r in range(self.h) for c in range(self.w) if rows[r][c] == "S")
        self.terminal = np.array([rows[s // self.w][s % self.w] in "HG" for s in range(self.n)])
        self.goal = next(r * self.w + c for r in range(self.h) for c in range(self.w) if rows[r][c] == "G")

    def step(self, state: int, action: int) -> int:
        r, c = divmod(state, self.w)
        dr, dc = ACTIONS[action]
        r, c = min(max(r + dr, 0), self.h - 1), min(max(c + dc, 0), self.w - 1)  # walls keep you in place
        return r * self.w + c

    def transitions(self) -> np.ndarray:
        return np.array([[self.step(s, a) for a in range(4)] for s in range(self.n)])

    def optimal_table(self, discount: float = 0.99) -> np.ndarray:
        """Value iteration; T*[s] uniform over the actions within 1e-9 of the best Q (zero rows for terminals)."""
        nxt = self.transitions()
        reward = (np.arange(self.n) == self.goal).astype(float)
        value = np.zeros(self.n)
        for _ in range(1000):
            q = reward[nxt] + discount * np.where(self.terminal[nxt], 0.0, value[nxt])
            value = np.where(self.terminal, 0.0, q.max(1))
        best = q >= q.max(1, keepdims=True) - 1e-9
        table_ = best / best.sum(1, keepdims=True)
        return np.where(self.terminal[:, None], 0.0, table_)

    def safe_table(self) -> np.ndarray:
        """Uniform over the moves that change the cell without entering a hole (the gift counts as safe)."""
        nxt = self.transitions()
        hole = self.terminal & (np.arange(self.n) != self.goal)
        safe = (nxt != np.arange(self.n)[:, None]) & ~hole[nxt]
        return np.where(self.terminal[:, None], 0.0, safe / np.maximum(safe.sum(1, keepdims=True), 1))

    def simple_routes(self) -> list[list[tuple[int, int]]]:
        """Every hole-free path from the start to the gift that never revisits a cell, as (state, action) lists."""
        routes = []

        def walk(state, path, seen):
            if state == self.goal:
                routes.append(list(path))
                return
            for a in range(4):
                nxt = self.step(state, a)
                if nxt in seen or (self.terminal[nxt] and nxt != self.goal):
                    continue
                path.append((state, a))
                walk(nxt, path, seen | {nxt})
                path.pop()

        walk(self.start, [], {self.start})
        return sorted(routes, key=len)


def init_mlp(key, n_states: int):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (n_states, HIDDEN)) * (2.0 / n_states) ** 0.5, "b1": jnp.zeros(HIDDEN),
            "w2": jax.random.normal(k2, (HIDDEN, 4)) * 0.01, "b2": jnp.zeros(4)}


def policy_logits(params, inputs):
    return jax.nn.relu(inputs @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def probabilities(lake: Lake, params) -> np.ndarray:
    return np.asarray(jax.nn.softmax(policy_logits(params, jnp.eye(lake.n))))


def pretrained_start(lake: Lake, seed: int, steps: int, lr: float = 1e-2):
    """A random policy (seeded) trained by cross-entropy towards the safe policy on every non-terminal state."""
    target = jnp.asarray(lake.safe_table())
    live = jnp.asarray(~lake.terminal, jnp.float32)

    def loss(params):
        logp = jax.nn.log_softmax(policy_logits(params, jnp.eye(lake.n)))
        return -((target * logp).sum(1) * live).sum() / live.sum()

    return train_policy(lambda p, _ref, _data: loss(p), init_mlp(jax.random.key(seed), lake.n), {}, steps, lr)[0]


def sample_negatives(lake: Lake, params, seed: int, chosen, count: int = NEGATIVES, max_moves: int = MAX_MOVES):
    """``count`` roll-outs of the policy (temperature 1), none equal to ``chosen``, as (state, action) lists."""
    probs = probabilities(lake, params)
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        state, path = lake.start, []
        while not lake.terminal[state] and len(path) < max_moves:
            action = int(rng.choice(4, p=probs[state] / probs[state].sum()))
            path.append((state, action))
            state = lake.step(state, action)
        if path != list(chosen):
            out.append(path)
    return out


def padded(trajectories, length: int = MAX_MOVES) -> dict:
    """``{"states", "actions", "mask"}`` arrays ``[K, length]`` (right-padded with state 0, action 0, mask 0)."""
    states, actions, mask = (np.zeros((len(trajectories), length), dtype) for dtype in (np.int32, np.int32, np.float32))
    for i, path in enumerate(trajectories):
        states[i, : len(path)] = [s for s, _ in path]
        actions[i, : len(path)] = [a for _, a in path]
        mask[i, : len(path)] = 1.0
    return {k: jnp.asarray(v) for k, v in (("states", states), ("actions", actions), ("mask", mask))}


def make_losses(lake: Lake, optimal, *, lam: float, gamma: float, beta: float, orpo_lam: float):
    """``{method: loss(params, reference, rejected)}``; ``rejected`` is ``padded(negatives)``."""
    n = lake.n
    nxt = jnp.asarray(lake.transitions())
    s_opt, a_opt = (jnp.asarray([p[i] for p in optimal]) for i in (0, 1))

    def logps(params, states, actions, inputs=None):
        x = jax.nn.one_hot(states, n) if inputs is None else inputs
        return jnp.take_along_axis(jax.nn.log_softmax(policy_logits(params, x)), actions[..., None], -1)[..., 0]

    def chosen_and_rejected(params, rejected):
        chosen = logps(params, s_opt, a_opt).sum()
        rejected_sum = (logps(params, rejected["states"], rejected["actions"]) * rejected["mask"]).sum(1)
        return jnp.broadcast_to(chosen, rejected_sum.shape), rejected_sum

    def sft(params, _ref, _rejected):
        return -logps(params, s_opt, a_opt).mean()

    def ift_loss(params, _ref, _rejected):
        greedy = jnp.argmax(policy_logits(jax.lax.stop_gradient(params), jax.nn.one_hot(s_opt, n)), -1)
        guessed = jnp.concatenate([s_opt[:1], nxt[s_opt[:-1], greedy[:-1]]])  # ŝ_i from s*_{i-1}
        mixed = (1 - lam) * jax.nn.one_hot(s_opt, n) + lam * jax.nn.one_hot(guessed, n)
        losses = -logps(params, s_opt, a_opt, mixed)
        # jaxalign.losses.ift never trains position 0 (language-model convention): prepend an untrained step
        padded_ = jnp.concatenate([jnp.zeros(1), losses])[None]
        mask = jnp.concatenate([jnp.zeros(1), jnp.ones(len(optimal))])[None]
        return ift(padded_, mask, gamma=gamma)[0][0]

    def dpo_loss(params, ref, rejected):
        loss, _ = dpo(*chosen_and_rejected(params, rejected), *chosen_and_rejected(ref, rejected), beta=beta)
        return loss.mean()

    def orpo_loss(params, _ref, rejected):
        chosen, rejected_sum = chosen_and_rejected(params, rejected)
        loss, _ = orpo(chosen, rejected_sum, jnp.full(chosen.shape, float(len(optimal))), rejected["mask"].sum(1),
                       lam=orpo_lam)
        return loss.mean()

    return {"SFT": sft, "IFT": ift_loss, "DPO": dpo_loss, "ORPO": orpo_loss}


def train_policy(loss_fn, params, rejected, steps: int, lr: float):
    """``steps`` Adam steps from ``params`` (also the reference); returns ``(params, losses)``."""
    return _trainer(loss_fn, steps)(params, rejected, jnp.float32(lr))


_TRAINERS: dict = {}


def _trainer(loss_fn, steps: int):
    """One compiled loop per loss and step count (the learning rate is an argument, not a constant)."""
    key = (loss_fn, steps)
    if key not in _TRAINERS:
        tx = optax.inject_hyperparams(optax.adam)(learning_rate=1.0)

        @jax.jit
        def run(params, rejected, lr):
            reference = params
            opt = tx.init(params)
            opt.hyperparams["learning_rate"] = lr

            def body(carry, _):
                p, opt = carry
                loss, grads = jax.value_and_grad(loss_fn)(p, reference, rejected)
                updates, opt = tx.update(grads, opt, p)
                return (optax.apply_updates(p, updates), opt), loss

            (p, _), losses = jax.lax.scan(body, (params, opt), None, length=steps)
            return p, losses

        _TRAINERS[key] = run
    return _TRAINERS[key]


def rollout(lake: Lake, params, max_steps: int = 30) -> list[int]:
    probs = probabilities(lake, params)
    state, visited = lake.start, [lake.start]
    for _ in range(max_steps):
        if lake.terminal[state]:
            break
        state = lake.step(state, int(np.argmax(probs[state])))
        visited.append(state)
    return visited


def evaluate(lake: Lake, params, target, data_states) -> dict:
    err = ((probabilities(lake, params) - target) ** 2).mean(1)
    visited = rollout(lake, params)
    return {"mse": float(err[~lake.terminal].mean()), "mse_data": float(err[data_states].mean()),
            "visited": visited, "reaches_gift": bool(visited[-1] == lake.goal), "cells": len(set(visited))}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=0, help="fine-tuning steps per run (default 300; smoke 20)")
    p.add_argument("--negatives", default=",".join(DESIGNS), help="comma-separated designs: sampled, route")
    args = p.parse_args(argv)
    started = time.time()
    steps = args.steps or (20 if args.smoke else 300)
    pretrain_steps = 50 if args.smoke else 500
    seeds = seeds_of(args, tuple(range(30)), smoke=(0, 1))
    lrs = (1e-2, 3e-2) if args.smoke else LRS
    tuning_seeds = TUNING_SEEDS[:1] if args.smoke else TUNING_SEEDS
    lake = Lake()
    routes = lake.simple_routes()
    assert len(routes) == 2 and len(routes[0]) < len(routes[1]), "the map must have one optimal, one longer route"
    optimal, route = routes
    target = lake.optimal_table()
    hp = dict(lam=0.2, gamma=0.95, beta=0.1, orpo_lam=0.25)
    losses = make_losses(lake, optimal, **hp)

    def setting(design: str, seed: int) -> dict:
        start = pretrained_start(lake, seed, pretrain_steps)
        negatives = (sample_negatives(lake, start, seed, optimal) if design == "sampled" else [route])
        data_states = np.zeros(lake.n, bool)
        data_states[[s for s, _ in optimal]] = True
        for path in negatives:
            data_states[[s for s, a in path if target[s, a] == 0]] = True
        return {"start": start, "rejected": padded(negatives), "negatives": negatives, "data_states": data_states}

    designs = {}
    for design in args.negatives.split(","):
        settings = {seed: setting(design, seed) for seed in (*tuning_seeds, *seeds)}

        def run(method, lr, seed, settings=settings):
            s = settings[seed]
            params, curve = train_policy(losses[method], s["start"], s["rejected"], steps, lr)
            return {**evaluate(lake, params, target, s["data_states"]), "final_loss": float(np.asarray(curve)[-1])}

        sweep = {m: {lr: [run(m, lr, seed)["mse"] for seed in tuning_seeds] for lr in lrs} for m in METHODS}
        chosen = {m: min(lrs, key=lambda lr, m=m: float(np.mean(sweep[m][lr]))) for m in METHODS}
        runs = {m: [run(m, chosen[m], seed) for seed in seeds] for m in METHODS}
        runs["start"] = [evaluate(lake, settings[seed]["start"], target, settings[seed]["data_states"])
                         for seed in seeds]
        comparisons = {}
        for metric in ("mse", "mse_data"):
            for better, worse in CLAIMS:
                # MSE(worse) − MSE(better) per seed: > 0 where the claimed ordering holds
                comparisons[f"{metric}: {worse} − {better}"] = paired_difference(
                    [r[metric] for r in runs[worse]], [r[metric] for r in runs[better]])
        designs[design] = {
            "sweep": {m: {f"{lr:g}": v for lr, v in sweep[m].items()} for m in METHODS}, "chosen": chosen,
            "runs": runs, "comparisons": comparisons,
            "verdicts": {name: verdict(d) for name, d in comparisons.items()},
            "ordering": sorted(METHODS, key=lambda m: np.mean([r["mse"] for r in runs[m]])),
            "negatives": {str(seed): settings[seed]["negatives"] for seed in seeds},
            "data_states": {str(seed): np.flatnonzero(settings[seed]["data_states"]).tolist() for seed in seeds}}
    out = {"map": MAP, "steps": steps, "pretrain_steps": pretrain_steps, "lrs": list(lrs), "hparams": hp,
           "seeds": seeds, "tuning_seeds": list(tuning_seeds), "optimal_route": optimal, "route": route,
           "target": target.tolist(), "designs": designs}
    markdown = "\n\n".join(_markdown(lake, out, design) for design in designs)
    write(args.out, STUDY, command=command_line(STUDY, argv), results=out, markdown=markdown, started=started)
    _plot(lake, out, f"{args.out}/{STUDY}.png")
    return out


def _markdown(lake: Lake, out: dict, design: str) -> str:
    d = out["designs"][design]
    live = int((~lake.terminal).sum())
    rows = []
    for method in ("start", *METHODS):
        r = d["runs"][method]
        rows.append([method if method != "start" else "pretrained start", d["chosen"].get(method, "—"),
                     ci_text([x["mse"] for x in r], 1, 4), ci_text([x["mse_data"] for x in r], 1, 4),
                     f"{100 * np.mean([x['reaches_gift'] for x in r]):.0f}", ci_text([x["cells"] for x in r], 1, 1)])
    negatives = ("8 roll-outs of the start policy per seed" if design == "sampled"
                 else f"the {len(out['route'])}-move route")
    sweep = table(["method", *[f"lr {lr:g}" for lr in out["lrs"]]],
                  [[m, *[f"{np.mean(d['sweep'][m][f'{lr:g}']):.4f}" for lr in out["lrs"]]] for m in METHODS])
    return (f"**Rejected trajectories: {negatives}.** Learning-rate sweep (mean MSE over tuning seeds "
            f"{out['tuning_seeds']}):\n\n{sweep}\n\n"
            + table(["policy", "learning rate", f"MSE vs optimal, all {live} states (95 % CI)",
                     "MSE, states where the data is right (95 % CI)", "greedy roll-out reaches the gift %",
                     "cells visited"], rows)
            + "\n\nPaired differences (MSE of the method claimed worse − the one claimed better; > 0 where the "
              "paper's ordering holds):\n\n"
            + differences_table(d["comparisons"], scale=1.0, digits=4, unit="MSE", verdicts=True)
            + f"\n\nOrdering by mean MSE (best first): {' < '.join(d['ordering'])}; the paper's: DPO ≤ IFT < ORPO, SFT."
              f" Seeds {out['seeds'][0]}–{out['seeds'][-1]} ({len(out['seeds'])}); {out['steps']} Adam steps from a "
              f"start pretrained for {out['pretrain_steps']} steps; λ = {out['hparams']['lam']}, γ = "
              f"{out['hparams']['gamma']}, β = {out['hparams']['beta']}, λ_OR = {out['hparams']['orpo_lam']}.")


def _plot(lake: Lake, out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = ("start", *METHODS)
    designs = list(out["designs"])
    fig, axes = plt.subplots(len(designs), len(methods), figsize=(2.4 * len(methods), 2.8 * len(designs)),
                             squeeze=False)
    for row, design in zip(axes, designs, strict=True):
        for ax, method in zip(row, methods, strict=True):
            runs = out["designs"][design]["runs"][method]
            counts = np.zeros(lake.n)
            for r in runs:
                for s in set(r["visited"]):
                    counts[s] += 1
            ax.imshow((counts / len(runs)).reshape(lake.h, lake.w), cmap="Blues", vmin=0, vmax=1)
            for s in range(lake.n):
                r, c = divmod(s, lake.w)
                ax.text(c, r, lake.rows[r][c], ha="center", va="center",
                        color="red" if lake.rows[r][c] == "H" else "black", fontsize=9)
            ax.set_title(f"{method} ({design})\nMSE {np.mean([r['mse'] for r in runs]):.3f}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle("Share of seeds whose greedy roll-out visits each cell", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
