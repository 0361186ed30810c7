"""--resume refuses a checkpoint of another experiment: another script, another option (except the
ones that leave the experiment the same), a checkpoint without a record of its options, and the
processes of a distributed run that found different checkpoints."""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys

import flax.serialization
import pytest
from helpers import REPO, TINY, run_script

from cleanba import (
    cleanba_apex_dpg,
    cleanba_apex_dqn,
    cleanba_gala_a2c,
    cleanba_impala,
    cleanba_ppo,
    cleanba_ppo_continuous,
    cleanba_sac,
)
from cleanba_utils import checkpoints
from cleanba_utils.run_args import RESUMABLE_CHANGES

SCRIPTS = [
    cleanba_apex_dpg,
    cleanba_apex_dqn,
    cleanba_gala_a2c,
    cleanba_impala,
    cleanba_ppo,
    cleanba_ppo_continuous,
    cleanba_sac,
]

# Two updates of 2 actor threads x 4 environments x 16 steps, a checkpoint after each.
BASE = [*TINY, "--local-num-envs", 4, "--total-timesteps", 256, "--checkpoint-every", 1]


# The comparison, on hand-built records


def test_changed_options_names_each_compared_option_with_both_values():
    saved = {
        "env_id": "Breakout-v5",
        "learning_rate": 0.00025,
        "hiddens": [32],
        "log_frequency": 10,
        "channels": None,
        "clip_vloss": False,
    }
    new = {
        "env_id": "Pong-v5",
        "learning_rate": 0.00025,
        "hiddens": [32, 32],
        "log_frequency": 1,
        "channels": None,
        "clip_vloss": True,
    }
    assert checkpoints.changed_options(saved, new, allowed={"log_frequency"}) == [
        "--env-id Breakout-v5 -> Pong-v5",
        "--hiddens 32 -> 32 32",
        "--clip-vloss False -> True",
    ]
    assert checkpoints.changed_options(saved, saved, allowed=set()) == []


def test_an_option_one_record_lacks_counts_as_changed():
    assert checkpoints.changed_options({"gamma": 0.99}, {"gamma": 0.99, "tau": 0.005}, set()) == [
        "--tau (not recorded) -> 0.005"
    ]
    assert checkpoints.changed_options({"gamma": 0.99, "tau": 0.005}, {"gamma": 0.99}, set()) == [
        "--tau 0.005 -> (no such option)"
    ]


def test_a_checkpoint_from_before_an_added_option_resumes_at_that_options_old_behaviour():
    # --env-params came with JAX environments: none is what every earlier version did.
    before = {"gamma": 0.99}
    assert checkpoints.changed_options(before, {"gamma": 0.99, "env_params": []}, set()) == []
    assert checkpoints.changed_options(
        before, {"gamma": 0.99, "env_params": ["max_steps_in_episode=10"]}, set()
    ) == ["--env-params (not recorded) -> max_steps_in_episode=10"]
    # --frame-stack came with Gymnasium's environments: 1, the image alone, as before.
    assert checkpoints.changed_options(before, {"gamma": 0.99, "frame_stack": 1}, set()) == []
    assert checkpoints.changed_options(before, {"gamma": 0.99, "frame_stack": 4}, set()) == [
        "--frame-stack (not recorded) -> 4"
    ]


SIZES = {"num_envs": 8, "steps_per_update": 128, "num_updates": 2}
RECORD = {
    "script": "cleanba_ppo.py",
    "args": {"seed": 1, "learning_rate": 0.00025, "local_num_envs": 4, "num_actor_threads": 2},
}
COUNTERS = {"update": 1, "wall_time_s": 1.0, "sizes": SIZES, "seed": 1, "options": RECORD}


def refusal(capsys, counters: dict, identity: dict, record: dict) -> str:
    """The one line that `refuse_another_experiment` prints as it exits 2."""
    with pytest.raises(SystemExit) as exit_:
        checkpoints.refuse_another_experiment("runs/r", counters, identity, record)
    lines = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_the_same_experiment_in_another_layout_resumes(capsys):
    # 8 environments as 2 threads x 4 or 1 thread x 8: the same global sizes.
    layout = {"local_num_envs": 8, "num_actor_threads": 1}
    record = {"script": "cleanba_ppo.py", "args": RECORD["args"] | layout}
    checkpoints.refuse_another_experiment("runs/r", COUNTERS, {"sizes": SIZES, "seed": 1}, record)
    assert capsys.readouterr().err == ""


def test_a_changed_option_is_refused(capsys):
    record = {"script": "cleanba_ppo.py", "args": RECORD["args"] | {"learning_rate": 0.001}}
    line = refusal(capsys, COUNTERS, {"sizes": SIZES, "seed": 1}, record)
    assert line.startswith("error: --resume: the checkpoint of runs/r is of another experiment: ")
    assert "--learning-rate 0.00025 -> 0.001;" in line


