"""Multi-process runs, a lost peer, preemption with checkpoint and resume: the machinery the
scripts share."""

import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import (
    IMPALA_LAYOUT_ATOL,
    IMPALA_TINY,
    PPO_LAYOUT_ATOL,
    REPO,
    TINY,
    fingerprint_of,
    load_params,
    max_abs_difference,
    run_script,
    scalars,
    wait_for_line,
)
from test_apex_dpg import LAYOUT_ATOL as APEX_DPG_LAYOUT_ATOL
from test_apex_dpg import TINY as APEX_DPG_TINY
from test_sac import LAYOUT_ATOL as SAC_LAYOUT_ATOL
from test_sac import TINY as SAC_TINY

from cleanba_utils.checkpoints import CHECKSUM_BYTES

# Each script's tiny arguments and how far its parameters may drift between layouts.
SCRIPTS = {
    "cleanba_ppo.py": (TINY, PPO_LAYOUT_ATOL),
    "cleanba_impala.py": (IMPALA_TINY, IMPALA_LAYOUT_ATOL),
}
# The off-policy scripts in two processes too: every process gathers all processes' transitions
# into a whole replay of its own, and its learner devices take their shares of each global batch.
MULTI_PROCESS_SCRIPTS = {
    **SCRIPTS,
    "cleanba_sac.py": (SAC_TINY, SAC_LAYOUT_ATOL),
    "cleanba_apex_dpg.py": (APEX_DPG_TINY, APEX_DPG_LAYOUT_ATOL),
}
GLOBAL = [
    "--total-timesteps",
    384,
    "--concurrency",
    "--num-actor-threads",
    1,
    "--actor-device-ids",
    0,
    "--learner-device-ids",
    1,
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_processes(script: str, args: list, cwd, num_processes: int = 2) -> list[subprocess.Popen]:
    """Processes on this machine joined by jax.distributed, 2 CPU devices each."""
    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    return [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO / "cleanba" / script),
                *map(str, args),
                "--distributed",
                "--coordinator-address",
                address,
                "--num-processes",
                str(num_processes),
                "--process-id",
                str(i),
            ],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(num_processes)
    ]


# In the long checks (`-m long`): SAC's and Ape-X DPG's runs cost the README's test command about
# 55 s of a worker (the SLURM tests run the continuous scripts across two nodes in it).
LONG_SCALE_OUT = {"cleanba_sac.py", "cleanba_apex_dpg.py"}


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(script, marks=[pytest.mark.long] if script in LONG_SCALE_OUT else [])
        for script in MULTI_PROCESS_SCRIPTS
    ],
)
def test_two_processes_match_one_process_with_two_learner_devices(tmp_path, script):
    tiny, layout_atol = MULTI_PROCESS_SCRIPTS[script]
    start = time.time()
    processes = start_processes(
        script,
        [*tiny, *GLOBAL, "--local-num-envs", 4, "--save-model", "--run-name", "two"],
        tmp_path,
    )
    results = [p.communicate(timeout=300) for p in processes]
    wall_time = time.time() - start
    for p, (_, stderr) in zip(processes, results):
        assert p.returncode == 0, stderr[-3000:]
    fingerprints = {
        fingerprint_of(subprocess.CompletedProcess([], 0, stdout, "")) for stdout, _ in results
    }
    assert len(fingerprints) == 1
    print(f"two-process run: {wall_time:.1f}s wall time")

    single = run_script(
        script,
        [
            *tiny,
            *GLOBAL,
            "--local-num-envs",
            8,
            "--save-model",
            "--learner-device-ids",
            1,
            2,
            "--run-name",
            "one",
        ],
        tmp_path,
        devices=3,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    # Only process 0 writes the run folder.
    assert (
        json.loads((tmp_path / "runs" / "two" / "spec.json").read_text())["sizes"]["num_envs"] == 8
    )
    model = script.replace(".py", ".cleanba_model")
    assert (
        max_abs_difference(
            load_params(tmp_path / "runs" / "two" / model),
            load_params(tmp_path / "runs" / "one" / model),
        )
        < layout_atol
    )


@pytest.mark.long
def test_a_killed_peer_ends_the_run(tmp_path):
    processes = start_processes(
        "cleanba_ppo.py",
        [*TINY, *GLOBAL, "--local-num-envs", 4, "--total-timesteps", 100_000],
        tmp_path,
    )
    wait_for_line(processes[0], "update 1/")
    processes[1].kill()
    killed_at = time.time()
    _, stderr = processes[0].communicate(timeout=90)
    # The survivor's collective fails when the peer's connection closes: it names the peer in one
    # line and ends at once, not at JAX's heartbeat timeout (30 s).
    assert processes[0].returncode == 1 and time.time() - killed_at < 20, stderr[-3000:]
    assert stderr.splitlines()[-1] == (
        "error: distributed run broken: process 1 failed or left the run, and process 0 stops; "
        "continue with --resume from the newest checkpoint"
    ), stderr[-3000:]


def checkpoint_files(run_dir) -> list:
    return sorted((run_dir / "checkpoints").glob("*.ckpt"))


@pytest.fixture(scope="module")
def preempted_run(request, tmp_path_factory):
    """A run of the script given as parameter, stopped by SIGTERM after its third update, with a
    checkpoint after every update. Tests resume copies of it (`copy_of`), never the run itself."""
    script = request.param
    cwd = tmp_path_factory.mktemp("preempted")
    args = [
        *SCRIPTS[script][0],
        "--local-num-envs",
        4,
        "--total-timesteps",
        640,
        "--checkpoint-every",
        1,
        "--run-name",
        "run",
    ]
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "cleanba" / script), *map(str, args)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_line(proc, "update 3/")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and "continue with --resume" in stderr, stderr[
        -3000:
    ]
    return script, cwd, args


