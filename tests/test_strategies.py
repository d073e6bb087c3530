"""Fine-tuning strategies on a real env: each recipe's mix, warm-up, hand-over and critic subset, counted as they run.

Every count here is read from what the run did (the batches the update
received, the critics the target evaluated, the actions the env got, the
rows the replay buffer holds), not from the strategy's own settings.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import offrl
from offrl.algos import CQL, IQL, SAC, CalQL, TD3PlusBC
from offrl.datasets.core import Dataset
from offrl.online import E2O, JSRL, RLPD, WSRL, CalQLFineTuning, OnlineStrategy, resolve_strategy
from offrl.online.strategies import deterministic_action
from test_learning import pendulum_mixed_dataset

SMALL = dict(hidden_dims=(32, 32), batch_size=32)
OFFLINE_MARK = 7.0  # the offline rows' behaviour log-probability: no online action has this density
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pendulum_data() -> Dataset:
    data = pendulum_mixed_dataset(n_episodes=4)
    return Dataset.from_arrays(observations=data.observations, actions=data.actions, rewards=data.rewards,
                               terminals=data.terminals, timeouts=data.timeouts,
                               next_observations=data.next_observations,
                               behavior_log_probs=np.full(data.n_transitions, OFFLINE_MARK, np.float32),
                               action_low=-2.0, action_high=2.0, metadata=dict(data.metadata))


def _record_updates(algo) -> list[dict]:
    """Wrap the agent's online update: per call, how many offline rows its batch held and the buffer's size."""
    calls: list[dict] = []
    update = algo._online_update

    def recording(batch):
        calls.append({"offline": int((batch.behavior_log_probs == OFFLINE_MARK).sum()),
                      "size": len(batch.observations), "buffer": len(algo.replay_buffer_)})
        return update(batch)

    algo._online_update = recording
    return calls


def _record_target_members(algo) -> list:
    """Wrap the target critics: the `members` selection of each call (None: the whole ensemble)."""
    calls: list = []
    forward = algo.critic_target_.forward

    def recording(obs, actions, members=None):
        calls.append(None if members is None else members.tolist())
        return forward(obs, actions, members)

    algo.critic_target_.forward = recording
    return calls


def _weights(algo) -> dict[str, torch.Tensor]:
    return {f"{name}.{k}": v.clone() for name, module in algo._state_objects().items()
            for k, v in module.state_dict().items()}


# ---------------------------------------------------------------------- names, parameters, errors
def test_resolve_strategy_names_mappings_and_instances():
    assert type(resolve_strategy("naive")) is OnlineStrategy
    assert isinstance(resolve_strategy("wsrl"), WSRL) and isinstance(resolve_strategy("calql"), CalQLFineTuning)
    rlpd = resolve_strategy({"rlpd": {"utd_ratio": 5}})
    assert isinstance(rlpd, RLPD) and rlpd.utd_ratio == 5 and rlpd.offline_fraction == 0.5
    mine = JSRL(horizon=50)
    assert resolve_strategy(mine) is mine
    with pytest.raises(ValueError, match="unknown.*'e2o'"):
        resolve_strategy("sunrise")
    with pytest.raises(ValueError, match="strategy 'rlpd'.*utd"):
        resolve_strategy({"rlpd": {"utd": 5}})
    with pytest.raises(TypeError, match="strategy must be"):
        resolve_strategy(3)


@pytest.mark.parametrize("make, message", [
    (lambda: OnlineStrategy(utd_ratio=0), "utd_ratio"),
    (lambda: OnlineStrategy(offline_fraction=1.5), "offline_fraction"),
    (lambda: OnlineStrategy(warmup_actions="random"), "warmup_actions"),
    (lambda: RLPD(n_critics=4, critic_subset=5), "critic_subset=5 exceeds n_critics=4"),
    (lambda: JSRL(curriculum="linear"), "curriculum"),
    (lambda: JSRL(n_stages=0), "n_stages"),
    (lambda: E2O(ucb_lambda=-1), "ucb_lambda"),
])
def test_bad_strategy_parameters_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_strategy_refuses_an_agent_it_does_not_fit(pendulum_data):
    iql = IQL(**SMALL, random_state=0).fit(pendulum_data, n_steps=5, progress=False)
    with pytest.raises(ValueError, match=r"uses 10 critics.*IQL\(n_critics=10\)"):
        iql.fit_online("Pendulum-v1", 10, strategy="wsrl", progress=False)
    with pytest.raises(ValueError, match="'calql' strategy.*CalQL"):
        iql.fit_online("Pendulum-v1", 10, strategy="calql", offline_dataset=pendulum_data, progress=False)
    with pytest.raises(ValueError, match="offline_dataset="):
        iql.fit_online("Pendulum-v1", 10, strategy=RLPD(n_critics=2), progress=False)
    # A refused run leaves the agent's own update options as they were.
    assert iql._critic_subset is None and iql._conservative is True


# ---------------------------------------------------------------------- sampling mix, warm-up, UTD
def test_rlpd_batches_are_half_offline_after_a_uniform_warm_up(pendulum_data):
    algo = IQL(**SMALL, n_critics=4, random_state=0).fit(pendulum_data, n_steps=5, progress=False)
    calls = _record_updates(algo)
    algo.fit_online("Pendulum-v1", 300, strategy=RLPD(warmup_steps=100, utd_ratio=3, n_critics=4),
                    offline_dataset=pendulum_data, progress=False)
    # Warm-up: no update before 101 online transitions, then 3 per step; the offline data never enters the buffer.
    assert calls[0]["buffer"] == 101 and len(calls) == 3 * 200 == algo.online_updates_done_
    assert {c["offline"] for c in calls} == {16} and {c["size"] for c in calls} == {32}
    stored = algo.replay_buffer_.columns["behavior_log_probs"][:len(algo.replay_buffer_)].numpy()
    assert len(algo.replay_buffer_) == 300 and not (stored == OFFLINE_MARK).any()
    # The warm-up actions are uniform (their density is the box's), the later ones the policy's.
    np.testing.assert_allclose(stored[:100], -np.log(4.0), rtol=1e-6)
    assert not np.isclose(stored[100:], -np.log(4.0)).all()


def test_wsrl_warms_up_with_the_policy_and_keeps_no_offline_data(pendulum_data):
    algo = CQL(**SMALL, n_critics=4, n_action_samples=2, random_state=0).fit(pendulum_data, n_steps=5, progress=False)
    calls = _record_updates(algo)
    metrics = []
    update = algo._update

    def recording(batch, step):
        metrics.append(update(batch, step))
        return metrics[-1]

    algo._update = recording
    policy_log_probs = []
    act = algo._online_act

    def acting(obs, generator):
        actions, log_probs = act(obs, generator)
        policy_log_probs.append(log_probs.clone())
        return actions, log_probs

    algo._online_act = acting
    algo.fit_online("Pendulum-v1", 250, strategy=WSRL(warmup_steps=120, batch_size=48, n_critics=4),
                    offline_dataset=pendulum_data, progress=False)
    assert calls[0]["buffer"] == 121 and len(calls) == 4 * 130
    assert {c["offline"] for c in calls} == {0} and {c["size"] for c in calls} == {48}
    assert len(algo.replay_buffer_) == 250  # the offline data was not kept
    # Every warm-up action came from the policy (its log-density is what the buffer holds).
    stored = algo.replay_buffer_.columns["behavior_log_probs"][:120]
    assert torch.equal(stored, torch.cat(policy_log_probs[:120]))
    # The conservative penalty is off online: the critic loss is the TD loss alone ...
    assert all(torch.equal(m["critic_loss"], m["td_loss"]) for m in metrics)
    # ... and back on for the agent afterwards.
    assert algo._conservative is True and algo._critic_subset is None


def test_calql_keeps_its_penalty_and_mixes_offline_rows_with_their_returns(pendulum_data):
    algo = CalQL(**SMALL, n_action_samples=2, random_state=0).fit(pendulum_data, n_steps=5, progress=False)
    batches = []
    update = algo._online_update

    def recording(batch):
        batches.append((int((batch.behavior_log_probs == OFFLINE_MARK).sum()), batch.extras["mc_returns"].clone()))
        metrics = update(batch)
        assert not torch.equal(metrics["critic_loss"], metrics["td_loss"])  # the calibrated penalty is still on
        return metrics

    algo._online_update = recording
    algo.fit_online("Pendulum-v1", 250, strategy="calql", offline_dataset=pendulum_data, progress=False)
    # Until the first episode ends (step 200) the online buffer is empty and batches are wholly offline; then half.
    assert [n for n, _ in batches[:199]] == [32] * 199 and {n for n, _ in batches[199:]} == {16}
    assert len(batches) == 250 and algo.online_updates_done_ == 250
    assert all(torch.isfinite(mc).all() and (mc != 0).any() for _, mc in batches)


def test_naive_fine_tuning_draws_uniformly_from_one_buffer(pendulum_data):
    algo = TD3PlusBC(**SMALL, random_state=0).fit(pendulum_data, n_steps=5, progress=False)
    calls = _record_updates(algo)
    algo.fit_online("Pendulum-v1", 200, offline_dataset=pendulum_data, progress=False)
    offline = np.array([c["offline"] for c in calls]) / 32
    # The buffer holds 800 offline rows and k online ones at the k-th update: no fixed split, the share follows it.
    expected = np.mean([800 / (800 + k) for k in range(1, 201)])
    assert len(calls) == 200 and abs(offline.mean() - expected) < 0.02 and offline.min() < 1.0
    assert len(algo.replay_buffer_) == pendulum_data.n_transitions + 200


# ---------------------------------------------------------------------- critic subsets
def test_rlpd_targets_take_the_minimum_of_two_random_critics_and_the_actor_their_mean(pendulum_data):
    algo = SAC(**SMALL, random_state=0)
    members_seen: list = []
    built = algo._build

    def build_and_record(spec):
        built(spec)
        members_seen.append(_record_target_members(algo))

    algo._build = build_and_record
    algo.fit_online("Pendulum-v1", 150, strategy=RLPD(warmup_steps=50, utd_ratio=2), offline_dataset=pendulum_data,
                    progress=False)
    calls = members_seen[0]
    assert algo.critic_.n_critics == 10 and len(calls) == 2 * 100
    # Each target evaluates 2 distinct critics of the 10, a fresh pair each time, every critic in its turn.
    assert all(len(m) == 2 and len(set(m)) == 2 and set(m) <= set(range(10)) for m in calls)
    assert len({tuple(sorted(m)) for m in calls}) > 20 and set().union(*map(set, calls)) == set(range(10))
    # The critics have LayerNorm (RLPD's), recorded in the spec so a checkpoint rebuilds them.
    assert algo.spec_["critic_layer_norm"] is True
    assert any("layers.1" in name for name, _ in algo.critic_.named_parameters())


def test_without_a_subset_the_target_is_the_whole_ensemble(pendulum_data):
    algo = IQL(**SMALL, n_critics=3, random_state=0).fit(pendulum_data, n_steps=5, progress=False)
    calls = _record_target_members(algo)
    algo.fit_online("Pendulum-v1", 50, progress=False)
    assert len(calls) == 50 and set(map(str, calls)) == {"None"}


# ---------------------------------------------------------------------- JSRL's guide and curriculum
def _guided_prefixes(algo, n_episodes: int, length: int = 200) -> list[int]:
    """Per episode, how many first steps took exactly the guide's deterministic action."""
    buffer = algo.replay_buffer_
    obs = buffer.columns["observations"][: n_episodes * length]
    actions = buffer.columns["actions"][: n_episodes * length]
    with torch.no_grad():
        guide = deterministic_action(algo.online_guide_policy_, algo.obs_normalizer_(obs))
    same = torch.isclose(guide, actions, atol=1e-6).all(1).reshape(n_episodes, length).numpy()
    return [int(np.argmin(row)) if not row.all() else length for row in same]


