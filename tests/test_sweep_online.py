"""Sweeps that go online after the offline phase (`online:`), on a recorded Pendulum-v1 dataset, run in-process."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import yaml

import offrl
from conftest import random_pendulum_npz
from offrl.algos import IQL
from offrl.report import results_frame, write_report
from offrl.sweep import ConfigError, expand_runs, load_config, parse_config, run_sweep

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"hidden_dims": [32, 32], "batch_size": 32}
OFFLINE_STEPS = 100
ONLINE_STEPS = 400
ALGORITHMS = {
    "IQL-jsrl": {"algorithm": "IQL", **SMALL, "online": {"steps": ONLINE_STEPS, "strategy": "jsrl", "eval_every": 40}},
    "IQL-rlpd": {"algorithm": "IQL", **SMALL, "n_critics": 4,
                 "online": {"steps": ONLINE_STEPS, "eval_every": 40,
                            "strategy": {"rlpd": {"warmup_steps": 50, "utd_ratio": 1, "n_critics": 4}}}},
    "SAC-rlpd": {"algorithm": "SAC", **SMALL,
                 "online": {"steps": 200, "eval_every": 20,
                            "strategy": {"rlpd": {"warmup_steps": 50, "utd_ratio": 1, "n_critics": 4}}}},
}


@pytest.fixture(scope="module")
def pendulum_npz(tmp_path_factory) -> Path:
    """A small real Pendulum-v1 dataset (uniform-random behaviour, 4 episodes) saved with Dataset.save."""
    return random_pendulum_npz(tmp_path_factory.mktemp("data") / "pendulum.npz", n_episodes=4)


def write_config(path: Path, data: Path, algorithms: dict) -> Path:
    config = {"name": "online", "datasets": [{"spec": str(data), "label": "pendulum"}], "algorithms": algorithms,
              "seeds": [0], "steps": OFFLINE_STEPS, "eval": {"every": 50, "episodes": 2}, "log_every": 50}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def finished_sweep(pendulum_npz, tmp_path_factory) -> tuple[Path, Path, dict[str, dict]]:
    """(config, out, variant -> result.json) of one sweep of the three online variants, run in this process."""
    root = tmp_path_factory.mktemp("sweep")
    config = write_config(root / "sweep.yaml", pendulum_npz, ALGORITHMS)
    out = root / "out"
    results = run_sweep(config, workers=1, out=out, progress=False)
    assert (results["status"] == "ok").all(), results.get("error")
    runs = {row.variant: json.loads((Path(row.dir) / "result.json").read_text()) for row in results.itertuples()}
    return config, out, runs


def _policy_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.policy_.state_dict().items()}


@pytest.mark.parametrize("variant, strategy", [("IQL-jsrl", "jsrl"), ("IQL-rlpd", "rlpd")])
def test_offline_then_online_results_cover_both_phases(finished_sweep, variant, strategy):
    _, _, runs = finished_sweep
    result = runs[variant]
    online = result["online_history"]
    assert result["strategy"] == strategy and result["online_steps"] == ONLINE_STEPS
    assert result["switch_step"] == OFFLINE_STEPS and result["steps"] == OFFLINE_STEPS
    assert [row["step"] for row in online] == list(range(40, ONLINE_STEPS + 1, 40))
    # history: the offline rows, then the online rows with their steps counted after the offline ones
    offline = [row for row in result["history"] if row["phase"] == "offline"]
    shifted = [row for row in result["history"] if row["phase"] == "online"]
    assert [row["step"] for row in offline] == [50, 100]
    assert result["history"] == offline + shifted
    assert [row["step"] for row in shifted] == [row["step"] + OFFLINE_STEPS for row in online]
    assert [row["return_mean"] for row in shifted] == [row["return_mean"] for row in online]
    assert result["offline_score"] == offline[-1]["normalized_score_mean"]
    assert math.isfinite(result["offline_score"])
    assert result["final_score"] == online[-1]["normalized_score_mean"]
    assert result["final_return"] == online[-1]["return_mean"]
    assert result["dip_score"] == min(r["normalized_score_mean"] for r in online if r["step"] <= 40)
    best = max(result["history"], key=lambda r: r["return_mean"])
    assert result["best_score"] == best["normalized_score_mean"]
    if strategy == "jsrl":
        assert all("guide_horizon" in row for row in online)


@pytest.mark.parametrize("variant", ["IQL-jsrl", "IQL-rlpd"])
def test_the_offline_and_the_fine_tuned_models_are_both_saved(finished_sweep, variant):
    _, _, runs = finished_sweep
    run_dir = Path(runs[variant]["dir"])
    offline_model = offrl.load(run_dir / "model_offline.pt")
    tuned = offrl.load(run_dir / "model.pt")
    assert offline_model.n_steps_done_ == OFFLINE_STEPS and not hasattr(offline_model, "online_steps_done_")
    assert tuned.online_steps_done_ == ONLINE_STEPS
    assert tuned.online_strategy_["name"] == runs[variant]["strategy"]
    before, after = _policy_weights(offline_model), _policy_weights(tuned)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (run_dir / "online" / "online_checkpoint.pt").exists() and (run_dir / "online" / "eval.csv").exists()


def test_an_online_learner_trains_from_scratch_with_the_datasets_scores(finished_sweep):
    _, _, runs = finished_sweep
    result = runs["SAC-rlpd"]
    run_dir = Path(result["dir"])
    assert result["steps"] == 0 and result["switch_step"] == 0 and result["strategy"] == "rlpd"
    assert math.isnan(result["offline_score"]) and not (run_dir / "model_offline.pt").exists()
    assert {row["phase"] for row in result["history"]} == {"online"}
    # SAC knows only the env; its scores come from the dataset's reference returns (-1200 and -150)
    for row in result["online_history"]:
        assert row["normalized_score_mean"] == pytest.approx(100 * (row["return_mean"] + 1200) / 1050)
    assert result["dip_score"] == min(r["normalized_score_mean"] for r in result["online_history"] if r["step"] <= 20)
    sac = offrl.load(run_dir / "model.pt")
    assert sac.n_steps_done_ == 200 and sac.critic_.n_critics == 4


def test_a_second_sweep_skips_the_finished_runs(finished_sweep):
    config, out, runs = finished_sweep
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/**/*.pt")}
    results = run_sweep(config, workers=1, out=out, progress=False)
    assert (results["status"] == "ok").all() and len(results) == len(ALGORITHMS)
    assert stamps == {p: p.stat().st_mtime_ns for p in out.glob("runs/**/*.pt")}
    for result in runs.values():
        assert json.loads((Path(result["dir"]) / "result.json").read_text())["hash"] == result["hash"]


def test_an_interrupted_online_phase_resumes_to_the_same_result(finished_sweep, pendulum_npz, tmp_path, monkeypatch):
    """The online phase dies at step 280 (its checkpoint is from the episode end at 200); the next sweep resumes it
    and ends where the uninterrupted run ended.  A run that lost only its result.json finishes again the same."""
    _, _, runs = finished_sweep
    config = write_config(tmp_path / "sweep.yaml", pendulum_npz, {"IQL-jsrl": ALGORITHMS["IQL-jsrl"]})
    out = tmp_path / "out"
    original = IQL.fit_online

    def crash(algo, step, row):
        if step >= 280:
            raise RuntimeError("worker lost")

    def crashing_fit_online(self, *args, **kwargs):
        return original(self, *args, **{**kwargs, "callbacks": [crash]})

    monkeypatch.setattr(IQL, "fit_online", crashing_fit_online)
    first = run_sweep(config, workers=1, out=out, progress=False)
    assert list(first["status"]) == ["failed"]
    run_dir = Path(first["dir"].iloc[0])
    assert "worker lost" in (run_dir / "error.txt").read_text()
    assert not (run_dir / "result.json").exists() and (run_dir / "online" / "online_checkpoint.pt").exists()
    assert torch.load(run_dir / "online" / "online_checkpoint.pt",
                      weights_only=False)["online_checkpoint"]["step"] == 200

    monkeypatch.setattr(IQL, "fit_online", original)
    resumed = run_sweep(config, workers=1, out=out, progress=False)
    assert list(resumed["status"]) == ["ok"] and not (run_dir / "error.txt").exists()
    result = json.loads((run_dir / "result.json").read_text())
    reference = runs["IQL-jsrl"]
    assert result["hash"] == reference["hash"]
    assert result["final_score"] == reference["final_score"]
    assert result["online_history"] == reference["online_history"]

    (run_dir / "result.json").unlink()
    again = run_sweep(config, workers=1, out=out, progress=False)
    assert list(again["status"]) == ["ok"]
    assert json.loads((run_dir / "result.json").read_text())["final_score"] == reference["final_score"]


def test_the_report_marks_the_switch_and_shows_offline_to_final(finished_sweep):
    _, out, runs = finished_sweep
    paths = write_report(out)
    page = paths["html"].read_text()
    assert "Dashed vertical line marked online: the switch from offline training to online fine-tuning, at step 100 " \
           "(IQL-jsrl and IQL-rlpd)" in page
    offline, final = runs["IQL-jsrl"]["offline_score"], runs["IQL-jsrl"]["final_score"]
    assert f"{offline:.1f} → {final:.1f}" in page
    assert f"dip {runs['IQL-jsrl']['dip_score']:.1f}" in page
    assert f"{runs['SAC-rlpd']['final_score']:.1f} (from scratch)" in page
    frame = results_frame(out)
    assert {"offline_score", "dip_score", "strategy", "online_steps"} <= set(frame.columns)
    assert "online_history" not in frame.columns
    row = frame.set_index("variant").loc["IQL-rlpd"]
    assert row["strategy"] == "rlpd" and row["online_steps"] == ONLINE_STEPS
    assert row["dip_score"] == runs["IQL-rlpd"]["dip_score"]
    table = (out / "table.csv").read_text().splitlines()[0]
    assert "IQL-jsrl (offline)" in table and "IQL-jsrl (dip)" in table


def test_a_config_without_online_keeps_its_hash():
    """Hashes recorded before `online:` existed: a config that does not use it re-runs nothing."""
    config = {"name": "fixed", "datasets": [{"spec": "data/pendulum.npz", "label": "pm"}],
              "algorithms": {"IQL": {"hidden_dims": [32, 32], "batch_size": 32},
                             "BC-x": {"algorithm": "BC", "lr": [0.001, 0.0003]}},
              "seeds": [0], "steps": 100, "eval": {"every": 50, "episodes": 2, "env": "Pendulum-v1"}}
    runs = expand_runs(parse_config(config, check_datasets=False), "unused")
    assert {r["variant"]: r["hash"] for r in runs} == {
        "IQL": "e237aa8677b2", "BC-x-bb90828f": "d0bc579ad98a", "BC-x-edfeec77": "6dd3ed4605d4"}
    assert all("online" not in r for r in runs)
    config["algorithms"]["IQL"]["online"] = {"steps": 1000}
    online = {r["variant"]: r for r in expand_runs(parse_config(config, check_datasets=False), "unused")}
    assert online["IQL"]["hash"] != "e237aa8677b2" and online["BC-x-bb90828f"]["hash"] == "d0bc579ad98a"
    assert online["IQL"]["online"] == {"steps": 1000, "n_envs": 1, "eval_every": 50, "offline_data": True,
                                       "strategy": "naive"}


@pytest.mark.parametrize(
    "algorithms, key, needle",
    [
        ({"IQL": {"online": {"steps": 100, "stratgy": "wsrl"}}}, "algorithms.IQL.online.stratgy",
         "unknown online key 'stratgy'"),
        ({"IQL": {"online": {"steps": 100, "strategy": "warm"}}}, "algorithms.IQL.online.strategy",
         "strategy 'warm' is unknown"),
        ({"IQL": {"online": {"steps": 100, "strategy": {"jsrl": {"n_stages": 0}}}}}, "algorithms.IQL.online.strategy",
         "n_stages must be an integer of at least 1"),
        ({"IQL": {"online": {"steps": 100, "strategy": {"jsrl": {"stages": 3}}}}}, "algorithms.IQL.online.strategy",
         "unexpected keyword argument 'stages'"),
        ({"IQL": {"online": {"strategy": "jsrl"}}}, "algorithms.IQL.online", "online needs steps"),
        ({"IQL": {"online": {"steps": 0}}}, "algorithms.IQL.online.steps", "steps must be an integer >= 1"),
        ({"IQL": {"online": {"steps": 100, "offline_data": "yes"}}}, "algorithms.IQL.online.offline_data",
         "offline_data must be true or false"),
        ({"SAC": {"hidden_dims": [32, 32]}}, "algorithms.SAC", "SAC learns online and needs an online: block"),
        ({"IQL": {"online": {"steps": 100, "strategy": "wsrl"}}}, "algorithms.IQL.online.strategy",
         "set n_critics: 10"),
        ({"IQL": {"online": {"steps": 100, "strategy": "calql"}}}, "algorithms.IQL.online.strategy",
         "needs a CalQL algorithm"),
        ({"BC": {"online": {"steps": 100}}}, "algorithms.BC.online", "BC has no critic to continue online"),
    ],
)
def test_bad_online_config_is_reported_with_its_key_and_line(tmp_path, pendulum_npz, algorithms, key, needle):
    path = tmp_path / "bad.yaml"
    config = {"name": "bad", "datasets": [str(pendulum_npz)], "algorithms": algorithms, "seeds": [0], "steps": 10}
    path.write_text(yaml.safe_dump(config, sort_keys=False, default_flow_style=False))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert info.value.key == key and needle in message, message
    line = path.read_text().splitlines()[int(message.split(":")[1]) - 1]
    assert key.rsplit(".", 1)[-1] + ":" in line, (message, line)


def test_going_online_needs_an_environment(pendulum_npz):
    config = {"datasets": [{"spec": str(pendulum_npz), "eval_env": None}], "algorithms": {"IQL": {"online": {"steps": 10}}},
              "steps": 10}
    with pytest.raises(ConfigError, match="sets eval_env: null, so there is no environment to fine-tune in"):
        parse_config(config)


def test_an_unmeasurable_dip_is_warned_about_at_parse_time(pendulum_npz):
    def parse(online: dict) -> list[str]:
        config = {"datasets": [str(pendulum_npz)], "algorithms": {"IQL": {"online": online}}, "steps": 10}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            parse_config(config)
        return [str(w.message) for w in caught if "dip" in str(w.message)]

    assert parse({"steps": 1000, "eval_every": 100}) == []
    assert parse({"steps": 1000}) == []  # the default, steps // 20, measures it
    (message,) = parse({"steps": 1000, "eval_every": 101})
    assert "algorithms.IQL.online.eval_every" in message and "use eval_every <= 100" in message


def test_the_finetune_experiments_parse():
    root = Path(__file__).resolve().parents[1] / "experiments"
    variants = {"IQL-naive", "IQL-jsrl", "IQL-rlpd", "IQL-wsrl", "IQL-e2o", "CQL-naive", "CQL-wsrl", "CQL-e2o",
                "CalQL-calql", "SAC-scratch", "SAC-rlpd-scratch"}
    for name, steps, every in (("finetune_pendulum.yaml", 20000, 1000), ("finetune_hopper.yaml", 100000, 5000)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # each measures its dip
            config = load_config(root / name, check_datasets=False)
        assert set(config.algorithms) == variants
        assert {a["online"]["steps"] for a in config.algorithms.values()} == {steps}
        assert {a["online"]["eval_every"] for a in config.algorithms.values()} == {every}
        assert config.algorithms["SAC-scratch"]["online"]["strategy"] is None
        assert config.algorithms["SAC-scratch"]["online"]["offline_data"] is False
        assert config.algorithms["SAC-rlpd-scratch"]["online"]["strategy"] == "rlpd"
