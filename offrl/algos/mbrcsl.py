"""MBRCSL (Zhou et al., 2023, "Free from Bellman Completeness: Trajectory Stitching via Model-based
Return-conditioned Supervised Learning").

RCSL cannot stitch: conditioned on a return no logged trajectory reached,
it has no action to copy.  MBRCSL makes the stitched trajectories itself:

1. fit an ensemble dynamics and reward model (`offrl.nn.dynamics.EnsembleDynamics`,
   the model of `offrl.ope.ModelBased`), keeping the elites with the lowest
   holdout error;
2. fit a behaviour policy to the logged actions;
3. roll the behaviour policy out in the model from logged initial states
   (each step through a random elite, with the model's noise) and keep the
   roll-outs that stay inside the logged range (`rollout_range_margin`) and
   whose model return beats `return_threshold` (default: the
   best complete logged episode's return, see `rcsl.best_complete_episode`), until `n_rollouts` are kept or
   `max_rollout_batches` batches were tried;
4. train RCSL (RvS's network, loss, commands and actor, from
   `offrl.algos.rcsl`) on the kept roll-outs for `n_steps` through the
   standard fit loop.

Steps 1-3 run inside `_make_sampler`, so the fit loop, logging,
checkpoints and resume are the shared ones; on resume the restored model
and behaviour policy roll out again, to the same roll-outs.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from offrl.algos.base import _seed_from, make_adam
from offrl.algos.bc import nll_bc_loss
from offrl.algos.params import InvalidParameterError, boolean, integer, layer_sizes, real
from offrl.algos.rcsl import RvS, target_spec
from offrl.datasets.core import Dataset
from offrl.datasets.samplers import TransitionSampler
from offrl.nn import TanhGaussianPolicy, flush_denormals
from offrl.nn.dynamics import EnsembleDynamics

__all__ = ["MBRCSL"]

_POSITIVE = real(0, None, closed="neither")


class MBRCSL(RvS):
    """Model-based RCSL: RCSL on model roll-outs of a behaviour policy that beat the best logged return.

    Defaults follow the authors' code (zhaoyizhou1123/mbrcsl,
    examples/pointmaze/run_mbrcsl_maze.py and offlinerlkit's
    `EnsembleDynamics`): 7 models with 5 elites, 4x200 SiLU dynamics
    networks trained at 1e-3 with a 20 % holdout (at most 1000 rows);
    roll-outs in batches of 200, 100 kept ones needed, at most 1000
    batches, kept when their return beats the best (complete) logged episode
    return; the RCSL policy a 2x1024 MLP on (state, return to go) fitted by
    MSE (`conditioning="rtg"`, `policy="deterministic"`) with Adam 5e-5 and
    L2 weight decay 0.1, batch 256, trained on the kept roll-outs only
    (`mix_dataset=False`; True adds the logged data), and acting with the
    best kept roll-out's return as the default target.

    Departures: the behaviour policy is a tanh-Gaussian MLP (4x200, the
    size of their MLP-behaviour ablation) fitted by likelihood, where their
    main results use a diffusion policy; the dynamics train for a fixed
    `dynamics_n_steps` (theirs: until the holdout loss stops improving) with
    one weight decay (`EnsembleDynamics` lists the model's other
    departures); the roll-out horizon defaults to the longest logged
    episode (theirs: the task's horizon); returns enter the RCSL network
    times `return_scale` and observations are normalised; there is no
    holdout-based choice of the RCSL epoch.  One addition: a roll-out whose
    predicted next observation or reward leaves the logged range, widened by
    `rollout_range_margin` (0.1) of its width on each side, stops there and
    is never kept (None turns the check off, as in the authors' code, whose
    hopper dynamics end roll-outs with the task's known termination
    function instead; offrl's model has no such function).

    Fitted attributes: `n_rollouts_` (tried), `n_rollouts_kept_`,
    `n_rollouts_left_data_` (dropped for leaving the logged range),
    `rollout_return_max_` (best model return of any roll-out),
    `kept_return_max_` (NaN when none was kept), `return_threshold_`, `rcsl_data_` ("rollouts",
    "rollouts+dataset" or "dataset"), `dynamics_loss_`, `behavior_loss_`.
    If no roll-out beats the threshold, MBRCSL warns and trains RCSL on the
    logged dataset (i.e. it becomes RvS), with the logged best return as the
    default target.
    """

    _param_rules = {
        "weight_decay": real(0, None), "n_models": integer(1), "n_elites": integer(1),
        "dynamics_hidden_dims": layer_sizes(), "dynamics_lr": _POSITIVE, "dynamics_weight_decay": real(0, None),
        "dynamics_n_steps": integer(0), "holdout_ratio": real(0, 1, closed="left"),
        "behavior_hidden_dims": layer_sizes(), "behavior_lr": _POSITIVE, "behavior_n_steps": integer(0),
        "rollout_horizon": integer(1, none=True), "rollout_batch_size": integer(1), "n_rollouts": integer(1),
        "max_rollout_batches": integer(1), "return_threshold": real(none=True), "mix_dataset": boolean(),
        "rollout_range_margin": real(0, None, none=True),
    }

    def __init__(
        self,
        *,
        conditioning: str = "rtg",
        policy: str = "deterministic",
        return_scale: float = 1e-3,
        hidden_dims: Sequence[int] = (1024, 1024),
        dropout: float = 0.0,
        lr: float = 5e-5,
        weight_decay: float = 0.1,
        batch_size: int = 256,
        n_steps: int = 100_000,
        n_models: int = 7,
        n_elites: int = 5,
        dynamics_hidden_dims: Sequence[int] = (200, 200, 200, 200),
        dynamics_lr: float = 1e-3,
        dynamics_weight_decay: float = 5e-5,
        dynamics_n_steps: int = 50_000,
        holdout_ratio: float = 0.2,
        behavior_hidden_dims: Sequence[int] = (200, 200, 200, 200),
        behavior_lr: float = 1e-3,
        behavior_n_steps: int = 50_000,
        rollout_horizon: int | None = None,
        rollout_batch_size: int = 200,
        n_rollouts: int = 100,
        max_rollout_batches: int = 1000,
        return_threshold: float | None = None,
        mix_dataset: bool = False,
        rollout_range_margin: float | None = 0.1,
        normalize_observations: bool = True,
        precision: str = "fp32",
        compile: bool | str = False,
        log_every: int = 100,
        device: str = "auto",
        random_state: Any = None,
    ) -> None:
        super().__init__(conditioning=conditioning, policy=policy, return_scale=return_scale, hidden_dims=hidden_dims,
                         dropout=dropout, lr=lr, batch_size=batch_size, n_steps=n_steps,
                         normalize_observations=normalize_observations, precision=precision, compile=compile,
                         log_every=log_every, device=device, random_state=random_state)
        self.weight_decay = weight_decay
        self.n_models = n_models
        self.n_elites = n_elites
        self.dynamics_hidden_dims = dynamics_hidden_dims
        self.dynamics_lr = dynamics_lr
        self.dynamics_weight_decay = dynamics_weight_decay
        self.dynamics_n_steps = dynamics_n_steps
        self.holdout_ratio = holdout_ratio
        self.behavior_hidden_dims = behavior_hidden_dims
        self.behavior_lr = behavior_lr
        self.behavior_n_steps = behavior_n_steps
        self.rollout_horizon = rollout_horizon
        self.rollout_batch_size = rollout_batch_size
        self.n_rollouts = n_rollouts
        self.max_rollout_batches = max_rollout_batches
        self.return_threshold = return_threshold
        self.mix_dataset = mix_dataset
        self.rollout_range_margin = rollout_range_margin

    def check_params(self) -> None:
        super().check_params()
        if self.n_elites > self.n_models:
            raise InvalidParameterError(f"MBRCSL: n_elites ({self.n_elites}) cannot exceed n_models "
                                        f"({self.n_models}); the elites are chosen among the models")

    # ------------------------------------------------------------------ networks
    def _build(self, spec: dict[str, Any]) -> None:
        super()._build(spec)  # RvS's policy_ and its loss
        self.optimizer_ = make_adam(self.policy_.parameters(), self.lr, self.device_, weight_decay=self.weight_decay)
        obs_dim, act_dim = spec["observation_dim"], spec["action_dim"]
        self.dynamics_ = EnsembleDynamics(obs_dim, act_dim, int(self.n_models), tuple(self.dynamics_hidden_dims),
                                          n_elites=int(self.n_elites), activation="silu").to(self.device_)
        self.behavior_policy_ = TanhGaussianPolicy(obs_dim, act_dim, tuple(self.behavior_hidden_dims),
                                                   spec["action_low"], spec["action_high"],
                                                   log_std_min=-5.0).to(self.device_)
        self._models_fitted = False

    def _restore(self, spec: dict[str, Any], state: Mapping[str, Any], attributes: Mapping[str, Any]) -> None:
        super()._restore(spec, state, attributes)
        self._models_fitted = True  # a loaded or resumed MBRCSL rolls out its saved model and behaviour policy

    def _make_spec(self, dataset: Dataset) -> dict[str, Any]:
        spec = super()._make_spec(dataset)
        spec["dataset_return_max"] = spec["target_return"]
        return spec

    # ------------------------------------------------------------------ the model-based data
    def fit(self, dataset: Any, y: None = None, **fit_options: Any) -> "MBRCSL":
        """`OfflineAlgorithm.fit`, with float32 denormals flushed to zero while it runs (restored to off after).

        The RCSL policy's L2 weight decay (0.1) drives the weights of dead units below 1.2e-38, and a
        1024x1024 CPU matmul with 0.1% such weights ran 3.2x slower (8.8 ms against 2.7 ms, measured on a
        trained policy); whole updates fell to ~1 per second on pendulum.
        """
        with flush_denormals():
            return super().fit(dataset, y, **fit_options)

    def _make_sampler(self, dataset: Dataset) -> TransitionSampler:
        """RvS's transition sampler over the RCSL training data (kept roll-outs, made here)."""
        return super()._make_sampler(self._rcsl_dataset(dataset))

    def _generator(self, seed: int, phase: int) -> torch.Generator:
        """An independent stream per phase, so that a resumed fit (no training) rolls out exactly as the first."""
        state = int(np.random.SeedSequence([seed, phase]).generate_state(1)[0])
        return torch.Generator(device=self.device_).manual_seed(state)

    def _rcsl_dataset(self, dataset: Dataset) -> Dataset:
        seed = _seed_from(self.random_state)
        if not self._models_fitted:
            self.dynamics_loss_ = self.dynamics_.fit(
                dataset, n_steps=int(self.dynamics_n_steps), batch_size=int(self.batch_size), lr=self.dynamics_lr,
                generator=self._generator(seed, 1), weight_decay=self.dynamics_weight_decay,
                holdout_ratio=float(self.holdout_ratio))
            self.behavior_loss_ = self._fit_behavior(dataset, self._generator(seed, 2))
            self._models_fitted = True
        rollouts = self._rollouts(dataset, self._generator(seed, 3))
        spec = self.spec_
        if rollouts is None:
            warnings.warn(
                f"MBRCSL: none of the {self.n_rollouts_} model roll-outs beat the return threshold "
                f"{self.return_threshold_:.6g} (best roll-out: {self.rollout_return_max_:.6g}; "
                f"{self.n_rollouts_left_data_} left the logged range and were dropped), so the RCSL policy "
                "trains on the logged dataset instead (as RvS would); train the model or the behaviour policy longer, "
                "roll out more (max_rollout_batches) or lower return_threshold", RuntimeWarning, stacklevel=4)
            self.rcsl_data_ = "dataset"
            data = dataset
        elif self.mix_dataset:
            self.rcsl_data_ = "rollouts+dataset"
            logged = dataset.without_behavior_log_probs() if dataset.has_behavior_log_probs else dataset
            data = Dataset.concatenate([rollouts, logged], metadata=dataset.metadata)
        else:
            self.rcsl_data_ = "rollouts"
            data = rollouts
        spec.update(target_spec(data))  # the best kept roll-out (or logged episode)
        return data

    def _fit_behavior(self, dataset: Dataset, generator: torch.Generator) -> float:
        """Fit the tanh-Gaussian behaviour policy to the logged actions by likelihood; the last loss."""
        device, policy = self.device_, self.behavior_policy_
        with torch.no_grad():
            obs = self.obs_normalizer_(torch.from_numpy(dataset.observations).to(device))
        actions = torch.from_numpy(dataset.actions).to(device)
        optimizer = make_adam(policy.parameters(), self.behavior_lr, device)
        loss = torch.tensor(math.nan)
        for _ in range(int(self.behavior_n_steps)):
            idx = torch.randint(len(obs), (int(self.batch_size),), generator=generator, device=device)
            loss = nll_bc_loss(policy.log_prob(obs[idx], actions[idx]))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        return float(loss.detach())

    def _data_box(self, dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(low, high) over (observation..., reward): the logged range widened by `rollout_range_margin` times its
        width on each side (None when the margin is None: no check)."""
        if self.rollout_range_margin is None:
            return None
        low = np.append(np.minimum(dataset.observations.min(0), dataset.next_observations.min(0)),
                        dataset.rewards.min()).astype(np.float64)
        high = np.append(np.maximum(dataset.observations.max(0), dataset.next_observations.max(0)),
                         dataset.rewards.max()).astype(np.float64)
        margin = float(self.rollout_range_margin) * (high - low)
        return (torch.as_tensor(low - margin, dtype=torch.float32, device=self.device_),
                torch.as_tensor(high + margin, dtype=torch.float32, device=self.device_))

    @torch.no_grad()
    def _rollout_batch(self, starts: torch.Tensor, horizon: int, generator: torch.Generator,
                       box: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """Roll the behaviour policy out in the model from `starts` (B, obs_dim): (B, H', ...) columns, the
        (B, H') mask of real steps (a roll-out ends at a sampled termination) and the (B,) flags of the roll-outs
        that left `box` (a predicted next observation or reward outside it; such a roll-out stops there).
        H' <= `horizon`: the batch stops once every roll-out has ended, since later steps would all be masked
        (hopper's falls end most early)."""
        policy, dynamics = self.behavior_policy_, self.dynamics_
        b = len(starts)
        alive = torch.ones(b, dtype=torch.bool, device=starts.device)
        left = torch.zeros(b, dtype=torch.bool, device=starts.device)
        obs, columns, masks = starts, {k: [] for k in ("observations", "actions", "rewards", "next_observations",
                                                       "terminals")}, []
        for _ in range(horizon):
            mean, log_std = policy.distribution_params(self.obs_normalizer_(obs))
            noise = torch.randn(mean.shape, generator=generator, device=mean.device)
            actions = policy.to_env(torch.tanh(mean + log_std.exp() * noise))
            nxt, rewards, p_terminal = dynamics.step(obs, actions, generator)
            terminal = (torch.rand(b, generator=generator, device=obs.device) < p_terminal
                        if bool(dynamics.has_terminals) else torch.zeros(b, dtype=torch.bool, device=obs.device))
            for key, value in (("observations", obs), ("actions", actions), ("rewards", rewards),
                               ("next_observations", nxt), ("terminals", terminal & alive)):
                columns[key].append(value)
            masks.append(alive)
            if box is not None:  # NaN compares False, so it leaves the box too
                low, high = box
                reward_out = ~((rewards >= low[-1]) & (rewards <= high[-1]))
                # a terminal step's next state is not one the environment reaches (the model does not learn it)
                state_out = ~((nxt >= low[:-1]) & (nxt <= high[:-1])).all(1) & ~terminal
                outside = reward_out | state_out
                left = left | (alive & outside)
                alive = alive & ~outside
            alive = alive & ~terminal
            obs = nxt
            if not bool(alive.any()):
                break
        return {k: torch.stack(v, dim=1) for k, v in columns.items()}, torch.stack(masks, dim=1), left

    def _rollouts(self, dataset: Dataset, generator: torch.Generator) -> Dataset | None:
        """Batches of roll-outs until `n_rollouts` beat the threshold; the kept ones as a Dataset (None if none).

        A roll-out that leaves the logged range (`rollout_range_margin`) is never kept: past that point the
        model extrapolates, and selecting roll-outs for a high model return favours exactly those (hopper medium:
        model returns of 100,000+ where a logged step pays at most 5.2).  It is dropped whole rather than cut at
        the exit, since a cut roll-out's partial return does not compare with a complete episode's (with
        Pendulum's costs, any short cut "beats" every whole episode)."""
        device = self.device_
        starts = torch.from_numpy(dataset.observations[dataset.episode_starts[:-1]]).to(device)
        horizon = int(self.rollout_horizon or dataset.episode_lengths().max())
        threshold = (target_spec(dataset)["target_return"] if self.return_threshold is None
                     else float(self.return_threshold))
        box = self._data_box(dataset)
        kept: list[dict[str, np.ndarray]] = []
        kept_returns: list[np.ndarray] = []
        n_tried, n_kept, n_left, best = 0, 0, 0, -math.inf
        for _ in range(int(self.max_rollout_batches)):
            pick = torch.randint(len(starts), (int(self.rollout_batch_size),), generator=generator, device=device)
            columns, mask, left = self._rollout_batch(starts[pick], horizon, generator, box)
            returns = torch.where(mask, columns["rewards"], 0.0).double().sum(1)
            finite = torch.stack([torch.isfinite(v.float()).reshape(*mask.shape, -1).all(-1)
                                  for v in columns.values()]).all(0)
            ok = (finite | ~mask).all(1) & ~left  # a roll-out the model sent to inf, NaN or out of range: never kept
            n_tried += len(returns)
            n_left += int(left.sum())
            if ok.any():
                best = max(best, float(returns[ok].max()))
            keep = ok & (returns > threshold)
            if keep.any():
                kept.append({k: v[keep].cpu().numpy() for k, v in columns.items()} | {"mask": mask[keep].cpu().numpy()})
                kept_returns.append(returns[keep].cpu().numpy())
                n_kept += int(keep.sum())
            if n_kept >= int(self.n_rollouts):
                break
        self.n_rollouts_left_data_ = n_left
        self.n_rollouts_, self.n_rollouts_kept_ = n_tried, n_kept
        self.rollout_return_max_, self.return_threshold_ = best, threshold
        self.kept_return_max_ = float(max(r.max() for r in kept_returns)) if kept_returns else math.nan
        if not kept:
            return None
        # Batches stop when their last roll-out ends, so they differ in length: flatten each by its own mask (a
        # prefix of each row, so every roll-out's steps stay contiguous and in order), then join them.
        flat = {key: np.concatenate([k[key][k["mask"]] for k in kept]) for key in kept[0] if key != "mask"}
        lengths = np.concatenate([k["mask"].sum(1) for k in kept])
        return Dataset.from_arrays(
            flat["observations"], flat["actions"], flat["rewards"], terminals=flat["terminals"].astype(np.float32),
            next_observations=flat["next_observations"], episode_starts=np.concatenate([[0], np.cumsum(lengths)]),
            action_low=dataset.action_low, action_high=dataset.action_high,
            metadata={**dataset.metadata, "source": "MBRCSL model roll-outs"})
