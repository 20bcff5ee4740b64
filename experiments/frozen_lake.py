"""Frozen Lake (IFT paper §5.3): SFT, IFT, DPO and ORPO fine-tune a two-layer MLP policy towards the optimal one.

The paper gives no map, sizes or numbers (only a figure), so the protocol is ours (spec §1(e)): a deterministic
5×5 lake whose frozen cells form a ring, the gift hanging below it, so exactly two hole-free routes lead from the
start to the gift: one of 6 moves (optimal: down the left edge) and one of 10 (sub-optimal: round the right):

    S F F F F
    F H H H F
    F H H H F
    F F F F F
    H H G H H

The optimal policy table T* (uniform over the optimal actions of each state) comes from value iteration
(reward 1 at the gift, γ = 0.99). The policy is MLP(one-hot state → 64 ReLU → 4 logits), randomly initialised
(seeded); each method trains on the same data for the same steps with Adam:

* SFT: NLL of the optimal trajectory's actions;
* IFT: the input at step i is (1−λ)·onehot(s*_i) + λ·onehot(ŝ_i), ŝ_i the state the policy's greedy action
  reaches from s*_{i−1} (stop-gradient; ŝ_0 = s*_0), and the per-step NLLs are weighted by the reverse-discounted
  propagation weights (γ = 0.95, mean 1) of `jaxalign.losses.ift`;
* DPO: chosen = optimal trajectory, rejected = sub-optimal, reference = the initial policy, β = 0.1;
* ORPO: the same pair, λ_OR = 0.25 (the IFT repository's value);
* SFT→DPO: the usual language-model pipeline, half the steps of SFT then half of DPO with the SFT policy as the
  reference (plain DPO above starts from the random policy, as the paper's description suggests).

Metric: MSE between π_θ(·|s) and T*(·|s) over all non-terminal states (lower is better), and the cells that greedy
roll-outs from the start visit ("explored grid"), over ≥ 10 seeds.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import command_line, parser, pm, seeds_of, table, write

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
METHODS = ("SFT", "IFT", "DPO", "ORPO", "SFT→DPO")
HIDDEN = 64


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


def make_losses(lake: Lake, optimal, suboptimal, *, lam: float, gamma: float, beta: float, orpo_lam: float):
    n = lake.n
    nxt = jnp.asarray(lake.transitions())
    s_opt, a_opt = (jnp.asarray([p[i] for p in optimal]) for i in (0, 1))
    s_sub, a_sub = (jnp.asarray([p[i] for p in suboptimal]) for i in (0, 1))

    def logps(params, states, actions, inputs=None):
        x = jax.nn.one_hot(states, n) if inputs is None else inputs
        return jnp.take_along_axis(jax.nn.log_softmax(policy_logits(params, x)), actions[:, None], 1)[:, 0]

    def sft(params, _ref):
        return -logps(params, s_opt, a_opt).mean()

    def ift_loss(params, _ref):
        greedy = jnp.argmax(policy_logits(jax.lax.stop_gradient(params), jax.nn.one_hot(s_opt, n)), -1)
        guessed = jnp.concatenate([s_opt[:1], nxt[s_opt[:-1], greedy[:-1]]])  # ŝ_i from s*_{i-1}
        mixed = (1 - lam) * jax.nn.one_hot(s_opt, n) + lam * jax.nn.one_hot(guessed, n)
        losses = -logps(params, s_opt, a_opt, mixed)
        # jaxalign.losses.ift never trains position 0 (language-model convention): prepend an untrained step
        padded = jnp.concatenate([jnp.zeros(1), losses])[None]
        mask = jnp.concatenate([jnp.zeros(1), jnp.ones(len(optimal))])[None]
        return ift(padded, mask, gamma=gamma)[0][0]

    def dpo_loss(params, ref):
        loss, _ = dpo(logps(params, s_opt, a_opt).sum()[None], logps(params, s_sub, a_sub).sum()[None],
                      logps(ref, s_opt, a_opt).sum()[None], logps(ref, s_sub, a_sub).sum()[None], beta=beta)
        return loss[0]

    def orpo_loss(params, _ref):
        loss, _ = orpo(logps(params, s_opt, a_opt).sum()[None], logps(params, s_sub, a_sub).sum()[None],
                       jnp.asarray([float(len(optimal))]), jnp.asarray([float(len(suboptimal))]), lam=orpo_lam)
        return loss[0]

    return {"SFT": sft, "IFT": ift_loss, "DPO": dpo_loss, "ORPO": orpo_loss}


def train_policy(loss_fn, params, steps: int, lr: float):
    tx = optax.adam(lr)
    reference = params

    @jax.jit
    def run(params):
        def body(carry, _):
            p, opt = carry
            loss, grads = jax.value_and_grad(loss_fn)(p, reference)
            updates, opt = tx.update(grads, opt, p)
            return (optax.apply_updates(p, updates), opt), loss

        (p, _), losses = jax.lax.scan(body, (params, tx.init(params)), None, length=steps)
        return p, losses

    return run(params)


def rollout(lake: Lake, params, max_steps: int = 30) -> list[int]:
    probs = np.asarray(jax.nn.softmax(policy_logits(params, jnp.eye(lake.n))))
    state, visited = lake.start, [lake.start]
    for _ in range(max_steps):
        if lake.terminal[state]:
            break
        state = lake.step(state, int(np.argmax(probs[state])))
        visited.append(state)
    return visited


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=0, help="optimisation steps per run (default 300; smoke 20)")
    args = p.parse_args(argv)
    started = time.time()
    steps = args.steps or (20 if args.smoke else 300)
    seeds = seeds_of(args, tuple(range(10)), smoke=(0, 1))
    lake = Lake()
    routes = lake.simple_routes()
    assert len(routes) == 2 and len(routes[0]) < len(routes[1]), "the map must have one optimal, one longer route"
    optimal, suboptimal = routes
    target = lake.optimal_table()
    live = ~lake.terminal
    hp = dict(lam=0.2, gamma=0.95, beta=0.1, orpo_lam=0.25)
    losses = make_losses(lake, optimal, suboptimal, **hp)
    lr = 1e-2
    results = {m: {"mse": [], "mse_on_route": [], "visited": [], "reaches_gift": [], "final_loss": []}
               for m in ("initial", *METHODS)}
    on_route = np.zeros(lake.n, bool)
    on_route[[s for s, _ in optimal]] = True
    for seed in seeds:
        params0 = init_mlp(jax.random.key(seed), lake.n)
        for method in ("initial", *METHODS):
            if method == "initial":
                params, curve = params0, np.zeros(1)
            elif method == "SFT→DPO":
                warm, _ = train_policy(losses["SFT"], params0, steps // 2, lr)
                params, curve = train_policy(losses["DPO"], warm, steps - steps // 2, lr)
            else:
                params, curve = train_policy(losses[method], params0, steps, lr)
            probs = np.asarray(jax.nn.softmax(policy_logits(params, jnp.eye(lake.n))))
            err = ((probs - target) ** 2).mean(1)
            visited = rollout(lake, params)
            results[method]["mse"].append(float(err[live].mean()))
            results[method]["mse_on_route"].append(float(err[on_route].mean()))
            results[method]["visited"].append(visited)
            results[method]["reaches_gift"].append(bool(visited[-1] == lake.goal))
            results[method]["final_loss"].append(float(np.asarray(curve)[-1]))
    rows = []
    for method in ("initial", *METHODS):
        r = results[method]
        distinct = [len(set(v)) for v in r["visited"]]
        rows.append([method, pm(r["mse"], 1, 4), pm(r["mse_on_route"], 1, 4),
                     f"{100 * np.mean(r['reaches_gift']):.0f}", pm(distinct, 1, 1)])
    markdown = table(["policy", f"MSE vs optimal (all {int(live.sum())} non-terminal states)",
                      "MSE on the optimal route's states", "greedy roll-out reaches the gift %", "cells visited"], rows)
    order = sorted(METHODS, key=lambda m: np.mean(results[m]["mse"]))
    markdown += (f"\n\nOrdering by mean MSE (best first): {' < '.join(order)}. The paper reports DPO ≤ IFT < ORPO, "
                 "SFT."
                 f"\nMap: {' / '.join(MAP)}; optimal route {len(optimal)} moves "
                 f"({''.join(ACTION_NAMES[a] for _, a in optimal)}), sub-optimal {len(suboptimal)} "
                 f"({''.join(ACTION_NAMES[a] for _, a in suboptimal)}). {steps} Adam steps at lr {lr}; "
                 f"λ = {hp['lam']}, γ = {hp['gamma']}, β = {hp['beta']}, λ_OR = {hp['orpo_lam']}; seeds "
                 f"{seeds[0]}–{seeds[-1]} ({len(seeds)}).")
    out = {"map": MAP, "steps": steps, "lr": lr, "hparams": hp, "seeds": seeds, "ordering": order,
           "optimal_route": optimal, "suboptimal_route": suboptimal, "target": target.tolist(), "methods": results}
    write(args.out, STUDY, command=command_line(STUDY, argv), results=out, markdown=markdown, started=started)
    _plot(lake, results, f"{args.out}/{STUDY}.png")
    return out


def _plot(lake: Lake, results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = ("initial", *METHODS)
    fig, axes = plt.subplots(1, len(methods), figsize=(2.4 * len(methods), 2.8))
    for ax, method in zip(axes, methods, strict=True):
        counts = np.zeros(lake.n)
        for visited in results[method]["visited"]:
            for s in set(visited):
                counts[s] += 1
        ax.imshow((counts / len(results[method]["visited"])).reshape(lake.h, lake.w), cmap="Blues", vmin=0, vmax=1)
        for s in range(lake.n):
            r, c = divmod(s, lake.w)
            ax.text(c, r, lake.rows[r][c], ha="center", va="center",
                    color="red" if lake.rows[r][c] == "H" else "black", fontsize=9)
        ax.set_title(f"{method}\nMSE {np.mean(results[method]['mse']):.3f}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("Share of seeds whose greedy roll-out visits each cell", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
