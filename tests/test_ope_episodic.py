"""Episodic estimators on small tabular MDPs with exactly known values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from offrl import Dataset
from offrl.ope import (
    FQE,
    BehaviorPolicy,
    DoublyRobust,
    ImportanceSampling,
    ModelBased,
    OPEWarning,
    PerDecisionIS,
    QFunction,
    WeightedDoublyRobust,
    WeightedIS,
    WeightedPerDecisionIS,
    kernel_bandwidth,
)
from offrl.ope.synthetic import TabularMDP, tabular_policy

GAMMA = 0.9


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Small networks on a shared CPU run fastest single-threaded."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
PI_B = np.array([[0.5, 0.5], [0.6, 0.4], [0.3, 0.7]])
PI_E = np.array([[0.8, 0.2], [0.2, 0.8], [0.5, 0.5]])


@pytest.fixture(scope="module")
def mdp():
    return TabularMDP.random(n_states=3, n_actions=2, terminal_prob=0.2, reward_noise=0.1, seed=1)


def _exact_q(mdp, pi, horizon):
    q = mdp.q_values(pi, GAMMA, horizon)
    if horizon is None:
        fn = QFunction(lambda o, a: q[o.argmax(1), a[:, 0].astype(int)], policy=tabular_policy(pi))
    else:
        fn = QFunction(lambda o, a, h: q[h.astype(int), o.argmax(1), a[:, 0].astype(int)], policy=tabular_policy(pi))
        fn.horizon = horizon
    return fn


@pytest.mark.parametrize("horizon", [None, 4])
def test_is_pdis_dr_unbiased(mdp, horizon):
    """Mean over 200 datasets lies within 3 standard errors of the exact value."""
    exact = mdp.value(PI_E, GAMMA, horizon)
    target = tabular_policy(PI_E)
    q = _exact_q(mdp, PI_E, horizon)
    kinds = {"IS": ImportanceSampling, "PDIS": PerDecisionIS, "DR": DoublyRobust}
    values = {k: [] for k in kinds}
    for rep in range(200):
        ds = mdp.sample(PI_B, 50, horizon=horizon, seed=rep)
        for name, cls in kinds.items():
            est = cls(gamma=GAMMA, horizon=horizon, interval="t", warn=False)
            res = est.estimate(ds, target, q_function=q) if name == "DR" else est.estimate(ds, target)
            values[name].append(res.value)
    for name, v in values.items():
        v = np.asarray(v)
        se = v.std(ddof=1) / math.sqrt(len(v))
        assert abs(v.mean() - exact) < 3 * se, (name, v.mean(), exact, se)
    # DR with the exact Q has lower variance than PDIS, which has lower variance than IS
    assert np.std(values["DR"]) < np.std(values["PDIS"]) < np.std(values["IS"])


def test_weighted_estimators_consistent(mdp):
    exact = mdp.value(PI_E, GAMMA, 4)
    target = tabular_policy(PI_E)
    errors = {}
    for n in (100, 20000):
        ds = mdp.sample(PI_B, n, horizon=4, seed=n)
        for cls in (WeightedIS, WeightedPerDecisionIS):
            res = cls(gamma=GAMMA, horizon=4, interval="t").estimate(ds, target)
            errors[(cls.name, n)] = abs(res.value - exact)
            if n == 20000:
                assert errors[(cls.name, n)] < 0.01 * exact
                assert res.ci_low - 0.005 < exact < res.ci_high + 0.005
    assert errors[("WPDIS", 20000)] < 0.5 * max(errors[("WPDIS", 100)], 0.01)


@pytest.mark.parametrize("horizon", [None, 5])
def test_dr_with_exact_q_is_exact_with_zero_variance(horizon):
    """Deterministic transitions and rewards, fixed start: with the exact Q every episode's DR term is V(s0)."""
    mdp = TabularMDP.random(n_states=4, n_actions=2, terminal_prob=0.0, deterministic=True, seed=3)
    if horizon is None:
        mdp.D[:, 1] = 1.0  # action 1 ends the episode (deterministically)
    pi_b = np.full((4, 2), 0.5)
    pi_e = np.array([[0.9, 0.1], [0.3, 0.7], [0.5, 0.5], [0.1, 0.9]])
    ds = mdp.sample(pi_b, 300, horizon=horizon if horizon else 60, seed=0)
    h = horizon
    exact = mdp.value(pi_e, GAMMA, h)
    q = _exact_q(mdp, pi_e, h)
    for cls in (DoublyRobust, WeightedDoublyRobust):
        res = cls(gamma=GAMMA, horizon=h, q_function=q, interval="t", warn=False).estimate(ds, tabular_policy(pi_e))
        if horizon is None and ds.timeouts.any():
            # episodes cut at 60 steps leave a gamma^60 tail; still exact to 1e-2 relative
            assert res.value == pytest.approx(exact, rel=1e-2)
        else:
            # exact up to the float32 storage of rewards
            assert res.value == pytest.approx(exact, rel=1e-6)
            assert res.std_error < 1e-6 * exact
            assert res.ci_high - res.ci_low < 1e-5 * exact


