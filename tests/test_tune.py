"""`offrl tune`: optuna's search over a sweep config's grid and ranges, scored by OPE, on a recorded Pendulum-v1
dataset, in-process with a real SQLite storage."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import optuna
import pytest
import yaml

import offrl
from conftest import random_pendulum_npz, run_cli
from offrl import ope
from offrl.sweep import ConfigError
from offrl.tune import add_tune_parser, load_tune_config, run_tune_command, search_space, tune, tune_report

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 60
REPORT_EVERY = 20
# A small FQE: each objective estimate takes a fraction of a second.
FQE_PARAMS = {"n_steps": 50, "hidden_dims": [16, 16], "batch_size": 64, "n_critics": 2, "n_bootstrap": 100}
BC_SPACE = {"lr": {"low": 1e-4, "high": 1e-2, "log": True}, "batch_size": {"low": 16, "high": 64, "step": 16},
            "hidden_dims": [[16, 16], [32, 32]]}


@pytest.fixture(scope="module")
def pendulum_npz(tmp_path_factory) -> Path:
    """A small real Pendulum-v1 dataset (uniform-random behaviour, 4 episodes) saved with Dataset.save."""
    return random_pendulum_npz(tmp_path_factory.mktemp("data") / "pendulum.npz", n_episodes=4)


def write_config(path: Path, data: Path, algorithms: dict | None = None, **top) -> Path:
    config = {"name": "tiny", "datasets": [{"spec": str(data), "label": "pendulum"}],
              "algorithms": algorithms or {"BC": BC_SPACE}, "steps": STEPS,
              "eval": {"every": REPORT_EVERY, "episodes": 1}, "log_every": REPORT_EVERY, **top}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def trial_record(out: Path, number: int) -> dict:
    return json.loads((out / "trials" / str(number) / "result.json").read_text())


@pytest.fixture(scope="module")
def resumed(pendulum_npz, tmp_path_factory) -> dict:
    """3 trials, then the same search asked for 5: what each call returned and the first call's trial files."""
    root = tmp_path_factory.mktemp("tune")
    config = write_config(root / "tiny.yaml", pendulum_npz)
    out = root / "out"
    first = tune(config, trials=3, out=out, objective_params=FQE_PARAMS, progress=False)
    first_records = {n: (out / "trials" / str(n) / "result.json").read_text() for n in range(3)}
    second = tune(config, trials=5, out=out, objective_params=FQE_PARAMS, progress=False)
    return {"config": config, "out": out, "first": first, "second": second, "first_records": first_records}


def stored_study(out: Path, name: str = "tiny") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{out / 'optuna.db'}")


def test_trials_complete_and_each_writes_its_result_and_model(resumed):
    out, first = resumed["out"], resumed["first"]
    assert (out / "optuna.db").is_file()
    assert list(first.frame["trial"]) == [0, 1, 2] and set(first.frame["state"]) == {"COMPLETE"}
    for number in range(3):
        record = trial_record(out, number)
        params = record["params"]
        assert 1e-4 <= params["lr"] <= 1e-2 and params["batch_size"] in (16, 32, 48, 64)
        assert params["hidden_dims"] in ([16, 16], [32, 32])
        assert [row["step"] for row in record["intermediate"]] == [20, 40, 60]
        last = record["intermediate"][-1]
        assert record["final_objective"] == last["value"] == last["estimate"]
        assert record["steps_done"] == STEPS and math.isfinite(record["true_score"])
        model = offrl.load(out / "trials" / str(number) / "model.pt", device="cpu")
        assert model.n_steps_done_ == STEPS
        assert (model.lr, model.batch_size, list(model.hidden_dims)) == (params["lr"], params["batch_size"],
                                                                         params["hidden_dims"])


def test_a_rerun_resumes_and_runs_only_the_missing_trials(resumed):
    out, second = resumed["out"], resumed["second"]
    trials = stored_study(out).trials
    assert [t.number for t in trials] == [0, 1, 2, 3, 4]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert list(second.frame["trial"]) == [0, 1, 2, 3, 4]
    for number, text in resumed["first_records"].items():  # the first three were not run again
        assert (out / "trials" / str(number) / "result.json").read_text() == text
    # the sampler is reseeded on resuming: a restarted seed would draw the first trials' values again
    first_lrs = {trial_record(out, n)["params"]["lr"] for n in range(3)}
    assert not first_lrs & {trial_record(out, n)["params"]["lr"] for n in (3, 4)}