def test_other_global_sizes_are_refused_and_the_seed_is_named_once(capsys):
    record = {"script": "cleanba_ppo.py", "args": RECORD["args"] | {"local_num_envs": 8, "seed": 2}}
    identity = {"sizes": SIZES | {"num_envs": 16, "steps_per_update": 256}, "seed": 2}
    line = refusal(capsys, COUNTERS, identity, record)
    assert (
        "another experiment: --seed 1 -> 2, "
        "global sizes num_envs 8 -> 16, steps_per_update 128 -> 256;" in line
    )


def test_another_scripts_checkpoint_is_refused(capsys):
    record = {"script": "cleanba_impala.py", "args": RECORD["args"]}
    line = refusal(capsys, COUNTERS, {"sizes": SIZES, "seed": 1}, record)
    assert line.startswith(
        "error: --resume: the checkpoint of runs/r is cleanba_ppo.py's, not cleanba_impala.py's"
    )


def test_a_checkpoint_without_a_record_of_its_options_is_refused(capsys):
    counters = {key: value for key, value in COUNTERS.items() if key != "options"}
    line = refusal(capsys, counters, {"sizes": SIZES, "seed": 1}, RECORD)
    assert "predates the record of a run's options" in line
    assert "runs/r/spec.json" in line and "start a new run" in line


def test_options_that_change_the_data_are_compared():
    every_field = {field.name for script in SCRIPTS for field in dataclasses.fields(script.Args)}
    assert RESUMABLE_CHANGES <= every_field
    changing_the_data = {
        "seed",
        "env_id",
        "total_timesteps",
        "learning_rate",
        "num_steps",
        "concurrency",
        "hiddens",
        "num_agents",
        "topology",
        "checkpoint_replay",
    }
    assert not changing_the_data & RESUMABLE_CHANGES


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda script: script.__name__.split(".")[-1])
def test_every_scripts_record_survives_a_checkpoint(script):
    record = checkpoints.options_record(script.Args(), script.__file__)
    restored = flax.serialization.msgpack_restore(flax.serialization.msgpack_serialize(record))
    assert restored == record
    assert restored["script"] == os.path.basename(script.__file__)
    assert set(restored["args"]) == {field.name for field in dataclasses.fields(script.Args)}


# Real runs of PPO


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """The folder of a finished tiny PPO run, "base", checkpointed after both its updates."""
    cwd = tmp_path_factory.mktemp("checkpointed")
    result = run_script("cleanba_ppo.py", [*BASE, "--run-name", "base"], cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "runs" / "base"


def resumed(checkpointed, cwd, changes: list):
    """The run resumed in `cwd` from the checkpoint of its update 1, with `changes`."""
    shutil.copytree(checkpointed, cwd / "runs" / "base")
    os.remove(cwd / "runs" / "base" / "checkpoints" / "update_000000002.ckpt")
    return run_script("cleanba_ppo.py", [*BASE, "--run-name", "base", "--resume", *changes], cwd)


@pytest.mark.parametrize(
    "changes,line",
    [
        (["--learning-rate", 0.001], "--learning-rate 0.00025 -> 0.001;"),
        (["--env-id", "Pong-v5"], "--env-id Breakout-v5 -> Pong-v5;"),
        (
            ["--total-timesteps", 384],
            "--total-timesteps 256 -> 384, global sizes num_updates 2 -> 3;",
        ),
    ],
)
def test_a_resume_with_another_option_is_one_line_and_exit_2(checkpointed, tmp_path, changes, line):
    result = resumed(checkpointed, tmp_path, changes)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(
        "error: --resume: the checkpoint of runs/base is of another experiment: "
    )
    assert line in lines[0]


def test_a_resume_with_other_logging_and_checkpoints_continues(checkpointed, tmp_path):
    result = resumed(checkpointed, tmp_path, ["--log-frequency", 2, "--checkpoint-every", 2])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming base from update 1" in result.stdout
    summary = json.loads((tmp_path / "runs" / "base" / "summary.json").read_text())
    assert summary["learner_policy_version"] == 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_processes_that_found_other_checkpoints_stop_with_one_line(checkpointed, tmp_path):
    # Process 0's folder holds the run's checkpoints, process 1's none: a run folder that is not
    # shared between the nodes.
    shutil.copytree(checkpointed, tmp_path / "node0" / "runs" / "base")
    (tmp_path / "node1").mkdir()
    address = f"127.0.0.1:{free_port()}"
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO / "cleanba" / "cleanba_ppo.py"),
                *map(str, [*BASE, "--local-num-envs", 2, "--run-name", "base", "--resume"]),
                "--distributed",
                "--coordinator-address",
                address,
                "--num-processes",
                "2",
                "--process-id",
                str(process),
            ],
            cwd=tmp_path / f"node{process}",
            env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for process in range(2)
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=120)
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert process.returncode == 2 and len(errors) == 1, stderr[-3000:]
        assert errors[0] == (
            "error: --resume: the processes of this run found other checkpoints in runs/base "
            "(process 0 update 2, process 1 none); every process must read the same run folder "
            "(one shared between the nodes)"
        )
        assert "Traceback" not in stderr