def test_fqe_converges_to_exact_q(mdp):
    ds = mdp.sample(PI_B, 2000, seed=0)
    empirical = TabularMDP.from_dataset(ds)  # FQE's fixed point with one-hot features
    q_emp = empirical.q_values(PI_E, GAMMA)
    q_true = mdp.q_values(PI_E, GAMMA)
    fqe = FQE(gamma=GAMMA, hidden_dims=(64, 64), n_steps=2500, lr=1e-3, tau=0.05, n_critics=2, bootstrap=False,
              device="cpu", random_state=0).fit(ds, policy=tabular_policy(PI_E))
    obs = np.eye(3, dtype=np.float32).repeat(2, 0)
    act = np.tile([0, 1], 3)[:, None]
    q_fqe = fqe.q_values(obs, act).reshape(3, 2)
    assert np.abs(q_fqe - q_emp).max() < 0.03 * np.abs(q_emp).max()
    assert np.abs(q_fqe - q_true).max() < 0.06 * np.abs(q_true).max()
    res = fqe.estimate(ds)
    assert res.value == pytest.approx(empirical.value(PI_E, GAMMA), rel=0.015)
    assert res.method == "FQE" and len(res.diagnostics["member_values"]) == 2
    # a Q from FQE plugs into DR
    dr = DoublyRobust(gamma=GAMMA, q_function=fqe, warn=False).estimate(ds, tabular_policy(PI_E))
    assert dr.value == pytest.approx(mdp.value(PI_E, GAMMA), rel=0.05)


@pytest.mark.slow
def test_fqe_finite_horizon_and_save_load(mdp, tmp_path):
    import offrl

    ds = mdp.sample(PI_B, 2000, horizon=5, seed=1)
    empirical = TabularMDP.from_dataset(ds)
    fqe = FQE(gamma=GAMMA, horizon=5, hidden_dims=(64, 64), n_steps=2500, lr=1e-3, tau=0.05, n_critics=2,
              bootstrap=False, device="cpu", random_state=0).fit(ds, policy=tabular_policy(PI_E))
    assert fqe.estimate(ds).value == pytest.approx(empirical.value(PI_E, GAMMA, 5), rel=0.02)
    # with bootstrap members (the default) the interval also reflects the data's uncertainty about Q
    boot = FQE(gamma=GAMMA, horizon=5, hidden_dims=(64, 64), n_steps=2500, lr=1e-3, tau=0.05, n_critics=3,
               device="cpu", random_state=0).fit(ds, policy=tabular_policy(PI_E)).estimate(ds)
    assert boot.ci_low < mdp.value(PI_E, GAMMA, 5) < boot.ci_high
    assert boot.diagnostics["ensemble_std"] > 0 and "bootstrap" in boot.diagnostics["interval_note"]
    fqe.save(tmp_path / "fqe.pt")
    loaded = offrl.load(tmp_path / "fqe.pt", device="cpu")
    obs, act = ds.observations[:10], ds.actions[:10]
    np.testing.assert_allclose(loaded.q_values(obs, act), fqe.q_values(obs, act), rtol=1e-6)
    assert loaded.estimate(ds, tabular_policy(PI_E)).value == pytest.approx(fqe.estimate(ds).value, rel=1e-6)


