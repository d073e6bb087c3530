"""Distributional OPE on small tabular MDPs whose return distributions are known exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import pendulum_shaped_dataset

from offrl.ope import ModelBased, OPEWarning
from offrl.ope.distributional import (
    DISTRIBUTIONAL_ESTIMATORS,
    CumulativeDistributionDM,
    CumulativeDistributionDR,
    CumulativeDistributionIS,
    CumulativeDistributionSNDR,
    CumulativeDistributionSNIS,
    ReturnDistribution,
    evaluate_distributions,
    exact_return_distribution,
    ks_distance,
)
from offrl.ope.synthetic import TabularMDP, tabular_policy

pytestmark = pytest.mark.usefixtures("one_thread")

GAMMA = 0.9
HORIZON = 3
PI_B = np.array([[0.5, 0.5], [0.6, 0.4], [0.3, 0.7]])
PI_E = np.array([[0.8, 0.2], [0.2, 0.8], [0.5, 0.5]])
SIZES = (200, 5000)
SEEDS = (0, 1, 2)
CONVERGING = (CumulativeDistributionIS, CumulativeDistributionSNIS, CumulativeDistributionDR)


@pytest.fixture(scope="module")
def mdp():
    return TabularMDP.random(n_states=3, n_actions=2, terminal_prob=0.2, seed=1)


@pytest.fixture(scope="module")
def exact(mdp):
    return exact_return_distribution(mdp, PI_E, GAMMA, HORIZON)


@pytest.fixture(scope="module")
def estimates(mdp):
    """(n, seed) -> estimator name -> ReturnDistribution, for the CD estimators on data of pi_b.

    The model of CD-DM / CD-DR is fitted once, on other data: CD-DR is unbiased for any model, and an MLP
    ensemble on one-hot states is a poor one (which CD-DM shows).
    """
    model = ModelBased(gamma=GAMMA, horizon=HORIZON, n_models=2, n_steps=300, hidden_dims=(32,), device="cpu",
                       random_state=0).fit(mdp.sample(PI_B, 500, horizon=HORIZON, seed=99))
    out = {}
    for n in SIZES:
        for seed in SEEDS:
            ds = mdp.sample(PI_B, n, horizon=HORIZON, seed=seed)
            out[(n, seed)] = {cls.name: cls(gamma=GAMMA, horizon=HORIZON, n_bootstrap=40, random_state=seed)
                              .estimate_distribution(ds, tabular_policy(PI_E), model=model)
                              for cls in CONVERGING + (CumulativeDistributionDM,)}
    return out


def test_exact_distribution_matches_the_exact_value(mdp, exact):
    support, probs = exact
    assert np.all(np.diff(support) > 0) and probs.sum() == pytest.approx(1.0)
    assert support @ probs == pytest.approx(mdp.value(PI_E, GAMMA, HORIZON), rel=1e-10)
    with pytest.raises(ValueError, match="reward_noise=0"):
        exact_return_distribution(TabularMDP.random(reward_noise=0.1), np.full((4, 2), 0.5), GAMMA, 2)


def test_statistics_of_an_exact_distribution_match_closed_forms():
    # one state, rewards 0 (action 0) and 1 (action 1), gamma 0.5, two steps: G = a0 + a1 / 2 with a ~ Bernoulli(0.7)
    mdp = TabularMDP(P=np.ones((1, 2, 1)), R=np.array([[0.0, 1.0]]))
    support, probs = exact_return_distribution(mdp, np.array([[0.3, 0.7]]), 0.5, 2)
    np.testing.assert_allclose(support, [0.0, 0.5, 1.0, 1.5])
    np.testing.assert_allclose(probs, [0.09, 0.21, 0.21, 0.49])
    dist = ReturnDistribution.from_probabilities(support, probs, cvar_alpha=0.2)
    np.testing.assert_allclose(dist.cdf, [0.09, 0.30, 0.51, 1.0])
    assert dist.mean() == pytest.approx(1.5 * 0.7)
    assert dist.variance() == pytest.approx(0.7 * 0.3 * (1.0 + 0.25))  # two independent Bernoullis, scaled 1, 1/2
    # the worst 20%: all 9% at 0 and 11% of the 21% at 0.5
    assert dist.cvar() == pytest.approx((0.09 * 0.0 + 0.11 * 0.5) / 0.2)
    assert dist.cvar(0.05) == 0.0 and dist.cvar(1.0) == pytest.approx(dist.mean())
    assert dist.quantile(0.3) == 0.5 and dist.quantile(0.31) == 1.0 and dist.quantile(0.5) == 1.0
    assert dist.interquartile_range() == pytest.approx(1.5 - 0.5)
    # a continuous closed form: U(0, 1) on a fine grid has CVaR_a = a / 2 and interquartile range 1/2
    grid = np.linspace(0.0, 1.0, 10_001)
    uniform = ReturnDistribution(grid, np.linspace(0.0, 1.0, 10_001), "uniform")
    assert uniform.cvar(0.1) == pytest.approx(0.05, abs=1e-3)
    assert uniform.interquartile_range() == pytest.approx(0.5, abs=1e-3)
    assert uniform.variance() == pytest.approx(1 / 12, abs=1e-3)
    with pytest.raises(ValueError, match="non-decreasing"):
        ReturnDistribution([0.0, 1.0], [0.6, 0.4], "bad")


@pytest.mark.parametrize("cls", CONVERGING, ids=lambda c: c.name)
def test_ks_distance_to_the_true_cdf_shrinks_with_n(estimates, exact, cls):
    ks = {n: np.mean([ks_distance(estimates[(n, s)][cls.name], *exact) for s in SEEDS]) for n in SIZES}
    assert ks[5000] < 0.5 * ks[200], ks
    assert ks[5000] < 0.05, ks


def test_dr_corrects_the_models_bias(estimates, exact):
    """The one-hot MLP model is biased (CD-DM stays far off); CD-DR, built on the same model, converges."""
    dm = np.mean([ks_distance(estimates[(5000, s)]["CD-DM"], *exact) for s in SEEDS])
    dr = np.mean([ks_distance(estimates[(5000, s)]["CD-DR"], *exact) for s in SEEDS])
    assert dr < 0.5 * dm, (dr, dm)
    assert estimates[(5000, 0)]["CD-DM"].diagnostics["model_based_terms"] is True


def test_cvar_estimate_approaches_the_exact_cvar(estimates, exact):
    truth = ReturnDistribution.from_probabilities(*exact, cvar_alpha=0.1).cvar()
    for name in ("CD-SNIS", "CD-DR"):
        errors = {n: np.mean([abs(estimates[(n, s)][name].cvar() - truth) for s in SEEDS]) for n in SIZES}
        assert errors[5000] < errors[200] and errors[5000] < 0.03, (name, errors)
        value, low, high = estimates[(5000, 0)][name].statistics["cvar_0.1"]
        assert value == pytest.approx(estimates[(5000, 0)][name].cvar())
        assert low <= truth <= high and high - low < 0.1


def test_distribution_estimates_are_proper_and_reproducible(mdp):
    ds = mdp.sample(PI_B, 300, horizon=HORIZON, seed=5)
    target = tabular_policy(PI_E)
    snis = CumulativeDistributionSNIS(gamma=GAMMA, horizon=HORIZON, n_bootstrap=50, random_state=3)
    first = snis.estimate_distribution(ds, target)
    assert first.cdf[-1] == 1.0 and np.all(np.diff(first.cdf) >= 0) and np.all(np.diff(first.grid) > 0)
    assert set(first.statistics) == {"mean", "variance", "cvar_0.1", "iqr"}
    for value, low, high in first.statistics.values():
        assert low <= high and np.isfinite(value)
    assert first.statistics["mean"][0] == pytest.approx(first.mean())
    again = snis.estimate_distribution(ds, target)
    assert again.statistics == first.statistics and np.array_equal(again.cdf, first.cdf)
    back = json.loads(json.dumps(first.to_dict()))
    assert back["method"] == "CD-SNIS" and back["statistics"]["iqr"]["value"] == first.statistics["iqr"][0]
    assert first.diagnostics["n"] == 300 and 0 < first.diagnostics["ess"] <= 300
    # CD-IS need not end at 1, but stays a CDF within [0, 1]
    is_cdf = CumulativeDistributionIS(gamma=GAMMA, horizon=HORIZON, n_bootstrap=0).estimate_distribution(ds, target)
    assert np.all((0 <= is_cdf.cdf) & (is_cdf.cdf <= 1)) and np.all(np.diff(is_cdf.cdf) >= 0)
    assert np.isnan(is_cdf.statistics["mean"][1])  # no bootstrap, no interval
    # the target equal to the behaviour policy: every weight is 1 and CD-IS is the empirical CDF of the returns
    same = CumulativeDistributionIS(gamma=GAMMA, horizon=HORIZON, n_bootstrap=0).estimate_distribution(
        ds, tabular_policy(PI_B))
    returns = np.add.reduceat(ds.rewards.astype(np.float64) * GAMMA ** ds.timesteps(), ds.episode_starts[:-1])
    points = np.unique(np.round(returns, 9)) + 1e-7  # clear of ties summed in another order
    np.testing.assert_allclose(same.cdf_at(points), [np.mean(returns <= x) for x in points], atol=1e-6)


def test_sndr_is_a_proper_cdf_and_dm_needs_no_weights(mdp):
    ds = mdp.sample(PI_B, 200, horizon=HORIZON, seed=6)
    mb = {"n_models": 2, "n_steps": 50, "hidden_dims": (16,), "device": "cpu"}
    sndr = CumulativeDistributionSNDR(gamma=GAMMA, horizon=HORIZON, n_bootstrap=20, mb_params=mb)
    dist = sndr.estimate_distribution(ds, tabular_policy(PI_E))  # fits its own model
    assert dist.cdf[-1] == 1.0 and dist.diagnostics["model_samples_per_episode"] == 2
    dm = CumulativeDistributionDM(gamma=GAMMA, horizon=HORIZON, n_bootstrap=0, n_rollouts=3, mb_params=mb)
    dm_dist = dm.estimate_distribution(ds.without_behavior_log_probs(), tabular_policy(PI_E))
    assert dm_dist.diagnostics["model_samples_per_episode"] == 6 and "ess" not in dm_dist.diagnostics


def test_evaluate_distributions(mdp):
    ds = mdp.sample(PI_B, 200, horizon=HORIZON, seed=7)
    policies = {"e": tabular_policy(PI_E), "b": tabular_policy(PI_B)}
    out = evaluate_distributions(policies, ds, ["CD-IS", "CumulativeDistributionSNIS"], gamma=GAMMA, horizon=HORIZON,
                                 n_bootstrap=20, cvar_alpha=0.25, behavior_log_probs=ds.behavior_log_probs)
    assert list(out) == ["e", "b"] and list(out["e"]) == ["CD-IS", "CD-SNIS"]
    assert out["b"]["CD-SNIS"].diagnostics["behavior_policy"] == "given"
    assert "cvar_0.25" in out["e"]["CD-IS"].statistics
    assert set(DISTRIBUTIONAL_ESTIMATORS) == {"CD-IS", "CD-SNIS", "CD-DM", "CD-DR", "CD-SNDR"}
    with pytest.raises(ValueError, match="unknown distributional estimator"):
        evaluate_distributions(policies, ds, ["CD-XYZ"], gamma=GAMMA)
    with pytest.raises(ValueError, match="log_ratios has 3 rows"):
        from offrl.ope.behavior import StepLogRatios

        CumulativeDistributionSNIS().estimate_distribution(ds, policies["e"], log_ratios=StepLogRatios(
            np.zeros(3), "given", "discrete"))
    # a target that never takes a logged action: a clear error for the self-normalised CDF, a warning for CD-IS
    only_one = mdp.sample(np.array([[1.0, 0.0]] * 3), 50, horizon=HORIZON, seed=8)
    with pytest.raises(ValueError, match="every trajectory weight is 0"):
        CumulativeDistributionSNIS(gamma=GAMMA).estimate_distribution(only_one, tabular_policy(np.array([[0.0, 1.0]] * 3)))
    with pytest.warns(OPEWarning):
        CumulativeDistributionIS(gamma=GAMMA, n_bootstrap=0).estimate_distribution(
            only_one, tabular_policy(np.array([[0.0, 1.0]] * 3)))


def test_continuous_actions_with_a_model_and_kernel_weights():
    """Pendulum-shaped data logged by a uniform policy on [-2, 2]: the same policy as target gives weights 1, so
    CD-SNIS is the logged returns' own distribution; CD-DR rolls the model out from the logged first actions."""
    from offrl.ope import TargetPolicy
    from offrl.ope.report import logged_value

    ds = pendulum_shaped_dataset(n_episodes=12, length=8)
    rng = np.random.default_rng(0)
    uniform = TargetPolicy("stochastic", log_prob=lambda o, a: np.full(len(o), -np.log(4.0)),
                           sample=lambda o: rng.uniform(-2, 2, size=(len(o), 1)))
    with pytest.warns(OPEWarning, match="policy 'zero': CD-SNIS: the importance weights are dominated"):
        out = evaluate_distributions({"uniform": uniform, "zero": lambda o: np.zeros((len(o), 1))}, ds,
                                     ["CD-SNIS", "CD-DR"], gamma=0.95, n_bootstrap=20,
                                     behavior_log_probs=np.full(ds.n_transitions, -np.log(4.0)),
                                     mb_params={"n_models": 3, "n_steps": 60, "hidden_dims": (16,), "device": "cpu"})
    same = out["uniform"]["CD-SNIS"]
    assert same.mean() == pytest.approx(logged_value(ds, 0.95), rel=1e-6)
    assert same.diagnostics["ess"] == pytest.approx(12)
    dr = out["uniform"]["CD-DR"]
    assert dr.diagnostics["model_samples_per_episode"] == 3 and np.isfinite(dr.mean())
    assert out["zero"]["CD-SNIS"].diagnostics["target_policy"] == "deterministic"  # kernel weights


