"""Datasets made by the D4RL-recipe builder: their names, where they live, and how to read them back.

This is the data layer's half of `offrl.builder`: it names a build
(`<env>-<kind>-v<env version>` plus a budget), knows the on-disk layout and
loads or lists what was built, without importing the algorithms.  Training
SAC and collecting the data happen in `offrl.builder`, which sits above the
algorithms and writes what this module reads.

Layout under `$OFFRL_DATA_DIR` (default `~/.offrl/datasets`), which is also
the Minari root for these datasets::

    offrl/<env>-v<N>/<variant>/<kind>-v<R>/data/   Minari datasets (minari.load_dataset)
    .builds/v<R>/<env>-v<N>/<run variant>/        the SAC run: run.json, sac_checkpoint.pt, replay_buffer.pt,
                                                   snapshots/, policies/{medium,expert}.pt
    .tmp/                                          datasets being written (renamed into place)

`<R>` is `DATASET_VERSION`, the builder's recipe version: datasets written
under another version are never read as this one's.  `<variant>` is
`seed<S>` for the default budget, with `-sac<steps>`, a hash of the other
non-default run settings, `-n<transitions>`, `-e<envs>` and `-best` appended
when they differ from the defaults.  The variant is a function of the
request only (the name and the budget the user asked for); each dataset's
metadata (`offrl_build.config`) also records the full configuration that
made it, which the builder checks against the SAC of the day before it
reuses a cached build.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from offrl.datasets.core import Dataset
from offrl.datasets.files import check_path_name

__all__ = [
    "KINDS",
    "ENV_IDS",
    "BUILD_DEFAULTS",
    "DATASET_VERSION",
    "BuildTarget",
    "BuildRequest",
    "offrl_data_dir",
    "parse_name",
    "resolve",
    "built_record",
    "load_built",
    "list_built",
    "known_datasets",
]

KINDS = ("random", "medium", "expert", "medium-replay", "medium-expert")

# Lower-case names (hyphens and underscores ignored) -> gymnasium env names (the version comes from the dataset name).
ENV_IDS = {
    "pendulum": "Pendulum",
    "invertedpendulum": "InvertedPendulum",
    "inverteddoublependulum": "InvertedDoublePendulum",
    "reacher": "Reacher",
    "swimmer": "Swimmer",
    "hopper": "Hopper",
    "halfcheetah": "HalfCheetah",
    "walker2d": "Walker2d",
    "ant": "Ant",
    "humanoid": "Humanoid",
}

# Per-env budgets: SAC environment steps (one update each after the warm-up), transitions per collected kind,
# evaluation/snapshot interval, and (optionally, "sac_params") SAC hyper-parameters that differ from SAC's defaults.
# Pendulum is solved (about -150) within ~10k steps; the MuJoCo locomotion tasks get D4RL's 1M steps.
BUILD_DEFAULTS: dict[str, dict[str, Any]] = {
    "pendulum": {"sac_steps": 15_000, "n_transitions": 1_000_000, "eval_every": 250},
    "invertedpendulum": {"sac_steps": 30_000, "n_transitions": 1_000_000, "eval_every": 500},
    "inverteddoublependulum": {"sac_steps": 100_000, "n_transitions": 1_000_000, "eval_every": 1_000},
    "reacher": {"sac_steps": 200_000, "n_transitions": 1_000_000, "eval_every": 2_000},
    "swimmer": {"sac_steps": 1_000_000, "n_transitions": 1_000_000, "eval_every": 10_000},
    "hopper": {"sac_steps": 1_000_000, "n_transitions": 1_000_000, "eval_every": 10_000},
    "halfcheetah": {"sac_steps": 1_000_000, "n_transitions": 1_000_000, "eval_every": 10_000},
    "walker2d": {"sac_steps": 1_000_000, "n_transitions": 1_000_000, "eval_every": 10_000},
    "ant": {"sac_steps": 1_000_000, "n_transitions": 1_000_000, "eval_every": 10_000},
    "humanoid": {"sac_steps": 1_000_000, "n_transitions": 1_000_000, "eval_every": 10_000},
}
GENERIC_DEFAULTS: dict[str, Any] = {"sac_steps": 1_000_000, "n_transitions": 1_000_000}
N_EVALS = 100  # snapshots per run when eval_every is not set (for non-default budgets)
EXPERT_CHOICES = ("final", "best")
# The recipe version: the `-v<R>` of the Minari ids and the `.builds/v<R>` of the runs.  Bump it whenever the
# builder's recipe or its cache key changes, so that datasets of the old recipe are not found, never reused.
# 1: the cache key holds SAC's full configuration (0 held only its differences from SAC's defaults of the day).
DATASET_VERSION = 1
NAMESPACE = "offrl"
DEFAULT_N_ENVS = 32
DEFAULT_EVAL_EPISODES = 10
DEFAULT_REF_EPISODES = 100
# Not a SAC setting of the run: the replay buffer always holds the whole run (medium-replay is a slice of it).
_FORCED_SAC_PARAMS = ("buffer_size",)
_MISSING = object()


def offrl_data_dir() -> Path:
    """Where offrl caches the datasets it builds: `$OFFRL_DATA_DIR` or `~/.offrl/datasets`."""
    return Path(os.environ.get("OFFRL_DATA_DIR", "~/.offrl/datasets")).expanduser()


def data_root(data_dir: str | os.PathLike | None = None) -> Path:
    """`data_dir` expanded, or `offrl_data_dir()` for None."""
    return Path(data_dir).expanduser() if data_dir is not None else offrl_data_dir()


# ---------------------------------------------------------------------- names
@dataclass(frozen=True)
class BuildTarget:
    """A parsed dataset name: which env and which kinds."""

    name: str
    env: str  # short lower-case env name as used in the dataset name
    env_id: str  # gymnasium id
    version: int
    kinds: tuple[str, ...]

    @property
    def env_key(self) -> str:
        return f"{self.env}-v{self.version}"

    def dataset_name(self, kind: str) -> str:
        return f"{self.env}-{kind}-v{self.version}"


def normalise_env(text: str) -> str:
    """Lower case without hyphens, underscores or spaces: how env names are compared."""
    return re.sub(r"[-_ ]", "", text.lower())


def env_defaults(target: BuildTarget) -> dict[str, Any]:
    """The default budget of `target`'s env (`BUILD_DEFAULTS`, or the generic one)."""
    return BUILD_DEFAULTS.get(normalise_env(target.env), GENERIC_DEFAULTS)


