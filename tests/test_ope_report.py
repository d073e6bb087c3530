"""evaluate / OPEReport / benchmark / the `offrl ope` command, end to end on small problems."""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pytest

from offrl import Dataset
from offrl.ope import OPEReport, OPEResult, OPEWarning, TargetPolicy, benchmark, evaluate
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


@pytest.fixture(scope="module")
def tabular_report():
    mdp = TabularMDP.random(n_states=3, n_actions=2, terminal_prob=0.3, seed=1)
    pi_b = np.array([[0.5, 0.5], [0.6, 0.4], [0.3, 0.7]])
    ds = mdp.sample(pi_b, 300, seed=0)
    rng = np.random.default_rng(0)
    tables = {f"p{i}": rng.dirichlet(np.ones(2), size=3) for i in range(4)}
    true = {k: mdp.value(v, GAMMA) for k, v in tables.items()}
    report = evaluate({k: tabular_policy(v) for k, v in tables.items()}, ds,
                      estimators=["FQE", "IS", "WPDIS", "DR"], gamma=GAMMA, true_values=true, n_bootstrap=200,
                      fqe_params=dict(n_steps=300, hidden_dims=(32, 32), n_critics=2, lr=1e-3, device="cpu"))
    return report, true


def test_report_frame_metrics_and_selection(tabular_report, tmp_path):
    report, true = tabular_report
    frame = report.to_frame()
    assert len(frame) == 16
    for column in ("policy", "estimator", "value", "std_error", "ci_low", "ci_high", "true_value", "covered", "ess"):
        assert column in frame.columns
    assert (frame.ci_low <= frame.value).all() and (frame.value <= frame.ci_high).all()
    assert frame.loc[frame.estimator == "IS", "behavior_policy"].eq("logged").all()
    metrics = report.metrics()
    assert list(metrics.index) == ["FQE", "IS", "WPDIS", "DR"]
    for column in ("relative_error", "normalized_mse", "spearman", "regret@1", "precision@1", "coverage"):
        assert column in metrics.columns
    best_by_dr = max(true, key=lambda p: report.results[p]["DR"].value)
    assert report.select(1, by="DR") == [best_by_dr]
    assert report.select(2) == sorted(true, key=lambda p: -report.results[p]["FQE"].value)[:2]
    assert len(report.select(10, by="IS", criterion="ci_low")) == 4
    report.to_csv(tmp_path / "e.csv")
    back = pd.read_csv(tmp_path / "e.csv")
    assert list(back.columns) == list(frame.columns) and len(back) == 16


def test_html_is_self_contained(tabular_report, tmp_path):
    report, _ = tabular_report
    report.to_html(tmp_path / "r.html")
    text = (tmp_path / "r.html").read_text()
    assert text.count("data:image/png;base64,") == 2  # estimates with intervals, estimated vs true
    assert "Spearman" in text and "<table" in text
    # nothing is fetched from the network: no external src/href at all
    assert not re.search(r"""(src|href)\s*=\s*['"]?(https?:)?//""", text)
    assert "<script" not in text
    plain = OPEReport({"a": {"X": OPEResult(1.0, 0.1, 0.8, 1.2, "X")}})
    plain.to_html(tmp_path / "plain.html")
    assert (tmp_path / "plain.html").read_text().count("data:image/png;base64,") == 1
    with pytest.raises(ValueError, match="true values"):
        plain.metrics()


def test_evaluate_refuses_bad_input(tabular_report):
    ds = TabularMDP.random(n_states=3, n_actions=2, terminal_prob=0.3, seed=1).sample(np.full((3, 2), 0.5), 20, seed=0)
    pol = {"a": tabular_policy(np.full((3, 2), 0.5))}
    with pytest.raises(ValueError, match="gamma"):
        evaluate(pol, ds, ["IS"], gamma=1.2)
    with pytest.raises(ValueError, match="unknown estimator"):
        evaluate(pol, ds, ["XYZ"])
    with pytest.raises(ValueError, match="policies is empty"):
        evaluate({}, ds, ["IS"])
    with pytest.raises(ValueError, match="interval must be one of"):
        evaluate(pol, ds, ["IS"], interval="wald")


