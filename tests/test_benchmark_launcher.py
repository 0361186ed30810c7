import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from helpers import launch

from cleanba_utils.experiments import launch as launch_module
from cleanba_utils.experiments.sweeps import grid_settings, parse_sweep, random_settings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = os.path.join(REPO, "cleanba.slurm_template")
GAMES = ["Breakout-v5", "Pong-v5"]

# Stands in for a training script: records its argv, writes to both streams, fails on Pong with
# --fail-pong, and with --sleep waits until SIGTERM or SIGUSR1, notes which one it got and exits
# 128 + its number (as the scripts do after saving their checkpoint).
FAKE_TRAIN = """
import json, os, signal, sys, time
here = os.path.dirname(os.path.abspath(__file__))
def stopped(signum, frame):
    open(os.path.join(here, "stopped-" + signal.Signals(signum).name), "w").close()
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stopped)
signal.signal(signal.SIGUSR1, stopped)
os.makedirs(os.path.join(here, "calls"), exist_ok=True)
record = os.path.join(here, "calls", f"{os.getpid()}.json")
with open(record + ".tmp", "w") as file:
    json.dump(sys.argv[1:], file)
os.replace(record + ".tmp", record)
print("to stdout")
print("to stderr", file=sys.stderr)
if "--sleep" in sys.argv:
    time.sleep(60)
sys.exit(3 if "--fail-pong" in sys.argv and "Pong-v5" in sys.argv else 0)
"""


@pytest.fixture
def fake_train(tmp_path):
    path = tmp_path / "fake_train.py"
    path.write_text(FAKE_TRAIN)
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(path))}"


def calls(tmp_path):
    """Every fake training run so far, as {flag: the token after it} plus its whole argv under
    "argv"."""
    records = [json.loads(path.read_text()) for path in sorted((tmp_path / "calls").glob("*.json"))]
    return [dict(itertools.pairwise(argv)) | {"argv": argv} for argv in records]


def wait_for(condition, seconds=20):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_local_runs_every_game_and_seed_with_logs(tmp_path, fake_train):
    result = launch(
        tmp_path,
        "--env-ids",
        *GAMES,
        "--command",
        fake_train,
        "--num-seeds",
        "2",
        "--start-seed",
        "1",
        "--workers",
        "2",
    )
    assert result.returncode == 0, result.stderr
    runs = calls(tmp_path)
    assert sorted((run["--env-id"], run["--seed"]) for run in runs) == sorted(
        itertools.product(GAMES, ["1", "2"])
    )
    for run in runs:
        run_name = f"{run['--env-id']}__fake_train__0__{run['--seed']}"
        assert run["--run-name"] == run_name and run["--group"] == "fake_train/0"
        assert "--resume" not in run["argv"]
        log = (tmp_path / "runs" / "_launcher" / "fake_train" / f"{run_name}.log").read_text()
        assert "to stdout" in log and "to stderr" in log
    progress = [line for line in result.stdout.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    assert all(" exit 0 " in line for line in progress)
    assert "4 runs: 4 exited 0, 0 failed" in result.stdout


def test_failing_run_fails_the_launcher(tmp_path, fake_train):
    result = launch(
        tmp_path, "--env-ids", *GAMES, "--command", f"{fake_train} --fail-pong", "--workers", "2"
    )
    assert result.returncode == 1
    assert "2 runs: 1 exited 0, 1 failed" in result.stdout
    assert "exit 3: Pong-v5__fake_train__0__1" in result.stdout


def test_interrupt_stops_running_runs(tmp_path, fake_train):
    args = ["--env-ids", *GAMES, "--command", f"{fake_train} --sleep", "--workers", "2"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "cleanba_utils.experiments.launch", *args],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: len(calls(tmp_path)) == 2)
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=30) == 130
    assert "stopping 2 running run(s)" in launcher.stderr.read()
    assert (tmp_path / "stopped-SIGTERM").exists()
    for record in (tmp_path / "calls").glob("*.json"):
        with pytest.raises(ProcessLookupError):
            os.kill(int(record.stem), 0)