def parse_name(name: str, env_id: str | None = None) -> BuildTarget:
    """Split `<env>-<kind>-v<env version>` and find the gymnasium env.

    The kind may be `*` or `all` for all five kinds.  Known lower-case env
    names map to gymnasium ids (`hopper` -> `Hopper-v<N>`); other names are
    looked up in gymnasium's registry ignoring case, hyphens and
    underscores; `env_id` names the gymnasium id explicitly (its version
    must agree with the name's).
    """
    import gymnasium as gym

    if not isinstance(name, str):
        raise TypeError(f"dataset name must be a string like 'hopper-medium-v5', got {type(name).__name__}")
    match = re.fullmatch(r"(?P<stem>.+)-v(?P<version>\d+)", name.strip())
    if not match or "-" not in match["stem"]:
        raise ValueError(f"dataset name {name!r} must look like '<env>-<kind>-v<env version>', e.g. 'hopper-medium-v5' "
                         f"(kinds: {', '.join(KINDS)}, or '*' for all)")
    stem, version = match["stem"], int(match["version"])
    kinds_pattern = "|".join(re.escape(k) for k in sorted(KINDS + ("*", "all"), key=len, reverse=True))
    kind_match = re.fullmatch(rf"(?P<env>.+?)-(?P<kind>{kinds_pattern})", stem)
    if not kind_match:
        env_guess, _, kind_guess = stem.rpartition("-")
        raise ValueError(
            f"unknown dataset kind {kind_guess!r} in {name!r}; choose one of {', '.join(KINDS)} (or '*' for all), "
            f"e.g. '{env_guess or stem}-medium-v{version}'"
        )
    env, kind = kind_match["env"].lower(), kind_match["kind"]
    kinds = KINDS if kind in ("*", "all") else (kind,)
    key = normalise_env(env)
    if env_id is not None:
        if env_id not in gym.registry:
            raise ValueError(f"env_id {env_id!r} is not a registered gymnasium environment; import the package that registers it")
        spec_version = gym.spec(env_id).version
        if spec_version is not None and spec_version != version:
            raise ValueError(f"{name!r} asks for env version v{version} but env_id {env_id!r} is v{spec_version}; make them agree")
        resolved = env_id
    else:
        base = ENV_IDS.get(key)
        if base is None:
            matches = sorted({s.name for s in gym.registry.values() if s.namespace is None and normalise_env(s.name) == key})
            if not matches:
                raise ValueError(
                    f"unknown environment {env!r} in {name!r}: known names are {', '.join(sorted(ENV_IDS))}, or any "
                    "gymnasium env name (e.g. 'mountaincarcontinuous-medium-v0'); pass env_id='Package/Env-vN' for others"
                )
            base = matches[0]
        resolved = f"{base}-v{version}"
        if resolved not in gym.registry:
            versions = sorted(s.version for s in gym.registry.values() if s.name == base and s.namespace is None
                              and s.version is not None)
            raise ValueError(
                f"{resolved} is not registered in gymnasium (versions of {base}: "
                f"{', '.join(f'v{v}' for v in versions) or 'none'}); use one of those versions in {name!r}"
            )
    short = re.sub(r"[^a-z0-9_]", "", env.replace("-", ""))
    if not short:  # e.g. '/' or '..' with an explicit env_id: the env part names the build's folders
        raise ValueError(f"dataset name {name!r} has no letters or digits in its env part {env!r}, which names the "
                         "build's folders; use an env name such as 'pendulum' (with env_id for the gymnasium id)")
    check_path_name(f"{short}-v{version}", f"the env folder of dataset name {name!r}")
    return BuildTarget(name=name, env=short, env_id=resolved, version=version, kinds=kinds)


