"""Sweeps on real data (a recorded Pendulum-v1 dataset), on the local and Ray backends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from offrl import Dataset
from offrl.algos import BC
from conftest import random_pendulum_npz
from offrl.cli import main as cli_main
from offrl.report import stratified_bootstrap_iqm, iqm
from offrl.sweep import ConfigError, load_config, parse_config, run_sweep

COMPARE = ["dataset", "variant", "seed", "status", "final_return", "best_return", "final_score", "best_score"]


@pytest.fixture(scope="module")
def pendulum_npz(tmp_path_factory) -> Path:
    """A small real Pendulum-v1 dataset (uniform-random behaviour, 6 episodes) saved with Dataset.save."""
    return random_pendulum_npz(tmp_path_factory.mktemp("data") / "pendulum.npz", n_episodes=6)


def write_config(path: Path, datasets, steps=200, seeds=(0, 1), algorithms=None) -> Path:
    config = {
        "name": "tiny",
        "datasets": datasets,
        "algorithms": algorithms or {"BC": {"lr": [0.001, 0.0003], "hidden_dims": [32, 32]}},
        "seeds": list(seeds),
        "steps": steps,
        "eval": {"every": steps // 2, "episodes": 2},
        "log_every": 50,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_local_and_ray_backends_give_identical_tables(tmp_path, pendulum_npz):
    pytest.importorskip("ray")
    config = write_config(tmp_path / "sweep.yaml", [str(pendulum_npz)])
    local = run_sweep(config, backend="local", workers=2, out=tmp_path / "local", progress=False)
    ray_results = run_sweep(config, backend="ray", workers=2, out=tmp_path / "ray", progress=False)
    assert len(local) == 4 and (local["status"] == "ok").all()
    assert local[COMPARE].equals(ray_results[COMPARE])
    run_dir = Path(local["dir"][0])
    for name in ("config.json", "result.json", "train.csv", "eval.csv", "checkpoint.pt", "model.pt"):
        assert (run_dir / name).exists(), name
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["hash"] == json.loads((run_dir / "result.json").read_text())["hash"]


def test_rerun_skips_finished_runs_and_killed_sweep_resumes(tmp_path, pendulum_npz):
    config = write_config(tmp_path / "sweep.yaml", [str(pendulum_npz)], steps=3000, seeds=(0, 1, 2))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "offrl.cli", "sweep", str(config), "--workers", "1", "--out", str(out),
                             "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and not list(out.glob("runs/**/result.json")):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = {p: p.stat().st_mtime_ns for p in out.glob("runs/**/result.json")}
    assert 1 <= len(finished) < 6, "the sweep should have been killed midway"
    results = run_sweep(config, backend="local", workers=1, out=out, progress=False)
    assert len(results) == 6 and (results["status"] == "ok").all()
    for path, mtime in finished.items():
        assert path.stat().st_mtime_ns == mtime, f"{path} was re-run"
        assert json.loads(path.read_text())["resumed_from_step"] == 0  # trained in one go before the kill
    assert set(results["resumed_from_step"]) <= {0, 1500, 3000}  # a killed run resumes at one of its checkpoints
    again = {p: p.stat().st_mtime_ns for p in out.glob("runs/**/result.json")}
    run_sweep(config, backend="local", workers=1, out=out, progress=False)
    assert again == {p: p.stat().st_mtime_ns for p in out.glob("runs/**/result.json")}


def test_a_changed_config_trains_from_scratch_not_from_the_old_checkpoint(tmp_path, pendulum_npz):
    """Run directories are named by label and seed, not hash: a new setting must not resume the old
    setting's finished checkpoint (which once gave a 'result' for lr 0.1 made entirely with lr 0.001)."""
    algorithms = {"BC": {"lr": 0.001, "hidden_dims": [32, 32]}}
    out = tmp_path / "out"
    run_sweep(write_config(tmp_path / "a.yaml", [str(pendulum_npz)], seeds=(0,), algorithms=algorithms),
              backend="local", workers=1, out=out, progress=False)
    algorithms["BC"]["lr"] = 0.1
    changed = run_sweep(write_config(tmp_path / "b.yaml", [str(pendulum_npz)], seeds=(0,), algorithms=algorithms),
                        backend="local", workers=1, out=out, progress=False)
    fresh = run_sweep(write_config(tmp_path / "c.yaml", [str(pendulum_npz)], seeds=(0,), algorithms=algorithms),
                      backend="local", workers=1, out=tmp_path / "fresh", progress=False)
    run_dir = Path(changed["dir"][0])
    assert (run_dir / "train.csv").read_text() == (Path(fresh["dir"][0]) / "train.csv").read_text()
    assert changed["final_return"][0] == fresh["final_return"][0]
    assert json.loads((run_dir / "config.json").read_text())["params"]["lr"] == 0.1


