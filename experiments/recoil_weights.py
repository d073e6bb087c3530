"""Where ReCOIL's AWR actor puts its weight: the advantages and weights of trained runs on the rows of the mixed data
and of the demonstrations, over the whole data and over the first steps of episodes (where every hopper episode
starts, and where random data, whose episodes are short, is densest).

    python experiments/recoil_weights.py RUN_DIR [RUN_DIR ...] --mixed SPEC --demos SPEC [--first-steps 20]

For each run's `model.pt` it prints, per group of rows: the mean Q (minimum of the critics), the mean, median and
90% quantile of the advantage Q - V, the mean AWR weight min(exp(temperature * A), max_weight) and the share of rows
at that cap, with the number of rows in the group; then the policy's mean squared action error on the
demonstrations. The actor's weight mass on a group is its row count times its mean weight. Up to `--samples` rows
are drawn per group (all if fewer). benchmarks/RESULTS.md (issue 14, "ReCOIL's actor data") records the figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

import offrl
from offrl.algos.losses import awr_weights
from offrl.datasets import Dataset, load

sys.path.insert(0, str(Path(__file__).resolve().parent))
from advantage_scale import advantage  # noqa: E402  (a sibling script)


def first_step_rows(dataset: Dataset, first_steps: int) -> np.ndarray:
    """Indices of the rows within the first `first_steps` steps of their episode."""
    starts, ends = dataset.episode_starts[:-1], dataset.episode_starts[1:]
    return np.concatenate([np.arange(s, min(s + first_steps, e)) for s, e in zip(starts, ends)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="sweep run directories holding model.pt")
    parser.add_argument("--mixed", required=True, help="the mixed data's spec (the run's training data)")
    parser.add_argument("--demos", required=True, help="the demonstrations' spec")
    parser.add_argument("--first-steps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    mixed, demos = load(args.mixed), load(args.demos)
    groups = {}
    for name, dataset in (("mixed", mixed), ("demos", demos)):
        for part, rows in (("all rows", np.arange(dataset.n_transitions)),
                           (f"first {args.first_steps} steps", first_step_rows(dataset, args.first_steps))):
            drawn = rows if len(rows) <= args.samples else rng.choice(rows, size=args.samples, replace=False)
            groups[f"{name}, {part}"] = (len(rows), np.asarray(dataset.observations[drawn], np.float32),
                                         np.asarray(dataset.actions[drawn], np.float32))
    demo_obs, demo_actions = np.asarray(demos.observations, np.float32), np.asarray(demos.actions, np.float32)
    for run in args.runs:
        model = offrl.load(run / "model.pt")
        print(f"{run}  (temperature {model.temperature}, max_weight {model.max_weight})")
        for name, (n_rows, observations, actions) in groups.items():
            a = advantage(model, observations, actions)
            weight = awr_weights(torch.from_numpy(a), model.temperature, model.max_weight).numpy()
            print(f"  {name:26s} rows {n_rows:>9,d}  Q {model.predict_value(observations, actions).mean():7.1f}  "
                  f"A mean {a.mean():6.2f} median {np.median(a):6.2f} q90 {np.quantile(a, 0.9):6.2f}  "
                  f"weight mean {weight.mean():5.1f}, at the cap {np.mean(weight >= model.max_weight):.2f}")
        error = float(((model.predict(demo_obs) - demo_actions) ** 2).mean())
        print(f"  action mean squared error on the demonstrations {error:.4f}")


if __name__ == "__main__":
    main()
