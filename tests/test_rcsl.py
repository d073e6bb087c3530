"""Return-conditioned supervised learning (RvS, Decision Transformer): the commands RvS learns from, DT's padding
mask and per-episode context, the target-return option of predict / make_actor / evaluate, and save, load, clone,
export, determinism and bf16 on tiny networks."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import sklearn.base
import torch

import offrl
from offrl.algos import BC, DecisionTransformer, RvS
from offrl.algos.rcsl import best_complete_episode, masked_action_loss, rvs_commands
from offrl.datasets import Dataset

from conftest import make_episodes, pendulum_shaped_dataset

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_DT = dict(context_length=20, embed_dim=16, n_layers=2, n_heads=2, batch_size=8, warmup_steps=5, device="cpu")
TINY_RVS = dict(hidden_dims=(32, 32), batch_size=32, device="cpu")


@pytest.fixture(scope="module")
def pendulum() -> Dataset:
    return pendulum_shaped_dataset(n_episodes=4, length=30)


@pytest.fixture(scope="module")
def fitted_dt(pendulum) -> DecisionTransformer:
    return DecisionTransformer(**TINY_DT, random_state=0).fit(pendulum, n_steps=20, progress=False)


@pytest.fixture(scope="module")
def fitted_rvs(pendulum) -> RvS:
    return RvS(**TINY_RVS, random_state=0).fit(pendulum, n_steps=20, progress=False)


def two_episodes() -> Dataset:
    """Episode 0: rewards 1, 2, 3; episode 1: rewards 4, 5."""
    episodes = make_episodes((3, 2), obs_dim=2, act_dim=1, log_probs=False)
    episodes[0]["rewards"] = np.array([1.0, 2.0, 3.0], np.float32)
    episodes[1]["rewards"] = np.array([4.0, 5.0], np.float32)
    return Dataset.from_episodes(episodes, action_low=-1.0, action_high=1.0)


def state_of(algo) -> dict[str, torch.Tensor]:
    return {f"{name}.{k}": v.clone() for name, module in algo._state_objects().items()
            for k, v in module.state_dict().items()}


# ---------------------------------------------------------------------------------------------- RvS commands


def test_rvs_commands_of_each_conditioning_on_a_hand_made_dataset():
    ds = two_episodes()  # returns to go 6, 5, 3 | 9, 5; the longest episode has H = 3 steps
    scale = 0.5
    np.testing.assert_allclose(rvs_commands(ds, "rtg", scale, 3)[:, 0], [3.0, 2.5, 1.5, 4.5, 2.5])
    # RvS's average reward to go G_t / (H - t), times H * scale: 6/3, 5/2, 3/1 | 9/3, 5/2 (x 1.5); the shorter second
    # episode divides by H - t too, not by its own remaining steps (RvS's reward_to_go in its dataset.py)
    np.testing.assert_allclose(rvs_commands(ds, "avg_rtg", scale, 3)[:, 0], [3.0, 3.75, 4.5, 4.5, 3.75])
    udrl = rvs_commands(ds, "udrl", scale, 3)
    np.testing.assert_allclose(udrl[:, 0], [3.0, 2.5, 1.5, 4.5, 2.5])
    np.testing.assert_allclose(udrl[:, 1], [3 / 3, 2 / 3, 1 / 3, 2 / 3, 1 / 3])  # remaining steps / H

    for conditioning in ("rtg", "avg_rtg", "udrl"):  # fit learns from exactly these, with H from the dataset
        algo = RvS(conditioning=conditioning, return_scale=scale, **TINY_RVS, random_state=0).fit(ds, n_steps=1,
                                                                                                    progress=False)
        assert algo.spec_["horizon"] == 3 and algo.spec_["target_return"] == 9.0 and algo.spec_["target_horizon"] == 2
        sampler = algo._make_sampler(ds)
        batch = sampler.gather(torch.arange(len(ds)))
        np.testing.assert_allclose(batch.extras["commands"].numpy(), rvs_commands(ds, conditioning, scale, 3))


def test_rvs_actor_counts_the_return_down_except_for_the_average_target():
    ds = two_episodes()
    for conditioning, expected in [("rtg", [[4.5], [2.5]]), ("avg_rtg", [[4.5], [4.5]]),
                                   ("udrl", [[4.5, 2 / 3], [2.5, 1 / 3]])]:
        algo = RvS(conditioning=conditioning, return_scale=0.5, **TINY_RVS, random_state=0).fit(ds, n_steps=1,
                                                                                                  progress=False)
        actor = algo.make_actor()
        actor.reset(1)
        commands = []
        for t, reward in enumerate([4.0, 5.0]):
            commands.append(algo._commands(actor.remaining, actor.targets, np.array([t])).numpy()[0])
            actor.act(ds.observations[3 + t][None], np.array([t]))
            actor.observe(np.array([reward]), np.array([t == 1]))
        np.testing.assert_allclose(commands, expected, rtol=1e-6)
        assert actor.remaining[0] == 9.0  # the episode ended: back to the target


# ---------------------------------------------------------------------------------------------- DT padding


def test_dt_loss_on_a_left_padded_batch_equals_the_loss_on_the_unpadded_episodes():
    ds = Dataset.from_episodes(make_episodes((4, 7), obs_dim=3, act_dim=2, log_probs=False),
                               action_low=-1.0, action_high=1.0)
    algo = DecisionTransformer(**{**TINY_DT, "dropout": 0.0}, random_state=0).fit(ds, n_steps=3, progress=False)
    sampler = algo._make_sampler(ds)
    batch = sampler.gather(torch.as_tensor(ds.episode_starts[:-1]))  # each whole episode, left-padded to 20
    assert batch.mask.sum(1).tolist() == [4, 7] and not batch.mask[:, :13].any()
    # Garbage in the padding must change nothing.
    pad = ~batch.mask
    batch.observations[pad] = 1e3
    batch.actions[pad] = 0.9
    batch.returns_to_go[pad] = -50.0
    batch.timesteps[pad] = 999
    with torch.no_grad():
        padded_loss = algo._loss_eager(batch.observations, batch.actions, batch.returns_to_go, batch.timesteps,
                                       batch.mask)
        policy = algo.policy_
        unit = policy.to_unit(batch.actions)
        padded_pred = policy(batch.observations, unit, batch.returns_to_go, batch.timesteps, batch.mask)
        squared, count = 0.0, 0
        for row, length in enumerate([4, 7]):
            real = slice(20 - length, 20)
            pred = policy(batch.observations[row:row + 1, real], unit[row:row + 1, real],
                          batch.returns_to_go[row:row + 1, real], batch.timesteps[row:row + 1, real],
                          torch.ones(1, length, dtype=torch.bool))
            torch.testing.assert_close(padded_pred[row:row + 1, real], pred, rtol=1e-5, atol=1e-6)
            squared += float(((pred - unit[row:row + 1, real]) ** 2).sum())
            count += length * 2
    assert float(padded_loss) == pytest.approx(squared / count, rel=1e-5)
    assert float(masked_action_loss(padded_pred, unit, batch.mask)) == pytest.approx(squared / count, rel=1e-5)


def test_dt_actor_context_is_reset_between_episodes(fitted_dt, pendulum):
    actor = fitted_dt.make_actor()
    actor.reset(1)
    first_obs = pendulum.observations[:1]
    first = actor.act(first_obs, np.array([0]))
    assert actor.context_lengths.tolist() == [1]
    np.testing.assert_allclose(first, fitted_dt.predict(first_obs), rtol=1e-5, atol=1e-6)  # predict = a first step
    for t in range(1, 25):  # longer than the context, which then stays at its length
        actor.observe(np.array([-3.0]), np.array([False]))
        mid = actor.act(pendulum.observations[t:t + 1], np.array([t]))
    assert actor.context_lengths.tolist() == [20]
    actor.observe(np.array([-3.0]), np.array([False]))
    same_obs_mid_episode = actor.act(first_obs, np.array([25]))
    assert not np.allclose(same_obs_mid_episode, first)  # the context matters mid-episode
    actor.observe(np.array([-1.0]), np.array([True]))
    assert actor.context_lengths.tolist() == [0]
    again = actor.act(first_obs, np.array([0]))
    assert actor.context_lengths.tolist() == [1]
    np.testing.assert_array_equal(again, first)
    assert mid.shape == first.shape == (1, 1)


def test_dt_actor_resets_only_the_env_whose_episode_ended(fitted_dt, pendulum):
    actor = fitted_dt.make_actor()
    actor.reset(2)
    obs = pendulum.observations[:2]
    first = actor.act(obs, np.array([0, 0]))
    actor.observe(np.array([-2.0, -2.0]), np.array([False, True]))
    actor.act(pendulum.observations[2:4], np.array([1, 0]))
    assert actor.context_lengths.tolist() == [2, 1]
    single = fitted_dt.make_actor()
    single.reset(1)
    np.testing.assert_allclose(first[1:], single.act(obs[1:], np.array([0])), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"reset for 1 envs but got 2 observations"):
        single.act(obs, np.array([0, 0]))


# ---------------------------------------------------------------------------------------------- target return


def cut_log() -> Dataset:
    """Costs, as in Pendulum: two whole 4-step episodes (returns -8, -6), one that terminated after 2 steps
    (-5) and the log's last, partial episode cut after 1 step (-1: the highest return, but not comparable)."""
    episodes = make_episodes((4, 4, 2, 1), obs_dim=2, act_dim=1, terminal=(False, False, True, False),
                             log_probs=False)
    for ep, reward in zip(episodes, (-2.0, -1.5, -2.5, -1.0)):
        ep["rewards"] = np.full(len(ep["actions"]), reward, np.float32)
    return Dataset.from_episodes(episodes, action_low=-1.0, action_high=1.0)