def test_a_guide_given_as_a_spec_or_settings_is_recorded_with_its_defaults():
    """A GORL guide written in a config as a path or a dict resolves to the Guide it becomes, so a result made
    under another Guide default (normalize was False before 2026-12-06) is not reused."""
    from offrl.algos.guide import Guide
    from offrl.sweep import resolved_params

    def guide_of(guide):
        return resolved_params({"algorithm": "TD3PlusBC", "params": {"guide": guide}})["algorithm"]["guide"]

    as_path = guide_of("demos.npz")
    assert as_path["class"] == "Guide" and as_path["params"]["expert"] == "demos.npz"
    assert as_path["params"]["normalize"] is Guide().normalize and as_path["params"]["lr"] == Guide().lr
    assert guide_of({"expert": "demos.npz", "normalize": False})["params"]["normalize"] is False
    assert guide_of({"expert": "demos.npz"}) == as_path
    assert resolved_params({"algorithm": "TD3PlusBC", "params": {}})["algorithm"]["guide"] is None


def test_a_result_made_with_other_defaults_is_trained_again(tmp_path, pendulum_npz):
    """The hash holds the params as written; a default that changed in the code since must not reuse the result."""
    config = write_config(tmp_path / "sweep.yaml", [str(pendulum_npz)], seeds=(0,),
                          algorithms={"BC": {"hidden_dims": [32, 32]}})
    out = tmp_path / "out"
    first = run_sweep(config, backend="local", workers=1, out=out, progress=False)
    result_path = Path(first["dir"][0]) / "result.json"
    result = json.loads(result_path.read_text())
    assert result["resolved_params"]["algorithm"]["lr"] == BC().lr and "random_state" not in result["resolved_params"]["algorithm"]
    stamp = result_path.stat().st_mtime_ns
    run_sweep(config, backend="local", workers=1, out=out, progress=False)
    assert result_path.stat().st_mtime_ns == stamp  # the same code: reused

    result["resolved_params"]["algorithm"]["lr"] = 0.5  # as if BC's default lr had been 0.5 when it ran
    result_path.write_text(json.dumps(result))
    run_sweep(config, backend="local", workers=1, out=out, progress=False)
    assert json.loads(result_path.read_text())["resolved_params"]["algorithm"]["lr"] == BC().lr

    del result["resolved_params"]  # a result from before they were recorded: nothing to compare, reused
    result_path.write_text(json.dumps(result))
    stamp = result_path.stat().st_mtime_ns
    run_sweep(config, backend="local", workers=1, out=out, progress=False)
    assert result_path.stat().st_mtime_ns == stamp


def test_failing_run_does_not_stop_the_others(tmp_path, pendulum_npz):
    broken = tmp_path / "broken.npz"
    broken.write_bytes(b"this is not a dataset")
    config = write_config(tmp_path / "sweep.yaml", [str(pendulum_npz), str(broken)], seeds=(0,),
                          algorithms={"BC": {"hidden_dims": [32, 32]}})
    results = run_sweep(config, backend="local", workers=1, out=tmp_path / "out", progress=False)
    status = dict(zip(results["dataset"], results["status"]))
    assert status == {pendulum_npz.name.replace("/", "_"): "ok", "broken.npz": "failed"} or sorted(status.values()) == ["failed", "ok"]
    failed_dir = Path(results.loc[results["status"] == "failed", "dir"].iloc[0])
    assert "Traceback" in (failed_dir / "error.txt").read_text()


