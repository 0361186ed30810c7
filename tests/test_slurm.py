"""The SLURM path on a real cluster (benchmark/slurm_local.sh start): a job array submitted by the
launcher, with a failing task, and a requeued task that resumes. Skipped where no cluster answers
`sinfo`; `.ci/run` starts the local one first."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from helpers import REPO, launch, run_script


def cluster_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


CLUSTER = cluster_answers()
pytestmark = pytest.mark.skipif(
    not CLUSTER, reason="no SLURM cluster answers sinfo (start one: benchmark/slurm_local.sh start)"
)

SLURM = [
    *["--slurm-template-path", REPO / "cleanba.slurm_template", "--slurm-gpus-per-task", 0],
    *["--slurm-total-cpus", 1, "--workers", 2],
]
PPO = (
    f"python {REPO}/cleanba/cleanba_ppo.py --hiddens 16 --local-num-envs 4 --num-actor-threads 1 "
    "--num-steps 32 --total-timesteps 512"
)


def tasks_env() -> dict:
    """The tasks start `python`: this environment's, first on the PATH that sbatch passes on."""
    bin_dir = os.path.dirname(sys.executable)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def state_of(task: str) -> str:
    squeue = ["squeue", "--noheader", "--array", f"--jobs={task}", "--format=%T"]
    return subprocess.run(squeue, capture_output=True, text=True).stdout.strip()


def summary(cwd, run_name: str) -> dict:
    return json.loads((cwd / "runs" / run_name / "summary.json").read_text())


