"""Dataset transformers and Pipelines of a transformer and an algorithm: fit options routed by step name,
predictions on raw observations, evaluation, clone (fitted-estimator parameters stay fitted), grid-search names."""

from __future__ import annotations

import numpy as np
import pytest
import sklearn.base
import sklearn.pipeline
import torch
from sklearn.exceptions import NotFittedError
from sklearn.model_selection import ParameterGrid
from sklearn.preprocessing import FunctionTransformer
from torch import nn

import offrl
from offrl.algos import IQL
from offrl.datasets import Dataset
from offrl.datasets.transformers import (
    DatasetTransformer,
    PotentialShaping,
    RewardScaler,
    clone_keeping_fitted_params,
    is_fitted_estimator,
)
from offrl.pipeline import Pipeline, make_pipeline
from conftest import pendulum_shaped_dataset

SMALL = dict(hidden_dims=(32, 32), batch_size=32, device="cpu")


class ToyLabeler(DatasetTransformer):
    """Test-only labeller: rewards minus their fitted mean, times `factor`."""

    def __init__(self, factor: float = 1.0) -> None:
        self.factor = factor

    def _fit(self, dataset: Dataset, **fit_params) -> None:
        self.mean_ = np.float32(dataset.rewards.mean())

    def _transform(self, dataset: Dataset) -> Dataset:
        return dataset.with_rewards((dataset.rewards - self.mean_) * np.float32(self.factor))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data() -> Dataset:
    return pendulum_shaped_dataset(n_episodes=6, length=40)


@pytest.fixture(scope="module")
def fitted_iql(data) -> IQL:
    return IQL(**SMALL, random_state=1).fit(data, n_steps=20, progress=False)


# ---------------------------------------------------------------------- the transformer base
def test_dataset_transformer_fit_transform_and_pass_through(data, tmp_path):
    labeler = ToyLabeler(factor=2.0)
    with pytest.raises(NotFittedError, match="call fit"):
        labeler.transform(data)
    assert not is_fitted_estimator(labeler)
    assert labeler.fit(data) is labeler and is_fitted_estimator(labeler)
    out = labeler.transform(data)
    np.testing.assert_array_equal(out.rewards, (data.rewards - data.rewards.mean(dtype=np.float32)) * np.float32(2))
    np.testing.assert_array_equal(out.observations, data.observations)
    # Anything that is not a Dataset (raw observations at predict time) passes through as the same object.
    obs = data.observations[:5]
    assert labeler.transform(obs) is obs
    assert labeler.transform([0.0, 1.0, 2.0]) == [0.0, 1.0, 2.0]
    np.testing.assert_array_equal(ToyLabeler(factor=2.0).fit_transform(data).rewards, out.rewards)
    # A load spec is loaded once, in fit and in transform.
    data.save(tmp_path / "d.npz")
    np.testing.assert_array_equal(ToyLabeler(2.0).fit_transform(str(tmp_path / "d.npz")).rewards, out.rewards)
    other = Dataset.from_arrays(observations=np.zeros((4, 5)), actions=np.zeros((4, 1)), rewards=np.zeros(4),
                                terminals=[0, 0, 0, 1])
    with pytest.raises(ValueError, match="observations of dimension 3 but the dataset has 5"):
        labeler.transform(other)
    with pytest.raises(TypeError, match="needs an offrl Dataset"):
        ToyLabeler().fit(np.zeros((3, 3)))


def test_reward_scaler_methods_and_errors(data):
    returns = data.episode_returns()
    scaler = RewardScaler(method="return_range", target=1000.0, shift=-1.0).fit(data)
    assert scaler.scale_.dtype == np.float32
    assert scaler.scale_ == np.float32(1000.0 / float(returns.max() - returns.min()))
    out = scaler.transform(data)
    np.testing.assert_array_equal(out.rewards, data.rewards * scaler.scale_ + np.float32(-1.0))
    assert out.metadata["transforms"][-1]["transformer"] == "RewardScaler"
    assert "transforms" not in data.metadata  # the input dataset is not modified
    assert RewardScaler(method="std").fit(data).transform(data).rewards.std() == pytest.approx(1.0, rel=1e-5)
    assert np.abs(RewardScaler(method="max_abs", target=2.0).fit_transform(data).rewards).max() == pytest.approx(2.0)
    assert RewardScaler(method="none").fit(data).scale_ == 1.0
    with pytest.raises(ValueError, match="method must be one of"):
        RewardScaler(method="zscore").fit(data)
    with pytest.raises(ValueError, match="target must be a positive number"):
        RewardScaler(target=0.0).fit(data)
    flat = data.with_rewards(np.ones(data.n_transitions, np.float32))
    with pytest.raises(ValueError, match="constant rewards"):
        RewardScaler(method="std").fit(flat)
    with pytest.raises(ValueError, match="RewardScaler needs rewards"):
        RewardScaler().fit(data.without_rewards())
    with pytest.raises(ValueError, match="RewardScaler needs rewards"):
        scaler.transform(data.without_rewards(keep=np.arange(data.n_transitions) > 5))