def test_report_writes_table_and_self_contained_html(tmp_path, pendulum_npz, capsys):
    config = write_config(tmp_path / "sweep.yaml", [str(pendulum_npz)])
    out = tmp_path / "out"
    run_sweep(config, backend="local", workers=1, out=out, progress=False)
    for name in ("results.csv", "table.csv", "iqm.csv", "report.html"):
        (out / name).unlink(missing_ok=True)
    assert cli_main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(last)" in printed and "(best)" in printed
    page = (out / "report.html").read_text()
    assert "<table" in page and "data:image/png;base64," in page
    assert "http://" not in page and "https://" not in page
    # made for reading: a summary first, the seed count, captioned curves, the raw runs collapsed
    assert "</h1><section class='summary' id='summary'>" in page
    assert "2 algorithm variants" in page and "2 seeds (0 and 1) each" in page
    assert "<figcaption>Figure 1." in page and "<details><summary>All runs: one row per run (4;" in page
    results = (out / "results.csv").read_text().splitlines()
    assert len(results) == 1 + 4


def test_iqm_and_stratified_bootstrap():
    scores = np.arange(1, 9, dtype=float)  # middle 50%: 3,4,5,6
    assert iqm(scores) == pytest.approx(4.5)
    strata = [np.array([1.0, 2.0, 3.0, 4.0]), np.array([10.0, 11.0, 12.0, 13.0])]
    value, low, high = stratified_bootstrap_iqm(strata, n_boot=500, seed=0)
    assert low <= value <= high
    assert value == pytest.approx(iqm(np.concatenate(strata)))
    constant = [np.full(5, 7.0), np.full(3, 7.0)]
    assert stratified_bootstrap_iqm(constant, n_boot=50) == (7.0, 7.0, 7.0)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda c: c["algorithms"].update({"NoSuchAlgo": {}}), "unknown algorithm"),
        (lambda c: c["algorithms"]["BC"].update({"learning_rate": 0.1}), "no hyper-parameter 'learning_rate'"),
        (lambda c: c["datasets"].append("d4rl:hopper-medium-v2"), "not found"),
        (lambda c: c["algorithms"]["BC"].update({"lr": []}), "at least one value"),
        (lambda c: c["algorithms"]["BC"].update({"lr": [{"a": 1}]}), "malformed grid"),
        (lambda c: c.update({"seeds": "zero"}), "seeds"),
        (lambda c: c["datasets"].append({"spec": "offrl:pendulum-medium-v1", "build": {"sac_step": 9}}),
         "unknown build option"),
        (lambda c: c["algorithms"]["BC"].update({"labelers": [{"NoSuchLabeler": {}}]}), "unknown labeler"),
        (lambda c: c["algorithms"]["BC"].update({"labelers": [{"OTRewardLabeler": {"epsilon": -1}}]}), "epsilon"),
        (lambda c: c["algorithms"]["BC"].update({"labelers": [{"RewardModelLabeler": {"n_step": 5}}]}), "n_step"),
        (lambda c: c["algorithms"]["BC"].update({"labelers": [{"OTRewardLabeler": {"expert": "nowhere.npz"}}]}),
         "nowhere.npz does not exist"),
        (lambda c: c["algorithms"]["BC"].update({"labelers": [{"OTRewardLabeler": {}}]}), "needs expert"),
    ],
)
def test_bad_config_is_reported_with_path_and_line(tmp_path, pendulum_npz, monkeypatch, mutate, needle):
    monkeypatch.setenv("D4RL_DATASET_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("HOME", str(tmp_path))
    config = {
        "name": "bad",
        "datasets": [str(pendulum_npz)],
        "algorithms": {"BC": {"hidden_dims": [32, 32]}},
        "seeds": [0],
        "steps": 10,
    }
    mutate(config)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False, default_flow_style=False))
    text = path.read_text().splitlines()
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert needle in message
    assert message.startswith(f"{path}:")
    reported = int(message.split(":")[1])
    # The reported line holds the offending key (or its list item).
    key = info.value.key.split(".")[-1]
    assert key in text[reported - 1] or text[reported - 1].lstrip().startswith("-"), (message, text)
    assert not (tmp_path / "offrl-results").exists()


