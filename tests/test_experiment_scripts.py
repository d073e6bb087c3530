"""The helpers of scripts under experiments/ that choose what an experiment's data is, or read its runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from offrl.datasets import Dataset

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _episodes(lengths: list[int], fell: list[bool]) -> Dataset:
    n = sum(lengths)
    ends = np.cumsum(lengths) - 1
    terminals = np.zeros(n, np.float32)
    timeouts = np.zeros(n, np.float32)
    for end, f in zip(ends, fell):
        (terminals if f else timeouts)[end] = 1.0
    rng = np.random.default_rng(0)
    return Dataset.from_arrays(rng.normal(size=(n, 3)), rng.uniform(-1, 1, size=(n, 2)), np.ones(n),
                               terminals=terminals, timeouts=timeouts, next_observations=rng.normal(size=(n, 3)))


def test_demonstrations_are_the_first_episodes_or_the_first_that_reach_the_time_limit():
    choose = _script("dual_data").demonstration_episodes
    # episode:        0 fall, 1 full, 2 fall, 3 full, 4 full, 5 cut by the end of the log (timeout, short)
    expert = _episodes([4, 6, 2, 6, 6, 3], [True, False, True, False, False, False])
    assert choose(expert, 2).tolist() == [0, 1]
    assert choose(expert, 2, complete_only=True).tolist() == [1, 3]
    assert choose(expert, 3, complete_only=True).tolist() == [1, 3, 4]
    chosen = expert.subset(choose(expert, 3, complete_only=True))
    assert chosen.n_transitions == 18 and chosen.terminals.sum() == 0
    with pytest.raises(ValueError, match="3 episodes that reach the time limit .6 steps.*asks for 4"):
        choose(expert, 4, complete_only=True)
    with pytest.raises(ValueError, match="has 6 episodes.*asks for 7"):
        choose(expert, 7)
    with pytest.raises(ValueError, match="at least 1"):
        choose(expert, 0)


def test_the_authors_mixed_data_is_random_then_the_first_expert_episodes_without_rewards():
    join = _script("dual_data").random_with_expert
    expert = _episodes([4, 6, 2, 6], [True, False, True, False])
    random = _episodes([3, 3], [True, True])
    mixed = join(random, expert, 3)
    assert mixed.n_transitions == 6 + 12 and mixed.n_episodes == 5
    assert not mixed.is_labelled("rewards")
    np.testing.assert_array_equal(mixed.actions[6:], expert.actions[:12])
    np.testing.assert_array_equal(mixed.actions[:6], random.actions)
    with pytest.raises(ValueError, match="has 4 episodes.*asks for 5"):
        join(random, expert, 5)


def test_the_actor_weight_readings_split_the_mixed_rows_and_measure_the_demonstrations_spacing():
    script = _script("recoil_actor_weights")
    assert script._parts("random:3,medium-replay:2", 5) == [("random", 0, 3), ("medium-replay", 3, 5)]
    with pytest.raises(SystemExit, match="covers 4 rows but the mixed data has 5"):
        script._parts("random:3,medium-replay:1", 5)
    with pytest.raises(SystemExit, match="name:rows"):
        script._parts("random=3", 3)
    # Two demonstrations along the same line, one 0.5 beside the other: each state's nearest state of the other
    # episode is 0.5 away, whatever the states of its own episode.
    import torch

    first = torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]])
    demos = torch.cat([first, first + torch.tensor([0.0, 0.5])])
    assert script.demo_spacing(demos, np.array([0, 0, 0, 1, 1, 1])) == pytest.approx(0.5)
    assert np.isnan(script.demo_spacing(demos, np.zeros(6, dtype=int)))  # one demonstration: no spacing
    assert script.nearest_distance(torch.tensor([[0.0, 3.0]]), demos).tolist() == pytest.approx([2.5])
    a = np.array([0.1, 5.0, -2.0, 3.0])
    assert script.spearman(a, a ** 3) == pytest.approx(1.0)
    assert script.spearman(a, -a) == pytest.approx(-1.0)


def test_run_snapshots_trains_a_sweep_run_again_with_the_same_losses(tmp_path, monkeypatch, capsys):
    import sys

    import torch
    import yaml

    from conftest import random_pendulum_npz
    from offrl.sweep import run_sweep

    data = random_pendulum_npz(tmp_path / "pendulum.npz", n_episodes=3)
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({"name": "tiny", "datasets": [str(data)],
                                      "algorithms": {"BC": {"hidden_dims": [32, 32]}},
                                      "seeds": [0], "steps": 200, "log_every": 50}))
    threads = torch.get_num_threads()
    try:
        run_sweep(config, workers=1, out=tmp_path / "out", progress=False)
        (run_dir,) = (tmp_path / "out" / "runs").glob("*/BC/seed0")
        monkeypatch.setattr(sys, "argv", ["run_snapshots.py", str(run_dir), "--until", "100", "--every", "50",
                                          "--episodes", "1", "--env", "Pendulum-v1", "--out", str(tmp_path / "snaps")])
        _script("run_snapshots").main()
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "losses repeat the run's train.csv at 2 logged steps: True" in out
    assert sorted(p.name for p in (tmp_path / "snaps").glob("step*.pt")) == ["step0000050.pt", "step0000100.pt"]
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["50", "100"]
    # A run recorded under another default (here a pretend batch size) is refused, not silently retrained.
    import json

    recorded = json.loads((run_dir / "config.json").read_text())
    recorded["resolved_params"]["algorithm"]["batch_size"] = 512
    (run_dir / "config.json").write_text(json.dumps(recorded))
    monkeypatch.setattr(sys, "argv", ["run_snapshots.py", str(run_dir), "--until", "100", "--every", "50",
                                      "--out", str(tmp_path / "snaps2")])
    with pytest.raises(SystemExit, match="batch_size: 512 then, 256 now"):
        _script("run_snapshots").main()
