"""Write the datasets of issue 14's imitation and guidance experiments as .npz files the sweep configs load.

    offrl datasets build 'hopper-*-v5' --sac-steps 300000     # random, medium-replay, medium-expert, expert
    python experiments/dual_data.py --out $OFFRL_DATA_DIR/dual

writes
    hopper-expert-5ep.npz          the first 5 episodes of hopper-expert-v5 (the demonstrations)
    hopper-random+medium-replay.npz  random and medium-replay together, rewards removed (ReCOIL's mixed data)

With --mixed-expert-episodes N it also writes the ReCOIL authors' kind of mixed data: random together with the
first N episodes of the expert kind, rewards removed ({env}-random+expert-{N}ep.npz; their code adds 200 expert
trajectories to D4RL's random data and gives 1 trajectory as the demonstration: --expert-episodes 1).

With --complete-episodes the demonstrations are the first 5 episodes that run to the time limit instead
(hopper-expert-5ep-complete.npz): the expert kind samples the SAC policy's actions, so some of its episodes end
in a fall, and how many differs between builds. The recorded figures of the other configs use the first 5.

Built datasets are read from $OFFRL_DATA_DIR (or --data-dir), the 300,000-SAC-step build by default.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from offrl.datasets import Dataset, load


def demonstration_episodes(expert: Dataset, n_episodes: int, complete_only: bool = False) -> np.ndarray:
    """Indices of the episodes to use as demonstrations: the first `n_episodes`, or with `complete_only` the
    first `n_episodes` that reach the time limit (end in a timeout, not a terminal, at the longest length)."""
    if n_episodes < 1:
        raise ValueError(f"--expert-episodes must be at least 1; got {n_episodes}")
    if not complete_only:
        if expert.n_episodes < n_episodes:
            raise ValueError(f"the expert dataset has {expert.n_episodes} episodes; --expert-episodes asks for "
                             f"{n_episodes}. Build it with more steps or ask for fewer.")
        return np.arange(n_episodes)
    lengths = expert.episode_lengths()
    last_rows = expert.episode_starts[1:] - 1
    complete = np.flatnonzero((expert.terminals[last_rows] == 0) & (lengths == lengths.max()))
    if len(complete) < n_episodes:
        raise ValueError(f"the expert dataset has {len(complete)} episodes that reach the time limit "
                         f"({lengths.max()} steps); --expert-episodes asks for {n_episodes}. Ask for fewer, "
                         "or drop --complete-episodes.")
    return complete[:n_episodes]


def random_with_expert(random: Dataset, expert: Dataset, n_episodes: int) -> Dataset:
    """The ReCOIL authors' kind of mixed data: `random` followed by the first `n_episodes` of `expert` (falls
    included, as their code counts them), rewards removed."""
    return Dataset.concatenate([random, expert.subset(demonstration_episodes(expert, n_episodes))]).without_rewards()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the .npz files")
    parser.add_argument("--env", default="hopper", help="environment name of the built datasets")
    parser.add_argument("--version", default="v5")
    parser.add_argument("--sac-steps", type=int, default=300_000)
    parser.add_argument("--expert-episodes", type=int, default=5)
    parser.add_argument("--complete-episodes", action="store_true",
                        help="demonstrations: the first episodes that reach the time limit (no falls)")
    parser.add_argument("--mixed-expert-episodes", type=int, default=0,
                        help="also write random + the first N expert episodes without rewards (the ReCOIL authors' "
                             "mixed data; 0: do not)")
    parser.add_argument("--data-dir", default=os.environ.get("OFFRL_DATA_DIR"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def built(kind: str) -> Dataset:
        return load(f"offrl:{args.env}-{kind}-{args.version}", sac_steps=args.sac_steps, data_dir=args.data_dir)

    expert = built("expert")
    episodes = demonstration_episodes(expert, args.expert_episodes, args.complete_episodes)
    demos = expert.subset(episodes)
    stem = f"{args.env}-expert-{args.expert_episodes}ep" + ("-complete" if args.complete_episodes else "")
    demos.metadata.update(name=f"{stem}-{args.version}", expert_episode_indices=episodes.tolist())
    demos.save(out / f"{stem}.npz")
    print(f"{stem}: episodes {episodes.tolist()} of {args.env}-expert-{args.version}, {demos.n_transitions} "
          f"transitions, return {demos.episode_returns().mean():.1f} per episode")

    random = built("random")
    if args.mixed_expert_episodes > 0:
        with_expert = random_with_expert(random, expert, args.mixed_expert_episodes)
        stem = f"{args.env}-random+expert-{args.mixed_expert_episodes}ep"
        with_expert.metadata.update(name=f"{stem}-{args.version}")
        with_expert.save(out / f"{stem}.npz")
        print(f"{stem}: {with_expert.n_transitions} transitions ({with_expert.n_transitions - random.n_transitions} "
              f"expert), {with_expert.n_episodes} episodes, no rewards")

    mixed = Dataset.concatenate([random, built("medium-replay")]).without_rewards()
    mixed.metadata.update(name=f"{args.env}-random+medium-replay-{args.version}")
    mixed.save(out / f"{args.env}-random+medium-replay.npz")
    print(f"{args.env}-random+medium-replay: {mixed.n_transitions} transitions, {mixed.n_episodes} episodes, no rewards")


if __name__ == "__main__":
    main()
