"""Labels from small supervised models: inverse dynamics for actions (SS-ORL), a reward model for rewards.

Both fit an MLP on the rows that have the label and predict it for the rows
that lack it:

- `InverseDynamicsLabeler`: a_t = g(s_t, s_{t+1} - s_t), regression (MSE on
  standardised actions, clipped to the action bounds) or, for discrete
  actions, classification (cross-entropy, argmax).  SS-ORL trains it on the
  labelled trajectories and proxy-labels the rest before offline RL.
- `RewardModelLabeler`: r_t = h(s_t, a_t, s_{t+1}) by MSE regression.

Inputs and targets are standardised with the training rows' statistics.  A
tenth of the labelled rows (`validation_fraction`) is held out; training
stops when the validation loss has not improved for `patience` checks, and
keeps the best weights.  `label_fraction` hides all but a seeded random
fraction of the labels first (whole episodes for inverse dynamics, as SS-ORL;
transitions for the reward model), so an experiment can start from a fully
labelled dataset; the same rows are hidden again at `transform`.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from offrl.algos.params import boolean, choice, device_name, integer, layer_sizes, real, seed
from offrl.datasets.core import Dataset
from offrl.datasets.transformers import DatasetTransformer
from offrl.nn import MLP, flush_denormals

__all__ = ["InverseDynamicsLabeler", "RewardModelLabeler"]


def _fingerprint(dataset: Dataset) -> str:
    """A digest of a dataset's episodes and observations: tells the dataset a labeller was fitted on from others."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.ascontiguousarray(dataset.episode_starts, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(dataset.observations).tobytes())
    return digest.hexdigest()


