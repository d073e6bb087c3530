"""The estimator base shared by every offline algorithm: scikit-learn conventions, the fit loop,
logging, checkpoints and resume, divergence detection, evaluation, model files and export."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
import warnings

import gymnasium as gym
import numpy as np
import pytest
import sklearn.base
import torch
from sklearn.exceptions import NotFittedError

import offrl
from offrl.algos import BC, IQL, TD3PlusBC
from offrl.algos.base import TrainingDivergedError, resolve_device
from offrl.datasets import Dataset
from conftest import pendulum_shaped_dataset

SMALL = dict(hidden_dims=(32, 32), batch_size=32)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data() -> Dataset:
    return pendulum_shaped_dataset()


def state_of(algo) -> dict[str, torch.Tensor]:
    return {f"{name}.{k}": v.clone() for name, module in algo._state_objects().items()
            for k, v in module.state_dict().items()}


def assert_same_state(a, b) -> None:
    sa, sb = state_of(a), state_of(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


# ---------------------------------------------------------------------- scikit-learn conventions
def test_init_stores_params_and_clone_gives_an_unfitted_copy(data):
    algo = TD3PlusBC(alpha=1.5, hidden_dims=(32, 32), random_state=3)
    assert algo.get_params()["alpha"] == 1.5 and algo.get_params()["random_state"] == 3
    assert not any(k.endswith("_") for k in vars(algo))  # __init__ does no work
    algo.set_params(alpha=2.0)
    assert algo.alpha == 2.0
    assert algo.fit(data, n_steps=5, progress=False) is algo
    copy = sklearn.base.clone(algo)
    assert copy.get_params() == algo.get_params()
    assert not hasattr(copy, "policy_") and hasattr(algo, "policy_") and algo.n_steps_done_ == 5


@pytest.mark.parametrize("call", ["predict", "sample_action", "predict_value", "evaluate", "save", "export_policy"])
def test_methods_before_fit_raise_not_fitted(call, tmp_path):
    algo = IQL()
    args = {"predict": (np.zeros(3),), "sample_action": (np.zeros(3),), "predict_value": (np.zeros(3), np.zeros(1)),
            "evaluate": ("Pendulum-v1",), "save": (tmp_path / "m.pt",), "export_policy": (tmp_path / "p.pt",)}[call]
    with pytest.raises(NotFittedError, match="not fitted"):
        getattr(algo, call)(*args)


def test_predict_one_or_many_observations(data):
    algo = IQL(**SMALL, random_state=0).fit(data, n_steps=20, progress=False)
    obs = data.observations[:5]
    batch = algo.predict(obs)
    assert batch.shape == (5, 1) and batch.dtype == np.float32
    np.testing.assert_allclose(algo.predict(obs[0]), batch[0], rtol=1e-5, atol=1e-6)  # matmul kernels vary with n
    assert np.all(np.abs(batch) <= 2.0)
    assert algo.sample_action(obs).shape == (5, 1)
    assert not np.array_equal(algo.sample_action(obs), batch)  # stochastic policy
    values = algo.predict_value(obs, data.actions[:5])
    assert values.shape == (5,) and np.isfinite(values).all()
    assert np.ndim(algo.predict_value(obs[0], data.actions[0])) == 0
    with pytest.raises(ValueError, match=r"observations has shape \(5, 2\)"):
        algo.predict(obs[:, :2])
    with pytest.raises(AttributeError, match="no critic"):
        BC(**SMALL).fit(data, n_steps=2, progress=False).predict_value(obs, data.actions[:5])


def test_random_state_makes_runs_bit_for_bit_repeatable(data):
    a = TD3PlusBC(**SMALL, random_state=7).fit(data, n_steps=30, progress=False)
    b = TD3PlusBC(**SMALL, random_state=7).fit(data, n_steps=30, progress=False)
    c = TD3PlusBC(**SMALL, random_state=8).fit(data, n_steps=30, progress=False)
    assert_same_state(a, b)
    assert not np.array_equal(a.predict(data.observations[:8]), c.predict(data.observations[:8]))


def test_device_auto_and_validation():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


# ---------------------------------------------------------------------- fit loop: logs, checkpoints, resume
def test_logs_to_csv_and_evaluates_periodically(data, tmp_path):
    algo = BC(**SMALL, random_state=0)
    algo.fit(data, n_steps=40, log_dir=tmp_path, log_every=10, eval_env="Pendulum-v1", eval_every=20, eval_episodes=1,
             progress=False)
    with open(tmp_path / "train.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [10, 20, 30, 40]
    assert all(math.isfinite(float(r["bc_loss"])) for r in rows)
    with open(tmp_path / "eval.csv") as f:
        evals = list(csv.DictReader(f))
    assert [int(r["step"]) for r in evals] == [20, 40]
    assert {"return_mean", "normalized_score_mean"} <= set(evals[0])
    assert [h["step"] for h in algo.history_] == [20, 40]
    expected = 100 * (algo.history_[-1]["return_mean"] + 1500.0) / (1500.0 - 150.0)
    assert algo.history_[-1]["normalized_score_mean"] == pytest.approx(expected)


@pytest.mark.parametrize("cls", [TD3PlusBC, IQL])
def test_resume_continues_to_the_same_result(cls, data, tmp_path):
    full = cls(**SMALL, random_state=1).fit(data, n_steps=60, log_every=10, progress=False)

    interrupted = cls(**SMALL, random_state=1)
    interrupted.fit(data, n_steps=60, log_dir=tmp_path, checkpoint_every=20, log_every=10, progress=False,
                    callbacks=[lambda algo, step, metrics: step < 30])  # stops after step 30; last checkpoint: 20
    assert interrupted.n_steps_done_ == 30
    resumed = cls(**SMALL, random_state=1).fit(data, n_steps=60, log_dir=tmp_path, checkpoint_every=20, log_every=10,
                                               resume=True, progress=False)
    assert resumed.n_steps_done_ == 60
    assert (full.resumed_from_step_, interrupted.resumed_from_step_, resumed.resumed_from_step_) == (0, 0, 20)
    assert_same_state(full, resumed)
    np.testing.assert_array_equal(full.predict(data.observations[:16]), resumed.predict(data.observations[:16]))
    with open(tmp_path / "train.csv") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps == [10, 20, 30, 40, 50, 60]  # rows after the checkpoint were replaced, not duplicated


def test_resume_without_checkpoint_starts_fresh_and_needs_a_log_dir(data, tmp_path):
    algo = BC(**SMALL, random_state=0).fit(data, n_steps=10, log_dir=tmp_path, resume=True, progress=False)
    assert algo.n_steps_done_ == 10
    with pytest.raises(ValueError, match="need a log_dir"):
        BC(**SMALL).fit(data, n_steps=10, resume=True, progress=False)


def test_nan_loss_stops_with_the_loss_name_and_step_and_keeps_the_last_good_checkpoint(data, tmp_path):
    def explode(algo, step, metrics):  # a bad learning-rate change at step 20
        if step == 20:
            algo.optimizer_.param_groups[0]["lr"] = 1e38

    algo = BC(**SMALL, random_state=0)
    with pytest.raises(TrainingDivergedError, match=r"loss 'bc_loss' became (nan|inf) at step 30") as err:
        algo.fit(data, n_steps=100, log_dir=tmp_path, checkpoint_every=10, log_every=10, callbacks=[explode], progress=False)
    assert str(tmp_path / "checkpoint.pt") in str(err.value)
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["checkpoint"]["step"] == 20
    resumed = BC(**SMALL, random_state=0).fit(data, n_steps=40, log_dir=tmp_path, resume=True, progress=False)
    assert np.isfinite(resumed.last_metrics_["bc_loss"])


def test_precision_bf16_keeps_fp32_weights(data):
    algo = TD3PlusBC(**SMALL, precision="bf16", random_state=0).fit(data, n_steps=20, progress=False)
    assert all(p.dtype == torch.float32 for p in algo.critic_.parameters())
    assert all(math.isfinite(v) for v in algo.last_metrics_.values())
    assert algo.predict(data.observations[:3]).dtype == np.float32
    with pytest.raises(ValueError, match="precision must be one of"):
        TD3PlusBC(**SMALL, precision="fp8").fit(data, n_steps=1, progress=False)


@pytest.mark.parametrize("capability, warns", [("AVX2", True), ("AVX512", False)])
def test_bf16_on_a_cpu_without_avx512_warns_to_use_fp32(data, monkeypatch, capability, warns):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TD3PlusBC(**SMALL, precision="bf16", random_state=0).fit(data, n_steps=2, progress=False)
        TD3PlusBC(**SMALL, precision="fp32", random_state=0).fit(data, n_steps=2, progress=False)
    messages = [str(w.message) for w in caught if "emulated bf16" in str(w.message)]
    assert len(messages) == int(warns)
    if warns:
        assert "TD3PlusBC(precision='bf16')" in messages[0] and "AVX2" in messages[0] and "precision='fp32'" in messages[0]


def test_bf16_warning_covers_online_training(data, monkeypatch):
    """The emulated-bf16 warning is given before online runs too: fine-tuning and SAC's own `fit_online`."""
    from offrl.algos import SAC

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    algo = TD3PlusBC(**SMALL, precision="bf16", random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        algo.fit(data, n_steps=2, progress=False)
    sac = SAC(hidden_dims=(32, 32), batch_size=32, learning_starts=5, precision="bf16", random_state=0)
    for name, run in [("TD3PlusBC", lambda: algo.fit_online("Pendulum-v1", 10, progress=False)),
                      ("SAC", lambda: sac.fit_online("Pendulum-v1", 10, progress=False))]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
        messages = [str(w.message) for w in caught if "emulated bf16" in str(w.message)]
        assert len(messages) == 1 and f"{name}(precision='bf16')" in messages[0], (name, messages)


# ---------------------------------------------------------------------- evaluation
def test_evaluate_single_and_vector_env(data):
    algo = BC(**SMALL, random_state=0).fit(data, n_steps=10, progress=False)
    single = algo.evaluate("Pendulum-v1", n_episodes=2, seed=0)
    assert single["n_episodes"] == 2 and single["length_mean"] == 200
    assert single["normalized_score_mean"] == pytest.approx(100 * (single["return_mean"] + 1500) / 1350)
    assert single == algo.evaluate(gym.make("Pendulum-v1"), n_episodes=2, seed=0)
    vector = gym.vector.SyncVectorEnv([lambda: gym.make("Pendulum-v1")] * 2)
    result = algo.evaluate(vector, n_episodes=2, seed=0)
    assert result["n_episodes"] == 2 and {"return_mean", "return_std", "normalized_score_mean"} <= set(result)


# ---------------------------------------------------------------------- model files and export
def test_save_load_round_trip_gives_identical_predictions(data, tmp_path):
    algo = IQL(**SMALL, random_state=0).fit(data, n_steps=20, progress=False)
    algo.save(tmp_path / "iql.pt")
    torch.load(tmp_path / "iql.pt", weights_only=True)  # plain tensors and containers only
    loaded = offrl.load(tmp_path / "iql.pt")
    assert type(loaded) is IQL and loaded.get_params() == algo.get_params()
    obs, actions = data.observations[:32], data.actions[:32]
    np.testing.assert_array_equal(loaded.predict(obs), algo.predict(obs))
    np.testing.assert_array_equal(loaded.predict_value(obs, actions), algo.predict_value(obs, actions))
    assert loaded.spec_["reward_scale"] == algo.spec_["reward_scale"]
    assert loaded.n_steps_done_ == 20


def test_incompatible_model_file_gives_a_clear_error(data, tmp_path):
    BC(**SMALL).fit(data, n_steps=2, progress=False).save(tmp_path / "bc.pt")
    payload = torch.load(tmp_path / "bc.pt", weights_only=True)
    payload["format_version"] = 999
    torch.save(payload, tmp_path / "future.pt")
    with pytest.raises(ValueError, match="model format 999"):
        offrl.load(tmp_path / "future.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="could not be read as an offrl model file"):
        offrl.load(tmp_path / "junk.pt")


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("cls", [BC, TD3PlusBC, IQL])
def test_exported_torchscript_policy_matches_predict(cls, data, tmp_path):
    algo = cls(**SMALL, random_state=0).fit(data, n_steps=10, progress=False)
    algo.export_policy(tmp_path / "policy.pt")
    scripted = torch.jit.load(str(tmp_path / "policy.pt"))
    obs = data.observations[:10]
    exported = scripted(torch.as_tensor(obs)).numpy()
    np.testing.assert_allclose(exported, algo.predict(obs), rtol=1e-6, atol=1e-6)


def test_exported_policy_runs_without_offrl(data, tmp_path):
    algo = TD3PlusBC(**SMALL, random_state=0).fit(data, n_steps=4, progress=False)
    algo.export_policy(tmp_path / "policy.pt")
    np.save(tmp_path / "obs.npy", data.observations[:4])
    code = ("import sys, numpy, torch; assert 'offrl' not in sys.modules; "
            f"m = torch.jit.load({str(tmp_path / 'policy.pt')!r}); "
            f"numpy.save({str(tmp_path / 'out.npy')!r}, m(torch.from_numpy(numpy.load({str(tmp_path / 'obs.npy')!r}))).numpy()); "
            "assert 'offrl' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, capture_output=True)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), algo.predict(data.observations[:4]), rtol=1e-6, atol=1e-6)


def test_fit_refuses_a_dataset_missing_a_label_it_learns_from(data):
    unrewarded = data.without_rewards()
    with pytest.raises(ValueError, match=r"IQL needs rewards.*with_rewards.*offrl.reward_labeling"):
        IQL(**SMALL).fit(unrewarded, n_steps=1, progress=False)
    partly = data.without_rewards(keep=np.arange(data.n_transitions) % 3 != 0)
    with pytest.raises(ValueError, match="rewards"):
        TD3PlusBC(**SMALL).fit(partly, n_steps=1, progress=False)
    with pytest.raises(ValueError, match="actions"):
        BC(**SMALL).fit(data.without_actions(), n_steps=1, progress=False)
    # Behaviour cloning learns from actions alone: the same bits as with the rewards present.
    with_rewards = BC(**SMALL, random_state=0).fit(data, n_steps=5, progress=False)
    without = BC(**SMALL, random_state=0).fit(unrewarded, n_steps=5, progress=False)
    obs = data.observations[:4]
    np.testing.assert_array_equal(with_rewards.predict(obs), without.predict(obs))
