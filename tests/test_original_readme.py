"""The original cleanba README's run commands (github.com/vwxyzjn/cleanba, README.md) on this
repository: each in one list beside its text, mapped to our names, run to the end on CPU devices
with a tiny budget.

The mapping: `poetry run python` is this environment's Python (`uv run python`; the tests run
`sys.executable`); `cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py` is
`cleanba/cleanba_ppo.py`; `cleanrl/cleanba_ppo_envpool_impala_atari_wrapper_large.py` (a file of
CleanRL's repository, vwxyzjn/cleanrl at 753a9cb, not of cleanba's) is that script with the IMPALA
ResNet widened to 64, 128 and 128 channels, here `cleanba/cleanba_ppo.py --channels 64 128 128`;
`python -m cleanrl_utils.benchmark` is `python -m cleanba_utils.experiments.launch`, which takes the
same options (cleanba_utils/experiments/LAUNCHER.md). A GPU of the original is a host device here
(XLA_FLAGS forces 8 of them), and `--track` logs to W&B offline (WANDB_MODE=offline: no login, no
network)."""

import dataclasses
import json
import shlex
import sys

import pytest
from helpers import (
    PPO_LAYOUT_ATOL,
    REPO,
    TINY,
    fingerprint_of,
    launch,
    load_params,
    max_abs_difference,
    run_by_hand_under_slurm,
    run_script,
    scalar_tags,
)

from cleanba_utils import hub


@dataclasses.dataclass(frozen=True)
class ReadmeCommand:
    label: str  # the README's name for the command (its layout), or what the command is
    original: str  # the README's text, verbatim
    ours: str  # the same command here, before the tiny budget
    # The two-terminal run: the CUDA_VISIBLE_DEVICES of each terminal, as the original sets them.
    terminals: tuple[str, ...] = ()


ORIGINAL_README_COMMANDS = [
    ReadmeCommand(
        label="default",
        original="poetry run python cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py",
        ours="python cleanba/cleanba_ppo.py",
    ),
    ReadmeCommand(
        label="a0-l0-d1",
        original="python cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py --actor-device-ids 0 "
        "--learner-device-ids 0 --track",
        ours="python cleanba/cleanba_ppo.py --actor-device-ids 0 --learner-device-ids 0 --track",
    ),
    ReadmeCommand(
        label="a0-l0,1-d1",
        original="python cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py --actor-device-ids 0 "
        "--learner-device-ids 0 1 --track",
        ours="python cleanba/cleanba_ppo.py --actor-device-ids 0 --learner-device-ids 0 1 --track",
    ),
    ReadmeCommand(
        label="a0-l1,2-d1",
        original="python cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py --actor-device-ids 0 "
        "--learner-device-ids 1 2 --track",
        ours="python cleanba/cleanba_ppo.py --actor-device-ids 0 --learner-device-ids 1 2 --track",
    ),
    ReadmeCommand(
        label="a0-l1,2,3-d1",
        original="python cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py --actor-device-ids 0 "
        "--learner-device-ids 1 2 3 --track",
        ours="python cleanba/cleanba_ppo.py --actor-device-ids 0 --learner-device-ids 1 2 3 "
        "--track",
    ),
    ReadmeCommand(
        label="a0-l1,2,3,4-d1",
        original="python cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py --actor-device-ids 0 "
        "--learner-device-ids 1 2 3 4 --track",
        ours="python cleanba/cleanba_ppo.py --actor-device-ids 0 --learner-device-ids 1 2 3 4 "
        "--track",
    ),
    ReadmeCommand(
        label="a0-l1,2,3,4,5,6-d1",
        original="python cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py --actor-device-ids 0 "
        "--learner-device-ids 1 2 3 4 5 6 --track",
        ours="python cleanba/cleanba_ppo.py --actor-device-ids 0 --learner-device-ids 1 2 3 4 5 6 "
        "--track",
    ),
    # The README calls this run a0-l0-d2, but both of its commands put the learners on GPUs 1 2 3.
    ReadmeCommand(
        label="a0-l1,2,3-d2",
        original='CUDA_VISIBLE_DEVICES="0,1,2,3" SLURM_JOB_ID=26017 SLURM_STEP_NODELIST=localhost '
        "SLURM_NTASKS=2 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_STEP_NUM_NODES=2 python "
        "cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py --distributed --actor-device-ids 0 "
        "--learner-device-ids 1 2 3\n"
        'CUDA_VISIBLE_DEVICES="4,5,6,7" SLURM_JOB_ID=26017 SLURM_STEP_NODELIST=localhost '
        "SLURM_NTASKS=2 SLURM_PROCID=1 SLURM_LOCALID=0 SLURM_STEP_NUM_NODES=2 python "
        "cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py --distributed --actor-device-ids 0 "
        "--learner-device-ids 1 2 3",
        ours="python cleanba/cleanba_ppo.py --distributed --actor-device-ids 0 "
        "--learner-device-ids 1 2 3",
        terminals=("0,1,2,3", "4,5,6,7"),
    ),
    ReadmeCommand(
        label="slurm-benchmark",
        original="python -m cleanrl_utils.benchmark \\\n"
        "--env-ids Breakout-v5 \\\n"
        '--command "poetry run python cleanrl/cleanba_ppo_envpool_impala_atari_wrapper_large.py '
        '--distributed --learner-device-ids 1 2 3 --track --save-model --upload-model" \\\n'
        "--num-seeds 1 \\\n"
        "--workers 1 \\\n"
        "--slurm-gpus-per-task 4 \\\n"
        "--slurm-ntasks 2 \\\n"
        "--slurm-nodes 1 \\\n"
        "--slurm-template-path cleanba.slurm_template",
        ours="python -m cleanba_utils.experiments.launch --env-ids Breakout-v5 "
        '--command "python cleanba/cleanba_ppo.py --channels 64 128 128 --distributed '
        '--learner-device-ids 1 2 3 --track --save-model --upload-model" --num-seeds 1 '
        "--workers 1 --slurm-gpus-per-task 4 --slurm-ntasks 2 --slurm-nodes 1 "
        "--slurm-template-path cleanba.slurm_template",
    ),
]
SINGLE_PROCESS_RUNS = [
    command
    for command in ORIGINAL_README_COMMANDS
    if command.ours.startswith("python cleanba/") and not command.terminals
]


