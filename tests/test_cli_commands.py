"""`offrl train`, `offrl evaluate`, `offrl export` and `offrl datasets convert`, end to end on tiny data.

The commands run in process through `offrl.cli.main` (one subprocess checks the console script).  Every bad
argument must end in exit status 2 and one line on stderr that names the fix, never a traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import offrl
from conftest import assert_same_columns, pendulum_shaped_dataset, run_cli as run
from offrl.cli import _setting, build_parser, main
from offrl.datasets import Dataset, load

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")]

# Small networks and batches, so a few steps take a fraction of a second.
TINY = ["--set", "hidden_dims=[16,16]", "--set", "batch_size=16", "--no-progress"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pendulum-shaped transitions (env Pendulum-v1, reference scores) saved as .npz."""
    path = tmp_path_factory.mktemp("data") / "pendulum.npz"
    pendulum_shaped_dataset(n_episodes=4, length=50).save(path)
    return path


@pytest.fixture(scope="module")
def trained(data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(out folder, stdout) of one `offrl train iql` run with one evaluation at the end."""
    out = tmp_path_factory.mktemp("train") / "iql"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["train", "IQL", str(data), "--steps", "20", *TINY, "--eval-episodes", "1", "--eval-every", "20",
                     "--out", str(out)])
    assert code == 0
    return out, stdout.getvalue()


@pytest.fixture(scope="module")
def envless_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose training data names no environment and has no reference scores."""
    from offrl.algos import BC

    dataset = pendulum_shaped_dataset(n_episodes=2, length=10)
    for key in ("env_id", "ref_min_score", "ref_max_score"):
        dataset.metadata.pop(key)
    path = tmp_path_factory.mktemp("envless") / "model.pt"
    BC(hidden_dims=(8,), batch_size=8, random_state=0).fit(dataset, n_steps=2, progress=False).save(path)
    return path


# ---------------------------------------------------------------------- train

def test_train_writes_logs_checkpoint_and_a_model_that_loads(trained, data):
    out, stdout = trained
    for name in ("train.csv", "eval.csv", "checkpoint.pt", "model.pt", "train_config.json"):
        assert (out / name).is_file(), name
    model = offrl.load(out / "model.pt")
    assert type(model).__name__ == "IQL" and model.hidden_dims == [16, 16] and model.n_steps_done_ == 20
    assert model.random_state == 0
    assert model.predict(np.zeros(3)).shape == (1,)
    config = json.loads((out / "train_config.json").read_text())
    assert config["algorithm"] == "IQL" and config["steps"] == 20 and config["checkpoint_every"] == 2
    assert config["dataset"] == str(data.resolve()) and config["eval_env"] == "Pendulum-v1"
    evaluations = (out / "eval.csv").read_text().splitlines()
    assert evaluations[0].startswith("step,return_mean") and len(evaluations) == 2
    final = dict(zip(evaluations[0].split(","), map(float, evaluations[1].split(","))))
    assert final["step"] == 20
    # The summary gives the final evaluation (the dataset's env and reference scores) and the files.
    assert "training IQL on pendulum-toy for 20 steps, evaluating in Pendulum-v1" in stdout
    assert (f"final evaluation (step 20, 1 episode in Pendulum-v1): return {final['return_mean']:.2f} ± 0.00, "
            f"normalised score {final['normalized_score_mean']:.1f}") in stdout
    assert f"model       {out / 'model.pt'}" in stdout and f"offrl evaluate {out / 'model.pt'}" in stdout


def state_of(path: Path) -> dict[str, torch.Tensor]:
    model = offrl.load(path)
    return {f"{name}.{key}": value for name, module in model._state_objects().items()
            for key, value in module.state_dict().items()}


def test_resume_after_an_interruption_ends_with_the_weights_of_an_uninterrupted_run(data, tmp_path, capsys,
                                                                                     monkeypatch):
    from offrl.algos import base

    args = ["train", "iql", str(data), "--steps", "20", *TINY, "--set", "log_every=5", "--checkpoint-every", "5",
            "--eval-env", "none"]
    assert run([*args, "--out", str(tmp_path / "whole")], capsys)[0] == 0

    write_checkpoint = base.write_checkpoint

    def interrupted_after_step_10(path, estimator, generator, step, *rest, **kwargs):
        write_checkpoint(path, estimator, generator, step, *rest, **kwargs)
        if step == 10:
            raise KeyboardInterrupt

    monkeypatch.setattr(base, "write_checkpoint", interrupted_after_step_10)
    code, _, err = run([*args, "--out", str(tmp_path / "cut")], capsys)
    assert code == 130 and "interrupted" in err and "--resume" in err
    assert not (tmp_path / "cut" / "model.pt").exists()
    monkeypatch.undo()

    # Resuming with other hyper-parameters is refused before anything is touched.
    code, _, err = run([*args, "--set", "expectile=0.8", "--out", str(tmp_path / "cut"), "--resume"], capsys)
    assert code == 2 and "expectile=0.7, not 0.8" in err and "arguments it was started with" in err
    # Without --resume the interrupted run is not overwritten.
    code, _, err = run([*args, "--out", str(tmp_path / "cut")], capsys)
    assert code == 2 and "continue it with --resume" in err

    code, out, _ = run([*args, "--out", str(tmp_path / "cut"), "--resume"], capsys)
    assert code == 0 and "20 steps" in out
    whole, resumed = state_of(tmp_path / "whole" / "model.pt"), state_of(tmp_path / "cut" / "model.pt")
    assert whole.keys() == resumed.keys() and len(whole) > 4
    for key in whole:
        assert torch.equal(whole[key], resumed[key]), key
    assert (tmp_path / "whole" / "train.csv").read_text() == (tmp_path / "cut" / "train.csv").read_text()

    # --force starts over: the same seed gives the same weights again.
    assert run([*args, "--out", str(tmp_path / "cut"), "--force"], capsys)[0] == 0
    again = state_of(tmp_path / "cut" / "model.pt")
    assert all(torch.equal(whole[key], again[key]) for key in whole)


def test_preset_then_set_overrides_it_and_names_resolve_in_any_case(tmp_path, capsys):
    dataset = pendulum_shaped_dataset(n_episodes=2, length=10)
    dataset.metadata.update(name="antmaze-umaze-v2", env_id=None)
    dataset.save(tmp_path / "antmaze.npz")
    code, out, err = run(["train", "iql", str(tmp_path / "antmaze.npz"), "--steps", "2", *TINY, "--preset",
                          "--set", "temperature=5", "--set", "actor_lr=3e-4", "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err
    assert "IQL's preset for antmaze-umaze-v2: expectile=0.9" in out and "temperature" not in out.split("\n")[0]
    assert "no evaluation env" in out
    model = offrl.load(tmp_path / "run" / "model.pt")
    assert (model.expectile, model.temperature, model.reward_bias, model.actor_lr) == (0.9, 5, -1.0, 3e-4)
    assert not (tmp_path / "run" / "eval.csv").exists()

    code, _, err = run(["train", "td3+bc", str(tmp_path / "antmaze.npz"), "--steps", "1", *TINY, "--out",
                        str(tmp_path / "td3")], capsys)
    assert code == 0, err
    assert type(offrl.load(tmp_path / "td3" / "model.pt")).__name__ == "TD3PlusBC"


@pytest.mark.parametrize("text, parsed", [
    ("expectile=0.8", ("expectile", 0.8)), ("lr=3e-4", ("lr", 3e-4)), ("batch_size=64", ("batch_size", 64)),
    ("hidden_dims=[64, 64]", ("hidden_dims", [64, 64])),
    ("normalize_observations=false", ("normalize_observations", False)),
    ("reward_normalization=None", ("reward_normalization", None)), ("precision=bf16", ("precision", "bf16")),
])
def test_set_values_are_read_as_yaml(text, parsed):
    assert _setting(text) == parsed


# ---------------------------------------------------------------------- evaluate / export

def test_evaluate_prints_the_return_and_normalised_score(trained, capsys):
    out, _ = trained
    model_path = str(out / "model.pt")
    expected = offrl.load(model_path).evaluate("Pendulum-v1", n_episodes=2, seed=3)
    code, stdout, err = run(["evaluate", model_path, "--episodes", "2", "--seed", "3"], capsys)
    assert code == 0 and err == ""
    assert f"{model_path} in Pendulum-v1, 2 episodes (seeds 3..4)" in stdout
    assert f"return            {expected['return_mean']:.2f} ± {expected['return_std']:.2f}" in stdout
    assert f"normalised score  {expected['normalized_score_mean']:.1f}" in stdout

    code, stdout, _ = run(["evaluate", model_path, "--env", "Pendulum-v1", "--episodes", "2", "--seed", "3", "--json"],
                          capsys)
    row = json.loads(stdout)
    assert code == 0 and len(stdout.strip().splitlines()) == 1
    assert row["env"] == "Pendulum-v1" and row["returns"] == expected["returns"]
    assert row["normalized_score_mean"] == pytest.approx(expected["normalized_score_mean"])


def test_evaluate_without_reference_scores_says_so(envless_model, capsys):
    code, stdout, _ = run(["evaluate", str(envless_model), "--env", "Pendulum-v1", "--episodes", "1"], capsys)
    assert code == 0 and "normalised score  n/a" in stdout


def test_export_writes_torchscript_that_runs_without_offrl(trained, tmp_path, capsys):
    out, _ = trained
    target = tmp_path / "policy.ts"
    code, stdout, _ = run(["export", str(out / "model.pt"), str(target)], capsys)
    assert code == 0 and f"torch.jit.load({str(target)!r})" in stdout and "observations (n, 3)" in stdout
    policy = torch.jit.load(str(target))
    observations = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    expected = offrl.load(out / "model.pt").predict(observations)
    np.testing.assert_allclose(policy(torch.from_numpy(observations)).numpy(), expected, rtol=1e-5, atol=1e-6)

    code, _, err = run(["export", str(out / "model.pt"), str(target)], capsys)
    assert code == 2 and "--force" in err
    target.write_bytes(b"old")
    assert run(["export", str(out / "model.pt"), str(target), "--force"], capsys)[0] == 0
    assert torch.jit.load(str(target))(torch.zeros(1, 3)).shape == (1, 1)


# ---------------------------------------------------------------------- datasets convert

def test_convert_to_minari_and_npz_reads_back_equal(data, minari_dir, tmp_path, capsys):
    original = load(str(data))
    code, stdout, err = run(["datasets", "convert", str(data), "--to", "minari", "test/pendulum-v0"], capsys)
    assert code == 0, err
    assert "wrote Minari dataset test/pendulum-v0 (200 transitions, 4 episodes)" in stdout
    back = load("minari:test/pendulum-v0")
    assert_same_columns(original, back)
    assert back.metadata["env_id"] == "Pendulum-v1"
    assert (back.metadata["ref_min_score"], back.metadata["ref_max_score"]) == (-1500.0, -150.0)

    code, _, err = run(["datasets", "convert", str(data), "--to", "minari", "test/pendulum-v0"], capsys)
    assert code == 2 and "already exists" in err and "minari delete test/pendulum-v0" in err

    code, _, err = run(["datasets", "convert", "minari:test/pendulum-v0", "--to", "npz", str(tmp_path / "b.npz")],
                       capsys)
    assert code == 0, err
    assert_same_columns(original, Dataset.load(tmp_path / "b.npz"))


# ---------------------------------------------------------------------- bad arguments

BAD = [
    # (command line with {data} {run} {model} {envless} {tmp} placeholders, what the one line must say)
    ("train foo {data}", "unknown algorithm 'foo'; use one of BC, CQL, CalQL, DecisionTransformer, DiffusionQL, EDP, FDVL, "
     "FQL, IQL, MBRCSL, OFQL, ReCOIL, RvS, TD3PlusBC, XQL"),
    ("train iql {tmp}/missing.npz", "no dataset file at"),
    ("train iql {tmp}/data.txt", "use 'd4rl:<name>', 'minari:<dataset id>'"),
    ("train iql {data} --set expectile=1.5", "IQL's expectile must be a real number in (0, 1)"),
    ("train iql {data} --set batch_size=2.5", "batch_size must be an integer >= 1"),
    ("train iql {data} --set expectile=1" + "0" * 400, "expectile must be a real number in (0, 1)"),  # was OverflowError
    ("train iql {data} --set expectiles=0.8", "no hyper-parameter 'expectiles'; valid ones: actor_lr"),
    ("train iql {data} --set expectile", "takes KEY=VALUE"),
    ("train iql {data} --set n_steps=10", "n_steps is set with --steps"),
    ("train iql {data} --set hidden_dims=[3,", "not valid YAML"),
    ("train iql {data} --set expectile=0.8 --set expectile=0.9", "given twice"),
    ("train iql {data} --eval-env Nope-v0", "not a registered gymnasium environment"),
    ("train iql {data} --eval-env CartPole-v1", "--eval-env must be the env the data comes from"),
    ("train iql {data} --out {run}", "continue it with --resume, start over with --force"),
    ("train iql {data} --out {run} --resume --force", "give one of them"),
    ("train iql {data} --steps 0", "must be an integer >= 1, got 0"),
    ("train iql {data} --device gpu", "must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"),
    ("train iql {data} --bogus", "unrecognized arguments: --bogus"),
    ("train iql", "the following arguments are required: dataset"),
    ("evaluate {tmp}/missing.pt", "no model file at"),
    ("evaluate {tmp}/damaged.pt", "not a readable offrl model file"),
    ("evaluate {run}", "pass the model file in it"),
    ("evaluate {model} --env Nope-v0", "not a registered gymnasium environment"),
    ("evaluate {model} --env CartPole-v1", "pass --env with the env the model was trained for (Pendulum-v1)"),
    ("evaluate {envless}", "names no environment"),
    ("evaluate {model} --episodes 0", "must be an integer >= 1"),
    ("export {tmp}/missing.pt {tmp}/policy.ts", "no model file at"),
    ("export {tmp}/damaged.pt {tmp}/policy.ts", "not a readable offrl model file"),
    ("export {model} {model}", "exists; pass --force"),
    ("export {model} {tmp}", "is a folder; give a file name"),
    ("datasets convert {data} --to parquet x", "invalid choice: 'parquet'"),
    ("datasets convert {data} --to minari nover", "must look like [namespace/]name-v<N>"),
    ("datasets convert {data} --to minari ../up-v0", "no '..'"),
    ("datasets convert {data} --to minari test/x-v0 --env Nope-v0", "not a registered gymnasium environment"),
    ("datasets convert {data} --to minari test/x-v0 --env CartPole-v1", "3-d observations but CartPole-v1's have"),
    ("datasets convert {data} --to npz {tmp}/out.csv", "must end in .npz"),
    ("datasets convert {data} --to npz {data}", "exists; pass --force"),
    ("datasets convert {tmp}/missing.npz --to npz {tmp}/out.npz", "no dataset file at"),
]


@pytest.mark.parametrize("command, message", BAD, ids=[c for c, _ in BAD])
def test_bad_arguments_exit_2_with_one_line_naming_the_fix(command, message, data, trained, envless_model, tmp_path,
                                                         minari_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a default --out would go
    out, _ = trained
    raw = (out / "model.pt").read_bytes()
    (tmp_path / "damaged.pt").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "data.txt").write_text("not a dataset")
    argv = [part.format(data=data, run=out, model=out / "model.pt", envless=envless_model, tmp=tmp_path)
            for part in shlex.split(command)]
    before = sorted(os.listdir(out))
    code, _, err = run(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    name = " ".join(argv[:2]) if argv[0] == "datasets" else argv[0]
    assert len(lines) == 1 and lines[0].startswith(f"offrl {name}: error: "), err
    assert message in lines[0] and "Traceback" not in err
    assert sorted(os.listdir(out)) == before  # a refused command touched nothing of the run


@pytest.mark.parametrize("command", ["train", "evaluate", "export", "datasets convert", "datasets info", "datasets label",
                                     "datasets build", "datasets list", "quickstart", "sweep", "report", "ope"])
def test_help_ends_with_an_example_that_parses(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command.split(), "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    examples = text[text.rindex("example"):].splitlines()[1:]
    assert examples and all(f"{line} ".startswith(f"  offrl {command} ") for line in examples), text
    for line in examples:  # every example is a valid command line
        args = build_parser().parse_args(shlex.split(line)[1:])
        assert args.func is not None


def test_console_script_reports_a_bad_argument_in_one_line(tmp_path):
    script = shutil.which("offrl", path=str(Path(sys.executable).parent)) or shutil.which("offrl")
    assert script is not None, "the offrl console script is not installed (pip install -e .)"
    proc = subprocess.run([script, "evaluate", str(tmp_path / "missing.pt")], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"offrl evaluate: error: no model file at {tmp_path / 'missing.pt'}; save one with estimator.save(path)"]