def test_jsrl_hands_over_along_its_curriculum(pendulum_data):
    algo = IQL(**SMALL, random_state=0).fit(pendulum_data, n_steps=20, progress=False)
    policy_before = {k: v.clone() for k, v in algo.policy_.state_dict().items()}
    # tolerance so large that every window advances: the horizon drops 200, 150, 100, 50, 0, 0.
    strategy = JSRL(horizon=200, n_stages=4, window=1, tolerance=1e9)
    algo.fit_online("Pendulum-v1", 1200, strategy=strategy, progress=False)
    assert _guided_prefixes(algo, 6) == [200, 150, 100, 50, 0, 0]
    assert strategy.stage_steps_ == [199, 399, 599, 799]
    # The guide is the policy at the switch, frozen; the learner moved on.
    assert all(torch.equal(v, policy_before[k]) for k, v in algo.online_guide_policy_.state_dict().items())
    assert any(not torch.equal(v, policy_before[k]) for k, v in algo.policy_.state_dict().items())


def test_jsrl_waits_while_the_learner_falls_short(pendulum_data):
    algo = IQL(**SMALL, random_state=0).fit(pendulum_data, n_steps=20, progress=False)
    # tolerance 0 and a window of 2: stage 0 sets the reference, then the mixed policy must match it to advance.
    strategy = JSRL(horizon=200, n_stages=2, window=2, tolerance=0.0)
    returns_by_stage: dict[int, list[float]] = {}
    end = strategy.episode_end

    def counting(i, episode_return):
        returns_by_stage.setdefault(strategy.stage_, []).append(episode_return)
        end(i, episode_return)

    strategy.episode_end = counting
    algo.fit_online("Pendulum-v1", 1600, strategy=strategy, progress=False)
    prefixes = _guided_prefixes(algo, 8)
    stage_one = returns_by_stage.get(1, [])
    # Stage 0 lasts its window; in stage 1 (guide for 100 steps) each rolling window of two episodes below the
    # reference keeps h at 100, and the first window at or above it drops h to 0.
    assert prefixes[:2] == [200, 200] and set(prefixes[2:2 + len(stage_one)]) == {100}
    reference = np.mean(returns_by_stage[0][:2])
    windows = [np.mean(stage_one[i - 1:i + 1]) for i in range(1, len(stage_one))]
    assert all(w < reference for w in windows[:-1])
    if strategy.stage_ == 2:
        assert windows[-1] >= reference and set(prefixes[2 + len(stage_one):]) <= {0}
    else:
        assert all(w < reference for w in windows)


