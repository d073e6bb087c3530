"""Gradient updates per second and roofline fraction of the offline algorithms.

    python benchmarks/updates.py                       # all algorithms, fp32 and bf16, eager
    python benchmarks/updates.py --compile             # also torch.compile'd updates
    python benchmarks/updates.py --algos CQL --precision bf16 --repeats 9
    python benchmarks/updates.py --threads 1 --clock cpu   # robust on a shared machine
    python benchmarks/updates.py --algos IQL,DiffusionQL,EDP,EDP-iql,FQL,OFQL --threads 1 --clock cpu
    python benchmarks/updates.py --algos IQL,XQL,FDVL,ReCOIL,TD3PlusBC,TD3PlusBC-GORL,IQL-GORL --threads 1 --clock cpu
    python benchmarks/updates.py --algos TD3PlusBC,TD3PlusBC-GORL,TD3PlusBC-GORL-raw,IQL,IQL-GORL,IQL-GORL-raw \
        --threads 1 --clock cpu             # GORL with and without its guide's normalisation

Each configuration trains through the real `fit` loop (sampling from a
dataset held as tensors, `log_every` = one timed chunk) on a synthetic
dataset with Hopper's dimensions (11-d observations, 3-d actions) and batch
256.  Network sizes:

- BC, TD3PlusBC, IQL, CQL, CalQL: 256x256 (forced, whatever the class default);
- DiffusionQL, EDP (variant "td3"), EDP-iql (`EDP(variant="iql")`), OFQL:
  their class defaults, the papers' 3x256 Mish actor and critics, so
  DiffusionQL (5 diffusion steps) and OFQL compare at equal sizes;
- FQL: its class default, the paper's 4x512 GELU actors and critics;
- XQL, FDVL, ReCOIL, TD3PlusBC-GORL, IQL-GORL (`guide=` 5 synthetic expert
  episodes: the guide's meta-gradient step included), TD3PlusBC-GORL-raw and
  IQL-GORL-raw (the same with `Guide(normalize=False)`, the paper's raw
  scales): 256x256;
- RvS (2x1024) and DecisionTransformer (context 20, 128-d, 3 layers, batch 64 windows
  of the segment sampler, whatever --batch-size): their class defaults.

`--set hidden_dims=[256,256]` overrides the (critic) sizes of every timed
algorithm; FQL's actors take `actor_hidden_dims`.  The EMA actors (DiffusionQL, EDP, OFQL) are timed from step 0
(`ema_start=0`), so the chunks include the EMA update of steady-state
training rather than the first 1000 steps without it.  When IQL is timed
too, a second table gives every configuration's updates/s relative to
IQL's at the same precision and compile setting (and OFQL's relative to
DiffusionQL's).

Roofline fraction = achieved FLOP/s of the update / FLOP/s of a plain fp32
256x256 @ 256x256 matmul loop measured in the same process.  FLOPs are the
matmul FLOPs of one update (forward and backward, counted by
`torch.utils.flop_counter` on an eager fp32 update, averaged over two steps
so TD3+BC's delayed actor counts half).  OFQL's MeanFlow target is a
forward-mode tangent pass, written out as stacked matmuls that the counter
sees like any other (`ConditionalMLP.forward_with_tangent`; the
`torch.func.jvp` fallback for other networks is counted too, including a
matmul against the weights' zero tangents per layer).  Should the counter
fail on an algorithm, its FLOP and roofline columns read n/a.
Each timed chunk of updates is followed by a reference window of the same
length, and the fraction is the median over chunks of the two rates'
ratio, so both sides see the same load on a shared machine.  updates/s is
the median chunk's (best chunk printed too).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offrl.algos import (BC, CQL, EDP, FDVL, FQL, IQL, OFQL, XQL, CalQL, DecisionTransformer,  # noqa: E402
                         DiffusionQL, ReCOIL, RvS, TD3PlusBC)
from offrl.algos.guide import Guide  # noqa: E402
from offrl.datasets import Dataset  # noqa: E402

ALGORITHMS = {"BC": BC, "TD3PlusBC": TD3PlusBC, "IQL": IQL, "CQL": CQL, "CalQL": CalQL,
              "DiffusionQL": DiffusionQL, "EDP": EDP, "EDP-iql": functools.partial(EDP, variant="iql"),
              "FQL": FQL, "OFQL": OFQL, "XQL": XQL, "FDVL": FDVL, "ReCOIL": ReCOIL,
              "TD3PlusBC-GORL": TD3PlusBC, "IQL-GORL": IQL, "TD3PlusBC-GORL-raw": TD3PlusBC, "IQL-GORL-raw": IQL,
              "RvS": RvS, "DecisionTransformer": DecisionTransformer}
# updates per timed chunk (about 0.1-0.3 s each; the generative ones measured on one CPU thread)
CHUNK = {"BC": 200, "TD3PlusBC": 100, "IQL": 100, "CQL": 6, "CalQL": 6,
         "DiffusionQL": 6, "EDP": 10, "EDP-iql": 12, "FQL": 3, "OFQL": 7, "XQL": 100, "FDVL": 100, "ReCOIL": 50,
         "TD3PlusBC-GORL": 50, "IQL-GORL": 50, "TD3PlusBC-GORL-raw": 50, "IQL-GORL-raw": 50, "RvS": 50,
         "DecisionTransformer": 3}
_SMALL_NETWORKS = {"hidden_dims": (256, 256)}
_EMA_FROM_START = {"ema_start": 0}
# hyper-parameters every timed instance gets (before --set): see the module docstring
BENCH_PARAMS = {"BC": _SMALL_NETWORKS, "TD3PlusBC": _SMALL_NETWORKS, "IQL": _SMALL_NETWORKS, "CQL": _SMALL_NETWORKS,
                "CalQL": _SMALL_NETWORKS, "DiffusionQL": _EMA_FROM_START, "EDP": _EMA_FROM_START, "EDP-iql": {},
                "FQL": {}, "OFQL": _EMA_FROM_START, "XQL": _SMALL_NETWORKS, "FDVL": _SMALL_NETWORKS,
                "ReCOIL": _SMALL_NETWORKS, "TD3PlusBC-GORL": _SMALL_NETWORKS, "IQL-GORL": _SMALL_NETWORKS,
                "TD3PlusBC-GORL-raw": _SMALL_NETWORKS, "IQL-GORL-raw": _SMALL_NETWORKS,
                "RvS": {}, "DecisionTransformer": {}}
# algorithms that learn from expert demonstrations get 5 synthetic episodes of 1000 steps (GORL's guide, ReCOIL's
# expert; at the benchmark's batch of 256 ReCOIL draws 128 expert + 128 mixed rows)
DEMONSTRATIONS = {"TD3PlusBC-GORL": "guide", "IQL-GORL": "guide", "TD3PlusBC-GORL-raw": "guide",
                  "IQL-GORL-raw": "guide", "ReCOIL": "expert"}
# the guide's scales used as they come (GORL's paper) rather than divided by their batch mean (offrl's default)
RAW_GUIDE = {"TD3PlusBC-GORL-raw", "IQL-GORL-raw"}
# algorithms timed at their own batch size rather than --batch-size (a DT batch is 64 windows of 20 steps)
OWN_BATCH = {"DecisionTransformer": 64}


def make_algorithm(name: str, params: dict | None = None, **fixed: Any) -> Any:
    """The timed estimator: the benchmark's sizes for `name`, then `--set` params, then the fixed settings."""
    demos = {DEMONSTRATIONS[name]: synthetic_dataset(n=5000, seed=1)} if name in DEMONSTRATIONS else {}
    if name in RAW_GUIDE:
        demos["guide"] = Guide(expert=demos["guide"], normalize=False)
    if name in OWN_BATCH and "batch_size" in fixed:
        fixed["batch_size"] = OWN_BATCH[name]
    return ALGORITHMS[name](**{**BENCH_PARAMS[name], **demos, **(params or {})}, **fixed)


