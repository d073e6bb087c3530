"""Inference actions per second of each model's acting path, against IQL's Gaussian policy in the same run.

    python benchmarks/acting.py                             # every model, fp32 and bf16, batch 1 and 256
    python benchmarks/acting.py --threads 1 --clock cpu     # robust on a shared machine
    python benchmarks/acting.py --models IQL,FQL,OFQL --batch 1 --precision fp32 --json acting.json

What is timed is `algo.predict(observations)`, the deterministic acting
path an environment loop calls: numpy in, observation normalisation, the
policy (and, for the generative models with several candidates, the
critic that picks one), numpy out, and the eval/train mode switch of every
module that `predict` does around each call (a large share at batch 1).
(a) Batch 1 is one decision at a time, `predict(obs_row)`; (b) batch 256
is `predict` on 256 observations at once.  Actions/s counts actions, so at
batch 1 it is decisions per second.

- IQL: tanh of the Gaussian policy's mean, one 256x256 MLP (the reference);
- DiffusionQL: the 5-step DDPM chain on each of n_action_samples=50
  candidates (fixed noise table), the target critics pick the best;
  DiffusionQL-1: n_action_samples=1, the zero-noise chain alone;
- EDP: as DiffusionQL (50 candidates, the critics pick);
- FQL: the one-step policy mu(s, z = 0), one 4x512 MLP (n_action_samples=1);
  FQL-2x256: the same at IQL's network size (2x256 GELU);
  FQL-flow: the BC flow FQL distils from, 10 Euler steps, through the same
  `predict` call with `_act` replaced by `_export_actor(policy="flow")`;
- OFQL: one average-velocity evaluation a = -u(s, 0, 0, 1) (n_action_samples=1);
  OFQL-50: its default acting, 50 one-step candidates in one batched evaluation, the critics pick;
- RvS: `predict(obs)` with the default target return (2x1024 MLP on state and command);
- DecisionTransformer: `actor.act(obs, t)` then `actor.observe(rewards, done=False)` of the Actor that
  `make_actor()` returns, its context full (20 steps per env): a causal transformer over 60 tokens per env.

Network sizes are updates.py's: IQL 256x256, FQL 4x512, the others 3x256.
Models are fitted with `n_steps=0` (built, untrained): acting speed does
not depend on the weights.  `predict` itself runs in fp32 whatever the
estimator's `precision`; the bf16 rows time the same `predict` call inside
`torch.autocast("cpu", dtype=torch.bfloat16)`, the autocast training uses.
Timing: every configuration runs `--repeats` windows of about `--window`
seconds (at least one call), interleaved across configurations so all see
the same load; actions/s is the median window's (best printed too) and
"vs IQL" is that over IQL's at the same batch and precision (> 1 is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from updates import CLOCKS, make_algorithm, network_label, synthetic_dataset  # noqa: E402

# name: (updates.py algorithm, hyper-parameters, acting path)
MODELS: dict[str, tuple[str, dict[str, Any], str]] = {
    "IQL": ("IQL", {}, "predict"),
    "DiffusionQL": ("DiffusionQL", {"n_action_samples": 50}, "predict"),
    "DiffusionQL-1": ("DiffusionQL", {"n_action_samples": 1}, "predict"),
    "EDP": ("EDP", {"n_action_samples": 50}, "predict"),
    "FQL": ("FQL", {"n_action_samples": 1}, "predict"),
    # FQL's one-step policy at IQL's network size (2x256): the cost of the method rather than of its 4x512 nets
    "FQL-2x256": ("FQL", {"n_action_samples": 1, "actor_hidden_dims": (256, 256), "hidden_dims": (256, 256)},
                  "predict"),
    "FQL-flow": ("FQL", {"n_action_samples": 1}, "flow"),
    "OFQL": ("OFQL", {"n_action_samples": 1}, "predict"),
    "OFQL-50": ("OFQL", {"n_action_samples": 50}, "predict"),
    # return-conditioned: RvS's 2x1024 MLP on (s, command); DT through its stateful Actor mid-episode (a full
    # context of 20 steps per env, the call an evaluation loop makes at every step after the 20th)
    "RvS": ("RvS", {}, "predict"),
    "DecisionTransformer": ("DecisionTransformer", {}, "actor"),
}


def describe(algo: Any, path: str) -> str:
    """What one acting call evaluates, in a few words."""
    params = algo.get_params()
    if path == "flow":
        return f"BC flow, {params['flow_steps']} Euler steps"
    name = type(algo).__name__
    if name == "IQL":
        return "Gaussian mean"
    if name == "RvS":
        return f"{len(params['hidden_dims'])}x{params['hidden_dims'][0]} MLP on (s, command)"
    if name == "DecisionTransformer":
        return f"transformer, context {params['context_length']} (60 tokens), stateful Actor"
    candidates = params.get("n_action_samples", 1)
    pick = f" x{candidates}, softmax Q" if candidates > 1 else ""
    if name in ("DiffusionQL", "EDP"):
        return f"{params['n_diffusion_steps']}-step DDPM{pick}"
    if name == "FQL":
        return f"one-step policy{pick}"
    steps = params["sample_steps"]
    return f"{steps} MeanFlow step{'s' if steps > 1 else ''}{pick}"


def build_actor(model: str, dataset: Any) -> tuple[Any, Callable[[np.ndarray], np.ndarray]]:
    """(estimator, its acting call): `predict` of the model fitted for 0 steps (FQL-flow: with the flow policy)."""
    algorithm, params, path = MODELS[model]
    algo = make_algorithm(algorithm, params, device="cpu", random_state=0)
    algo.fit(dataset, n_steps=0, progress=False)
    if path == "flow":
        flow = algo._export_actor(policy="flow")
        algo._act = lambda obs, deterministic: flow(obs)  # the rest of `predict` unchanged
    if path == "actor":
        return algo, context_actor_call(algo)
    return algo, algo.predict


def context_actor_call(algo: Any) -> Callable[[np.ndarray], np.ndarray]:
    """One step of the estimator's stateful Actor for a batch of envs: act, then observe a zero reward with no
    episode over.  Each batch size gets its own Actor, reset and filled to a full context the first time it is
    seen (untimed warm-up), so configurations interleaved across batch sizes never refill a context."""
    actors: dict[int, dict[str, Any]] = {}

    def step_once(state: dict[str, Any], obs: np.ndarray) -> np.ndarray:
        actor, n = state["actor"], len(obs)
        actions = actor.act(obs, np.full(n, state["t"]))
        actor.observe(np.zeros(n), np.zeros(n, bool))
        state["t"] += 1
        return actions

    def step(observations: np.ndarray) -> np.ndarray:
        obs = np.atleast_2d(observations)
        state = actors.get(len(obs))
        if state is None:
            state = actors[len(obs)] = {"actor": algo.make_actor(), "t": 0}
            state["actor"].reset(len(obs))
            for _ in range(int(algo.get_params().get("context_length", 20))):
                step_once(state, obs)
        return step_once(state, obs)

    return step


def precision_context(precision: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


class Config:
    """One (model, batch, precision): its inputs, calls per clock reading, and the windows' rates."""

    def __init__(self, model: str, act: Callable, observations: np.ndarray, batch: int, precision: str) -> None:
        self.model, self.act, self.batch, self.precision = model, act, batch, precision
        count = 64 if batch == 1 else 4
        self.inputs = [observations[i] for i in range(count)] if batch == 1 else \
            [observations[i * batch:(i + 1) * batch] for i in range(count)]
        self.rates: list[float] = []
        self.group = 1
        self.calls = 0

    def call(self, n: int) -> None:
        inputs, act = self.inputs, self.act
        with precision_context(self.precision):
            for _ in range(n):
                act(inputs[self.calls % len(inputs)])
                self.calls += 1

    def warm_up(self, clock: Callable[[], float], window: float) -> None:
        """A few untimed calls, then the group size: calls between clock readings (about 1/20 of a window)."""
        self.call(3)
        start = clock()
        self.call(3)
        per_call = max((clock() - start) / 3, 1e-7)
        self.group = max(1, int(window / 20 / per_call))

    def measure(self, clock: Callable[[], float], window: float) -> None:
        count, start = 0, clock()
        while True:
            self.call(self.group)
            count += self.group
            elapsed = clock() - start
            if elapsed >= window:
                break
        self.rates.append(count * self.batch / elapsed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    parser.add_argument("--precision", default="fp32,bf16", help="comma-separated: fp32, bf16 (default both)")
    parser.add_argument("--batch", default="1,256", help="comma-separated batch sizes (default 1,256)")
    parser.add_argument("--repeats", type=int, default=5, help="timed windows per configuration")
    parser.add_argument("--window", type=float, default=0.2, help="seconds per timed window (at least one call)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time (default); cpu: process CPU time, which with --threads 1 "
                             "is insensitive to other processes sharing the cores")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    if "IQL" not in models:
        models.insert(0, "IQL")  # the reference of the "vs IQL" column
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    if set(precisions) - {"fp32", "bf16"}:
        parser.error(f"--precision: use fp32 and/or bf16, got {args.precision!r}")
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    if not batches or min(batches) < 1:
        parser.error(f"--batch: positive integers, got {args.batch!r}")
    clock = CLOCKS[args.clock]

    dataset = synthetic_dataset()
    observations = np.ascontiguousarray(dataset.observations[: max(64, 4 * max(batches))], np.float32)
    algos = {model: build_actor(model, dataset) for model in models}
    configs = [Config(model, algos[model][1], observations, batch, precision)
               for batch in batches for precision in precisions for model in models]
    for config in configs:
        config.warm_up(clock, args.window)
    for _ in range(args.repeats):  # interleaved windows: every configuration sees the same machine load
        for config in configs:
            config.measure(clock, args.window)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"obs 11 / act 3, {args.clock} clock, predict() (bf16: inside torch.autocast)")
    print(f"{'model':<14} {'acting path':<26} {'networks':<9} {'batch':>5} {'precision':<9} {'actions/s':>10} "
          f"{'best':>10} {'vs IQL':>7}")
    results = []
    for config in configs:
        algo = algos[config.model][0]
        median = statistics.median(config.rates)
        iql = next(statistics.median(c.rates) for c in configs
                   if c.model == "IQL" and c.batch == config.batch and c.precision == config.precision)
        row = {"model": config.model, "algorithm": type(algo).__name__,
               "acting_path": describe(algo, MODELS[config.model][2]), "networks": network_label(algo),
               "n_action_samples": int(algo.get_params().get("n_action_samples", 1)), "batch": config.batch,
               "precision": config.precision, "actions_per_s": median, "actions_per_s_best": max(config.rates),
               "vs_IQL": median / iql, "rates": config.rates}
        results.append(row)
        print(f"{row['model']:<14} {row['acting_path']:<26} {row['networks']:<9} {row['batch']:>5} "
              f"{row['precision']:<9} {median:>10.0f} {row['actions_per_s_best']:>10.0f} {row['vs_IQL']:>6.3f}x")
    print("actions/s: median window; vs IQL: over IQL's at the same batch and precision (> 1 faster)")
    if args.json:
        payload = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                   "clock": args.clock, "window_s": args.window, "repeats": args.repeats, "results": results}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