def command_labelled(label: str) -> ReadmeCommand:
    (command,) = [c for c in ORIGINAL_README_COMMANDS if c.label == label]
    return command


# One GPU, actor and learner on it: the run every other run of the same global configuration is
# compared with. It is itself compared with the same command on a host of one device
# (REFERENCE_HOST_DEVICES): see the test's docstring.
REFERENCE = command_labelled("a0-l0-d1")
HOST_DEVICES = 8
REFERENCE_HOST_DEVICES = 1
TWO_TERMINALS = command_labelled("a0-l1,2,3-d2")
SLURM_BENCHMARK = command_labelled("slurm-benchmark")
# The launcher's name of the benchmark's one run: game, experiment (the script), setting, seed.
BENCHMARK_RUN_NAME = "Breakout-v5__cleanba_ppo__0__1"

# TINY's network (Breakout, 4 channels) and two updates: the second rollout is played with the
# parameters of the first update, which the learner devices return to the actor's device (without
# --concurrency the actor waits for them). Rollouts of 8 steps, TINY's 16 halved, so that the two
# updates play as many steps as one of TINY's. Each actor thread's 12 environments divide among 1,
# 2, 3, 4 and 6 learner devices: each takes an equal share. The models are saved to compare the
# layouts' parameters.
NUM_ENVS_PER_THREAD = 12
NUM_ACTOR_THREADS = 2  # the script's default, as the original's
NUM_UPDATES = 2
NUM_STEPS = 8
STEPS_PER_UPDATE = NUM_ACTOR_THREADS * NUM_ENVS_PER_THREAD * NUM_STEPS
SHORT_TINY = list(TINY)
SHORT_TINY[TINY.index("--num-steps") + 1] = str(NUM_STEPS)
BUDGET = [
    *SHORT_TINY,
    "--total-timesteps",
    NUM_UPDATES * STEPS_PER_UPDATE,
    "--save-model",
]
# What --track leaves with W&B offline: a run of its own under `wandb/` of the working directory,
# with a copy of the run folder's TensorBoard events (synced as they are written).
WANDB_OFFLINE = {"WANDB_MODE": "offline"}