def _pendulum_dataset(n_episodes: int = 8, length: int = 15, seed: int = 0) -> Dataset:
    import gymnasium as gym

    env = gym.make("Pendulum-v1")
    rng = np.random.default_rng(seed)
    episodes = []
    for i in range(n_episodes):
        obs, _ = env.reset(seed=seed + i)
        o, a, r = [obs], [], []
        for _ in range(length):
            act = rng.uniform(-2, 2, size=1).astype(np.float32)
            obs, rew, *_ = env.step(act)
            o.append(obs), a.append(act), r.append(rew)
        episodes.append({"observations": np.array(o), "actions": np.array(a), "rewards": np.array(r),
                         "truncations": np.array([False] * (length - 1) + [True]),
                         "behavior_log_probs": np.full(length, -math.log(4.0))})
    return Dataset.from_episodes(episodes, action_low=-2.0, action_high=2.0, metadata={"name": "tiny-pendulum"})


@pytest.mark.filterwarnings("ignore::offrl.ope.OPEWarning")
def test_benchmark_harness_on_pendulum():
    from offrl.algos import BC

    ds = _pendulum_dataset()
    bc = BC(n_steps=30, device="cpu", random_state=0).fit(ds, progress=False)
    rng = np.random.default_rng(0)
    uniform = TargetPolicy("stochastic", log_prob=lambda o, a: np.full(len(o), -math.log(4.0)),
                           sample=lambda o: rng.uniform(-2, 2, size=(len(o), 1)))
    report = benchmark("Pendulum-v1", ds, {"bc": bc, "uniform": uniform, "zero": lambda o: np.zeros((len(o), 1))},
                       gamma=0.95, n_rollouts=3, estimators=["FQE", "WIS", "PDIS"], horizon=15,
                       fqe_params={"n_steps": 50, "hidden_dims": (32, 32), "device": "cpu"}, n_bootstrap=100)
    assert set(report.true_values) == {"bc", "uniform", "zero"}
    assert all(v < 0 for v in report.true_values.values())  # pendulum rewards are costs
    metrics = report.metrics()
    assert set(metrics.index) == {"FQE", "WIS", "PDIS"}
    assert "true_value_std_error" in report.metadata
    frame = report.to_frame()
    # the uniform target equals the behaviour policy: all importance weights are 1
    uni = frame[(frame.policy == "uniform") & (frame.estimator == "WIS")].iloc[0]
    assert uni.ess == pytest.approx(ds.n_episodes) and uni.target_policy == "stochastic"
    assert frame[(frame.policy == "bc") & (frame.estimator == "WIS")].iloc[0].target_policy == "deterministic"


