"""offrl.datasets.build on the real Pendulum-v1 (and InvertedPendulum-v5) with tiny budgets.

One tiny build of all five kinds is shared by the module; each test reads
the real Minari files it wrote under a temporary $OFFRL_DATA_DIR.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

import offrl
from offrl.datasets import build as build_mod
from offrl.datasets.build import KINDS, list_built, load_built, parse_name, run_build

# Small enough to build in seconds, big enough that SAC's final policy clearly beats the random one.
TINY = dict(
    n_transitions=7000,  # 32 envs x ~218 steps: one full 200-step episode per env, then a cut
    sac_steps=4000,
    eval_every=500,
    ref_episodes=10,
    sac_params={"learning_starts": 500, "hidden_dims": (64, 64), "batch_size": 128, "lr": 1e-3},
    device="cpu",
)
LOAD = {k: v for k, v in TINY.items() if k != "device"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny networks gain nothing from intra-op threads, and lose a lot when other jobs share the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("offrl_data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OFFRL_DATA_DIR", str(data_dir))
        report = run_build("pendulum-*-v1", progress=False, **TINY)
        datasets = {kind: load_built(f"pendulum-{kind}-v1", **LOAD) for kind in KINDS}
        yield {"dir": data_dir, "report": report, "datasets": datasets}


def test_every_kind_is_a_loadable_minari_dataset(built, monkeypatch):
    import minari

    report = built["report"]
    assert report.built == list(KINDS)
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(built["dir"]))
    for kind in KINDS:
        info = report.datasets[kind]
        md = minari.load_dataset(info["dataset_id"])
        assert md.total_steps == info["n_transitions"]
        assert md.total_episodes == info["n_episodes"]
        assert md.storage.metadata["ref_min_score"] == pytest.approx(report.ref_min_score)
        assert md.storage.metadata["ref_max_score"] == pytest.approx(report.ref_max_score)
        episode = next(md.iterate_episodes())
        assert "action_log_probs" in episode.infos
        assert md.spec.env_spec.id == "Pendulum-v1"
    assert report.ref_max_score > report.ref_min_score
    assert {row["kind"] for row in list_built(built["dir"])} == set(KINDS)


def test_sizes_and_episode_boundaries(built):
    datasets, report = built["datasets"], built["report"]
    for kind in ("random", "medium", "expert"):
        ds = datasets[kind]
        assert ds.n_transitions == TINY["n_transitions"]
        lengths = ds.episode_lengths()
        last = ds.episode_starts[1:] - 1
        # Pendulum never terminates: episodes end by the 200-step time limit, or by the budget cut.
        assert ds.terminals.sum() == 0
        assert np.array_equal(np.flatnonzero(ds.timeouts), last)
        assert lengths.max() == 200
        cut = set(ds.metadata["cut_episodes"])
        assert all(lengths[i] == 200 for i in range(ds.n_episodes) if i not in cut)
        assert len(cut) == 32 and all(lengths[i] < 200 for i in cut)
        # Within an episode, the next observation is the following row's observation.
        inside = np.setdiff1d(np.arange(ds.n_transitions - 1), last)
        assert np.array_equal(ds.next_observations[inside], ds.observations[inside + 1])
        assert np.all(np.abs(ds.actions) <= 2.0)
    replay = datasets["medium-replay"]
    assert replay.n_transitions == report.medium_step
    assert report.medium_step > TINY["sac_params"]["learning_starts"]
    assert np.all(replay.episode_lengths()[:-1] == 200)
    medium_expert = datasets["medium-expert"]
    assert medium_expert.n_transitions == 2 * TINY["n_transitions"]
    assert np.array_equal(medium_expert.observations[: TINY["n_transitions"]], datasets["medium"].observations)
    assert np.array_equal(medium_expert.actions[TINY["n_transitions"]:], datasets["expert"].actions)


def test_log_probs_are_the_behaviour_policies(built):
    datasets, report = built["datasets"], built["report"]
    uniform = -np.log(4.0)  # Pendulum's actions lie in [-2, 2]
    np.testing.assert_allclose(datasets["random"].behavior_log_probs, uniform, rtol=1e-6)
    for kind in ("medium", "expert"):
        ds = datasets[kind]
        policy = offrl.load(report.policies[kind], device="cpu")
        assert ds.metadata["behavior_policy"] == report.policies[kind]
        np.testing.assert_allclose(policy.log_prob(ds.observations, ds.actions), ds.behavior_log_probs,
                                   rtol=1e-5, atol=1e-4)
    # The warm-up part of medium-replay was uniform; the rest came from SAC's policy of the moment.
    replay = datasets["medium-replay"].behavior_log_probs
    warmup = TINY["sac_params"]["learning_starts"]
    np.testing.assert_allclose(replay[:warmup], uniform, rtol=1e-6)
    assert not np.allclose(replay[warmup:], uniform)


def test_scores_and_medium_choice(built):
    report, datasets = built["report"], built["datasets"]
    scores = {kind: info["normalized_score_mean"] for kind, info in report.datasets.items()}
    assert scores["random"] < scores["medium"] < scores["expert"]
    assert abs(scores["random"]) < 25 and abs(scores["expert"] - 100) < 25
    assert datasets["medium"].metadata["ref_min_score"] == pytest.approx(report.ref_min_score)
    from offrl.datasets import normalized_score

    returns = datasets["expert"].episode_returns()
    assert np.isfinite(normalized_score(datasets["expert"], returns)).all()


def test_load_scheme_and_cache(built, monkeypatch):
    monkeypatch.setenv("OFFRL_DATA_DIR", str(built["dir"]))
    ds = offrl.datasets.load("offrl:pendulum-medium-v1", **LOAD)
    assert np.array_equal(ds.actions, built["datasets"]["medium"].actions)
    assert ds.metadata["name"] == "pendulum-medium-v1"
    again = run_build("pendulum-expert-v1", progress=False, **TINY)  # cached: nothing is rebuilt
    assert again.built == [] and again.ref_max_score == built["report"].ref_max_score
    from offrl.datasets import build  # the module is also the function

    expert = build("pendulum-expert-v1", progress=False, **TINY)
    assert np.array_equal(expert.observations, built["datasets"]["expert"].observations)
    both = build("pendulum-*-v1", progress=False, **TINY)
    assert set(both) == set(KINDS) and both["medium-replay"].n_transitions == built["report"].medium_step
    with pytest.raises(FileNotFoundError, match="offrl datasets build pendulum-medium-v1 --seed 7"):
        offrl.datasets.load("offrl:pendulum-medium-v1", seed=7, **LOAD)


def test_best_snapshot_expert_reuses_the_sac_run(built, monkeypatch):
    import json
    from pathlib import Path

    monkeypatch.setenv("OFFRL_DATA_DIR", str(built["dir"]))
    final = built["report"]
    checkpoint = Path(final.run_dir) / "sac_checkpoint.pt"
    trained_at = checkpoint.stat().st_mtime_ns
    best = run_build("pendulum-*-v1", progress=False, expert="best", **TINY)
    assert checkpoint.stat().st_mtime_ns == trained_at and best.timings["SAC training"] < 0.5  # same SAC run
    snapshots = [json.loads(p.read_text()) for p in (Path(final.run_dir) / "snapshots").glob("step_*.json")]
    learned = [r for r in snapshots if r["step"] > TINY["sac_params"]["learning_starts"]]
    top = max(learned, key=lambda r: (r["return_mean"], -r["step"]))
    assert best.expert_step == top["step"] and final.expert_step == TINY["sac_steps"]
    assert best.medium_step < best.expert_step
    assert best.ref_min_score == final.ref_min_score
    for kind, info in best.datasets.items():
        assert info["dataset_id"].split("/")[-2].endswith("-best") and info["expert_step"] == best.expert_step
    expert = load_built("pendulum-expert-v1", expert="best", **LOAD)
    policy = offrl.load(best.policies["expert"], device="cpu")
    np.testing.assert_allclose(policy.log_prob(expert.observations, expert.actions), expert.behavior_log_probs,
                               rtol=1e-5, atol=1e-4)
    assert load_built("pendulum-medium-replay-v1", expert="best", **LOAD).n_transitions == best.medium_step
    # The final-policy datasets are untouched.
    again = load_built("pendulum-expert-v1", **LOAD)
    assert np.array_equal(again.actions, built["datasets"]["expert"].actions)
    with pytest.raises(ValueError, match="expert must be one of"):
        run_build("pendulum-medium-v1", progress=False, expert="peak", **TINY)


def test_sweep_config_can_name_a_build_budget(built, monkeypatch, tmp_path):
    from offrl.sweep import _load_dataset, parse_config

    monkeypatch.setenv("OFFRL_DATA_DIR", str(built["dir"]))
    config = parse_config({"name": "budget", "datasets": [{"spec": "offrl:pendulum-medium-replay-v1", "build": LOAD}],
                           "algorithms": {"BC": {}}, "seeds": [0], "steps": 10}, source="test")
    entry = config.datasets[0]
    assert entry["build"] is True and entry["build_options"] == LOAD
    ds = _load_dataset(entry)  # already built with this budget: loaded, not rebuilt
    assert np.array_equal(ds.actions, built["datasets"]["medium-replay"].actions)


def test_interrupted_build_resumes_to_the_same_data(built, tmp_path, monkeypatch):
    monkeypatch.setenv("OFFRL_DATA_DIR", str(tmp_path))
    from offrl.algos.sac import SAC

    real_update, calls = SAC.update, {"n": 0}

    def crashing_update(self, batch):
        calls["n"] += 1
        if calls["n"] == 2700:  # in SAC step 3200; the last checkpoint (one per 200-step episode) is at step 3000
            raise KeyboardInterrupt
        return real_update(self, batch)

    monkeypatch.setattr(SAC, "update", crashing_update)
    with pytest.raises(KeyboardInterrupt):
        run_build("pendulum-*-v1", progress=False, **TINY)
    monkeypatch.setattr(SAC, "update", real_update)

    # Then a kill while the medium dataset is being written: nothing half written becomes visible.
    from offrl.datasets import minari as minari_mod

    real_to_minari = minari_mod.to_minari

    def killed_to_minari(ds, dataset_id, *args, **kwargs):
        written = real_to_minari(ds, dataset_id, *args, **kwargs)
        if dataset_id.endswith("/medium-v0"):
            raise KeyboardInterrupt
        return written

    monkeypatch.setattr(minari_mod, "to_minari", killed_to_minari)
    with pytest.raises(KeyboardInterrupt):
        run_build("pendulum-*-v1", progress=False, **TINY)
    monkeypatch.setattr(minari_mod, "to_minari", real_to_minari)
    with pytest.raises(FileNotFoundError):
        load_built("pendulum-medium-v1", **LOAD)
    assert not any((tmp_path / ".tmp").iterdir())
    load_built("pendulum-random-v1", **LOAD)  # written before the kill

    report = run_build("pendulum-*-v1", progress=False, **TINY)
    assert report.built == ["medium", "expert", "medium-replay", "medium-expert"]
    assert report.medium_step == built["report"].medium_step
    assert report.ref_min_score == built["report"].ref_min_score
    assert report.ref_max_score == built["report"].ref_max_score
    for kind in KINDS:
        resumed, reference = load_built(f"pendulum-{kind}-v1", **LOAD), built["datasets"][kind]
        for column in ("observations", "actions", "rewards", "timeouts", "behavior_log_probs"):
            assert np.array_equal(getattr(resumed, column), getattr(reference, column)), (kind, column)


def test_collect_marks_terminals_and_timeouts():
    """InvertedPendulum terminates when the pole falls: terminal, not timeout, at each episode's end."""
    spec = build_mod._check_env("InvertedPendulum-v5")
    pool = build_mod._EnvPool("InvertedPendulum-v5", 4)
    try:
        act = build_mod._uniform_actor(spec, torch.Generator().manual_seed(0))
        ds = pool.collect(act, 2000, 4, seed=0, stream=9, spec=spec, progress=False, desc="")
    finally:
        pool.close()
    last = ds.episode_starts[1:] - 1
    cut = ds.metadata["cut_episodes"]
    assert ds.n_transitions == 2000 and len(cut) <= 4
    natural = np.setdiff1d(np.arange(ds.n_episodes), cut)
    assert np.all(ds.terminals[last[natural]] == 1) and np.all(ds.timeouts[last[natural]] == 0)
    assert np.all(ds.timeouts[last[cut]] == 1) and np.all(ds.terminals[last[cut]] == 0)
    assert ds.terminals.sum() + ds.timeouts.sum() == ds.n_episodes
    np.testing.assert_allclose(ds.behavior_log_probs, -np.log(6.0), rtol=1e-6)  # actions in [-3, 3]


