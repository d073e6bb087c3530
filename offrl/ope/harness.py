"""Evaluation of OPE itself: true values by on-policy roll-outs, then `evaluate` with metrics."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from offrl.datasets.core import Dataset
from offrl.ope.api import evaluate, resolve_policies
from offrl.ope.behavior import as_target_policy
from offrl.ope.report import OPEReport
from offrl.ope.results import check_gamma, check_horizon

__all__ = ["benchmark", "true_policy_value"]


def true_policy_value(env: Any, policy: Any, gamma: float, n_rollouts: int = 100, horizon: int | None = None,
                      seed: int = 0, dataset: Dataset | None = None) -> dict[str, float]:
    """Monte-Carlo discounted value of `policy` in `env`: mean, standard error and n.

    The policy acts as OPE sees it: sampled for stochastic and discrete
    policies, pi(s) for deterministic ones.  Episode i is reset with seed
    `seed + i`; `horizon` caps the episode length.
    """
    from offrl.evaluation import evaluate_policy

    import torch

    gamma = check_gamma(gamma)
    target = as_target_policy(policy, dataset)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)  # offrl policies sample with torch's global generator
    actor = lambda obs: target.act(obs, rng)  # noqa: E731
    if _keeps_context(policy):  # a transformer or a guide: roll it out through its own stateful actor
        actor = policy.make_actor(deterministic=target.kind == "deterministic")
    out = evaluate_policy(actor, env, n_episodes=int(n_rollouts), seed=seed, gamma=gamma,
                          max_steps=check_horizon(horizon))
    values = np.asarray(out["discounted_returns"], np.float64)
    se = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.inf
    return {"value": float(values.mean()), "std_error": se, "n": len(values),
            "undiscounted_return": float(out["return_mean"])}


def _keeps_context(policy: Any) -> bool:
    from offrl.algos.base import BaseEstimator

    return isinstance(policy, BaseEstimator) and type(policy).make_actor is not BaseEstimator.make_actor


def benchmark(
    env: Any,
    dataset: Dataset | str,
    policies: Any,
    gamma: float = 0.99,
    n_rollouts: int = 100,
    estimators: Any = None,
    horizon: int | None = None,
    *,
    seed: int = 0,
    **evaluate_kwargs: Any,
) -> OPEReport:
    """True discounted value of every policy by `n_rollouts` on-policy roll-outs in `env`, then
    `evaluate(policies, dataset, estimators, gamma, horizon, true_values=...)`: the report has the
    selection metrics (`report.metrics()`), and `report.metadata["true_value_std_error"]`.
    """
    from offrl.datasets import load as load_dataset
    from offrl.evaluation import make_env

    if isinstance(dataset, str):
        dataset = load_dataset(dataset)
    env = make_env(env)
    policies = resolve_policies(policies)
    truth = {name: true_policy_value(env, p, gamma, n_rollouts, horizon, seed, dataset) for name, p in policies.items()}
    report = evaluate(policies, dataset, estimators, gamma, horizon, true_values={k: v["value"] for k, v in truth.items()},
                      **evaluate_kwargs)
    report.metadata["true values"] = f"{n_rollouts} on-policy roll-outs per policy"
    report.metadata["true_value_std_error"] = {k: round(v["std_error"], 4) for k, v in truth.items()}
    return report