# The costliest runs, these layouts (the most learner devices) and the runs of two processes (the
# two-terminal run, the SLURM example's job), run with `uv run pytest -m long`; the others in the
# README's test command.
LONG = {"a0-l1,2-d1", "a0-l1,2,3-d1", "a0-l1,2,3,4-d1", "a0-l1,2,3,4,5,6-d1"}


def split_text(text: str) -> list[str]:
    """A shell command's words, its backslash line continuations joined."""
    return shlex.split(text.replace("\\\n", " "))


def script_arguments(command_line: str) -> list[str]:
    """The words after the script (the word ending in .py) of one command line."""
    words = split_text(command_line)
    script_index = next(i for i, word in enumerate(words) if word.endswith(".py"))
    return words[script_index + 1 :]


def option_values(args: list[str], option: str) -> list[str]:
    """The words after `option` up to the next option."""
    values = args[args.index(option) + 1 :]
    return values[: next((i for i, w in enumerate(values) if w.startswith("--")), len(values))]


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory):
    """Runs a single-process command once for the module (the other runs' tests compare with the
    reference run) on `devices` host devices: its result, its run folder and its working
    directory."""
    cwd = tmp_path_factory.mktemp("original_readme")
    results = {}

    def run(command: ReadmeCommand, devices: int = HOST_DEVICES):
        run_name = command.label if devices == HOST_DEVICES else f"{command.label}_{devices}"
        if run_name not in results:
            script = split_text(command.ours)[1]
            result = run_script(
                script.removeprefix("cleanba/"),
                [
                    *script_arguments(command.ours),
                    *BUDGET,
                    "--local-num-envs",
                    NUM_ENVS_PER_THREAD,
                    "--run-name",
                    run_name,
                ],
                cwd,
                devices=devices,
                extra_env=WANDB_OFFLINE,
            )
            results[run_name] = (result, cwd / "runs" / run_name, cwd)
        return results[run_name]

    return run


