"""What a process of a --distributed run asks JAX to make visible. Under SLURM, JAX's default is one
device per process (the one of its SLURM_LOCALID): the paper's a0-l1,2,3-d2 layout would start with
one device instead of four. No GPU is needed to see what JAX was asked for: `jax.distributed`
records it as `jax_cuda_visible_devices` (tests/device_probe.py prints it)."""

import os
import subprocess
import sys

import jax
import pytest
from helpers import REPO, run_by_hand_under_slurm

from cleanba_utils import distributed

PROBE = [sys.executable, str(REPO / "tests" / "device_probe.py")]
WORKSTATION = ["--distributed", "--actor-device-ids", "0", "--learner-device-ids", "1", "2", "3"]


def probed_by_hand(tmp_path, script_and_args: list, gpus_of) -> list[str]:
    """Two processes with SLURM's variables set by hand (`run_by_hand_under_slurm`), 4 host devices
    each; the stdout of each."""
    results = run_by_hand_under_slurm(
        [*PROBE, *script_and_args], tmp_path, gpus_of, devices=4, timeout=120
    )
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    return [result.stdout for result in results]


def test_the_original_readmes_two_terminal_run_sees_four_devices_per_process(tmp_path):
    """The original cleanba README's two-terminal example: SLURM's variables set by hand, 4 GPUs per
    process through CUDA_VISIBLE_DEVICES, both processes of local rank 0."""
    outputs = probed_by_hand(
        tmp_path,
        ["cleanba_ppo", "--env-id", "CartPole-v1", *WORKSTATION],
        gpus_of=lambda process: ",".join(str(4 * process + gpu) for gpu in range(4)),
    )
    for process, stdout in enumerate(outputs):
        assert f"process {process}/2: jax_cuda_visible_devices=0,1,2,3 " in stdout, stdout


def test_a_gala_process_asks_for_one_device_per_agent_of_its_own(tmp_path):
    """GALA has no device ids: 4 agents over 2 processes are 2 devices each."""
    outputs = probed_by_hand(
        tmp_path,
        ["cleanba_gala_a2c", "--env-id", "CartPole-v1", "--num-agents", "4", "--distributed"],
        gpus_of=lambda process: None,
    )
    for process, stdout in enumerate(outputs):
        assert f"process {process}/2: jax_cuda_visible_devices=0,1 " in stdout, stdout


@pytest.mark.parametrize(
    "visible, num_layout_devices, expected",
    [
        ("4,5,6,7", 4, [0, 1, 2, 3]),  # every GPU SLURM gave the task, numbered from 0 by CUDA
        ("2,3", 4, [0, 1]),  # fewer than the layout needs: the device check names them
        ("", 3, [0, 1, 2]),  # no GPUs listed (hand-set variables, CPUs): 0 .. the largest id
        (None, 1, [0]),
    ],
)
def test_a_process_asks_for_every_gpu_of_its_task(
    monkeypatch, visible, num_layout_devices, expected
):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert distributed.local_device_ids(num_layout_devices) == expected


def test_the_layouts_devices_reach_its_largest_id():
    class Layout:
        actor_device_ids = (0,)
        learner_device_ids = (2,)

    assert distributed.layout_devices(Layout) == 3


def test_a_device_the_task_was_not_given_is_named_with_what_slurm_gave(tmp_path):
    result = subprocess.run(
        [
            *[sys.executable, str(REPO / "cleanba" / "cleanba_ppo.py"), "--env-id", "CartPole-v1"],
            *["--actor-device-ids", "0", "--learner-device-ids", "1", "2", "3"],
        ],
        cwd=tmp_path,
        env=dict(
            os.environ,
            SLURM_JOB_ID="4242",
            CUDA_VISIBLE_DEVICES="3",
            SLURM_GPUS_PER_TASK="1",
            XLA_FLAGS="--xla_force_host_platform_device_count=1",
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        "error: --learner-device-ids must list distinct ids among the 1 local devices "
        "(0..0: cpu:0), got [1, 2, 3]; this SLURM task (job 4242) was given the GPUs "
        "CUDA_VISIBLE_DEVICES=3 (--gpus-per-task 1)"
    ), lines[0]


@pytest.mark.parametrize(
    "node_list, tasks_per_node, distribution, num_processes, expected",
    [
        ("gpu[1-2]", "1(x2)", None, 2, ["gpu1", "gpu2"]),
        ("gpu[1-3]", "2(x2),1", None, 5, ["gpu1", "gpu1", "gpu2", "gpu2", "gpu3"]),
        ("gpu[1-3]", "2(x2),1", "cyclic", 5, ["gpu1", "gpu2", "gpu3", "gpu1", "gpu2"]),
        ("gpu[1-2]", "2,1", "block:cyclic", 3, ["gpu1", "gpu1", "gpu2"]),
        ("gpu[1-2]", "2,1", None, 5, None),  # 3 tasks, but the run has 5 processes
        ("gpu[1-2]", "1(x2)", "plane=2", 2, None),  # another order
    ],
)
def test_the_node_of_each_process_under_srun(
    tmp_path, monkeypatch, node_list, tasks_per_node, distribution, num_processes, expected
):
    """What a survivor names the lost peer by: SLURM's node list expanded by `scontrol show
    hostnames` (here a stand-in that expands gpu[1-N]), each node given its tasks in SLURM's
    order."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        "#!/bin/sh\n"
        '[ "$1 $2" = "show hostnames" ] || exit 1\n'
        'n=$(echo "$3" | sed "s/.*-\\([0-9]*\\)]/\\1/"); seq -f "gpu%g" 1 "$n"\n'
    )
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_STEP_NODELIST", node_list)
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", tasks_per_node)
    if distribution:
        monkeypatch.setenv("SLURM_DISTRIBUTION", distribution)
    else:
        monkeypatch.delenv("SLURM_DISTRIBUTION", raising=False)
    assert distributed.slurm_nodes_of_processes(num_processes) == expected


@pytest.mark.parametrize(
    "error, broken",
    [
        (
            ValueError("UNKNOWN: Gloo AllGather failed: [pair.cc:538] Connection reset by peer"),
            True,
        ),
        (jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather: Connection closed by peer"), True),
        (ValueError("Incompatible shapes for broadcasting: (4,) and (3,)"), False),
        (
            OSError("Connection reset by peer"),
            False,
        ),  # a socket of the script's own, not a collective
    ],
)
def test_a_collective_that_lost_its_peer_is_told_from_other_errors(error, broken):
    """What process_allgather (ValueError) and a pmapped collective (JaxRuntimeError) raise when a
    peer's connection closes, as seen on the local 2-node cluster."""
    assert distributed.is_broken_run(error) == broken
