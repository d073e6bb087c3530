"""Read and write Minari datasets through the `minari` package."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import numpy as np

from offrl.datasets.core import Dataset
from offrl.datasets.files import check_path_name

__all__ = ["load_minari", "to_minari", "minari_datasets_path", "check_minari_id", "check_new_minari_id"]

_LOG_PROB_KEY = "action_log_probs"
_NEXT_OBS_KEY = "next_observations"


@contextlib.contextmanager
def minari_datasets_path(path: str | os.PathLike | None) -> Iterator[None]:
    """Temporarily point `$MINARI_DATASETS_PATH` at `path` (no-op for None)."""
    if path is None:
        yield
        return
    old = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = os.fspath(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MINARI_DATASETS_PATH", None)
        else:
            os.environ["MINARI_DATASETS_PATH"] = old


def check_minari_id(dataset_id: object) -> str:
    """`dataset_id` when every '/'-separated part is a safe folder name, else a ValueError naming the id.

    A Minari id becomes a folder path under the data path ("mujoco/hopper/medium-v0" -> three folders), so
    '..', empty parts (leading, doubled or trailing '/'), backslashes and leading dots are refused before
    anything touches the disk.
    """
    if not isinstance(dataset_id, str):
        raise TypeError(f"Minari dataset id must be a string, got {type(dataset_id).__name__} ({dataset_id!r})")
    for part in dataset_id.split("/"):
        check_path_name(part, f"Minari dataset id {dataset_id!r}: the part")
    return dataset_id


def check_new_minari_id(dataset_id: object) -> str:
    """`check_minari_id`, plus the `-v<N>` version Minari needs to create a dataset (else a ValueError)."""
    check_minari_id(dataset_id)
    from minari.dataset.minari_dataset import parse_dataset_id

    try:
        version = parse_dataset_id(dataset_id)[2]
    except (ValueError, TypeError):
        version = None
    if version is None:
        raise ValueError(f"Minari dataset id {dataset_id!r} must look like [namespace/]name-v<N>, e.g. "
                         "offrl/pendulum-medium-v0")
    return dataset_id


def _check_spaces_fit(dataset: Dataset, observation_space: Any, action_space: Any, where: str) -> None:
    """Refuse spaces that do not describe the data (Minari would store them next to it without complaint)."""
    import gymnasium as gym

    obs_shape = getattr(observation_space, "shape", None)
    if obs_shape is not None and int(np.prod(obs_shape)) != dataset.observation_dim:
        raise ValueError(f"{where}'s observation space {observation_space} does not fit the data's "
                         f"{dataset.observation_dim}-d observations; pass the env the data comes from")
    if isinstance(action_space, gym.spaces.Discrete) != (dataset.discrete_actions is not None) or (
            isinstance(action_space, gym.spaces.Discrete) and int(action_space.n) != dataset.discrete_actions) or (
            isinstance(action_space, gym.spaces.Box) and int(np.prod(action_space.shape)) != dataset.action_dim):
        what = (f"{dataset.discrete_actions} discrete actions" if dataset.discrete_actions is not None
                else f"{dataset.action_dim}-d actions")
        raise ValueError(f"{where}'s action space {action_space} does not fit the data's {what}; "
                         "pass the env the data comes from")


def _space_bounds(space: Any) -> dict[str, Any]:
    import gymnasium as gym

    if isinstance(space, gym.spaces.Discrete):
        return {"discrete_actions": int(space.n)}
    if isinstance(space, gym.spaces.Box):
        low, high = np.asarray(space.low, np.float32).reshape(-1), np.asarray(space.high, np.float32).reshape(-1)
        return {
            "action_low": None if not np.isfinite(low).all() else low,
            "action_high": None if not np.isfinite(high).all() else high,
        }
    raise ValueError(f"action space {space} is not supported; offrl handles Box and Discrete action spaces")


def _step_info(infos: dict, key: str, t: int, episode_id: Any) -> np.ndarray:
    """Per-step info `key` with T rows.

    offrl writes T rows; Minari's `DataCollector` records the reset info too
    (T + 1 rows, row k + 1 coming from step k), so its first row is dropped.
    """
    value = np.asarray(infos[key])
    if len(value) == t + 1:
        value = value[1:]
    if len(value) != t:
        raise ValueError(
            f"episode {episode_id}: info {key!r} has {len(value)} rows for {t} steps; expected {t} or {t + 1}"
        )
    return value


def load_minari(dataset_id: str, data_path: str | os.PathLike | None = None, download: bool = False) -> Dataset:
    """Load a local Minari dataset (`minari.load_dataset`) into a Dataset.

    The action bounds come from the dataset's action space (None where it is
    unbounded); errors in the data name the dataset.
    """
    import minari

    check_minari_id(dataset_id)
    try:
        return _load_minari(minari, dataset_id, data_path, download)
    except ValueError as err:
        raise ValueError(f"Minari dataset {dataset_id!r}: {err}") from err


def _load_minari(minari: Any, dataset_id: str, data_path: str | os.PathLike | None, download: bool) -> Dataset:
    with minari_datasets_path(data_path):
        try:
            md = minari.load_dataset(dataset_id, download=download)
        except FileNotFoundError as err:
            where = os.environ.get("MINARI_DATASETS_PATH", "~/.minari/datasets")
            raise FileNotFoundError(
                f"Minari dataset {dataset_id!r} not found under {where}; download it with "
                f"`minari download {dataset_id}` (or load(..., download=True)), or set MINARI_DATASETS_PATH"
            ) from err
        episodes = []
        for ep in md.iterate_episodes():
            infos = ep.infos or {}
            episode = {
                "observations": np.asarray(ep.observations),
                "actions": np.asarray(ep.actions),
                "rewards": ep.rewards,
                "terminations": ep.terminations,
                "truncations": ep.truncations,
            }
            if _NEXT_OBS_KEY in infos:
                episode["observations"] = episode["observations"][:-1]
                episode["next_observations"] = _step_info(infos, _NEXT_OBS_KEY, len(episode["actions"]), ep.id)
            if _LOG_PROB_KEY in infos:
                episode["behavior_log_probs"] = _step_info(infos, _LOG_PROB_KEY, len(episode["actions"]), ep.id)
            episodes.append(episode)
        metadata = md.storage.metadata
        spec = md.spec
        bounds = _space_bounds(spec.action_space)
    meta: dict[str, Any] = {"name": dataset_id, "source": f"minari:{dataset_id}"}
    for key in ("ref_min_score", "ref_max_score"):
        if metadata.get(key) is not None:
            meta[key] = float(metadata[key])
    if spec.env_spec is not None:
        meta["env_id"] = spec.env_spec.id
        if spec.env_spec.max_episode_steps:
            meta["max_episode_steps"] = int(spec.env_spec.max_episode_steps)
    if metadata.get("description"):
        meta["description"] = metadata["description"]
    if "discrete_actions" in bounds:
        for ep in episodes:
            ep["actions"] = np.asarray(ep["actions"]).reshape(-1, 1)
    return Dataset.from_episodes(episodes, metadata=meta, **bounds)


def to_minari(
    dataset: Dataset,
    dataset_id: str,
    env: Any = None,
    ref_min_score: float | None = None,
    ref_max_score: float | None = None,
    *,
    observation_space: Any = None,
    action_space: Any = None,
    data_path: str | os.PathLike | None = None,
    algorithm_name: str = "offrl",
    author: str = "offrl",
    description: str | None = None,
    **kwargs: Any,
) -> Any:
    """Write `dataset` as Minari dataset `dataset_id` via `minari.create_dataset_from_buffers`.

    Behaviour log-probs go to the per-step info `action_log_probs`.  When a
    stored `next_observations` differs from the following observation within
    an episode, it is kept as info `next_observations` so nothing is lost.
    Reference scores default to the dataset's own metadata.  Minari has no
    place for missing labels, so a dataset lacking any rewards or actions is
    refused (label it first).
    """
    check_new_minari_id(dataset_id)  # before Minari creates any folder
    import gymnasium as gym
    import minari
    from minari.data_collector import EpisodeBuffer

    # Minari has no field for a missing label: unlabelled rows would be written as real zeros.
    dataset.require_labels("rewards", "actions", context="to_minari")
    if env is None and (observation_space is None or action_space is None):
        if dataset.metadata.get("env_id"):
            env = dataset.metadata["env_id"]
        else:
            observation_space = observation_space or gym.spaces.Box(-np.inf, np.inf, (dataset.observation_dim,), np.float32)
            if action_space is None:
                if dataset.discrete_actions is not None:
                    action_space = gym.spaces.Discrete(dataset.discrete_actions)
                else:
                    low = dataset.action_low if dataset.action_low is not None else np.full(dataset.action_dim, -np.inf)
                    high = dataset.action_high if dataset.action_high is not None else np.full(dataset.action_dim, np.inf)
                    action_space = gym.spaces.Box(low.astype(np.float32), high.astype(np.float32), dtype=np.float32)
    if env is not None:
        made = gym.make(env) if isinstance(env, str) else env
        try:
            _check_spaces_fit(dataset, made.observation_space, made.action_space, f"env {getattr(made.spec, 'id', env)}")
        finally:
            if isinstance(env, str):
                made.close()
    ref_min_score = dataset.metadata.get("ref_min_score") if ref_min_score is None else ref_min_score
    ref_max_score = dataset.metadata.get("ref_max_score") if ref_max_score is None else ref_max_score
    discrete = dataset.discrete_actions is not None
    episodes = list(dataset)
    # Minari needs the same info keys in every episode, so decide once.
    store_next = any(not np.array_equal(ep["next_observations"][:-1], ep["observations"][1:]) for ep in episodes)
    buffers = []
    for i, ep in enumerate(episodes):
        infos = {}
        if store_next:
            infos[_NEXT_OBS_KEY] = ep["next_observations"]
        if "behavior_log_probs" in ep:
            infos[_LOG_PROB_KEY] = ep["behavior_log_probs"]
        buffers.append(
            EpisodeBuffer(
                id=i,
                observations=np.concatenate([ep["observations"], ep["next_observations"][-1:]]),
                actions=ep["actions"][:, 0].astype(np.int64) if discrete else ep["actions"],
                rewards=ep["rewards"].tolist(),
                terminations=(ep["terminals"] > 0).tolist(),
                truncations=(ep["timeouts"] > 0).tolist(),
                infos=infos or None,
            )
        )
    # Minari stores reference scores only when it has an environment, and with
    # one of the two missing it rolls out 100 random-policy episodes to fill it
    # in.  So write the dataset without them and record them afterwards.
    with minari_datasets_path(data_path):
        md = minari.create_dataset_from_buffers(
            dataset_id,
            buffers,
            env=env,
            # an expert_policy in kwargs asks Minari to compute the scores itself
            ref_min_score=ref_min_score if kwargs.get("expert_policy") is not None else None,
            observation_space=observation_space,
            action_space=action_space,
            algorithm_name=algorithm_name,
            author=author,
            author_email="offrl@users.noreply.github.com",
            code_permalink="https://github.com/offrl/offrl",
            description=description or dataset.metadata.get("description") or f"written by offrl from {dataset!r}",
            **kwargs,
        )
        scores = {
            k: float(v) for k, v in (("ref_min_score", ref_min_score), ("ref_max_score", ref_max_score)) if v is not None
        }
        if scores and kwargs.get("expert_policy") is None:
            md.storage.update_metadata(scores)
        return md