def test_default_target_skips_an_episode_cut_short_by_the_end_of_the_log():
    ds = cut_log()
    np.testing.assert_allclose(ds.episode_returns(), [-8.0, -6.0, -5.0, -1.0])
    assert best_complete_episode(ds) == 2  # a termination completes an episode of any length
    no_terminal = Dataset.from_episodes(make_episodes((4, 4, 2, 1), terminal=(False,) * 4, log_probs=False))
    no_terminal = no_terminal.with_rewards(np.repeat([-2.0, -1.5, -2.5, -1.0], [4, 4, 2, 1]))
    assert best_complete_episode(no_terminal) == 1  # only the longest-length episodes count
    windows = Dataset.from_episodes(make_episodes((3, 3), terminal=(False, False), log_probs=False))
    assert best_complete_episode(windows) == int(np.argmax(windows.episode_returns()))  # all complete
    for algo in (RvS(**TINY_RVS, random_state=0), DecisionTransformer(**TINY_DT, random_state=0)):
        algo.fit(ds, n_steps=1, progress=False)
        assert algo.spec_["target_return"] == -5.0 and algo.spec_["target_horizon"] == 2


@pytest.mark.parametrize("name", ["fitted_rvs", "fitted_dt"])
def test_target_return_defaults_to_the_best_dataset_return_and_changes_the_action(name, pendulum, request):
    algo = request.getfixturevalue(name)
    best = float(pendulum.episode_returns().max())
    assert algo.spec_["target_return"] == pytest.approx(best)
    obs = pendulum.observations[:5]
    np.testing.assert_array_equal(algo.predict(obs), algo.predict(obs, target_return=best))
    assert not np.allclose(algo.predict(obs, target_return=0.0), algo.predict(obs, target_return=-3000.0))
    per_row = algo.predict(obs, target_return=np.array([0.0, 0.0, -3000.0, -3000.0, 0.0]))
    np.testing.assert_allclose(per_row[:2], algo.predict(obs[:2], target_return=0.0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="target_return must be a number or one per observation"):
        algo.predict(obs, target_return=[1.0, 2.0])
    with pytest.raises(ValueError, match="target_return must be finite"):
        algo.make_actor(target_return=float("nan"))


def test_unknown_predict_options_raise_type_error(fitted_dt, pendulum):
    bc = BC(hidden_dims=(8,), batch_size=8, device="cpu", random_state=0).fit(pendulum, n_steps=1, progress=False)
    obs = pendulum.observations[:2]
    with pytest.raises(TypeError, match=r"BC.predict got unknown option\(s\) \['target_return'\]; it takes no options"):
        bc.predict(obs, target_return=0.0)
    with pytest.raises(TypeError, match="BC.make_actor takes no options"):
        bc.evaluate("Pendulum-v1", n_episodes=1, target_return=0.0)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['horizon'\]; it takes target_return"):
        fitted_dt.predict(obs, horizon=3)
    with pytest.raises(TypeError):
        fitted_dt.make_actor(target_horizon=3)
    assert bc.predict(obs).shape == (2, 1)  # no options: as before


# ---------------------------------------------------------------------------------------------- evaluation


def test_evaluate_on_pendulum_with_a_target_return(fitted_dt, fitted_rvs):
    for algo in (fitted_dt, fitted_rvs):
        result = algo.evaluate("Pendulum-v1", n_episodes=2, target_return=-200.0)
        assert result["n_episodes"] == 2 and result["length_mean"] == 200
        assert np.isfinite(result["return_mean"]) and "normalized_score_mean" in result
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("Pendulum-v1", max_episode_steps=30)] * 2)
    result = fitted_dt.evaluate(envs, n_episodes=4)
    assert result["n_episodes"] == 4 and result["length_mean"] == 30


