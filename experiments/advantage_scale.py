"""The scale of Q(s, a) - V(s) on a dataset's own transitions, for trained implicit-value runs (IQL, XQL, f-DVL).

    python experiments/advantage_scale.py RUN_DIR [RUN_DIR ...] --data SPEC [--samples 20000]

For each run's `model.pt`, draws `--samples` transitions of the dataset SPEC (all if it has fewer) and prints the mean, the standard
deviation and the 10 / 50 / 90% quantiles of the advantage Q(s, a) - V(s) (Q the minimum of the critics, in the
units the critic was trained in, rewards scaled as the run scaled them). XQL's temperature beta is in these units,
so the figures say whether one scale-free temperature, beta / std, could serve two datasets (issue 14; the hopper
side is unmeasured). benchmarks/RESULTS.md (issue 14, "XQL's policy extraction") records pendulum's figures, which
set experiments/dual_pendulum_20k_actor_temperature.yaml's actor temperature.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import offrl
from offrl.datasets import load


def advantage(model, observations: np.ndarray, actions: np.ndarray) -> np.ndarray:
    q = model.predict_value(observations, actions)
    with torch.no_grad():
        obs = torch.as_tensor(observations, dtype=torch.float32, device=model.device_)
        v = model.value_(model.obs_normalizer_(obs)).float().cpu().numpy().reshape(-1)
    return q - v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="sweep run directories holding model.pt")
    parser.add_argument("--data", required=True, help="dataset spec, e.g. offrl:pendulum-medium-replay-v1")
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dataset = load(args.data)
    n = len(dataset.observations)
    rows = np.random.default_rng(args.seed).choice(n, size=min(args.samples, n), replace=False)
    observations = np.asarray(dataset.observations[rows], np.float32)
    actions = np.asarray(dataset.actions[rows], np.float32)
    for run in args.runs:
        model = offrl.load(run / "model.pt")
        a = advantage(model, observations, actions)
        q10, q50, q90 = np.quantile(a, [0.1, 0.5, 0.9])
        print(f"{run}: advantage mean {a.mean():.2f} std {a.std():.2f} quantiles 10/50/90% {q10:.2f} / {q50:.2f} / "
              f"{q90:.2f}")


if __name__ == "__main__":
    main()