def test_jsrl_random_curriculum_draws_a_horizon_per_episode(pendulum_data):
    algo = IQL(**SMALL, random_state=0).fit(pendulum_data, n_steps=20, progress=False)
    drawn = []
    strategy = JSRL(horizon=200, curriculum="random")
    start = strategy.episode_start

    def recording(i):
        start(i)
        drawn.append(strategy.guide_horizon(i))

    strategy.episode_start = recording
    algo.fit_online("Pendulum-v1", 1000, strategy=strategy, progress=False)
    assert _guided_prefixes(algo, 5) == drawn[:5] and len(set(drawn[:5])) > 1


# ---------------------------------------------------------------------- E2O's optimism
def test_e2o_acts_by_the_ensembles_upper_confidence_bound(pendulum_data):
    algo = CQL(**SMALL, n_critics=4, n_action_samples=2, random_state=0).fit(pendulum_data, n_steps=5, progress=False)
    chosen_correctly, candidates_seen = [], []
    act = algo._online_act

    def sampling(obs, generator):
        actions, log_probs = act(obs, generator)
        with torch.no_grad():
            q = algo.critic_(algo.obs_normalizer_(obs), actions)
        candidates_seen.append((actions.clone(), (q.mean(0) + 2.0 * q.std(0)).clone()))
        return actions, log_probs

    algo._online_act = sampling
    algo.fit_online("Pendulum-v1", 60, strategy=E2O(n_candidates=6, ucb_lambda=2.0, n_critics=4), progress=False)
    stored = algo.replay_buffer_.columns["actions"][:60]
    for step, (actions, ucb) in enumerate(candidates_seen):
        assert len(actions) == 6  # six candidates for the one env
        chosen_correctly.append(torch.equal(stored[step], actions[ucb.argmax()]))
    assert all(chosen_correctly)