def test_experiment_configs_are_valid_and_quickstart_yaml_matches_the_command():
    from offrl.quickstart import QUICKSTART_CONFIG

    root = Path(__file__).resolve().parents[1] / "experiments"
    names = sorted(p.name for p in root.glob("*.yaml"))
    assert {"quickstart.yaml", "local_suite.yaml", "d4rl_locomotion.yaml"} <= set(names)
    from offrl.tune import load_tune_config

    for name in names:
        if name.startswith("tune_"):  # `offrl tune` configs: a sweep config with ranges
            config = load_tune_config(root / name, check_datasets=False).sweep
        else:
            config = load_config(root / name, check_datasets=False)
        assert config.algorithms and config.datasets
    assert yaml.safe_load((root / "quickstart.yaml").read_text()) == QUICKSTART_CONFIG
    suite = load_config(root / "d4rl_locomotion.yaml", check_datasets=False)
    assert len(suite.datasets) == 9 and len(suite.seeds) == 5 and suite.steps == 1_000_000
    assert set(suite.algorithms) == {"BC", "TD3PlusBC", "IQL", "CQL", "CalQL"}


def test_longest_runs_start_first_and_on_result_sees_each_run(tmp_path, pendulum_npz):
    from offrl.sweep import run_step

    algorithms = {"BC": {"hidden_dims": [32, 32]}, "IQL": {"hidden_dims": [32, 32]}}
    config = write_config(tmp_path / "sweep.yaml", [str(pendulum_npz)], steps=100, seeds=(0,), algorithms=algorithms)
    seen = []
    results = run_sweep(config, workers=1, out=tmp_path / "out", progress=False,
                        on_result=lambda r: seen.append((r["algorithm"], r["status"], run_step(r["dir"]))))
    # IQL's update costs several BC updates, so it starts first; the callback gets every finished run.
    assert seen == [("IQL", "ok", 100), ("BC", "ok", 100)]
    assert set(results["algorithm"]) == {"BC", "IQL"}


def test_progress_view_shows_the_step_of_each_running_run(tmp_path):
    from offrl.sweep import _Progress, run_step

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert run_step(run_dir) == 0  # nothing logged yet
    (run_dir / "train.csv").write_text("step,loss\n")
    assert run_step(run_dir) == 0
    (run_dir / "train.csv").write_text("step,loss\n250,0.5\n500,0.25\n")
    assert run_step(run_dir) == 500
    view = _Progress(total=3, skipped=1, enabled=True)
    view.running = [{"dir": str(run_dir), "variant": "CQL", "seed": 0, "steps": 5000}]
    view.show()
    postfix = view.bar.postfix
    view.update({"status": "failed", "dir": str(run_dir)})
    view.close()
    assert "CQL/s0 500/5000" in postfix and "running=1" in postfix and "skipped=1" in postfix
    assert view.failed == 1 and view.running == []


def test_an_offrl_dataset_not_to_be_built_must_exist_with_that_budget(tmp_path, pendulum_npz, monkeypatch):
    from test_layers import _fake_build

    monkeypatch.setenv("OFFRL_DATA_DIR", str(tmp_path / "data"))
    config = {"name": "built", "datasets": [{"spec": "offrl:pendulum-medium-v1", "build": False}],
              "algorithms": {"BC": {}}, "seeds": [0], "steps": 10}
    with pytest.raises(ConfigError, match="is not built; run `offrl datasets build pendulum-medium-v1`"):
        parse_config(config, source="test")
    _fake_build(tmp_path / "data", seed=3)  # built, but with seed 3: still not the default budget's
    with pytest.raises(ConfigError, match="is not built"):
        parse_config(config, source="test")
    _fake_build(tmp_path / "data", seed=0)
    assert parse_config(config, source="test").datasets[0]["build"] is False


