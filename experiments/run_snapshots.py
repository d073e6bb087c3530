"""Look inside a finished sweep run: train it again with snapshots, and score each one.

A sweep keeps only a run's final model and its last checkpoint. This script trains the same run again: the same
estimator, settings, seed and step budget, so schedules such as the cosine actor rate are the same. It stops at
`--until` and saves the policy every `--every` steps. It checks that the losses repeat the run's train.csv, so the
snapshots are of that run. Each snapshot is then scored over `--episodes` evaluation episodes and, with `--demos`,
by its mean squared action error on the demonstrations.

    OMP_NUM_THREADS=1 OFFRL_DATA_DIR=/tmp/offrl-data-mj3 python experiments/run_snapshots.py \
        offrl-results/recoil_hopper_200k/runs/hopper-random+medium-replay-no-rewards/ReCOIL-actor-all/seed1 \
        --until 80000 --every 10000 --episodes 50 --env Hopper-v5 --success-return 3000 \
        --demos '$OFFRL_DATA_DIR/dual/hopper-expert-5ep-complete.npz'
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _losses(path: Path, until: int) -> dict[int, list[str]]:
    with open(path, newline="") as f:
        return {int(row["step"]): [row[k] for k in sorted(row) if k != "step"] for row in csv.DictReader(f)
                if int(row["step"]) <= until}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a sweep run folder (config.json, train.csv)")
    parser.add_argument("--until", type=int, required=True, help="stop after this step")
    parser.add_argument("--every", type=int, required=True, help="save a snapshot every this many steps")
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1000, help="the first evaluation episode's seed")
    parser.add_argument("--demos", default=None, help="a load spec of demonstrations for the action error")
    parser.add_argument("--env", default=None, help="gymnasium id (default: the model's)")
    parser.add_argument("--success-return", type=float, default=None,
                        help="also give the share of episodes with at least this return")
    parser.add_argument("--out", type=Path, default=None, help="default: <run_dir>/snapshots")
    args = parser.parse_args()

    import offrl
    from offrl.datasets import load
    from offrl.evaluation import make_env
    from offrl.sweep import _load_dataset, _make_algorithm, resolved_params

    config = json.loads((args.run_dir / "config.json").read_text())  # the run as the sweep ran it
    if config.get("labelers") or config.get("online"):
        raise SystemExit(f"{args.run_dir} has labelers or an online phase; this script retrains plain offline runs")
    recorded = (config.get("resolved_params") or {}).get("algorithm")
    now = resolved_params(config)["algorithm"]
    if recorded is not None and recorded != now:  # a default changed since the run (as ReCOIL's actor_data did)
        changed = ", ".join(f"{k}: {recorded.get(k)!r} then, {now.get(k)!r} now" for k in sorted(set(recorded) | set(now))
                            if recorded.get(k) != now.get(k))
        raise SystemExit(f"{args.run_dir}: the code would not train this run as recorded ({changed}); "
                         "write the recorded values into the config entry and run the sweep again")
    out = args.out or args.run_dir / "snapshots"
    out.mkdir(parents=True, exist_ok=True)
    algo = _make_algorithm(config)  # the sweep's estimator: its settings, seed, device and log_every
    torch.set_num_threads(1)  # the sweep's threads_per_run
    dataset = _load_dataset(config["dataset"])

    def snapshot(model: Any, step: int, metrics: dict[str, float]) -> bool:
        if step % args.every == 0:
            model.save(out / f"step{step:07d}.pt")
        return step < args.until

    algo.fit(dataset, n_steps=config["steps"], callbacks=[snapshot], log_dir=out / "log", progress=False)
    ours, theirs = _losses(out / "log" / "train.csv", args.until), _losses(args.run_dir / "train.csv", args.until)
    same = all(ours[s] == theirs[s] for s in ours if s in theirs)
    print(f"losses repeat the run's train.csv at {sum(s in theirs for s in ours)} logged steps: {same}")

    demos = load(args.demos) if args.demos else None  # load expands $OFFRL_DATA_DIR
    print(f"{'step':>8} {'score':>7} {'std':>6} {'mean length':>11}"
          + (f" {'share >= ' + str(args.success_return):>16}" if args.success_return is not None else "")
          + (f" {'action error':>12}" if demos is not None else ""))
    for path in sorted(out.glob("step*.pt")):
        model = offrl.load(path, device="cpu")
        env = make_env(args.env or model.spec_["env_id"])
        try:
            result = model.evaluate(env, n_episodes=args.episodes, seed=args.seed)
        finally:
            env.close()
        returns = np.asarray(result["returns"])
        line = (f"{int(path.stem[4:]):>8} {result['normalized_score_mean']:>7.1f} {result['normalized_score_std']:>6.1f} "
                f"{result['length_mean']:>11.1f}")
        if args.success_return is not None:
            line += f" {np.mean(returns >= args.success_return):>16.2f}"
        if demos is not None:
            error = np.mean((model.predict(demos.observations) - demos.actions) ** 2)
            line += f" {error:>12.4f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
