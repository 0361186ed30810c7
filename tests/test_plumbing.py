"""The run plumbing in cleanba_utils, module by module, without a training run."""

import dataclasses
import hashlib
import json
import os
import platform
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Literal, NamedTuple

import envpool
import flax.serialization
import jax
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from helpers import REPO, scalars, skip_unless_required
from tensorboardX import SummaryWriter

from cleanba_utils import (
    checkpoints,
    devices,
    env_records,
    fields,
    handoff,
    huge_pages,
    parsing,
    run_files,
    signals,
    threads,
)
from cleanba_utils.envs import MACHADO_ATARI, compiled_step, flat_observation
from cleanba_utils.episodes import Episodes
from cleanba_utils.run import open_run
from cleanba_utils.run_logs import RunLogs, duration
from cleanba_utils.stops import Stops


@dataclasses.dataclass
class Options:
    rate: float = 0.5
    """a float"""
    count: int = 3
    """an int"""
    replay_eviction_order: Literal["prioritized_by_priority", "first_in_first_out"] = (
        "first_in_first_out"
    )
    """a choice with names long enough that tyro wraps its error message over lines"""


# parsing


def test_parse_error_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        parsing.parse_args(Options, ["--count", "many"])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--count" in lines[0], lines


def test_a_wrapped_parse_error_keeps_its_whole_message_on_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        parsing.parse_args(Options, ["--replay-eviction-order", "last_in_first_out"])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    # The choices come after the line break of tyro's box.
    assert "'prioritized_by_priority', 'first_in_first_out'" in lines[0], lines


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_floats_are_refused_even_where_any_sign_is_allowed(capsys, value):
    with pytest.raises(SystemExit) as exit_:
        parsing.check_fields(parsing.parse_args(Options, ["--rate", value]))
    assert exit_.value.code == 2 and "--rate must be a finite number" in capsys.readouterr().err


@dataclasses.dataclass
class CheckedOptions:
    rate: float = fields.in_range(0.5, 0, 1, low_open=True)
    """a rate in (0, 1]"""
    count: int = fields.positive(3)
    """a positive count"""
    offset: float = fields.non_negative(0.0)
    """an offset of 0 or more"""
    exponent: float = fields.at_most(-0.5, 0)
    """an exponent of 0 or less"""
    threads: int | None = fields.positive(None)
    """unset, or a positive number of threads"""


def test_declared_checks_accept_their_bounds_and_refuse_beyond_in_one_line(capsys):
    parsing.check_fields(CheckedOptions())
    parsing.check_fields(CheckedOptions(rate=1.0, count=1, offset=0.0, exponent=0.0, threads=1))
    refusals = {
        "--rate must be in (0, 1], got 0.0": CheckedOptions(rate=0.0),
        "--rate must be in (0, 1], got 1.5": CheckedOptions(rate=1.5),
        "--count must be positive, got 0": CheckedOptions(count=0),
        "--offset must be non-negative, got -0.1": CheckedOptions(offset=-0.1),
        "--exponent must be at most 0, got 0.5": CheckedOptions(exponent=0.5),
        "--threads must be positive, got 0": CheckedOptions(threads=0),
    }
    for message, options in refusals.items():
        with pytest.raises(SystemExit) as exit_:
            parsing.check_fields(options)
        assert exit_.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"


