"""offrl.builder on the real Pendulum-v1 (and InvertedPendulum-v5) with tiny budgets.

One tiny build of all five kinds is shared by the module; each test reads
the real Minari files it wrote under a temporary $OFFRL_DATA_DIR.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

import offrl
import offrl.builder as builder_mod
from offrl.algos.sac import SAC
from offrl.builder import UNKEYED_SAC_PARAMS, build, load_or_build
from offrl.datasets.built import DATASET_VERSION, KINDS, list_built, load_built, parse_name

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
        report = build("pendulum-*-v1", progress=False, **TINY)
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


def test_the_run_and_its_datasets_record_the_software_versions(built):
    import importlib.metadata
    import json
    from pathlib import Path

    report = built["report"]
    run = json.loads((Path(report.run_dir) / "run.json").read_text())
    software = run["software"]
    assert software["torch"] == torch.__version__ and software["mujoco"] == importlib.metadata.version("mujoco")
    assert software["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert software["cpu"] and software["cpu"] != "unknown"  # builds differ across CPU models, so each names its own
    assert "software" not in run["config"]  # a record, not part of the cache key
    for info in report.datasets.values():
        assert info["software"] == software


def test_a_cached_build_made_on_another_machine_is_reused_and_says_so(built, tmp_path, monkeypatch):
    """The CPU model and versions are a record, not part of the cache key: data made elsewhere are reused as they
    are, and the report names what differs, since a rebuild here may not repeat them."""
    import json
    import shutil

    from offrl.builder import cpu_model

    report = built["report"]
    assert report.software is not None and report.software_changed == {}
    assert "made with: python" in report.format() and "this machine differs" not in report.format()
    root = tmp_path / "copy"
    shutil.copytree(built["dir"], root)
    monkeypatch.setenv("OFFRL_DATA_DIR", str(root))
    run_file = root / report.run_dir[len(str(built["dir"])) + 1:] / "run.json"
    record = json.loads(run_file.read_text())
    record["software"] = {**record["software"], "cpu": "Some Other CPU", "mujoco": "2.3.0"}
    run_file.write_text(json.dumps(record))
    again = build("pendulum-expert-v1", progress=False, **TINY)
    assert again.built == []  # reused, not rebuilt
    assert again.software_changed == {"cpu": ("Some Other CPU", cpu_model()),
                                      "mujoco": ("2.3.0", report.software["mujoco"])}
    text = again.format()
    assert "this machine differs" in text and "'Some Other CPU'" in text and "(made with '2.3.0')" in text


def test_load_scheme_and_cache(built, monkeypatch):
    monkeypatch.setenv("OFFRL_DATA_DIR", str(built["dir"]))
    ds = offrl.datasets.load("offrl:pendulum-medium-v1", **LOAD)
    assert np.array_equal(ds.actions, built["datasets"]["medium"].actions)
    assert ds.metadata["name"] == "pendulum-medium-v1"
    again = build("pendulum-expert-v1", progress=False, **TINY)  # cached: nothing is rebuilt
    assert again.built == [] and again.ref_max_score == built["report"].ref_max_score
    expert = load_or_build("pendulum-expert-v1", progress=False, **TINY)
    assert np.array_equal(expert.observations, built["datasets"]["expert"].observations)
    both = load_or_build("pendulum-*-v1", progress=False, **TINY)
    assert set(both) == set(KINDS) and both["medium-replay"].n_transitions == built["report"].medium_step
    # The CLI cannot set TINY's hidden_dims: the message names the Python call.
    with pytest.raises(FileNotFoundError, match=r"has not been built .* offrl\.builder\.load_or_build\("
                                                r"'pendulum-medium-v1', seed=7, sac_steps=4000"):
        offrl.datasets.load("offrl:pendulum-medium-v1", seed=7, **LOAD)
    with pytest.raises(FileNotFoundError, match="`offrl datasets build pendulum-medium-v1 --seed 7 --sac-steps 8000`"):
        offrl.datasets.load("offrl:pendulum-medium-v1", seed=7, sac_steps=8000)


def test_best_snapshot_expert_reuses_the_sac_run(built, monkeypatch):
    import json
    from pathlib import Path

    monkeypatch.setenv("OFFRL_DATA_DIR", str(built["dir"]))
    final = built["report"]
    checkpoint = Path(final.run_dir) / "sac_checkpoint.pt"
    trained_at = checkpoint.stat().st_mtime_ns
    best = build("pendulum-*-v1", progress=False, expert="best", **TINY)
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
        build("pendulum-medium-v1", progress=False, expert="peak", **TINY)


def test_sweep_config_can_name_a_build_budget(built, monkeypatch, tmp_path):
    from offrl.sweep import _load_dataset, parse_config

    monkeypatch.setenv("OFFRL_DATA_DIR", str(built["dir"]))
    config = parse_config({"name": "budget", "datasets": [{"spec": "offrl:pendulum-medium-replay-v1", "build": LOAD}],
                           "algorithms": {"BC": {}}, "seeds": [0], "steps": 10}, source="test")
    entry = config.datasets[0]
    assert entry["build"] is True and entry["build_options"] == LOAD
    ds = _load_dataset(entry)  # already built with this budget: loaded, not rebuilt
    assert np.array_equal(ds.actions, built["datasets"]["medium-replay"].actions)


def test_medium_replay_comes_from_the_replay_buffer_the_builder_wrote(built, tmp_path, monkeypatch):
    """Not from SAC's checkpoint: with the checkpoint gone, medium-replay is rebuilt to the same data."""
    import shutil
    from pathlib import Path

    import offrl.datasets.built as built_mod

    root = tmp_path / "copy"
    shutil.copytree(built["dir"], root)
    monkeypatch.setenv("OFFRL_DATA_DIR", str(root))
    run_dir = Path(built["report"].run_dir.replace(str(built["dir"]), str(root)))
    buffer = torch.load(run_dir / "replay_buffer.pt", map_location="cpu", weights_only=True)
    assert buffer["size"] == TINY["sac_steps"]
    (run_dir / "sac_checkpoint.pt").unlink()
    replay_id = built["report"].datasets["medium-replay"]["dataset_id"]
    shutil.rmtree(built_mod.dataset_path(root, replay_id))
    report = build("pendulum-medium-replay-v1", progress=False, **TINY)
    assert report.built == ["medium-replay"] and report.timings["SAC training"] < 0.5
    rebuilt, reference = load_built("pendulum-medium-replay-v1", **LOAD), built["datasets"]["medium-replay"]
    for column in ("observations", "actions", "rewards", "terminals", "timeouts", "behavior_log_probs"):
        assert np.array_equal(getattr(rebuilt, column), getattr(reference, column)), column
    assert rebuilt.metadata["cut_episodes"] == reference.metadata["cut_episodes"]


