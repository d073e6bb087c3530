"""`evaluate`: every requested estimator on every candidate policy, as one `OPEReport`."""

from __future__ import annotations

import os
import warnings
from typing import Any, Mapping, Sequence

import sklearn.base

from offrl.datasets.core import Dataset
from offrl.ope.behavior import estimate_behavior, log_importance_ratios
from offrl.ope.episodic import (
    DoublyRobust,
    ImportanceSampling,
    PerDecisionIS,
    WeightedDoublyRobust,
    WeightedIS,
    WeightedPerDecisionIS,
    _DRFamily,
    _ISFamily,
)
from offrl.ope.fqe import FQE
from offrl.ope.marginal import MQL, MarginalDR, MarginalIS, MarginalRatios, SelfNormalizedMarginalIS, _MarginalEstimator
from offrl.ope.model_based import ModelBased
from offrl.ope.report import OPEReport
from offrl.ope.results import INTERVALS, OPEResult, OPEWarning, check_alpha, check_gamma, check_horizon

__all__ = ["evaluate", "ESTIMATORS", "DEFAULT_ESTIMATORS", "make_estimator", "resolve_policies"]

ESTIMATORS = {
    "FQE": FQE,
    "IS": ImportanceSampling,
    "PDIS": PerDecisionIS,
    "WIS": WeightedIS,
    "WPDIS": WeightedPerDecisionIS,
    "DR": DoublyRobust,
    "WDR": WeightedDoublyRobust,
    "MB": ModelBased,
    "MIS": MarginalIS,
    "SNMIS": SelfNormalizedMarginalIS,
    "MDR": MarginalDR,
    "MQL": MQL,
}
DEFAULT_ESTIMATORS = ("FQE", "IS", "PDIS", "WIS", "WPDIS", "DR", "WDR")


def estimator_key(name: str) -> str:
    """The short name (a key of ESTIMATORS) of an estimator given by short or class name, case-insensitive."""
    names = {k.lower(): k for k in ESTIMATORS}
    names.update({cls.__name__.lower(): k for k, cls in ESTIMATORS.items()})
    key = names.get(str(name).lower())
    if key is None:
        raise ValueError(f"unknown estimator {name!r}; choose from {list(ESTIMATORS)} (or their class names, "
                         f"{[cls.__name__ for cls in ESTIMATORS.values()]})")
    return key


def make_estimator(name: str, **params: Any) -> Any:
    """An episodic estimator by short name (FQE, IS, PDIS, WIS, WPDIS, DR, WDR, MB, MIS, SNMIS, MDR, MQL) or class name
    (e.g. "PerDecisionIS", "DoublyRobust"), case-insensitive."""
    cls = ESTIMATORS[estimator_key(name)]
    valid = cls().get_params()
    return cls(**{k: v for k, v in params.items() if k in valid})


def resolve_policies(policies: Any) -> dict[str, Any]:
    """name -> policy; a string value is a model file, loaded with `offrl.load`."""
    if isinstance(policies, Mapping):
        items = list(policies.items())
    elif isinstance(policies, Sequence) and not isinstance(policies, str):
        items = [(getattr(p, "name", None) or type(p).__name__ + f"_{i}", p) for i, p in enumerate(policies)]
    else:
        raise TypeError("policies must be a dict name -> policy (a fitted estimator, callable, TargetPolicy or model path)")
    if not items:
        raise ValueError("policies is empty; pass at least one policy to evaluate")
    out = {}
    for name, policy in items:
        if isinstance(policy, (str, os.PathLike)):
            from offrl import load

            policy = load(policy, device="cpu")
        out[str(name)] = policy
    return out