def test_model_based_tabular(mdp):
    ds = mdp.sample(PI_B, 1000, horizon=5, seed=0)
    mb = ModelBased(gamma=GAMMA, horizon=5, n_steps=1500, hidden_dims=(64, 64), n_models=3, device="cpu")
    res = mb.estimate(ds, tabular_policy(PI_E))
    assert res.value == pytest.approx(mdp.value(PI_E, GAMMA, 5), rel=0.08)
    assert len(res.diagnostics["member_values"]) == 3 and res.ci_low < res.value < res.ci_high


def test_estimated_behaviour_policy_is_reported(mdp):
    ds = mdp.sample(PI_B, 3000, horizon=4, seed=5)
    exact = mdp.value(PI_E, GAMMA, 4)
    logged = PerDecisionIS(gamma=GAMMA, horizon=4, interval="t").estimate(ds, tabular_policy(PI_E))
    estimated = PerDecisionIS(gamma=GAMMA, horizon=4, interval="t").estimate(ds.without_behavior_log_probs(),
                                                                             tabular_policy(PI_E))
    assert logged.diagnostics["behavior_policy"] == "logged"
    assert estimated.diagnostics["behavior_policy"].startswith("estimated")
    assert abs(estimated.value - exact) < 3 * estimated.std_error + 0.01
    # the classifier recovers pi_b on one-hot states
    bp = BehaviorPolicy().fit(ds)
    np.testing.assert_allclose(bp.predict_proba(np.eye(3, dtype=np.float32)), PI_B, atol=0.05)


def test_bad_input_is_refused(mdp):
    ds = mdp.sample(PI_B, 50, horizon=4, seed=0)
    target = tabular_policy(PI_E)
    for gamma in (0.0, 1.5, -1):
        with pytest.raises(ValueError, match="gamma"):
            ImportanceSampling(gamma=gamma).estimate(ds, target)
    with pytest.raises(ValueError, match="horizon"):
        ImportanceSampling(horizon=0).estimate(ds, target)
    with pytest.raises(ValueError, match="rows but the dataset has"):
        ImportanceSampling().estimate(ds, target, behavior=np.zeros(3))
    zero = np.log(np.full(ds.n_transitions, 0.5))
    zero[4] = -np.inf
    with pytest.raises(ValueError, match="probability 0 to the logged action at row 4"):
        ImportanceSampling().estimate(ds, target, behavior=zero)
    with pytest.raises(ValueError, match="probabilities must be non-negative and sum to 1"):
        ImportanceSampling().estimate(ds, lambda obs: np.full((len(obs), 2), 0.7))


def test_unsupported_actions_warn_with_ess(mdp):
    pi_b = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])  # the logs never take action 1
    ds = mdp.sample(pi_b, 100, horizon=4, seed=0)
    with pytest.warns(OPEWarning, match=r"never take \(\[1\]\).*effective sample size"):
        res = WeightedIS(gamma=GAMMA, horizon=4).estimate(ds, tabular_policy(PI_E))
    assert res.diagnostics["unsupported_mass"] == pytest.approx(PI_E[:, 1] @ np.bincount(
        ds.observations.argmax(1), minlength=3) / ds.n_transitions)


