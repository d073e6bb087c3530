"""Marginal OPE (MWL ratios, MIS, SNMIS, MQL, MDR) against exact answers on tabular MDPs."""

from __future__ import annotations

import numpy as np
import pytest
import sklearn.base

from offrl.ope import ESTIMATORS, MQL, MarginalDR, MarginalIS, MarginalRatios, OPEWarning, QFunction, SelfNormalizedMarginalIS, evaluate
from offrl.ope.synthetic import TabularMDP, tabular_policy
from conftest import pendulum_shaped_dataset

pytestmark = pytest.mark.usefixtures("one_thread")

S, A, GAMMA = 4, 2, 0.9


@pytest.fixture(scope="module")
def problem():
    mdp = TabularMDP.random(n_states=S, n_actions=A, seed=1)
    rng = np.random.default_rng(0)
    return mdp, rng.dirichlet(np.ones(A), size=S), rng.dirichlet(np.ones(A), size=S)


def occupancy(mdp: TabularMDP, pi: np.ndarray, gamma: float) -> np.ndarray:
    """Normalised discounted state-action occupancy (1 - gamma) sum_t gamma^t P(s_t = s, a_t = a)."""
    p_pi = np.einsum("sat,sa->st", mdp.P, pi)
    d_s = (1 - gamma) * np.linalg.solve((np.eye(len(p_pi)) - gamma * p_pi).T, mdp.mu0)
    return d_s[:, None] * pi


def step_occupancy(mdp: TabularMDP, pi: np.ndarray, horizon: int) -> np.ndarray:
    """P(s_t = s, a_t = a) for t < horizon: (H, S, A)."""
    p_pi = np.einsum("sat,sa->st", mdp.P, pi)
    d, out = mdp.mu0.copy(), []
    for _ in range(horizon):
        out.append(d[:, None] * pi)
        d = d @ p_pi
    return np.array(out)


def data_distribution(ds) -> np.ndarray:
    s, a = ds.observations.argmax(1), ds.actions[:, 0].astype(int)
    d = np.zeros((S, A))
    np.add.at(d, (s, a), 1.0)
    return d / d.sum()


CELLS = (np.repeat(np.eye(S), A, 0), np.tile(np.arange(A), S)[:, None])


def test_ratios_equal_the_certainty_equivalent_occupancy_ratio(problem):
    # with one-hot features and no ridge, MWL solves the empirical flow equation exactly
    mdp, pb, pe = problem
    ds = mdp.sample(pb, 2000, horizon=30, seed=0)
    ratios = MarginalRatios(gamma=GAMMA, ridge=0.0).fit(ds, tabular_policy(pe))
    est = ratios.density_ratio(*CELLS).reshape(S, A)
    expected = occupancy(TabularMDP.from_dataset(ds), pe, GAMMA) / data_distribution(ds)
    np.testing.assert_allclose(est, expected, rtol=1e-8)
    assert ratios.diagnostics_["features"] == f"tabular ({S * A})"
    assert abs(ratios.diagnostics_["ratio_mass"] - 1.0) < 1e-6


def test_learned_ratios_converge_to_the_true_ratio(problem):
    mdp, pb, pe = problem
    true_occ = occupancy(mdp, pe, GAMMA)
    errors = {}
    for n in (100, 3000):
        per_seed = []
        for seed in range(3):
            ds = mdp.sample(pb, n, horizon=30, seed=seed)
            d_data = data_distribution(ds)
            est = MarginalRatios(gamma=GAMMA).fit(ds, tabular_policy(pe)).density_ratio(*CELLS).reshape(S, A)
            per_seed.append(float(np.sum(d_data * np.abs(est - true_occ / d_data))))  # E_D |w_hat - w|
        errors[n] = np.mean(per_seed)
    print(f"E_D|w_hat - w|: {errors}")
    assert errors[3000] < 0.05
    assert errors[3000] < errors[100] / 3


def test_time_indexed_ratios_match_per_step_occupancies(problem):
    mdp, pb, pe = problem
    H = 4
    ds = mdp.sample(pb, 20000, horizon=H, seed=3)
    ratios = MarginalRatios(gamma=GAMMA, horizon=H).fit(ds, tabular_policy(pe))
    true_pi, true_b = step_occupancy(mdp, pe, H), step_occupancy(mdp, pb, H)
    for t in range(H):
        # normalised over (s, a, t): gamma^t d_pi,t / K against d_D uniform over the steps
        est = ratios.density_ratio(*CELLS, steps=np.full(S * A, t)).reshape(S, A)
        K = np.sum(GAMMA ** np.arange(H))
        expected = (GAMMA ** t * true_pi[t] / K) / (true_b[t] / H)
        np.testing.assert_allclose(est, expected, rtol=0.15, atol=0.02)
    with pytest.raises(ValueError, match="steps="):
        ratios.density_ratio(*CELLS)