def test_every_intermediate_objective_reaches_optuna(resumed):
    out = resumed["out"]
    for trial in stored_study(out).trials:
        record = trial_record(out, trial.number)
        assert trial.intermediate_values == {row["step"]: row["value"] for row in record["intermediate"]}
        assert trial.value == record["final_objective"]
        assert trial.user_attrs["true_score"] == record["true_score"]


def test_the_objective_and_the_true_score_are_those_of_the_saved_policy(resumed, pendulum_npz):
    out = resumed["out"]
    best = resumed["second"].best
    record = trial_record(out, best["best_trial"])
    model = offrl.load(best["model"], device="cpu")
    # the FQE estimate of the final policy, as `offrl ope` would compute it
    report = ope.evaluate({"policy": model}, offrl.datasets.load(str(pendulum_npz)), ["FQE"], gamma=0.99,
                          random_state=0, fqe_params={**FQE_PARAMS, "device": "cpu"})
    assert report.to_frame()["value"].iloc[0] == pytest.approx(record["final_objective"], rel=1e-5)
    # the true score: the sweep's evaluation (1 episode, seed 0), normalised by the data's reference scores
    rollout = model.evaluate("Pendulum-v1", n_episodes=1, seed=0)
    assert record["true_return"] == pytest.approx(rollout["return_mean"])
    assert record["true_score"] == pytest.approx(100 * (rollout["return_mean"] + 1200) / 1050)


def test_the_report_has_a_row_per_trial_and_the_regret_of_the_choice(resumed):
    out = resumed["out"]
    frame = tune_report(out)
    assert list(frame["trial"]) == [0, 1, 2, 3, 4]
    assert {"state", "lr", "batch_size", "hidden_dims", "objective", "true_score"} <= set(frame.columns)
    chosen = frame.loc[frame["objective"].idxmax()]
    regret = frame["true_score"].max() - chosen["true_score"]
    summary = resumed["second"].best
    assert summary["best_trial"] == chosen["trial"] and summary["regret"] == pytest.approx(regret)
    assert summary["regret"] >= 0
    markdown = (out / "tune.md").read_text()
    page = (out / "tune.html").read_text()
    assert f"Best trial by the objective: trial {chosen['trial']}" in markdown
    assert "regret of choosing by the objective" in markdown and "regret of choosing by the objective" in page
    assert markdown.count("| COMPLETE |") == 5 and page.count("<tr>") == 6  # a header and five trials
    assert "<script" not in page and "http" not in page  # self-contained


def test_a_lagging_trial_is_pruned_at_its_first_estimate(pendulum_npz, tmp_path):
    config = write_config(tmp_path / "tiny.yaml", pendulum_npz)
    out = tmp_path / "out"
    # a threshold no estimate reaches: the pruner stops the trial at its first report
    result = tune(config, trials=1, out=out, objective_params=FQE_PARAMS, progress=False, lcb=True,
                  prune=optuna.pruners.ThresholdPruner(lower=1e9))
    record = trial_record(out, 0)
    assert record["state"] == "PRUNED" and record["pruned_at"] == REPORT_EVERY
    assert [row["step"] for row in record["intermediate"]] == [REPORT_EVERY]
    row = record["intermediate"][0]
    assert row["value"] == row["ci_low"] < row["estimate"]  # lcb: the lower end of the interval is the objective
    assert "true_score" not in record  # a pruned policy is not rolled out
    assert offrl.load(out / "trials" / "0" / "model.pt", device="cpu").n_steps_done_ == REPORT_EVERY
    assert stored_study(out).trials[0].state == optuna.trial.TrialState.PRUNED
    assert list(result.frame["state"]) == ["PRUNED"] and "best_trial" not in result.best
    assert "No trial has completed yet" in (out / "tune.md").read_text()