# ---------------------------------------------------------------------- requests
def _digest(value: Any, n: int = 8) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:n]


def json_value(name: str, value: Any) -> Any:
    """`value` as JSON stores it (tuples become lists), so requests and stored records compare equal."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as err:
        raise ValueError(f"sac_params[{name!r}] = {value!r} is not a plain number, string, bool, None or list "
                         f"of them ({err}); pass a JSON-like value") from err


@dataclass(frozen=True)
class BuildRequest:
    """A dataset name and the budget asked for, resolved against the env's defaults.

    It names the build on disk (variants, Minari ids, run directory) and
    holds no SAC defaults: `sac_params` are the recipe's and the user's SAC
    settings only (JSON values, `buffer_size` left out: the builder always
    keeps the whole run).
    """

    target: BuildTarget
    seed: int
    sac_steps: int
    n_transitions: int
    eval_every: int
    eval_episodes: int
    ref_episodes: int
    n_envs: int
    expert: str
    sac_params: dict[str, Any] = field(default_factory=dict)
    default_sac_steps: int = 0
    default_n_transitions: int = 0
    default_eval_every: int = 0
    recipe_sac_params: dict[str, Any] = field(default_factory=dict)

    def _run_extras(self) -> dict[str, Any]:
        """The run settings that differ from the defaults for this many SAC steps (they make the hash)."""
        extras: dict[str, Any] = {}
        if self.eval_every != self.default_eval_every:
            extras["eval_every"] = self.eval_every
        if self.eval_episodes != DEFAULT_EVAL_EPISODES:
            extras["eval_episodes"] = self.eval_episodes
        if self.ref_episodes != DEFAULT_REF_EPISODES:
            extras["ref_episodes"] = self.ref_episodes
        overrides = {k: v for k, v in self.sac_params.items() if self.recipe_sac_params.get(k, _MISSING) != v}
        if overrides:
            extras["sac_params"] = overrides
        return extras

    @property
    def run_variant(self) -> str:
        """`seed<S>`, then `-sac<steps>` and a hash of the other run settings when they are not the defaults."""
        variant = f"seed{self.seed}" + ("" if self.sac_steps == self.default_sac_steps else f"-sac{self.sac_steps}")
        extras = self._run_extras()
        if extras:
            variant += "-" + _digest({"env_id": self.target.env_id, "seed": self.seed, "sac_steps": self.sac_steps,
                                      **extras})
        return variant

    @property
    def data_variant(self) -> str:
        variant = self.run_variant + ("" if self.n_transitions == self.default_n_transitions else f"-n{self.n_transitions}")
        variant += "" if self.n_envs == DEFAULT_N_ENVS else f"-e{self.n_envs}"
        return variant + ("" if self.expert == "final" else f"-{self.expert}")

    def namespace(self) -> str:
        return f"{NAMESPACE}/{self.target.env_key}/{self.data_variant}"

    def dataset_id(self, kind: str) -> str:
        return f"{self.namespace()}/{kind}-v{DATASET_VERSION}"

    def run_dir(self, root: Path) -> Path:
        """The directory of the SAC run shared by every kind (and by both expert choices)."""
        return root / ".builds" / f"v{DATASET_VERSION}" / self.target.env_key / self.run_variant

    def run_fields(self) -> dict[str, Any]:
        """What determines the SAC run besides SAC's own configuration (the builder adds `sac_params`)."""
        return {
            "version": DATASET_VERSION,
            "env_id": self.target.env_id,
            "seed": self.seed,
            "sac_steps": self.sac_steps,
            "eval_every": self.eval_every,
            "eval_episodes": self.eval_episodes,
            "ref_episodes": self.ref_episodes,
        }

    def collection_fields(self) -> dict[str, Any]:
        """What determines the collected datasets beyond the run."""
        return {"n_transitions": self.n_transitions, "n_envs": self.n_envs, "expert": self.expert}

    def mismatches(self, config: Mapping[str, Any]) -> list[str]:
        """The fields of a stored build configuration that differ from this request (empty: it is this request's)."""
        expected = {**self.run_fields(), **self.collection_fields()}
        diffs = [f"{k} {config.get(k)!r} (asked {v!r})" for k, v in expected.items() if config.get(k) != v]
        stored = config.get("sac_params") or {}
        diffs += [f"sac_params.{k} {stored.get(k, '<absent>')!r} (asked {v!r})"
                  for k, v in self.sac_params.items() if stored.get(k, _MISSING) != v]
        return diffs

    def build_command(self) -> str:
        """The `offrl datasets build` line for this request ('' when the CLI cannot express its SAC settings)."""
        cli_sac = {"learning_starts"}
        if set(self._run_extras().get("sac_params", {})) - cli_sac or self.eval_episodes != DEFAULT_EVAL_EPISODES \
                or self.ref_episodes != DEFAULT_REF_EPISODES or self.n_envs != DEFAULT_N_ENVS:
            return ""
        flags = [("seed", self.seed or None),
                 ("sac-steps", self.sac_steps if self.sac_steps != self.default_sac_steps else None),
                 ("transitions", self.n_transitions if self.n_transitions != self.default_n_transitions else None),
                 ("eval-every", self.eval_every if self.eval_every != self.default_eval_every else None),
                 ("learning-starts", self._run_extras().get("sac_params", {}).get("learning_starts")),
                 ("expert", self.expert if self.expert != "final" else None)]
        return f"offrl datasets build {self.target.name}" + "".join(f" --{k} {v}" for k, v in flags if v is not None)

    def rebuild_hint(self) -> str:
        """How to rebuild this request from scratch: the CLI line (when it can say it) or the Python call."""
        command = self.build_command()
        call = self.builder_call()[:-1] + ", force=True)"
        return (f"`{command} --force` or " if command else "") + call

    def builder_call(self) -> str:
        """The `offrl.builder.load_or_build(...)` call for this request."""
        args = [repr(self.target.name)]
        if self.seed:
            args.append(f"seed={self.seed}")
        for name, value, default in (("sac_steps", self.sac_steps, self.default_sac_steps),
                                     ("n_transitions", self.n_transitions, self.default_n_transitions),
                                     ("eval_every", self.eval_every, self.default_eval_every),
                                     ("eval_episodes", self.eval_episodes, DEFAULT_EVAL_EPISODES),
                                     ("ref_episodes", self.ref_episodes, DEFAULT_REF_EPISODES),
                                     ("n_envs", self.n_envs, DEFAULT_N_ENVS), ("expert", self.expert, "final")):
            if value != default:
                args.append(f"{name}={value!r}")
        overrides = self._run_extras().get("sac_params")
        if overrides:
            args.append(f"sac_params={overrides!r}")
        return f"offrl.builder.load_or_build({', '.join(args)})"