def test_a_checked_field_keeps_its_default_and_docstring_in_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        parsing.parse_args(CheckedOptions, ["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0
    assert "a positive count (default: 3)" in help_text, help_text
    assert "an exponent of 0 or less (default: -0.5)" in help_text, help_text
    assert parsing.parse_args(CheckedOptions, ["--count", "7"]).count == 7


# threads


def test_a_blocked_queue_wait_ends_with_stopped_once_the_run_stops():
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    start = time.time()
    with pytest.raises(threads.Stopped):
        threads.queue_get(queue.Queue(), stop)
    with pytest.raises(threads.Stopped):
        full = queue.Queue(maxsize=1)
        full.put(0)
        threads.queue_put(full, 1, stop)
    assert time.time() - start < 2


def test_a_failing_thread_is_recorded_and_stops_the_others():
    stop, failures = threading.Event(), []

    def explode(message):
        raise RuntimeError(message)

    threads.start_thread(explode, "exploding", stop, failures, message="boom").join(timeout=5)
    wait_forever = lambda: threads.queue_get(queue.Queue(), stop)
    waiting = threads.start_thread(wait_forever, "waiting", stop, failures)
    waiting.join(timeout=5)
    assert stop.is_set() and not waiting.is_alive()
    assert len(failures) == 1 and "RuntimeError: boom" in failures[0]


# run files


def test_fingerprint_is_the_sha256_of_little_endian_float32_leaves_in_tree_order():
    # Leaves in key order: a = (1, 2), b = (0.5,); the digest of struct.pack("<3f", 1.0, 2.0, 0.5).
    tree = {"b": np.array([0.5], np.float64), "a": np.array([1, 2], np.int32)}
    expected = "fdd6aa4a2057d96e55c4c39c3048c44a5b8d508931201bcb4fc8b66771ae09f1"
    assert hashlib.sha256(struct.pack("<3f", 1.0, 2.0, 0.5)).hexdigest() == expected
    assert run_files.params_fingerprint(tree) == expected


@dataclasses.dataclass
class ScriptArgs:
    exp_name: str = "thing"
    """the name of the experiment"""
    hiddens: tuple[int, ...] = (1, 2)
    """a tuple, which msgpack stores as a list"""


def test_saved_model_holds_script_args_and_params(tmp_path):
    params = {"dense": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)}}
    path = run_files.save_model(ScriptArgs(), params, str(tmp_path), "/somewhere/cleanba_thing.py")
    with open(path, "rb") as f:
        saved = flax.serialization.msgpack_restore(f.read())
    assert os.path.basename(path) == "thing.cleanba_model" and saved["script"] == "cleanba_thing"
    assert saved["args"] == {"exp_name": "thing", "hiddens": [1, 2]}
    np.testing.assert_array_equal(saved["params"]["dense"]["kernel"], np.arange(6).reshape(2, 3))


# checkpoints


def replicated_state(value: float):
    """A TrainState as the learner holds it: one replica per learner device (here one)."""
    state = TrainState.create(
        apply_fn=None, params={"w": np.full(3, value, np.float32)}, tx=optax.sgd(0.1)
    )
    return devices.replicate(state, jax.local_devices()[:1]), state


def newest_restored(run_dir, template):
    """(state, counters) of the newest readable checkpoint of `run_dir`, `template` filled with its
    state, as `checkpoints.resume_from` reads it."""
    path, saved = checkpoints.newest_checkpoint(str(run_dir))
    return checkpoints.restored_state(path, template, saved["state"]), saved["counters"]


def test_checkpoint_round_trip_keeps_the_newest_two(tmp_path):
    for update in (1, 2, 3):
        checkpoints.save_checkpoint(
            str(tmp_path), replicated_state(float(update))[1], dict(update=update, seed=7)
        )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "update_000000002.ckpt",
        "update_000000003.ckpt",
    ]
    state, counters = newest_restored(tmp_path, replicated_state(0.0)[1])
    assert counters == {"update": 3, "seed": 7}
    np.testing.assert_array_equal(state.params["w"], [3.0, 3.0, 3.0])


def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    for update in (1, 2):
        checkpoints.save_checkpoint(
            str(tmp_path), replicated_state(float(update))[1], dict(update=update)
        )
    newest = tmp_path / "checkpoints" / "update_000000002.ckpt"
    data = bytearray(newest.read_bytes())
    data[-5] ^= 0xFF
    newest.write_bytes(bytes(data))
    state, counters = newest_restored(tmp_path, replicated_state(0.0)[1])
    assert (
        counters["update"] == 1
        and state.params["w"][0] == 1.0
        and "damaged" in capsys.readouterr().err
    )
    assert checkpoints.newest_checkpoint(str(tmp_path / "elsewhere")) is None


def damaged_checkpoints(tmp_path) -> list:
    """Three checkpoints, each damaged its own way: truncated, a byte changed, a folder in the place
    of the file (permissions cannot make a file unreadable to root, who runs CI)."""
    for update in (1, 2):
        checkpoints.save_checkpoint(
            str(tmp_path), replicated_state(float(update))[1], dict(update=update)
        )
    directory = tmp_path / "checkpoints"
    truncated = directory / "update_000000001.ckpt"
    truncated.write_bytes(truncated.read_bytes()[:40])
    changed = directory / "update_000000002.ckpt"
    data = bytearray(changed.read_bytes())
    data[-5] ^= 0xFF
    changed.write_bytes(bytes(data))
    (directory / "update_000000003.ckpt").mkdir()
    return sorted(p.name for p in directory.iterdir())