def test_medium_expert_alone_collects_what_it_needs(built, tmp_path, monkeypatch):
    """Building only medium-expert once failed when medium and expert had not been built ("not found")."""
    import shutil

    root, _, folder = _damaged_copy(built, tmp_path, monkeypatch)
    for kind in ("medium", "expert", "medium-expert"):
        shutil.rmtree(folder(kind))
    report = build("pendulum-medium-expert-v1", progress=False, **TINY)
    assert report.built == ["medium-expert"] and report.timings["SAC training"] < 0.5
    rebuilt, reference = load_built("pendulum-medium-expert-v1", **LOAD), built["datasets"]["medium-expert"]
    for column in ("observations", "actions", "rewards", "timeouts", "behavior_log_probs"):
        assert np.array_equal(getattr(rebuilt, column), getattr(reference, column)), column
    assert rebuilt.metadata["cut_episodes"] == reference.metadata["cut_episodes"]


def _damaged_copy(built, tmp_path, monkeypatch):
    """A copy of the shared build to damage, its run directory, and a function giving a kind's dataset folder."""
    import shutil
    from pathlib import Path

    import offrl.datasets.built as built_mod

    root = tmp_path / "copy"
    shutil.copytree(built["dir"], root)
    monkeypatch.setenv("OFFRL_DATA_DIR", str(root))
    run_dir = Path(built["report"].run_dir.replace(str(built["dir"]), str(root)))
    return root, run_dir, lambda kind: built_mod.dataset_path(root, built["report"].datasets[kind]["dataset_id"])