def resolve(
    name: str | BuildTarget,
    *,
    seed: int = 0,
    n_transitions: int | None = None,
    sac_steps: int | None = None,
    eval_every: int | None = None,
    eval_episodes: int = DEFAULT_EVAL_EPISODES,
    ref_episodes: int = DEFAULT_REF_EPISODES,
    sac_params: Mapping[str, Any] | None = None,
    n_envs: int = DEFAULT_N_ENVS,
    expert: str = "final",
    env_id: str | None = None,
) -> BuildRequest:
    """Resolve a name and budget against the env's defaults (`BUILD_DEFAULTS`); check what needs no SAC.

    `sac_steps` and `n_transitions` default per env; `eval_every` to the
    env's interval at its default budget, else `sac_steps / 100`.
    """
    target = name if isinstance(name, BuildTarget) else parse_name(name, env_id)
    defaults = env_defaults(target)
    default_steps = int(defaults["sac_steps"])
    default_n = int(defaults["n_transitions"])
    sac_steps = default_steps if sac_steps is None else int(sac_steps)
    n_transitions = default_n if n_transitions is None else int(n_transitions)
    if isinstance(seed, bool) or int(seed) != seed or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if sac_steps < 1:
        raise ValueError(f"sac_steps must be at least 1, got {sac_steps}")
    if n_transitions < 1:
        raise ValueError(f"n_transitions must be at least 1, got {n_transitions}")
    if eval_episodes < 10 or ref_episodes < 10:
        raise ValueError(f"eval_episodes and ref_episodes must be at least 10 (got {eval_episodes}, {ref_episodes}); "
                         "D4RL-style reference scores need at least 10 evaluation episodes")
    if n_envs < 1:
        raise ValueError(f"n_envs must be at least 1, got {n_envs}")
    if expert not in EXPERT_CHOICES:
        raise ValueError(f"expert must be one of {EXPERT_CHOICES} (the final SAC policy, as in D4RL, or the best "
                         f"evaluated snapshot), got {expert!r}")
    if eval_every is not None and int(eval_every) < 1:
        raise ValueError(f"eval_every must be at least 1, got {eval_every}")
    default_eval_every = int(defaults.get("eval_every", 0)) if sac_steps == default_steps else 0
    default_eval_every = default_eval_every or max(sac_steps // N_EVALS, 1)
    recipe = {k: json_value(k, v) for k, v in defaults.get("sac_params", {}).items() if k not in _FORCED_SAC_PARAMS}
    params = dict(recipe)
    params.update({k: json_value(k, v) for k, v in (sac_params or {}).items() if k not in _FORCED_SAC_PARAMS})
    return BuildRequest(
        target=target, seed=int(seed), sac_steps=sac_steps, n_transitions=n_transitions,
        eval_every=int(eval_every or default_eval_every), eval_episodes=int(eval_episodes),
        ref_episodes=int(ref_episodes), n_envs=int(n_envs), expert=expert, sac_params=params,
        default_sac_steps=default_steps, default_n_transitions=default_n, default_eval_every=default_eval_every,
        recipe_sac_params=recipe,
    )


# ---------------------------------------------------------------------- files
def read_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


def dataset_path(root: Path, dataset_id: str) -> Path:
    """The directory of a Minari dataset id under the Minari root `root`."""
    return root.joinpath(*dataset_id.split("/"))


def read_metadata(root: Path, dataset_id: str) -> dict[str, Any] | None:
    """A built dataset's Minari metadata, or None when it is absent or unreadable (e.g. half written)."""
    path = dataset_path(root, dataset_id) / "data" / "metadata.json"
    if not path.exists():
        return None
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


# What a build record (a built dataset's `offrl_build` metadata) must hold for `load_built`.
_RECORD_FIELDS = {"config": dict, "medium_step": int}


def build_record_problem(root: Path, dataset_id: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the build record of `dataset_id`, None) when it is readable; (None, None) when the dataset has none
    (not built); (None, what is wrong) when its metadata.json is damaged (truncated, edited)."""
    path = dataset_path(root, dataset_id) / "data" / "metadata.json"
    if not path.exists():
        return None, None
    try:
        metadata = read_json(path)
    except (OSError, ValueError) as err:
        return None, f"{path} cannot be read ({type(err).__name__}: {err})"
    info = metadata.get("offrl_build") if isinstance(metadata, dict) else None
    if info is None:
        return None, None
    if not isinstance(info, dict):
        return None, f"{path}: offrl_build is a {type(info).__name__}, not a mapping"
    for key, kind in _RECORD_FIELDS.items():
        if not isinstance(info.get(key), kind) or isinstance(info.get(key), bool):
            return None, f"{path}: offrl_build.{key} is {info.get(key)!r}, not a {kind.__name__}"
    return info, None


def _lookup(name: str, data_dir: str | os.PathLike | None, budget: Mapping[str, Any], verb: str
            ) -> tuple[BuildRequest, Path, str, dict[str, Any] | None, list[str]]:
    """The request for one kind, the data root, its dataset id, its build record (None if not built) and how the
    record's configuration differs from the request (empty: it is this request's).  A damaged record raises
    ValueError saying how to rebuild it."""
    request = resolve(name, **budget)
    if len(request.target.kinds) != 1:
        raise ValueError(f"{name!r} names several kinds; {verb} one, e.g. {request.target.dataset_name('medium')!r}")
    root = data_root(data_dir)
    dataset_id = request.dataset_id(request.target.kinds[0])
    info, damage = build_record_problem(root, dataset_id)
    if damage:
        raise ValueError(f"the build record of offrl dataset {name!r} is damaged: {damage}; rebuild it with "
                         f"{request.rebuild_hint()}")
    problems = request.mismatches(info.get("config", {})) if info else []
    return request, root, dataset_id, info, problems


_DAMAGE_ERRORS = (OSError, KeyError, ValueError, RuntimeError, TypeError, IndexError, AttributeError, EOFError)


def load_built_files(dataset_id: str, root: Path, name: str, hint: str) -> Dataset:
    """The Minari files of a built dataset as a Dataset; damaged files raise ValueError naming them and `hint`."""
    from offrl.datasets.minari import load_minari

    try:
        return load_minari(dataset_id, data_path=root)
    except _DAMAGE_ERRORS as err:
        raise ValueError(f"the files of offrl dataset {name!r} under {dataset_path(root, dataset_id)} are damaged "
                         f"({type(err).__name__}: {err}); rebuild it with {hint}") from err


def built_record(name: str, *, data_dir: str | os.PathLike | None = None, **budget: Any) -> dict[str, Any] | None:
    """The build record (`offrl_build` metadata, with its `path`) of one built dataset, or None if it is not
    built with this budget.  `budget` takes `resolve`'s arguments."""
    _, root, dataset_id, info, problems = _lookup(name, data_dir, budget, "ask for")
    if not info or problems:
        return None
    return {**info, "path": str(dataset_path(root, dataset_id))}