def network_label(algo: Any) -> str:
    """Hidden layers as "3x256" (actor/critic shown apart where they differ)."""
    def label(dims) -> str:
        dims = tuple(int(d) for d in dims)
        return f"{len(dims)}x{dims[0]}" if len(set(dims)) == 1 else "x".join(map(str, dims))

    params = algo.get_params()
    if "hidden_dims" not in params:  # a transformer
        return f"{params.get('n_layers', '?')} layers x {params.get('embed_dim', '?')}"
    critic = label(params["hidden_dims"])
    actor = params.get("actor_hidden_dims")
    if params.get("critic_hidden_dims") is not None:
        actor, critic = params["hidden_dims"], label(params["critic_hidden_dims"])
    if actor is None or label(actor) == critic:
        return critic
    return f"actor {label(actor)} critic {critic}"


def synthetic_dataset(n: int = 100_000, obs_dim: int = 11, act_dim: int = 3, episode_length: int = 1000,
                      seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=(n, obs_dim)).astype(np.float32)
    actions = rng.uniform(-1, 1, size=(n, act_dim)).astype(np.float32)
    rewards = rng.normal(size=n).astype(np.float32)
    timeouts = (np.arange(n) % episode_length) == episode_length - 1
    return Dataset.from_arrays(obs, actions, rewards, timeouts=timeouts,
                               next_observations=obs + 0.01 * rng.normal(size=obs.shape).astype(np.float32),
                               action_low=-1.0, action_high=1.0, metadata={"name": "synthetic-hopper-dims"})


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class MatmulReference:
    """FLOP/s of a plain 256x256 @ 256x256 matmul loop, measured in windows as long as the timed chunks."""

    clock = staticmethod(time.perf_counter)

    def __init__(self, dtype: torch.dtype, n: int = 256) -> None:
        self.a = torch.randn(n, n).to(dtype)
        self.b = torch.randn(n, n).to(dtype)
        self.flops = 2 * n**3
        self.rates: list[float] = []
        for _ in range(5):
            torch.mm(self.a, self.b)

    def measure(self, duration: float) -> float:
        """Run the loop for about `duration` seconds (at least 20 matmuls); returns and records FLOP/s."""
        a, b, clock = self.a, self.b, self.clock
        count, start = 0, clock()
        while True:
            for _ in range(10):
                torch.mm(a, b)
            count += 10
            elapsed = clock() - start
            if count >= 20 and elapsed >= duration:
                break
        rate = self.flops * count / elapsed
        self.rates.append(rate)
        return rate

    @property
    def best(self) -> float:
        return max(self.rates)

    @property
    def median(self) -> float:
        return statistics.median(self.rates)


