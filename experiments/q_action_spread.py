"""How much a trained critic's Q-values vary across actions at one state, against across states.

    python experiments/q_action_spread.py RUN_DIR [RUN_DIR ...] --data SPEC [--states 2000] [--actions 21]

For each run's `model.pt` (any offrl algorithm with a critic), draws `--states` observations of the
dataset SPEC, evaluates Q on an even grid of `--actions` values per action dimension (one dimension at
a time, the others at 0), and prints: the mean over states of Q's range across actions, the std across
states of Q's mean over actions (both averaged over action dimensions), the share of greedy (argmax-Q)
grid actions at the two ends of the grid, and the share of the policy's own actions within 10% of the
action bounds.  With
`--pendulum-episodes N` it also rolls each policy out in Pendulum-v1 (reset seeds 100, 101, ...) and prints
the return, the mean |angular velocity| and the share of steps near upright (cos theta > 0.9).  Written for
issue 14's ReCOIL-on-pendulum diagnosis (benchmarks/RESULTS.md): whether a weak policy comes from a critic blind
to the action, and what the policy does in the environment.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import offrl
from offrl.datasets import load


def spread(model, observations: np.ndarray, low: np.ndarray, high: np.ndarray, n_actions: int) -> dict[str, float]:
    n_states, action_dim = len(observations), len(low)
    policy = model.predict(observations)
    edge = 0.1 * (high - low)
    figures = {"policy_near_bounds": float(np.mean((policy <= low + edge) | (policy >= high - edge)))}
    if not hasattr(model, "critic_"):  # BC: its actions only
        return figures
    within, greedy_at_ends, across = [], [], []
    for dim in range(action_dim):
        grid = np.linspace(low[dim], high[dim], n_actions, dtype=np.float32)
        actions = np.zeros((n_states * n_actions, action_dim), dtype=np.float32)
        actions[:, dim] = np.tile(grid, n_states)
        q = model.predict_value(np.repeat(observations, n_actions, axis=0), actions).reshape(n_states, n_actions)
        within.append(q.max(axis=1) - q.min(axis=1))
        best = q.argmax(axis=1)
        greedy_at_ends.append(np.mean((best == 0) | (best == n_actions - 1)))
        across.append(q.mean(axis=1).std())
    return {"q_range_across_actions": float(np.mean(within)), "q_std_across_states": float(np.mean(across)),
            "greedy_at_grid_ends": float(np.mean(greedy_at_ends)), **figures}


def pendulum_rollouts(model, episodes: int) -> dict[str, float]:
    import gymnasium as gym

    env = gym.make("Pendulum-v1")
    returns, speeds, upright = [], [], []
    for episode in range(episodes):
        obs, _ = env.reset(seed=100 + episode)
        done, total = False, 0.0
        while not done:
            obs, reward, terminated, truncated, _ = env.step(model.predict(obs[None].astype(np.float32))[0])
            total, done = total + float(reward), terminated or truncated
            speeds.append(abs(obs[2]))
            upright.append(obs[0] > 0.9)
        returns.append(total)
    return {"return": float(np.mean(returns)), "mean_abs_thetadot": float(np.mean(speeds)),
            "upright_share": float(np.mean(upright))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories holding model.pt")
    parser.add_argument("--data", required=True, help="the dataset to draw states from (a load spec or path)")
    parser.add_argument("--states", type=int, default=2000)
    parser.add_argument("--actions", type=int, default=21)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pendulum-episodes", type=int, default=0, help="Pendulum-v1 roll-outs per policy")
    args = parser.parse_args()
    data = load(args.data)
    rows = np.random.default_rng(args.seed).choice(data.n_transitions, size=min(args.states, data.n_transitions),
                                                   replace=False)
    observations = np.asarray(data.observations[rows], dtype=np.float32)
    low = np.asarray(data.actions.min(axis=0) if data.action_low is None else data.action_low, dtype=np.float32)
    high = np.asarray(data.actions.max(axis=0) if data.action_high is None else data.action_high, dtype=np.float32)
    print(f"{len(rows)} states of {args.data}; actions in [{low}, {high}], {args.actions} grid points per dimension")
    for run in args.runs:
        model = offrl.load(Path(run) / "model.pt", device="cpu")
        figures = spread(model, observations, low, high, args.actions)
        if args.pendulum_episodes:
            figures.update(pendulum_rollouts(model, args.pendulum_episodes))
        print(f"{run}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
