"""Labelling throughput (transitions/s) of offrl's three labellers, with their fit times.

    python benchmarks/labelling.py                                       # 1M synthetic transitions, all three
    python benchmarks/labelling.py --threads 1 --otr-transitions 20000   # a quick run
    python benchmarks/labelling.py --only otr --dataset d4rl:hopper-medium-replay-v2 \\
        --expert d4rl:hopper-expert-v2 --repeat-to 1000000               # 1M rows made from a real dataset
    python benchmarks/labelling.py --only idm --device cpu --repeats 3 --json labelling.json

What is timed, on one dataset for all three (wall clock by default):

- OTRewardLabeler: `fit` (keeps the expert's best-return episode,
  n_demonstrations=1) and `transform`, which labels every transition by
  aligning each episode to that demonstration with the batched Sinkhorn
  solver (class defaults: cosine cost, epsilon 0.01, at most 100
  iterations).  The Sinkhorn path each solver batch took (float64 kernel or
  log domain) and its iterations are recorded during the timed transform
  by thin wrappers around the module's solver functions (one Python call
  per batch of episodes, nothing inside the iterations);
- InverseDynamicsLabeler: `fit` with its default n_steps (early stopping
  may end it sooner: the steps run are counted through a wrapper of the
  instance's loss; "best weights at step" is the step it kept) on the
  actions of 10% of the episodes (label_fraction=0.1), and `transform`,
  which predicts the other 90%'s actions;
- RewardModelLabeler: `fit` on 1% of the transitions' rewards
  (label_fraction=0.01) and `transform`, which predicts the other 99%.

Each supervised fit follows an untimed 2-step fit on one episode, which
takes the process's one-time costs (torch.optim's lazy imports, ~2 s) off
whichever labeller happens to run first; each timed transform follows an
untimed transform of one episode.  transitions/s = the dataset's
transitions / transform seconds (the median of --repeats transforms):
every row goes through each labeller, and "labelled" says how many rows it
filled.  The fitted model's count of denormal float32 weights is printed:
on a CPU they slow both training and prediction several-fold.  A labeller
whose labels the dataset lacks (a reward-free log for RewardModelLabeler)
is skipped with the reason.

Data: by default a synthetic Hopper-like dataset of --otr-transitions rows
(11-d observations, 3-d actions in [-1, 1], episodes of 1000 steps), seeded:
each episode is a smooth random walk driven by its actions,
s' = s + 0.05 A a + 0.01 noise, from a start near Hopper's (height 1.25),
with reward 1 + s'[5] - 0.001 |a|^2, so the inverse-dynamics and reward
models have something to learn; the expert is 5 more such episodes.  With
--dataset SPEC and --expert SPEC (any `offrl.datasets.load` spec) the real
dataset is labelled instead, and --repeat-to N concatenates it with itself
(whole episodes, `Dataset.concatenate`) up to N transitions, so a
1M-transition measurement can be made from a 195k-transition dataset.

The machine's load average is printed before and after, with torch's
thread count: on a shared machine use --threads 1 and read the load figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import sklearn.base
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offrl.algos.base import resolve_device  # noqa: E402
from offrl.datasets import Dataset, load  # noqa: E402
from offrl.reward_labeling import (InverseDynamicsLabeler, OTRewardLabeler, RewardModelLabeler,  # noqa: E402
                                   optimal_transport)

LABELLERS = ("otr", "idm", "rm")
NAMES = {"otr": "OTRewardLabeler", "idm": "InverseDynamicsLabeler", "rm": "RewardModelLabeler"}
# labels a labeller needs on every row of the timed dataset (the supervised ones hide all but label_fraction)
NEEDS = {"otr": (), "idm": ("actions",), "rm": ("actions", "rewards")}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
OBS_DIM, ACT_DIM, EPISODE_LENGTH = 11, 3, 1000


# ---------------------------------------------------------------------------- data
def synthetic_dataset(n_transitions: int, seed: int = 0, episode_length: int = EPISODE_LENGTH,
                      name: str = "synthetic-hopper-like") -> Dataset:
    """Hopper-shaped episodes whose observations are a smooth walk driven by the actions (see the module doc).

    The dynamics matrix A is the same for every seed, so an expert made with another seed is of the same task.
    """
    if n_transitions < 2:
        raise ValueError(f"n_transitions must be at least 2, got {n_transitions}")
    dynamics = np.random.default_rng(12345).normal(size=(OBS_DIM, ACT_DIM))
    rng = np.random.default_rng(seed)
    n_episodes = -(-n_transitions // episode_length)
    actions = rng.uniform(-1.0, 1.0, size=(n_episodes, episode_length, ACT_DIM))
    start = 0.1 * rng.normal(size=(n_episodes, 1, OBS_DIM))
    start[..., 0] += 1.25  # Hopper's torso height; keeps cosine costs away from the origin's degeneracy
    steps = 0.05 * actions @ dynamics.T + 0.01 * rng.normal(size=(n_episodes, episode_length, OBS_DIM))
    walk = start + np.concatenate([np.zeros((n_episodes, 1, OBS_DIM)), np.cumsum(steps, axis=1)], axis=1)
    observations = walk[:, :-1].reshape(-1, OBS_DIM)[:n_transitions]
    next_observations = walk[:, 1:].reshape(-1, OBS_DIM)[:n_transitions]
    actions = actions.reshape(-1, ACT_DIM)[:n_transitions]
    rewards = 1.0 + next_observations[:, 5] - 1e-3 * (actions ** 2).sum(axis=1)
    timeouts = (np.arange(n_transitions) % episode_length) == episode_length - 1
    return Dataset.from_arrays(observations.astype(np.float32), actions.astype(np.float32),
                               rewards.astype(np.float32), timeouts=timeouts,
                               next_observations=next_observations.astype(np.float32), action_low=-1.0,
                               action_high=1.0, metadata={"name": name})


def repeat_to(dataset: Dataset, n_transitions: int) -> Dataset:
    """`dataset` concatenated with itself, whole episodes, up to `n_transitions` rows (at least one episode)."""
    lengths = dataset.episode_lengths()
    copies, rest = divmod(int(n_transitions), dataset.n_transitions)
    n_extra = int(np.searchsorted(np.cumsum(lengths), rest, side="right"))
    parts = [dataset] * copies + ([dataset.subset(np.arange(n_extra))] if n_extra else [])
    if not parts:
        parts = [dataset.subset([0])]
    return parts[0] if len(parts) == 1 else Dataset.concatenate(parts)


def load_data(args: argparse.Namespace) -> tuple[Dataset, Dataset | None, str]:
    """(dataset to label, expert data or None when no expert was given, a description of both)."""
    if args.dataset is None:
        dataset = synthetic_dataset(args.otr_transitions, seed=0)
        expert = synthetic_dataset(5 * EPISODE_LENGTH, seed=1, name="synthetic-hopper-like-expert")
        return dataset, expert, (f"synthetic Hopper-like ({OBS_DIM}-d obs, {ACT_DIM}-d actions, episodes of "
                                 f"{EPISODE_LENGTH}), expert: best of 5 synthetic episodes")
    dataset = load(args.dataset)
    base = dataset.n_transitions
    if args.repeat_to:
        dataset = repeat_to(dataset, args.repeat_to)
    repeated = f", repeated to {dataset.n_transitions} rows" if args.repeat_to else ""
    expert = None if args.expert is None else load(args.expert)
    expert_text = "" if expert is None else f", expert: best episode of {args.expert}"
    return dataset, expert, f"{args.dataset} ({base} transitions{repeated}){expert_text}"


# ---------------------------------------------------------------------------- Sinkhorn record
@contextlib.contextmanager
def recording_sinkhorn() -> Iterator[dict[str, list]]:
    """Record, per solver batch, the Sinkhorn path taken and its iterations, while the labeller runs.

    Wraps the module-level functions `OTRewardLabeler` calls (`sinkhorn`, and the kernel/log solvers
    `sinkhorn` dispatches to); restores them on exit.
    """
    record: dict[str, list] = {"paths": [], "n_iter": [], "marginal_error": [], "batch_shapes": []}
    originals = {name: getattr(optimal_transport, name, None)
                 for name in ("sinkhorn", "_sinkhorn_kernel", "_sinkhorn_log")}

    def wrap_path(name: str, label: str) -> Callable | None:
        original = originals[name]
        if original is None:
            return None

        def solver(*args: Any, **kwargs: Any) -> Any:
            record["paths"].append(label)
            return original(*args, **kwargs)
        return solver

    def solve(cost: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = originals["sinkhorn"](cost, *args, **kwargs)
        record["n_iter"].append(int(result.n_iter))
        record["marginal_error"].append(float(result.marginal_error))
        record["batch_shapes"].append(tuple(cost.shape))
        return result

    patched = {"sinkhorn": solve, "_sinkhorn_kernel": wrap_path("_sinkhorn_kernel", "kernel"),
               "_sinkhorn_log": wrap_path("_sinkhorn_log", "log")}
    try:
        for name, function in patched.items():
            if function is not None:
                setattr(optimal_transport, name, function)
        yield record
    finally:
        for name, original in originals.items():
            if original is not None:
                setattr(optimal_transport, name, original)


def describe_sinkhorn(record: dict[str, list], labeller: OTRewardLabeler) -> str:
    """One line: the path(s) taken and the iterations per solver batch."""
    if float(labeller.epsilon) == 0:
        return "exact OT (epsilon=0: POT's ot.emd, one episode at a time)"
    if not record["n_iter"]:
        return "no Sinkhorn call recorded"
    paths = {p: record["paths"].count(p) for p in dict.fromkeys(record["paths"])}
    path_text = ", ".join(f"{p} x{n}" for p, n in paths.items()) or "path unknown"
    iters = record["n_iter"]
    shapes = record["batch_shapes"]
    batches = f"{len(iters)} batch{'es' if len(iters) > 1 else ''}"
    return (f"{path_text} ({batches} of up to {max(s[0] for s in shapes)} episodes, "
            f"cost {shapes[0][1]}x{shapes[0][2]} in the first); iterations min/median/max "
            f"{min(iters)}/{statistics.median(iters):g}/{max(iters)} of max_iter {labeller.max_iter}; "
            f"final marginal error max {max(record['marginal_error']):.2e} (tol {labeller.tol:g})")


# ---------------------------------------------------------------------------- timing
def timed(clock: Callable[[], float], function: Callable[[], Any]) -> tuple[Any, float]:
    start = clock()
    out = function()
    return out, clock() - start


def timed_transform(labeller: Any, dataset: Dataset, repeats: int, clock: Callable[[], float],
                    warm_up: bool = True) -> tuple[Dataset, list[float]]:
    """An untimed warm-up transform of the first episode (first-call costs), then `repeats` timed transforms."""
    if warm_up:
        labeller.transform(dataset.subset([0]))
    times = []
    for _ in range(repeats):
        out, seconds = timed(clock, lambda: labeller.transform(dataset))
        times.append(seconds)
    return out, times


def run_otr(dataset: Dataset, expert: Dataset, args: argparse.Namespace, clock: Callable[[], float]) -> dict:
    params = {} if args.otr_epsilon is None else {"epsilon": args.otr_epsilon}
    labeller = OTRewardLabeler(expert, n_demonstrations=1, device=args.device, **params)
    _, fit_s = timed(clock, lambda: labeller.fit(dataset))
    labeller.transform(dataset.subset([0]))  # warm-up outside the record, so it holds the timed batches only
    with recording_sinkhorn() as record:
        out, times = timed_transform(labeller, dataset, args.repeats, clock, warm_up=False)
    n_batches = len(record["n_iter"]) // args.repeats  # the record holds every timed transform's batches: keep one
    for key in ("paths", "n_iter", "marginal_error", "batch_shapes"):
        record[key] = record[key][-n_batches:]
    demo_length = int(labeller.demonstration_lengths_[0])
    return {"labeller": "OTRewardLabeler", "fit_s": fit_s, "transform_times_s": times,
            "n_labelled": int(out.n_transitions),
            "detail": (f"1 demonstration of {demo_length} steps, cost {labeller.cost}, epsilon {labeller.epsilon}, "
                       f"device {labeller._device()}"),
            "sinkhorn": describe_sinkhorn(record, labeller), "sinkhorn_n_iter": record["n_iter"],
            "sinkhorn_paths": record["paths"], "demonstration_length": demo_length}


def count_training_steps(labeller: Any) -> dict[str, int]:
    """Count the optimiser steps `fit` runs (the labeller keeps only the best step, `n_steps_done_`).

    Wraps the instance's loss: a call with gradients on is a training step, one without a validation check.
    """
    counter = {"steps": 0}
    loss = getattr(labeller, "_loss", None)
    if loss is None:
        counter["steps"] = -1
        return counter

    def counting_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            counter["steps"] += 1
        return loss(x, y)

    labeller._loss = counting_loss
    return counter


def denormal_weights(module: torch.nn.Module) -> int:
    """Non-zero parameters below float32's smallest normal: each such one slows CPU matmuls markedly."""
    return sum(int(((p != 0) & (p.abs() < torch.finfo(p.dtype).tiny)).sum()) for p in module.parameters()
               if p.is_floating_point())