def test_checkpoints_all_damaged_are_one_line_and_exit_2_and_none_is_no_checkpoint(
    tmp_path, capsys
):
    names = damaged_checkpoints(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        checkpoints.newest_checkpoint(str(tmp_path))
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"error: --resume: no checkpoint in {tmp_path / 'checkpoints'} can be")
    for name in names:
        assert name in line
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == names
    # A folder without checkpoints is a fresh start, as documented.
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    assert checkpoints.newest_checkpoint(str(tmp_path / "empty")) is None


def test_pruning_keeps_every_checkpoint_of_a_later_update_than_the_one_written(tmp_path):
    for update in (5, 6):
        checkpoints.save_checkpoint(str(tmp_path), replicated_state(0.0)[1], dict(update=update))
    (tmp_path / "checkpoints" / "update_000000000.ckpt").mkdir()
    for update in (1, 2, 3):
        checkpoints.save_checkpoint(str(tmp_path), replicated_state(0.0)[1], dict(update=update))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "update_000000000.ckpt",
        "update_000000002.ckpt",
        "update_000000003.ckpt",
        "update_000000005.ckpt",
        "update_000000006.ckpt",
    ]


def test_a_checkpoint_of_another_version_is_one_line_and_exit_2(tmp_path, capsys):
    # A checkpoint without a field the script's checkpoints now hold (as continuous PPO's and Ape-X
    # DPG's before they saved their environments).
    checkpoints.save_checkpoint(str(tmp_path), {"learner": np.zeros(2)}, dict(update=3))
    with pytest.raises(SystemExit) as exit_:
        newest_restored(tmp_path, {"learner": np.zeros(2), "env_record": np.zeros(1)})
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2 and len(stderr.splitlines()) == 1
    assert stderr.startswith("error: --resume: ") and "another version" in stderr


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path, capsys):
    record = checkpoints.options_record(Options(), "script.py")
    counters = dict(update=1, seed=1, options=record)
    checkpoints.save_checkpoint(str(tmp_path), replicated_state(1.0)[1], counters)
    template = replicated_state(0.0)[1]
    resumed = checkpoints.resume_from(str(tmp_path), template, dict(seed=1), record)
    assert resumed[1]["update"] == 1
    with pytest.raises(SystemExit) as exit_:
        checkpoints.resume_from(str(tmp_path), template, dict(seed=2), record)
    assert exit_.value.code == 2 and "of another experiment" in capsys.readouterr().err


# signals


def test_stop_signals_are_noted_and_handed_to_a_thread_at_once():
    previous = {signum: signal.getsignal(signum) for signum in signals.WATCHED_SIGNALS}
    stops = []
    stopped = threading.Event()
    try:
        signal.signal(
            signal.SIGINT, signal.SIG_IGN
        )  # as a process started in the background inherits it
        received = signals.catch_stop_signals(lambda signum: [stops.append(signum), stopped.set()])
        assert signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopped.wait(5)
        time.sleep(0.2)
        # The first stop signal is acted on; a later one is not noted.
        assert received == [signal.SIGUSR1] and stops == [signal.SIGUSR1]
        assert signals.stop_agreement([], 1, distributed=False)(received)
        assert not signals.stop_agreement([], 1, distributed=False)([])
        assert (
            signals.exit_code_of(received) == 128 + signal.SIGUSR1
            and signals.exit_code_of([]) == 143
        )
    finally:
        signals.WATCHER.on_stop = signals.exit_at_once
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# The main thread waits in C (a pipe read) for 60 s, as a learner waits for a computation: only the
# watcher thread sees the signals. One Ctrl-C under `uv run` is two SIGINTs 0.2 s apart.
CTRL_C_PROGRAM = """
import os, sys, threading
from cleanba_utils import signals

signals.catch_stop_signals(lambda signum: print("stop", signum, flush=True))
print("ready", flush=True)
read_end, _ = os.pipe()
threading.Timer(60, lambda: os._exit(0)).start()
os.read(read_end, 1)
"""


def test_one_ctrl_c_is_one_stop_and_a_second_one_quits_at_once():
    proc = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_PROGRAM],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline() == f"stop {int(signal.SIGINT)}\n"
    time.sleep(1.5)
    proc.send_signal(signal.SIGTERM)  # after a Ctrl-C: not noted
    proc.send_signal(signal.SIGINT)
    start = time.time()
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.time() - start < 5
    assert stdout == "" and stderr == "interrupted again: quitting\n"


