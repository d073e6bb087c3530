"""Model files with nested estimators: Pipelines, estimators held as parameters, fitted transformer state,
a strict class allow-list (no code runs on load), format versions, and atomic writes."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import sklearn.pipeline
import torch
from sklearn.exceptions import NotFittedError

import offrl
from offrl.algos import IQL
from offrl.datasets import Dataset
from offrl.datasets.transformers import DatasetTransformer, PotentialShaping, RewardScaler, is_fitted_estimator
from offrl.pipeline import Pipeline, make_pipeline
from offrl.serialization import MODEL_FORMAT_VERSION, _json, model_payload
from conftest import pendulum_shaped_dataset

SMALL = dict(hidden_dims=(32, 32), batch_size=32, device="cpu")


class OutsideLabeler(DatasetTransformer):
    """A transformer defined outside the offrl package: it cannot go into a model file."""

    def _transform(self, dataset: Dataset) -> Dataset:
        return dataset


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data() -> Dataset:
    return pendulum_shaped_dataset(n_episodes=6, length=40)


@pytest.fixture(scope="module")
def fitted_pipe(data) -> Pipeline:
    pipe = make_pipeline(RewardScaler(method="return_range", target=100.0, shift=-0.5), IQL(**SMALL, random_state=0))
    return pipe.fit(data, iql__n_steps=20, iql__progress=False)


def assert_same_predictions(a, b, data: Dataset) -> None:
    obs, actions = data.observations, data.actions
    np.testing.assert_array_equal(a.predict(obs), b.predict(obs))
    np.testing.assert_array_equal(a.predict_value(obs, actions), b.predict_value(obs, actions))


# ---------------------------------------------------------------------- Pipelines
def test_pipeline_round_trip_is_bit_identical(fitted_pipe, data, tmp_path):
    fitted_pipe.save(tmp_path / "pipe.pt")
    torch.load(tmp_path / "pipe.pt", weights_only=True)  # plain containers, strings and tensors only
    loaded = offrl.load(tmp_path / "pipe.pt")
    assert type(loaded) is Pipeline and [n for n, _ in loaded.steps] == ["rewardscaler", "iql"]
    assert loaded.get_params(deep=False)["memory"] is None
    scaler, iql = loaded.named_steps["rewardscaler"], loaded.named_steps["iql"]
    assert scaler.get_params() == fitted_pipe[0].get_params() and scaler.scale_ == fitted_pipe[0].scale_
    assert type(scaler.scale_) is np.float32 and scaler.observation_dim_ == 3
    assert iql.hidden_dims == (32, 32) and iql.n_steps_done_ == 20
    assert_same_predictions(loaded, fitted_pipe, data)
    np.testing.assert_array_equal(scaler.transform(data).rewards, fitted_pipe[0].transform(data).rewards)
    # offrl.save writes the same model; a plain scikit-learn Pipeline comes back as one.
    plain = sklearn.pipeline.Pipeline(list(fitted_pipe.steps))
    offrl.save(plain, tmp_path / "plain.pt")
    loaded_plain = offrl.load(tmp_path / "plain.pt")
    assert type(loaded_plain) is sklearn.pipeline.Pipeline
    np.testing.assert_array_equal(loaded_plain.predict(data.observations), fitted_pipe.predict(data.observations))
    assert loaded.evaluate("Pendulum-v1", n_episodes=1) == fitted_pipe.evaluate("Pendulum-v1", n_episodes=1)


def test_fitted_estimator_parameter_round_trips(data, tmp_path):
    potential = IQL(**SMALL, random_state=1).fit(data, n_steps=10, progress=False)
    shaping = PotentialShaping(potential=potential, gamma=0.9)
    pipe = make_pipeline(shaping, PotentialShaping(potential=potential, scale=0.0), IQL(**SMALL, random_state=0))
    pipe.fit(data, iql__n_steps=10, iql__progress=False)
    pipe.save(tmp_path / "shaped.pt")
    loaded = offrl.load(tmp_path / "shaped.pt", device="cpu")
    inner = loaded[0].potential
    assert type(inner) is IQL and is_fitted_estimator(inner) and inner is not potential
    assert inner is loaded[1].potential  # one object referenced twice is saved once and comes back as one
    assert_same_predictions(inner, potential, data)
    np.testing.assert_array_equal(loaded[0].transform(data).rewards, shaping.transform(data).rewards)
    assert_same_predictions(loaded, pipe, data)
    payload = torch.load(tmp_path / "shaped.pt", weights_only=True)
    assert payload["format_version"] == MODEL_FORMAT_VERSION == 2 and len(payload["nested"]) == 4


def test_unfitted_estimator_parameter_round_trips(tmp_path):
    offrl.save(PotentialShaping(potential=IQL(hidden_dims=(8,), expectile=0.6), gamma=0.5), tmp_path / "s.pt")
    loaded = offrl.load(tmp_path / "s.pt")
    assert loaded.gamma == 0.5 and type(loaded.potential) is IQL and not is_fitted_estimator(loaded.potential)
    assert loaded.potential.hidden_dims == (8,) and loaded.potential.expectile == 0.6


def test_fitted_state_values_round_trip_exactly(data, tmp_path):
    scaler = RewardScaler().fit(data)
    notes = {
        "tuple": (1, 2.5, "x", None, True),
        "list": [np.int64(3), np.float32(0.1), np.bool_(True)],
        "array": np.arange(6, dtype=np.int16).reshape(2, 3),
        "tensor": torch.linspace(0, 1, 5, dtype=torch.float64),
        "nan": float("nan"),
        "nested": {"deeper": [(0.5,), {"empty": []}]},
    }
    scaler.notes_ = notes
    scaler.expert_ = data.subset([0]).without_actions(keep=np.arange(40) % 3 == 0)  # masks travel too
    offrl.save(scaler, tmp_path / "scaler.pt")
    loaded = offrl.load(tmp_path / "scaler.pt").notes_
    assert loaded["tuple"] == notes["tuple"] and type(loaded["tuple"]) is tuple
    assert [type(v) for v in loaded["list"]] == [np.int64, np.float32, np.bool_]
    assert loaded["list"][1] == np.float32(0.1)
    assert loaded["array"].dtype == np.int16 and np.array_equal(loaded["array"], notes["array"])
    assert torch.equal(loaded["tensor"], notes["tensor"]) and loaded["tensor"].dtype == torch.float64
    assert np.isnan(loaded["nan"]) and loaded["nested"] == {"deeper": [(0.5,), {"empty": []}]}
    expert = offrl.load(tmp_path / "scaler.pt").expert_
    assert isinstance(expert, Dataset) and expert.metadata == scaler.expert_.metadata
    np.testing.assert_array_equal(expert.observations, scaler.expert_.observations)
    np.testing.assert_array_equal(expert.action_high, scaler.expert_.action_high)
    np.testing.assert_array_equal(expert.label_mask("actions"), np.arange(40) % 3 == 0)


def test_unstorable_parameter_is_named(data, tmp_path):
    pipe = make_pipeline(PotentialShaping(potential=IQL(**SMALL), scale=np.random.default_rng(0)), IQL(**SMALL))
    with pytest.raises(TypeError, match=r"Pipeline\.steps\[0\]\[1\]\.scale holds a numpy.*Generator"):
        model_payload(pipe)
    with pytest.raises(TypeError, match=r"RewardScaler\.target has a dict key 1"):
        model_payload(RewardScaler(target={1: 2}))
    with pytest.raises(NotFittedError, match="fit it before saving"):
        offrl.save(make_pipeline(RewardScaler(), IQL(**SMALL)), tmp_path / "unfitted.pt")
    with pytest.raises(NotFittedError):
        Pipeline([("iql", IQL(**SMALL))]).save(tmp_path / "unfitted.pt")
    assert not os.listdir(tmp_path)


# ---------------------------------------------------------------------- what a file may name
def payload_with(tmp_path, name: str, payload: dict) -> str:
    path = tmp_path / name
    torch.save(payload, path)
    return str(path)


@pytest.mark.parametrize("cls", ["os:system", "builtins:eval", "subprocess:Popen", "offrl.datasets.core:Dataset",
                                 "offrl.algos.base:torch", "offrl.__main__:main",
                                 "tests.test_serialization:OutsideLabeler"])
def test_a_file_naming_another_class_is_refused(cls, fitted_pipe, tmp_path):
    marker = tmp_path / "ran"
    params = json.dumps({"command": f"touch {marker}", "source": f"open({str(marker)!r}, 'w')"})
    root = {"format": "offrl-model", "format_version": 2, "class": cls, "params": params, "nested": {}, "tensors": {}}
    with pytest.raises(ValueError, match="refusing to load it"):
        offrl.load(payload_with(tmp_path, "root.pt", root))
    # The same name deep inside a valid pipeline file is refused too.
    payload = model_payload(fitted_pipe)
    ref = next(iter(payload["nested"]))
    payload["nested"][ref] = dict(payload["nested"][ref], **{"class": cls, "params": params})
    with pytest.raises(ValueError, match="refusing to load it"):
        offrl.load(payload_with(tmp_path, "nested.pt", payload))
    assert not marker.exists()


def test_a_class_outside_offrl_is_refused_at_save(data, tmp_path):
    pipe = sklearn.pipeline.Pipeline([("mine", OutsideLabeler()), ("iql", IQL(**SMALL, random_state=0))])
    pipe.fit(data, iql__n_steps=2, iql__progress=False)
    with pytest.raises(TypeError, match=r"Pipeline\.steps\[0\]\[1\] is a .*OutsideLabeler.*offrl package"):
        offrl.save(pipe, tmp_path / "mine.pt")
    assert not (tmp_path / "mine.pt").exists()


def test_damaged_references_give_clear_errors(fitted_pipe, tmp_path):
    payload = model_payload(fitted_pipe)
    payload["nested"].pop(next(iter(payload["nested"])))
    with pytest.raises(ValueError, match="does not contain; the file is damaged"):
        offrl.load(payload_with(tmp_path, "damaged.pt", payload))


# ---------------------------------------------------------------------- format versions and atomic writes
def test_format_1_files_still_load(data, tmp_path):
    algo = IQL(**SMALL, random_state=0).fit(data, n_steps=5, progress=False)
    v1 = {  # what offrl wrote before nesting (format 1)
        "format": "offrl-model", "format_version": 1, "offrl_version": "0.1.0", "class": "offrl.algos.iql:IQL",
        "params": _json(algo.get_params(deep=False)), "spec": _json(algo.spec_),
        "attributes": _json(algo._fitted_attributes()),
        "state": {name: obj.state_dict() for name, obj in algo._state_objects().items()},
    }
    loaded = offrl.load(payload_with(tmp_path, "v1.pt", v1))
    assert loaded.hidden_dims == (32, 32)
    assert_same_predictions(loaded, algo, data)
    v1["format_version"] = 3
    with pytest.raises(ValueError, match=r"model format 3 .*reads formats \[1, 2\]"):
        offrl.load(payload_with(tmp_path, "v3.pt", v1))


def test_files_with_state_names_of_older_versions_load(data, tmp_path):
    """SAC and CQL model files written before issue 10 named the temperatures log_alpha / log_alpha_(prime_)."""
    from offrl.algos import CQL, SAC

    sac = SAC(hidden_dims=(16,), random_state=0)
    sac._build_all(sac.spec_from_env(__import__("gymnasium").make("Pendulum-v1")))
    cql = CQL(**SMALL, random_state=0).fit(data, n_steps=3, progress=False)
    renames = {SAC: lambda st: {**st, "temperature_": {"log_alpha": st["temperature_"]["log_value"]}},
               CQL: lambda st: {("log_alpha_" if k == "temperature_" else "log_alpha_prime_" if k == "alpha_prime_"
                                 else k): v for k, v in st.items()}}
    for algo in (sac, cql):
        state = {name: obj.state_dict() for name, obj in algo._state_objects().items()}
        old = {"format": "offrl-model", "format_version": 1, "offrl_version": "0.1.0",
               "class": f"{type(algo).__module__}:{type(algo).__qualname__}",
               "params": _json(algo.get_params(deep=False)), "spec": _json(algo.spec_),
               "attributes": _json(algo._fitted_attributes()), "state": renames[type(algo)](state)}
        loaded = offrl.load(payload_with(tmp_path, f"{type(algo).__name__}.pt", old))
        assert float(loaded.temperature_().detach()) == float(algo.temperature_().detach())


def test_nothing_half_written_on_a_failed_save(fitted_pipe, tmp_path, monkeypatch):
    target = tmp_path / "model.pt"
    target.write_bytes(b"previous model")
    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        real_save(obj, path, *args, **kwargs)
        with open(path, "r+b") as f:
            f.truncate(10)
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        fitted_pipe.save(target)
    assert target.read_bytes() == b"previous model" and os.listdir(tmp_path) == ["model.pt"]