class _SupervisedLabeler(DatasetTransformer):
    """Shared fit/transform of a label predicted by an MLP from other columns of the same row."""

    label: str = ""          # "actions" or "rewards"
    label_unit: str = ""     # what label_fraction keeps: "episodes" or "transitions"

    _param_rules = {"hidden_dims": layer_sizes(), "lr": real(0, None, closed="neither"), "weight_decay": real(0, None),
                    "batch_size": integer(1), "n_steps": integer(1), "validation_fraction": real(0, 1, closed="left"),
                    "patience": integer(1), "label_fraction": real(0, 1, closed="right", none=True),
                    "fill": choice("missing", "all"), "random_state": seed(), "device": device_name(),
                    "progress": boolean()}

    def __init__(self, *, hidden_dims: Sequence[int] = (256, 256), lr: float = 1e-3, weight_decay: float = 1e-4,
                 batch_size: int = 256, n_steps: int = 10_000, validation_fraction: float = 0.1, patience: int = 10,
                 label_fraction: float | None = None, fill: str = "missing", random_state: Any = None,
                 device: str = "auto", progress: bool = False) -> None:
        self.hidden_dims = hidden_dims
        self.lr = lr
        self.weight_decay = weight_decay
        self.batch_size = batch_size
        self.n_steps = n_steps
        self.validation_fraction = validation_fraction
        self.patience = patience
        self.label_fraction = label_fraction
        self.fill = fill
        self.random_state = random_state
        self.device = device
        self.progress = progress

    # ------------------------------------------------------------------ what subclasses define
    def _features(self, dataset: Dataset) -> np.ndarray:
        raise NotImplementedError

    def _targets(self, dataset: Dataset) -> np.ndarray:
        return getattr(dataset, self.label)

    def _is_classifier(self, dataset: Dataset) -> bool:
        return False

    def _check_inputs(self, dataset: Dataset, rows: np.ndarray, use: str) -> None:
        """Refuse a dataset that lacks, in `rows`, a column the features need (`use` says what the rows are for)."""

    # ------------------------------------------------------------------ label hiding
    def _keep_mask(self, dataset: Dataset, label_seed: int) -> np.ndarray | None:
        """Rows whose label `label_fraction` keeps: a seeded fraction of the labelled episodes (or transitions);
        None when `label_fraction` is not set."""
        if self.label_fraction is None:
            return None
        rng = np.random.default_rng(label_seed)
        mask = dataset.label_mask(self.label)
        labelled = np.ones(dataset.n_transitions, bool) if mask is None else mask
        if self.label_unit == "episodes":
            episode_of = np.repeat(np.arange(dataset.n_episodes), dataset.episode_lengths())
            candidates = np.unique(episode_of[labelled])
            n_keep = max(1, int(round(self.label_fraction * len(candidates))))
            keep_episode = np.zeros(dataset.n_episodes, dtype=bool)
            keep_episode[rng.permutation(candidates)[:n_keep]] = True
            return keep_episode[episode_of] & labelled
        candidates = np.flatnonzero(labelled)
        n_keep = max(1, int(round(self.label_fraction * len(candidates))))
        keep = np.zeros(dataset.n_transitions, dtype=bool)
        keep[rng.permutation(candidates)[:n_keep]] = True
        return keep

    def _visible(self, dataset: Dataset, fitted_data: bool = False) -> Dataset:
        """`dataset` with the labels `label_fraction` hides removed.

        Only on the dataset the labeller was fitted on (`fitted_data`, or the same fingerprint): on any other
        every true label is kept and only missing ones are filled.
        """
        if self.label_fraction is None or not (fitted_data or _fingerprint(dataset) == self.fit_fingerprint_):
            return dataset
        keep = self._keep_mask(dataset, self.label_seed_)
        drop = getattr(dataset, f"without_{self.label}")
        return drop(keep=keep)

    # ------------------------------------------------------------------ fit
    def _fit(self, dataset: Dataset, **fit_params: Any) -> None:
        super()._fit(dataset, **fit_params)
        from offrl.algos.base import _seed_from, resolve_device
        from offrl.algos.params import check_params

        check_params(self)
        seed_value = _seed_from(self.random_state)
        self.label_seed_ = int(np.random.default_rng(seed_value).integers(0, 2**62))
        self.fit_fingerprint_ = _fingerprint(dataset)
        visible = self._visible(dataset, fitted_data=True)
        mask = visible.label_mask(self.label)
        rows = np.arange(visible.n_transitions) if mask is None else np.flatnonzero(mask)
        if len(rows) < 2:
            raise ValueError(f"{type(self).__name__} needs at least 2 rows with {self.label} to learn from, found "
                             f"{len(rows)}; label more rows (or raise label_fraction)")
        self._check_inputs(visible, rows, "trains on")
        features = self._features(visible)
        targets = self._targets(visible)
        classifier = self._is_classifier(visible)
        device = resolve_device(self.device)
        rng = np.random.default_rng(seed_value)
        rows = rng.permutation(rows)
        n_val = int(round(self.validation_fraction * len(rows)))
        n_val = min(n_val, len(rows) - 1)
        val_rows, train_rows = np.sort(rows[:n_val]), np.sort(rows[n_val:])

        x_train = features[train_rows]
        self.input_mean_ = x_train.mean(axis=0).astype(np.float32)
        self.input_std_ = np.maximum(x_train.std(axis=0), 1e-6).astype(np.float32)
        if classifier:
            self.n_classes_ = int(visible.discrete_actions)
            self.target_mean_ = np.zeros(1, np.float32)
            self.target_std_ = np.ones(1, np.float32)
            out_dim = self.n_classes_
        else:
            y_train = targets[train_rows].reshape(len(train_rows), -1)
            self.target_mean_ = y_train.mean(axis=0).astype(np.float32)
            self.target_std_ = np.maximum(y_train.std(axis=0), 1e-6).astype(np.float32)
            out_dim = y_train.shape[1]
        self.in_dim_, self.out_dim_ = int(features.shape[1]), int(out_dim)
        self.classifier_ = bool(classifier)

        def tensors(index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.as_tensor((features[index] - self.input_mean_) / self.input_std_, device=device)
            if classifier:
                y = torch.as_tensor(targets[index].reshape(-1).astype(np.int64), device=device)
            else:
                y = torch.as_tensor((targets[index].reshape(len(index), -1) - self.target_mean_) / self.target_std_,
                                    device=device)
            return x, y

        x_tr, y_tr = tensors(train_rows)
        x_val, y_val = tensors(val_rows) if n_val > 0 else (x_tr, y_tr)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), flush_denormals():
            torch.manual_seed(seed_value)
            generator = torch.Generator(device=device).manual_seed(seed_value)
            self._build_fitted_modules()
            self.model_.to(device)
            best = self._train(x_tr, y_tr, x_val, y_val, generator)
        if best["state"] is None:
            raise ValueError(f"{type(self).__name__}: the validation loss was never finite; the {self.label} or the "
                             "observations hold extreme values (check them, or rescale them first)")
        self.model_.load_state_dict(best["state"])
        self.model_.cpu().eval()
        self.n_training_rows_ = int(len(train_rows))
        self.n_validation_rows_ = int(n_val)
        self.validation_loss_ = float(best["loss"])
        self.n_steps_done_ = int(best["steps"])

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.model_(x)
        return F.cross_entropy(out, y) if self.classifier_ else F.mse_loss(out, y)

    def _train(self, x_tr, y_tr, x_val, y_val, generator) -> dict[str, Any]:
        from tqdm.auto import tqdm

        from offrl.algos.base import make_adam

        optimizer = make_adam(self.model_.parameters(), float(self.lr), x_tr.device, kernel="foreach",
                              weight_decay=float(self.weight_decay))
        check_every = max(1, int(self.n_steps) // 100)
        best = {"loss": float("inf"), "state": None, "steps": 0}
        stale = 0
        steps = tqdm(range(1, int(self.n_steps) + 1), disable=not self.progress, desc=type(self).__name__)
        for step in steps:
            index = torch.randint(len(x_tr), (int(self.batch_size),), device=x_tr.device, generator=generator)
            loss = self._loss(x_tr[index], y_tr[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % check_every == 0 or step == int(self.n_steps):
                with torch.no_grad():
                    val = float(self._loss(x_val, y_val))
                if val < best["loss"]:
                    best = {"loss": val, "state": {k: v.detach().clone() for k, v in self.model_.state_dict().items()},
                            "steps": step}
                    stale = 0
                else:
                    stale += 1
                    if stale >= int(self.patience):
                        break
        return best

    def _build_fitted_modules(self) -> None:
        self.model_ = MLP(self.in_dim_, self.out_dim_, tuple(self.hidden_dims))

    # ------------------------------------------------------------------ predict / transform
    def predict_labels(self, dataset: Dataset, rows: np.ndarray | None = None, batch_size: int = 65536) -> np.ndarray:
        """The model's label for `rows` of `dataset` (default: every row): actions (n, action_dim) or rewards (n,)."""
        from sklearn.utils.validation import check_is_fitted

        check_is_fitted(self)
        rows = np.arange(dataset.n_transitions) if rows is None else np.asarray(rows)
        self._check_inputs(dataset, rows, "labels")
        features = self._features(dataset)[rows]
        outs = []
        with torch.no_grad(), flush_denormals():
            for start in range(0, len(features), batch_size):
                x = torch.as_tensor((features[start:start + batch_size] - self.input_mean_) / self.input_std_)
                out = self.model_(x)
                if self.classifier_:
                    outs.append(out.argmax(dim=1, keepdim=True).float().numpy())
                else:
                    outs.append(out.numpy() * self.target_std_ + self.target_mean_)
        pred = np.concatenate(outs, axis=0) if outs else np.zeros((0, self.out_dim_), np.float32)
        return self._finish(pred.astype(np.float32), dataset)

    def _finish(self, pred: np.ndarray, dataset: Dataset) -> np.ndarray:
        return pred

    def _transform(self, dataset: Dataset) -> Dataset:
        visible = self._visible(dataset)
        mask = visible.label_mask(self.label)
        if self.fill == "all":
            fill = np.ones(visible.n_transitions, bool)
        else:
            fill = np.zeros(visible.n_transitions, bool) if mask is None else ~mask
        shape = (visible.n_transitions, visible.action_dim) if self.label == "actions" else (visible.n_transitions,)
        values = np.zeros(shape, np.float32)
        if fill.any():
            values[fill] = self.predict_labels(visible, np.flatnonzero(fill))
        out = getattr(visible, f"with_{self.label}")(values, mask=fill)  # a copy, with its own metadata
        info = {}
        if self.label == "actions" and fill.any() and out.has_behavior_log_probs:
            # The logged log-probabilities belong to the logged actions, not to the predicted ones.
            out = out.without_behavior_log_probs()
            info["dropped"] = "behavior_log_probs"
        return self._record(out, labels=self.label, n_labelled=int(fill.sum()), fill=self.fill,
                            label_fraction=self.label_fraction, label_fraction_applied=visible is not dataset,
                            n_training_rows=self.n_training_rows_, validation_loss=self.validation_loss_, **info)


class InverseDynamicsLabeler(_SupervisedLabeler):
    """Missing actions from an inverse-dynamics model a = g(s, s' - s) trained on the labelled rows (SS-ORL).

    `fill="missing"` labels only the rows without actions (SS-ORL's proxy labels); "all" relabels every row.
    `label_fraction` keeps the actions of that fraction of episodes (SS-ORL's labelled trajectories) and hides
    the rest before fitting and transforming.  Continuous predictions are clipped to the dataset's action
    bounds; discrete actions are classified.
    """

    label = "actions"
    label_unit = "episodes"

    def _features(self, dataset: Dataset) -> np.ndarray:
        return np.concatenate([dataset.observations, dataset.next_observations - dataset.observations], axis=1)

    def _is_classifier(self, dataset: Dataset) -> bool:
        return dataset.discrete_actions is not None

    def _finish(self, pred: np.ndarray, dataset: Dataset) -> np.ndarray:
        if self.classifier_:
            return pred
        low = dataset.action_low if dataset.action_low is not None else -np.inf
        high = dataset.action_high if dataset.action_high is not None else np.inf
        return np.clip(pred, low, high).astype(np.float32)


class RewardModelLabeler(_SupervisedLabeler):
    """Missing rewards from a reward model r = h(s, a, s') trained on the labelled rows.

    `fill="missing"` imputes only the rows without rewards; "all" relabels every row.  `label_fraction`
    keeps that fraction of transitions' rewards (e.g. 0.01) and hides the rest before fitting and
    transforming.  The dataset must have all its actions (label them first, e.g. with an
    `InverseDynamicsLabeler` ahead in the pipeline).
    """

    label = "rewards"
    label_unit = "transitions"

    def _check_inputs(self, dataset: Dataset, rows: np.ndarray, use: str) -> None:
        mask = dataset.label_mask("actions")
        missing = 0 if mask is None else int((~mask[rows]).sum())  # mask is all False when no row has actions
        if missing:
            raise ValueError(f"RewardModelLabeler reads r(s, a, s'), but actions are missing in {missing} of the "
                             f"{len(rows)} rows it {use}; fill them first (an InverseDynamicsLabeler ahead of it in "
                             "the pipeline, or dataset.with_actions(...))")

    def _features(self, dataset: Dataset) -> np.ndarray:
        actions = dataset.actions
        if dataset.discrete_actions is not None:
            actions = np.eye(dataset.discrete_actions, dtype=np.float32)[actions[:, 0].astype(np.int64)]
        return np.concatenate([dataset.observations, actions, dataset.next_observations], axis=1)

    def _targets(self, dataset: Dataset) -> np.ndarray:
        return dataset.rewards.reshape(-1, 1)

    def _finish(self, pred: np.ndarray, dataset: Dataset) -> np.ndarray:
        return pred[:, 0]