# ---------------------------------------------------------------------------------------------- lifecycle


@pytest.mark.parametrize("name", ["fitted_rvs", "fitted_dt"])
def test_save_load_and_clone(name, pendulum, tmp_path, request):
    algo = request.getfixturevalue(name)
    algo.save(tmp_path / "model.pt")
    loaded = offrl.load(tmp_path / "model.pt")
    obs = pendulum.observations[:10]
    np.testing.assert_array_equal(loaded.predict(obs), algo.predict(obs))
    np.testing.assert_array_equal(loaded.predict(obs, target_return=-10.0), algo.predict(obs, target_return=-10.0))
    a, b = algo.make_actor(), loaded.make_actor()
    a.reset(1)
    b.reset(1)
    for t in range(5):
        np.testing.assert_array_equal(a.act(obs[t:t + 1], np.array([t])), b.act(obs[t:t + 1], np.array([t])))
        a.observe(np.array([-1.0]), np.array([False]))
        b.observe(np.array([-1.0]), np.array([False]))
    clone = sklearn.base.clone(algo)
    assert clone.get_params() == algo.get_params() and not hasattr(clone, "spec_")


@pytest.mark.parametrize("cls, params", [(RvS, {**TINY_RVS, "dropout": 0.1}), (DecisionTransformer, TINY_DT)],
                         ids=["RvS", "DecisionTransformer"])