@pytest.mark.parametrize(
    "name, kwargs, match",
    [
        ("cheetah-medium-v5", {}, "unknown environment"),
        ("hopper-mediocre-v5", {}, "unknown dataset kind"),
        ("hopper-v5", {}, "must look like"),
        ("hopper-medium-v99", {}, "not registered"),
        ("cartpole-medium-v1", {}, "Box"),
        ("pendulum-medium-v1", {"sac_steps": 5500}, "too small to reach a medium policy"),
        ("pendulum-medium-v1", {"sac_steps": 3000, "sac_params": {"learning_starts": 500}, "eval_every": 1500},
         "too small to reach a medium policy"),
        ("pendulum-medium-v1", {"sac_params": {"learning_rate": 1e-3}}, "unknown SAC parameter"),
        ("pendulum-medium-v1", {"env_id": "Pendulum-v0"}, "not a registered"),
    ],
)
def test_bad_input_fails_before_any_work(name, kwargs, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        run_build(name, data_dir=tmp_path, progress=False, **kwargs)
    assert not any(tmp_path.iterdir())  # nothing written


def test_names_map_to_gymnasium_ids():
    assert parse_name("hopper-medium-replay-v5").env_id == "Hopper-v5"
    assert parse_name("halfcheetah-medium-expert-v5").kinds == ("medium-expert",)
    assert parse_name("inverted-double-pendulum-expert-v5").env_id == "InvertedDoublePendulum-v5"
    assert parse_name("walker2d-*-v5").kinds == KINDS
    assert parse_name("mountaincarcontinuous-random-v0").env_id == "MountainCarContinuous-v0"
    assert parse_name("car-medium-v0", env_id="MountainCarContinuous-v0").env_id == "MountainCarContinuous-v0"
    assert parse_name("ant-expert-v5").env_key == "ant-v5"
