"""`offrl datasets label`: OTR, inverse-dynamics and reward-model labelling of saved datasets, in process.

Each labelled file must hold exactly what the labeller gives when run by hand on the same data (so the options
reach it), keep the labels it was given, and record the labeller in metadata["transforms"].  Every refusal is
exit status 2 with one line naming the option, and writes nothing.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import pytest

from conftest import make_episodes, run_cli as run
from offrl.cli import build_parser, main
from offrl.datasets import Dataset
from offrl.reward_labeling import InverseDynamicsLabeler, OTRewardLabeler, RewardModelLabeler

pytestmark = pytest.mark.usefixtures("one_thread")

# Few training steps: the tests check what the command writes, not how well the models learn.
FAST = ["--n-steps", "30", "--random-state", "0"]


def small_dataset(lengths: tuple[int, ...], seed: int) -> Dataset:
    """Episodes whose actions follow from (s, s') and whose rewards from (s, a), so the labellers' models learn.

    With learnable labels the validation loss keeps falling for many steps, so `--n-steps` changes the result
    (on pure noise, early stopping ends every run at the same step and would hide a lost option).
    """
    episodes = make_episodes(lengths, seed=seed)
    for ep in episodes:
        obs, actions = ep["observations"], ep["actions"]
        for t in range(len(actions)):
            obs[t + 1] = obs[t] + 0.5 * np.array([1.0, -1.0, 0.5], np.float32) * actions[t, 0]
        ep["rewards"] = (np.sin(obs[:-1, 0]) - actions[:, 0] ** 2).astype(np.float32)
    return Dataset.from_episodes(episodes, action_low=-1.0, action_high=1.0, metadata={"name": f"toy-{seed}"})


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """Saved .npz datasets: a fully labelled one, its expert, and copies missing some actions or rewards."""
    data = small_dataset((60, 45, 75, 30), seed=0)
    expert = small_dataset((20, 18, 22), seed=1)
    actions_kept = np.repeat([True, True, False, False], data.episode_lengths())  # whole episodes, as SS-ORL
    rewards_kept = np.random.default_rng(2).random(data.n_transitions) < 0.5
    paths = {"data": tmp_path / "data.npz", "expert": tmp_path / "expert.npz",
             "no_actions": tmp_path / "no_actions.npz", "no_rewards": tmp_path / "no_rewards.npz"}
    data.save(paths["data"])
    expert.save(paths["expert"])
    data.without_actions(keep=actions_kept).save(paths["no_actions"])
    data.without_rewards(keep=rewards_kept).save(paths["no_rewards"])
    return paths


@pytest.mark.parametrize("options, params", [
    (["--n-demonstrations", "1", "--epsilon", "0.05"], {"n_demonstrations": 1, "epsilon": 0.05}),
    (["--top-k", "2"], {"top_k": 2}),
], ids=["n-demonstrations-epsilon", "top-k"])
def test_otr_writes_the_labellers_rewards(files, tmp_path, capsys, options, params):
    out = tmp_path / "otr.npz"
    code, stdout, err = run(["datasets", "label", str(files["data"]), "--otr", str(files["expert"]), *options,
                             "--out", str(out)], capsys)
    assert code == 0, err
    data, expert = Dataset.load(files["data"]), Dataset.load(files["expert"])
    expected = OTRewardLabeler(expert, **params).fit_transform(data)
    labelled = Dataset.load(out)
    np.testing.assert_array_equal(labelled.rewards, expected.rewards)
    assert not np.allclose(labelled.rewards, data.rewards)  # the rewards were replaced, not copied
    for column in ("observations", "actions", "next_observations", "terminals", "timeouts", "episode_starts"):
        np.testing.assert_array_equal(getattr(labelled, column), getattr(data, column), err_msg=column)
    record = labelled.metadata["transforms"][-1]
    assert record["transformer"] == "OTRewardLabeler" and record["labels"] == "rewards"
    n_demos = params.get("n_demonstrations", expert.n_episodes)
    assert record["n_demonstrations"] == n_demos
    assert stdout.count("\n") == 1
    assert stdout.startswith(f"labelled 210 rewards with OTRewardLabeler ({n_demos} demonstration")
    assert f"offrl.datasets.load({str(out)!r})" in stdout


def test_inverse_dynamics_fills_the_missing_actions(files, tmp_path, capsys):
    out = tmp_path / "id.npz"
    code, stdout, err = run(["datasets", "label", str(files["no_actions"]), "--inverse-dynamics", *FAST,
                             "--out", str(out)], capsys)
    assert code == 0, err
    masked = Dataset.load(files["no_actions"])
    labelled = Dataset.load(out)
    assert labelled.is_labelled("actions") and labelled.is_labelled("rewards")
    kept = masked.label_mask("actions")
    np.testing.assert_array_equal(labelled.actions[kept], masked.actions[kept])
    expected = InverseDynamicsLabeler(n_steps=30, random_state=0).fit_transform(masked)
    np.testing.assert_array_equal(labelled.actions, expected.actions)
    assert np.all(np.abs(labelled.actions) <= 1.0)  # clipped to the action bounds
    record = labelled.metadata["transforms"][-1]
    assert record["transformer"] == "InverseDynamicsLabeler" and record["labels"] == "actions"
    assert record["n_labelled"] == int((~kept).sum()) == 105
    assert stdout.startswith("labelled 105 actions with InverseDynamicsLabeler (trained on ")
    true_actions = Dataset.load(files["data"]).actions[~kept]
    # the model learned the dynamics: far closer than guessing the mean action of the labelled rows
    guess = np.abs(true_actions - masked.actions[kept].mean(axis=0)).mean()
    assert np.abs(labelled.actions[~kept] - true_actions).mean() < 0.5 * guess


def test_reward_model_fills_the_missing_rewards(files, tmp_path, capsys):
    out = tmp_path / "rm.npz"
    code, stdout, err = run(["datasets", "label", str(files["no_rewards"]), "--reward-model", *FAST,
                             "--out", str(out)], capsys)
    assert code == 0, err
    masked = Dataset.load(files["no_rewards"])
    labelled = Dataset.load(out)
    assert labelled.is_labelled("rewards")
    kept = masked.label_mask("rewards")
    np.testing.assert_array_equal(labelled.rewards[kept], masked.rewards[kept])
    expected = RewardModelLabeler(n_steps=30, random_state=0).fit_transform(masked)
    np.testing.assert_array_equal(labelled.rewards, expected.rewards)
    record = labelled.metadata["transforms"][-1]
    assert record["transformer"] == "RewardModelLabeler" and record["n_labelled"] == int((~kept).sum())
    assert stdout.startswith(f"labelled {int((~kept).sum())} rewards with RewardModelLabeler")
    true_rewards = Dataset.load(files["data"]).rewards[~kept]
    guess = np.abs(true_rewards - masked.rewards[kept].mean()).mean()
    assert np.abs(labelled.rewards[~kept] - true_rewards).mean() < 0.5 * guess


def test_label_fraction_hides_labels_of_a_fully_labelled_dataset_and_labels_them(files, tmp_path, capsys):
    out = tmp_path / "id-half.npz"
    code, stdout, err = run(["datasets", "label", str(files["data"]), "--inverse-dynamics", "--label-fraction",
                             "0.5", *FAST, "--out", str(out)], capsys)
    assert code == 0, err
    labelled = Dataset.load(out)
    expected = InverseDynamicsLabeler(n_steps=30, random_state=0, label_fraction=0.5).fit_transform(
        Dataset.load(files["data"]))
    np.testing.assert_array_equal(labelled.actions, expected.actions)
    record = labelled.metadata["transforms"][-1]
    assert record["label_fraction"] == 0.5 and 0 < record["n_labelled"] < labelled.n_transitions
    assert "label fraction 0.5" in stdout


def test_existing_out_needs_force(files, tmp_path, capsys):
    out = tmp_path / "taken.npz"
    out.write_bytes(b"old")
    argv = ["datasets", "label", str(files["no_rewards"]), "--reward-model", *FAST, "--out", str(out)]
    code, _, err = run(argv, capsys)
    assert code == 2 and "exists; pass --force" in err and out.read_bytes() == b"old"
    code, _, err = run([*argv, "--force"], capsys)
    assert code == 0, err
    assert Dataset.load(out).is_labelled("rewards")


BAD = [
    # (arguments after `offrl datasets label`, with {data} {expert} {tmp} placeholders; what the one line must say)
    ("{data} --otr {expert} --out {tmp}/out.csv", "must end in .npz"),
    ("{data} --otr {expert} --out {tmp}/folder.npz", "is a folder"),
    ("{data} --otr {expert} --inverse-dynamics --out {tmp}/out.npz",
     "argument --inverse-dynamics: not allowed with argument --otr"),
    ("{data} --out {tmp}/out.npz", "one of the arguments --otr --inverse-dynamics --reward-model is required"),
    ("{data} --otr {expert} --epsilon -1 --out {tmp}/out.npz",
     "--epsilon -1.0: OTRewardLabeler's epsilon must be a real number >= 0"),
    ("{data} --otr {expert} --top-k 0 --out {tmp}/out.npz", "--top-k 0: OTRewardLabeler's top_k must be an integer"),
    ("{data} --otr {expert} --top-k 4 --out {tmp}/out.npz", "top_k=4 exceeds the 3 expert demonstrations"),
    ("{data} --otr {expert} --n-demonstrations 5 --out {tmp}/out.npz", "n_demonstrations=5 but the expert data has"),
    ("{data} --reward-model --label-fraction 1.5 --out {tmp}/out.npz",
     "--label-fraction 1.5: RewardModelLabeler's label_fraction must be a real number in (0, 1]"),
    ("{data} --otr {expert} --random-state 0 --out {tmp}/out.npz",
     "--random-state applies to --inverse-dynamics and --reward-model, not --otr"),
    ("{data} --inverse-dynamics --epsilon 0.1 --out {tmp}/out.npz", "--epsilon applies to --otr, not --inverse-dynamics"),
    ("{data} --inverse-dynamics --out {tmp}/out.npz",
     "has all its actions, so --inverse-dynamics has none to label; pass --label-fraction"),
    ("{data} --otr {tmp}/missing.npz --out {tmp}/out.npz", "no dataset file at"),
    ("{data} --epsilon x --otr {expert} --out {tmp}/out.npz", "argument --epsilon: invalid float value: 'x'"),
]


@pytest.mark.parametrize("command, message", BAD, ids=[m for _, m in BAD])
def test_bad_arguments_exit_2_with_one_line_and_write_nothing(command, message, files, tmp_path, capsys):
    (tmp_path / "folder.npz").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = ["datasets", "label", *(part.format(data=files["data"], expert=files["expert"], tmp=tmp_path)
                                   for part in shlex.split(command))]
    code, stdout, err = run(argv, capsys)
    assert code == 2 and stdout == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("offrl datasets label: error: "), err
    assert message in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_convert_shares_the_npz_output_check(files, tmp_path, capsys):
    (tmp_path / "folder.npz").mkdir()
    code, _, err = run(["datasets", "convert", str(files["data"]), "--to", "npz", str(tmp_path / "folder.npz")],
                       capsys)
    assert code == 2 and err.startswith("offrl datasets convert: error: ") and "is a folder" in err


def test_help_ends_with_examples_that_parse(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["datasets", "label", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    examples = text[text.rindex("example"):].splitlines()[1:]
    assert len(examples) == 3 and all(line.startswith("  offrl datasets label ") for line in examples), text
    flags = set()
    for line in examples:
        args = build_parser().parse_args(shlex.split(line)[1:])
        assert args.func.__name__ == "_datasets_label" and args.out.endswith(".npz")
        flags |= {name for name in ("otr", "inverse_dynamics", "reward_model") if getattr(args, name)}
    assert flags == {"otr", "inverse_dynamics", "reward_model"}  # one example per labeller


def test_info_shows_what_a_labeller_did_and_no_score_in_its_units(tmp_path, capsys):
    """`datasets info` on a labelled file names the labeller and gives no normalised score for relabelled rewards
    (the reference scores are in the environment's rewards); on a reward-free file it says rewards are missing."""
    data = Dataset.from_episodes(make_episodes((6, 5, 7), obs_dim=3, act_dim=1, log_probs=False),
                                 metadata={"ref_min_score": -10.0, "ref_max_score": 10.0})
    data.save(tmp_path / "data.npz")
    data.without_rewards().save(tmp_path / "bare.npz")
    data.subset([0]).save(tmp_path / "expert.npz")
    assert main(["datasets", "label", str(tmp_path / "data.npz"), "--otr", str(tmp_path / "expert.npz"),
                 "--out", str(tmp_path / "otr.npz")]) == 0
    capsys.readouterr()
    assert main(["datasets", "info", str(tmp_path / "otr.npz")]) == 0
    out = capsys.readouterr().out
    assert "transforms            OTRewardLabeler (rewards)" in out
    assert "normalised score      n/a (rewards labelled by OTRewardLabeler)" in out
    assert main(["datasets", "info", str(tmp_path / "data.npz")]) == 0
    assert "normalised score      mean" in capsys.readouterr().out
    assert main(["datasets", "info", str(tmp_path / "bare.npz")]) == 0
    out = capsys.readouterr().out
    assert "missing rewards       18 of 18 rows" in out and "episode return        n/a (rewards missing)" in out
