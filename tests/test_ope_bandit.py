"""Bandit estimators: OBP's formulas in closed form, OBP parity (when obp is importable), unbiasedness, bad input."""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import pytest

from offrl.ope import OPEWarning
from offrl.ope.bandit import (
    DR,
    IPW,
    SNDR,
    SNIPW,
    DirectMethod,
    DRShrinkage,
    RegressionModel,
    SwitchDR,
    evaluate_bandit,
)
from offrl.ope.synthetic import SyntheticBandit


@pytest.fixture
def log():
    rng = np.random.default_rng(0)
    n, k = 200, 3
    action = rng.integers(k, size=n)
    pscore = rng.uniform(0.2, 0.6, size=n)
    reward = rng.binomial(1, 0.4, size=n).astype(float)
    dist = rng.dirichlet(np.ones(k), size=n)[:, :, None]
    q = rng.uniform(0, 1, size=(n, k, 1))
    return dict(reward=reward, action=action, pscore=pscore, action_dist=dist, estimated_rewards_by_reg_model=q)


def _parts(d):
    n = len(d["reward"])
    w = d["action_dist"][np.arange(n), d["action"], 0] / d["pscore"]
    q = d["estimated_rewards_by_reg_model"][:, :, 0]
    dm = (q * d["action_dist"][:, :, 0]).sum(1)
    qa = q[np.arange(n), d["action"]]
    return w, dm, qa, d["reward"]


def test_closed_forms(log):
    w, dm, qa, r = _parts(log)
    expected = {
        IPW(): np.mean(w * r),
        IPW(lambda_=1.5): np.mean(np.minimum(w, 1.5) * r),
        SNIPW(): np.mean(w * r) / np.mean(w),
        DirectMethod(): np.mean(dm),
        DR(): np.mean(dm + w * (r - qa)),
        SNDR(): np.mean(dm) + np.mean(w * (r - qa)) / np.mean(w),
        SwitchDR(lambda_=1.0): np.mean(dm + (w <= 1.0) * w * (r - qa)),
        DRShrinkage(lambda_=2.0): np.mean(dm + 2.0 * w / (w ** 2 + 2.0) * (r - qa)),
    }
    for est, value in expected.items():
        res = est.estimate(**log)
        assert res.value == pytest.approx(value, rel=1e-12), type(est).__name__
        assert est.estimate_policy_value(**log) == pytest.approx(value, rel=1e-12)
        assert res.ci_low <= res.value <= res.ci_high
        assert res.method == est.estimator_name
    # limits: shrinkage 0 and switch 0 are DM; switch/shrinkage inf are DR
    assert DRShrinkage(lambda_=0.0).estimate(**log).value == pytest.approx(np.mean(dm))
    assert SwitchDR(lambda_=0.0).estimate(**log).value == pytest.approx(np.mean(dm))
    assert SwitchDR().estimate(**log).value == pytest.approx(DR().estimate(**log).value)
    assert DRShrinkage(lambda_=np.inf).estimate(**log).value == pytest.approx(DR().estimate(**log).value)


def test_positions_and_2d_action_dist(log):
    rng = np.random.default_rng(1)
    n = len(log["reward"])
    dist = rng.dirichlet(np.ones(3), size=(n, 2)).transpose(0, 2, 1)
    position = rng.integers(2, size=n)
    w = dist[np.arange(n), log["action"], position] / log["pscore"]
    res = IPW().estimate(reward=log["reward"], action=log["action"], pscore=log["pscore"], action_dist=dist,
                         position=position)
    assert res.value == pytest.approx(np.mean(w * log["reward"]))
    with pytest.raises(ValueError, match="position must be given"):
        IPW().estimate(reward=log["reward"], action=log["action"], pscore=log["pscore"], action_dist=dist)
    two_d = IPW().estimate(**{**log, "action_dist": log["action_dist"][:, :, 0]})
    assert two_d.value == pytest.approx(IPW().estimate(**log).value)


def test_bad_input_is_refused(log):
    with pytest.raises(ValueError, match="reward has 199 rows but action_dist has 200"):
        IPW().estimate(**{**log, "reward": log["reward"][:-1]})
    with pytest.raises(ValueError, match="pscore must be positive"):
        IPW().estimate(**{**log, "pscore": np.where(np.arange(200) == 5, 0.0, log["pscore"])})
    with pytest.raises(ValueError, match="found -0.1 at row 7"):
        SNIPW().estimate(**{**log, "pscore": np.where(np.arange(200) == 7, -0.1, log["pscore"])})
    with pytest.raises(ValueError, match="probability distribution"):
        IPW().estimate(**{**log, "action_dist": log["action_dist"] * 1.1})
    with pytest.raises(ValueError, match="outside"):
        IPW().estimate(**{**log, "action": np.full(200, 3)})
    with pytest.raises(ValueError, match="estimated_rewards_by_reg_model"):
        DR().estimate(**{k: v for k, v in log.items() if k != "estimated_rewards_by_reg_model"})
    with pytest.raises(ValueError, match="shape"):
        DR().estimate(**{**log, "estimated_rewards_by_reg_model": log["estimated_rewards_by_reg_model"][:, :2]})