def _truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_a_damaged_build_cache_is_named_with_the_rebuild(built, tmp_path, monkeypatch):
    """Truncated cache files raised raw torch, h5py and json errors; each now names the file and the rebuild."""
    import re
    import shutil

    root, run_dir, folder = _damaged_copy(built, tmp_path, monkeypatch)
    rebuild = re.escape("force=True)")
    # The replay buffer medium-replay is cut from.
    _truncate(run_dir / "replay_buffer.pt")
    shutil.rmtree(folder("medium-replay"))
    with pytest.raises(ValueError, match=rf"replay buffer {re.escape(str(run_dir / 'replay_buffer.pt'))} is damaged "
                                         rf".*{rebuild}"):
        build("pendulum-medium-replay-v1", progress=False, **TINY)
    # A policy file a kind is collected with.
    _truncate(run_dir / "policies" / "medium.pt")
    shutil.rmtree(folder("medium"))
    with pytest.raises(ValueError, match=rf"{re.escape(str(run_dir / 'policies' / 'medium.pt'))}.*build cache .* is "
                                         rf"damaged.*{rebuild}"):
        build("pendulum-medium-v1", progress=False, **TINY)
    # A dataset's own files.
    data_file = next((folder("expert") / "data").glob("*.hdf5"))
    _truncate(data_file)
    with pytest.raises(ValueError, match=rf"files of offrl dataset 'pendulum-expert-v1' under .* are damaged.*{rebuild}"):
        load_built("pendulum-expert-v1", **LOAD)
    # A dataset's build record: loading names it; building writes that kind again.
    _truncate(folder("random") / "data" / "metadata.json")
    with pytest.raises(ValueError, match=r"build record of offrl dataset 'pendulum-random-v1' is damaged: .*"
                                         rf"metadata\.json cannot be read .*{rebuild}"):
        load_built("pendulum-random-v1", **LOAD)
    assert build("pendulum-random-v1", progress=False, **TINY).built == ["random"]
    again = load_built("pendulum-random-v1", **LOAD)
    assert np.array_equal(again.actions, built["datasets"]["random"].actions)
    # The SAC run's state.
    _truncate(run_dir / "run.json")
    with pytest.raises(ValueError, match=rf"SAC run's state {re.escape(str(run_dir / 'run.json'))} is damaged.*"
                                         rf"{rebuild}"):
        build("pendulum-random-v1", progress=False, **TINY)


def _config(**kwargs):
    return builder_mod._make_config("pendulum-medium-v1", **{
        "n_transitions": None, "seed": 0, "sac_steps": None, "eval_every": None, "eval_episodes": 10,
        "ref_episodes": 100, "sac_params": None, "n_envs": 32, "checkpoint_every": None, "device": "cpu",
        "expert": "final", "env_id": None, **kwargs})


def test_the_cache_key_holds_every_sac_parameter():
    sac = SAC().get_params()
    cfg = _config()
    key = cfg.data_config()
    assert set(UNKEYED_SAC_PARAMS) <= set(sac)
    assert set(key["sac_params"]) == set(sac) - set(UNKEYED_SAC_PARAMS)
    assert key["sac_params"] == {k: (list(v) if isinstance(v, tuple) else v) for k, v in sac.items()
                                 if k not in UNKEYED_SAC_PARAMS and k != "buffer_size"} | {"buffer_size": 15_000}
    # The unkeyed ones are in the key another way (sac_steps, seed), or do not change the run.
    assert key["sac_steps"] == 15_000 and key["seed"] == 0 and key["version"] == DATASET_VERSION
    assert cfg.request.run_variant == "seed0" and cfg.namespace() == "offrl/pendulum-v1/seed0"
    assert cfg.dataset_id("medium") == f"offrl/pendulum-v1/seed0/medium-v{DATASET_VERSION}"


def _another(name, value):
    """A valid SAC setting different from `value`."""
    if name == "precision":
        return "bf16" if value == "fp32" else "fp32"
    if name == "hidden_dims":
        return (64, 64)
    if value is None:
        return -0.5 if name == "target_entropy" else 1e-3
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):  # within SAC's declared range: builds check SAC's settings up front
        from offrl.algos.params import param_rules

        rule = param_rules(SAC).get(name)
        steps = (value + 1, value - 1) if isinstance(value, int) else (value * 2, value / 2, value + 0.01)
        valid = [v for v in steps if rule is None or rule.accepts(v)]
        if valid:
            return valid[0]
    raise AssertionError(f"add a test value for the new SAC parameter {name}={value!r}")