@pytest.mark.parametrize("horizon,gamma", [(None, GAMMA), (5, GAMMA), (5, 1.0)])
def test_marginal_estimators_are_consistent(problem, horizon, gamma):
    mdp, pb, pe = problem
    true = mdp.value(pe, gamma, horizon)
    policy = tabular_policy(pe)
    errors = {name: [] for name in ("MIS", "SNMIS", "MQL", "MDR")}
    for n in (100, 4000):
        ds = mdp.sample(pb, n, horizon=30 if horizon is None else horizon, seed=n)
        ratios = MarginalRatios(gamma=gamma, horizon=horizon).fit(ds, policy)
        for cls in (MarginalIS, SelfNormalizedMarginalIS, MQL):
            res = cls(gamma=gamma, horizon=horizon, interval="t").estimate(ds, policy, ratios=ratios)
            errors[cls.name].append(abs(res.value - true))
        zero_q = QFunction(lambda o, a, *_: np.zeros(len(o)), v=lambda o, *_: np.zeros(len(o)))
        res = MarginalDR(gamma=gamma, horizon=horizon, interval="t").estimate(ds, policy, ratios=ratios, q_function=zero_q)
        errors["MDR"].append(abs(res.value - true))
    for name, (small, large) in errors.items():
        assert large < 0.02 * abs(true), (name, errors)
        assert large < small or small < 0.01 * abs(true), (name, errors)


def test_marginal_dr_is_consistent_with_exact_q_and_wrong_ratios(problem):
    # double robustness: with Q exact, ratios from far too strong a ridge do not bias MDR
    mdp, pb, pe = problem
    H = 5
    q_exact = mdp.q_values(pe, GAMMA, H)  # (H + 1, S, A) by steps to go

    def q(obs, actions, steps_to_go):
        return q_exact[np.asarray(steps_to_go), obs.argmax(1), np.asarray(actions)[:, 0].astype(int)]

    def v(obs, steps_to_go):
        return (q_exact[np.asarray(steps_to_go), obs.argmax(1)] * pe[obs.argmax(1)]).sum(1)

    qf = QFunction(q, v=v)  # plain callables: the steps to go come as their third argument
    ds = mdp.sample(pb, 3000, horizon=H, seed=7)
    bad = MarginalRatios(gamma=GAMMA, horizon=H, ridge=10.0).fit(ds, tabular_policy(pe))
    true = mdp.value(pe, GAMMA, H)
    mis = MarginalIS(gamma=GAMMA, horizon=H, ridge=10.0, interval="t", warn=False).estimate(
        ds, tabular_policy(pe), ratios=bad)
    mdr = MarginalDR(gamma=GAMMA, horizon=H, ridge=10.0, interval="t", warn=False).estimate(
        ds, tabular_policy(pe), ratios=bad, q_function=qf)
    assert abs(mis.value - true) > 0.1 * true  # the ratios are badly wrong ...
    assert abs(mdr.value - true) < 0.02 * true  # ... and MDR is not


def test_interval_covers_the_truth(problem):
    # the delta-method interval includes the ratio fit's error: ~95% coverage over independent data sets
    mdp, pb, pe = problem
    true = mdp.value(pe, GAMMA, 5)
    covered = [MarginalIS(gamma=GAMMA, horizon=5, n_bootstrap=300, random_state=s).estimate(
        mdp.sample(pb, 200, horizon=5, seed=100 + s), tabular_policy(pe)) for s in range(30)]
    rate = np.mean([r.ci_low <= true <= r.ci_high for r in covered])
    assert 0.8 <= rate <= 1.0, rate


def test_evaluate_by_name_shares_one_ratio_fit(problem, monkeypatch):
    mdp, pb, pe = problem
    ds = mdp.sample(pb, 300, horizon=5, seed=0)
    fits = []
    original = MarginalRatios.fit

    def counting(self, *args, **kwargs):
        fits.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MarginalRatios, "fit", counting)
    report = evaluate({"e": tabular_policy(pe), "b": tabular_policy(pb)}, ds, ["MIS", "SNMIS", "MQL", "MDR", "PDIS"],
                      gamma=GAMMA, horizon=5, fqe_params={"n_steps": 50, "hidden_dims": (32, 32), "device": "cpu"}, interval="t")
    assert len(fits) == 2  # one per policy
    frame = report.to_frame().set_index(["policy", "estimator"])
    for name in ("MIS", "SNMIS", "MQL"):
        assert abs(frame.loc[("e", name), "value"] - mdp.value(pe, GAMMA, 5)) < 0.15
        assert frame.loc[("e", name), "ci_low"] < frame.loc[("e", name), "ci_high"]
    assert np.isfinite(frame.loc[("e", "MDR"), "value"])  # on a barely trained FQE: consistent through the ratios
    assert {"MIS", "SNMIS", "MDR", "MQL"} <= set(ESTIMATORS)