def evaluate(
    policies: Any,
    dataset: Dataset | str,
    estimators: Sequence[Any] | None = None,
    gamma: float = 0.99,
    horizon: int | None = None,
    true_values: Mapping[str, float] | None = None,
    *,
    behavior: Any = None,
    interval: str = "bootstrap",
    alpha: float = 0.05,
    n_bootstrap: int = 2000,
    reward_bound: tuple[float, float] | None = None,
    weight_bound: float | None = None,
    bandwidth: Any = "scott",
    fqe_params: Mapping[str, Any] | None = None,
    mb_params: Mapping[str, Any] | None = None,
    marginal_params: Mapping[str, Any] | None = None,
    distributional: Sequence[Any] | str | None = None,
    cvar_alpha: float = 0.1,
    k: int = 1,
    safety_threshold: float | None = None,
    random_state: Any = 0,
    verbose: bool = False,
) -> OPEReport:
    """Estimate the value of each policy with each estimator; returns an `OPEReport`.

    `estimators`: names ("FQE", "IS", "PDIS", "WIS", "WPDIS", "DR", "WDR",
    "MB", and the marginal "MIS", "SNMIS", "MDR", "MQL") or estimator
    instances (their `gamma` and `horizon` are set to this call's).
    Default: all but MB and the marginal ones.  The behaviour log-probabilities are
    computed once (logged, or estimated, see `estimate_behavior`); an
    estimated model's held-out log-likelihood goes into the IS/DR results'
    diagnostics (`behavior_heldout_loglik`, nats per transition) and the
    report.  FQE is fitted once per policy and shared by DR and WDR; the MB
    model is fitted once; the marginal estimators share one `MarginalRatios`
    fit per policy (and MDR the FQE fit).  `fqe_params` / `mb_params` /
    `marginal_params` go to FQE / ModelBased / the marginal estimators
    (features, n_features, ridge, ...).

    `distributional`: distributional estimators ("CD-IS", "CD-SNIS",
    "CD-DM", "CD-DR", "CD-SNDR") whose estimated return CDFs (with mean,
    variance, CVaR at `cvar_alpha` and interquartile range, each with an
    interval) go into the report (`report.distributions`, the CDF figure,
    `select(risk="cvar")`).  They share this call's behaviour estimate, and
    their bootstrap uses at most 500 resamples (each recomputes every
    policy's whole CDF).
    `reward_bound` and `weight_bound` are guaranteed ranges of the rewards
    and importance weights for the "hoeffding" / "bernstein" intervals
    (without them the observed ranges are used, and the results say so).
    """
    from offrl.datasets import load as load_dataset

    if isinstance(dataset, (str, os.PathLike)):
        dataset = load_dataset(dataset)
    if not isinstance(dataset, Dataset):
        raise TypeError(f"dataset must be an offrl Dataset or a load spec, got {type(dataset).__name__}")
    gamma = check_gamma(gamma)
    horizon = check_horizon(horizon)
    check_alpha(alpha)
    if interval not in INTERVALS:
        raise ValueError(f"interval must be one of {INTERVALS}, got {interval!r}")
    policies = resolve_policies(policies)
    common = dict(gamma=gamma, horizon=horizon, interval=interval, alpha=alpha, n_bootstrap=n_bootstrap,
                  reward_bound=reward_bound, weight_bound=weight_bound, random_state=random_state, bandwidth=bandwidth)
    ests: list[Any] = []
    for spec in (DEFAULT_ESTIMATORS if estimators is None else estimators):
        if isinstance(spec, str):
            key = estimator_key(spec)
            extra = (dict(fqe_params or {}) if key == "FQE" else dict(mb_params or {}) if key == "MB"
                     else dict(marginal_params or {}) if issubclass(ESTIMATORS[key], _MarginalEstimator) else {})
            est = make_estimator(spec, **{**common, **extra})
        else:
            est = sklearn.base.clone(spec)
            est.set_params(**{k_: v for k_, v in (("gamma", gamma), ("horizon", horizon)) if k_ in est.get_params()})
        if hasattr(est, "warn"):
            est.set_params(warn=False)
        ests.append(est)
    names = [getattr(e, "name", type(e).__name__) for e in ests]
    if len(set(names)) != len(names):
        raise ValueError(f"estimator names must be unique, got {names}")
    needs_weights = any(isinstance(e, (_ISFamily, _DRFamily)) for e in ests)
    needs_fqe = any(isinstance(e, FQE) for e in ests) or any(
        isinstance(e, (_DRFamily, MarginalDR)) and e.q_function is None for e in ests)
    marginal_template = next((e for e in ests if isinstance(e, _MarginalEstimator)), None)
    b_log_probs = estimate_behavior(dataset, behavior) if needs_weights else None
    fqe_template = next((e for e in ests if isinstance(e, FQE)), None)
    if fqe_template is None:
        fqe_template = FQE(**{**{k_: v for k_, v in common.items() if k_ in FQE().get_params()}, **dict(fqe_params or {})})
    model = None
    results: dict[str, dict[str, OPEResult]] = {}
    for policy_name, policy in policies.items():
        if verbose:
            print(f"[ope] evaluating {policy_name}", flush=True)
        per_policy: dict[str, OPEResult] = {}
        ratios = log_importance_ratios(dataset, policy, behavior_log_probs_=b_log_probs, bandwidth=bandwidth) \
            if needs_weights else None
        fqe = ratios_fit = None
        if marginal_template is not None:
            ratios_fit = MarginalRatios(**marginal_template.ratio_params()).fit(dataset, policy)
        if needs_fqe:
            fqe = sklearn.base.clone(fqe_template).fit(dataset, policy=policy)
        for est, name in zip(ests, names):
            if isinstance(est, FQE):
                per_policy[name] = fqe.estimate(dataset)
            elif isinstance(est, _DRFamily):
                per_policy[name] = est.estimate(dataset, policy, log_ratios=ratios,
                                                q_function=est.q_function if est.q_function is not None else fqe)
            elif isinstance(est, MarginalDR):
                per_policy[name] = est.estimate(dataset, policy, ratios=_shared(ratios_fit, est),
                                                q_function=est.q_function if est.q_function is not None else fqe)
            elif isinstance(est, _MarginalEstimator):
                per_policy[name] = est.estimate(dataset, policy, ratios=_shared(ratios_fit, est))
            elif isinstance(est, _ISFamily):
                per_policy[name] = est.estimate(dataset, policy, log_ratios=ratios)
            elif isinstance(est, ModelBased):
                if model is None:
                    model = est.fit(dataset)
                per_policy[name] = model.estimate(dataset, policy)
            else:
                per_policy[name] = est.estimate(dataset, policy)
        texts = [f"{name}: {r.diagnostics['warning']}" for name, r in per_policy.items() if "warning" in r.diagnostics]
        if texts:
            more = f" (and warnings from {len(texts) - 1} more estimators; see the report)" if len(texts) > 1 else ""
            warnings.warn(f"policy {policy_name!r}: {texts[0]}{more}", OPEWarning, stacklevel=2)
        results[policy_name] = per_policy
    metadata = {"dataset": dataset.metadata.get("name", repr(dataset)), "episodes": dataset.n_episodes,
                "transitions": dataset.n_transitions, "gamma": gamma, "horizon": horizon or "as logged",
                "interval": f"{interval} ({100 * (1 - alpha):g}%)"}
    if dataset.is_labelled("rewards"):  # the logged episodes' own value: the summary compares the best policy with it
        from offrl.ope.report import logged_value

        metadata["data value"] = logged_value(dataset, gamma, horizon)
    if b_log_probs is not None:
        metadata["behaviour policy"] = b_log_probs.description
    distributions = None
    if distributional:
        from offrl.ope.distributional import distribution_model, evaluate_distributions

        specs = [distributional] if isinstance(distributional, str) or not isinstance(distributional, Sequence) \
            else list(distributional)
        # the MB estimator's fitted model serves CD-DM / CD-DR too when it is the model they would fit
        shared = model if model is not None and _same_model(model, distribution_model(
            gamma=gamma, horizon=horizon, random_state=random_state, mb_params=mb_params)) else None
        distributions = evaluate_distributions(
            policies, dataset, specs, gamma=gamma, horizon=horizon, behavior=behavior, bandwidth=bandwidth,
            alpha=alpha, cvar_alpha=cvar_alpha, n_bootstrap=min(int(n_bootstrap), 500), random_state=random_state,
            mb_params=mb_params, behavior_log_probs=b_log_probs, model=shared)
    return OPEReport(results, true_values=true_values, k=k, safety_threshold=safety_threshold, metadata=metadata,
                     distributions=distributions)


def _same_model(a: ModelBased, b: ModelBased) -> bool:
    """Whether two `ModelBased` fit the same model: they may differ only in how they estimate with it."""
    estimate_only = ("gamma", "horizon", "interval", "alpha", "n_bootstrap", "reward_bound")
    pa, pb = ({k: v for k, v in m.get_params().items() if k not in estimate_only} for m in (a, b))
    return pa == pb


def _shared(ratios: MarginalRatios, est: Any) -> MarginalRatios | None:
    """The shared ratio fit when `est` asks for the same one (else None: the estimator fits its own)."""
    return ratios if est.ratio_params() == ratios.get_params() else None