def test_a_diverged_trial_is_recorded_failed_and_counted(pendulum_npz, tmp_path):
    # Adam with a learning rate of 1e30 makes BC's loss NaN by step 20
    config = write_config(tmp_path / "tiny.yaml", pendulum_npz,
                          {"BC": {"lr": {"low": 1e30, "high": 1e31}, "hidden_dims": [16, 16]}})
    out = tmp_path / "out"
    tune(config, trials=1, out=out, objective_params=FQE_PARAMS, progress=False)
    record = trial_record(out, 0)
    assert record["state"] == "FAIL" and "became nan" in record["error"]
    tune(config, trials=1, out=out, objective_params=FQE_PARAMS, progress=False)  # its outcome, not an interruption
    assert len(stored_study(out).trials) == 1
    assert list(tune_report(out)["state"]) == ["FAIL"]


def test_a_marginal_objective_takes_its_ratio_settings(pendulum_npz, tmp_path):
    config = write_config(tmp_path / "tiny.yaml", pendulum_npz, {"BC": {"lr": [1e-3], "hidden_dims": [16, 16]}})
    out = tmp_path / "out"
    calls = []
    original = ope.evaluate

    def spy(*args, **kwargs):
        calls.append(kwargs.get("marginal_params"))
        return original(*args, **kwargs)

    import unittest.mock

    with unittest.mock.patch.object(ope, "evaluate", spy):
        tune(config, objective="MIS", trials=1, out=out, objective_params={"n_features": 20, "ridge": 1e-2},
             progress=False)
    record = trial_record(out, 0)
    assert record["state"] == "COMPLETE" and math.isfinite(record["final_objective"])
    assert calls and all(c == {"n_features": 20, "ridge": 1e-2} for c in calls)
    with pytest.raises(ValueError, match="ridge"):
        tune(config, objective="MIS", trials=1, out=tmp_path / "o2", objective_params={"ridge": -1}, progress=False)


def test_an_ope_failure_fails_the_trial_not_the_study(pendulum_npz, tmp_path, monkeypatch):
    config = write_config(tmp_path / "tiny.yaml", pendulum_npz, {"BC": {"lr": [1e-3], "hidden_dims": [16, 16]}})
    out = tmp_path / "out"

    def failing(*args, **kwargs):
        raise ValueError("SNMIS: the learned ratios have non-positive total mass")

    monkeypatch.setattr(ope, "evaluate", failing)
    result = tune(config, trials=2, out=out, objective_params=FQE_PARAMS, progress=False)
    assert list(result.frame["state"]) == ["FAIL", "FAIL"]
    assert "non-positive total mass" in trial_record(out, 0)["error"]


def test_another_study_in_the_same_folder_is_refused(resumed):
    with pytest.raises(ValueError, match="holds the study 'tiny'"):
        tune(resumed["config"], trials=1, out=resumed["out"], study_name="other", objective_params=FQE_PARAMS,
             progress=False)


def test_one_study_per_dataset_and_algorithm(pendulum_npz, tmp_path):
    # a second dataset that neither entry runs on (their `datasets:` lists): it gets no study
    algorithms = {"BC-small": {"algorithm": "BC", "hidden_dims": [16, 16], "lr": [1e-3, 3e-3], "datasets": ["pendulum"]},
                  "BC-large": {"algorithm": "BC", "hidden_dims": [32, 32], "lr": [1e-3, 3e-3], "datasets": ["pendulum"]}}
    datasets = [{"spec": str(pendulum_npz), "label": "pendulum"}, {"spec": str(pendulum_npz), "label": "unused"}]
    config = write_config(tmp_path / "two.yaml", pendulum_npz, algorithms, name="two", steps=REPORT_EVERY,
                          datasets=datasets)
    out = tmp_path / "out"
    result = tune(config, trials=1, out=out, objective_params=FQE_PARAMS, progress=False)
    names = optuna.study.get_all_study_names(f"sqlite:///{out / 'optuna.db'}")
    assert sorted(names) == ["two:pendulum:BC-large", "two:pendulum:BC-small"]
    for label, width in (("BC-small", 16), ("BC-large", 32)):
        record = json.loads((out / "studies" / "pendulum" / label / "trials" / "0" / "result.json").read_text())
        assert record["state"] == "COMPLETE" and record["params"]["lr"] in (1e-3, 3e-3)
        assert offrl.load(out / "studies" / "pendulum" / label / "trials" / "0" / "model.pt").hidden_dims[0] == width
    assert sorted(zip(result.frame["dataset"], result.frame["algorithm"])) == [("pendulum", "BC-large"),
                                                                              ("pendulum", "BC-small")]