@pytest.mark.parametrize(
    "workers, gpus, given, expected",
    [
        (2, 1, {}, "0.45"),
        # Every run sees every GPU, so a second GPU does not make the share larger.
        (2, 2, {}, "0.45"),
        (7, 4, {}, "0.12"),
        (1, 1, {}, None),
        (4, 0, {}, None),
        (4, 1, {"XLA_CLIENT_MEM_FRACTION": "0.6"}, "0.6"),
        (4, 1, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6"}, None),
    ],
)
def test_runs_sharing_a_gpu_each_get_a_share_of_its_memory(
    monkeypatch, workers, gpus, given, expected
):
    monkeypatch.setattr(launch_module, "gpu_count", lambda: gpus)
    environ = dict(given)
    line = launch_module.share_gpus(workers, environ)
    assert environ.get("XLA_CLIENT_MEM_FRACTION") == expected
    assert environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") == given.get(
        "XLA_PYTHON_CLIENT_MEM_FRACTION"
    )
    assert (line is not None) == (expected is not None and not given)


# Records the memory fraction its environment gives it, under calls/<pid>.json.
ENVIRONMENT_RECORDER = """
import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
os.makedirs(os.path.join(here, "calls"), exist_ok=True)
with open(os.path.join(here, "calls", f"{os.getpid()}.json"), "w") as file:
    json.dump([os.environ.get("XLA_CLIENT_MEM_FRACTION")], file)
"""


def test_local_workers_on_a_gpu_machine_get_the_memory_fraction(tmp_path):
    # nvidia-smi stands in for the machine's: it lists two GPUs.
    (tmp_path / "bin").mkdir()
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho 'GPU 0: Fake GPU (UUID: GPU-0)'\necho 'GPU 1: Fake GPU (UUID: GPU-1)'\n"
    )
    smi.chmod(0o755)
    recorder = tmp_path / "recorder.py"
    recorder.write_text(ENVIRONMENT_RECORDER)
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
    }
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}"
    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(recorder))}"
    result = launch(
        tmp_path,
        "--env-ids",
        *GAMES,
        "--command",
        command,
        "--num-seeds",
        "2",
        "--workers",
        "3",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "3 runs at a time share each of the 2 GPU(s): XLA_CLIENT_MEM_FRACTION=0.30" in (
        result.stdout
    )
    assert [run["argv"] for run in calls(tmp_path)] == [["0.30"]] * 4


def test_dry_run_prints_commands_only(tmp_path, fake_train):
    result = launch(
        tmp_path,
        "--env-ids",
        *GAMES,
        "--command",
        fake_train,
        "--num-seeds",
        "3",
        "--resume",
        "--dry-run",
    )
    assert result.returncode == 0
    commands = [shlex.split(line) for line in result.stdout.splitlines()]
    assert len(commands) == 6 and all(command[-1] == "--resume" for command in commands)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "calls").exists()


def test_grid_sweep_runs_every_setting(tmp_path, fake_train):
    result = launch(
        tmp_path,
        "--env-ids",
        "Pong-v5",
        "--command",
        fake_train,
        "--experiment",
        "grid",
        "--dry-run",
        "--sweep",
        "--learning-rate=1e-4,1e-3",
        "--sweep",
        "--learner-device-ids=1 2,3",
    )
    commands = [shlex.split(line) for line in result.stdout.splitlines()]
    # A value with spaces becomes several arguments, as flags taking a list (device ids) need.
    settings = [
        (" ".join(command[2 : command.index("--env-id")]), command[command.index("--group") + 1])
        for command in commands
    ]
    assert settings == [
        ("--learning-rate 1e-4 --learner-device-ids 1 2", "grid/0"),
        ("--learning-rate 1e-4 --learner-device-ids 3", "grid/1"),
        ("--learning-rate 1e-3 --learner-device-ids 1 2", "grid/2"),
        ("--learning-rate 1e-3 --learner-device-ids 3", "grid/3"),
    ]


def test_random_search_is_deterministic_within_grid_and_budget():
    sweeps = [parse_sweep("--learning-rate=1e-4,3e-4,1e-3"), parse_sweep("--num-minibatches=2,4,8")]
    grid = grid_settings(sweeps)
    drawn = random_settings(sweeps, 5, seed=3)
    assert drawn == random_settings(sweeps, 5, seed=3)
    assert len(drawn) == 5 and all(setting in grid for setting in drawn)
    assert len({tuple(setting) for setting in drawn}) == 5
    assert len({tuple(map(tuple, random_settings(sweeps, 5, seed))) for seed in range(5)}) > 1
    with pytest.raises(ValueError, match="larger than the grid of 9"):
        random_settings(sweeps, 10, seed=3)