@pytest.mark.filterwarnings("ignore::offrl.ope.OPEWarning")
def test_cli_ope(tmp_path, capsys):
    from offrl.algos import BC
    from offrl.cli import main

    ds = _pendulum_dataset()
    ds.save(tmp_path / "data.npz")
    for name, steps in (("a", 10), ("b", 40)):
        BC(n_steps=steps, device="cpu", random_state=0).fit(ds, progress=False).save(tmp_path / f"{name}.pt")
    out = tmp_path / "out"
    code = main(["ope", "--dataset", str(tmp_path / "data.npz"), "--policy", f"a={tmp_path / 'a.pt'}",
                 "--policy", f"b={tmp_path / 'b.pt'}", "--estimators", "FQE,WIS", "PDIS", "--fqe-steps", "30",
                 "--gamma", "0.95", "--env", "Pendulum-v1", "--true-values", "--n-rollouts", "2", "--horizon", "15",
                 "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "spearman" in printed and "report.html" in printed
    frame = pd.read_csv(out / "estimates.csv")
    assert set(frame.estimator) == {"FQE", "WIS", "PDIS"} and set(frame.policy) == {"a", "b"}
    assert (out / "report.html").exists() and (out / "metrics.csv").exists()
    assert main(["ope", "--dataset", str(tmp_path / "data.npz"), "--policy", f"a={tmp_path / 'a.pt'}",
                 "--true-values", "--out", str(out)]) == 2
    assert "--true-values needs --env" in capsys.readouterr().err
    assert main(["ope", "--dataset", str(tmp_path / "data.npz"), "--policy", f"a={tmp_path / 'missing.pt'}",
                 "--out", str(out)]) == 2


def test_evaluate_warns_once_per_policy_on_unsupported_actions():
    mdp = TabularMDP.random(n_states=3, n_actions=2, terminal_prob=0.3, seed=1)
    ds = mdp.sample(np.array([[1.0, 0.0]] * 3), 30, seed=0)  # action 1 is never logged
    with pytest.warns(OPEWarning, match=r"policy 'b'.*never take \(\[1\]\).*effective sample size") as caught:
        report = evaluate({"a": tabular_policy(np.array([[1.0, 0.0]] * 3)), "b": tabular_policy(np.full((3, 2), 0.5))},
                          ds, ["IS", "WIS"], gamma=GAMMA, n_bootstrap=50)
    assert sum(issubclass(w.category, OPEWarning) for w in caught) == 1
    assert "warning" in report.to_frame().columns


@pytest.mark.filterwarnings("ignore::offrl.ope.OPEWarning")
def test_report_shows_the_behaviour_models_held_out_log_likelihood(tmp_path):
    """An estimated pi_b: its held-out log-likelihood is in the results, the CSV, the text summary and the HTML."""
    from offrl.ope import BehaviorPolicy

    ds = _pendulum_dataset().without_behavior_log_probs()
    rng = np.random.default_rng(0)
    uniform = TargetPolicy("stochastic", log_prob=lambda o, a: np.full(len(o), -math.log(4.0)),
                           sample=lambda o: rng.uniform(-2, 2, size=(len(o), 1)))
    behavior = BehaviorPolicy(n_steps=200)
    report = evaluate({"uniform": uniform, "zero": lambda o: np.zeros((len(o), 1))}, ds, ["WIS", "PDIS"],
                      gamma=0.95, behavior=behavior, n_bootstrap=50)
    heldout = behavior.heldout_log_likelihood_
    assert heldout is not None and math.isfinite(heldout)
    for per_policy in report.results.values():
        for result in per_policy.values():
            assert result.diagnostics["behavior_heldout_loglik"] == heldout
            assert result.diagnostics["behavior_insample_loglik"] == behavior.insample_log_likelihood_
    frame = report.to_frame()
    assert (frame.behavior_heldout_loglik == heldout).all()
    report.to_csv(tmp_path / "e.csv")
    assert pd.read_csv(tmp_path / "e.csv").behavior_heldout_loglik.tolist() == pytest.approx([heldout] * len(frame))
    shown = f"held-out log-likelihood {heldout:.4g} nats per transition"
    assert shown in report.metadata["behaviour policy"]
    text = str(report)
    assert "behaviour policy: estimated (3-component tanh-Gaussian-mixture BC, 2-fold cross-fitted" in text
    assert shown in text and f"in-sample {behavior.insample_log_likelihood_:.4g}" in text
    report.to_html(tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "<b>behaviour policy</b>" in page and shown in page and "behavior_heldout_loglik" in page
    # logged propensities: said so, and no log-likelihood columns
    logged = evaluate({"uniform": uniform}, _pendulum_dataset(), ["WIS"], gamma=0.95, n_bootstrap=50)
    assert "behavior_heldout_loglik" not in logged.to_frame().columns
    assert str(logged).endswith("behaviour policy: logged")


def test_evaluate_passes_weight_bound_and_knows_class_names():
    mdp = TabularMDP.random(n_states=3, n_actions=2, terminal_prob=0.3, seed=1)
    pi_b = np.array([[0.5, 0.5], [0.6, 0.4], [0.3, 0.7]])
    ds = mdp.sample(pi_b, 100, seed=0)
    target = tabular_policy(np.array([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]]))
    common = dict(gamma=GAMMA, interval="hoeffding", reward_bound=(-1.0, 1.0))
    given = evaluate({"p": target}, ds, estimators=["IS", "WeightedIS"], weight_bound=1e6, **common)
    observed = evaluate({"p": target}, ds, estimators=["IS"], **common)
    assert given.results["p"]["IS"].diagnostics["weight_bound_source"] == "given"
    assert "WIS" in given.results["p"]
    assert "observed" in observed.results["p"]["IS"].diagnostics["weight_bound_source"]
    assert "weight_bound_source" in given.to_frame().columns
    with pytest.raises(ValueError, match="unknown estimator"):
        evaluate({"p": target}, ds, estimators=["NoSuchEstimator"], gamma=GAMMA)
    by_class = evaluate({"p": target}, ds, estimators=["ModelBased"], gamma=GAMMA, horizon=3,
                        mb_params={"n_models": 2, "n_steps": 3, "hidden_dims": (8,)})
    assert len(by_class.results["p"]["MB"].diagnostics["member_values"]) == 2  # mb_params reached it


def _safe_and_risky():
    """One step from two equally likely states: 'safe' always earns 0.5; 'risky' earns 3 or -0.5 (mean 1.25)."""
    from offrl.ope.distributional import evaluate_distributions

    mdp = TabularMDP(P=np.full((2, 2, 2), 0.5), R=np.array([[0.5, 3.0], [0.5, -0.5]]))
    ds = mdp.sample(np.full((2, 2), 0.5), 400, horizon=1, seed=0)
    policies = {"safe": tabular_policy(np.array([[1.0, 0.0], [1.0, 0.0]])),
                "risky": tabular_policy(np.array([[0.0, 1.0], [0.0, 1.0]]))}
    report = evaluate(policies, ds, ["WIS"], gamma=GAMMA, horizon=1, n_bootstrap=200)
    distributions = evaluate_distributions(policies, ds, ["CD-SNIS"], gamma=GAMMA, horizon=1, cvar_alpha=0.2,
                                           n_bootstrap=200)
    return report, distributions


def test_select_by_cvar_prefers_the_safe_policy(tmp_path):
    plain, distributions = _safe_and_risky()
    report = OPEReport(plain.results, metadata=plain.metadata, distributions=distributions)
    assert report.select(1, by="WIS") == ["risky"]  # the higher mean
    assert report.select(1, by="WIS", risk="lcb") == ["risky"]  # its lower bound still beats 0.5
    assert report.select(1, risk="cvar") == ["safe"]  # its worst 20% earn 0.5, the risky policy's -0.5
    assert report.select(2, risk="cvar", criterion="ci_low") == ["safe", "risky"]
    cvar = report.distribution_estimates("CD-SNIS", "cvar")
    assert cvar["safe"] == pytest.approx(0.5) and cvar["risky"] == pytest.approx(-0.5)
    frame = report.distribution_frame()
    assert list(frame.columns) == ["policy", "estimator", "statistic", "value", "ci_low", "ci_high"]
    assert len(frame) == 8 and set(frame.statistic) == {"mean", "variance", "cvar_0.2", "iqr"}
    mean = frame[(frame.policy == "risky") & (frame.statistic == "mean")].iloc[0]
    assert mean.ci_low < 1.25 < mean.ci_high
    with pytest.raises(ValueError, match="distributions=..."):
        plain.select(risk="cvar")
    with pytest.raises(ValueError, match="no return distributions in this report"):
        report.select(risk="cvar", by="WIS")
    with pytest.raises(ValueError, match="risk must be"):
        report.select(risk="variance")
    with pytest.raises(ValueError, match="that the results lack"):
        OPEReport(plain.results, distributions={"other": distributions["safe"]})
    # the page: the CDF figure (one per distributional estimator) and the table of risk measures
    report.to_html(tmp_path / "r.html")
    text = (tmp_path / "r.html").read_text()
    assert text.count("data:image/png;base64,") == 2  # the estimates, then CD-SNIS's CDFs
    assert "Figure 2. The cumulative distribution function of each policy" in text
    assert "Return distributions" in text and "CVaR 20%" in text and "interquartile range" in text
    assert "Return distributions" in report.section_html() and "Return distributions" not in plain.section_html()


def test_metrics_add_sharpe_ratio_when_the_data_value_is_known():
    results = {p: {"X": OPEResult(v, 0.1, v - 0.2, v + 0.2, "X")} for p, v in (("a", 3.0), ("b", 2.0), ("c", 1.0))}
    true = {"a": 1.0, "b": 4.0, "c": 2.0}
    report = OPEReport(results, true_values=true, k=2, metadata={"data value": 1.5})
    # top-2 by estimate: a, b (true 1, 4): (4 - 1.5) / std([1, 4], ddof=1)
    assert report.metrics().loc["X", "sharpe@2"] == pytest.approx(2.5 / np.std([1.0, 4.0], ddof=1))
    assert "sharpe@2" not in OPEReport(results, true_values=true, k=2).metrics().columns