def test_potential_shaping_matches_its_formula(data, fitted_iql):
    shaping = PotentialShaping(potential=fitted_iql, gamma=0.9, scale=0.5, batch_size=7)
    out = shaping.transform(data)  # needs no fit: the potential is the fitted state

    def phi(obs):
        return fitted_iql.predict_value(obs, fitted_iql.predict(obs))

    expected = data.rewards + np.float32(0.5) * (
        np.float32(0.9) * (1 - data.terminals) * phi(data.next_observations) - phi(data.observations))
    np.testing.assert_allclose(out.rewards, expected, rtol=1e-6, atol=1e-6)
    assert out.metadata["transforms"][-1] == {"transformer": "PotentialShaping", "potential": "IQL",
                                              "gamma": 0.9, "scale": 0.5}
    with pytest.raises(NotFittedError, match="potential"):
        PotentialShaping(potential=IQL(**SMALL)).transform(data)
    with pytest.raises(TypeError, match="potential must be a fitted estimator"):
        PotentialShaping().transform(data)


# ---------------------------------------------------------------------- Pipelines
def test_plain_sklearn_pipeline_fits_predicts_and_clones(data):
    """The acceptance test: a plain scikit-learn Pipeline of a toy labeller and IQL."""
    pipe = sklearn.pipeline.Pipeline([("label", ToyLabeler(factor=3.0)), ("iql", IQL(**SMALL, random_state=0))])
    assert pipe.fit(data, iql__n_steps=20, iql__progress=False) is pipe
    assert pipe.named_steps["iql"].n_steps_done_ == 20
    obs = data.observations[:16]
    actions = pipe.predict(obs)
    assert actions.shape == (16, 1) and np.all(np.abs(actions) <= 2.0)
    # The algorithm trained on the labelled data: the same as composing the two by hand.
    manual = IQL(**SMALL, random_state=0).fit(ToyLabeler(3.0).fit_transform(data), n_steps=20, progress=False)
    np.testing.assert_array_equal(actions, manual.predict(obs))
    clone = sklearn.base.clone(pipe)
    assert clone.get_params()["iql__hidden_dims"] == (32, 32) and clone.get_params()["label__factor"] == 3.0
    assert not is_fitted_estimator(clone.named_steps["iql"]) and not is_fitted_estimator(clone.named_steps["label"])
    with pytest.raises(NotFittedError):
        clone.predict(obs)
    np.testing.assert_array_equal(clone.fit(data, iql__n_steps=20, iql__progress=False).predict(obs), actions)


def test_offrl_pipeline_fit_options_predict_evaluate_and_export(data, tmp_path):
    pipe = make_pipeline(RewardScaler(method="return_range", target=100.0), IQL(**SMALL, random_state=0))
    assert isinstance(pipe, Pipeline) and [name for name, _ in pipe.steps] == ["rewardscaler", "iql"]
    with pytest.raises(NotFittedError, match="before sample_action"):
        pipe.sample_action(data.observations[:2])
    pipe.fit(data, iql__n_steps=20, iql__progress=False)
    iql = pipe.named_steps["iql"]
    obs, actions = data.observations[:8], data.actions[:8]
    np.testing.assert_array_equal(pipe.predict(obs), iql.predict(obs))
    np.testing.assert_array_equal(pipe.predict_value(obs, actions), iql.predict_value(obs, actions))
    assert pipe.sample_action(obs).shape == (8, 1)
    assert pipe.predict(obs[0]).shape == (1,)
    result = pipe.evaluate("Pendulum-v1", n_episodes=1, seed=3)
    assert result == iql.evaluate("Pendulum-v1", n_episodes=1, seed=3)
    assert result["n_episodes"] == 1 and np.isfinite(result["normalized_score_mean"])
    # Roll-outs that take "an estimator" (its make_actor) take the pipeline as well.
    from offrl.evaluation import evaluate_policy

    assert evaluate_policy(pipe, "Pendulum-v1", n_episodes=1, seed=3)["return_mean"] == result["return_mean"]
    pipe.export_policy(tmp_path / "policy.pt")
    assert (tmp_path / "policy.pt").exists()
    assert offrl.make_pipeline is make_pipeline and offrl.Pipeline is Pipeline