def test_unsupported_actions_warn_with_ess(log):
    d = dict(log)
    d["action"] = np.where(log["action"] == 2, 0, log["action"])  # the logs never take action 2
    with pytest.warns(OPEWarning, match=r"never take \(\[2\]\).*effective sample size"):
        res = IPW().estimate(**d)
    assert res.diagnostics["unsupported_mass"] > 0.2
    assert 0 < res.diagnostics["ess"] <= 200


def test_ipw_dr_unbiased_on_synthetic_bandit():
    env = SyntheticBandit(n_actions=4, dim_context=3, seed=2)
    rng = np.random.default_rng(0)
    theta = rng.normal(size=(3, 4))
    values = {"ipw": [], "dr": [], "truth": []}
    for rep in range(100):
        fb = env.obtain_batch_bandit_feedback(300, seed=rep)
        logits = fb["context"] @ theta
        dist = np.exp(logits - logits.max(1, keepdims=True))
        dist = (dist / dist.sum(1, keepdims=True))[:, :, None]
        q_wrong = np.full(dist.shape, 0.5)  # a poor reward model: DR stays unbiased
        values["ipw"].append(IPW().estimate_policy_value(fb["reward"], fb["action"], dist, fb["pscore"]))
        values["dr"].append(DR().estimate_policy_value(fb["reward"], fb["action"], dist, fb["pscore"],
                                                       estimated_rewards_by_reg_model=q_wrong))
        values["truth"].append(env.calc_ground_truth_policy_value(fb["expected_reward"], dist))
    truth = np.mean(values["truth"])
    for key in ("ipw", "dr"):
        v = np.asarray(values[key])
        assert abs(v.mean() - truth) < 3 * v.std(ddof=1) / np.sqrt(len(v)), key


def test_regression_model_cross_fitting():
    from sklearn.linear_model import LogisticRegression

    env = SyntheticBandit(n_actions=3, dim_context=2, seed=0)
    fb = env.obtain_batch_bandit_feedback(600, seed=0)
    model = RegressionModel(LogisticRegression(max_iter=500), n_actions=3)
    q1 = model.fit_predict(fb["context"], fb["action"], fb["reward"], n_folds=1)
    q3 = model.fit_predict(fb["context"], fb["action"], fb["reward"], n_folds=3, random_state=0)
    assert q1.shape == q3.shape == (600, 3, 1)
    assert np.all((q3 > 0) & (q3 < 1)) and not np.allclose(q1, q3)
    # cross-fitted: a round's own reward never reaches the model that predicts it
    flipped = fb["reward"].copy()
    flipped[5] = 1 - flipped[5]
    q3_flipped = model.fit_predict(fb["context"], fb["action"], flipped, n_folds=3, random_state=0)
    np.testing.assert_allclose(q3_flipped[5], q3[5])
    assert not np.allclose(q3_flipped, q3)
    report = evaluate_bandit({"uniform": np.full((600, 3), 1 / 3)}, reward=fb["reward"], action=fb["action"],
                             pscore=fb["pscore"], context=fb["context"])
    assert set(report.estimators) == {"ipw", "snipw", "dm", "dr", "sndr", "switch-dr", "dr-os"}


def _import_obp():
    path = os.environ.get("OBP_PATH")  # e.g. an unpacked obp 0.5.x source tree (obp does not support Python 3.11)
    if path and path not in sys.path:
        sys.path.insert(0, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("obp.ope")


def test_obp_parity():
    O = _import_obp()
    from sklearn.linear_model import LogisticRegression

    env = SyntheticBandit(n_actions=4, dim_context=3, len_list=3, seed=1)
    fb = env.obtain_batch_bandit_feedback(400, seed=2)
    dist = np.random.default_rng(3).dirichlet(np.ones(4), size=(400, 3)).transpose(0, 2, 1)
    q_obp = O.RegressionModel(n_actions=4, len_list=3, base_model=LogisticRegression(max_iter=500)).fit_predict(
        context=fb["context"], action=fb["action"], reward=fb["reward"], position=fb["position"], n_folds=3,
        random_state=5)
    q = RegressionModel(LogisticRegression(max_iter=500), n_actions=4, len_list=3).fit_predict(
        fb["context"], fb["action"], fb["reward"], position=fb["position"], n_folds=3, random_state=5)
    np.testing.assert_allclose(q, q_obp)
    kw = dict(reward=fb["reward"], action=fb["action"], pscore=fb["pscore"], action_dist=dist,
              position=fb["position"], estimated_rewards_by_reg_model=q)
    pairs = [(O.InverseProbabilityWeighting(), IPW()), (O.SelfNormalizedInverseProbabilityWeighting(), SNIPW()),
             (O.DirectMethod(), DirectMethod()), (O.DoublyRobust(), DR()), (O.SelfNormalizedDoublyRobust(), SNDR()),
             (O.SwitchDoublyRobust(lambda_=2.0), SwitchDR(lambda_=2.0)),
             (O.DoublyRobustWithShrinkage(lambda_=1.0), DRShrinkage(lambda_=1.0))]
    for theirs, ours in pairs:
        assert ours.estimate_policy_value(**kw) == pytest.approx(theirs.estimate_policy_value(**kw), rel=1e-12)
        a = theirs.estimate_interval(**kw, n_bootstrap_samples=200, random_state=7)
        b = ours.estimate_interval(**kw, n_bootstrap_samples=200, random_state=7)
        assert list(a) == list(b)
        assert [b[key] for key in a] == pytest.approx([a[key] for key in a], rel=1e-12)
