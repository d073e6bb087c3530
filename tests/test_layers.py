"""Layers point one way: the data layer (offrl.datasets) and the networks (offrl.nn) import nothing above them,
and the training core (monitor, online loop, replay buffer, roll-outs) imports no algorithm.

Checked twice: in a fresh interpreter through `sys.modules` (what importing
and loading really pulls in), and statically over every import statement of
those packages (including imports inside functions, which only run later).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import offrl
from conftest import d4rl_arrays, make_episodes, write_d4rl_hdf5
from offrl.datasets import Dataset

ROOT = Path(offrl.__file__).parent
LOW_PACKAGES = ("datasets", "nn")
# What the low layers must never import: the algorithms and everything built on them.
ABOVE = ("offrl.algos", "offrl.ope", "offrl.online", "offrl.sweep", "offrl.cli", "offrl.builder", "offrl.quickstart",
         "offrl.report", "offrl.reward_labeling", "offrl.monitor", "offrl.pipeline", "offrl.serialization")


def _run_fresh(code: str, **env: str) -> dict:
    """Run `code` in a new interpreter; it prints one JSON line, returned here."""
    import os

    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, **env}, cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


_LOADED_ABOVE = f"""
    import json, sys
    above = [m for m in sys.modules if m.startswith({ABOVE!r})]
    print(json.dumps({{"above": sorted(above), "datasets": "offrl.datasets" in sys.modules}}))
