"""OPE in sweeps (`offrl sweep CONFIG --ope FQE,DR`): estimates for every trained policy, added to finished runs
without training them again, and the report's OPE-based selection.  Real BC runs on a recorded Pendulum-v1
dataset, run in this process."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy.stats import spearmanr

from conftest import random_pendulum_npz
from offrl import Dataset
from offrl.cli import build_parser, main as cli_main
from offrl.report import ope_selection, results_frame, write_report
from offrl.sweep import ConfigError, expand_runs, load_config, ope_missing, parse_config, run_sweep

# Deterministic BC against uniform-random logging: the importance weights are degenerate, and the OPE says so.
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::offrl.ope.OPEWarning")]

FQE_PARAMS = {"n_steps": 200, "hidden_dims": [32, 32], "batch_size": 64}  # FQE's default is 20,000 steps
LRS = [0.003, 0.001, 0.0003]


@pytest.fixture(scope="module")
def pendulum_npz(tmp_path_factory) -> Path:
    """4 recorded Pendulum-v1 episodes of uniform-random actions on [-2, 2], with their logged behaviour
    log-probabilities (-log 4): IS and DR then need no fitted behaviour model (seconds per run)."""
    folder = tmp_path_factory.mktemp("data")
    data = Dataset.load(random_pendulum_npz(folder / "random.npz", n_episodes=4))
    episodes = [{**episode, "behavior_log_probs": np.full(len(episode["actions"]), -math.log(4.0))}
                for episode in data]
    logged = Dataset.from_episodes(episodes, action_low=-2.0, action_high=2.0, metadata=data.metadata)
    logged.save(folder / "pendulum.npz")
    return folder / "pendulum.npz"


def write_config(path: Path, data: Path, lrs: list[float], steps: int, env: str | None = "auto",
                 ope: dict | None = None) -> Path:
    """BC with one grid point per learning rate, seed 0; `env` None trains without any evaluation."""
    config = {"name": "ope", "datasets": [{"spec": str(data), "label": "pendulum"}],
              "algorithms": {"BC": {"lr": lrs, "hidden_dims": [32, 32], "batch_size": 64}},
              "seeds": [0], "steps": steps, "eval": {"every": steps // 2, "episodes": 2, "env": env},
              "log_every": 50, "ope": ope or {"rollouts": 2, "fqe_params": FQE_PARAMS}}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _run_files(out: Path) -> dict[str, int]:
    """mtime of every training output (model, logs, checkpoint) of every run."""
    names = ("model.pt", "train.csv", "eval.csv", "checkpoint.pt")
    return {str(p): p.stat().st_mtime_ns for name in names for p in out.glob(f"runs/**/{name}")}


def _results(out: Path) -> dict[str, dict]:
    return {p.parent.parent.name: json.loads(p.read_text()) for p in out.glob("runs/**/result.json")}


@pytest.fixture(scope="module")
def ope_sweep(pendulum_npz, tmp_path_factory):
    """Three BC runs swept with `--ope FQE,DR`, then again with `--ope FQE,DR,WPDIS`: the results, printed
    output and training-file times after each, the OPE estimators computed and the models built in the second."""
    root = tmp_path_factory.mktemp("sweep")
    config = write_config(root / "sweep.yaml", pendulum_npz, LRS, steps=100)
    out = root / "out"
    argv = ["sweep", str(config), "--workers", "1", "--out", str(out), "--no-progress"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        first_code = cli_main(argv + ["--ope", "FQE,DR"])
    first, first_files = _results(out), _run_files(out)

    import offrl.ope
    import offrl.sweep

    asked, built = [], []
    evaluate, make_algorithm = offrl.ope.evaluate, offrl.sweep._make_algorithm
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()):
        patch.setattr(offrl.ope, "evaluate", lambda policies, dataset, estimators, *a, **k:
                      asked.append(list(estimators)) or evaluate(policies, dataset, estimators, *a, **k))
        patch.setattr(offrl.sweep, "_make_algorithm", lambda run: built.append(run["dir"]) or make_algorithm(run))
        second_code = cli_main(argv + ["--ope", "FQE,DR,WPDIS"])
    return {"config": config, "out": out, "codes": (first_code, second_code), "printed": printed.getvalue(),
            "first": first, "first_files": first_files, "second": _results(out), "second_files": _run_files(out),
            "asked": asked, "built": built}


def test_every_trained_policy_gets_the_requested_estimates_and_its_true_value(ope_sweep):
    assert ope_sweep["codes"] == (0, 0)
    first = ope_sweep["first"]
    assert len(first) == 3 and all(r["status"] == "ok" for r in first.values())
    for result in first.values():
        ope = result["ope"]
        assert set(ope) == {"FQE", "DR", "true_value", "settings"}
        for name in ("FQE", "DR"):
            assert np.isfinite(ope[name]["value"]) and ope[name]["ci_low"] <= ope[name]["value"] <= ope[name]["ci_high"]
        assert np.isfinite(ope["true_value"]) and ope["true_value"] < 0  # Pendulum's rewards are all <= 0
        assert ope["settings"] == {"gamma": 0.99, "rollouts": 2, "fqe_params": FQE_PARAMS}
    # --ope is outside the hash: the runs carry the hashes the config alone gives
    runs = expand_runs(load_config(ope_sweep["config"]), ope_sweep["out"])
    assert {Path(r["dir"]).parent.name: r["hash"] for r in runs} == {v: r["hash"] for v, r in first.items()}
    assert all(r["ope_request"]["estimators"] == ["FQE"] for r in runs)  # the config's own, without --ope
    saved = json.loads((Path(runs[0]["dir"]) / "config.json").read_text())  # as the run was trained
    assert saved["ope_request"]["estimators"] == ["FQE", "DR"] and saved["hash"] == runs[0]["hash"]


def test_a_rerun_with_another_estimator_adds_only_it_from_the_saved_models(ope_sweep):
    assert ope_sweep["built"] == []  # no run built an estimator to train
    assert ope_sweep["second_files"] == ope_sweep["first_files"] and len(ope_sweep["first_files"]) == 12
    assert ope_sweep["asked"] == [["WPDIS"]] * 3  # one OPE call per run, for the missing estimator alone
    for variant, before in ope_sweep["first"].items():
        after = ope_sweep["second"][variant]
        assert after["hash"] == before["hash"] and after["history"] == before["history"]
        assert after["train_seconds"] == before["train_seconds"]
        assert {k: after["ope"][k] for k in ("FQE", "DR", "true_value")} == \
               {k: before["ope"][k] for k in ("FQE", "DR", "true_value")}
        assert np.isfinite(after["ope"]["WPDIS"]["value"])


def test_the_report_shows_each_estimators_pick_its_regret_and_rank_correlation(ope_sweep):
    out = ope_sweep["out"]
    runs = results_frame(out)
    assert {"ope_WPDIS", "ope_WPDIS_ci_low", "ope_WPDIS_ci_high", "ope_true_value"} <= set(runs.columns)
    selection = pd.read_csv(out / "ope_selection.csv", keep_default_na=False, na_values=[""])
    assert sorted(selection["estimator"]) == ["DR", "FQE", "WPDIS"]
    results = ope_sweep["second"]
    names = {v: f"{v}/seed0" for v in results}
    score = {names[v]: r["final_score"] for v, r in results.items()}
    best = max(score.values())
    for row in selection.itertuples():
        estimates = {names[v]: r["ope"][row.estimator]["value"] for v, r in results.items()}
        pick = max(estimates, key=estimates.get)
        assert row.truth == "normalised score" and row.runs == 3
        assert row.selected == pick and row.selected_score == pytest.approx(score[pick])
        assert row.regret == pytest.approx(best - score[pick]) and row.regret >= 0
        assert row.best_score == pytest.approx(best) and score[row.best_run] == best
        lows = {n: r["ope"][row.estimator]["ci_low"] for n, r in zip(names.values(), results.values())}
        finite = {n: low for n, low in lows.items() if np.isfinite(low)}
        if finite:
            assert row.selected_by_lcb == max(finite, key=finite.get)
            assert row.lcb_regret == pytest.approx(best - score[row.selected_by_lcb])
        else:
            assert pd.isna(row.selected_by_lcb)
        rho = spearmanr([estimates[n] for n in score], list(score.values())).statistic
        assert row.rank_corr == pytest.approx(rho) and row.ranked_runs == 3
    write_report(out, title="ope")
    page = (out / "report.html").read_text()
    section = page[page.index("<h2 id='ope-selection'>OPE-based selection</h2>"):]
    for row in selection.itertuples():
        assert f"<th scope='row'>pendulum</th><td>{row.estimator}</td><td>{row.selected}" in section
    summary = page[page.index("<section class='summary'"):page.index("</section>")]
    fqe = selection.set_index("estimator").loc["FQE"]
    assert f"FQE would pick {fqe.selected} (normalised score" in summary and "regret" in summary
    printed = ope_sweep["printed"]
    assert "OPE-based selection (every column in" in printed and f"FQE {fqe.selected}" in printed


def test_without_an_environment_the_selection_has_no_truth(pendulum_npz, tmp_path):
    """`ope=` replaces the config's estimators (DR in place of its FQE); with no env there are no roll-outs,
    the result says so, and the report shows the picks alone."""
    ope = {"estimators": ["FQE"], "rollouts": 2, "fqe_params": FQE_PARAMS}
    config = write_config(tmp_path / "sweep.yaml", pendulum_npz, LRS[:2], steps=40, env=None, ope=ope)
    results = run_sweep(config, workers=1, out=tmp_path / "out", progress=False, ope=["DR"])
    assert (results["status"] == "ok").all() and len(results) == 2
    for result in _results(tmp_path / "out").values():
        assert "FQE" not in result["ope"] and np.isfinite(result["ope"]["DR"]["value"])
        assert result["ope"]["true_value"] is None and "no evaluation environment" in result["ope"]["no_truth"]
        assert "final_score" not in result  # nothing was evaluated
    selection = ope_selection(results)
    assert len(selection) == 1
    row = selection.iloc[0]
    estimates = dict(zip(results["variant"] + "/seed0", results["ope_DR"]))
    assert row["selected"] == max(estimates, key=estimates.get) and row["truth"] == "" and row["best_run"] == ""
    assert all(pd.isna(row[k]) for k in ("selected_score", "regret", "lcb_regret", "best_score", "rank_corr"))
    paths = write_report(tmp_path / "out")
    page = paths["html"].read_text()
    assert "pendulum had no evaluation environment, so only the picks are shown" in page
    assert f"DR would pick {row['selected']}" in page and "No run was evaluated in an environment" in page


def test_a_failed_ope_keeps_the_trained_run_and_a_rerun_computes_only_the_ope(pendulum_npz, tmp_path, monkeypatch):
    from offrl import sweep

    config = write_config(tmp_path / "sweep.yaml", pendulum_npz, LRS[:1], steps=40, env=None)
    run = expand_runs(load_config(config), tmp_path / "out")[0]
    real_run_ope = sweep._run_ope

    def broken(*args, **kwargs):
        raise RuntimeError("FQE diverged")

    monkeypatch.setattr(sweep, "_run_ope", broken)
    failed = sweep.execute_run(run)
    assert failed["status"] == "failed" and "FQE diverged" in failed["error"] and "model is kept" in failed["error"]
    kept = json.loads((Path(run["dir"]) / "result.json").read_text())
    assert kept["status"] == "ok" and "ope" not in kept and ope_missing(run, kept) == ["FQE"]
    model_time = (Path(run["dir"]) / "model.pt").stat().st_mtime_ns
    monkeypatch.setattr(sweep, "_run_ope", real_run_ope)
    monkeypatch.setattr(sweep, "_make_algorithm", lambda run: pytest.fail("a finished run was trained again"))
    done = sweep.execute_run(run)
    assert done["status"] == "ok" and done["ope_added"] == ["FQE"] and np.isfinite(done["ope"]["FQE"]["value"])
    assert (Path(run["dir"]) / "model.pt").stat().st_mtime_ns == model_time
    assert not (Path(run["dir"]) / "error.txt").exists()
    assert sweep.execute_run(run)["skipped"] is True


def test_ope_missing_reuses_stored_estimates_only_under_the_same_settings():
    spec = {"estimators": ["FQE", "DoublyRobust"], "gamma": 0.99, "rollouts": 10, "fqe_params": {}}
    run = {"ope_request": spec}
    estimate = {"value": -50.0, "ci_low": -60.0, "ci_high": -40.0}
    older = {"status": "ok", "ope": {"FQE": estimate, "true_value": -400.0}}  # from before settings were stored
    assert ope_missing(run, older) == ["DR"]
    assert ope_missing(run, {"status": "ok"}) == ["FQE", "DR"]
    changed = {"status": "ok", "ope": {"FQE": estimate, "DR": estimate,
                                       "settings": {"gamma": 0.99, "rollouts": 10, "fqe_params": {"n_steps": 5}}}}
    assert ope_missing(run, changed) == ["FQE", "DR"]  # FQE's settings changed: every estimate is redone
    assert ope_missing({**run, "ope_request": {**spec, "fqe_params": {"n_steps": 5}}}, changed) == []
    # the model's and the marginal ratios' settings are stored (only when set) and count the same way
    stored = {"status": "ok", "ope": {"FQE": estimate, "DR": estimate,
                                      "settings": {"gamma": 0.99, "rollouts": 10, "fqe_params": {}}}}
    assert ope_missing({"ope_request": {**spec, "mb_params": {}, "marginal_params": {}}}, stored) == []
    assert ope_missing({"ope_request": {**spec, "marginal_params": {"ridge": 0.1}}}, stored) == ["FQE", "DR"]
    stored["ope"]["settings"]["marginal_params"] = {"ridge": 0.1}
    assert ope_missing({"ope_request": {**spec, "marginal_params": {"ridge": 0.1}}}, stored) == []
    assert ope_missing(run, {"status": "ok", "ope": {"skipped": "the logged data lacks rewards"}}) == []
    assert ope_missing({"ope_request": None, "ope": None}, {"status": "ok"}) == []


HASH_CONFIG = {"name": "fixed", "datasets": [{"spec": "data/pendulum.npz", "label": "pm"}],
               "algorithms": {"IQL": {"hidden_dims": [32, 32], "batch_size": 32},
                              "BC-x": {"algorithm": "BC", "lr": [0.001, 0.0003]}},
               "seeds": [0], "steps": 100, "eval": {"every": 50, "episodes": 2, "env": "Pendulum-v1"}}


def test_asking_for_ope_changes_no_run_hash():
    """Hashes recorded before `--ope` and `fqe_params` existed (the second set with an `ope:` block)."""
    plain = parse_config(HASH_CONFIG, check_datasets=False)
    without = {"IQL": "e237aa8677b2", "BC-x-bb90828f": "d0bc579ad98a", "BC-x-edfeec77": "6dd3ed4605d4"}
    asked = expand_runs(dataclasses.replace(plain, ope_request=["FQE", "DR"]), "unused")
    assert {r["variant"]: r["hash"] for r in asked} == without
    assert all(r["ope"] is None and r["ope_request"]["estimators"] == ["FQE", "DR"] for r in asked)
    with_block = {"IQL": "83757ab08c5b", "BC-x-bb90828f": "163693b1b712", "BC-x-edfeec77": "87595195b390"}
    block = {"estimators": ["FQE", "DR"], "gamma": 0.95, "rollouts": 5}
    for extra in ({}, {"fqe_params": {"n_steps": 500}},
                  {"mb_params": {"n_steps": 100}, "marginal_params": {"features": "rff", "ridge": 0.01}}):
        config = parse_config({**HASH_CONFIG, "ope": {**block, **extra}}, check_datasets=False)
        for request in (None, ["WPDIS"]):
            runs = expand_runs(dataclasses.replace(config, ope_request=request), "unused")
            assert {r["variant"]: r["hash"] for r in runs} == with_block
            assert runs[0]["ope_request"] == {"estimators": request or ["FQE", "DR"], "gamma": 0.95, "rollouts": 5,
                                              "fqe_params": extra.get("fqe_params", {}),
                                              "mb_params": extra.get("mb_params", {}),
                                              "marginal_params": extra.get("marginal_params", {})}


@pytest.mark.parametrize("ope, key, needle", [
    ({"fqe_params": {"n_stepz": 5}}, "ope.fqe_params.n_stepz", "FQE has no hyper-parameter 'n_stepz'"),
    ({"fqe_params": {"gamma": 0.9}}, "ope.fqe_params.gamma", "gamma is set by ope.gamma"),
    ({"fqe_params": {"n_critics": 0}}, "ope.fqe_params", "n_critics"),
    ({"fqe_params": [200]}, "ope.fqe_params", "fqe_params must be a mapping"),
    ({"mb_params": {"n_modelz": 3}}, "ope.mb_params.n_modelz", "ModelBased has no hyper-parameter 'n_modelz'"),
    ({"mb_params": {"random_state": 3}}, "ope.mb_params.random_state", "random_state is set by the run's seed"),
    ({"mb_params": {"n_models": 0}}, "ope.mb_params", "n_models"),
    ({"marginal_params": {"features": "fourier"}}, "ope.marginal_params", "features must be one of"),
    ({"marginal_params": {"ridge": -1}}, "ope.marginal_params", "ridge must be a non-negative number"),
    ({"marginal_params": {"n_features": 2.5}}, "ope.marginal_params", "n_features must be a positive integer"),
    ({"marginal_params": {"gamma": 0.9}}, "ope.marginal_params", "no setting 'gamma'"),
    ({"marginal_params": "rff"}, "ope.marginal_params", "must be a mapping"),
    ({"estimators": ["FQE", "fqe"]}, "ope.estimators.1", "list each estimator once"),
    ({"estimators": ["FQE", "NOPE"]}, "ope.estimators.1", "unknown estimator 'NOPE'"),
])
def test_the_ope_block_is_checked_before_any_run(ope, key, needle):
    with pytest.raises(ConfigError) as err:
        parse_config({**HASH_CONFIG, "ope": ope}, check_datasets=False)
    assert err.value.key == key and needle in str(err.value)


def test_the_cli_parses_ope_and_refuses_an_unknown_estimator_naming_the_option(tmp_path, capsys):
    args = build_parser().parse_args(["sweep", "sweep.yaml", "--ope", "fqe, DoublyRobust,WPDIS"])
    assert args.ope == ["FQE", "DR", "WPDIS"]
    assert build_parser().parse_args(["sweep", "sweep.yaml"]).ope is None
    for names, needle in (("FQE,NOPE", "unknown estimator 'NOPE'"), ("FQE,,DR", "separated by commas"),
                          ("DR,dr", "twice")):
        with pytest.raises(SystemExit) as exit_:
            cli_main(["sweep", str(tmp_path / "sweep.yaml"), "--ope", names])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("offrl sweep: error: argument --ope: ") and needle in err[0]


def test_an_estimator_that_fails_is_recorded_and_the_others_kept(monkeypatch):
    from offrl import ope
    from offrl.sweep import _estimates

    original = ope.evaluate

    def picky(policies, dataset, estimators, *args, **kwargs):
        if "MIS" in estimators:
            raise ValueError("SNMIS: the learned ratios have non-positive total mass")
        return original(policies, dataset, estimators, *args, **kwargs)

    monkeypatch.setattr(ope, "evaluate", picky)
    from conftest import pendulum_shaped_dataset
    from offrl.algos import BC

    data = pendulum_shaped_dataset(n_episodes=3, length=20)
    bc = BC(n_steps=5, hidden_dims=(8, 8), device="cpu").fit(data, progress=False)
    out = _estimates(bc, data, ["WPDIS", "MIS"], 0.99, 0, {})
    assert out["MIS"] == {"error": "ValueError: SNMIS: the learned ratios have non-positive total mass"}
    assert set(out["WPDIS"]) == {"value", "ci_low", "ci_high"}


def test_the_ope_blocks_estimator_settings_reach_evaluate_and_are_stored(monkeypatch):
    from offrl import ope
    from offrl.sweep import _run_ope

    seen = {}
    original = ope.evaluate

    def spy(policies, dataset, estimators, *args, **kwargs):
        seen.update(kwargs)
        return original(policies, dataset, estimators, *args, **kwargs)

    monkeypatch.setattr(ope, "evaluate", spy)
    from conftest import pendulum_shaped_dataset
    from offrl.algos import BC

    data = pendulum_shaped_dataset(n_episodes=3, length=20)
    bc = BC(n_steps=5, hidden_dims=(8, 8), device="cpu").fit(data, progress=False)
    spec = {"estimators": ["MIS"], "gamma": 0.99, "rollouts": 1, "fqe_params": {},
            "mb_params": {"n_steps": 7}, "marginal_params": {"features": "rff", "n_features": 20, "ridge": 0.01}}
    out = _run_ope(bc, data, None, spec, seed=3)
    assert seen["marginal_params"] == spec["marginal_params"] and seen["mb_params"] == {"n_steps": 7}
    assert seen["random_state"] == 3 and np.isfinite(out["MIS"]["value"])
    assert out["settings"] == {"gamma": 0.99, "rollouts": 1, "fqe_params": {}, "mb_params": {"n_steps": 7},
                               "marginal_params": spec["marginal_params"]}