# environment records


def replayed_envs(env_id: str, record: env_records.EnvRecord, **config):
    envs = envpool.make(env_id, env_type="gymnasium", num_envs=2, seed=7, **config)
    return envs, env_records.fast_forward(envs, record)[0]


def played_envs(env_id: str, actions, **config):
    """Two environments that play `actions` (steps, envs, ...), and their record."""
    envs = envpool.make(env_id, env_type="gymnasium", num_envs=2, seed=7, **config)
    spec = envpool.make_spec(env_id, **config)
    record = env_records.EnvRecord(
        resets=np.zeros(2, np.int64),
        episode_actions=np.zeros((2, spec.config.max_episode_steps, *actions.shape[2:])),
        episode_lengths=np.zeros(2, np.int64),
    )
    envs.reset()
    next_is_reset = np.zeros(2, bool)
    for action in actions:
        obs, _, terminated, truncated, _ = envs.step(action)
        env_records.record_step(record, action, next_is_reset)
        next_is_reset = terminated | truncated
    assert record.resets.min() >= 1  # episodes ended: the record's resets are exercised
    return envs, flat_observation(obs), record


def test_a_mujoco_environment_comes_back_from_its_resets_and_its_episodes_actions():
    actions = np.random.default_rng(0).uniform(-1, 1, (300, 2, 3))  # Hopper: episodes of ~20 steps
    envs, obs, record = played_envs("Hopper-v4", actions)
    replayed, replayed_obs = replayed_envs("Hopper-v4", record)
    np.testing.assert_array_equal(replayed_obs, obs)
    more = np.random.default_rng(1).uniform(-1, 1, (20, 2, 3))
    for action in more:
        np.testing.assert_array_equal(replayed.step(action)[0], envs.step(action)[0])


@pytest.mark.parametrize(
    "env_id, action_dim",
    [("Hopper-v4", 3), ("Pendulum-v1", 1), ("CheetahRun-v1", 6)],
)
def test_the_compiled_step_gives_what_envpools_python_step_gives(env_id, action_dim):
    # Hopper takes float64 actions and ends episodes within the 300 steps (envpool's reset steps
    # included), Pendulum takes float32 ones, CheetahRun observes a dict. The float32 actions are
    # what the compiled rollouts hand over.
    actions = np.random.default_rng(0).uniform(-1, 1, (300, 2, action_dim)).astype(np.float32)
    python_envs = envpool.make(env_id, env_type="gymnasium", num_envs=2, seed=7)
    expected_obs = [flat_observation(python_envs.reset()[0])]
    expected = []
    for action in actions:
        obs, reward, terminated, truncated, _ = python_envs.step(action)
        expected_obs.append(flat_observation(obs))
        expected.append((reward, terminated, truncated))
    compiled_envs = envpool.make(env_id, env_type="gymnasium", num_envs=2, seed=7)
    first_obs = flat_observation(compiled_envs.reset()[0])

    def scan_step(handle, action):
        # envpool's step ignores the step index, which a JAX environment's keys take.
        handle, *outputs = step(handle, action, 0)
        return handle, outputs

    with jax.enable_x64(True):
        handle, step = compiled_step(compiled_envs)
        rollout = jax.jit(lambda handle, actions: jax.lax.scan(scan_step, handle, actions))
        _, (obs, rewards, terminations, truncations) = jax.device_get(rollout(handle, actions))
    np.testing.assert_array_equal(first_obs, expected_obs[0])
    np.testing.assert_array_equal(obs, np.stack(expected_obs[1:]))
    assert obs.dtype == np.float32
    np.testing.assert_array_equal(rewards, np.stack([r for r, _, _ in expected]))
    np.testing.assert_array_equal(terminations, np.stack([t for _, t, _ in expected]))
    np.testing.assert_array_equal(truncations, np.stack([t for _, _, t in expected]))
    if env_id == "Hopper-v4":
        assert terminations.any()