def load_built(name: str, *, data_dir: str | os.PathLike | None = None, **budget: Any) -> Dataset:
    """Load a dataset that `offrl.builder` built (`offrl.datasets.load("offrl:<name>")`); it never builds.

    `budget` takes `resolve`'s arguments (seed, n_transitions, sac_steps, eval_every, eval_episodes,
    ref_episodes, sac_params, n_envs, expert, env_id): those the dataset was built with (defaults: the
    env's default budget).  A dataset that is not built, or was built with another budget, raises
    FileNotFoundError saying how to build it; one whose record or files are damaged raises ValueError
    saying how to rebuild it.
    """
    request, root, dataset_id, info, problems = _lookup(name, data_dir, budget, "load")
    target = request.target
    kind = target.kinds[0]
    if not info or problems:
        what = f"was built with a different configuration ({'; '.join(problems)})" if info else "has not been built"
        command = request.build_command()
        how = (f"`{command}{' --force' if info else ''}` or " if command else "") + request.builder_call()
        raise FileNotFoundError(
            f"offrl dataset {name!r} (seed {request.seed}, {request.sac_steps:,} SAC steps, "
            f"{request.n_transitions:,} transitions) {what} under {root}; build it with {how}"
        )
    ds = load_built_files(dataset_id, root, name, request.rebuild_hint())
    ds.metadata.update({
        "name": target.name,
        "source": f"offrl:{target.name}",
        "minari_id": dataset_id,
        "path": str(dataset_path(root, dataset_id)),
        "kind": kind,
        "seed": request.seed,
        "sac_steps": request.sac_steps,
        "medium_step": info["medium_step"],
        "cut_episodes": list(info.get("cut_episodes", [])),
    })
    if info.get("behavior_policy"):
        ds.metadata["behavior_policy"] = info["behavior_policy"]
    return ds