def test_the_sweep_log_every_reaches_each_estimator():
    import inspect

    from sklearn.base import clone

    from offrl.sweep import _algorithm_class, _make_algorithm

    for name in ("BC", "IQL"):
        algo = _make_algorithm({"algorithm": name, "params": {"hidden_dims": [8]}, "seed": 0, "device": "cpu",
                                "log_every": 7})
        assert algo.log_every == 7 and algo.random_state == 0
        if "log_every" in inspect.signature(_algorithm_class(name).__init__).parameters:
            assert clone(algo).log_every == 7  # a constructor parameter: clone keeps it
    # An algorithm's own log_every wins over the sweep's.
    if "log_every" in inspect.signature(_algorithm_class("BC").__init__).parameters:
        own = _make_algorithm({"algorithm": "BC", "params": {"log_every": 3}, "seed": 0, "device": "cpu",
                               "log_every": 7})
        assert own.log_every == 3


def test_labelers_run_in_front_of_the_algorithm_and_save_with_it(tmp_path, pendulum_npz):
    """OTR labels a reward-free copy of the data for IQL, a reward model fills hidden rewards; model.pt holds the
    pipeline, and the dataset score stays the logged data's."""
    import offrl
    from offrl.reward_labeling import OTRewardLabeler

    data = Dataset.load(pendulum_npz)
    unlabelled = tmp_path / "no-rewards.npz"
    data.without_rewards().save(unlabelled)
    expert = tmp_path / "demo.npz"
    data.subset([0]).save(expert)
    small = {"hidden_dims": [32, 32]}
    algorithms = {
        "IQL-OTR": {"algorithm": "IQL", **small, "labelers": [{"OTRewardLabeler": {"expert": str(expert)}}]},
        "IQL-RM": {"algorithm": "IQL", **small,
                   "labelers": [{"RewardModelLabeler": {"label_fraction": 0.2, "n_steps": 50, "hidden_dims": [16]}}]},
        "IQL": small,
    }
    datasets = [{"spec": str(pendulum_npz), "label": "logged"}, {"spec": str(unlabelled), "label": "no-rewards"}]
    config = write_config(tmp_path / "sweep.yaml", datasets, steps=20, seeds=(0,), algorithms=algorithms)
    results = run_sweep(config, backend="local", workers=1, out=tmp_path / "out", progress=False)
    status = {(row.dataset, row.variant): row.status for row in results.itertuples()}
    # Without rewards, only the OTR run can train; with them, all three.
    assert status[("no-rewards", "IQL-OTR")] == "ok"
    assert status[("no-rewards", "IQL")] == "failed" and status[("no-rewards", "IQL-RM")] == "failed"
    assert all(status[(d, v)] == "ok" for d, v in status if d != "no-rewards")
    rows = results.set_index(["dataset", "variant"])
    logged = rows.loc[("logged", "IQL"), "dataset_score"]
    assert np.isfinite(logged)
    assert rows.loc[("logged", "IQL-RM"), "dataset_score"] == logged
    assert rows.loc[("logged", "IQL-OTR"), "dataset_score"] == logged

    run_dir = Path(rows.loc[("no-rewards", "IQL-OTR"), "dir"])
    model = offrl.load(run_dir / "model.pt")
    labeler = model.steps[0][1]
    assert isinstance(labeler, OTRewardLabeler) and labeler.demonstrations_.shape[0] == 1
    fresh = OTRewardLabeler(str(expert)).fit(Dataset.load(unlabelled))
    np.testing.assert_array_equal(labeler.transform(Dataset.load(unlabelled)).rewards,
                                  fresh.transform(Dataset.load(unlabelled)).rewards)
    obs = data.observations[:5]
    assert model.predict(obs).shape == (5, 1)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["labelers"] == [["OTRewardLabeler", {"expert": str(expert)}]]
    # The learned labeller took the run's seed and the sweep's device.
    rm = offrl.load(Path(rows.loc[("logged", "IQL-RM"), "dir"]) / "model.pt").steps[0][1]
    assert rm.random_state == 0 and rm.device == "cpu"