def test_pipeline_refuses_to_hand_raw_observations_past_an_opaque_step(data):
    pipe = Pipeline([("identity", FunctionTransformer()), ("iql", IQL(**SMALL, random_state=0))])
    pipe.fit(data, iql__n_steps=2, iql__progress=False)
    with pytest.raises(TypeError, match="step 'identity' .*not an offrl DatasetTransformer"):
        pipe.evaluate("Pendulum-v1", n_episodes=1)


def test_set_params_and_parameter_grid_names(data):
    pipe = make_pipeline(ToyLabeler(), IQL(**SMALL))
    pipe.set_params(iql__expectile=0.8, toylabeler__factor=2.0)
    assert pipe.named_steps["iql"].expectile == 0.8 and pipe.named_steps["toylabeler"].factor == 2.0
    grid = ParameterGrid({"iql__expectile": [0.6, 0.9], "toylabeler__factor": [0.5, 1.5], "iql__n_steps": [3]})
    seen = set()
    for params in grid:
        candidate = sklearn.base.clone(pipe).set_params(**params)
        candidate.fit(data, iql__progress=False)
        iql = candidate.named_steps["iql"]
        assert iql.n_steps_done_ == 3
        seen.add((iql.expectile, candidate.named_steps["toylabeler"].factor))
    assert seen == {(0.6, 0.5), (0.6, 1.5), (0.9, 0.5), (0.9, 1.5)}
    assert pipe.named_steps["iql"].expectile == 0.8  # the template is untouched
    assert make_pipeline(RewardScaler(), RewardScaler(), IQL()).steps[1][0] == "rewardscaler-2"


def test_clone_keeps_fitted_estimator_parameters_fitted(data, fitted_iql):
    shaping = PotentialShaping(potential=fitted_iql, gamma=0.9)
    clone = sklearn.base.clone(shaping)
    assert clone is not shaping and clone.potential is fitted_iql and clone.gamma == 0.9
    assert is_fitted_estimator(clone.potential)
    # An unfitted estimator parameter is cloned as scikit-learn always does.
    unfitted = IQL(**SMALL, expectile=0.6)
    clone = sklearn.base.clone(PotentialShaping(potential=unfitted))
    assert clone.potential is not unfitted and clone.potential.get_params() == unfitted.get_params()
    # Inside a cloned Pipeline: the transformer step is new, its fitted potential is kept, the algorithm is unfitted.
    pipe = make_pipeline(PotentialShaping(potential=fitted_iql), IQL(**SMALL, random_state=0))
    pipe.fit(data, iql__n_steps=5, iql__progress=False)
    cloned = sklearn.base.clone(pipe)
    assert cloned[0] is not pipe[0] and cloned[0].potential is fitted_iql
    assert not is_fitted_estimator(cloned[-1])
    np.testing.assert_array_equal(cloned.fit(data, iql__n_steps=5, iql__progress=False).predict(data.observations),
                                  pipe.predict(data.observations))


def test_clone_keeping_fitted_params_checks_the_constructor():
    class Renaming(DatasetTransformer):
        def __init__(self, value: tuple = ()) -> None:
            self.value = list(value)

    with pytest.raises(RuntimeError, match="does not store parameter 'value' unchanged"):
        clone_keeping_fitted_params(Renaming((1, 2)))


def test_fitted_state_protocol_rebuilds_modules():
    class WithNet(DatasetTransformer):
        def _fit(self, dataset, **_):
            self.width_ = 4
            self.net_ = nn.Linear(3, self.width_)

        def _build_fitted_modules(self):
            self.net_ = nn.Linear(3, self.width_)

        def _transform(self, dataset):
            return dataset

    first = WithNet().fit(pendulum_shaped_dataset(n_episodes=1, length=5))
    state = first._get_fitted_state()
    assert set(state) == {"width_", "net_", "observation_dim_"}
    values = {k: v for k, v in state.items() if not isinstance(v, nn.Module)}
    second = WithNet()
    second._set_fitted_state(values, {"net_": first.net_.state_dict()})
    assert second.width_ == 4 and torch.equal(second.net_.weight, first.net_.weight)

    class NoBuilder(DatasetTransformer):
        def _transform(self, dataset):
            return dataset

    with pytest.raises(NotImplementedError, match="must implement _build_fitted_modules"):
        NoBuilder()._set_fitted_state({}, {"net_": first.net_.state_dict()})


def test_transformer_base_and_pipeline_import_no_algorithm():
    """The transformer base is data layer: importing it (or offrl.pipeline) loads no offrl.algos module."""
    import subprocess
    import sys

    code = ("import sys, offrl.datasets.transformers, offrl.pipeline; "
            "print(sorted(m for m in sys.modules if m.startswith('offrl.algos')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
