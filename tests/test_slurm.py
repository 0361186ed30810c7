"""The SLURM path on a real cluster (benchmark/slurm_local.sh start): a job array submitted by the
launcher, with a failing task, and a requeued task that resumes. Skipped where no cluster answers
`sinfo` (failed with CLEANBA_REQUIRE_ALL_TESTS=1, as `.ci/run` sets, which starts the local one
first)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    PPO_LAYOUT_ATOL,
    REPO,
    launch,
    load_params,
    max_abs_difference,
    run_script,
    skip_unless_required,
)
from test_ppo_continuous import LAYOUT_ATOL as PPO_CONTINUOUS_LAYOUT_ATOL


def cluster_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


CLUSTER = cluster_answers()
NO_CLUSTER = (
    "no SLURM cluster answers sinfo (start one as root: bash benchmark/slurm_local.sh start "
    "--nodes 2)"
)


@pytest.fixture(autouse=True)
def cluster():
    """Every test of this file needs the cluster."""
    if not CLUSTER:
        skip_unless_required(NO_CLUSTER)


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


def restarts_of(task: str) -> int | None:
    """How many times SLURM has queued the task again; None once it has forgotten the task
    (MinJobAge seconds after its end)."""
    show = ["scontrol", "show", "job", "--oneliner", task]
    match = re.search(
        r"\bRestarts=(\d+)", subprocess.run(show, capture_output=True, text=True).stdout
    )
    return int(match.group(1)) if match else None


def kill_wait_seconds() -> int:
    """The cluster's KillWait: the seconds between the SIGTERM and the SIGKILL with which SLURM ends
    a job's processes."""
    config = subprocess.run(
        ["scontrol", "show", "config"], capture_output=True, text=True, check=True
    ).stdout
    return int(re.search(r"^KillWait\s*=\s*(\d+) sec", config, re.M).group(1))


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


# In the long checks (`-m long`): its job costs the README's test command about 45 s of a worker.
@pytest.mark.long
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
    ended_at = time.time()
    # A requeue puts the task back in the queue as soon as it is asked for (PENDING, held for
    # SLURM's 2 minutes, its Restarts counted up), by the batch script before it ends or by a
    # process of the task that outlives it: on slurm_local.sh's cluster, a task whose batch script
    # left `sleep 8; scontrol requeue` behind was pending again 8 s after it had ended. SLURM ends
    # the processes it tracks of an ended task with SIGTERM and, KillWait seconds later (30 s in
    # slurm_local.sh's slurm.conf, SLURM's default), SIGKILL: the queue is watched that long after
    # the last task ended, plus 5 s for the controller. Nothing else requeues a cancelled or failed
    # task (SLURM requeues running jobs, on a node's failure or a preemption).
    deadline = ended_at + kill_wait_seconds() + 5
    while True:
        for task in range(2):
            text = (log_dir / f"cancelled_{job_id}_{task}.log").read_text()
            assert state_of(f"{job_id}_{task}") == "", text[-3000:]
            assert restarts_of(f"{job_id}_{task}") in (0, None), text[-3000:]
        if time.time() > deadline:
            break
        time.sleep(0.5)
    for task in range(2):
        text = (log_dir / f"cancelled_{job_id}_{task}.log").read_text()
        assert "requeueing" not in text
        assert "stopped by a signal after update" in text, text[-3000:]
        run_dir = tmp_path / "runs" / f"CartPole-v1__cancelled__0__{task + 1}"
        assert [path.suffix for path in (run_dir / "checkpoints").glob("*")] == [".ckpt"]


def nodes_up() -> list[str]:
    """The cluster's nodes that answer (idle or running jobs)."""
    sinfo = ["sinfo", "--noheader", "--Node", "--format=%N %T"]
    out = subprocess.run(sinfo, capture_output=True, text=True).stdout if CLUSTER else ""
    return sorted(
        {
            line.split()[0]
            for line in out.splitlines()
            if line.split()[1].startswith(("idle", "mixed", "allocated"))
        }
    )


@pytest.fixture
def two_nodes():
    if len(nodes_up()) < 2:
        skip_unless_required(
            "the SLURM cluster has fewer than 2 nodes that answer (start two as root: bash "
            "benchmark/slurm_local.sh start --nodes 2)"
        )


TWO_NODES = ["--slurm-nodes", "2", "--slurm-ntasks", "2", "--slurm-total-cpus", "2"]
# One process per node with 4 environments, against one process with 8 and two learner devices:
# the same global configuration (the layout tolerances of tests/test_ppo.py and
# tests/test_ppo_continuous.py).
ACROSS_NODES = {
    "cleanba_ppo.py": (
        "CartPole-v1",
        "--hiddens 16 --num-actor-threads 1 --num-steps 32 --total-timesteps 512",
        PPO_LAYOUT_ATOL,
    ),
    "cleanba_ppo_continuous.py": (
        "HalfCheetah-v4",
        "--num-steps 16 --num-minibatches 2 --update-epochs 2 --total-timesteps 192",
        PPO_CONTINUOUS_LAYOUT_ATOL,
    ),
}


def job_nodes(task_log) -> list[str]:
    """The nodes that the template's first line names ("task 0 (job …) on NODES: command")."""
    node_list = task_log.read_text().splitlines()[0].split(" on ")[1].split(":")[0]
    hostnames = ["scontrol", "show", "hostnames", node_list]
    return subprocess.run(hostnames, capture_output=True, text=True).stdout.split()