def test_an_atari_environment_with_sticky_actions_does_not():
    # The measurement behind docs/checkpoints.md's "What a resumed run is": with sticky actions the
    # emulator draws a random number at every step, so only the whole history comes back; without
    # them the resets and the current episode's actions suffice.
    actions = np.random.default_rng(0).integers(0, 18, (700, 2))  # Breakout: episodes of ~200
    _, sticky_obs, sticky_record = played_envs("Breakout-v5", actions, **MACHADO_ATARI)
    assert not np.array_equal(
        replayed_envs("Breakout-v5", sticky_record, **MACHADO_ATARI)[1], sticky_obs
    )
    whole_history = envpool.make(
        "Breakout-v5", env_type="gymnasium", num_envs=2, seed=7, **MACHADO_ATARI
    )
    whole_history.reset()
    for action in actions:
        obs = whole_history.step(action)[0]
    np.testing.assert_array_equal(obs, sticky_obs)
    not_sticky = dict(MACHADO_ATARI, repeat_action_probability=0.0)
    _, obs, record = played_envs("Breakout-v5", actions, **not_sticky)
    np.testing.assert_array_equal(replayed_envs("Breakout-v5", record, **not_sticky)[1], obs)


# run


def test_the_time_left_is_minutes_hours_or_days():
    assert [duration(s) for s in (90, 7199, 3 * 3600, 47 * 3600, 5 * 86400)] == [
        "1.5min",
        "120.0min",
        "3.0h",
        "47.0h",
        "5.0days",
    ]


def test_episodes_count_rewards_and_steps_but_not_reset_steps(tmp_path):
    # Env 0: rewards 1, 2, then done (return 3, length 2 at step 2); its next step is envpool's
    # reset step (reward 100 ignored), then reward 4. Env 1 plays on: return 0 + 5 + 6 + 7 + 8 when
    # done at step 4.
    writer = SummaryWriter(str(tmp_path))
    episodes = Episodes(writer, [], np.zeros(2), np.zeros(2, dtype=np.int64))
    for step, (rewards, done, is_reset) in enumerate(
        [
            ([1, 5], [False, False], [False, False]),
            ([2, 6], [True, False], [False, False]),
            ([100, 7], [False, False], [True, False]),
            ([4, 8], [False, True], [False, False]),
        ]
    ):
        episodes.step(
            np.array(rewards, float), np.array(done), np.array(is_reset), global_step=step
        )
    assert episodes.recent_returns == [3.0, 26.0]
    np.testing.assert_array_equal(episodes.returns, [4.0, 0.0])
    np.testing.assert_array_equal(episodes.lengths, [1, 0])


@dataclasses.dataclass(frozen=True)
class RunSizes:
    num_updates: int = 5
    steps_per_update: int = 8
    num_envs: int = 2


@dataclasses.dataclass
class RunArgs:
    checkpoint_every: int = 2
    distributed: bool = False


@dataclasses.dataclass
class NamedRunArgs:
    run_name: str = "evaluated"
    env_id: str = "CartPole-v1"
    exp_name: str = "script"
    seed: int = 1
    track: bool = False
    resume: bool = False
    distributed: bool = False
    save_model: bool = False
    upload_model: bool = False
    eval_episodes: int = 2
    eval_every: int = 2
    capture_video: bool = False
    nondeterministic_gpu_ops: bool = False