def test_random_search_draws_ranges(tmp_path, fake_train):
    args = [
        "--env-ids",
        "Pong-v5",
        "--command",
        fake_train,
        "--search",
        "random",
        "--budget",
        "4",
        "--sweep-seed",
        "7",
        "--sweep",
        "--learning-rate=loguniform(1e-5,1e-3)",
        "--sweep",
        "--num-minibatches=4,8",
        "--dry-run",
    ]
    result = launch(tmp_path, *args)
    assert result.stdout == launch(tmp_path, *args).stdout
    commands = [shlex.split(line) for line in result.stdout.splitlines()]
    assert len(commands) == 4
    for command in commands:
        assert 1e-5 <= float(command[command.index("--learning-rate") + 1]) <= 1e-3
        assert command[command.index("--num-minibatches") + 1] in ["4", "8"]


def slurm_args(fake_train, *extra):
    return [
        "--env-ids",
        *GAMES,
        "--command",
        fake_train,
        "--num-seeds",
        "2",
        "--workers",
        "3",
        "--slurm-template-path",
        TEMPLATE,
        *extra,
    ]


def test_sbatch_script_has_every_command_and_requeue(tmp_path, fake_train):
    fake_train = f"{fake_train} --distributed"
    result = launch(
        tmp_path,
        *slurm_args(
            fake_train,
            "--slurm-ntasks",
            "2",
            "--slurm-gpus-per-task",
            "4",
            "--slurm-total-cpus",
            "16",
            "--slurm-partition",
            "gpu",
            "--slurm-time",
            "2-00:00:00",
            "--slurm-signal-lead",
            "300",
            "--dry-run",
        ),
    )
    assert result.returncode == 0, result.stderr
    script = result.stdout
    local_args = [
        "--env-ids",
        *GAMES,
        "--command",
        fake_train,
        "--num-seeds",
        "2",
        "--resume",
        "--dry-run",
    ]
    commands = launch(tmp_path, *local_args).stdout.splitlines()
    assert len(commands) == 4
    for index, command in enumerate(commands):
        assert f"    {shlex.quote(command)}  # {index}" in script.splitlines()
    expected = [
        "#SBATCH --job-name=fake_train",
        "#SBATCH --partition=gpu",
        "#SBATCH --array=0-3%3",
        "#SBATCH --ntasks=2",
        "#SBATCH --gpus-per-task=4",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@300",
        "command=${commands[$SLURM_ARRAY_TASK_ID]}",
        "trap 'pass_on USR1' USR1",
        "trap 'pass_on TERM' TERM",
        'srun bash -c "exec $command" &',
        '    scontrol requeue "$SLURM_JOB_ID"',
    ]
    assert [line for line in script.splitlines() if line in expected] == expected
    assert "{{" not in script
    defaults = launch(tmp_path, *slurm_args(fake_train, "--dry-run")).stdout
    assert "--partition" not in defaults and "--time" not in defaults
    assert "#SBATCH --signal=B:USR1@120" in defaults.splitlines()


