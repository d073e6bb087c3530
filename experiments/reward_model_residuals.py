"""Where a reward model fitted on 1% of hopper medium-expert's rewards errs (issue 16's open comparison).

    OFFRL_DATA_DIR=/tmp/offrl-data python experiments/reward_model_residuals.py [--seeds 0,1,2]

IQL on the rewards of a 1% reward model scores ~86% of IQL on the true rewards on hopper medium-expert
(benchmarks/RESULTS.md) while the model's R^2 on the rows it fills is 0.997.  This splits the model's errors
(fitted as `experiments/labelling_hopper.yaml` fits it: `RewardModelLabeler(label_fraction=0.01)`) by where
they fall: the medium and the expert half of the data (medium-expert is the two concatenated), terminal rows
(a v5 hopper's last step when it falls) and the others, and shows what they do to the discounted return to go
(gamma 0.99, IQL's), the quantity IQL's values estimate.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from offrl.datasets import load
from offrl.reward_labeling import RewardModelLabeler


def describe(name: str, error: np.ndarray, truth: np.ndarray) -> str:
    if len(error) == 0:
        return f"{name}: no rows"
    return (f"{name}: {len(error):,} rows, bias {error.mean():+.4f}, RMSE {np.sqrt((error ** 2).mean()):.4f} "
            f"(true mean {truth.mean():.3f}, std {truth.std():.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--label-fraction", type=float, default=0.01)
    parser.add_argument("--dataset", default="offrl:hopper-medium-expert-v5", help="a medium-expert build")
    parser.add_argument("--sac-steps", type=int, default=300_000, help="the build's SAC budget")
    args = parser.parse_args()
    data = load(args.dataset, sac_steps=args.sac_steps, data_dir=os.environ.get("OFFRL_DATA_DIR"))
    n = data.n_transitions
    expert_half = np.arange(n) >= n // 2
    terminal = data.terminals > 0.5
    starts = data.episode_starts
    print(f"{args.dataset}: {n:,} transitions, {data.n_episodes:,} episodes, {int(terminal.sum()):,} "
          f"terminal rows ({int(terminal[~expert_half].sum()):,} in the medium half); an episode starts at the "
          f"halves' boundary: {bool((starts == n // 2).any())}")
    true_rtg = data.returns_to_go(gamma=0.99)
    for seed in (int(s) for s in args.seeds.split(",")):
        model = RewardModelLabeler(label_fraction=args.label_fraction, random_state=seed).fit(data)
        filled = ~model._keep_mask(data, model.label_seed_)
        guess = model.transform(data).rewards
        error = guess - data.rewards
        print(f"seed {seed}: {int((~filled).sum()):,} rows keep their rewards ({int((~filled & terminal).sum())} "
              f"terminal), the model trained on {model.n_training_rows_:,} of them")
        for name, rows in (("  medium half, non-terminal", ~expert_half & ~terminal),
                           ("  medium half, terminal    ", ~expert_half & terminal),
                           ("  expert half, non-terminal", expert_half & ~terminal),
                           ("  expert half, terminal    ", expert_half & terminal)):
            rows = rows & filled
            print(describe(name, error[rows], data.rewards[rows]))
        rtg_error = data.with_rewards(guess).returns_to_go(gamma=0.99) - true_rtg
        for name, rows in (("  discounted return to go, medium half", ~expert_half),
                           ("  discounted return to go, expert half", expert_half),
                           ("  discounted return to go, last 20 steps before a fall",
                            _before_falls(data, terminal, 20))):
            print(describe(name, rtg_error[rows], true_rtg[rows]))


def _before_falls(data, terminal: np.ndarray, k: int) -> np.ndarray:
    """Rows within `k` steps of a terminal row of the same episode (where a fall's value is learnt)."""
    near = np.zeros(data.n_transitions, bool)
    for end in np.flatnonzero(terminal):
        episode = np.searchsorted(data.episode_starts, end, side="right") - 1
        near[max(int(data.episode_starts[episode]), end - k + 1): end + 1] = True
    return near


if __name__ == "__main__":
    main()