def test_labelled_runs_evaluate_ope_on_the_logged_rewards(tmp_path, pendulum_npz, monkeypatch):
    """OPE of a run on relabelled rewards reads the logged data (the true value is in the env's rewards); on data
    that lacks rewards it is skipped with the reason.  Runs execute in this process, with the OPE call recorded."""
    import offrl
    from offrl import sweep

    data = Dataset.load(pendulum_npz)
    unlabelled = tmp_path / "no-rewards.npz"
    data.without_rewards().save(unlabelled)
    expert = tmp_path / "demo.npz"
    data.subset([0]).save(expert)
    labelers = [{"OTRewardLabeler": {"expert": str(expert)}}, {"RewardScaler": {"method": "none"}},
                {"RewardScaler": {"method": "std"}}]
    algorithms = {"BC-OTR": {"algorithm": "BC", "hidden_dims": [32, 32], "labelers": labelers},
                  "BC": {"hidden_dims": [32, 32]}}
    datasets = [{"spec": str(pendulum_npz), "label": "logged"}, {"spec": str(unlabelled), "label": "no-rewards"}]
    config = write_config(tmp_path / "sweep.yaml", datasets, steps=20, seeds=(0,), algorithms=algorithms)
    raw = yaml.safe_load(config.read_text())
    raw["ope"] = {"estimators": ["FQE"], "rollouts": 2}
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    seen = []
    monkeypatch.setattr(sweep, "_run_ope", lambda algo, dataset, env, cfg, seed: seen.append(dataset.rewards.copy())
                        or {"FQE": "recorded"})
    results = {(run["dataset"]["label"], run["variant"]): sweep.execute_run(run)
               for run in sweep.expand_runs(load_config(config), tmp_path / "out")}
    assert all(r["status"] == "ok" for r in results.values())  # BC needs no rewards
    assert results[("logged", "BC-OTR")]["ope"] == {"FQE": "recorded"}
    assert len(seen) == 2  # the two runs on logged data, each given the logged rewards, not OTR's
    for rewards in seen:
        np.testing.assert_array_equal(rewards, data.rewards)
    for key in [("no-rewards", "BC-OTR"), ("no-rewards", "BC")]:
        assert results[key]["ope"] == {"skipped": "the logged data lacks rewards, so its estimates would not be in "
                                                  "the environment's rewards"}
    model = offrl.load(Path(results[("logged", "BC-OTR")]["dir"]) / "model.pt")
    assert [name for name, _ in model.steps] == ["otrewardlabeler", "rewardscaler-1", "rewardscaler-2", "bc"]


def test_an_algorithm_can_run_on_some_of_the_datasets_only(tmp_path, pendulum_npz):
    from offrl.sweep import expand_runs

    datasets = [{"spec": str(pendulum_npz), "label": "a"}, {"spec": str(pendulum_npz), "label": "b"}]
    everywhere = {"BC": {"hidden_dims": [8]}, "IQL": {"hidden_dims": [8]}}
    restricted = {"BC": {"hidden_dims": [8]}, "IQL": {"hidden_dims": [8], "datasets": ["b"]}}

    def runs(algorithms):
        raw = {"name": "some", "datasets": datasets, "algorithms": algorithms, "seeds": [0, 1], "steps": 4}
        return {(r["dataset"]["label"], r["label"], r["seed"]): r["hash"]
                for r in expand_runs(parse_config(raw), tmp_path / "out")}

    full, some = runs(everywhere), runs(restricted)
    assert sorted(set(full) - set(some)) == [("a", "IQL", 0), ("a", "IQL", 1)]
    assert all(some[k] == full[k] for k in some)  # the runs that remain are the same runs (same hashes)

    def error(only):
        raw = {"name": "some", "datasets": datasets, "algorithms": {"IQL": {"datasets": only}}, "steps": 4}
        with pytest.raises(ConfigError) as info:
            parse_config(raw)
        return str(info.value)

    assert "algorithms.IQL.datasets: no dataset is labelled 'c'; the config's dataset labels are ['a', 'b']" in error(["a", "c"])
    for bad in ([], "b", [3]):
        assert "algorithms.IQL.datasets: datasets must be a non-empty list of the dataset labels IQL runs on" in error(bad)