def run_supervised(kind: str, dataset: Dataset, args: argparse.Namespace, clock: Callable[[], float]) -> dict:
    cls, fraction, steps = ((InverseDynamicsLabeler, 0.1, args.idm_steps) if kind == "idm"
                            else (RewardModelLabeler, 0.01, args.rm_steps))
    params = {} if steps is None else {"n_steps": steps}
    labeller = cls(label_fraction=fraction, random_state=0, device=args.device, **params)
    # untimed: the first fit in a process pays one-time costs (torch.optim's lazy imports, ~2 s) that are no
    # part of the labeller's fit
    sklearn.base.clone(labeller).set_params(n_steps=2).fit(dataset.subset([0]))
    counter = count_training_steps(labeller)
    _, fit_s = timed(clock, lambda: labeller.fit(dataset))
    out, times = timed_transform(labeller, dataset, args.repeats, clock)
    steps = counter["steps"]
    per_step = f" ({1e3 * fit_s / steps:.2f} ms/step)" if steps > 0 else ""
    n_labelled = int(out.metadata["transforms"][-1].get("n_labelled", -1)) if out.metadata.get("transforms") else -1
    return {"labeller": cls.__name__, "fit_s": fit_s, "transform_times_s": times, "n_labelled": n_labelled,
            "steps_run": steps, "best_step": int(labeller.n_steps_done_),
            "denormal_weights": denormal_weights(labeller.model_),
            "detail": (f"label_fraction {fraction}, {labeller.n_training_rows_} training rows, n_steps "
                       f"{labeller.n_steps}: {steps} run{per_step}, best weights at step {labeller.n_steps_done_}, "
                       f"validation loss {labeller.validation_loss_:.4f}, hidden {tuple(labeller.hidden_dims)}, "
                       f"{denormal_weights(labeller.model_)} denormal weights")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=LABELLERS, default=None, help="time one labeller (default all three)")
    parser.add_argument("--otr-transitions", type=int, default=1_000_000,
                        help="transitions of the synthetic dataset (default 1,000,000); ignored with --dataset")
    parser.add_argument("--dataset", default=None, help="label this dataset (an offrl.datasets.load spec)")
    parser.add_argument("--expert", default=None, help="expert data for OTR with --dataset (a load spec)")
    parser.add_argument("--repeat-to", type=int, default=None, metavar="N",
                        help="with --dataset: concatenate it with itself up to N transitions")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="the labellers' device (default auto, theirs: a GPU when present)")
    parser.add_argument("--otr-epsilon", type=float, default=None,
                        help="OTR's entropic epsilon (default the class's); small values take the log-domain path")
    parser.add_argument("--idm-steps", type=int, default=None, help="InverseDynamicsLabeler n_steps (default its own)")
    parser.add_argument("--rm-steps", type=int, default=None, help="RewardModelLabeler n_steps (default its own)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed transforms per labeller, the median reported (default 1: OTR at 1M takes minutes)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time (default); cpu: process CPU time, which with --threads 1 "
                             "is insensitive to other processes sharing the cores (meaningless on a GPU)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.expert is not None and args.dataset is None:
        parser.error("--expert goes with --dataset (the synthetic data makes its own expert)")
    if args.dataset is not None and args.expert is None and args.only in (None, "otr"):
        parser.error("--dataset needs --expert for OTR (or time only the others: --only idm / --only rm)")
    if args.repeat_to is not None and args.dataset is None:
        parser.error("--repeat-to needs --dataset (the synthetic dataset's size is --otr-transitions)")
    if args.repeat_to is not None and args.repeat_to < 1:
        parser.error(f"--repeat-to must be positive, got {args.repeat_to}")
    if args.repeats < 1:
        parser.error(f"--repeats must be positive, got {args.repeats}")
    if args.otr_transitions < 2:
        parser.error(f"--otr-transitions must be at least 2, got {args.otr_transitions}")
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]

    load_before = os.getloadavg()
    dataset, expert, description = load_data(args)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, {args.clock} clock, device {args.device} "
          f"({resolve_device(args.device)}; the supervised labellers predict on the CPU)")
    print(f"data: {description}: {dataset.n_transitions} transitions, {dataset.n_episodes} episodes")
    print(f"load average before (1/5/15 min): {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}",
          flush=True)

    kinds = [args.only] if args.only else list(LABELLERS)
    results = []
    for kind in kinds:
        missing = [name for name in NEEDS[kind] if not dataset.is_labelled(name)]
        if missing:  # e.g. a reward-free log: the supervised labellers learn from the labels they are timed hiding
            results.append({"labeller": NAMES[kind], "transitions": int(dataset.n_transitions),
                            "skipped": f"the dataset lacks {' and '.join(missing)} on some rows"})
            print(f"  {NAMES[kind]}: skipped, {results[-1]['skipped']}", flush=True)
            continue
        row = run_otr(dataset, expert, args, clock) if kind == "otr" else run_supervised(kind, dataset, args, clock)
        row["transitions"] = int(dataset.n_transitions)
        row["transform_s"] = statistics.median(row["transform_times_s"])
        row["transitions_per_s"] = dataset.n_transitions / row["transform_s"] if row["transform_s"] > 0 else None
        row["load_after"] = list(os.getloadavg())
        results.append(row)
        print(f"  {row['labeller']}: fit {row['fit_s']:.2f} s, transform {row['transform_s']:.2f} s; {row['detail']}",
              flush=True)
        if "sinkhorn" in row:
            print(f"  Sinkhorn: {row['sinkhorn']}", flush=True)
    load_after = os.getloadavg()

    print(f"{'labeller':<24} {'transitions':>11} {'labelled':>10} {'fit s':>9} {'transform s':>11} "
          f"{'transitions/s':>13}")
    for row in results:
        if "skipped" in row:
            print(f"{row['labeller']:<24} {row['transitions']:>11} skipped: {row['skipped']}")
            continue
        rate = row["transitions_per_s"]
        print(f"{row['labeller']:<24} {row['transitions']:>11} {row['n_labelled']:>10} {row['fit_s']:>9.2f} "
              f"{row['transform_s']:>11.2f} {'n/a' if rate is None else format(rate, '13.0f'):>13}")
    print(f"load average after (1/5/15 min): {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs")
    print(f"transitions/s: the dataset's transitions / transform seconds (median of {args.repeats} transform"
          f"{'s' if args.repeats > 1 else ''} after an untimed one-episode warm-up)")
    if args.json:
        payload = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                   "clock": args.clock, "device": args.device, "data": description,
                   "load_before": list(load_before), "load_after": list(load_after), "results": results}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