# ---------------------------------------------------------------------- checkpoints, model files, resume
@pytest.mark.parametrize("name", ["jsrl", "rlpd", "wsrl", "e2o", "calql"])
def test_resuming_mid_fine_tuning_gives_the_uninterrupted_run(pendulum_data, tmp_path, name):
    strategies = {"jsrl": lambda: JSRL(horizon=100, n_stages=2, window=1, tolerance=1e9),
                  "rlpd": lambda: RLPD(warmup_steps=50, utd_ratio=2, n_critics=4),
                  "wsrl": lambda: WSRL(warmup_steps=50, utd_ratio=2, batch_size=32, n_critics=4),
                  "e2o": lambda: E2O(n_candidates=3, n_critics=4), "calql": lambda: "calql"}
    algorithm = CalQL if name == "calql" else CQL

    def run(log_dir=None, resume=False, **kw):
        algo = algorithm(**SMALL, n_critics=2 if name in ("calql", "jsrl") else 4, n_action_samples=2,
                         random_state=3).fit(pendulum_data, n_steps=10, progress=False)
        return algo.fit_online("Pendulum-v1", 600, strategy=strategies[name](), offline_dataset=pendulum_data,
                               log_dir=log_dir, checkpoint_every=200 if log_dir else None, resume=resume,
                               progress=False, **kw)

    reference = run()
    run(tmp_path, callbacks=[lambda a, step, row: step < 400], eval_every=200, eval_env="Pendulum-v1",
        eval_episodes=1)
    resumed = run(tmp_path, resume=True, eval_every=200, eval_env="Pendulum-v1", eval_episodes=1)
    assert resumed.online_steps_done_ == 600 and resumed.online_updates_done_ == reference.online_updates_done_
    for key, value in _weights(reference).items():
        assert torch.equal(value, _weights(resumed)[key]), key
    for column, values in reference.replay_buffer_.columns.items():
        assert torch.equal(values, resumed.replay_buffer_.columns[column]), column
    assert resumed.online_strategy_ == reference.online_strategy_


