"""Experiments as files: spec parsing and merging, the Atari-57 specs against benchmark/atari57.sh,
the Optuna worker's hand-back and replay, and one real search with pruning and its report, end to
end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from helpers import launch
from optuna.trial import TrialState

from cleanba_utils.experiments import search, spec
from cleanba_utils.experiments.hns import reference_scores

REPO = Path(__file__).resolve().parents[1]
VALID = """
command = "python train.py --total-timesteps 1000"
env_ids = ["CartPole-v1"]
num_seeds = 2

[space]
"--learning-rate" = {loguniform = [1e-4, 1e-2]}
"--clip-coef" = [0.1, 0.2]
"--update-epochs" = {int = [1, 4]}

[search]
method = "tpe"
budget = 3
report_every = 500

[thresholds]
"CartPole-v1" = 475
"""


def write(tmp_path, text, name="exp.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_spec_is_parsed_into_launcher_options(tmp_path):
    options, analysis = spec.load(write(tmp_path, VALID))
    assert options["experiment"] == "exp"  # the file name, when the spec has no experiment key
    assert options["command"] == "python train.py --total-timesteps 1000" and options[
        "env_ids"
    ] == ["CartPole-v1"]
    assert options["num_seeds"] == 2 and options["search"] == "tpe" and options["budget"] == 3
    assert options["sweep"] == [
        ("--learning-rate", ("loguniform", 1e-4, 1e-2)),
        ("--clip-coef", ["0.1", "0.2"]),
        ("--update-epochs", ("int", 1.0, 4.0)),
    ]
    assert analysis == {"thresholds": {"CartPole-v1": 475.0}}
    atari, _ = spec.load(
        write(tmp_path, 'command = "python x.py"\nenv_ids = "atari57"\n', "atari.toml")
    )
    assert atari["env_ids"] == list(reference_scores()) and len(atari["env_ids"]) == 57


def test_folder_copy_gives_the_same_options(tmp_path):
    """The spec that the experiment folder keeps, the command line's options merged in, loads back
    to them."""
    options, analysis = spec.load(write(tmp_path, VALID))
    merged = spec.merge(options, {"workers": 2, "sweep": [("--ent-coef", ["0", "0.01"])]})
    copy = write(tmp_path, spec.dumps(merged, analysis), "copy.toml")
    assert spec.load(copy) == ({**merged, "experiment": "exp"}, analysis)


def test_flags_fill_the_spec_and_a_clash_is_refused(tmp_path):
    options, _ = spec.load(write(tmp_path, VALID))
    merged = spec.merge(
        options, {"workers": 4, "experiment": "renamed", "sweep": [("--ent-coef", ["0"])]}
    )
    assert merged["workers"] == 4 and merged["experiment"] == "renamed" and merged["budget"] == 3
    assert [flag for flag, _ in merged["sweep"]] == [
        "--learning-rate",
        "--clip-coef",
        "--update-epochs",
        "--ent-coef",
    ]
    with pytest.raises(ValueError, match="--budget is also set in the spec"):
        spec.merge(options, {"budget": 5})
    with pytest.raises(ValueError, match="--sweep --clip-coef is also in the spec"):
        spec.merge(options, {"sweep": [("--clip-coef", ["0.3"])]})


@pytest.mark.parametrize(
    "text, message",
    [
        ("learning_rate = 1\n" + VALID, "unknown key 'learning_rate'"),
        (
            VALID.replace("budget = 3", "budget = 3\nworkers = 2"),
            "unknown key 'workers' in [search]",
        ),
        ('command = "python x.py"\nenv_ids = ["A"]\n[space]\n', "[space] is empty"),
        ('command = "x"\nenv_ids = ["A"]\n[space]\n"--lr" = []\n', "non-empty list"),
        ('command = "x"\nenv_ids = ["A"]\n[space]\n"--lr" = {uniform = [2, 1]}\n', "LOW < HIGH"),
        ('command = "x"\nenv_ids = ["A"]\n[space]\n"--lr" = {loguniform = [0, 1]}\n', "LOW > 0"),
        ('command = "x"\nenv_ids = ["A"]\n[space]\n"--n" = {int = [1, 2.5]}\n', "(integers)"),
        ('command = "x"\nenv_ids = ["A"]\n[space]\n"--lr" = {normal = [0, 1]}\n', "one range"),
        ('command = "x"\nenv_ids = []\n', "non-empty list of environment ids"),
        ('command = "x"\nenv_ids = ["A"]\nnum_seeds = 0\n', "num_seeds must be a positive integer"),
        ('command = 3\nenv_ids = ["A"]\n', "command must be a str"),
        (
            'command = "x"\nenv_ids = ["A"]\n[search]\nbudget = "2"\n',
            "search.budget must be a positive integer",
        ),
        ("command = \n", "is not valid TOML"),
    ],
)
def test_bad_spec_is_refused_with_one_line(tmp_path, text, message):
    with pytest.raises(ValueError) as error:
        spec.load(write(tmp_path, text))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_bad_spec_at_the_command_line_is_one_line_and_exit_2(tmp_path):
    result = launch(
        tmp_path, "--spec", str(write(tmp_path, '[space]\n"--lr" = {uniform = [2, 1]}\n'))
    )
    assert (
        result.returncode == 2 and result.stderr.count("\n") == 1 and "LOW < HIGH" in result.stderr
    )
    missing = launch(tmp_path, "--spec", str(tmp_path / "missing.toml"))
    assert missing.returncode == 2 and "cannot read the spec" in missing.stderr


def test_spec_and_flags_clash_at_the_command_line(tmp_path):
    result = launch(
        tmp_path, "--spec", str(write(tmp_path, VALID)), "--num-seeds", "3", "--dry-run"
    )
    assert result.returncode == 2 and "--num-seeds is also set in the spec" in result.stderr


@pytest.mark.parametrize("algorithm", ["ppo", "impala"])
def test_atari57_specs_match_the_shell_script(algorithm):
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "DRY_RUN": "--dry-run",
    }
    for variant in ("sync", "async"):
        for setting in ("base", "workstation"):
            name = f"{algorithm}_sync_{setting}" if variant == "sync" else f"{algorithm}_{setting}"
            script = ["bash", "benchmark/atari57.sh", algorithm, variant, setting]
            expected = subprocess.run(
                script, cwd=REPO, env=env, capture_output=True, text=True, check=True
            ).stdout
            spec_path = f"benchmark/specs/{name}.toml"
            assert launch(REPO, "--spec", spec_path, "--dry-run").stdout == expected, name
            assert len(expected.splitlines()) >= 57 * 3
    slurm = subprocess.run(
        [*script[:-1], "base"], cwd=REPO, env={**env, "SLURM": "1"}, capture_output=True, text=True
    )
    options = ["--slurm-template-path", "cleanba.slurm_template", "--slurm-gpus-per-task", "1"]
    base_spec = f"benchmark/specs/{name.replace('workstation', 'base')}.toml"
    alone = launch(REPO, "--spec", base_spec, "--dry-run")
    assert alone.stdout != slurm.stdout  # the spec alone runs locally; SLURM comes from the flags
    with_flags = launch(
        REPO, "--spec", base_spec, *options, "--slurm-total-cpus", "10", "--dry-run"
    )
    assert with_flags.stdout == slurm.stdout and "#SBATCH --array=0-170%1" in slurm.stdout


def journal_study(tmp_path, name="study"):
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "j.log"))
    )
    return optuna.create_study(study_name=name, storage=storage, direction="maximize")


def test_a_handed_back_trial_is_resumed_and_counted_once(tmp_path):
    study = journal_study(tmp_path)
    sweeps = [("--clip-coef", ["0.1", "0.2", "0.3"])]
    trial = study.ask()
    flags = search.suggest(trial, sweeps)
    search.hand_back(study, trial.number, trial.params, runs_of=trial.number)
    search.hand_back(
        study, trial.number, trial.params, runs_of=trial.number
    )  # a second worker: no second retry
    states = [t.state for t in study.trials]
    assert states == [TrialState.FAIL, TrialState.WAITING]
    retry = study.ask()
    assert search.suggest(retry, sweeps) == flags and retry.user_attrs["runs_of"] == trial.number
    plan = search.SearchPlan(sweeps=sweeps, budget=2, report_every=None, metric="final_return")
    worker = search.Worker(
        study=study,
        plan=plan,
        runs_of=None,
        experiment_dir=tmp_path,
        log_dir=tmp_path,
        workers=1,
    )
    assert worker.wants_trial()  # two trials, but the handed-back one and its retry count once
    study.tell(retry, 1.0)
    study.tell(study.ask(), 2.0)
    assert not worker.wants_trial()


def test_replay_enqueues_the_recorded_flags_in_order(tmp_path):
    study = journal_study(tmp_path)
    sweeps = [
        ("--lr", ("loguniform", 1e-4, 1e-2)),
        ("--epochs", ("int", 1.0, 8.0)),
        ("--clip", ["0.1", "0.2"]),
    ]
    recorded = [
        dict(number=1, params={"--lr": "0.00123457", "--epochs": "7", "--clip": "0.2"}),
        dict(number=0, params={"--lr": "0.005", "--epochs": "2", "--clip": "0.1"}),
    ]
    search.replay(study, recorded, sweeps)
    assert dict(search.suggest(study.ask(), sweeps)) == recorded[1]["params"]
    assert dict(search.suggest(study.ask(), sweeps)) == recorded[0]["params"]


# PPO on CartPole with CleanRL's settings, short: learning rate 1e-6 stays near random play (about
# 22 at every step) while 2.5e-3 learns (measured, mean of the last 100 returns: 194 at 25k steps,
# 282 at 40k). The seeded TPE draws 2.5e-3 first (later draws of it reuse that trial's runs), then
# 1e-6, which the median pruner (1 complete trial needed) stops at its first report.
SEARCH = f"""
command = "{sys.executable} {REPO}/cleanba/cleanba_ppo.py --hiddens 64 64 --local-num-envs 4 \
--num-actor-threads 1 --num-steps 128 --clip-vloss --total-timesteps 40000 --log-frequency 1000"
env_ids = ["CartPole-v1"]
num_seeds = 2