def update_flops(name: str, dataset: Dataset, batch_size: int, params: dict | None = None) -> float | None:
    """Matmul FLOPs of one update (eager fp32, mean over two consecutive steps); None if the counter fails."""
    algo = make_algorithm(name, params, batch_size=batch_size, device="cpu", random_state=0)
    algo.fit(dataset, n_steps=2, progress=False)  # builds networks and optimiser state
    sampler = algo._make_sampler(dataset)
    generator = torch.Generator().manual_seed(1)
    try:
        with FlopCounterMode(display=False) as counter:
            for step in (2, 3):
                algo._update(sampler.sample(generator), step)
    except Exception as error:  # noqa: BLE001 - a mode the counter cannot follow: time the updates anyway
        print(f"{name}: the FLOP counter failed ({type(error).__name__}: {error}); FLOP columns n/a", flush=True)
        return None
    return counter.get_total_flops() / 2


def time_config(name: str, dataset: Dataset, batch_size: int, precision: str, compile_: bool, repeats: int,
                warmup_chunks: int, reference: MatmulReference, flops: float | None, clock=time.perf_counter,
                params: dict | None = None) -> dict:
    """Time `repeats` chunks of the real fit loop, each followed by a reference window of the same length.

    The roofline fraction is the median over chunks of (update FLOP/s in the chunk) / (reference FLOP/s
    in the window right after it), so both sides see the same machine load.  Without a FLOP count the
    reference windows still run (the same load pattern) and the fractions are None.
    """
    chunk = CHUNK[name]
    algo = make_algorithm(name, params, batch_size=batch_size, precision=precision, compile=compile_, device="cpu",
                          random_state=0)
    times: list[float] = []
    ratios: list[float] = []
    state = {"t": None}

    def callback(_algo, step, _metrics):
        elapsed = clock() - state["t"]
        if step > warmup_chunks * chunk:
            times.append(elapsed)
            reference_rate = reference.measure(elapsed)
            if flops is not None:
                ratios.append(flops * chunk / elapsed / reference_rate)
        state["t"] = clock()

    state["t"] = clock()
    started = time.perf_counter()
    algo.fit(dataset, n_steps=(warmup_chunks + repeats) * chunk, log_every=chunk, callbacks=[callback], progress=False)
    return {"updates_per_s": chunk / statistics.median(times), "updates_per_s_best": chunk / min(times),
            "roofline_fp32": statistics.median(ratios) if ratios else None,
            "roofline_fp32_best_chunk": max(ratios) if ratios else None,
            "wall_s": time.perf_counter() - started}


def _number(value: float | None, scale: float, spec: str) -> str:
    width = spec.split(".")[0]
    return f"{'n/a':>{width}}" if value is None else format(value * scale, spec)