def test_the_configs_fqe_params_set_the_objective_unless_overridden(pendulum_npz, tmp_path):
    config = write_config(tmp_path / "tiny.yaml", pendulum_npz, {"BC": {"hidden_dims": [16, 16]}},
                          steps=REPORT_EVERY, ope={"fqe_params": {**FQE_PARAMS, "n_steps": 40}})
    out = tmp_path / "out"
    tune(config, trials=1, out=out, objective_params={"n_steps": 30}, progress=False)
    identity = stored_study(out).user_attrs["identity"]
    # n_bootstrap is an option of ope.evaluate (the interval), the rest FQE's own
    assert identity["fqe_params"] == {"n_steps": 30, "hidden_dims": [16, 16], "batch_size": 64, "n_critics": 2}
    assert identity["options"] == {"n_bootstrap": 100}


def test_lists_and_ranges_make_the_search_space(pendulum_npz, tmp_path):
    algorithms = {"BC": {"lr": [1e-3, 3e-3], "batch_size": {"low": 16, "high": 64, "step": 16},
                         "hidden_dims": [[16, 16], [32, 32]], "policy": "gaussian"},
                  "IQL": {"expectile": {"low": 0.5, "high": 0.9}, "temperature": {"low": 1, "high": 10, "log": True}}}
    config = load_tune_config(write_config(tmp_path / "space.yaml", pendulum_npz, algorithms))
    space, fixed, decoding = search_space(config, "BC")
    assert space["lr"] == optuna.distributions.CategoricalDistribution([1e-3, 3e-3])
    assert space["batch_size"] == optuna.distributions.IntDistribution(16, 64, step=16)
    assert space["hidden_dims"] == optuna.distributions.CategoricalDistribution(["[16, 16]", "[32, 32]"])
    assert decoding["hidden_dims"] == {"[16, 16]": (16, 16), "[32, 32]": (32, 32)}
    assert fixed == {"policy": "gaussian"}
    space, _, _ = search_space(config, "IQL")
    assert space["expectile"] == optuna.distributions.FloatDistribution(0.5, 0.9)
    assert space["temperature"] == optuna.distributions.FloatDistribution(1.0, 10.0, log=True)  # a float parameter


BAD_RANGES = [
    ("lr: {low: 1.0e-4}", "algorithms.BC.lr", "high is missing"),
    ("lr: {low: 1.0e-2, high: 1.0e-4}", "algorithms.BC.lr", "low must be below high"),
    ("lr: {low: 0, high: 1.0e-2, log: true}", "algorithms.BC.lr.low", "a log range needs low > 0"),
    ("lr: {low: 1.0e-4, high: 1.0e-2, scale: log}", "algorithms.BC.lr.scale", "unknown range key 'scale'"),
    ("lr: {low: 1.0e-4, high: 1.0e-2, log: true, step: 1.0e-4}", "algorithms.BC.lr", "not both"),
    ("batch_size: {low: 16, high: 64, step: 0.5}", "algorithms.BC.batch_size", "is an integer"),
    ("batch_size: {low: 16, high: 60, step: 16}", "algorithms.BC.batch_size.step", "must be a multiple of step"),
    ("policy: {low: 0, high: 1}", "algorithms.BC.policy", "is not a number"),
    ("lr: {low: 1.0e-4, high: big}", "algorithms.BC.lr.high", "high must be a finite number"),
]


@pytest.mark.parametrize("line, key, message", BAD_RANGES)
def test_a_bad_range_is_refused_with_its_line_and_key(pendulum_npz, tmp_path, line, key, message):
    path = tmp_path / "bad.yaml"
    path.write_text(f"name: bad\ndatasets: [{{spec: '{pendulum_npz}', label: pendulum}}]\nalgorithms:\n  BC:\n"
                    f"    {line}\nsteps: 60\n")
    with pytest.raises(ConfigError, match=message) as err:
        load_tune_config(path)
    assert str(err.value).startswith(f"{path}:5: {key}: ")