@pytest.mark.parametrize(
    "signal_sent, requeued, exit_code",
    [
        # The time limit's signal: the run saves and stops (128 + USR1), the task is requeued.
        (signal.SIGUSR1, True, None),
        # A user's scancel (or preemption, which SLURM requeues itself): the task ends.
        (signal.SIGTERM, False, 128 + signal.SIGTERM),
        # A run that ends by itself is never requeued.
        (None, False, 0),
    ],
)
def test_the_batch_script_requeues_only_a_run_stopped_by_the_time_limit(
    tmp_path, fake_train, signal_sent, requeued, exit_code
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in [
        ("sbatch", 'echo "$@" > "$(dirname "$0")/sbatch.args"'),
        ("srun", 'exec "$@"'),
        ("scontrol", 'echo "$@" > "$(dirname "$0")/scontrol.args"'),
    ]:
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = os.environ | {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    sleep = " --sleep" if signal_sent else ""
    result = launch(tmp_path, *slurm_args(f"{fake_train}{sleep}"), env=env)
    assert result.returncode == 0, result.stderr
    log_dir = tmp_path / "runs" / "_launcher" / "fake_train"
    script = log_dir / "fake_train.sbatch"
    assert (bin_dir / "sbatch.args").read_text().split() == [
        "--parsable",
        str(script.relative_to(tmp_path)),
    ]

    task_env = env | {"SLURM_ARRAY_TASK_ID": "2", "SLURM_JOB_ID": "42", "SLURM_ARRAY_JOB_ID": "40"}
    task = subprocess.Popen(
        ["bash", str(script)],
        cwd=tmp_path,
        env=task_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for(lambda: len(calls(tmp_path)) == 1)
    run = calls(tmp_path)[0]
    assert (run["--env-id"], run["--seed"], run["argv"][-1]) == ("Pong-v5", "1", "--resume")
    if signal_sent:
        wait_for(lambda: len(list((tmp_path / "calls").glob("*.json"))) == 1)
        time.sleep(0.5)  # the fake has installed its handlers
        task.send_signal(signal_sent)
    status = task.wait(timeout=30)
    output = task.stdout.read()
    if signal_sent:
        assert (tmp_path / f"stopped-{signal_sent.name}").exists(), output
    assert (bin_dir / "scontrol.args").exists() == requeued, output
    if requeued:
        assert (bin_dir / "scontrol.args").read_text().split() == ["requeue", "42"]
        assert status == 0
        assert not (log_dir / "40_2.exit").exists()
    else:
        assert status == exit_code, output
        assert (log_dir / "40_2.exit").read_text().strip() == str(exit_code)


VALID = ["--env-ids", "Pong-v5", "--command", "python train.py"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--command", "python train.py"], "--env-ids is missing"),
        ([*VALID, "--search", "tpe", "--budget", "2"], "--search tpe needs a search space"),
        (
            [*VALID, "--search", "tpe", "--budget", "2", "--sweep", "--lr=1,2"],
            "--pruner needs --report-every",
        ),
        ([*VALID, "--report-every", "100"], "--report-every is for --search tpe only"),
        ([*VALID, "--sweep", "--learning-rate"], "bad --sweep"),
        ([*VALID, "--sweep", "--lr=uniform(1)"], "bad range"),
        ([*VALID, "--sweep", "--lr=uniform(1,2)"], "need --search random"),
        ([*VALID, "--sweep", "--seed=1,2"], "set by the launcher"),
        (
            ["--env-ids", "Pong-v5", "--command", "python train.py --seed 1"],
            "--command sets --seed",
        ),
        ([*VALID, "--workers", "0"], "argument --workers"),
        ([*VALID, "--num-seeds", "-1"], "argument --num-seeds"),
        ([*VALID, "--budget", "2"], "go together"),
        ([*VALID, "--slurm-ntasks", "2"], "needs --slurm-template-path"),
        ([*VALID, "--slurm-template-path", "missing"], "no SLURM template"),
        (
            [*VALID, "--slurm-template-path", TEMPLATE, "--slurm-ntasks", "2"],
            "--slurm-ntasks 2 starts that many processes per run, which train as one run only "
            "with --distributed",
        ),
        ([*VALID, "--slurm-time", "2:00:00"], "needs --slurm-template-path"),
        (
            [*VALID, "--slurm-template-path", TEMPLATE, "--slurm-time", "2h"],
            "--slurm-time '2h' is not a SLURM time limit; give MINUTES,",
        ),
        (
            [*VALID, "--slurm-template-path", TEMPLATE, "--slurm-time", "2", "--dry-run"],
            "--slurm-signal-lead 120 s is not shorter than --slurm-time 2 (120 s)",
        ),
        (
            [*VALID, "--slurm-template-path", TEMPLATE, "--slurm-signal-lead", "70000"],
            "--slurm-signal-lead must be at most 65535 s",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    result = launch(tmp_path, *args)
    assert result.returncode == 2
    assert result.stderr.startswith("launch: error: ") and message in result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stdout == ""


def test_a_time_limit_needs_a_place_in_the_template(tmp_path):
    """A template forked before the time limit existed has no {{time}}: the option would do
    nothing."""
    with open(TEMPLATE) as file:
        template = file.read()
    old = tmp_path / "old.slurm_template"
    old.write_text(template.replace("#SBATCH --time={{time}}\n", ""))
    result = launch(tmp_path, *VALID, "--slurm-template-path", old, "--slurm-time", "1-0")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"launch: error: --slurm-time needs a place in the SLURM template {old}, which has no "
        "{{time}} (see cleanba.slurm_template)"
    )
    accepted = launch(tmp_path, *VALID, "--slurm-template-path", old, "--dry-run")
    assert accepted.returncode == 0, accepted.stderr
