"""`offrl datasets info`: in process and through the installed console script."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import make_episodes
from offrl.cli import main
from offrl.datasets import Dataset, load


def info_rows(text: str) -> dict[str, str]:
    rows = {}
    for line in text.strip().splitlines():
        key, _, value = re.split(r"(\s{2,})", line.strip(), maxsplit=1)
        rows[key] = value
    return rows


def test_info_on_d4rl_file(d4rl_float32_file, capsys):
    path, _ = d4rl_float32_file
    assert main(["datasets", "info", str(path)]) == 0
    out = capsys.readouterr().out
    rows = info_rows(out)
    ds = load(str(path))
    returns = ds.episode_returns()
    scores = 100 * (returns + 20.272305) / (3234.3 + 20.272305)
    assert rows["dataset"] == "hopper_medium-v2"
    assert rows["transitions"] == "14"
    assert rows["episodes"] == "5"
    assert rows["observation dim"] == "3" and rows["action dim"] == "2"
    assert rows["terminals / timeouts"] == "2 / 3"
    assert rows["episode return"] == (
        f"mean {returns.mean():.3f} ± {returns.std():.3f}, min {returns.min():.3f}, max {returns.max():.3f}"
    )
    assert rows["normalised score"] == f"mean {scores.mean():.1f}, min {scores.min():.1f}, max {scores.max():.1f}"
    assert rows["behaviour log-probs"] == "present"


def test_info_on_saved_dataset_without_scores_or_log_probs(tmp_path, capsys):
    ds = Dataset.from_episodes(make_episodes((3, 4), log_probs=False), discrete_actions=None)
    ds.save(tmp_path / "mine.npz")
    assert main(["datasets", "info", str(tmp_path / "mine.npz")]) == 0
    rows = info_rows(capsys.readouterr().out)
    assert rows["transitions"] == "7" and rows["episodes"] == "2"
    assert rows["episode length"] == "mean 3.5, min 3, max 4"
    assert rows["normalised score"] == "n/a (no reference scores)"
    assert rows["behaviour log-probs"] == "absent"


def test_info_on_discrete_dataset(tmp_path, capsys):
    ds = Dataset.from_arrays(np.zeros((4, 2)), np.array([0, 1, 2, 1]), np.ones(4), discrete_actions=3)
    ds.save(tmp_path / "discrete.npz")
    assert main(["datasets", "info", str(tmp_path / "discrete.npz")]) == 0
    assert info_rows(capsys.readouterr().out)["action dim"] == "discrete (3 actions)"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("not-a-dataset.txt", "cannot load 'not-a-dataset.txt'"),
        ("d4rl:hopper-medium", "end in -v2"),
        ("d4rl:hopper-medium-v2", "download=True"),
        ("missing.hdf5", "no D4RL-layout file"),
        ("missing.npz", "no dataset file"),
    ],
)
def test_bad_spec_exits_2_with_message(spec, message, capsys, isolated_d4rl_dirs, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert main(["datasets", "info", spec]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("offrl datasets info: error: ") and message in captured.err


def test_corrupt_hdf5_exits_2(tmp_path, capsys):
    (tmp_path / "broken.hdf5").write_bytes(b"this is not an HDF5 file")
    assert main(["datasets", "info", str(tmp_path / "broken.hdf5")]) == 2
    assert "offrl datasets info: error:" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["datasets"])
    assert info.value.code == 2
    assert "usage: offrl datasets" in capsys.readouterr().err


def test_console_script(d4rl_replay_file, isolated_d4rl_dirs):
    script = shutil.which("offrl", path=str(Path(sys.executable).parent)) or shutil.which("offrl")
    assert script is not None, "the offrl console script is not installed (pip install -e .)"
    env = dict(os.environ)
    ok = subprocess.run([script, "datasets", "info", "d4rl:hopper-medium-replay-v2"], capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    rows = info_rows(ok.stdout)
    assert rows["dataset"] == "hopper-medium-replay-v2"
    assert rows["transitions"] == "11" and rows["episodes"] == "4"
    assert rows["behaviour log-probs"] == "present"
    assert rows["normalised score"].startswith("mean ")
    bad = subprocess.run([script, "datasets", "info", "nope.txt"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "offrl datasets info: error: cannot load 'nope.txt'" in bad.stderr


def test_list_and_info_of_built_datasets(tmp_path, capsys, monkeypatch):
    import json

    from offrl.datasets.built import DATASET_VERSION
    from test_layers import _fake_build

    monkeypatch.setenv("OFFRL_DATA_DIR", str(tmp_path))
    assert main(["datasets", "list"]) == 0
    assert "(none yet; build one with `offrl datasets build pendulum-medium-v1`)" in capsys.readouterr().out
    actions = _fake_build(tmp_path, seed=0)
    assert main(["datasets", "list"]) == 0
    out = capsys.readouterr().out
    assert f"offrl/pendulum-v1/seed0/medium-v{DATASET_VERSION}" in out and "seed 0, SAC 15,000 steps" in out
    assert "older builder recipe" not in out and "pendulum-<kind>-v1" in out
    # A dataset of an older recipe is listed apart, and `offrl:` loads do not see it.
    current = tmp_path / "offrl" / "pendulum-v1" / "seed0" / f"medium-v{DATASET_VERSION}"
    old = current.parent / "medium-v0"
    shutil.copytree(current, old)
    meta = json.loads((old / "data" / "metadata.json").read_text())
    meta["offrl_build"]["config"]["version"] = 0
    (old / "data" / "metadata.json").write_text(json.dumps(meta))
    assert main(["datasets", "list"]) == 0
    out = capsys.readouterr().out
    assert out.count("pendulum-medium-v1") == 1 and "(1 more of an older builder recipe" in out
    assert main(["datasets", "info", "offrl:pendulum-medium-v1"]) == 0
    rows = info_rows(capsys.readouterr().out)
    assert rows["dataset"] == "pendulum-medium-v1" and rows["transitions"] == str(len(actions))
    assert rows["behaviour log-probs"] == "present" and rows["normalised score"].startswith("mean ")
    assert main(["datasets", "info", "offrl:pendulum-expert-v1"]) == 2
    assert "offrl datasets build pendulum-expert-v1" in capsys.readouterr().err


def test_build_with_bad_input_exits_2(tmp_path, capsys):
    assert main(["datasets", "build", "cheetah-medium-v5", "--data-dir", str(tmp_path)]) == 2
    assert "offrl datasets build: error: unknown environment 'cheetah'" in capsys.readouterr().err
    assert main(["datasets", "build", "pendulum-medium-v1", "--sac-steps", "3000", "--data-dir", str(tmp_path)]) == 2
    assert "too small to reach a medium policy" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
