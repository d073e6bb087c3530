"""Write the datasets of issue 14's imitation and guidance experiments as .npz files the sweep configs load.

    offrl datasets build 'hopper-*-v5' --sac-steps 300000     # random, medium-replay, medium-expert, expert
    python experiments/dual_data.py --out $OFFRL_DATA_DIR/dual

writes
    hopper-expert-5ep.npz          the first 5 episodes of hopper-expert-v5 (the demonstrations)
    hopper-random+medium-replay.npz  random and medium-replay together, rewards removed (ReCOIL's mixed data)

Built datasets are read from $OFFRL_DATA_DIR (or --data-dir), the 300,000-SAC-step build by default.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from offrl.datasets import Dataset, load


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the .npz files")
    parser.add_argument("--env", default="hopper", help="environment name of the built datasets")
    parser.add_argument("--version", default="v5")
    parser.add_argument("--sac-steps", type=int, default=300_000)
    parser.add_argument("--expert-episodes", type=int, default=5)
    parser.add_argument("--data-dir", default=os.environ.get("OFFRL_DATA_DIR"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def built(kind: str) -> Dataset:
        return load(f"offrl:{args.env}-{kind}-{args.version}", sac_steps=args.sac_steps, data_dir=args.data_dir)

    expert = built("expert")
    demos = expert.subset(range(args.expert_episodes))
    demos.metadata.update(name=f"{args.env}-expert-{args.expert_episodes}ep-{args.version}")
    demos.save(out / f"{args.env}-expert-{args.expert_episodes}ep.npz")
    print(f"{args.env}-expert-{args.expert_episodes}ep: {demos.n_transitions} transitions, "
          f"return {demos.episode_returns().mean():.1f} per episode")

    mixed = Dataset.concatenate([built("random"), built("medium-replay")]).without_rewards()
    mixed.metadata.update(name=f"{args.env}-random+medium-replay-{args.version}")
    mixed.save(out / f"{args.env}-random+medium-replay.npz")
    print(f"{args.env}-random+medium-replay: {mixed.n_transitions} transitions, {mixed.n_episodes} episodes, no rewards")


if __name__ == "__main__":
    main()