def assert_ran_to_the_end(run_dir, devices: int = HOST_DEVICES) -> dict:
    """The run's summary has every step and update of the budget; its spec, on `devices`
    devices."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == NUM_UPDATES * STEPS_PER_UPDATE, summary
    assert summary["learner_policy_version"] == NUM_UPDATES, summary
    spec = json.loads((run_dir / "spec.json").read_text())
    assert len(spec["devices"]) == devices, spec["devices"]
    return spec


def assert_agrees_with_the_reference_run(
    run_dir, spec: dict, single_process_run, host_devices: int = HOST_DEVICES
):
    """The reference run's global configuration (spec.json's sizes) and its parameters, up to
    float rounding; the reference run's result. The reference run on `host_devices` host
    devices."""
    reference_result, reference_dir, _ = single_process_run(REFERENCE, host_devices)
    assert reference_result.returncode == 0, reference_result.stderr[-3000:]
    assert_ran_to_the_end(reference_dir, host_devices)
    assert spec["sizes"] == json.loads((reference_dir / "spec.json").read_text())["sizes"]
    model = "cleanba_ppo.cleanba_model"
    difference = max_abs_difference(
        load_params(run_dir / model), load_params(reference_dir / model)
    )
    assert difference < PPO_LAYOUT_ATOL
    return reference_result


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(
            command,
            id=command.label,
            marks=[pytest.mark.long] if command.label in LONG else [],
        )
        for command in SINGLE_PROCESS_RUNS
    ],
)
def test_a_single_process_command_runs_to_the_end_as_the_reference_run_does(
    single_process_run, command
):
    """Every layout of one process (and the command without options) has the reference run's
    global configuration: the original keeps the actor's settings (its device, environments,
    threads) and adds learner devices, which split each rollout. So their parameters agree with
    the reference run's up to float rounding; the default command, which is the reference run
    without --track, gives its very parameters.

    The reference run itself (a0-l0-d1, on 8 host devices as every run here) is compared with the
    same command on a host of one device. There the actor and the learner can only share that
    device: no rollout, parameter or collective can reach another, so that run is the one-device
    run by construction, whatever the code does with the devices it is not given. On 8 devices, a
    run that used more than its layout names (a pmap or a sharding over every local device,
    environments or seeds counted by the host's devices) would differ from it or fail; the number
    of host devices changes nothing else, so the two agree up to float rounding (XLA may split the
    host's threads otherwise; on this project's machine they agree bit for bit). The other
    layouts cannot give this reference: they are compared with a0-l0-d1, and comparing it with
    them would be the same comparison."""
    original_lines = command.original.splitlines()
    assert [script_arguments(line) for line in original_lines] == [script_arguments(command.ours)]
    result, run_dir, cwd = single_process_run(command)
    assert result.returncode == 0, result.stderr[-3000:]
    spec = assert_ran_to_the_end(run_dir)
    ours = split_text(command.ours)
    for option in ["--actor-device-ids", "--learner-device-ids"]:
        if option in ours:
            ids = spec["args"][option.removeprefix("--").replace("-", "_")]
            assert ids == [int(i) for i in option_values(ours, option)]
    if "--track" in ours:
        (wandb_copy,) = cwd.glob(f"wandb/offline-run-*/files/runs/{command.label}")
        assert scalar_tags(wandb_copy) == scalar_tags(run_dir)
    host_devices = REFERENCE_HOST_DEVICES if command is REFERENCE else HOST_DEVICES
    reference_result = assert_agrees_with_the_reference_run(
        run_dir, spec, single_process_run, host_devices
    )
    if command.label == "default":
        assert fingerprint_of(result) == fingerprint_of(reference_result)


def run_as_two_slurm_tasks(script_args: list, cwd, extra_env: dict | None = None):
    """cleanba_ppo.py with `script_args` and the budget as the two processes of one run, SLURM's
    variables set by hand, 4 host devices each for the 4 GPUs of each of the two-terminal run's
    terminals (its CUDA_VISIBLE_DEVICES). Each process has half the reference run's environments:
    the original gives both processes the same settings, so its run has twice the environments of
    one process; with half each, the run trains on the reference run's global batch."""
    return run_by_hand_under_slurm(
        [
            sys.executable,
            REPO / "cleanba" / "cleanba_ppo.py",
            *script_args,
            *BUDGET,
            "--local-num-envs",
            NUM_ENVS_PER_THREAD // 2,
        ],
        cwd,
        gpus_of=lambda process: TWO_TERMINALS.terminals[process],
        devices=4,
        timeout=300,
        extra_env=extra_env,
    )


@pytest.mark.long
def test_the_two_terminal_run_matches_the_reference_run(tmp_path, single_process_run):
    """The README's a0-l1,2,3-d2 example: two processes with SLURM's variables set by hand as the
    original sets them (the job id, from which jax.distributed takes its port, drawn at random).
    On CPU devices the two processes run today; what CUDA_VISIBLE_DEVICES hides from a process on
    GPUs (JAX's default of one GPU per SLURM process) is tests/test_distributed_devices.py's test of
    this example. Its 6 learner devices train on the reference run's global batch, and the
    parameters agree with that run's up to float rounding."""
    for line in TWO_TERMINALS.original.splitlines():
        assert script_arguments(line) == script_arguments(TWO_TERMINALS.ours)
    results = run_as_two_slurm_tasks(
        [*script_arguments(TWO_TERMINALS.ours), "--run-name", TWO_TERMINALS.label], tmp_path
    )
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    assert fingerprint_of(results[0]) == fingerprint_of(results[1])
    run_dir = tmp_path / "runs" / TWO_TERMINALS.label
    spec = assert_ran_to_the_end(run_dir)
    assert_agrees_with_the_reference_run(run_dir, spec, single_process_run)


def slurm_job_of_the_benchmark_command() -> tuple[list[str], list[str]]:
    """The launcher's --dry-run of the README's SLURM example: the sbatch script's lines and the
    words of the one run's command."""
    options = split_text(SLURM_BENCHMARK.ours)[3:]
    result = launch(REPO, *options, "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    (run_line,) = [line for line in lines if line.endswith("  # 0")]
    return lines, split_text(split_text(run_line)[0])


def test_the_slurm_benchmark_command_makes_an_array_of_one_run_on_two_tasks_of_4_gpus():
    """The README's SLURM example asks for 2 tasks of 4 GPUs each, which a cluster of CPU machines
    does not have (SLURM hands out GPUs as a resource of their own): the test takes the launcher's
    --dry-run, which prints the sbatch script without submitting it, and checks what the job would
    run. Its script command is the two-terminal run's layout (the actor on device 0, the default)
    with the large network, --track, --save-model and --upload-model, which
    test_the_slurm_benchmarks_run_trains_and_keeps_its_model_without_a_hugging_face_token runs."""
    original = split_text(SLURM_BENCHMARK.original)
    ours = split_text(SLURM_BENCHMARK.ours)
    assert original[:3] == ["python", "-m", "cleanrl_utils.benchmark"]
    assert ours[:3] == ["python", "-m", "cleanba_utils.experiments.launch"]
    # The same options; in --command, our script with the large network's channels.
    original_options = original[3:]
    options = ours[3:]
    command_at = original_options.index("--command") + 1
    assert options.index("--command") + 1 == command_at
    assert options[:command_at] == original_options[:command_at]
    assert options[command_at + 1 :] == original_options[command_at + 1 :]
    assert script_arguments(options[command_at]) == [
        "--channels",
        "64",
        "128",
        "128",
        *script_arguments(original_options[command_at]),
    ]

    lines, run_command = slurm_job_of_the_benchmark_command()
    for directive in [
        "#SBATCH --array=0-0%1",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=2",
        "#SBATCH --gpus-per-task=4",
    ]:
        assert directive in lines, lines
    script_command = split_text(options[command_at])
    assert run_command[: len(script_command)] == script_command
    assert run_command[len(script_command) :] == [
        "--env-id",
        "Breakout-v5",
        "--seed",
        "1",
        "--group",
        "cleanba_ppo/0",
        "--run-name",
        BENCHMARK_RUN_NAME,
        "--resume",
    ]


@pytest.mark.long
def test_the_slurm_benchmarks_run_trains_and_keeps_its_model_without_a_hugging_face_token(
    tmp_path, single_process_run
):
    """The job's command, with the budget (whose --channels replaces the large network's), run as
    srun starts the job's two tasks: SLURM's variables set by hand, 4 host devices each. Without a
    Hugging Face token (none here: HF_TOKEN empty, HF_HOME empty) the run trains, writes all its
    files and ends with one line and exit code 3 in process 0, the one that uploads; --track logs
    to W&B offline."""
    _, run_command = slurm_job_of_the_benchmark_command()
    assert run_command[:2] == ["python", "cleanba/cleanba_ppo.py"]
    results = run_as_two_slurm_tasks(
        run_command[2:],
        tmp_path,
        extra_env=WANDB_OFFLINE | {"HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf_home")},
    )
    uploader, other = results
    assert other.returncode == 0, other.stderr[-3000:]
    assert uploader.returncode == hub.UPLOAD_FAILED_EXIT_CODE, uploader.stderr[-3000:]
    assert uploader.stderr.strip().splitlines()[-1] == (
        f"the model stays in runs/{BENCHMARK_RUN_NAME}; it was not uploaded: no Hugging Face "
        "token: set HF_TOKEN or log in with `hf auth login`"
    )
    assert fingerprint_of(uploader) == fingerprint_of(other)
    run_dir = tmp_path / "runs" / BENCHMARK_RUN_NAME
    spec = assert_ran_to_the_end(run_dir)
    (wandb_copy,) = tmp_path.glob(f"wandb/offline-run-*/files/runs/{BENCHMARK_RUN_NAME}")
    assert scalar_tags(wandb_copy) == scalar_tags(run_dir)
    assert_agrees_with_the_reference_run(run_dir, spec, single_process_run)