def test_evaluate_fits_one_model_for_mb_and_the_model_based_cdfs(mdp, monkeypatch):
    """MB and CD-DM in one `evaluate` call share the MB estimator's fit (same model settings); a different
    model setting for MB (here: another random_state) is not shared, and a fitted model can be passed in."""
    from offrl.ope import evaluate

    ds = mdp.sample(PI_B, 60, horizon=HORIZON, seed=9)
    mb = {"n_models": 2, "n_steps": 30, "hidden_dims": (16,), "device": "cpu"}
    fits = []
    real_fit = ModelBased.fit
    monkeypatch.setattr(ModelBased, "fit", lambda self, data: fits.append(self) or real_fit(self, data))
    policy = {"e": tabular_policy(PI_E)}
    report = evaluate(policy, ds, ["MB"], gamma=GAMMA, horizon=HORIZON, n_bootstrap=20, mb_params=mb,
                      distributional=["CD-DM"])
    assert len(fits) == 1
    alone = evaluate_distributions(policy, ds, ["CD-DM"], gamma=GAMMA, horizon=HORIZON, n_bootstrap=20,
                                   mb_params=mb, random_state=0)
    assert len(fits) == 2  # fitted here on its own: the same model, so the same CDF
    np.testing.assert_array_equal(report.distributions["e"]["CD-DM"].cdf, alone["e"]["CD-DM"].cdf)
    with_model = evaluate_distributions(policy, ds, ["CD-DM"], gamma=GAMMA, horizon=HORIZON, n_bootstrap=20,
                                        mb_params=mb, model=fits[0])
    assert len(fits) == 2
    np.testing.assert_array_equal(with_model["e"]["CD-DM"].cdf, alone["e"]["CD-DM"].cdf)
    other = ModelBased(gamma=GAMMA, horizon=HORIZON, random_state=1, **mb)
    evaluate(policy, ds, [other], gamma=GAMMA, horizon=HORIZON, n_bootstrap=20, mb_params=mb, distributional="CD-DM")
    assert len(fits) == 4  # MB's own model (random_state 1) and CD-DM's (random_state 0)
    with pytest.raises(ValueError, match="model must be a fitted"):
        evaluate_distributions(policy, ds, ["CD-DM"], gamma=GAMMA, horizon=HORIZON, model=ModelBased())