def test_a_resumed_runs_summary_keeps_earlier_evaluations_and_a_finished_run_ignores_stops(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    devices = jax.local_devices()[:1]
    # The mean returns of the evaluations in turn; NaN, one that `finish` should not make.
    evaluations = [2.0, 4.0, 5.0, 41.0, float("nan")]

    def evaluate(params, args, num_episodes, seed):
        return [evaluations.pop(0)] * num_episodes

    first = open_run(
        NamedRunArgs(),
        RunSizes(),
        "script.py",
        dict(update=0, wall_time_s=0.0),
        devices,
        evaluate=evaluate,
    )
    assert [update for update in range(1, 6) if first.evaluation_due(update)] == [2, 4, 5]
    for update in [2, 4, 5]:
        first.evaluate_and_log(update, params=None, optimizer_steps=3 * update)
    first.logs.writer.close()
    assert scalars(tmp_path / "runs" / "evaluated", "charts/opt_step") == [
        (16, 6),
        (32, 12),
        (40, 15),
    ]
    # Preempted after the checkpoint of update 4 (step 32): the evaluation of step 40 followed it,
    # and the resumed run makes it again.
    resumed = open_run(
        NamedRunArgs(resume=True),
        RunSizes(),
        "script.py",
        dict(update=4, wall_time_s=1.0),
        devices,
        evaluate=evaluate,
    )
    assert resumed.evaluations.made == [[16, 2.0], [32, 4.0]]
    resumed.evaluate_and_log(5, params=None, optimizer_steps=15)
    handlers = {signum: signal.getsignal(signum) for signum in signals.STOP_SIGNALS}
    try:
        # The final evaluation is the last update's: `finish` plays no other episodes.
        resumed.finish({"w": np.zeros(2, np.float32)}, update=5, optimizer_steps=15)
        # A finished run ignores stop signals: Python's shutdown would restore their default
        # action, and a launcher's late SIGTERM would end the finished run with -15.
        assert all(signal.getsignal(signum) == signal.SIG_IGN for signum in handlers)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    summary = json.loads((tmp_path / "runs" / "evaluated" / "summary.json").read_text())
    assert summary["eval_returns"] == [[16, 2.0], [32, 4.0], [40, 41.0]]
    assert summary["eval_return"] == 41.0


def test_the_untrained_policy_is_evaluated_at_step_0_once_with_eval_every(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    devices = jax.local_devices()[:1]
    played = []

    def evaluate(params, args, num_episodes, seed):
        played.append((params, num_episodes, seed))
        return [3.0, 6.0]

    fresh = open_run(
        NamedRunArgs(),
        RunSizes(),
        "script.py",
        dict(update=0, wall_time_s=0.0),
        devices,
        evaluate=evaluate,
    )
    fresh.evaluate_untrained(lambda: "untrained")
    fresh.logs.end_progress()
    fresh.logs.writer.close()
    run_dir = tmp_path / "runs" / "evaluated"
    # The run's seed 1 + 1,000,000; two episodes, their mean 4.5 at step 0, before any optimizer
    # step.
    assert played == [("untrained", 2, 1_000_001)]
    assert scalars(run_dir, "charts/eval_return") == [(0, 4.5)]
    assert scalars(run_dir, "charts/opt_step") == [(0, 0.0)]
    assert json.loads((run_dir / "evaluations.json").read_text()) == [[0, 4.5]]
    # A resumed run keeps the evaluation of step 0 and does not make it again.
    resumed = open_run(
        NamedRunArgs(resume=True),
        RunSizes(),
        "script.py",
        dict(update=2, wall_time_s=1.0),
        devices,
        evaluate=evaluate,
    )
    resumed.evaluate_untrained(lambda: pytest.fail("evaluated again"))
    resumed.logs.end_progress()
    resumed.logs.writer.close()
    assert resumed.evaluations.made == [[0, 4.5]] and len(played) == 1
    # Without --eval-every (an evaluation after the last update only) or --eval-episodes: none.
    for name, args in [
        ("final_only", NamedRunArgs(run_name="final_only", eval_every=0)),
        ("none", NamedRunArgs(run_name="none", eval_episodes=0)),
    ]:
        counters = dict(update=0, wall_time_s=0.0)
        run = open_run(args, RunSizes(), "script.py", counters, devices, evaluate=evaluate)
        run.evaluate_untrained(lambda: pytest.fail("evaluated"))
        run.logs.end_progress()
        run.logs.writer.close()
        assert (
            run.evaluations.made == []
            and not (tmp_path / "runs" / name / "evaluations.json").exists()
        )


def test_after_update_checkpoints_on_schedule_and_at_the_end_and_stops_on_a_signal(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    logs = RunLogs(args=RunArgs(), sizes=RunSizes(), writer=writer, first_update=0)
    stops = Stops(
        args=RunArgs(),
        sizes=RunSizes(),
        dir=str(tmp_path),
        counters=dict(update=0, wall_time_s=0.0),
        logs=logs,
        stop_agreed=bool,
        received_signals=[],
    )
    state = replicated_state(1.0)[0]
    assert [stops.after_update(state, update) for update in range(1, 6)] == [0] * 5
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "update_000000004.ckpt",
        "update_000000005.ckpt",
    ]
    stops.received_signals.append(signal.SIGTERM)
    stops.dir = str(tmp_path / "preempted")
    assert stops.after_update(state, 3) == 128 + signal.SIGTERM
    assert os.listdir(tmp_path / "preempted" / "checkpoints") == ["update_000000003.ckpt"]
    # A signal during the last update lets the run finish.
    assert stops.after_update(state, 5) == 0


HUGE_PAGES_PROBE = """
import os, sys
from cleanba_utils.huge_pages import restart_with_huge_pages
print(os.getpid(), os.environ.get("GLIBC_TUNABLES", ""), sys.argv[1:], flush=True)
restart_with_huge_pages()
"""


def huge_pages_mode() -> str:
    """The kernel's line of transparent huge page modes, the chosen one in brackets."""
    try:
        with open(huge_pages.THP_MODE_FILE) as file:
            return file.read().strip()
    except OSError as error:
        return f"unreadable: {error.strerror}"


def test_a_script_restarts_once_with_huge_pages_unless_told_not_to(tmp_path):
    """Same process, same arguments, the caller's tunables kept; no restart with the opt-out."""
    if not huge_pages.glibc_has_the_tunable():
        skip_unless_required(
            f"glibc {platform.libc_ver()[1] or '(none)'} has no glibc.malloc.hugetlb tunable: "
            "the huge-pages restart needs glibc >= 2.35 (Debian 12, Ubuntu 22.04 or newer)"
        )
    if not huge_pages.madvised_huge_pages():
        skip_unless_required(
            f"transparent huge pages are not in madvise mode ({huge_pages.THP_MODE_FILE}: "
            f"{huge_pages_mode()}): as root, echo madvise > {huge_pages.THP_MODE_FILE}"
        )
    probe = tmp_path / "probe.py"
    probe.write_text(HUGE_PAGES_PROBE)
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.check=0")
    env.pop(huge_pages.NO_HUGE_PAGES_VARIABLE, None)
    command = [sys.executable, "-u", str(probe), "a b", "--c"]
    lines = subprocess.run(command, env=env, capture_output=True, text=True).stdout.splitlines()
    pid = lines[0].split()[0]
    assert lines == [
        f"{pid} glibc.malloc.check=0 ['a b', '--c']",
        f"{pid} glibc.malloc.check=0:{huge_pages.TUNABLE} ['a b', '--c']",
    ]
    env[huge_pages.NO_HUGE_PAGES_VARIABLE] = "1"
    lines = subprocess.run(command, env=env, capture_output=True, text=True).stdout.splitlines()
    assert len(lines) == 1


def test_track_without_a_weights_and_biases_login_is_one_line_and_exit_2(tmp_path):
    """W&B refuses to start without an API key (none in the environment or under HOME): the run
    says so in one line, with the two ways on, instead of W&B's traceback."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    script = [sys.executable, str(REPO / "cleanba" / "cleanba_ppo.py")]
    result = subprocess.run(
        [*script, "--env-id", "CartPole-v1", "--track"],
        cwd=tmp_path,
        env=dict(env, HOME=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].startswith(
        "error: --track could not start Weights & Biases (No API key configured"
    ), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


# handoff


class PlayedRollout(NamedTuple):
    update: int
    policy_version: int


def played_rollouts(first_update: int, num_updates: int, concurrency: bool, on_resume: str):
    """The rollouts an actor plays under the handoff rule, as the scripts' learners send: a
    "keep_lag" run resumed with --concurrency first the version before its checkpoint's (the one
    the actors would have played next), then the checkpoint's, then version u after update u."""
    sends = [first_update - 1, *range(first_update, num_updates)]
    if on_resume == "keep_lag" and concurrency and first_update > 1:
        sends.insert(0, first_update - 2)
    sent = iter(sends)
    rollouts = []
    lag = handoff.LagRule(first_update, num_updates, concurrency, on_resume)
    for update in range(first_update, num_updates + 1):
        if lag.actor_fetches_params(update):
            version = next(sent)
        rollouts.append(PlayedRollout(update, version))
    return rollouts


@pytest.mark.parametrize("concurrency", [False, True])
@pytest.mark.parametrize("on_resume", ["restart_lag", "keep_lag"])
def test_the_handoff_rule_and_its_check_agree_in_fresh_and_resumed_runs(concurrency, on_resume):
    lag = int(concurrency)
    fresh = played_rollouts(1, 6, concurrency, on_resume)
    assert [r.update - 1 - r.policy_version for r in fresh] == [0] + [lag] * 5
    resumed = played_rollouts(4, 6, concurrency, on_resume)
    # "restart_lag" starts the lag over (0, then 1); "keep_lag" keeps the uninterrupted run's.
    first_lag = 0 if on_resume == "restart_lag" else lag
    assert [r.update - 1 - r.policy_version for r in resumed] == [first_lag, lag, lag]
    for first_update, rollouts in [(1, fresh), (4, resumed)]:
        rule = handoff.LagRule(first_update, 6, concurrency, on_resume)
        for rollout in rollouts:
            rule.check([rollout], rollout.update)
    # A rollout of another policy, or of another update, is refused.
    rule = handoff.LagRule(1, 6, concurrency, on_resume)
    with pytest.raises(RuntimeError, match="expected"):
        stale = fresh[3]._replace(policy_version=fresh[3].policy_version - 1)
        rule.check([stale], stale.update)
    with pytest.raises(RuntimeError, match="rollout 3"):
        rule.check([fresh[2]], 4)


@pytest.mark.parametrize("concurrency", [False, True])
@pytest.mark.parametrize("first_update", [1, 4, 7])
def test_a_keep_lag_learner_first_sends_what_the_rule_has_the_actors_play(
    concurrency, first_update
):
    # 6 updates; first_update 7 is a resumed run that has none left. Two actor threads on one
    # device; the parameters are named by a number: 1.0 the learner's, 2.0 the checkpoint's.
    param_queues = [queue.Queue(), queue.Queue()]
    actors = handoff.ActorThreads(
        rollout_queues=[],
        threads=[],
        param_queues=param_queues,
        actor_devices=jax.local_devices()[:1],
        stop=threading.Event(),
        lag=handoff.LagRule(first_update, 6, concurrency, "keep_lag"),
    )
    names = {1.0: "learner", 2.0: "checkpoint's acting"}
    actors.send_first(np.float32(1.0), acting_params=np.float32(2.0))
    received = [
        [(names[float(params)], version) for version, params in list(param_queue.queue)]
        for param_queue in param_queues
    ]
    assert received[0] == received[1]
    sent = received[0]
    # The hand-off remembers the parameters sent last: those of the next rollout but one.
    assert names[float(actors.last_sent)] == "learner"
    expected = [("learner", first_update - 1)]
    if concurrency and 1 < first_update <= 6:
        expected.insert(0, ("checkpoint's acting", first_update - 2))
    assert sent == expected
    # The actors' first rollout is played with what the learner sent first.
    played = played_rollouts(first_update, 6, concurrency, "keep_lag")
    assert [rollout.policy_version for rollout in played[:1]] == [sent[0][1]][: len(played)]


def test_take_rollouts_takes_one_per_queue_in_order_and_refuses_a_stale_one():
    stop = threading.Event()
    queues = [queue.Queue(maxsize=1) for _ in range(3)]
    for rollout_queue in queues:
        rollout_queue.put(PlayedRollout(update=2, policy_version=1))
    lag = handoff.LagRule(1, 6, concurrency=False, on_resume="restart_lag")
    rollouts, waited = handoff.take_rollouts(queues, 2, lag, stop)
    assert rollouts == [PlayedRollout(2, 1)] * 3 and waited >= 0
    assert all(rollout_queue.empty() for rollout_queue in queues)
    queues[0].put(PlayedRollout(update=3, policy_version=1))
    with pytest.raises(RuntimeError, match="lag 1, expected 0"):
        handoff.take_rollouts(queues[:1], 3, lag, stop)


def test_a_named_run_without_resume_over_its_checkpoints_is_one_line_and_exit_2(
    tmp_path, monkeypatch, capsys
):
    # A fresh run there would write beside the earlier run's checkpoints, and a later --resume
    # would take the newest of both.
    monkeypatch.chdir(tmp_path)
    template = replicated_state(0.0)[1]
    record = {checkpoints.OPTIONS_RECORD: checkpoints.options_record(NamedRunArgs(), "script.py")}
    counters = dict(update=3, wall_time_s=1.0, **record)
    checkpoints.save_checkpoint("runs/evaluated", replicated_state(2.0)[1], counters)
    with pytest.raises(SystemExit) as exit_:
        checkpoints.resume_or_start(NamedRunArgs(), template, {}, "script.py")
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line == (
        "error: --run-name evaluated: runs/evaluated/checkpoints holds the checkpoints of a run; "
        "continue it with --resume, or give another --run-name (or move the folder away)"
    )
    # With --resume the run continues from them; a run of another name starts afresh.
    saved, counters = checkpoints.resume_or_start(
        NamedRunArgs(resume=True), template, {}, "script.py"
    )
    assert counters["update"] == 3 and saved.params["w"][0] == 2.0
    _, fresh = checkpoints.resume_or_start(NamedRunArgs(run_name="other"), template, {}, "s.py")
    assert fresh["update"] == 0