def test_changing_any_sac_parameter_changes_the_key_and_the_variant():
    base = _config()
    keyed = set(base.sac_params) - {"buffer_size"}  # always the run's length: medium-replay is a slice of it
    assert keyed
    variants = {base.request.data_variant}
    for name in sorted(keyed):
        cfg = _config(sac_params={name: _another(name, base.sac_params[name])})
        assert cfg.run_config() != base.run_config(), name
        assert cfg.run_config()["sac_params"][name] != base.sac_params[name], name
        variants.add(cfg.request.data_variant)
    assert len(variants) == len(keyed) + 1  # each its own directory: seed0-<hash>
    # Changing SAC's own default changes the key too, under the same short directory name.
    defaults = SAC.__init__.__kwdefaults__
    old = defaults["tau"]
    defaults["tau"] = 2 * old
    try:
        changed = _config()
    finally:
        defaults["tau"] = old
    assert changed.sac_params["tau"] == 2 * old and changed.run_config() != base.run_config()
    assert changed.request.data_variant == base.request.data_variant == "seed0"


def test_a_cached_build_of_another_sac_default_is_never_reused(built, monkeypatch):
    monkeypatch.setenv("OFFRL_DATA_DIR", str(built["dir"]))
    monkeypatch.setitem(SAC.__init__.__kwdefaults__, "gamma", 0.98)
    with pytest.raises(ValueError, match=r"different configuration: .*sac_params\.gamma 0\.99 -> 0\.98.*force=True"):
        build("pendulum-expert-v1", progress=False, **TINY)


def test_load_or_build_rebuilds_a_stale_cache_and_keeps_older_recipes(built, tmp_path, monkeypatch):
    import json
    import shutil

    import offrl.datasets.built as built_mod

    root = tmp_path / "copy"
    shutil.copytree(built["dir"], root)
    monkeypatch.setenv("OFFRL_DATA_DIR", str(root))
    expert_id = built["report"].datasets["expert"]["dataset_id"]
    current = built_mod.dataset_path(root, expert_id)
    older = current.parent / "expert-v0"  # a dataset of an older recipe next to it
    shutil.copytree(current, older)
    meta = json.loads((older / "data" / "metadata.json").read_text())
    meta["offrl_build"]["config"]["version"] = 0
    (older / "data" / "metadata.json").write_text(json.dumps(meta))
    monkeypatch.setitem(SAC.__init__.__kwdefaults__, "gamma", 0.98)
    expert = load_or_build("pendulum-expert-v1", progress=False, **TINY)
    info = json.loads((current / "data" / "metadata.json").read_text())["offrl_build"]
    assert info["config"]["sac_params"]["gamma"] == 0.98 and info["dataset_id"] == expert_id
    assert not np.array_equal(expert.actions, built["datasets"]["expert"].actions)  # a new SAC run
    run = json.loads((root / built["report"].run_dir[len(str(built["dir"])) + 1:] / "run.json").read_text())
    assert run["config"]["sac_params"]["gamma"] == 0.98
    assert (older / "data" / "metadata.json").exists()  # the older recipe's dataset is left alone
    namespace = expert_id.rsplit("/", 1)[0] + "/"  # the other kinds of the stale variant were deleted with it
    assert [row["dataset_id"] for row in list_built(root) if row["dataset_id"].startswith(namespace)] == [expert_id]


