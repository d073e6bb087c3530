"""Selection metrics against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from offrl.ope import metrics as M


TRUE = np.array([10.0, 20.0, 30.0, 40.0, 50.0])
EST = np.array([12.0, 35.0, 28.0, 38.0, 30.0])  # ranks 1, 4, 2, 5, 3


def test_errors():
    np.testing.assert_allclose(M.relative_error(EST, TRUE), np.abs(EST - TRUE) / TRUE)
    np.testing.assert_allclose(M.absolute_error(EST, TRUE, normalize=True), np.abs(EST - TRUE) / 40.0)
    assert M.mean_squared_error(EST, TRUE) == pytest.approx(np.mean((EST - TRUE) ** 2))
    assert M.normalized_mse(EST, TRUE) == pytest.approx(np.mean((EST - TRUE) ** 2) / 1600.0)
    with pytest.raises(ValueError, match="true value of 0"):
        M.relative_error([1.0], [0.0])
    with pytest.raises(ValueError, match="5 policies but true_values has 4"):
        M.mean_squared_error(EST, TRUE[:4])


def test_rank_metrics():
    # rank differences d = 0, 2, -1, 1, -2: rho = 1 - 6 * 10 / (5 * 24)
    assert M.spearman_rank_correlation(EST, TRUE) == pytest.approx(0.5)
    # top-1 by estimate is policy 3 (true 40): regret (50 - 40) / (50 - 10)
    assert M.regret_at_k(EST, TRUE, 1) == pytest.approx(0.25)
    assert M.regret_at_k(EST, TRUE, 1, normalize=False) == pytest.approx(10.0)
    # top-2 by estimate: policies 3, 1 (true 40, 20) -> best 40
    assert M.regret_at_k(EST, TRUE, 2) == pytest.approx(0.25)
    assert M.regret_at_k(EST, TRUE, 5) == 0.0
    # top-2 by estimate {3, 1} vs top-2 true {4, 3}
    assert M.precision_at_k(EST, TRUE, 2) == pytest.approx(0.5)
    assert M.precision_at_k(TRUE, TRUE, 3) == 1.0
    assert M.spearman_rank_correlation(TRUE, TRUE) == pytest.approx(1.0)
    assert M.spearman_rank_correlation(-TRUE, TRUE) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="k must be at least 1"):
        M.regret_at_k(EST, TRUE, 0)


def test_safety_errors_and_dicts():
    # threshold 25: truly safe {2, 3, 4}; estimated safe {1, 2, 3, 4}
    errors = M.safety_errors(EST, TRUE, threshold=25.0)
    assert errors["type_i_error_rate"] == 0.0  # no safe policy judged unsafe
    assert errors["type_ii_error_rate"] == pytest.approx(1 / 2)  # policy 1 (true 20) judged safe, of {0, 1}
    errors = M.safety_errors(EST, TRUE, threshold=36.0)  # safe {3, 4}; estimated safe {3}
    assert errors == {"type_i_error_rate": 0.5, "type_ii_error_rate": 0.0}
    names = [f"p{i}" for i in range(5)]
    est = dict(zip(names, EST))
    true = dict(zip(reversed(names), reversed(TRUE)))  # order does not matter for dicts
    row = M.selection_metrics(est, true, k=1, safety_threshold=25.0)
    assert row["spearman"] == pytest.approx(0.5)
    assert row["regret@1"] == pytest.approx(0.25)
    assert row["type_ii_error_rate"] == pytest.approx(0.5)
    assert row["relative_error"] == pytest.approx(np.mean(np.abs(EST - TRUE) / TRUE))


def test_sharpe_ratio_at_k_by_hand():
    # top policies by estimate: 3 (true 40), 1 (true 20), 4 (true 50), 2, 0
    top2 = np.array([40.0, 20.0])
    assert M.sharpe_ratio_at_k(EST, TRUE, 2, behavior_value=25.0) == pytest.approx((40 - 25) / top2.std(ddof=1))
    # top-3 true values 40, 20, 50: best 50, sample std sqrt(((40-110/3)^2 + (20-110/3)^2 + (50-110/3)^2) / 2)
    std3 = np.sqrt(((40 - 110 / 3) ** 2 + (20 - 110 / 3) ** 2 + (50 - 110 / 3) ** 2) / 2)
    assert M.sharpe_ratio_at_k(EST, TRUE, 3, behavior_value=25.0) == pytest.approx((50 - 25) / std3)
    assert M.sharpe_ratio_at_k(EST, TRUE, 3, behavior_value=25.0) == pytest.approx(25 / 15.275252, rel=1e-6)
    # the return over pi_b is clipped at 0; one policy has no spread (ddof=1): nan, as in SCOPE-RL
    assert M.sharpe_ratio_at_k(EST, TRUE, 2, behavior_value=60.0) == 0.0
    assert np.isnan(M.sharpe_ratio_at_k(EST, TRUE, 1, behavior_value=25.0))
    # equal true values among the top k: no risk, an infinite score if they beat pi_b, nan if not
    flat = np.array([5.0, 5.0, 1.0])
    assert M.sharpe_ratio_at_k([3.0, 2.0, 1.0], flat, 2, behavior_value=0.0) == float("inf")
    assert np.isnan(M.sharpe_ratio_at_k([3.0, 2.0, 1.0], flat, 2, behavior_value=9.0))
    row = M.selection_metrics(EST, TRUE, k=2, behavior_value=25.0)
    assert row["sharpe@2"] == pytest.approx((40 - 25) / top2.std(ddof=1))
    assert "sharpe@2" not in M.selection_metrics(EST, TRUE, k=2)
    with pytest.raises(ValueError, match="behavior_value must be finite"):
        M.sharpe_ratio_at_k(EST, TRUE, 2, behavior_value=float("nan"))
