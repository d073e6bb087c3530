"""Pipelines of dataset transformers (labellers) ahead of an offrl algorithm.

`Pipeline` is scikit-learn's, plus what offrl users expect of a fitted
algorithm: `sample_action`, `predict_value`, `evaluate`, `export_policy` and
`save`, delegated to the final step.  The steps before it are
`DatasetTransformer`s: they rewrite the training Dataset at `fit` and pass
raw observations through unchanged afterwards, so the final algorithm acts
on what the environment gives.

    pipe = make_pipeline(RewardScaler(), IQL())
    pipe.fit(dataset, iql__n_steps=100_000)          # fit options: <step>__<name>
    pipe.set_params(iql__expectile=0.8)             # also GridSearch / ParameterGrid names
    pipe.predict(observations); pipe.evaluate("Pendulum-v1")
    pipe.save("model.pt"); offrl.load("model.pt")   # the whole pipeline, fitted state included

A plain `sklearn.pipeline.Pipeline` of the same steps fits, predicts, clones
and saves as well; this subclass only adds the delegating methods.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Callable

import sklearn.pipeline
from sklearn.exceptions import NotFittedError
from sklearn.utils.metaestimators import available_if
from sklearn.utils.validation import check_is_fitted

from offrl.datasets.transformers import DatasetTransformer

__all__ = ["Pipeline", "make_pipeline"]


def _final_step_has(method: str) -> Callable[[Any], bool]:
    def check(pipe: "Pipeline") -> bool:
        final = pipe.steps[-1][1] if pipe.steps else None
        return final not in (None, "passthrough") and hasattr(final, method)

    return check


class Pipeline(sklearn.pipeline.Pipeline):
    """scikit-learn's Pipeline with the final algorithm's offrl methods.

    `fit(dataset, **params)` routes `<step>__<option>` to that step's fit
    (`iql__n_steps=1000`, `iql__progress=False`); `predict(observations,
    deterministic=True)` passes observations through the transformers.
    """

    def _fitted_final(self, method: str) -> Any:
        try:
            check_is_fitted(self)
        except NotFittedError as err:
            raise NotFittedError(f"This Pipeline is not fitted yet; call fit(dataset) before {method}") from err
        return self.steps[-1][1]

    def _through_transformers(self, observations: Any) -> Any:
        for _, step in self.steps[:-1]:
            if step not in (None, "passthrough"):
                observations = step.transform(observations)
        return observations

    def _check_transparent(self, method: str) -> None:
        """Refuse methods that hand raw observations straight to the final step if a step could change them."""
        for name, step in self.steps[:-1]:
            if step not in (None, "passthrough") and not isinstance(step, DatasetTransformer):
                raise TypeError(
                    f"Pipeline.{method} gives the final step raw observations, but step {name!r} "
                    f"({type(step).__name__}) is not an offrl DatasetTransformer, which would pass them through "
                    "unchanged; use steps that transform Datasets only"
                )

    @available_if(_final_step_has("sample_action"))
    def sample_action(self, observations: Any) -> Any:
        """Actions sampled from the final algorithm's (stochastic) policy."""
        final = self._fitted_final("sample_action")
        return final.sample_action(self._through_transformers(observations))

    @available_if(_final_step_has("predict_value"))
    def predict_value(self, observations: Any, actions: Any) -> Any:
        """Q(s, a) from the final algorithm's critic."""
        final = self._fitted_final("predict_value")
        return final.predict_value(self._through_transformers(observations), actions)

    @available_if(_final_step_has("evaluate"))
    def evaluate(self, env: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Roll the final algorithm's policy out in `env` (same arguments as its `evaluate`)."""
        final = self._fitted_final("evaluate")
        self._check_transparent("evaluate")
        return final.evaluate(env, *args, **kwargs)

    @available_if(_final_step_has("make_actor"))
    def make_actor(self, *args: Any, **kwargs: Any) -> Any:
        """The final algorithm's acting interface, so roll-outs and OPE take a Pipeline like an algorithm."""
        final = self._fitted_final("make_actor")
        self._check_transparent("make_actor")
        return final.make_actor(*args, **kwargs)

    @available_if(_final_step_has("export_policy"))
    def export_policy(self, path: str | os.PathLike) -> None:
        """TorchScript of the final algorithm's policy (the transformers act on datasets only)."""
        final = self._fitted_final("export_policy")
        self._check_transparent("export_policy")
        final.export_policy(path)

    def save(self, path: str | os.PathLike) -> None:
        """Write the fitted pipeline (every step, nested estimators included) to `path`; read it with `offrl.load`."""
        from offrl.serialization import save

        save(self, path)


def _step_names(steps: tuple[Any, ...]) -> list[str]:
    """Lower-case class names, with -1, -2, ... where a name repeats (scikit-learn's convention)."""
    names = [step if isinstance(step, str) else type(step).__name__.lower() for step in steps]
    repeated = {name for name, count in Counter(names).items() if count > 1}
    seen: Counter = Counter()
    out = []
    for name in names:
        if name in repeated:
            seen[name] += 1
            name = f"{name}-{seen[name]}"
        out.append(name)
    return out


def make_pipeline(*steps: Any, memory: Any = None, verbose: bool = False) -> Pipeline:
    """A `Pipeline` whose steps are named after their classes in lower case (`IQL()` -> "iql")."""
    if not steps:
        raise ValueError("make_pipeline needs at least one step, e.g. make_pipeline(RewardScaler(), IQL())")
    return Pipeline(list(zip(_step_names(steps), steps)), memory=memory, verbose=verbose)