def test_a_range_end_is_checked_against_the_algorithms_rules(pendulum_npz, tmp_path):
    config = write_config(tmp_path / "iql.yaml", pendulum_npz, {"IQL": {"expectile": {"low": 0.5, "high": 1.5}}})
    with pytest.raises(ConfigError, match=r"algorithms\.IQL\.expectile\.high: .*expectile must be"):
        load_tune_config(config)


def test_bad_options_are_refused_before_anything_runs(pendulum_npz, tmp_path):
    config = write_config(tmp_path / "tiny.yaml", pendulum_npz)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="unknown estimator 'NotAnEstimator'"):
        tune(config, objective="NotAnEstimator", out=out, progress=False)
    with pytest.raises(ValueError, match="trials must be an integer >= 1"):
        tune(config, trials=0, out=out, progress=False)
    with pytest.raises(ValueError, match="is not a database URL"):
        tune(config, storage="no url here", out=out, progress=False)
    with pytest.raises(ValueError, match="FQE .* has no parameter 'n_step'"):
        tune(config, objective_params={"n_step": 10}, out=out, progress=False)
    with pytest.raises(ValueError, match="objective_params: FQE: n_steps must be an integer >= 0, got -1"):
        tune(config, objective_params={"n_steps": -1}, out=out, progress=False)
    with pytest.raises(ValueError, match="gamma is set by tune"):
        tune(config, objective_params={"gamma": 0.9}, out=out, progress=False)
    online = write_config(tmp_path / "online.yaml", pendulum_npz,
                          {"IQL": {"online": {"steps": 100, "eval_every": 10}}})
    with pytest.raises(ConfigError, match=r"algorithms\.IQL\.online: .*online phase needs the environment"):
        tune(online, out=out, progress=False)
    assert not out.exists()


def test_a_changed_search_is_not_resumed_into_the_old_study(resumed, tmp_path):
    changed = yaml.safe_load(resumed["config"].read_text())
    changed["algorithms"]["BC"]["lr"]["high"] = 2e-2
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(changed))
    with pytest.raises(ValueError, match="was started with another space"):
        tune(path, trials=6, out=resumed["out"], objective_params=FQE_PARAMS, progress=False)
    assert len(stored_study(resumed["out"]).trials) == 5


def test_the_command_resumes_and_prints_the_report(resumed, capsys):
    parser = argparse.ArgumentParser(prog="offrl")
    add_tune_parser(parser.add_subparsers())
    settings = [f"--objective-param={k}={json.dumps(v)}" for k, v in FQE_PARAMS.items()]
    args = parser.parse_args(["tune", str(resumed["config"]), "--trials", "5", "--out", str(resumed["out"]),
                              "--no-progress", *settings])
    assert args.func is run_tune_command and args.objective == "FQE" and not args.lcb
    assert run_tune_command(args) == 0
    printed = capsys.readouterr().out
    assert len(stored_study(resumed["out"]).trials) == 5  # all five were there: nothing ran
    assert "Best trial by the objective: trial" in printed and "tune.html" in printed
    table_rows = [line for line in printed.splitlines() if "COMPLETE" in line]
    assert len(table_rows) == 5


def test_the_command_fits_the_offrl_parser(pendulum_npz, tmp_path, monkeypatch, capsys):
    """Registered on `offrl`'s own parser, errors are one line with exit status 2."""
    from offrl import cli

    assert "tune" in next(a for a in cli.build_parser()._actions
                          if isinstance(a, argparse._SubParsersAction)).choices
    config = write_config(tmp_path / "tiny.yaml", pendulum_npz)
    code, _, err = run_cli(["tune", str(config), "--objective", "nope", "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and err.startswith("offrl tune: error: unknown estimator 'nope'") and err.count("\n") == 1
    code, _, err = run_cli(["tune", str(config), "--trials", "0"], capsys)
    assert code == 2 and "--trials" in err and err.count("\n") == 1
    code, out, _ = run_cli(["tune", "--help"], capsys)
    assert code == 0 and "example:\n  offrl tune experiments/quickstart.yaml --objective FQE --trials 20" in out
    assert not (tmp_path / "out").exists()
