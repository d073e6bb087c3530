"""How good issue 16's labels are on the built hopper datasets (the numbers next to the learning results).

    OFFRL_DATA_DIR=/tmp/offrl-data python experiments/labelling_quality.py

For each of hopper medium-replay and medium-expert (300,000-SAC-step build) and seeds 0-2, fits the
reward model on 1% of the transitions and inverse dynamics on 10% of the episodes, as
`experiments/labelling_hopper.yaml` does, and compares the rows they filled with the hidden true labels
(R^2 of rewards, RMSE of actions).  On medium-replay it also compares OTR's rewards after the official 100
Sinkhorn iterations with 1,000 iterations, and OTR's episode returns with the true ones.
"""

from __future__ import annotations

import os

import numpy as np

from offrl.datasets import load
from offrl.reward_labeling import InverseDynamicsLabeler, OTRewardLabeler, RewardModelLabeler


def main() -> None:
    data_dir = os.environ.get("OFFRL_DATA_DIR")

    def built(kind: str):
        return load(f"offrl:hopper-{kind}-v5", sac_steps=300_000, data_dir=data_dir)

    replay = built("medium-replay")
    expert = os.path.join(data_dir or ".", "dual", "hopper-expert-5ep.npz")
    r100 = OTRewardLabeler(expert, n_demonstrations=1).fit(replay).transform(replay).rewards
    r1000 = OTRewardLabeler(expert, n_demonstrations=1, max_iter=1000).fit(replay).transform(replay).rewards
    returns = [replay.with_rewards(r).episode_returns() for r in (r100, r1000)]
    print(f"OTR on medium-replay, 100 vs 1,000 iterations: per-step correlation {np.corrcoef(r100, r1000)[0, 1]:.4f}, "
          f"mean |change| {np.abs(r100 - r1000).mean():.4f} (mean reward {r1000.mean():.3f}), episode-return "
          f"correlation {np.corrcoef(*returns)[0, 1]:.4f}; with the true returns "
          f"{np.corrcoef(returns[0], replay.episode_returns())[0, 1]:.3f}")
    for kind in ("medium-replay", "medium-expert"):
        data = replay if kind == "medium-replay" else built(kind)
        for seed in range(3):
            model = RewardModelLabeler(label_fraction=0.01, random_state=seed).fit(data)
            filled = ~model._keep_mask(data, model.label_seed_)
            truth, guess = data.rewards[filled], model.transform(data).rewards[filled]
            r2 = 1.0 - ((guess - truth) ** 2).sum() / ((truth - truth.mean()) ** 2).sum()
            idm = InverseDynamicsLabeler(label_fraction=0.1, random_state=seed).fit(data)
            filled = ~idm._keep_mask(data, idm.label_seed_)
            error = idm.transform(data).actions[filled] - data.actions[filled]
            print(f"hopper-{kind} seed {seed}: reward model R^2 on the filled rows {r2:.4f}; inverse dynamics "
                  f"action RMSE {np.sqrt((error ** 2).mean()):.3f} (actions' std {data.actions.std():.3f})")


if __name__ == "__main__":
    main()