def test_continuous_data_use_random_features():
    ds = pendulum_shaped_dataset()
    policy = lambda obs: np.clip(-obs[:, :1], -2, 2)  # noqa: E731  a deterministic continuous policy
    ratios = MarginalRatios(gamma=0.99, n_features=64).fit(ds, policy)
    assert ratios.diagnostics_["features"] == "rff (65)"
    # These transitions are independent random states, so no ratio satisfies the flow equation: SNMIS must say so.
    with pytest.warns(OPEWarning, match="SNMIS: the learned ratios' mass is"):
        res = SelfNormalizedMarginalIS(gamma=0.99, n_features=64, interval="t").estimate(ds, policy, ratios=ratios)
    assert np.isfinite(res.value) and res.ci_low <= res.value <= res.ci_high
    timed = MarginalRatios(gamma=0.99, horizon=50, n_features=64).fit(ds, policy)
    assert timed.features_.weights_.shape[0] == ds.observation_dim + ds.action_dim + 1  # (s, a, t)


def test_estimators_clone_and_refuse_bad_input(problem):
    mdp, pb, pe = problem
    est = MarginalDR(gamma=0.95, horizon=3, q_function="MQL", ridge=1e-3)
    assert sklearn.base.clone(est).get_params() == est.get_params()
    ds = mdp.sample(pb, 50, horizon=5, seed=0)
    with pytest.raises(ValueError, match="pass a horizon"):
        MarginalIS(gamma=1.0).estimate(ds, tabular_policy(pe))
    with pytest.raises(ValueError, match="features"):
        MarginalIS(gamma=0.9, features="fourier").estimate(ds, tabular_policy(pe))
    with pytest.raises(ValueError, match="q_function"):
        MarginalDR(gamma=0.9, q_function="FQE2").estimate(ds, tabular_policy(pe))
    other = mdp.sample(pb, 60, horizon=5, seed=1)
    ratios = MarginalRatios(gamma=0.9).fit(ds, tabular_policy(pe))
    with pytest.raises(ValueError, match="another dataset"):
        MarginalIS(gamma=0.9).estimate(other, tabular_policy(pe), ratios=ratios)


@pytest.mark.parametrize("ridge,transpose", [(0.1, False), (0.1, True), (1e-3, False)])
def test_influence_terms_are_the_derivative_of_the_fit(problem, ridge, transpose):
    # moving episode i's weight by eps changes s'x by eps * (psi_i - V): the delta method, ridge included
    mdp, pb, pe = problem
    ds = mdp.sample(pb, 40, horizon=4, seed=5)
    policy = tabular_policy(pe)
    r = MarginalRatios(gamma=GAMMA, horizon=4, ridge=ridge).fit(ds, policy)
    n = r.n_episodes_
    s_i = r.phi0_ if transpose else r.episode_sums(r.phi_ * r.rewards_[:, None])
    psi = r.influence(s_i, transpose=transpose)
    value = psi.mean()

    def refit(weights):
        wt = weights[r.episode_]  # per transition
        A = (r.delta_ * wt[:, None]).T @ r.phi_ / n
        b = (r.phi0_ * weights[:, None]).mean(0)
        c = (r.phi_ * (r.rewards_ * wt)[:, None]).sum(0) / n
        s_bar = (s_i * weights[:, None]).mean(0)
        P, q = (A.T, c) if transpose else (A, b)
        gram = P.T @ P
        lam = ridge * np.trace(gram) / len(gram)
        return s_bar @ np.linalg.solve(gram + lam * np.eye(len(gram)), P.T @ q)

    eps = 1e-6
    for i in (0, 7, 23):
        w = np.ones(n)
        w += eps * (n * np.eye(n)[i] - 1.0)  # toward episode i, total weight kept
        assert (refit(w) - value) / eps == pytest.approx(psi[i] - value, rel=1e-3, abs=1e-5)


def test_ratios_fitted_for_another_policy_are_refused(problem):
    mdp, pb, pe = problem
    ds = mdp.sample(pb, 50, horizon=5, seed=0)
    ratios = MarginalRatios(gamma=0.9).fit(ds, tabular_policy(pe))
    with pytest.raises(ValueError, match="another policy"):
        MarginalIS(gamma=0.9).estimate(ds, tabular_policy(pb), ratios=ratios)
