"""Helpers shared by the script tests: run a script in a subprocess, read back what it logged, and
the programs that make a script fail on purpose."""

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import flax.serialization
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmark"))

# A network and rollout small enough for two CPU cores; 8 envs x 16 steps per update.
TINY = [
    "--env-id",
    "Breakout-v5",
    "--channels",
    "4",
    "--hiddens",
    "32",
    "--num-steps",
    "16",
    "--num-minibatches",
    "2",
    "--update-epochs",
    "2",
    "--log-frequency",
    "1",
]


def run_script(
    script: str,
    args: list,
    cwd,
    devices: int = 1,
    extra_env: dict | None = None,
    timeout: float = 300,
):
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        **(extra_env or {}),
    )
    return subprocess.run(
        [sys.executable, str(REPO / "cleanba" / script), *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


REQUIRE_ALL_TESTS = "CLEANBA_REQUIRE_ALL_TESTS"
"""Set to 1 (`.ci/run` does) to make the tests that need something of the machine (a SLURM cluster,
its second node, tmpfs mounts, transparent huge pages) fail where it is missing, instead of
skipping: a run that passes has then run them all."""


def skip_unless_required(reason: str):
    """Skips the calling test for what this machine lacks (`reason`: what is missing and how to
    provide it), or, with CLEANBA_REQUIRE_ALL_TESTS=1, fails it with that line."""
    __tracebackhide__ = True  # pytest's summary names the caller's line
    if os.environ.get(REQUIRE_ALL_TESTS) == "1":
        pytest.fail(f"{REQUIRE_ALL_TESTS}=1 and {reason}", pytrace=False)
    pytest.skip(reason)


def hub_api_stand_in(uploaded: str = "uploaded", user: str = "token-user"):
    """huggingface_hub.HfApi for the tests (the Hub is not reachable from here), autospecced from
    the installed class: a call that its signatures refuse raises TypeError, a method it lacks
    AttributeError. Its instance answers as the Hub would: `whoami` names `user`, `create_repo`
    returns the repository's address and `upload_folder` copies the folder to `uploaded`/<repo
    id>; the calls are in `.return_value.mock_calls`."""
    import huggingface_hub

    api_class = mock.create_autospec(huggingface_hub.HfApi, spec_set=True)
    api = api_class.return_value
    api.whoami.return_value = {"name": user}
    api.create_repo.side_effect = lambda repo_id, **options: f"https://huggingface.co/{repo_id}"
    api.upload_folder.side_effect = lambda **options: shutil.copytree(
        options["folder_path"], Path(uploaded) / options["repo_id"]
    )
    return api_class


def scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return (
        [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []
    )


def scalar_tags(run_dir) -> set:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return set(events.Tags()["scalars"])


def load_params(model_path):
    with open(model_path, "rb") as f:
        return flax.serialization.msgpack_restore(f.read())["params"]


def max_abs_difference(params_a, params_b) -> float:
    flat_a, flat_b = flatten(params_a), flatten(params_b)
    assert flat_a.keys() == flat_b.keys()
    return max(float(np.max(np.abs(flat_a[k] - flat_b[k]))) for k in flat_a)


def flatten(tree, prefix="") -> dict:
    if isinstance(tree, dict):
        return {k: v for key in tree for k, v in flatten(tree[key], f"{prefix}/{key}").items()}
    return {prefix: np.asarray(tree, dtype=np.float64)}


def wait_for_line(proc, prefix: str):
    """Reads a running script's stdout until a line starts with `prefix` (other libraries print
    there too)."""
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
    raise AssertionError(
        f"the process ended (exit {proc.wait()}) before printing {prefix!r}: "
        f"{proc.stderr.read()[-3000:]}"
    )


# IMPALA makes one pass over each rollout, so it has no --update-epochs.
IMPALA_TINY = TINY[: TINY.index("--update-epochs")] + TINY[TINY.index("--update-epochs") + 2 :]

# Parameters of the same run under two layouts differ by float rounding only: measured at most 4e-9
# after 3 updates (1.5e-8 on Breakout), asserted with 25x margin; minibatches chosen per device
# instead of per global env index give 5e-4.
IMPALA_LAYOUT_ATOL = 1e-7

# Parameters of the same run under two layouts differ by float rounding only: measured at most
# 6e-8 after 3 updates, asserted with 20x margin.
PPO_LAYOUT_ATOL = 1e-6


def assert_policy_lag(run_dir, concurrent: bool, num_updates: int):
    learner = dict(scalars(run_dir, "stats/learner_policy_version"))
    actor = dict(scalars(run_dir, "stats/actor_policy_version"))
    assert sorted(learner.values()) == list(range(1, num_updates + 1))
    for step, learner_version in learner.items():
        # learner_policy_version is logged after the update that trained on the actor's data
        expected_lag = 1 if concurrent and learner_version > 1 else 0
        assert learner_version - 1 - actor[step] == expected_lag, (
            step,
            learner_version,
            actor[step],
        )


def fingerprint_of(result) -> str:
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line.startswith("params_fingerprint="), last_line
    return last_line.split("=", 1)[1]


def assert_refused(script, args: list, option: str, capsys):
    """A script's argument checks stop `args` with exit code 2 and one `error:` line naming
    `option`."""
    with pytest.raises(SystemExit) as exit_:
        script.validate_layout(script.parse_args(args))
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and option in lines[0], lines


def run_failing(script: str, failure: str, args: list, cwd):
    """Runs `failing_program(script, failure)` with `args`."""
    return subprocess.run(
        [sys.executable, "-c", failing_program(script, failure), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


# A process whose thread failed ends within this many seconds of the failure (measured: 3.6 and 4.9
# s for PPO's learner and actor on 2 cores at a load of 8-9, most of it joining the other threads,
# which poll their queues every 0.2 s); a run that ignored the failure would train on for minutes.
# Counted from the failure, not from the start, so that a slow machine's start-up and compilation do
# not count.
PROMPT_EXIT_SECONDS = 30


def seconds_after_failure(result, exited_at: float) -> float:
    """How long a `run_failing` process ran on after its first injected failure (`failed at TIME`
    on stderr; threads failing at once may print on one line) until `exited_at`."""
    failed_at = [float(moment) for moment in re.findall(r"failed at (\d+\.\d+)", result.stderr)]
    return exited_at - min(failed_at)


def evaluate_saved_model(model_path) -> dict:
    """`python -m cleanba_utils.evaluate MODEL --episodes 2 --json`, as a user runs it."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cleanba_utils.evaluate",
            str(model_path),
            "--episodes",
            "2",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def failing_program(script: str, failure: str) -> str:
    """A Python program that runs `cleanba.<script>` with one part made to fail on purpose:
    - "actor": the 20th environment step raises "environment exploded" (in a compiled rollout,
      from a callback of its environment step);
    - "learner": the update raises "learner exploded";
    (these two print `failed at TIME` on stderr first: see `seconds_after_failure`)
    - "lag": the actor thread skips its second parameter fetch and plays with the stale parameters;
    - "oom": the update fails as XLA does when a device allocation fails."""
    return (
        f"import sys\nimport threading\nimport time\nimport cleanba.{script} as script\n"
        + FAILURES[failure]
        + ("\nscript.main(sys.argv[1:])\n")
    )


FAILURES = dict(
    actor="""
import jax

make_env = script.make_env


class FailingEnv:
    def __init__(self, env):
        self.env, self.steps = env, 0

    def __getattr__(self, name):
        return getattr(self.env, name)

    def count_step(self, *_):
        self.steps += 1
        if self.steps == 20:
            print(f"failed at {time.time()}", file=sys.stderr, flush=True)
            raise RuntimeError("environment exploded")

    def step(self, action):
        self.count_step()
        return self.env.step(action)

    def send(self, action):
        # The image scripts' actors step with envpool's `send` and `recv`.
        self.count_step()
        return self.env.send(action)

    def xla(self):
        # A compiled rollout steps through envpool's XLA interface: counted by a callback.
        handle, recv, send, step = self.env.xla()

        def failing_step(handle, action, env_ids):
            jax.debug.callback(self.count_step, action, ordered=True)
            return step(handle, action, env_ids)

        return handle, recv, send, failing_step


script.make_env = lambda *args: FailingEnv(make_env(*args))
""",
    learner="""
def make_failing_update(*args, **kwargs):
    def update_fn(*update_args):
        print(f"failed at {time.time()}", file=sys.stderr, flush=True)
        raise RuntimeError("learner exploded")

    return update_fn


script.make_update = make_failing_update
""",
    oom="""
import jax


def make_update_out_of_memory(*args, **kwargs):
    def update_fn(*update_args):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory allocating 271191357088 bytes."
        )

    return update_fn


script.make_update = make_update_out_of_memory
""",
    lag="""
queue_get, fetched = script.queue_get, []


def skipping_queue_get(q, stop):
    if not threading.current_thread().name.startswith("actor"):
        return queue_get(q, stop)
    fetched.append(fetched[-1] if len(fetched) == 1 else queue_get(q, stop))
    return fetched[-1]


script.queue_get = skipping_queue_get
""",
)


def run_by_hand_under_slurm(
    command: list, cwd, gpus_of, devices: int, timeout: float, extra_env: dict | None = None
) -> list[subprocess.CompletedProcess]:
    """`command` as the two processes of one run, started with SLURM's variables set by hand as in
    the original cleanba README's two-terminal example: both of local rank 0 (as on two nodes),
    `gpus_of(process)` their CUDA_VISIBLE_DEVICES (None: unset), `devices` host devices each,
    `extra_env` added. The job id is drawn at random: jax.distributed derives its port from it, so
    that concurrent tests do not meet."""
    job_id = random.randrange(10_000, 90_000)
    processes = []
    for process in range(2):
        env = dict(
            os.environ,
            SLURM_JOB_ID=str(job_id),
            SLURM_STEP_NODELIST="localhost",
            SLURM_NTASKS="2",
            SLURM_PROCID=str(process),
            SLURM_LOCALID="0",
            SLURM_STEP_NUM_NODES="2",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
            **(extra_env or {}),
        )
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if gpus_of(process) is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus_of(process)
        processes.append(
            subprocess.Popen(
                list(map(str, command)),
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=timeout) for p in processes]
    return [
        subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
        for p, (stdout, stderr) in zip(processes, outputs)
    ]


def launch(cwd, *args, env=None, timeout=600):
    """`python -m cleanba_utils.experiments.launch ARGS` in `cwd`."""
    return subprocess.run(
        [sys.executable, "-m", "cleanba_utils.experiments.launch", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# PPO's layouts of a run on 4 host devices: one learner device, two, and two actor threads.
PPO_LAYOUTS = {
    "one_learner": ["--local-num-envs", 8, "--num-actor-threads", 1, "--learner-device-ids", 1],
    "two_learners": ["--local-num-envs", 8, "--num-actor-threads", 1, "--learner-device-ids", 1, 2],
    "two_threads": ["--local-num-envs", 4, "--num-actor-threads", 2, "--learner-device-ids", 1],
}


def ppo_params_by_layout(tmp_path, args: list, layouts: dict) -> dict:
    """PPO's final parameters after `args` (with --concurrency and actors on device 0) in each of
    `layouts` ({run name: layout options}), on 4 host devices."""
    params = {}
    for name, layout in layouts.items():
        argv = [
            *args,
            *["--concurrency", "--save-model", "--actor-device-ids", "0", *layout],
            *["--run-name", name],
        ]
        result = run_script("cleanba_ppo.py", argv, tmp_path, devices=4)
        assert result.returncode == 0, result.stderr[-3000:]
        params[name] = load_params(tmp_path / "runs" / name / "cleanba_ppo.cleanba_model")
    return params
