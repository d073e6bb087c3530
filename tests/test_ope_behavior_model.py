"""The estimated behaviour policy (issue 11, point 5): box-respecting mixture density, cross-fitting, held-out fit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from offrl import Dataset
from offrl.ope import BehaviorPolicy, WeightedIS
from offrl.ope.behavior import estimate_behavior

pytestmark = pytest.mark.usefixtures("one_thread")

LOW, HIGH = -2.0, 2.0
FAST = dict(n_steps=1000)


def _episodes(actions_of, n_episodes: int, length: int, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    episodes = []
    for i in range(n_episodes):
        s = rng.normal(size=(length + 1, 2)).astype(np.float32)
        a = actions_of(i, s[:-1], rng).astype(np.float32)
        episodes.append({"observations": s, "actions": a, "rewards": np.zeros(length),
                         "truncations": np.r_[np.zeros(length - 1), 1].astype(bool)})
    return Dataset.from_episodes(episodes, action_low=LOW, action_high=HIGH)


def _saturating(s: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A tanh-Gaussian policy that pushes against the upper bound, as a trained SAC actor does."""
    return HIGH * np.tanh(1.5 + 0.5 * s[:, :1] + 0.3 * rng.normal(size=(len(s), 1)))


def _mixture_actions(i: int, s: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Episodes 0-19: the saturating policy; 20-39: uniform in the box (two logs concatenated, like medium-expert)."""
    return _saturating(s, rng) if i % 40 < 20 else rng.uniform(LOW, HIGH, size=(len(s), 1))


def _mixture_log_density(s: np.ndarray, a: np.ndarray) -> np.ndarray:
    """log p(a|s) of the 50/50 mixture: the best any model of pi_b(a|s) can do on held-out rows."""
    u = np.clip(a[:, 0] / HIGH, -1 + 1e-12, 1 - 1e-12)
    x = np.arctanh(u)
    z = (x - (1.5 + 0.5 * s[:, 0])) / 0.3
    log_sat = -0.5 * z ** 2 - math.log(0.3) - 0.5 * math.log(2 * math.pi) - np.log1p(-u) - np.log1p(u) - math.log(HIGH)
    return np.logaddexp(log_sat, -math.log(HIGH - LOW)) - math.log(2.0)


@pytest.fixture(scope="module")
def mixture():
    return _episodes(_mixture_actions, 40, 50, seed=0), _episodes(_mixture_actions, 40, 50, seed=1)


@pytest.fixture(scope="module")
def fitted(mixture):
    train, _ = mixture
    old = BehaviorPolicy(density="gaussian", n_components=1, n_folds=1, **FAST).fit(train)
    new = BehaviorPolicy(**FAST).fit(train)
    return old, new


def _box_mass(model: BehaviorPolicy, obs: np.ndarray) -> np.ndarray:
    """Integral of pi_b(a|s) over the box, by the trapezoid rule in a on a grid that crowds at the bounds."""
    a = HIGH * np.tanh(np.linspace(-9.0, 9.0, 4001))[:, None]
    mass = []
    for o in obs:
        density = np.exp(model.log_prob(np.repeat(o[None], len(a), 0), a))
        mass.append(np.trapezoid(density, a[:, 0]))
    return np.array(mass)


def test_old_default_loses_mass_outside_the_box_and_new_default_does_not(fitted):
    """Fault: the old Gaussian puts probability outside [low, high]; the default density integrates to 1 inside."""
    old, new = fitted
    obs = np.array([[2.0, 0.0], [0.0, 0.0], [-2.0, 1.0]], np.float32)
    old_mass = _box_mass(old, obs)
    assert old_mass.min() < 0.9, old_mass  # the reproduction: mass missing from the box
    np.testing.assert_allclose(_box_mass(new, obs), 1.0, atol=0.01)
    assert BehaviorPolicy().density == "auto" and new.density_ == "tanh"


def test_default_models_mixture_data_better_on_held_out_rows(mixture, fitted):
    """Fault: one Gaussian misses the mixture; the default mixture comes close to the true log-likelihood."""
    _, fresh = mixture
    old, new = fitted
    best = _mixture_log_density(fresh.observations, fresh.actions).mean()
    old_ll = old.log_prob(fresh.observations, fresh.actions).mean()
    new_ll = new.log_prob(fresh.observations, fresh.actions).mean()
    assert new_ll > old_ll + 0.5, (old_ll, new_ll, best)
    assert new_ll > best - 0.15, (new_ll, best)
    # the cross-fitted held-out figure estimates the fold models' log-likelihood on fresh data (their average,
    # which `log_prob` uses, does a little better)
    per_fold = np.mean([new._log_prob_with(m, fresh.observations, fresh.actions).mean() for m in new.models_])
    assert new.heldout_log_likelihood_ == pytest.approx(per_fold, abs=0.1)
    assert new_ll > per_fold
    assert new.heldout_log_likelihood_per_dim_ == new.heldout_log_likelihood_


def test_in_sample_scores_overstate_pi_b_and_cross_fitting_does_not():
    """Fault: scoring the rows a flexible model was fitted on beats the true density, which no honest score can.

    Actions are uniform in the box whatever the state, so log pi_b = -log 4 on every row and, by Gibbs'
    inequality, no model's held-out mean log-likelihood exceeds it (up to noise).
    """
    uniform = _episodes(lambda i, s, rng: rng.uniform(LOW, HIGH, size=(len(s), 1)), 30, 8, seed=3)
    true_ll = -math.log(HIGH - LOW)
    params = dict(n_components=5, n_steps=800, lr=3e-3)
    in_sample = BehaviorPolicy(n_folds=1, **params).logged_log_probs(uniform).mean()
    model = BehaviorPolicy(**params)
    cross_fitted = model.logged_log_probs(uniform)
    assert in_sample > true_ll + 0.1, in_sample  # the reproduction: in-sample scores overstate pi_b(a|s)
    assert cross_fitted.mean() < true_ll
    assert model.heldout_log_likelihood_ == pytest.approx(cross_fitted.mean())
    assert model.insample_log_likelihood_ > model.heldout_log_likelihood_ + 0.2


def test_cross_fitting_scores_each_row_with_the_model_that_did_not_see_it(mixture):
    train, _ = mixture
    model = BehaviorPolicy(n_folds=3, n_steps=300).fit(train)
    folds = model.folds_
    assert set(np.unique(folds)) == {0, 1, 2} and len(model.models_) == 3
    for start, end in zip(train.episode_starts[:-1], train.episode_starts[1:]):
        assert len(np.unique(folds[start:end])) == 1  # folds are whole episodes
    for k, fold_model in enumerate(model.models_):
        rows = folds == k
        expected = model._log_prob_with(fold_model, train.observations[rows], train.actions[rows])
        np.testing.assert_array_equal(model.logged_log_probs_[rows], expected)
    # the same data again: the stored out-of-fold values, not a refit or in-sample scores
    np.testing.assert_array_equal(model.logged_log_probs(train), model.logged_log_probs_)
    # other data: every row is held out, scored by the fold models' average density
    other = _episodes(_mixture_actions, 4, 10, seed=7)
    per_model = np.stack([model._log_prob_with(m, other.observations, other.actions) for m in model.models_])
    np.testing.assert_allclose(model.logged_log_probs(other),
                               np.log(np.exp(per_model).mean(0)), rtol=1e-9)
    # too few episodes for the folds: contiguous blocks of rows
    one = _episodes(_mixture_actions, 1, 40, seed=8)
    blocks = BehaviorPolicy(n_steps=50).fit(one).folds_
    np.testing.assert_array_equal(blocks, np.repeat([0, 1], 20))


def test_actions_on_the_bound_and_parameters():
    on_bound = _episodes(lambda i, s, rng: np.where(rng.random((len(s), 1)) < 0.3, HIGH,
                                                   rng.uniform(LOW, HIGH, size=(len(s), 1))), 10, 20, seed=4)
    model = BehaviorPolicy(n_steps=200).fit(on_bound)
    assert np.all(np.isfinite(model.logged_log_probs_))  # clipped to the open box, not -inf / nan
    assert np.isfinite(model.log_prob(np.zeros((2, 2)), np.array([[LOW], [HIGH]]))).all()
    unbounded = Dataset.from_arrays(np.zeros((20, 2)), np.random.default_rng(0).normal(size=(20, 1)), np.zeros(20),
                                    terminals=np.ones(20))
    with pytest.raises(ValueError, match="action_low / action_high"):
        BehaviorPolicy(density="tanh", n_steps=10).fit(unbounded)
    auto = BehaviorPolicy(n_steps=10).fit(unbounded)
    assert auto.density_ == "gaussian" and "tanh" not in auto.description
    for bad, match in ((dict(density="beta"), "density must be one of"), (dict(n_folds=0), "n_folds"),
                       (dict(n_components=0), "n_components"), (dict(bound_eps=0.0), "bound_eps")):
        with pytest.raises(ValueError, match=match):
            BehaviorPolicy(n_steps=10, **bad).fit(on_bound)
    old = BehaviorPolicy(density="gaussian", n_components=1, n_folds=1, n_steps=10).fit(on_bound)
    assert old.description == "estimated (Gaussian BC)" and old.heldout_log_likelihood_ is None
    assert old.fit_diagnostics() == {"behavior_n_folds": 1, "behavior_insample_loglik": old.insample_log_likelihood_}


def test_estimate_behavior_reports_the_fit(mixture):
    train, _ = mixture
    fit = estimate_behavior(train, BehaviorPolicy(n_steps=200))
    assert fit.description.startswith("estimated (3-component tanh-Gaussian-mixture BC, 2-fold cross-fitted; "
                                      "held-out log-likelihood ")
    assert set(fit.diagnostics) == {"behavior_n_folds", "behavior_insample_loglik", "behavior_heldout_loglik"}
    assert fit.diagnostics["behavior_heldout_loglik"] == pytest.approx(fit.log_probs.mean())
    result = WeightedIS(gamma=1.0, interval="t", warn=False).estimate(train, lambda o: np.zeros((len(o), 1)),
                                                                   behavior=BehaviorPolicy(n_steps=200))
    assert "held-out log-likelihood" in result.diagnostics["behavior_policy"]


def test_discrete_cross_fitting_keeps_actions_a_fold_never_saw():
    """An action logged in one episode only: the other fold's classifier must not call it impossible."""
    def actions(i, s, rng):
        return np.full((len(s), 1), 2 if i == 0 else i % 2)

    rng = np.random.default_rng(0)
    episodes = []
    for i in range(6):
        s = rng.normal(size=(6, 2)).astype(np.float32)
        episodes.append({"observations": s, "actions": actions(i, s[:-1], rng), "rewards": np.zeros(5),
                         "truncations": np.r_[np.zeros(4), 1].astype(bool)})
    ds = Dataset.from_episodes(episodes, discrete_actions=3)
    model = BehaviorPolicy().fit(ds)
    assert np.all(np.isfinite(model.logged_log_probs_))
    assert model.description.startswith("estimated (LogisticRegression classifier, 2-fold cross-fitted; held-out")
    np.testing.assert_allclose(model.predict_proba(ds.observations).sum(1), 1.0)