def test_a_job_array_runs_its_tasks_and_names_the_failing_one(tmp_path):
    result = launch(
        tmp_path,
        *["--env-ids", "CartPole-v1", "--experiment", "array", "--command", PPO],
        *["--sweep", "--learning-rate=2.5e-4,nan", *SLURM, "--slurm-wait"],
        env=tasks_env(),
    )
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-2] == "2 runs: 1 exited 0, 1 failed"
    assert lines[-1].startswith(
        "  exit 2: CartPole-v1__array__1__1: "
        "error: --learning-rate must be a finite number, got nan"
    )
    # The task's run is the run launched without SLURM.
    argv = [*PPO.split()[2:], "--env-id", "CartPole-v1", "--seed", "1", "--run-name", "local"]
    local = run_script("cleanba_ppo.py", argv, tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    fingerprint = summary(tmp_path, "local")["params_fingerprint"]
    assert summary(tmp_path, "CartPole-v1__array__0__1")["params_fingerprint"] == fingerprint


def test_a_requeued_task_saves_resumes_and_ends_as_if_never_stopped(tmp_path):
    # SAC resumes bit for bit: `scontrol requeue` while it trains (SIGTERM to the task, a
    # checkpoint, the task queued again and started with --resume) changes nothing in its
    # parameters.
    sac = (
        f"python {REPO}/cleanba/cleanba_sac.py --hiddens 16 16 --batch-size 32 "
        "--num-steps 16 --local-num-envs 4 --learning-starts 128 --total-timesteps 6400"
    )
    submitted = launch(
        tmp_path,
        *["--env-ids", "Hopper-v4", "--experiment", "requeued", "--command", sac, *SLURM],
        env=tasks_env(),
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = submitted.stdout.split("submitted job array ")[1].split()[0]
    task_log = tmp_path / "runs" / "_launcher" / "requeued" / f"requeued_{job_id}_0.log"
    deadline = time.time() + 120
    while "update 20/" not in (task_log.read_text() if task_log.exists() else ""):
        assert time.time() < deadline, task_log.read_text() if task_log.exists() else "no log"
        time.sleep(0.2)
    subprocess.run(["scontrol", "requeue", f"{job_id}_0"], check=True)
    # SLURM holds a requeued task back for 2 minutes (BeginTime); let it go a few seconds after it
    # waits (at once, SLURM can fail it: "Job credential revoked").
    deadline = time.time() + 60
    while state_of(f"{job_id}_0") != "PENDING":
        assert time.time() < deadline, task_log.read_text()
        time.sleep(0.2)
    time.sleep(5)
    subprocess.run(["scontrol", "update", f"JobId={job_id}_0", "StartTime=now"], check=True)
    # The stopped task wrote its exit code (143) before SLURM queued it again; the launcher reads
    # the file once the task has left the queue, when the resumed run has written its own.
    exit_file = task_log.parent / f"{job_id}_0.exit"
    deadline = time.time() + 300
    while state_of(f"{job_id}_0") or not exit_file.exists():
        assert time.time() < deadline, task_log.read_text()
        time.sleep(0.5)
    text = task_log.read_text()
    assert exit_file.read_text().strip() == "0", text[-3000:]
    assert "stopped by a signal after update" in text
    assert "resuming Hopper-v4__requeued__0__1" in text
    argv = [*sac.split()[2:], "--env-id", "Hopper-v4", "--seed", "1", "--run-name", "local"]
    local = run_script("cleanba_sac.py", argv, tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    fingerprint = summary(tmp_path, "local")["params_fingerprint"]
    assert summary(tmp_path, "Hopper-v4__requeued__0__1")["params_fingerprint"] == fingerprint


def test_each_srun_task_asks_jax_for_every_device_of_the_workstation_layout(tmp_path):
    """The paper's a0-l1,2,3-d2 layout under a 2-task srun: each process asks JAX for devices 0 to
    3, not for the one device of its SLURM_LOCALID (JAX's default under SLURM)."""
    result = subprocess.run(
        [
            *["srun", "--ntasks", "2", "--cpus-per-task", "1", sys.executable],
            *[str(REPO / "tests" / "device_probe.py"), "cleanba_ppo", "--env-id", "CartPole-v1"],
            *["--distributed", "--actor-device-ids", "0", "--learner-device-ids", "1", "2", "3"],
        ],
        cwd=tmp_path,
        env=dict(tasks_env(), XLA_FLAGS="--xla_force_host_platform_device_count=4"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("process "))
    assert lines == [
        "process 0/2: jax_cuda_visible_devices=0,1,2,3 local_devices=4",
        "process 1/2: jax_cuda_visible_devices=0,1,2,3 local_devices=4",
    ], result.stdout + result.stderr


def test_a_users_scancel_ends_the_task_for_good_keeping_its_checkpoint(tmp_path):
    """Two tasks of one array: `scancel` of task 0, `scancel --signal=TERM` of task 1. Each run
    saves a checkpoint and its task ends; neither the batch script nor SLURM queues it again."""
    long_ppo = PPO.replace("--total-timesteps 512", "--total-timesteps 2000000")
    submitted = launch(
        tmp_path,
        *["--env-ids", "CartPole-v1", "--experiment", "cancelled", "--command", long_ppo],
        *["--num-seeds", "2", *SLURM],
        env=tasks_env(),
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = submitted.stdout.split("submitted job array ")[1].split()[0]
    log_dir = tmp_path / "runs" / "_launcher" / "cancelled"
    for task, how in enumerate([["scancel"], ["scancel", "--signal=TERM"]]):
        task_log = log_dir / f"cancelled_{job_id}_{task}.log"
        deadline = time.time() + 180
        while "update 10/" not in (task_log.read_text() if task_log.exists() else ""):
            assert time.time() < deadline, task_log.read_text() if task_log.exists() else "no log"
            time.sleep(0.2)
        subprocess.run([*how, f"{job_id}_{task}"], check=True)
    for task in range(2):
        deadline = time.time() + 60
        while state_of(f"{job_id}_{task}"):
            assert time.time() < deadline, state_of(f"{job_id}_{task}")
            time.sleep(0.2)
    # A requeue would show a task pending again within a second or two.
    time.sleep(3)
    for task in range(2):
        text = (log_dir / f"cancelled_{job_id}_{task}.log").read_text()
        assert state_of(f"{job_id}_{task}") == "", text[-3000:]
        assert "requeueing" not in text
        assert "stopped by a signal after update" in text, text[-3000:]
        run_dir = tmp_path / "runs" / f"CartPole-v1__cancelled__0__{task + 1}"
        assert [path.suffix for path in (run_dir / "checkpoints").glob("*")] == [".ckpt"]