def test_same_random_state_gives_identical_parameters(cls, params, pendulum):
    a = cls(**params, random_state=3).fit(pendulum, n_steps=8, progress=False)
    b = cls(**params, random_state=3).fit(pendulum, n_steps=8, progress=False)
    c = cls(**params, random_state=4).fit(pendulum, n_steps=8, progress=False)
    sa, sb, sc = state_of(a), state_of(b), state_of(c)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_dt_resume_from_a_checkpoint_repeats_the_uninterrupted_run(pendulum, tmp_path):
    full = DecisionTransformer(**TINY_DT, random_state=0).fit(pendulum, n_steps=12, progress=False)
    log_dir = tmp_path / "run"
    DecisionTransformer(**TINY_DT, random_state=0).fit(pendulum, n_steps=12, log_dir=log_dir, checkpoint_every=6,
                                                       log_every=6, progress=False,
                                                       callbacks=[lambda algo, step, metrics: step < 6])
    resumed = DecisionTransformer(**TINY_DT, random_state=0).fit(pendulum, n_steps=12, log_dir=log_dir,
                                                                 checkpoint_every=6, log_every=6, resume=True,
                                                                 progress=False)
    a, b = state_of(full), state_of(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dt_warm_up_raises_the_learning_rate_linearly(pendulum):
    algo = DecisionTransformer(**{**TINY_DT, "warmup_steps": 4}, lr=1e-3, random_state=0).fit(pendulum, n_steps=2,
                                                                                            progress=False)
    assert algo.optimizer_.param_groups[0]["lr"] == pytest.approx(2 / 4 * 1e-3)
    algo.fit(pendulum, n_steps=6, progress=False)
    assert algo.optimizer_.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert isinstance(algo.optimizer_, torch.optim.AdamW) and algo.optimizer_.param_groups[0]["weight_decay"] == 1e-4


@pytest.mark.parametrize("cls, params", [(RvS, TINY_RVS), (DecisionTransformer, TINY_DT)],
                         ids=["RvS", "DecisionTransformer"])
def test_bf16_fit_runs_with_fp32_weights(cls, params, pendulum):
    algo = cls(**params, precision="bf16", random_state=0).fit(pendulum, n_steps=5, progress=False)
    assert all(np.isfinite(v) for v in algo.last_metrics_.values())
    assert all(p.dtype == torch.float32 for p in algo.policy_.parameters())
    actions = algo.predict(pendulum.observations[:4])
    assert actions.dtype == np.float32 and np.all(np.abs(actions) <= 2.0)


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
def test_export_rvs_with_a_fixed_command_and_refuse_dt(fitted_rvs, fitted_dt, pendulum, tmp_path):
    fitted_rvs.export_policy(tmp_path / "rvs.pt", target_return=-300.0)
    scripted = torch.jit.load(str(tmp_path / "rvs.pt"))
    obs = pendulum.observations[:7]
    np.testing.assert_allclose(scripted(torch.as_tensor(obs)).numpy(), fitted_rvs.predict(obs, target_return=-300.0),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="cannot carry"):
        fitted_dt.export_policy(tmp_path / "dt.pt")
    assert not (tmp_path / "dt.pt").exists()


def test_dt_refuses_heads_that_do_not_divide_the_width(pendulum):
    with pytest.raises(ValueError, match="multiple of n_heads"):
        DecisionTransformer(**{**TINY_DT, "embed_dim": 10, "n_heads": 3}).fit(pendulum, n_steps=1, progress=False)