def test_a_hyper_parameter_that_takes_settings_is_given_a_mapping(tmp_path, pendulum_npz):
    from offrl.sweep import expand_runs

    guide = {"expert": str(pendulum_npz), "normalize": True, "lr": 1e-3}
    raw = {"name": "guided", "datasets": [{"spec": str(pendulum_npz), "label": "p"}], "seeds": [0], "steps": 4,
           "eval": {"every": 4, "episodes": 1},
           "algorithms": {"TD3PlusBC-GORL": {"algorithm": "TD3PlusBC", "hidden_dims": [8], "guide": guide},
                          "IQL-GORL": {"algorithm": "IQL", "hidden_dims": [8], "guide": {"grid": [guide, None]}}}}
    runs = expand_runs(parse_config(raw), tmp_path / "out")
    assert sorted(r["variant"].split("-")[0] for r in runs) == ["IQL", "IQL", "TD3PlusBC"]  # a grid of two for IQL
    results = run_sweep(parse_config(raw), workers=1, out=tmp_path / "out", progress=False)
    assert list(results["status"]) == ["ok"] * 3
    import offrl

    run_dir = tmp_path / "out" / "runs" / "p" / "TD3PlusBC-GORL" / "seed0"
    assert offrl.load(run_dir / "model.pt").guide == guide
    import pandas as pd

    assert pd.read_csv(run_dir / "train.csv")["guide_scale_mean"].iloc[-1] == pytest.approx(1.0, abs=1e-5)
    raw["algorithms"] = {"BC": {"lr": {"low": 1e-4, "high": 1e-3}}}
    with pytest.raises(ConfigError, match=r"algorithms\.BC\.lr: BC: lr must be a real number .*a mapping value is a "
                                          r"grid only as \{grid: \[v1, v2, \.\.\.\]\}"):
        parse_config(raw)


def test_a_selection_runs_part_of_the_sweep_as_the_whole_sweep_would(tmp_path, pendulum_npz):
    """--algorithms/--datasets/--seeds start some runs of a config; each is the run the whole config makes (same
    directory and hash), and the summary lists every run found in the output folder."""
    from offrl.sweep import expand_runs, select_runs

    datasets = [{"spec": str(pendulum_npz), "label": "a"}, {"spec": str(pendulum_npz), "label": "b"}]
    algorithms = {"BC": {"hidden_dims": [8]}, "BC-small-lr": {"algorithm": "BC", "hidden_dims": [8], "lr": 1e-4}}
    config = parse_config({"name": "part", "datasets": datasets, "algorithms": algorithms, "seeds": [0, 1],
                           "steps": 20, "eval": {"every": 20, "episodes": 1}}, source="part.yaml")
    whole = {r["dir"]: r["hash"] for r in expand_runs(config, tmp_path / "out")}
    part = select_runs(config, algorithms="BC-small-lr", datasets=["b"], seeds="1, 3")
    chosen = {r["dir"]: r["hash"] for r in expand_runs(part, tmp_path / "out")}
    assert sorted(Path(d).relative_to(tmp_path / "out" / "runs").as_posix() for d in chosen) == [
        "b/BC-small-lr/seed1", "b/BC-small-lr/seed3"]
    assert all(whole[d] == h for d, h in chosen.items() if d in whole)  # seed 1: the whole config's run
    assert config.seeds == [0, 1] and list(config.algorithms) == ["BC", "BC-small-lr"]  # the config is not changed

    first = run_sweep(config, workers=1, out=tmp_path / "out", progress=False, algorithms=["BC"], seeds=[0])
    assert len(first) == 2 and set(first["dataset"]) == {"a", "b"} and set(first["seed"]) == {0}
    done = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("runs/**/result.json")}
    second = run_sweep(config, workers=1, out=tmp_path / "out", progress=False, datasets="a")
    assert len(second) == 5 and (second["status"] == "ok").all()  # 2 from the first selection, 3 new ones on "a"
    assert all(p.stat().st_mtime_ns == t for p, t in done.items())  # what ran before is not run again
    assert sorted(second.loc[second["dataset"] == "a", "variant"] + "/" + second.loc[second["dataset"] == "a", "seed"]
                  .astype(str)) == ["BC-small-lr/0", "BC-small-lr/1", "BC/0", "BC/1"]

    with pytest.raises(ValueError, match=r"algorithm label\(s\) \['CQL'\] not in part.yaml; its algorithms are "
                                         r"\['BC', 'BC-small-lr'\]"):
        select_runs(config, algorithms="BC,CQL")
    with pytest.raises(ValueError, match=r"dataset label\(s\) \['c'\] not in part.yaml; its datasets are \['a', 'b'\]"):
        select_runs(config, datasets="c")
    for bad in ("1,x", "-1", "2,2", ""):
        with pytest.raises(ValueError, match="seeds must be"):
            select_runs(config, seeds=bad)
    only_b = parse_config({"name": "part", "datasets": datasets, "steps": 20,
                           "algorithms": {"IQL": {"hidden_dims": [8], "datasets": ["b"]}}}, source="part.yaml")
    with pytest.raises(ValueError, match=r"no run of part.yaml matches: the selected algorithms \['IQL'\] run on none "
                                         r"of the selected datasets \['a'\]"):
        select_runs(only_b, datasets="a")


