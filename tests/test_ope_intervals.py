"""Confidence intervals: each against its closed form, and coverage by simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from offrl.ope import OPEResult, bernstein_interval, bootstrap_interval, confidence_interval, hoeffding_interval, t_interval
from offrl.ope.results import RatioComponents, check_gamma, make_result


def test_t_interval_closed_form_two_sided():
    x = np.array([1.0, 2.0, 4.0, 7.0, 11.0])
    low, high = t_interval(x, alpha=0.1)
    half = stats.t.ppf(0.95, 4) * x.std(ddof=1) / math.sqrt(5)
    assert (low, high) == pytest.approx((x.mean() - half, x.mean() + half), rel=1e-12)
    # not the one-sided quantile t_{1-alpha}
    one_sided = stats.t.ppf(0.9, 4) * x.std(ddof=1) / math.sqrt(5)
    assert high - x.mean() > one_sided * 1.2


def test_hoeffding_closed_form_and_shrinks_with_n():
    rng = np.random.default_rng(0)
    for n in (10, 1000):
        x = rng.uniform(0, 1, n)
        low, high = hoeffding_interval(x, alpha=0.05, bound=(0.0, 2.0))
        half = 2.0 * math.sqrt(math.log(2 / 0.05) / (2 * n))
        assert (low, high) == pytest.approx((x.mean() - half, x.mean() + half), rel=1e-12)
    w10 = np.diff(hoeffding_interval(np.zeros(10), bound=1.0))[0]
    w1000 = np.diff(hoeffding_interval(np.zeros(1000), bound=1.0))[0]
    assert w1000 == pytest.approx(w10 / 10, rel=1e-12)  # width ∝ 1/sqrt(n), never sqrt(n)


def test_bernstein_closed_form():
    x = np.array([0.1, 0.5, 0.2, 0.9, 0.4, 0.3])
    n, alpha = len(x), 0.05
    low, high = bernstein_interval(x, alpha=alpha, bound=(0.0, 1.0))
    log_term = math.log(4 / alpha)
    half = math.sqrt(2 * x.var(ddof=1) * log_term / n) + 7 * 1.0 * log_term / (3 * (n - 1))
    assert (low, high) == pytest.approx((x.mean() - half, x.mean() + half), rel=1e-12)


def test_bootstrap_percentile_closed_form_and_seeded():
    x = np.arange(20, dtype=float) ** 1.5
    a = bootstrap_interval(x, alpha=0.1, n_bootstrap=500, random_state=3)
    b = bootstrap_interval(x, alpha=0.1, n_bootstrap=500, random_state=3)
    assert a == b
    # same counts drawn by hand give the same percentiles
    rng = np.random.default_rng(3)
    counts = rng.multinomial(20, np.full(20, 1 / 20), size=500) / 20
    means = counts @ x
    assert a == pytest.approx(tuple(np.quantile(means, [0.05, 0.95])), rel=1e-12)


def test_interval_input_errors():
    with pytest.raises(ValueError, match="range of the per-sample terms"):
        hoeffding_interval([1.0, 2.0])
    with pytest.raises(ValueError, match="alpha"):
        t_interval([1.0, 2.0], alpha=1.5)
    with pytest.raises(ValueError, match="interval must be one of"):
        confidence_interval([1.0, 2.0], method="wald")
    with pytest.raises(ValueError, match="NaN"):
        t_interval([1.0, np.nan])
    for bad in (0.0, -0.5, 1.01, "x"):
        with pytest.raises(ValueError, match="gamma"):
            check_gamma(bad)
    assert check_gamma(1.0) == 1.0


def test_coverage_by_simulation():
    """2000 datasets of n = 40 Beta(2, 5) samples: each interval covers the mean at (or above, for the
    conservative bounds) the nominal 90%."""
    rng = np.random.default_rng(1)
    reps, n, alpha = 2000, 40, 0.1
    x = rng.beta(2, 5, size=(reps, n))
    mu = 2 / 7
    m = x.mean(1)
    s = x.std(1, ddof=1)
    t_half = stats.t.ppf(1 - alpha / 2, n - 1) * s / math.sqrt(n)
    t_cov = np.mean(np.abs(m - mu) <= t_half)
    se = 1.96 * math.sqrt(0.9 * 0.1 / reps)  # binomial noise of a 90% coverage estimate, ~2 sd
    assert abs(t_cov - 0.9) < 2 * se
    # the library's function on a subset agrees with the vectorised check above
    for i in range(20):
        low, high = t_interval(x[i], alpha)
        assert (low <= mu <= high) == (abs(m[i] - mu) <= t_half[i])
    h_cov = np.mean([hoeffding_interval(row, alpha, (0, 1))[0] <= mu <= hoeffding_interval(row, alpha, (0, 1))[1]
                     for row in x[:500]])
    b_cov = np.mean([bernstein_interval(row, alpha, (0, 1))[0] <= mu <= bernstein_interval(row, alpha, (0, 1))[1]
                     for row in x[:500]])
    assert h_cov >= 0.9 and b_cov >= 0.9
    boot_cov = np.mean([bootstrap_interval(row, alpha, 400, i)[0] <= mu <= bootstrap_interval(row, alpha, 400, i)[1]
                        for i, row in enumerate(x[:400])])
    assert boot_cov > 0.84  # percentile bootstrap undercovers slightly at n = 40


def test_ratio_components_linearisation_and_bootstrap():
    rng = np.random.default_rng(0)
    w = rng.exponential(size=300)
    r = rng.normal(1.0, 1.0, size=300)
    comp = RatioComponents(w * r, w)
    assert comp.value() == pytest.approx((w * r).sum() / w.sum())
    pseudo = comp.pseudo_samples()
    assert pseudo.mean() == pytest.approx(comp.value())
    # the delta-method standard error equals the classic ratio-estimator formula
    v = comp.value()
    se_ratio = math.sqrt(np.sum((w * (r - v)) ** 2)) / w.sum()
    assert pseudo.std(ddof=0) / math.sqrt(300) == pytest.approx(se_ratio, rel=1e-10)
    boot = comp.bootstrap_values(1000, 0)
    assert boot.std() == pytest.approx(se_ratio, rel=0.15)


def test_make_result_fields():
    res = make_result(RatioComponents(np.array([1.0, 2.0, 3.0, 4.0])), "X", interval="t", alpha=0.05)
    assert isinstance(res, OPEResult)
    assert res.value == 2.5 and res.method == "X"
    assert res.std_error == pytest.approx(np.std([1, 2, 3, 4], ddof=1) / 2)
    assert res.ci_low < 2.5 < res.ci_high
    assert res.diagnostics["interval"] == "t" and res.diagnostics["n"] == 4
    assert "X: 2.5" in str(res)
    hoeff = make_result(RatioComponents(np.array([1.0, 2.0])), "X", interval="hoeffding")
    assert "not a guaranteed bound" in hoeff.diagnostics["bound_source"]


def test_self_normalised_interval_undefined_when_one_episode_dominates():
    comp = RatioComponents(np.array([5.0, 0.0, 0.0, 0.0]), np.array([1.0, 0.0, 0.0, 0.0]))
    res = make_result(comp, "WIS", interval="bootstrap", n_bootstrap=100, diagnostics={"ess": 1.0})
    assert res.value == pytest.approx(5.0)
    assert res.ci_low == -math.inf and res.ci_high == math.inf and res.std_error == math.inf
    assert "below 2" in res.diagnostics["interval_note"]
    # resamples that leave out every weighted row have no estimate and are dropped, not counted as 0
    assert np.isnan(comp.bootstrap_values(200, 0)).mean() > 0.2