def print_relative(results: list[dict]) -> None:
    """Add `vs_IQL` to every row (upd/s over IQL's, same precision and compile) and print the ratios."""
    def rate(name: str, row: dict) -> float | None:
        return next((other["updates_per_s"] for other in results if other["algorithm"] == name
                     and other["precision"] == row["precision"] and other["compile"] == row["compile"]), None)

    if not any(row["algorithm"] == "IQL" for row in results):
        return
    print("relative to IQL (same precision and compile; > 1 is faster):")
    for row in results:
        iql = rate("IQL", row)
        row["vs_IQL"] = None if iql is None else row["updates_per_s"] / iql
        if row["algorithm"] != "IQL":
            print(f"  {row['algorithm']:<11} {row['precision']:<5} compile={row['compile']!s:<5} "
                  f"{_number(row['vs_IQL'], 1.0, '6.3f')}x")
    for row in results:
        if row["algorithm"] == "OFQL" and rate("DiffusionQL", row):
            print(f"  OFQL / DiffusionQL ({row['networks']} vs "
                  f"{next(r['networks'] for r in results if r['algorithm'] == 'DiffusionQL')}) {row['precision']:<5} "
                  f"compile={row['compile']!s:<5} {row['updates_per_s'] / rate('DiffusionQL', row):6.3f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", default=",".join(ALGORITHMS), help="comma-separated subset of " + ",".join(ALGORITHMS))
    parser.add_argument("--precision", default="fp32,bf16", help="comma-separated: fp32, bf16 (default both)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd updates")
    parser.add_argument("--only-compile", action="store_true", help="time only torch.compile'd updates")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7, help="timed chunks per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed chunks first (compilation, caches)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time (default); cpu: process CPU time, which with --threads 1 "
                             "is insensitive to other processes sharing the cores")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a hyper-parameter of the timed algorithms (YAML value), e.g. --set n_action_samples=5")
    args = parser.parse_args(argv)
    import yaml

    params = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: use KEY=VALUE")
        params[key.strip()] = yaml.safe_load(value)
    if args.threads:
        torch.set_num_threads(args.threads)

    names = [n.strip() for n in args.algos.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        parser.error(f"unknown algorithm(s) {unknown}; choose from {list(ALGORITHMS)}")
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    precisions = [q for p in precisions for q in (("fp32", "bf16") if p == "both" else (p,))]
    unknown = sorted(set(precisions) - {"fp32", "bf16"})
    if unknown:
        parser.error(f"--precision: unknown {unknown}; use fp32, bf16 or both")
    compiles = [True] if args.only_compile else ([False, True] if args.compile else [False])

    dataset = synthetic_dataset()
    clock = CLOCKS[args.clock]
    MatmulReference.clock = staticmethod(clock)
    reference = MatmulReference(torch.float32)
    bf16_reference = MatmulReference(torch.bfloat16)
    networks = {name: network_label(make_algorithm(name, params)) for name in names}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"batch {args.batch_size}, obs 11 / act 3, {args.clock} clock")
    print("hidden layers: " + ", ".join(f"{name} {label}" for name, label in networks.items()))
    print(f"{'algorithm':<11} {'precision':<9} {'compile':<7} {'upd/s':>8} {'best':>8} {'MFLOP/upd':>10} "
          f"{'GFLOP/s':>8} {'roofline':>8}")
    results = []
    for name in names:
        flops = update_flops(name, dataset, args.batch_size, params)
        for compile_ in compiles:
            for precision in precisions:
                timing = time_config(name, dataset, args.batch_size, precision, compile_, args.repeats, args.warmup,
                                     reference, flops, clock, params)
                row = {"algorithm": name, "networks": networks[name], "precision": precision, "compile": compile_,
                       "flops_per_update": flops, **timing,
                       "gflops": None if flops is None else flops * timing["updates_per_s"] / 1e9}
                results.append(row)
                print(f"{name:<11} {precision:<9} {compile_!s:<7} {row['updates_per_s']:>8.1f} "
                      f"{row['updates_per_s_best']:>8.1f} {_number(flops, 1e-6, '10.1f')} "
                      f"{_number(row['gflops'], 1.0, '8.1f')} {_number(row['roofline_fp32'], 1.0, '8.1%')}",
                      flush=True)
    print_relative(results)
    bf16_reference.measure(0.2)
    reference.measure(0.2)
    print(f"reference matmul 256x256x256: fp32 median {reference.median / 1e9:.1f} GFLOP/s (best {reference.best / 1e9:.1f}), "
          f"bf16 {bf16_reference.median / 1e9:.1f} GFLOP/s")
    print("upd/s: median chunk; roofline: median over chunks of update FLOP/s / fp32 matmul FLOP/s in the window "
          "right after the chunk (bf16 rows too)")
    if args.json:
        payload = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                   "clock": args.clock,
                   "reference_gflops_median": {"fp32": reference.median / 1e9, "bf16": bf16_reference.median / 1e9},
                   "results": results}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
