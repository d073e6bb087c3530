"""Offline IQL on built pendulum medium-replay data, then `fit_online` in Pendulum-v1: does the score improve?

    OFFRL_DATA_DIR=/tmp/offrl-data offrl datasets build pendulum-medium-replay-v1
    OFFRL_DATA_DIR=/tmp/offrl-data python examples/fine_tune_online.py --seeds 0 1 2

Prints, per seed, the normalised score after offline training and after each
online chunk (20 evaluation episodes each), then mean ± std over seeds.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from offrl.algos import IQL
from offrl.datasets import load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="offrl:pendulum-medium-replay-v1")
    parser.add_argument("--env", default="Pendulum-v1")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--offline-steps", type=int, default=10_000)
    parser.add_argument("--online-steps", type=int, default=10_000, help="environment steps (one update each)")
    parser.add_argument("--chunks", type=int, default=2, help="evaluations during the online phase")
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dataset = load(args.dataset)
    print(dataset)
    scores: dict[str, list[float]] = {}
    for seed in args.seeds:
        start = time.perf_counter()
        algo = IQL(random_state=seed).fit(dataset, n_steps=args.offline_steps, progress=False)
        row = {"offline": algo.evaluate(args.env, n_episodes=args.episodes)["normalized_score_mean"]}
        algo.fit_online(args.env, args.online_steps, offline_dataset=dataset, eval_every=args.online_steps // args.chunks,
                        eval_env=args.env, eval_episodes=args.episodes, progress=False)
        for r in algo.online_history_:
            row[f"online {r['step']}"] = r["normalized_score_mean"]
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items())
              + f" ({time.perf_counter() - start:.0f} s)", flush=True)
        for key, value in row.items():
            scores.setdefault(key, []).append(value)
    print("mean ± std over seeds: " + ", ".join(f"{k} {np.mean(v):.1f} ± {np.std(v):.1f}" for k, v in scores.items()))


if __name__ == "__main__":
    main()