def test_the_strategy_and_jsrls_guide_are_saved_with_the_model(pendulum_data, tmp_path):
    algo = IQL(**SMALL, random_state=0).fit(pendulum_data, n_steps=20, progress=False)
    algo.fit_online("Pendulum-v1", 400, strategy=JSRL(horizon=100, window=1, tolerance=1e9), progress=False)
    algo.save(tmp_path / "model.pt")
    loaded = offrl.load(tmp_path / "model.pt")
    assert loaded.online_strategy_ == algo.online_strategy_
    assert loaded.online_strategy_["name"] == "jsrl" and loaded.online_strategy_["state"]["stage"] == 2
    assert loaded.online_strategy_["params"]["horizon"] == 100
    for key, value in algo.online_guide_policy_.state_dict().items():
        assert torch.equal(value, loaded.online_guide_policy_.state_dict()[key]), key
    obs = pendulum_data.observations[:16]
    np.testing.assert_array_equal(loaded.predict(obs), algo.predict(obs))
    # Fine-tuning again with another recipe drops the old guide.
    loaded.fit_online("Pendulum-v1", 20, progress=False)
    assert not hasattr(loaded, "online_guide_policy_") and loaded.online_strategy_["name"] == "naive"


def test_a_new_strategy_is_a_few_lines(pendulum_data):
    class QuarterOffline(OnlineStrategy):
        """A quarter of each batch from the offline data, two updates per step."""

        name = "quarter-offline"

        def __init__(self) -> None:
            super().__init__(offline_fraction=0.25, utd_ratio=2)

    algo = IQL(**SMALL, random_state=0).fit(pendulum_data, n_steps=5, progress=False)
    calls = _record_updates(algo)
    algo.fit_online("Pendulum-v1", 100, strategy=QuarterOffline(), offline_dataset=pendulum_data, progress=False)
    assert len(calls) == 200 and {c["offline"] for c in calls} == {8}
    assert algo.online_strategy_["name"] == "quarter-offline"