def _one_step_continuous(n, seed):
    rng = np.random.default_rng(seed)
    s = rng.normal(size=(n, 1))
    a = 0.5 * s + 0.5 * rng.normal(size=(n, 1))
    log_b = -0.5 * ((a - 0.5 * s) / 0.5) ** 2 - math.log(0.5) - 0.5 * math.log(2 * math.pi)
    r = -((a - s) ** 2)[:, 0]
    return Dataset.from_arrays(s, a, r, terminals=np.ones(n), next_observations=s, behavior_log_probs=log_b[:, 0])


def test_kernel_weights_for_deterministic_continuous_target():
    """r = -(a - s)^2, pi(s) = 0.8 s: the kernel-smoothed target has value -0.04 - h^2 in closed form."""
    ds = _one_step_continuous(20000, 0)
    for bandwidth in (0.1, "scott"):
        res = WeightedIS(gamma=1.0, bandwidth=bandwidth, interval="t").estimate(ds, lambda o: 0.8 * o)
        h = res.diagnostics["kernel_bandwidth"]
        assert abs(res.value - (-0.04 - h ** 2)) < 3 * res.std_error
    sigma = min(ds.actions.std(ddof=1), np.subtract(*np.percentile(ds.actions, [75, 25])) / 1.349)
    assert kernel_bandwidth(ds.actions, "scott")[0] == pytest.approx(sigma * 20000 ** (-1 / 5))
    assert kernel_bandwidth(ds.actions, "silverman")[0] == pytest.approx((4 / 3) ** 0.2 * sigma * 20000 ** (-1 / 5))
    # without logged log-probs the Gaussian BC estimate of pi_b is used and reported
    est = WeightedIS(gamma=1.0, interval="t").estimate(ds.without_behavior_log_probs(), lambda o: 0.8 * o)
    assert est.diagnostics["behavior_policy"].startswith("estimated (")  # the model is named (behavior.py's wording)
    assert abs(est.value - (-0.04 - est.diagnostics["kernel_bandwidth"] ** 2)) < 4 * est.std_error


def test_estimator_interval_coverage(mdp):
    """95% intervals of PDIS / WPDIS cover the exact value about 95% of the time (300 episodes, horizon 3)."""
    exact = mdp.value(PI_E, GAMMA, 3)
    target = tabular_policy(PI_E)
    covered: dict[tuple[str, str], list[bool]] = {}
    for rep in range(150):
        ds = mdp.sample(PI_B, 300, horizon=3, seed=1000 + rep)
        for cls in (PerDecisionIS, WeightedPerDecisionIS):
            for interval in ("t", "bootstrap", "hoeffding"):
                res = cls(gamma=GAMMA, horizon=3, interval=interval, n_bootstrap=300, reward_bound=(-0.5, 1.5),
                          random_state=rep, warn=False).estimate(ds, target)
                covered.setdefault((cls.name, interval), []).append(res.ci_low <= exact <= res.ci_high)
    for (name, interval), hits in covered.items():
        rate = float(np.mean(hits))
        if interval == "hoeffding":
            assert rate >= 0.95, (name, interval, rate)  # a conservative bound
        else:
            assert 0.9 <= rate <= 0.99, (name, interval, rate)


def test_warning_prints_the_largest_weight_that_a_float_rounds_to_zero():
    """200-step episodes give whole-episode weights of 1e-194: the warning said "max weight 0" before."""
    from offrl.ope.behavior import weight_diagnostics

    rescaled = np.array([1.0, 1e-30, 1e-40, 1e-50])  # the weights relative to the largest
    diag = weight_diagnostics(rescaled, warn=False, max_weight=0.0, log_max_weight=-447.0)
    assert "largest weight about 1e-194" in diag["warning"] and "max weight 0" not in diag["warning"]
    assert "the largest carries 100% of their total" in diag["warning"]
    plain = weight_diagnostics(np.array([3.0, 1e-9, 1e-9]), warn=False)
    assert "max weight 3" in plain["warning"]