def test_the_cli_selection_needs_only_the_selected_data(tmp_path, pendulum_npz, capsys):
    missing = tmp_path / "not-there.npz"
    config = write_config(tmp_path / "sweep.yaml", [{"spec": str(pendulum_npz), "label": "here"},
                                                    {"spec": str(missing), "label": "gone"}],
                          steps=20, seeds=(0, 1, 2), algorithms={"BC": {"hidden_dims": [8]}})
    out = tmp_path / "out"
    assert cli_main(["sweep", str(config), "--out", str(out), "--no-progress"]) == 2  # the whole config: refused
    assert "not-there.npz" in capsys.readouterr().err and not out.exists()
    assert cli_main(["sweep", str(config), "--out", str(out), "--no-progress", "--datasets", "here",
                     "--seeds", "2"]) == 0
    assert [p.parent.relative_to(out / "runs").as_posix() for p in out.glob("runs/**/result.json")] == ["here/BC/seed2"]
    with pytest.raises(ConfigError, match="not-there.npz"):  # from Python, the same: the whole config is refused...
        run_sweep(config, workers=1, out=out, progress=False)
    table = run_sweep(config, workers=1, out=out, progress=False, datasets=["here"], seeds=[2])  # ...a part is not
    assert list(table["seed"]) == [2] and (table["status"] == "ok").all()
    assert cli_main(["sweep", str(config), "--out", str(out), "--no-progress", "--datasets", "gone"]) == 2
    assert "datasets (gone)" in capsys.readouterr().err


def test_a_one_worker_sweep_shows_the_step_of_its_run_while_it_trains(tmp_path, pendulum_npz, monkeypatch):
    import threading

    import offrl.sweep as sweep

    monkeypatch.setattr(sweep, "_POLL_SECONDS", 0.01)
    shown = []  # the step counts of the bar's refreshes made outside the training thread
    original = sweep._Progress.show

    def show(view):
        original(view)
        if threading.current_thread() is not threading.main_thread():
            shown.append(view.bar.postfix)

    monkeypatch.setattr(sweep._Progress, "show", show)
    config = write_config(tmp_path / "sweep.yaml", [str(pendulum_npz)], steps=1500, seeds=(0,),
                          algorithms={"BC": {"hidden_dims": [32, 32]}})
    results = run_sweep(config, workers=1, out=tmp_path / "out", progress=True)
    assert list(results["status"]) == ["ok"]
    assert any("BC/s0" in postfix and "/1500" in postfix for postfix in shown), shown[-3:]


def test_a_one_worker_sweep_gives_the_caller_its_torch_thread_count_back(tmp_path, pendulum_npz):
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)  # not the sweep's threads_per_run (1), which each run sets for itself
        config = write_config(tmp_path / "sweep.yaml", [str(pendulum_npz)], steps=50, seeds=(0,),
                              algorithms={"BC": {"hidden_dims": [16]}})
        results = run_sweep(config, workers=1, out=tmp_path / "out", progress=False)
        assert list(results["status"]) == ["ok"]
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