def test_a_build_from_before_a_new_sac_parameter_is_still_reused(built, tmp_path, monkeypatch):
    """A SAC parameter added later (n_critics, critic_layer_norm) at the value that reproduces the old runs does not
    make every cached build stale."""
    import json
    import shutil

    import offrl.datasets.built as built_mod
    from offrl.builder import SAC_PARAMS_SINCE

    assert {k: SAC().get_params()[k] for k in SAC_PARAMS_SINCE} == SAC_PARAMS_SINCE
    root = tmp_path / "copy"
    shutil.copytree(built["dir"], root)
    monkeypatch.setenv("OFFRL_DATA_DIR", str(root))
    run_file = root / built["report"].run_dir[len(str(built["dir"])) + 1:] / "run.json"
    files = [run_file] + [built_mod.dataset_path(root, built["report"].datasets[kind]["dataset_id"]) / "data" /
                          "metadata.json" for kind in KINDS]
    for path in files:  # written by an offrl whose SAC did not have these parameters yet
        record = json.loads(path.read_text())
        config = record["config"] if path == run_file else record["offrl_build"]["config"]
        for key in SAC_PARAMS_SINCE:
            del config["sac_params"][key]
        path.write_text(json.dumps(record))
    expert = load_or_build("pendulum-expert-v1", progress=False, **TINY)
    np.testing.assert_array_equal(expert.actions, built["datasets"]["expert"].actions)
    assert "n_critics" not in json.loads(run_file.read_text())["config"]["sac_params"]  # not rebuilt


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
        build("pendulum-*-v1", progress=False, **TINY)
    monkeypatch.setattr(SAC, "update", real_update)

    # Then a kill while the medium dataset is being written: nothing half written becomes visible.
    from offrl.datasets import minari as minari_mod

    real_to_minari = minari_mod.to_minari

    def killed_to_minari(ds, dataset_id, *args, **kwargs):
        written = real_to_minari(ds, dataset_id, *args, **kwargs)
        if dataset_id.endswith(f"/medium-v{DATASET_VERSION}"):
            raise KeyboardInterrupt
        return written

    monkeypatch.setattr(minari_mod, "to_minari", killed_to_minari)
    with pytest.raises(KeyboardInterrupt):
        build("pendulum-*-v1", progress=False, **TINY)
    monkeypatch.setattr(minari_mod, "to_minari", real_to_minari)
    with pytest.raises(FileNotFoundError):
        load_built("pendulum-medium-v1", **LOAD)
    assert not any((tmp_path / ".tmp").iterdir())
    load_built("pendulum-random-v1", **LOAD)  # written before the kill

    report = build("pendulum-*-v1", progress=False, **TINY)
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
    spec = builder_mod._check_env("InvertedPendulum-v5")
    pool = builder_mod._EnvPool("InvertedPendulum-v5", 4)
    try:
        act = builder_mod._uniform_actor(spec, torch.Generator().manual_seed(0))
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
        ("pendulum-medium-v1", {"sac_params": {"gamma": 1.5}}, r"SAC: gamma must be a real number in \[0, 1\]"),
        ("/-medium-v1", {"env_id": "Pendulum-v1"}, "has no letters or digits in its env part"),
    ],
)
def test_bad_input_fails_before_any_work(name, kwargs, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        build(name, data_dir=tmp_path, progress=False, **kwargs)
    assert not any(tmp_path.iterdir())  # nothing written


def test_names_map_to_gymnasium_ids():
    assert parse_name("hopper-medium-replay-v5").env_id == "Hopper-v5"
    assert parse_name("halfcheetah-medium-expert-v5").kinds == ("medium-expert",)
    assert parse_name("inverted-double-pendulum-expert-v5").env_id == "InvertedDoublePendulum-v5"
    assert parse_name("walker2d-*-v5").kinds == KINDS
    assert parse_name("mountaincarcontinuous-random-v0").env_id == "MountainCarContinuous-v0"
    assert parse_name("car-medium-v0", env_id="MountainCarContinuous-v0").env_id == "MountainCarContinuous-v0"
    assert parse_name("ant-expert-v5").env_key == "ant-v5"


def test_an_expert_far_below_d4rls_is_named_with_the_fix():
    # this repository's hopper recipe (seed 0, 300k SAC steps) on one CPU: expert 2,002.5, on another 514.1
    problem = builder_mod.weak_expert_problem("hopper", "Hopper-v5", 514.1, 300_000, 0)
    assert problem is not None
    for part in ("Hopper-v5", "514.1", "D4RL-normalised score of 16.4", "3234.3", "--seed", "--sac-steps"):
        assert part in problem
    assert builder_mod.weak_expert_problem("hopper", "Hopper-v5", 2002.5, 300_000, 0) is None
    assert builder_mod.weak_expert_problem("pendulum", "Pendulum-v1", -1500.0, 20_000, 0) is None  # no D4RL scores
