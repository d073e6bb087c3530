"""Fine-tuning strategies: what differs between offline-to-online recipes, as small objects the one loop asks.

The loop (`offrl.online.loop.run_online`) steps the environments, stores
transitions, updates, evaluates and checkpoints.  A strategy answers its
questions:

- how many warm-up steps come before the first update, and whose actions
  they are (`warmup_steps`, `warmup_actions`);
- how many updates follow each environment step (`utd_ratio`) and on how big
  a batch (`batch_size`);
- what the replay buffer starts with, and how a batch is drawn
  (`keep_offline_data`, `offline_fraction`: RLPD's and Cal-QL's half
  offline, half online batches);
- which critics the update uses (`n_critics`, `critic_subset`: the size of
  the random subset whose minimum forms the TD target) and whether it keeps
  its offline conservative term (`conservative`);
- who acts (`act`: JSRL's guide for the first steps of each episode, E2O's
  optimistic choice among sampled actions), and what happens when an
  episode ends (`episode_end`: JSRL's hand-over curriculum).

Five recipes from the literature come with offrl ("naive" is the plain
`OnlineStrategy`); `resolve_strategy` turns a name into one.  A new recipe
is a subclass that changes a default or overrides one method; its
`state_dict` is saved in checkpoints and, with `describe`, in model files.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from offrl.datasets.core import Batch, Dataset
from offrl.online.replay import ReplayBuffer

__all__ = ["OnlineStrategy", "WSRL", "RLPD", "CalQLFineTuning", "JSRL", "E2O", "STRATEGIES", "resolve_strategy"]


class OnlineStrategy:
    """How an agent learns online; the defaults are plain continued training ("naive").

    Parameters
    ----------
    warmup_steps : environment steps taken before the first update.
    warmup_actions : "uniform" (uniformly random actions during warm-up, SAC
        and RLPD from scratch) or "policy" (the agent's own exploration
        actions, WSRL's warm-up).
    utd_ratio : gradient updates per environment step.
    batch_size : the update's batch size; None keeps the agent's.
    keep_offline_data : when `fit_online` gets an `offline_dataset` and no
        `offline_fraction` is set, the replay buffer starts with it (the
        naive recipe); False starts empty (WSRL keeps no offline data).
    offline_fraction : the share of every batch drawn from the offline data,
        the rest from the online buffer (RLPD and Cal-QL: 0.5); None draws
        uniformly from one buffer.
    n_critics : the critic ensemble size the recipe needs; None takes the
        agent's.  A fitted agent must have been trained with it (e.g.
        `CQL(n_critics=10)`); SAC from scratch builds it.
    critic_subset : the TD target is the minimum over this many critics
        drawn at random each update (REDQ and RLPD: 2), and the actor uses
        the ensemble mean; None takes the minimum over all critics.
    conservative : False drops the update's offline conservative term for
        the run (CQL's penalty, TD3+BC's behaviour-cloning term); None keeps
        the algorithm's update unchanged.
    critic_layer_norm : critics with LayerNorm (RLPD), where the strategy
        builds them (SAC from scratch); a fitted agent keeps its critics.
    """

    name = "naive"

    def __init__(self, warmup_steps: int = 0, warmup_actions: str = "policy", utd_ratio: int = 1,
                 batch_size: int | None = None, keep_offline_data: bool = True, offline_fraction: float | None = None,
                 n_critics: int | None = None, critic_subset: int | None = None, conservative: bool | None = None,
                 critic_layer_norm: bool = False) -> None:
        self.warmup_steps = warmup_steps
        self.warmup_actions = warmup_actions
        self.utd_ratio = utd_ratio
        self.batch_size = batch_size
        self.keep_offline_data = keep_offline_data
        self.offline_fraction = offline_fraction
        self.n_critics = n_critics
        self.critic_subset = critic_subset
        self.conservative = conservative
        self.critic_layer_norm = critic_layer_norm
        self.check()

    # ------------------------------------------------------------------ parameters
    def get_params(self) -> dict[str, Any]:
        """The constructor's parameters (as scikit-learn reads them), for `describe` and the sweep."""
        names = [p.name for p in inspect.signature(type(self).__init__).parameters.values()
                 if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        return {name: getattr(self, name) for name in names}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.get_params().items())})"

    def check(self) -> None:
        """Raise ValueError naming the first parameter of the wrong type or out of range."""
        _int_at_least("warmup_steps", self.warmup_steps, 0)
        if self.warmup_actions not in ("uniform", "policy"):
            raise ValueError(f"warmup_actions must be 'uniform' or 'policy', got {self.warmup_actions!r}")
        _int_at_least("utd_ratio", self.utd_ratio, 1)
        for name in ("batch_size", "n_critics", "critic_subset"):
            if getattr(self, name) is not None:
                _int_at_least(name, getattr(self, name), 1)
        if self.offline_fraction is not None and not (isinstance(self.offline_fraction, (int, float))
                                                      and 0.0 <= float(self.offline_fraction) <= 1.0):
            raise ValueError(f"offline_fraction must be a number in [0, 1] or None, got {self.offline_fraction!r}")
        if self.n_critics is not None and self.critic_subset is not None and self.critic_subset > self.n_critics:
            raise ValueError(f"critic_subset={self.critic_subset} exceeds n_critics={self.n_critics}; "
                             "draw at most as many critics as the ensemble has")
        if self.conservative not in (None, True, False):
            raise ValueError(f"conservative must be True, False or None, got {self.conservative!r}")

    # ------------------------------------------------------------------ the run
    def setup(self, agent: Any, envs: Sequence[Any], offline_dataset: Dataset | None, extra_columns: Sequence[str],
              *, fresh: bool, seed: int = 0) -> None:
        """Prepare `agent` for the run: check its critics, set the update's options, build the offline buffer.

        Called before a fresh run's first step and before a resumed run
        reads its checkpoint (`fresh=False`); `teardown` undoes the options.
        """
        self._saved_options = None
        critic = getattr(agent, "critic_", None)
        n = None if critic is None else int(getattr(critic, "n_critics", 0))
        if self.n_critics is not None and n != self.n_critics:
            raise ValueError(
                f"the {self.name!r} strategy uses {self.n_critics} critics, but this {type(agent).__name__} has "
                f"{n or 'no critic ensemble'}; train it with {type(agent).__name__}(n_critics={self.n_critics}) "
                f"before fine-tuning (the recipe pre-trains its ensemble), or pass n_critics={n} to the strategy")
        if self.critic_subset is not None and (n is None or self.critic_subset > n):
            raise ValueError(f"critic_subset={self.critic_subset} needs an ensemble of at least that many critics; "
                             f"this {type(agent).__name__} has {n or 'none'}")
        self._offline: ReplayBuffer | None = None
        if self.offline_fraction is not None:
            if offline_dataset is None:
                raise ValueError(f"the {self.name!r} strategy draws {self.offline_fraction:g} of every batch from "
                                 "offline data; pass offline_dataset= (the data the agent was trained on)")
            extras = agent._online_extras(offline_dataset) if extra_columns else None
            self._offline = ReplayBuffer.from_dataset(offline_dataset, device=agent.device_, extras=extras)
        self._saved_options = (agent._critic_subset, agent._conservative)
        agent._critic_subset = self.critic_subset
        if self.conservative is not None:
            agent._conservative = bool(self.conservative)
        if fresh and hasattr(agent, "online_guide_policy_"):  # a guide from an earlier JSRL run is not this run's
            del agent.online_guide_policy_

    def teardown(self, agent: Any) -> None:
        """Give the agent back its own update options (the strategy's hold only during the run)."""
        saved = getattr(self, "_saved_options", None)
        if saved is not None:
            agent._critic_subset, agent._conservative = saved
            self._saved_options = None

    def initial_buffer(self, agent: Any, capacity: int, offline_dataset: Dataset | None, extra_columns: Sequence[str]
                       ) -> ReplayBuffer:
        """The online replay buffer the run starts with (the offline data too, for the naive recipe)."""
        spec = agent.spec_
        if offline_dataset is not None and self.keep_offline_data and self.offline_fraction is None:
            extras = agent._online_extras(offline_dataset) if extra_columns else None
            return ReplayBuffer.from_dataset(offline_dataset, capacity + offline_dataset.n_transitions, agent.device_,
                                             extras=extras)
        return ReplayBuffer(capacity, spec["observation_dim"], spec["action_dim"], agent.device_,
                            extra_columns=tuple(extra_columns))

    def episode_start(self, env_index: int) -> None:
        """Env `env_index` was just reset (not called again for the episodes a resumed run starts in)."""

    def act(self, agent: Any, observations: np.ndarray, step: int, generator: torch.Generator,
            uniform: Callable[[int], tuple[torch.Tensor, torch.Tensor]], episode_steps: np.ndarray
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Actions (env units) and their log-probabilities for raw observations (k, obs_dim).

        `step` counts the run's environment steps, `episode_steps[i]` the
        steps env i has taken in its current episode.
        """
        if step < self.warmup_steps and self.warmup_actions == "uniform":
            return uniform(len(observations))
        obs = torch.as_tensor(np.asarray(observations, np.float32), device=agent.device_)
        return agent._online_act(obs, generator)

    def can_sample(self, buffer: ReplayBuffer) -> bool:
        """Whether a batch can be drawn yet (an empty online buffer still has the offline data to mix from)."""
        return len(buffer) > 0 or getattr(self, "_offline", None) is not None

    def sample(self, buffer: ReplayBuffer, batch_size: int, generator: torch.Generator) -> Batch:
        """One update's batch: uniform from the buffer, or `offline_fraction` of it from the offline data."""
        offline = getattr(self, "_offline", None)
        if offline is None:
            return buffer.sample(batch_size, generator)
        n_offline = int(round(batch_size * float(self.offline_fraction))) if len(buffer) else batch_size
        if n_offline >= batch_size:
            return offline.sample(batch_size, generator)
        if n_offline <= 0:
            return buffer.sample(batch_size, generator)
        return concat_batches(offline.sample(n_offline, generator), buffer.sample(batch_size - n_offline, generator))

    def episode_end(self, env_index: int, episode_return: float) -> None:
        """Env `env_index` finished an episode of return `episode_return` (JSRL's curriculum listens here)."""

    def log_values(self) -> dict[str, float]:
        """Numbers the strategy adds to the training log and evaluation rows (JSRL: the guide's horizon)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep of the strategy beyond its parameters (plain numbers and lists)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s output."""

    def describe(self) -> dict[str, Any]:
        """The strategy as plain data for a model file: its name, class, parameters and state."""
        return {"name": self.name, "class": f"{type(self).__module__}:{type(self).__qualname__}",
                "params": self.get_params(), "state": self.state_dict()}


def concat_batches(first: Batch, second: Batch) -> Batch:
    """The rows of `first` followed by those of `second` (columns both have; extras both carry)."""
    def cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        return None if a is None or b is None else torch.cat([a, b])

    extras = {k: torch.cat([first.extras[k], second.extras[k]]) for k in first.extras if k in second.extras}
    return Batch(observations=torch.cat([first.observations, second.observations]),
                 actions=cat(first.actions, second.actions), rewards=cat(first.rewards, second.rewards),
                 terminals=torch.cat([first.terminals, second.terminals]),
                 timeouts=torch.cat([first.timeouts, second.timeouts]),
                 next_observations=torch.cat([first.next_observations, second.next_observations]),
                 behavior_log_probs=cat(first.behavior_log_probs, second.behavior_log_probs), extras=extras)


class WSRL(OnlineStrategy):
    """WSRL (Zhou et al., 2024): warm-start with the pre-trained policy's roll-outs, then keep no offline data.

    5,000 warm-up steps with the pre-trained policy before any update, then
    SAC-style updates without the conservative term: 10 critics with a
    random 2-subset minimum, UTD 4, batch 1,024 (pre-train with
    `CQL(n_critics=10)` or `CalQL(n_critics=10)`, as the paper does).
    """

    name = "wsrl"

    def __init__(self, warmup_steps: int = 5000, warmup_actions: str = "policy", utd_ratio: int = 4,
                 batch_size: int | None = 1024, keep_offline_data: bool = False, offline_fraction: float | None = None,
                 n_critics: int | None = 10, critic_subset: int | None = 2, conservative: bool | None = False,
                 critic_layer_norm: bool = False) -> None:
        super().__init__(warmup_steps, warmup_actions, utd_ratio, batch_size, keep_offline_data, offline_fraction,
                         n_critics, critic_subset, conservative, critic_layer_norm)


class RLPD(OnlineStrategy):
    """RLPD (Ball et al., 2023): every batch half offline, half online; 10 LayerNorm critics, 2-subset min, UTD 20.

    5,000 uniformly random warm-up steps; without the conservative term.
    From scratch: `SAC().fit_online(env, strategy="rlpd", offline_dataset=data)`.
    """

    name = "rlpd"

    def __init__(self, warmup_steps: int = 5000, warmup_actions: str = "uniform", utd_ratio: int = 20,
                 batch_size: int | None = None, keep_offline_data: bool = False, offline_fraction: float | None = 0.5,
                 n_critics: int | None = 10, critic_subset: int | None = 2, conservative: bool | None = False,
                 critic_layer_norm: bool = True) -> None:
        super().__init__(warmup_steps, warmup_actions, utd_ratio, batch_size, keep_offline_data, offline_fraction,
                         n_critics, critic_subset, conservative, critic_layer_norm)


class CalQLFineTuning(OnlineStrategy):
    """Cal-QL's online phase (Nakamoto et al., 2023): keep the calibrated penalty, batches half offline.

    The agent must calibrate: a `CalQL` (its penalty needs Monte-Carlo
    returns, computed for each online episode when it ends).
    """

    name = "calql"

    def __init__(self, warmup_steps: int = 0, warmup_actions: str = "policy", utd_ratio: int = 1,
                 batch_size: int | None = None, keep_offline_data: bool = False, offline_fraction: float | None = 0.5,
                 n_critics: int | None = None, critic_subset: int | None = None, conservative: bool | None = True,
                 critic_layer_norm: bool = False) -> None:
        super().__init__(warmup_steps, warmup_actions, utd_ratio, batch_size, keep_offline_data, offline_fraction,
                         n_critics, critic_subset, conservative, critic_layer_norm)

    def setup(self, agent: Any, envs: Sequence[Any], offline_dataset: Dataset | None, extra_columns: Sequence[str],
              *, fresh: bool, seed: int = 0) -> None:
        if "mc_returns" not in extra_columns:
            raise ValueError(f"the 'calql' strategy fine-tunes a calibrated critic (offrl.algos.CalQL, whose penalty "
                             f"needs Monte-Carlo returns); {type(agent).__name__} has none. Use CalQL offline, or "
                             "another strategy ('naive', 'wsrl', 'rlpd', 'jsrl', 'e2o')")
        super().setup(agent, envs, offline_dataset, extra_columns, fresh=fresh, seed=seed)


class JSRL(OnlineStrategy):
    """Jump-start RL (Uchendu et al., 2023): a guide acts for the first h steps of each episode, the learner after.

    The guide is a frozen copy of the agent's policy at the switch to
    online (`online_guide_policy_`, deterministic), the learner the agent
    itself.  With `curriculum="stages"`, h starts at `horizon` and drops by
    horizon / n_stages each time the mean return of the last `window`
    episodes at the current h comes within `tolerance` (relative) of the
    best such mean so far; stage 0 (the guide alone) sets the reference.
    `curriculum="random"` draws h uniformly from [0, horizon] per episode
    (JSRL-random).  `horizon=None` takes the env's episode limit.
    """

    name = "jsrl"

    def __init__(self, horizon: int | None = None, n_stages: int = 10, window: int = 5, tolerance: float = 0.05,
                 curriculum: str = "stages", warmup_steps: int = 0, utd_ratio: int = 1, batch_size: int | None = None,
                 keep_offline_data: bool = True, offline_fraction: float | None = None,
                 n_critics: int | None = None, critic_subset: int | None = None,
                 conservative: bool | None = None) -> None:
        self.horizon = horizon
        self.n_stages = n_stages
        self.window = window
        self.tolerance = tolerance
        self.curriculum = curriculum
        super().__init__(warmup_steps, "policy", utd_ratio, batch_size, keep_offline_data, offline_fraction,
                         n_critics, critic_subset, conservative)
        self._reset_curriculum()

    def check(self) -> None:
        super().check()
        if self.horizon is not None:
            _int_at_least("horizon", self.horizon, 1)
        _int_at_least("n_stages", self.n_stages, 1)
        _int_at_least("window", self.window, 1)
        if not (isinstance(self.tolerance, (int, float)) and self.tolerance >= 0):
            raise ValueError(f"tolerance must be a non-negative number, got {self.tolerance!r}")
        if self.curriculum not in ("stages", "random"):
            raise ValueError(f"curriculum must be 'stages' or 'random', got {self.curriculum!r}")

    def _reset_curriculum(self) -> None:
        self.stage_ = 0
        self.best_ = None  # best window mean so far
        self.stage_returns_: list[float] = []
        self.horizons_: list[int] = []  # per env: this episode's guide horizon (random curriculum)
        self.stage_steps_: list[int] = []  # online steps at which each stage began
        self._rng = np.random.default_rng(0)
        self._step = 0

    def setup(self, agent: Any, envs: Sequence[Any], offline_dataset: Dataset | None, extra_columns: Sequence[str],
              *, fresh: bool, seed: int = 0) -> None:
        from offrl.nn import DeterministicPolicy, GaussianPolicy, TanhGaussianPolicy

        policy = getattr(agent, "policy_", None)
        if not isinstance(policy, (GaussianPolicy, TanhGaussianPolicy, DeterministicPolicy)):
            raise ValueError(f"the 'jsrl' strategy guides with the fitted agent's own policy; {type(agent).__name__} "
                             "has no Gaussian or deterministic policy_ to copy (fit it offline first)")
        super().setup(agent, envs, offline_dataset, extra_columns, fresh=fresh, seed=seed)
        limit = getattr(getattr(envs[0], "spec", None), "max_episode_steps", None)
        self.horizon_ = int(self.horizon if self.horizon is not None else (limit or 1000))
        if fresh:
            agent.online_guide_policy_ = copy.deepcopy(policy).requires_grad_(False)
            self._reset_curriculum()
            self._rng = np.random.default_rng([int(seed) % 2**63, 17])  # its own stream of the run's seed
            self.horizons_ = [self.horizon_] * len(envs)
        elif not hasattr(agent, "online_guide_policy_"):
            agent.online_guide_policy_ = copy.deepcopy(policy).requires_grad_(False)  # overwritten by the checkpoint

    def guide_horizon(self, env_index: int = 0) -> int:
        """How many steps the guide takes at the start of env `env_index`'s current episode."""
        if self.curriculum == "random":
            return int(self.horizons_[env_index])
        return int(round(self.horizon_ * (1.0 - min(self.stage_, self.n_stages) / self.n_stages)))

    def episode_start(self, env_index: int) -> None:
        if self.curriculum == "random":
            while len(self.horizons_) <= env_index:
                self.horizons_.append(self.horizon_)
            self.horizons_[env_index] = int(self._rng.integers(0, self.horizon_ + 1))

    def act(self, agent: Any, observations: np.ndarray, step: int, generator: torch.Generator,
            uniform: Callable[[int], tuple[torch.Tensor, torch.Tensor]], episode_steps: np.ndarray
            ) -> tuple[torch.Tensor, torch.Tensor]:
        self._step = step
        actions, log_probs = super().act(agent, observations, step, generator, uniform, episode_steps)
        guided = torch.as_tensor([int(episode_steps[i]) < self.guide_horizon(i) for i in range(len(observations))],
                                 device=actions.device)
        if not bool(guided.any()):
            return actions, log_probs
        obs = torch.as_tensor(np.asarray(observations, np.float32), device=agent.device_)
        with torch.no_grad():
            guide_actions = deterministic_action(agent.online_guide_policy_, agent.obs_normalizer_(obs))
        actions = torch.where(guided[:, None], guide_actions.to(actions.dtype), actions)
        log_probs = torch.where(guided, torch.zeros_like(log_probs), log_probs)  # the guide's density is not kept
        return actions, log_probs

    def episode_end(self, env_index: int, episode_return: float) -> None:
        if self.curriculum != "stages" or self.stage_ >= self.n_stages:
            return
        self.stage_returns_.append(float(episode_return))
        if len(self.stage_returns_) < self.window:
            return
        mean = float(np.mean(self.stage_returns_[-self.window:]))
        if self.best_ is None or mean >= self.best_ - self.tolerance * abs(self.best_):
            self.best_ = mean if self.best_ is None else max(self.best_, mean)
            self.stage_ += 1
            self.stage_returns_ = []
            self.stage_steps_.append(int(self._step))

    def log_values(self) -> dict[str, float]:
        return {"guide_horizon": float(self.guide_horizon(0)), "jsrl_stage": float(self.stage_)}

    def state_dict(self) -> dict[str, Any]:
        return {"stage": int(self.stage_), "best": self.best_, "stage_returns": list(self.stage_returns_),
                "horizons": [int(h) for h in self.horizons_], "stage_steps": list(self.stage_steps_),
                "rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.stage_ = int(state["stage"])
        self.best_ = None if state["best"] is None else float(state["best"])
        self.stage_returns_ = [float(r) for r in state["stage_returns"]]
        self.horizons_ = [int(h) for h in state["horizons"]]
        self.stage_steps_ = [int(s) for s in state["stage_steps"]]
        self._rng = np.random.default_rng()
        self._rng.bit_generator.state = dict(state["rng"])


class E2O(OnlineStrategy):
    """E2O / ENOTO (Zhao et al., 2024): Q ensembles, pessimism loosened online, optimistic exploration.

    Pre-train with 10 critics (`CQL(n_critics=10)`); online, the
    conservative term is dropped and the TD target is the minimum of a
    random pair of critics (E2O's RandomMinPair), and each action is the
    best of `n_candidates` policy samples by the upper confidence bound
    mean_i Q_i + `ucb_lambda` * std_i Q_i (SUNRISE-style exploration).  The
    offline data stays in the replay buffer.
    """

    name = "e2o"

    def __init__(self, n_candidates: int = 10, ucb_lambda: float = 1.0, warmup_steps: int = 0, utd_ratio: int = 1,
                 batch_size: int | None = None, keep_offline_data: bool = True, offline_fraction: float | None = None,
                 n_critics: int | None = 10, critic_subset: int | None = 2, conservative: bool | None = False) -> None:
        self.n_candidates = n_candidates
        self.ucb_lambda = ucb_lambda
        super().__init__(warmup_steps, "policy", utd_ratio, batch_size, keep_offline_data, offline_fraction,
                         n_critics, critic_subset, conservative)

    def check(self) -> None:
        super().check()
        _int_at_least("n_candidates", self.n_candidates, 1)
        if not (isinstance(self.ucb_lambda, (int, float)) and self.ucb_lambda >= 0):
            raise ValueError(f"ucb_lambda must be a non-negative number, got {self.ucb_lambda!r}")

    def act(self, agent: Any, observations: np.ndarray, step: int, generator: torch.Generator,
            uniform: Callable[[int], tuple[torch.Tensor, torch.Tensor]], episode_steps: np.ndarray
            ) -> tuple[torch.Tensor, torch.Tensor]:
        if step < self.warmup_steps and self.warmup_actions == "uniform":
            return uniform(len(observations))
        k, m = len(observations), int(self.n_candidates)
        obs = torch.as_tensor(np.asarray(observations, np.float32), device=agent.device_).repeat(m, 1)  # (m k, obs)
        actions, log_probs = agent._online_act(obs, generator)
        with torch.no_grad():
            q = agent.critic_(agent.obs_normalizer_(obs), actions).float()  # (n_critics, m k)
            ucb = (q.mean(0) + float(self.ucb_lambda) * q.std(0)).reshape(m, k)
        best = ucb.argmax(0)
        rows = best * k + torch.arange(k, device=best.device)
        return actions[rows], log_probs[rows]


STRATEGIES: dict[str, type[OnlineStrategy]] = {
    "naive": OnlineStrategy, "wsrl": WSRL, "rlpd": RLPD, "calql": CalQLFineTuning, "jsrl": JSRL, "e2o": E2O}


def resolve_strategy(strategy: Any) -> OnlineStrategy:
    """An `OnlineStrategy` from a name ("naive", "wsrl", "rlpd", "calql", "jsrl", "e2o"), a {name: params}
    mapping (as a sweep config writes it) or an instance (returned as is)."""
    if isinstance(strategy, OnlineStrategy):
        return strategy
    if isinstance(strategy, str):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r} is unknown; use one of {sorted(STRATEGIES)} or an "
                             "offrl.online.OnlineStrategy")
        return STRATEGIES[strategy]()
    if isinstance(strategy, Mapping) and len(strategy) == 1:
        (name, params), = strategy.items()
        if name not in STRATEGIES:
            raise ValueError(f"strategy {name!r} is unknown; use one of {sorted(STRATEGIES)}")
        params = {} if params is None else params  # YAML's `{wsrl: }`
        if not isinstance(params, Mapping):
            raise ValueError(f"strategy {name!r} takes a mapping of parameters, got {params!r}")
        try:
            return STRATEGIES[name](**dict(params))
        except TypeError as err:
            raise ValueError(f"strategy {name!r}: {err}; its parameters are "
                             f"{sorted(STRATEGIES[name]().get_params())}") from err
    raise TypeError(f"strategy must be a name ({', '.join(sorted(STRATEGIES))}), a {{name: params}} mapping or an "
                    f"OnlineStrategy, got {type(strategy).__name__}")


def deterministic_action(policy: torch.nn.Module, obs: torch.Tensor) -> torch.Tensor:
    """A Gaussian, tanh-Gaussian or deterministic policy's deterministic action (env units) for normalised obs."""
    from offrl.nn import DeterministicPolicy

    if isinstance(policy, DeterministicPolicy):
        return policy(obs)[0]
    return policy(obs, deterministic=True, with_log_prob=False)[0]


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer of at least {low}, got {value!r}")