def copy_of(preempted_run, tmp_path):
    """The preempted run's working folder copied into this test's own folder, so that what one test
    does to it (resume it, damage a checkpoint) no other test sees: each passes alone and in any
    order."""
    script, cwd, args = preempted_run
    copy = tmp_path / "preempted"
    shutil.copytree(cwd, copy)
    return script, copy, args


# Resumes a run, saving the first observations of every environment instance the script makes (by
# its seed and number of environments) to first_observations.npz.
RECORDING_RESUME = """
import importlib
import sys

import numpy as np

script = importlib.import_module("cleanba." + sys.argv[1])
make_env = script.make_env
first = {}


class Recording:
    def __init__(self, envs, seed):
        self.envs = envs
        self.seed = seed

    def __getattr__(self, name):
        return getattr(self.envs, name)

    def reset(self, *env_ids):
        obs, info = self.envs.reset(*env_ids)
        first.setdefault(f"{self.seed}_{len(obs)}", np.array(obs))
        return obs, info


script.make_env = lambda args, seed, num_envs: Recording(make_env(args, seed, num_envs), seed)
script.main(sys.argv[2:])
np.savez("first_observations.npz", **first)
"""


@pytest.mark.parametrize("preempted_run", SCRIPTS, indirect=True)
def test_sigterm_saves_and_resume_finishes_the_run(preempted_run, tmp_path):
    script, cwd, args = copy_of(preempted_run, tmp_path)
    run_dir = cwd / "runs" / "run"
    stopped_at = int(checkpoint_files(run_dir)[-1].stem.split("_")[1])
    assert 3 <= stopped_at < 5 and len(checkpoint_files(run_dir)) == 2
    result = subprocess.run(
        [sys.executable, "-c", RECORDING_RESUME, script[:-3], *map(str, [*args, "--resume"])],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # What docs/checkpoints.md says a resumed Atari run is: the learner of the checkpoint, with
    # environments made anew from the run's seeds, which start where the run's environments started.
    module = importlib.import_module("cleanba." + script[:-3])
    parsed = module.parse_args(list(map(str, args)))
    first = np.load(cwd / "first_observations.npz")
    assert f"{parsed.seed}_{parsed.local_num_envs}" in first  # the first actor thread's
    for key, obs in first.items():
        fresh, _ = module.make_env(parsed, int(key.split("_")[0]), len(obs)).reset()
        np.testing.assert_array_equal(obs, fresh)
    assert f"resuming run from update {stopped_at}" in result.stdout
    assert (run_dir / f"spec_resume_{stopped_at}.json").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 640 and summary["learner_policy_version"] == 5
    assert fingerprint_of(result)
    # TensorBoard sees each update once: what followed the checkpoint before the signal is purged.
    assert [v for _, v in scalars(run_dir, "stats/learner_policy_version")] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("preempted_run", ["cleanba_ppo.py"], indirect=True)
def test_resume_with_every_checkpoint_damaged_is_one_line_exit_2_and_touches_nothing(
    preempted_run, tmp_path
):
    # Before, the run started afresh with warnings, and its checkpoints of low updates were pruned
    # beside the damaged ones of higher updates: a requeued job started from zero each time.
    script, cwd, args = copy_of(preempted_run, tmp_path)
    run_dir = cwd / "runs" / "run"
    for path in checkpoint_files(run_dir):
        path.write_bytes(path.read_bytes()[: CHECKSUM_BYTES + 10])
    before = sorted((p.relative_to(cwd), p.stat().st_mtime_ns) for p in cwd.rglob("*"))
    result = run_script(script, [*args, "--resume", "--run-name", "run"], cwd)
    assert result.returncode == 2, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: --resume: no checkpoint in runs/run/checkpoints can be")
    assert "Traceback" not in result.stderr
    assert sorted((p.relative_to(cwd), p.stat().st_mtime_ns) for p in cwd.rglob("*")) == before


# Checkpoint files are the scripts' shared code: one script suffices.
@pytest.mark.parametrize("preempted_run", ["cleanba_ppo.py"], indirect=True)
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(preempted_run, tmp_path):
    script, cwd, args = copy_of(preempted_run, tmp_path)
    run_dir = cwd / "runs" / "run"
    newest, previous = checkpoint_files(run_dir)[-1], checkpoint_files(run_dir)[-2]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    result = run_script(script, [*args, "--resume", "--run-name", "run"], cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "damaged" in result.stderr
    assert f"resuming run from update {int(previous.stem.split('_')[1])}" in result.stdout


def test_resume_without_checkpoint_starts_fresh(tmp_path):
    args = [
        *TINY,
        "--local-num-envs",
        4,
        "--total-timesteps",
        128,
        "--resume",
        "--run-name",
        "fresh",
    ]
    result = run_script("cleanba_ppo.py", args, tmp_path)
    assert result.returncode == 0 and "resuming" not in result.stdout
    assert (
        json.loads((tmp_path / "runs" / "fresh" / "summary.json").read_text())[
            "learner_policy_version"
        ]
        == 1
    )