"""


def test_import_offrl_datasets_loads_no_algorithm():
    out = _run_fresh("import offrl.datasets\n" + textwrap.dedent(_LOADED_ABOVE))
    assert out["datasets"] and out["above"] == []


def test_the_data_layer_is_no_callable_module_and_has_no_build():
    import offrl.datasets

    assert not callable(offrl.datasets)
    with pytest.raises(AttributeError):
        offrl.datasets.build  # noqa: B018  (the builder is offrl.builder)
    with pytest.raises(TypeError, match="offrl.builder.load_or_build"):
        offrl.datasets.load("offrl:pendulum-medium-v1", build=True)


def _fake_build(root: Path, seed: int = 3) -> np.ndarray:
    """Write a small dataset where `offrl.builder` would put pendulum-medium-v1 (seed `seed`), with the build record
    the data layer checks, without training anything; return its actions."""
    from offrl.datasets.built import DATASET_VERSION, dataset_path, resolve
    from offrl.datasets.minari import to_minari

    request = resolve("pendulum-medium-v1", seed=seed)
    rng = np.random.default_rng(0)
    ds = Dataset.from_episodes(make_episodes((5, 4), obs_dim=3, act_dim=1, log_probs=True), discrete_actions=None)
    ds = Dataset.from_arrays(ds.observations, np.clip(rng.normal(size=(ds.n_transitions, 1)), -2, 2), ds.rewards,
                             terminals=ds.terminals, timeouts=ds.timeouts, next_observations=ds.next_observations,
                             behavior_log_probs=ds.behavior_log_probs, action_low=[-2.0], action_high=[2.0])
    dataset_id = request.dataset_id("medium")
    config = {"version": DATASET_VERSION, "env_id": "Pendulum-v1", "seed": seed, "sac_steps": request.sac_steps,
              "eval_every": request.eval_every, "eval_episodes": request.eval_episodes,
              "ref_episodes": request.ref_episodes, "n_transitions": request.n_transitions, "n_envs": request.n_envs,
              "expert": "final", "sac_params": {"lr": 3e-4, "buffer_size": request.sac_steps}}
    md = to_minari(ds, dataset_id, env="Pendulum-v1", ref_min_score=-1200.0, ref_max_score=-150.0, data_path=root)
    md.storage.update_metadata({"offrl_build": {"name": "pendulum-medium-v1", "kind": "medium", "dataset_id": dataset_id,
                                                "config": config, "medium_step": 100, "cut_episodes": [1],
                                                "n_transitions": ds.n_transitions, "n_episodes": ds.n_episodes,
                                                "return_mean": 0.0, "normalized_score_mean": 0.0}})
    del md
    assert (dataset_path(root, dataset_id) / "data").is_dir()
    return ds.actions


def test_loading_a_built_dataset_loads_no_algorithm(tmp_path):
    actions = _fake_build(tmp_path)
    out = _run_fresh(f"""
        import json, sys
        import numpy as np
        from offrl.datasets import load
        ds = load("offrl:pendulum-medium-v1", seed=3)
        np.save({str(tmp_path / "actions.npy")!r}, ds.actions)
        above = [m for m in sys.modules if m.startswith({ABOVE!r})]
        print(json.dumps({{"above": sorted(above), "n": ds.n_transitions, "kind": ds.metadata["kind"],
                          "cut": ds.metadata["cut_episodes"], "ref": [ds.metadata["ref_min_score"],
                                                                      ds.metadata["ref_max_score"]]}}))
    """, OFFRL_DATA_DIR=str(tmp_path))
    assert out["above"] == []
    assert out["n"] == len(actions) and out["kind"] == "medium" and out["cut"] == [1]
    assert out["ref"] == [-1200.0, -150.0]
    assert np.array_equal(np.load(tmp_path / "actions.npy"), actions)


def test_a_dataset_that_is_not_built_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFRL_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"`offrl datasets build pendulum-medium-v1 --seed 3` or "
                                                r"offrl\.builder\.load_or_build\('pendulum-medium-v1', seed=3\)"):
        offrl.datasets.load("offrl:pendulum-medium-v1", seed=3)
    _fake_build(tmp_path, seed=3)
    # Built, but not with this budget: the other budget is another variant, so it is not found either.
    with pytest.raises(FileNotFoundError, match="--transitions 5000"):
        offrl.datasets.load("offrl:pendulum-medium-v1", seed=3, n_transitions=5000)
    # A SAC setting the CLI cannot express: only the Python call is suggested.
    with pytest.raises(FileNotFoundError, match=r"has not been built.*build it with offrl\.builder\.load_or_build\("
                                                r"'pendulum-medium-v1', seed=3, sac_params=\{'lr': 0\.001\}\)"):
        offrl.datasets.load("offrl:pendulum-medium-v1", seed=3, sac_params={"lr": 1e-3})


def test_loading_every_other_spec_loads_no_algorithm(tmp_path):
    hdf5 = write_d4rl_hdf5(tmp_path / "d4rl" / "hopper-medium-v2.hdf5",
                           d4rl_arrays(float64=False, next_observations=True, column_rewards=False))
    from offrl.datasets.minari import to_minari

    episodes = Dataset.from_episodes(make_episodes((3, 4)), discrete_actions=None)
    ds = Dataset.from_arrays(episodes.observations, episodes.actions, episodes.rewards, terminals=episodes.terminals,
                             timeouts=episodes.timeouts, next_observations=episodes.next_observations,
                             action_low=[-1.0], action_high=[1.0])
    ds.save(tmp_path / "mine.npz")
    to_minari(ds, "test/pendulum/mine-v0", env="Pendulum-v1", data_path=tmp_path / "minari")
    out = _run_fresh(f"""
        import json, sys
        from offrl.datasets import load
        sizes = [load(spec).n_transitions for spec in ({str(hdf5)!r}, "d4rl:hopper-medium-v2",
                                                       {str(tmp_path / "mine.npz")!r}, "minari:test/pendulum/mine-v0")]
        above = [m for m in sys.modules if m.startswith({ABOVE!r})]
        print(json.dumps({{"above": sorted(above), "sizes": sizes}}))
    """, D4RL_DATASET_DIR=str(tmp_path / "d4rl"), MINARI_DATASETS_PATH=str(tmp_path / "minari"))
    assert out["above"] == []
    assert out["sizes"] == [14, 14, 7, 7]


# ---------------------------------------------------------------------- static scan
def imports_above(source: str, filename: str = "<source>", forbidden: tuple[str, ...] = ABOVE) -> list[str]:
    """'line: module' for every import in `source` (anywhere, functions included) of a module in ABOVE,
    written as `import x`, `from x import y`, `from offrl import algos` or `importlib.import_module("x")`."""

    def above(module: str) -> bool:
        return any(module == m or module.startswith(m + ".") for m in forbidden)

    found = []
    for node in ast.walk(ast.parse(source, filename)):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module] if above(node.module) else [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__"):
                modules = [node.args[0].value]
        found += [f"{node.lineno}: {m}" for m in modules if above(m)]
    return found


def test_the_scan_finds_imports_of_higher_layers():
    source = textwrap.dedent("""
        import numpy as np
        from offrl.datasets.core import Dataset
        def f():
            from offrl.algos.sac import SAC
            from offrl import ope
            import offrl.online.replay
            import importlib
            return importlib.import_module("offrl.builder")
    """)
    assert imports_above(source) == ["5: offrl.algos.sac", "6: offrl.ope", "7: offrl.online.replay",
                                     "9: offrl.builder"]


@pytest.mark.parametrize("package", LOW_PACKAGES)
def test_no_low_layer_module_imports_a_higher_layer(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    bad = {str(path.relative_to(ROOT.parent)): found for path in files
           if (found := imports_above(path.read_text(), str(path)))}
    assert bad == {}, f"the {package} layer imports higher layers: {bad}"


# The training core (the monitor, the online loop, the replay buffer, roll-outs) sits below the algorithms:
# SAC and `OfflineAlgorithm.fit_online` run on it, so it may know estimators only through their methods.
CORE_MODULES = ("monitor.py", "online/loop.py", "online/replay.py", "evaluation.py")
ABOVE_CORE = ("offrl.algos", "offrl.ope", "offrl.sweep", "offrl.cli", "offrl.builder", "offrl.quickstart",
              "offrl.report", "offrl.reward_labeling", "offrl.pipeline")


@pytest.mark.parametrize("module", CORE_MODULES)
def test_the_training_core_imports_no_algorithm(module):
    path = ROOT / module
    assert imports_above(path.read_text(), str(path), ABOVE_CORE) == []