@pytest.mark.usefixtures("two_nodes")
@pytest.mark.parametrize("script", ACROSS_NODES)
def test_a_run_across_two_nodes_is_the_one_process_run_up_to_rounding(tmp_path, script):
    env_id, options, layout_atol = ACROSS_NODES[script]
    command = f"python {REPO}/cleanba/{script} {options} --local-num-envs 4 --save-model"
    result = launch(
        tmp_path,
        *["--env-ids", env_id, "--experiment", "nodes", "--command", f"{command} --distributed"],
        *SLURM,
        *TWO_NODES,
        "--slurm-wait",
        env=tasks_env(),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    [task_log] = (tmp_path / "runs" / "_launcher" / "nodes").glob("nodes_*_0.log")
    assert len(job_nodes(task_log)) == 2, task_log.read_text()[-3000:]
    argv = [*options.split(), "--env-id", env_id, "--local-num-envs", 8, "--save-model"]
    argv += ["--learner-device-ids", 0, 1, "--run-name", "one"]
    one = run_script(script, argv, tmp_path, devices=2)
    assert one.returncode == 0, one.stderr[-3000:]
    model = script.replace(".py", ".cleanba_model")
    across = load_params(tmp_path / "runs" / f"{env_id}__nodes__0__1" / model)
    assert max_abs_difference(across, load_params(tmp_path / "runs" / "one" / model)) < layout_atol


def local_cluster_nodes() -> list[str]:
    """The nodes of benchmark/slurm_local.sh's cluster, which can kill and revive them."""
    path = Path(os.environ.get("CLEANBA_SLURM_DIR", "/tmp/cleanba-slurm")) / "nodes"
    return nodes_up() if path.exists() and int(path.read_text()) >= 2 else []


def node_of_batch(task: str) -> str:
    squeue = ["squeue", "--noheader", "--array", f"--jobs={task}", "--format=%B"]
    return subprocess.run(squeue, capture_output=True, text=True).stdout.strip()


@pytest.mark.long
def test_a_node_that_dies_ends_its_job_which_slurm_requeues_and_the_run_resumes_to_its_end(
    tmp_path,
):
    """Continuous PPO (resumes bit for bit) across two nodes, a checkpoint every 10 updates. Once
    it has passed update 40, the node without the batch script dies (its slurmd and job steps
    SIGKILLed): the surviving process stops with a line naming the lost peer, SLURM requeues the
    job for its node's failure, and once the node is back the run resumes from its newest
    checkpoint and ends with the fingerprint of the same run uninterrupted."""
    if len(local_cluster_nodes()) < 2:
        skip_unless_required(
            "no 2-node cluster of benchmark/slurm_local.sh, whose nodes this test kills and "
            "revives, answers (start it as root: bash benchmark/slurm_local.sh start --nodes 2)"
        )
    command = (
        f"python {REPO}/cleanba/cleanba_ppo_continuous.py --num-steps 16 "
        "--num-minibatches 2 --update-epochs 2 --local-num-envs 4 --log-frequency 1 "
        "--total-timesteps 25600 --checkpoint-every 10 --distributed"
    )
    submitted = launch(
        tmp_path,
        *["--env-ids", "HalfCheetah-v4", "--experiment", "failed", "--command", command, *SLURM],
        *TWO_NODES,
        env=tasks_env(),
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = submitted.stdout.split("submitted job array ")[1].split()[0]
    task = f"{job_id}_0"
    task_log = tmp_path / "runs" / "_launcher" / "failed" / f"failed_{task}.log"
    deadline = time.time() + 180
    while "update 40/" not in (task_log.read_text() if task_log.exists() else ""):
        assert time.time() < deadline, task_log.read_text() if task_log.exists() else "no log"
        time.sleep(0.2)
    [victim] = [node for node in job_nodes(task_log) if node != node_of_batch(task)]
    slurm_local = ["bash", REPO / "benchmark" / "slurm_local.sh"]
    subprocess.run([*slurm_local, "kill-node", victim], check=True, capture_output=True)
    try:
        deadline = time.time() + 120
        while not state_of(task).startswith("PENDING"):
            assert time.time() < deadline, task_log.read_text()[-3000:]
            time.sleep(0.5)
    finally:
        subprocess.run([*slurm_local, "revive-node", victim], check=True, capture_output=True)
    text = task_log.read_text()
    assert (
        f"error: distributed run broken: process 1 (node {victim}) failed or left the run, and "
        "process 0 stops" in text
    ), text[-3000:]
    deadline = time.time() + 60
    while victim not in nodes_up():
        assert time.time() < deadline, "the revived node did not come back"
        time.sleep(0.5)
    time.sleep(5)
    subprocess.run(["scontrol", "update", f"JobId={task}", "StartTime=now"], check=True)
    exit_file = task_log.parent / f"{job_id}_0.exit"
    deadline = time.time() + 300
    while state_of(task) or not exit_file.exists():
        assert time.time() < deadline, task_log.read_text()[-3000:]
        time.sleep(0.5)
    text = task_log.read_text()
    assert exit_file.read_text().strip() == "0", text[-3000:]
    assert "resuming HalfCheetah-v4__failed__0__1 from update 40" in text, text[-3000:]
    reference = launch(
        tmp_path,
        *["--env-ids", "HalfCheetah-v4", "--experiment", "whole", "--command", command, *SLURM],
        *[*TWO_NODES, "--slurm-wait"],
        env=tasks_env(),
    )
    assert reference.returncode == 0, reference.stdout + reference.stderr
    assert (
        summary(tmp_path, "HalfCheetah-v4__failed__0__1")["params_fingerprint"]
        == summary(tmp_path, "HalfCheetah-v4__whole__0__1")["params_fingerprint"]
    )
