"""Where ReCOIL's AWR actor puts its weight, snapshot by snapshot: demonstrations or which part of the mixed data.

    OFFRL_DATA_DIR=/tmp/offrl-data-mj3 python experiments/recoil_actor_weights.py SNAPSHOT.pt [SNAPSHOT.pt ...] \
        --mixed '$OFFRL_DATA_DIR/dual/hopper-random+medium-replay.npz' \
        --expert '$OFFRL_DATA_DIR/dual/hopper-expert-5ep-complete.npz' \
        --parts random:1000000,medium-replay:201000

The snapshots are models saved by `experiments/run_snapshots.py` (or any saved ReCOIL). Each is read exactly as its
actor update reads a batch: advantages min_i Q_target_i(s, a) - V(s), weights min(exp(temperature A), max_weight),
the expert half drawn from the demonstrations and the other half from the mixed source (the mixed data plus the
demonstrations when `expert_in_mixed`). Printed per snapshot:

- the share of the actor's expected weight mass on each part: the demonstrations (both halves) and each named part of
  the mixed data (`--parts`, the mixed file's row blocks in order);
- on the demonstrated states (mixed rows closer to a demonstrated state than the demonstrations' own median spacing
  between episodes, and the demonstrations themselves): the share of the weight mass the mixed rows hold there (nan
  with one demonstration, which has no such spacing);
- the share of the mixed rows whose weight sits at `max_weight`, and the share of their weight mass those rows hold;
- the weighted mean distance, in the model's normalised observations, from a mixed row to its nearest demonstrated
  state (how far from the demonstrations the actor's mixed targets lie), next to the unweighted one;
- the Spearman rank correlation of the mixed rows' advantages with the previous snapshot's (does the critic's ranking
  of the mixed actions change between snapshots).

The mixed rows are a fixed random sample (`--samples`, `--seed`), the same for every snapshot. benchmarks/RESULTS.md
(issue 14, "ReCOIL's actor on the whole batch") records the figures for the two retrained seeds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import offrl
from offrl.algos.losses import awr_weights
from offrl.datasets import load


def _parts(text: str, n_rows: int) -> list[tuple[str, int, int]]:
    blocks, start = [], 0
    for item in text.split(","):
        name, _, size = item.partition(":")
        if not name or not size.isdigit():
            raise SystemExit(f"--parts takes name:rows,name:rows,... (e.g. random:1000000,medium-replay:201000), "
                             f"got {text!r}")
        blocks.append((name, start, start + int(size)))
        start += int(size)
    if start != n_rows:
        raise SystemExit(f"--parts covers {start} rows but the mixed data has {n_rows}; give every block's size")
    return blocks


def advantages(model, observations: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """min_i Q_target_i(s, a) - V(s), as ReCOIL's actor update computes it."""
    with torch.no_grad():
        obs = model.obs_normalizer_(torch.as_tensor(observations, dtype=torch.float32))
        act = torch.as_tensor(actions, dtype=torch.float32)
        q = model.critic_target_(obs, act).min(0).values
        return (q - model.value_(obs).reshape(-1)).numpy()


def nearest_distance(points: torch.Tensor, reference: torch.Tensor, chunk: int = 4096) -> np.ndarray:
    return torch.cat([torch.cdist(points[i:i + chunk], reference).min(1).values
                      for i in range(0, len(points), chunk)]).numpy()


