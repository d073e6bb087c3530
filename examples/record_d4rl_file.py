"""Record a real Pendulum-v1 run with a uniform-random policy into a file in D4RL's HDF5 layout.

    python examples/record_d4rl_file.py pendulum-random.hdf5 --steps 20000

The file has D4RL's keys (observations, actions, rewards, terminals, timeouts,
next_observations, infos/action_log_probs), so `offrl datasets info` and
`offrl.datasets.load` read it exactly as they read a D4RL download.  D4RL's
files do not store the action space; offrl knows the bounds of D4RL's own
environments, and for this file they are passed when loading:

    offrl.datasets.load("pendulum-random.hdf5", action_low=-2.0, action_high=2.0)
"""

from __future__ import annotations

import argparse

import gymnasium as gym
import h5py
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    env = gym.make("Pendulum-v1")
    env.action_space.seed(args.seed)
    low, high = env.action_space.low, env.action_space.high
    log_prob = -float(np.log(high - low).sum())  # density of the uniform policy
    columns = {k: [] for k in ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations")}
    obs, _ = env.reset(seed=args.seed)
    for _ in range(args.steps):
        action = env.action_space.sample()
        next_obs, reward, terminated, truncated, _ = env.step(action)
        for key, value in zip(columns, (obs, action, reward, terminated, truncated, next_obs)):
            columns[key].append(value)
        obs = env.reset()[0] if terminated or truncated else next_obs
    with h5py.File(args.path, "w") as f:
        for key, values in columns.items():
            f.create_dataset(key, data=np.asarray(values, dtype=bool if key in ("terminals", "timeouts") else np.float32))
        f.create_dataset("infos/action_log_probs", data=np.full(args.steps, log_prob, np.float32))
    print(f"wrote {args.steps} transitions to {args.path}; load it with "
          f"offrl.datasets.load({args.path!r}, action_low=-2.0, action_high=2.0)")


if __name__ == "__main__":
    main()
