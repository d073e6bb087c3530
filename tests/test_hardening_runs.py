"""Hardening of runs, sweeps, builds and model files (issue 11, points 8, 9, 11, 12, 13).

Each test reproduces one fault of the issue (it failed before the fix) and
checks how the bad input is now refused.  Build-cache damage is tested in
test_build.py, next to the build it damages.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

import offrl
import offrl.cli
from conftest import pendulum_shaped_dataset
from offrl.algos import BC
from offrl.datasets.files import check_path_name, wait_for_lock
from offrl.monitor import TrainingDivergedError, read_checkpoint, write_checkpoint
from offrl.serialization import model_payload
from offrl.sweep import ConfigError, expand_runs, load_config, parse_config, run_sweep

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(hidden_dims=(8,), batch_size=16)


@pytest.fixture(scope="module")
def data():
    return pendulum_shaped_dataset(n_episodes=4, length=25)


@pytest.fixture(scope="module")
def npz(tmp_path_factory, data) -> Path:
    path = tmp_path_factory.mktemp("data") / "pendulum.npz"
    data.save(path)
    return path


@pytest.fixture(scope="module")
def fitted(data):
    return BC(**SMALL, random_state=0).fit(data, n_steps=2, progress=False)


def base_config(npz: Path, **changes) -> dict:
    config = {"name": "hard", "datasets": [str(npz)], "algorithms": {"BC": {"hidden_dims": [8]}}, "seeds": [0],
              "steps": 4, "eval": {"every": 4, "episodes": 1}}
    config.update(changes)
    return config


# ---------------------------------------------------------------------------------------- 8. paths
def test_a_sweep_label_or_key_cannot_escape_the_output_folder(tmp_path, npz, capsys):
    """The issue's config: a dataset label and an algorithm key full of '..' wrote a whole run outside `out`."""
    out = tmp_path / "a" / "b" / "c" / "out"
    config = base_config(npz, datasets=[{"spec": str(npz), "label": "../../../../escaped_ds"}],
                         algorithms={"../../../escaped_algo": {"algorithm": "BC", "hidden_dims": [8]}})
    path = tmp_path / "escape.yaml"
    path.write_text(yaml.safe_dump(config))
    assert offrl.cli.main(["sweep", str(path), "--out", str(out), "--no-progress"]) == 2
    assert "datasets.0.label: label '../../../../escaped_ds' contains a path separator" in capsys.readouterr().err
    assert not any(tmp_path.rglob("escaped*")) and not out.exists()
    config["datasets"] = [str(npz)]
    with pytest.raises(ConfigError, match=r"algorithms\.\.\./\.\./\.\./escaped_algo: algorithm key "
                                          r"'\.\./\.\./\.\./escaped_algo' contains a path separator"):
        parse_config(config)
    for name in ("..", "/etc", "a/b", ".hidden", "x\\y"):
        with pytest.raises(ConfigError, match="name"):
            parse_config(base_config(npz, name=name))


def test_a_derived_dataset_label_is_sanitised_not_refused(tmp_path, data):
    odd = tmp_path / ".hidden dir" / "my data (1).npz"
    odd.parent.mkdir()
    data.save(odd)
    relative = os.path.relpath(odd)  # starts with '..' or '.', and holds a space
    config = parse_config(base_config(odd, datasets=[str(odd), "./" + relative]))
    labels = [d["label"] for d in config.datasets]
    for label in labels:
        assert check_path_name(label, "label") == label
    runs = expand_runs(config, tmp_path / "out")
    for run in runs:
        assert (tmp_path / "out" / "runs").resolve() in Path(run["dir"]).resolve().parents