# ---------------------------------------------------------------------- listing
def known_datasets() -> list[dict[str, Any]]:
    """The env names the builder maps, with their gymnasium ids and default budgets."""
    import gymnasium as gym

    rows = []
    for short, base in ENV_IDS.items():
        versions = [s.version for s in gym.registry.values() if s.name == base and s.namespace is None and s.version is not None]
        if not versions:
            continue
        version = max(versions)
        defaults = BUILD_DEFAULTS.get(short, GENERIC_DEFAULTS)
        rows.append({"name": f"{short}-<kind>-v{version}", "env_id": f"{base}-v{version}",
                     "sac_steps": defaults["sac_steps"], "n_transitions": defaults["n_transitions"]})
    return rows


def list_built(data_dir: str | os.PathLike | None = None, *, all_versions: bool = False) -> list[dict[str, Any]]:
    """Datasets built under `data_dir` (default `$OFFRL_DATA_DIR`), read from their Minari metadata.

    Only those of the current recipe (`DATASET_VERSION`) unless
    `all_versions`; each row is the dataset's build record plus its `path`.
    """
    root = data_root(data_dir)
    rows: list[dict[str, Any]] = []
    base = root / NAMESPACE
    if not base.is_dir():
        return rows
    for metadata_path in sorted(base.glob("**/data/metadata.json")):
        if any(part.startswith(".") for part in metadata_path.relative_to(root).parts):
            continue
        try:
            info = read_json(metadata_path).get("offrl_build")
        except (OSError, ValueError, AttributeError):
            continue
        if not info:
            continue
        if not all_versions and info.get("config", {}).get("version") != DATASET_VERSION:
            continue
        rows.append({**info, "path": str(metadata_path.parent.parent)})
    return rows