def demo_spacing(demo_obs: torch.Tensor, episode: np.ndarray) -> float:
    """The median distance from a demonstrated state to the nearest state of another demonstration: how far apart
    the expert's own runs lie, the radius within which a mixed row counts as on the demonstrated states. NaN for a
    single demonstration (the authors' setting), which has no spacing between runs: the weight masses do not need it."""
    if episode.max() == 0:
        return float("nan")
    distance = torch.cdist(demo_obs, demo_obs)
    same = torch.as_tensor(episode[:, None] == episode[None, :])
    return float(distance.masked_fill(same, float("inf")).min(1).values.median())


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshots", nargs="+", type=Path, help="saved ReCOIL models, in training order")
    parser.add_argument("--mixed", required=True, help="load spec of the mixed data the run was fitted on")
    parser.add_argument("--expert", required=True, help="load spec of the run's demonstrations")
    parser.add_argument("--parts", required=True, help="the mixed data's row blocks in order, name:rows,...")
    parser.add_argument("--samples", type=int, default=50_000, help="mixed rows to sample")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    mixed, expert = load(args.mixed), load(args.expert)
    blocks = _parts(args.parts, mixed.n_transitions)
    rows = np.sort(np.random.default_rng(args.seed).choice(mixed.n_transitions, min(args.samples, mixed.n_transitions),
                                                           replace=False))
    mixed_obs = np.asarray(mixed.observations[rows], np.float32)
    mixed_act = np.asarray(mixed.actions[rows], np.float32)
    demo_obs, demo_act = np.asarray(expert.observations, np.float32), np.asarray(expert.actions, np.float32)
    demo_episode = np.repeat(np.arange(expert.n_episodes), expert.episode_lengths())

    names = ["demonstrations"] + [name for name, _, _ in blocks]
    print(f"{'snapshot':>20} " + " ".join(f"{'mass ' + n:>20}" for n in names) + f" {'mixed near demos':>17}"
          + f" {'rows at cap':>11} {'mass at cap':>11} {'dist (w)':>9} {'dist':>6} {'rank corr':>9}")
    previous = None
    for path in args.snapshots:
        model = offrl.load(path, device="cpu")
        if type(model).__name__ != "ReCOIL":
            raise SystemExit(f"{path} holds a {type(model).__name__}, not a ReCOIL model")
        normalise = lambda x: model.obs_normalizer_(torch.as_tensor(x, dtype=torch.float32))  # noqa: E731
        demo_normalised = normalise(demo_obs)
        distance = nearest_distance(normalise(mixed_obs), demo_normalised)
        radius = demo_spacing(demo_normalised, demo_episode)
        near = distance <= radius  # none when radius is nan (one demonstration)
        if previous is None:
            print("one demonstration: no spacing between the expert's runs, so no near-demonstration share (nan)"
                  if np.isnan(radius) else
                  f"near-demonstration radius {radius:.2f}: {near.mean():.1%} of the sampled mixed rows lie within it")
        weight = lambda a: awr_weights(torch.as_tensor(a), model.temperature, model.max_weight).numpy()  # noqa: E731
        a_mixed, a_demo = advantages(model, mixed_obs, mixed_act), advantages(model, demo_obs, demo_act)
        w_mixed, w_demo = weight(a_mixed), weight(a_demo)

        # The actor's batch: expert_fraction from the demonstrations, the rest from the mixed source, where each row
        # (the mixed data's, plus the demonstrations' with expert_in_mixed) is equally likely.
        e = model.expert_fraction
        n_mixed_source = mixed.n_transitions + (len(demo_obs) if model.expert_in_mixed else 0)
        demo_in_mixed = len(demo_obs) / n_mixed_source if model.expert_in_mixed else 0.0
        if model.actor_data == "all":
            mass = {"demonstrations": (e + (1 - e) * demo_in_mixed) * w_demo.mean()}
            mixed_scale = 1 - e
        else:  # the authors' actor reads the mixed half only
            mass = {"demonstrations": demo_in_mixed * w_demo.mean()}
            mixed_scale = 1.0
        near_mass = 0.0  # the mixed rows' mass within `radius` of a demonstrated state
        for name, start, stop in blocks:
            inside = (rows >= start) & (rows < stop)
            share = mixed_scale * (stop - start) / n_mixed_source
            mass[name] = share * w_mixed[inside].mean()
            near_mass += share * (w_mixed * near)[inside].mean()
        total = sum(mass.values())
        capped = w_mixed >= model.max_weight
        rows_at_cap, at_cap = capped.mean(), w_mixed[capped].sum() / w_mixed.sum()
        corr = spearman(previous, a_mixed) if previous is not None else float("nan")
        previous = a_mixed
        near_share = near_mass / (near_mass + mass["demonstrations"]) if not np.isnan(radius) else float("nan")
        print(f"{path.stem:>20} " + " ".join(f"{mass[n] / total:>20.3f}" for n in names)
              + f" {near_share:>17.3f} {rows_at_cap:>11.3f} {at_cap:>11.3f}"
              + f" {np.average(distance, weights=w_mixed):>9.2f} {distance.mean():>6.2f} {corr:>9.3f}", flush=True)


if __name__ == "__main__":
    main()