def test_a_built_dataset_name_cannot_make_a_folder_outside_the_cache(tmp_path):
    from offrl.datasets.built import parse_name

    # '/' passed the old name check and made the SAC run's folder the absolute path /-v1/seed0.
    for name in ("/-medium-v1", "..-medium-v1", "./-medium-v1"):
        with pytest.raises(ValueError, match="dataset name"):
            parse_name(name, env_id="Pendulum-v1")
    assert offrl.cli.main(["datasets", "build", "/-medium-v1", "--env-id", "Pendulum-v1",
                           "--data-dir", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------- 9. concurrency
def _fake_current_build(root: Path, seed: int = 7) -> None:
    """A built pendulum-medium-v1 whose record holds the full configuration `build` checks (no SAC run)."""
    from conftest import make_episodes

    from offrl.builder import _make_config
    from offrl.datasets import Dataset
    from offrl.datasets.built import DEFAULT_EVAL_EPISODES, DEFAULT_N_ENVS, DEFAULT_REF_EPISODES, dataset_path
    from offrl.datasets.minari import to_minari

    cfg = _make_config("pendulum-medium-v1", n_transitions=None, seed=seed, sac_steps=None, eval_every=None,
                       eval_episodes=DEFAULT_EVAL_EPISODES, ref_episodes=DEFAULT_REF_EPISODES, sac_params=None,
                       n_envs=DEFAULT_N_ENVS, checkpoint_every=None, device="cpu", expert="final", env_id=None)
    ds = Dataset.from_episodes(make_episodes((5, 4), obs_dim=3, act_dim=1, log_probs=True))
    dataset_id = cfg.dataset_id("medium")
    md = to_minari(ds, dataset_id, env="Pendulum-v1", ref_min_score=-1200.0, ref_max_score=-150.0, data_path=root)
    md.storage.update_metadata({"offrl_build": {
        "name": "pendulum-medium-v1", "kind": "medium", "dataset_id": dataset_id, "config": cfg.data_config(),
        "medium_step": 100, "expert_step": 200, "cut_episodes": [], "n_transitions": ds.n_transitions,
        "n_episodes": ds.n_episodes, "return_mean": 0.0, "return_std": 0.0, "normalized_score_mean": 0.0,
        "normalized_score_std": 0.0, "ref_min_score": -1200.0, "ref_max_score": -150.0, "medium_eval_score": 33.0,
        "expert_deterministic_return": None}})
    del md
    assert (dataset_path(root, dataset_id) / "data").is_dir()


def test_a_second_build_waits_for_the_first_and_uses_its_result(tmp_path, capfd):
    """A second process building the same dataset failed at once with BlockingIOError (a sweep lost a run)."""
    from offrl.builder import load_or_build
    from offrl.datasets.built import resolve

    run_dir = resolve("pendulum-medium-v1", seed=7).run_dir(tmp_path)
    outcome: dict = {}

    def second_build() -> None:
        try:
            outcome["dataset"] = load_or_build("pendulum-medium-v1", seed=7, data_dir=tmp_path, progress=False)
        except BaseException as err:  # noqa: BLE001 - reported by the assertions below
            outcome["error"] = err

    with wait_for_lock(run_dir / "lock", "the first build", timeout=0):  # the first build holds the run's lock
        thread = threading.Thread(target=second_build)
        thread.start()
        time.sleep(2.0)
        assert "error" not in outcome, outcome.get("error")
        assert thread.is_alive(), "the second build should wait for the first"
        _fake_current_build(tmp_path, seed=7)  # what the first build leaves behind
    thread.join(60)
    assert not thread.is_alive() and "error" not in outcome, outcome.get("error")
    assert outcome["dataset"].n_transitions == 9 and outcome["dataset"].metadata["kind"] == "medium"
    assert "waiting for another process busy with building pendulum-v1" in capfd.readouterr().err
    assert not (run_dir / "run.json").exists()  # it trained nothing


def test_a_run_folder_is_written_by_one_process_at_a_time(tmp_path, npz, capfd):
    from offrl.sweep import execute_run, run_lock_path

    config = parse_config(base_config(npz))
    run = expand_runs(config, tmp_path / "out")[0]
    outcome: dict = {}
    with wait_for_lock(run_lock_path(run["dir"]), "another sweep's run", timeout=0):
        thread = threading.Thread(target=lambda: outcome.update(execute_run(run)))
        thread.start()
        time.sleep(1.5)
        assert thread.is_alive() and not outcome, "the run should wait for the folder's lock"
        assert not (Path(run["dir"]) / "config.json").exists()
    thread.join(120)
    assert outcome["status"] == "ok", outcome
    assert f"busy with run {run['dir']}" in capfd.readouterr().err


@pytest.mark.parametrize("backend, workers", [("local", 1), ("local", 2), ("ray", 2)])
def test_a_sweep_takes_its_other_runs_before_one_another_process_is_writing(tmp_path, npz, backend, workers,
                                                                             monkeypatch):
    """A second sweep on the same `out` used to queue behind the first one's run; now it does the free runs
    first, then waits for the busy one (with 2 workers the pool's or Ray's retry path does it)."""
    import fcntl

    if backend == "ray":
        pytest.importorskip("ray")

    import offrl.sweep
    from offrl.sweep import run_lock_path

    monkeypatch.setattr(offrl.sweep, "RUN_LOCK_TIMEOUT", 20.0)  # a sweep that waited in order fails, not hangs

    config = parse_config(base_config(npz, seeds=[0, 1, 2]))
    out = tmp_path / "out"
    busy = expand_runs(config, out)[0]  # the first run in the sweep's order
    Path(busy["dir"]).mkdir(parents=True)
    handle = open(run_lock_path(busy["dir"]), "a")
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # "another process" writing that run
    seen = []

    def on_result(result):
        seen.append((result["seed"], result["status"]))
        if len(seen) == 2:  # both free runs are done: the other process lets go of its run
            fcntl.flock(handle, fcntl.LOCK_UN)

    try:
        run_sweep(config, backend=backend, workers=workers, out=out, progress=False, on_result=on_result)
    finally:
        handle.close()
    assert sorted(seen[:2]) == [(1, "ok"), (2, "ok")]
    assert seen[2] == (0, "ok")  # waited for, then (nothing was written by the holder) trained here


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sweep_workers_die_with_their_parent(tmp_path, npz):
    """kill -9 of a sweep left its workers training and writing into run folders."""
    config = base_config(npz, steps=10_000_000, seeds=[0, 1], eval={"every": 10_000_000, "episodes": 1}, log_every=50)
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "offrl.cli", "sweep", str(path), "--workers", "2", "--out",
                             str(out), "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.time() + 180
        while time.time() < deadline and len(list(out.glob("runs/**/train.csv"))) < 2:
            time.sleep(0.25)
        workers = _children(proc.pid)
        assert len(workers) == 2 and len(list(out.glob("runs/**/train.csv"))) == 2
        os.kill(proc.pid, signal.SIGKILL)  # the parent only, as a crash or the OOM killer would
        proc.wait()
        deadline = time.time() + 5
        while time.time() < deadline and any(_alive(pid) for pid in workers):
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers), "workers outlived their sweep"
        sizes = {p: p.stat().st_size for p in out.glob("runs/**/train.csv")}
        time.sleep(1.0)
        assert sizes == {p: p.stat().st_size for p in out.glob("runs/**/train.csv")}, "a run folder is still written"
    finally:
        for pid in [proc.pid, *workers]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------- 11. model files
def _damage(payload: dict, how: str) -> None:
    state = payload["state"]["policy_"]
    if how == "no state":
        del payload["state"]
    elif how == "no spec entry":
        payload["spec"] = json.dumps({k: v for k, v in json.loads(payload["spec"]).items() if k != "obs_mean"})
    elif how == "spec not JSON":
        payload["spec"] = "{not json"
    elif how == "params not text":
        payload["params"] = 5
    elif how == "attributes a list":
        payload["attributes"] = "[1, 2]"
    elif how == "state a list":
        payload["state"]["policy_"] = [1, 2]
    elif how == "missing tensor":
        del state[next(iter(state))]
    elif how == "wrong shape":
        name = next(k for k, v in state.items() if v.ndim == 2)
        state[name] = torch.zeros(state[name].shape[0] + 1, state[name].shape[1])
    elif how == "not a tensor":
        state[next(iter(state))] = "weights"
    elif how == "nested a list":
        payload["nested"] = []


DAMAGES = ["no state", "no spec entry", "spec not JSON", "params not text", "attributes a list", "state a list",
           "missing tensor", "wrong shape", "not a tensor", "nested a list"]


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_model_file_is_named_with_the_fix(how, fitted, tmp_path):
    payload = model_payload(fitted)
    _damage(payload, how)
    path = tmp_path / "model.pt"
    torch.save(payload, path)
    with pytest.raises(ValueError) as info:
        offrl.load(path)
    message = str(info.value)
    assert str(path) in message and "re-save" in message, message


CHECKPOINT_DAMAGES = [d for d in DAMAGES if d not in ("params not text", "nested a list")]  # resume reads neither


@pytest.mark.parametrize("how", CHECKPOINT_DAMAGES + ["no step", "step text", "history a dict", "no rng", "rng text"])
def test_a_damaged_checkpoint_is_named_with_the_fix(how, fitted, tmp_path):
    path = tmp_path / "checkpoint.pt"
    generator = torch.Generator().manual_seed(0)
    write_checkpoint(path, fitted, generator, 2)
    payload = torch.load(path, weights_only=True)
    if how in DAMAGES:
        _damage(payload, how)
    else:
        ckpt = payload["checkpoint"]
        {"no step": lambda: ckpt.pop("step"), "step text": lambda: ckpt.update(step="two"),
         "history a dict": lambda: ckpt.update(history={}), "no rng": lambda: ckpt.pop("torch_rng"),
         "rng text": lambda: ckpt.update(generator="seed")}[how]()
    torch.save(payload, path)
    with pytest.raises(ValueError) as info:
        read_checkpoint(path, BC(**SMALL), torch.Generator())
    message = str(info.value)
    assert f"checkpoint {path}" in message and "delete it" in message, message


# ---------------------------------------------------------------------------------------- 12. sweep configs
BAD_CONFIGS = [
    # (what, change to the config, ConfigError key, words of the message)
    ("negative lr", {"algorithms": {"BC": {"lr": -1e-3}}}, "algorithms.BC.lr", "lr must be a real number > 0"),
    ("negative batch_size", {"algorithms": {"BC": {"batch_size": -5}}}, "algorithms.BC.batch_size",
     "batch_size must be an integer >= 1"),
    ("precision fp16", {"algorithms": {"BC": {"precision": "fp16"}}}, "algorithms.BC.precision",
     "precision must be one of"),
    ("string expectile", {"algorithms": {"IQL": {"expectile": "high"}}}, "algorithms.IQL.expectile",
     "expectile must be a real number"),
    ("expectile 1.5", {"algorithms": {"IQL": {"expectile": 1.5}}}, "algorithms.IQL.expectile",
     "expectile must be a real number in (0, 1)"),
    ("expectile true", {"algorithms": {"IQL": {"expectile": True}}}, "algorithms.IQL.expectile",
     "got True"),
    ("batch_size [64, 2.5]", {"algorithms": {"BC": {"batch_size": [64, 2.5]}}}, "algorithms.BC.batch_size[1]",
     "got 2.5"),
    ("expectile grid", {"algorithms": {"IQL": {"expectile": {"grid": [0.7, 1.0]}}}},
     "algorithms.IQL.expectile.grid[1]", "got 1.0"),
    ("repeated grid value", {"algorithms": {"BC": {"lr": [0.001, 0.001]}}}, "algorithms.BC.lr",
     "repeats 0.001"),
    ("hidden_dims 0", {"algorithms": {"BC": {"hidden_dims": [0]}}}, "algorithms.BC.hidden_dims",
     "positive integer layer widths"),
    ("unknown parameter", {"algorithms": {"BC": {"learning_rate": 0.1}}}, "algorithms.BC.learning_rate",
     "no hyper-parameter 'learning_rate'"),
    ("n_steps per algorithm", {"algorithms": {"BC": {"n_steps": 5}}}, "algorithms.BC.n_steps", "set by the sweep"),
    ("algorithm not text", {"algorithms": {"BC": {"algorithm": ["BC"]}}}, "algorithms.BC.algorithm",
     "must be an algorithm name"),
    ("params a list", {"algorithms": {"BC": [1, 2]}}, "algorithms.BC", "must be a mapping"),
    ("unknown eval_env", {"datasets": [{"spec": "NPZ", "eval_env": "NoSuchEnv-v0"}]}, "datasets.0.eval_env",
     "not a registered gymnasium environment"),
    ("unknown eval.env", {"eval": {"every": 2, "episodes": 1, "env": "Pendulum-v9"}}, "eval.env",
     "not a registered gymnasium environment"),
    ("label not text", {"datasets": [{"spec": "NPZ", "label": 5}]}, "datasets.0.label", "must be a string"),
    ("negative seed", {"seeds": [0, -1]}, "seeds", "non-negative"),
    ("seeds true", {"seeds": True}, "seeds", "got True"),
    ("steps true", {"steps": True}, "steps", "got True"),
    ("eval.every true", {"eval": {"every": True, "episodes": 1}}, "eval.every", "got True"),
    ("eval.episodes 0", {"eval": {"every": 2, "episodes": 0}}, "eval.episodes", "got 0"),
    ("checkpoint_every 2.5", {"checkpoint_every": 2.5}, "checkpoint_every", "got 2.5"),
    ("threads_per_run true", {"threads_per_run": True}, "threads_per_run", "got True"),
    ("log_every 0", {"log_every": 0}, "log_every", "got 0"),
    ("device gpu", {"device": "gpu"}, "device", "'auto', 'cpu', 'cuda'"),
    ("out a number", {"out": 5}, "out", "must be a folder path"),
    ("ope gamma true", {"ope": {"gamma": True}}, "ope.gamma", "got True"),
    ("ope rollouts 0", {"ope": {"rollouts": 0}}, "ope.rollouts", "got 0"),
    ("build option sac_steps -1", {"datasets": [{"spec": "offrl:pendulum-medium-v1", "build": {"sac_steps": -1}}]},
     "datasets.0.build.sac_steps", "got -1"),
    ("build option seed text", {"datasets": [{"spec": "offrl:pendulum-medium-v1", "build": {"seed": "0"}}]},
     "datasets.0.build.seed", "got '0'"),
    ("build sac_params value", {"datasets": [{"spec": "offrl:pendulum-medium-v1",
                                              "build": {"sac_params": {"lr": -1.0}}}]},
     "datasets.0", "lr must be a real number > 0"),
]


@pytest.mark.parametrize("what, change, key, words", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_a_bad_sweep_value_is_refused_before_any_run(what, change, key, words, npz, tmp_path):
    config = base_config(npz, **json.loads(json.dumps(change).replace('"NPZ"', json.dumps(str(npz)))))
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        run_sweep(path, out=tmp_path / "out", progress=False)
    assert info.value.key == key and words in str(info.value), str(info.value)
    assert str(info.value).startswith(f"{path}:")
    assert not (tmp_path / "out").exists()


def test_a_duplicate_yaml_key_is_refused(npz, tmp_path):
    """PyYAML keeps the last of two equal keys: the first IQL silently vanished from the sweep."""
    path = tmp_path / "dup.yaml"
    path.write_text(f"name: dup\ndatasets: [{npz}]\nalgorithms:\n  IQL: {{expectile: 0.7}}\n  BC: {{}}\n"
                    "  IQL: {expectile: 0.9}\nseeds: [0]\nsteps: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:6: algorithms.IQL: duplicate key 'IQL' (first on line 4)"), info.value
    path.write_text(f"name: dup\ndatasets: [{npz}]\nalgorithms: {{BC: {{}}}}\nsteps: 4\nsteps: 5\n")
    with pytest.raises(ConfigError, match=r":5: steps: duplicate key 'steps'"):
        load_config(path)


def test_bad_workers_and_backend_are_refused_before_any_run(npz, tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(base_config(npz)))
    for workers in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="workers must be a positive integer"):
            run_sweep(path, workers=workers, out=tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="backend must be 'local' or 'ray'"):
        run_sweep(path, backend="slurm", out=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_run_directory_outside_out_is_refused_even_for_a_config_built_by_hand(npz, tmp_path):
    config = parse_config(base_config(npz))
    config.datasets[0]["label"] = "../../outside"  # a SweepConfig edited after parsing
    with pytest.raises(ValueError, match=r"seed0 resolves to .*outside/BC/seed0, outside .*out/runs"):
        expand_runs(config, tmp_path / "out")


# ---------------------------------------------------------------------------------------- 13. checkpoints
def test_a_checkpoint_with_non_finite_weights_is_never_written(data, tmp_path):
    """lr=1e39 made every weight inf in step 1; that checkpoint was written and later called 'the last good'."""
    algo = BC(**SMALL, lr=1e39, random_state=0)
    with pytest.raises(TrainingDivergedError) as info:
        algo.fit(data, n_steps=3, log_dir=tmp_path, checkpoint_every=1, progress=False)
    message = str(info.value)
    assert "at step 1" in message and "policy_.net.0.weight" in message, message
    assert "no checkpoint has been written" in message
    assert not (tmp_path / "checkpoint.pt").exists()


def test_a_diverged_state_keeps_the_previous_checkpoint(fitted, tmp_path):
    path = tmp_path / "checkpoint.pt"
    generator = torch.Generator().manual_seed(0)
    algo = BC(**SMALL, random_state=0).fit(pendulum_shaped_dataset(n_episodes=2, length=10), n_steps=1,
                                           progress=False)
    write_checkpoint(path, algo, generator, 5)
    before = path.read_bytes()
    with torch.no_grad():
        next(algo.policy_.parameters())[0, 0] = float("nan")
    with pytest.raises(TrainingDivergedError, match=r"BC: 1 tensor of the state became NaN or inf at step 6 "
                                                    r"\(policy_\.net\.0\.weight\).*the last good checkpoint is "
                                                    rf"{path} \(step 5\)"):
        write_checkpoint(path, algo, generator, 6)
    assert path.read_bytes() == before


def test_resuming_from_a_checkpoint_with_non_finite_weights_is_refused(fitted, tmp_path):
    path = tmp_path / "checkpoint.pt"
    write_checkpoint(path, fitted, torch.Generator(), 2)
    payload = torch.load(path, weights_only=True)
    first = next(iter(payload["state"]["policy_"]))
    payload["state"]["policy_"][first] = torch.full_like(payload["state"]["policy_"][first], float("inf"))
    torch.save(payload, path)  # as an older offrl would have written it
    with pytest.raises(ValueError, match=rf"checkpoint {path}: .*NaN or inf.*policy_\.{first}.*delete it"):
        read_checkpoint(path, BC(**SMALL), torch.Generator())


def test_the_last_good_checkpoint_message_is_true(fitted, tmp_path):
    from offrl.monitor import TrainingMonitor

    path = tmp_path / "checkpoint.pt"
    monitor = TrainingMonitor(fitted, 10, progress=False, checkpoint_path=path)
    with pytest.raises(TrainingDivergedError) as info:
        monitor.finite({"loss": torch.tensor(float("nan"))}, 7)
    assert "no checkpoint has been written" in str(info.value)
    write_checkpoint(path, fitted, torch.Generator(), 5)
    with pytest.raises(TrainingDivergedError, match=rf"the last good checkpoint is {path} \(step 5\)"):
        monitor.finite({"loss": torch.tensor(float("nan"))}, 7)
    payload = torch.load(path, weights_only=True)
    first = next(iter(payload["state"]["policy_"]))
    payload["state"]["policy_"][first] = torch.full_like(payload["state"]["policy_"][first], float("nan"))
    torch.save(payload, path)  # as an older offrl would have written it
    with pytest.raises(TrainingDivergedError) as info:
        monitor.finite({"loss": torch.tensor(float("nan"))}, 7)
    assert "last good" not in str(info.value) and f"{path} (step 5) holds NaN or inf" in str(info.value)