[space]
"--learning-rate" = [1e-6, 0.0025]

[search]
method = "tpe"
budget = 4
seed = 3
pruner = "median"
report_every = 8000
startup_trials = 1

[resources]
workers = 2
"""


def test_search_under_slurm_is_an_array_of_workers(tmp_path):
    template = ["--slurm-template-path", str(REPO / "cleanba.slurm_template"), "--dry-run"]
    result = launch(tmp_path, "--spec", str(write(tmp_path, SEARCH, "tiny.toml")), *template)
    workers = [line for line in result.stdout.splitlines() if "--search-worker" in line]
    assert result.returncode == 0 and "#SBATCH --array=0-1%2" in result.stdout and len(workers) == 2
    assert str(tmp_path / "runs" / "_experiments" / "tiny" / "spec.toml") in workers[0]
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    ntasks = launch(
        tmp_path, "--spec", str(tmp_path / "tiny.toml"), *template, "--slurm-ntasks", "2"
    )
    assert ntasks.returncode == 2 and "give --slurm-ntasks 1" in ntasks.stderr


@pytest.mark.long
def test_search_prunes_and_the_report_ranks_the_trials(tmp_path):
    result = launch(tmp_path, "--spec", str(write(tmp_path, SEARCH, "tiny.toml")))
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    experiment_dir = tmp_path / "runs" / "_experiments" / "tiny"
    record = json.loads((experiment_dir / "experiment.json").read_text())
    assert len(record["trials"]) == 4 and record["method"] == "tpe"
    pruned = [trial for trial in record["trials"] if trial["state"] == "pruned"]
    complete = [trial for trial in record["trials"] if trial["state"] == "complete"]
    assert pruned and complete, result.stdout
    assert all(trial["params"]["--learning-rate"] == "1e-06" for trial in pruned)
    # A pruned trial's runs were stopped cleanly (SIGTERM, exit 128 + 15, after a checkpoint), or
    # had finished before the report that pruned it.
    for run in pruned[0]["runs"]:
        assert run["exit_code"] in (0, 143)
        if run["exit_code"] == 143:
            assert list((tmp_path / "runs" / run["run_name"] / "checkpoints").iterdir())
    assert spec.load(experiment_dir / "spec.toml")[0]["budget"] == 4
    analyzed = subprocess.run(
        [
            sys.executable,
            "-m",
            "cleanba_utils.experiments.analyze",
            str(experiment_dir),
            "--reps",
            "200",
        ],
        capture_output=True,
        text=True,
    )
    assert analyzed.returncode == 0, analyzed.stderr
    report = (experiment_dir / "report.md").read_text()
    ranking = report.split("## Ranking")[1].split("##")[0]
    first_row = next(line for line in ranking.splitlines() if line.startswith("| 1 |"))
    assert "learning-rate=0.0025" in first_row and "pruned" in ranking
    for png in ("curves_CartPole-v1_steps.png", "curves_CartPole-v1_wall_time.png", "history.png"):
        assert (experiment_dir / png).stat().st_size > 1000
