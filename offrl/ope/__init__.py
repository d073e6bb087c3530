"""Off-policy evaluation: how good are candidate policies, from logged data alone, with honest uncertainty.

Episodic (RL) estimators, each `estimate(dataset, policy) -> OPEResult`:
`FQE`, `ImportanceSampling`, `PerDecisionIS`, `WeightedIS`,
`WeightedPerDecisionIS`, `DoublyRobust`, `WeightedDoublyRobust`,
`ModelBased`, and the marginal (state-action density ratio) estimators
`MarginalIS`, `SelfNormalizedMarginalIS`, `MarginalDR`, `MQL` built on
`MarginalRatios` (MWL).  Bandit estimators with Open Bandit Pipeline's interface
(`offrl.ope.bandit`): `IPW`, `SNIPW`, `DirectMethod`, `DR`, `SNDR`,
`SwitchDR`, `DRShrinkage`, `RegressionModel`.

`evaluate(policies, dataset, estimators, gamma)` -> `OPEReport` (tables,
CSV, a self-contained HTML page, `select(k)`), `benchmark(env, ...)` adds
true values from roll-outs, and `offrl.ope.metrics` scores estimators.
"""

from __future__ import annotations

from offrl.ope import metrics
from offrl.ope.api import DEFAULT_ESTIMATORS, ESTIMATORS, evaluate, make_estimator
from offrl.ope.bandit import (
    DR as BanditDR,
    IPW,
    SNDR,
    SNIPW,
    DirectMethod,
    DRShrinkage,
    RegressionModel,
    SwitchDR,
    evaluate_bandit,
)
from offrl.ope.behavior import BehaviorPolicy, TargetPolicy, as_target_policy, kernel_bandwidth
from offrl.ope.episodic import (
    DoublyRobust,
    ImportanceSampling,
    PerDecisionIS,
    QFunction,
    WeightedDoublyRobust,
    WeightedIS,
    WeightedPerDecisionIS,
)
from offrl.ope.fqe import FQE
from offrl.ope.marginal import MQL, MarginalDR, MarginalIS, MarginalRatios, SelfNormalizedMarginalIS
from offrl.ope.harness import benchmark, true_policy_value
from offrl.ope.model_based import ModelBased
from offrl.ope.report import OPEReport
from offrl.ope.results import (
    OPEResult,
    OPEWarning,
    bernstein_interval,
    bootstrap_interval,
    confidence_interval,
    hoeffding_interval,
    t_interval,
)

__all__ = [
    "OPEResult", "OPEReport", "OPEWarning",
    "FQE", "ImportanceSampling", "PerDecisionIS", "WeightedIS", "WeightedPerDecisionIS",
    "DoublyRobust", "WeightedDoublyRobust", "ModelBased", "QFunction",
    "MarginalRatios", "MarginalIS", "SelfNormalizedMarginalIS", "MarginalDR", "MQL",
    "IPW", "SNIPW", "DirectMethod", "BanditDR", "SNDR", "SwitchDR", "DRShrinkage", "RegressionModel",
    "evaluate_bandit",
    "TargetPolicy", "as_target_policy", "BehaviorPolicy", "kernel_bandwidth",
    "evaluate", "benchmark", "true_policy_value", "make_estimator", "ESTIMATORS", "DEFAULT_ESTIMATORS",
    "t_interval", "hoeffding_interval", "bernstein_interval", "bootstrap_interval", "confidence_interval",
    "metrics",
]
