"""A checkpoint or run file that cannot be written (a full disk, a read-only folder) ends the run
within seconds with one line and exit 1, from the learner's path and from the stop thread's; the
newest checkpoint stays intact and resumable, and no temporary file is left. The folders are small
tmpfs mounts (root's privilege: the tests are skipped where mounting fails, and fail there with
CLEANBA_REQUIRE_ALL_TESTS=1)."""

import glob
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
from helpers import TINY, run_script, skip_unless_required
from tensorboardX import SummaryWriter

from cleanba_utils import run_files
from cleanba_utils.run_logs import guard_events

# Updates of 2 actor threads x 4 environments x 16 steps; a tiny PPO checkpoint takes 3.6 MB.
PPO = [*TINY, "--local-num-envs", 4, "--total-timesteps", 128 * 4, "--run-name", "r"]
DISK_BYTES = 32 * 1024 * 1024
# Room for the TensorBoard events of a few updates but not for a checkpoint.
ROOM_BYTES = 1024 * 1024

# Runs `cleanba_ppo.main(argv)`; during update `at` (before its `after_update`) the disk is filled
# to `room` bytes free (`fill`), or, with `read_only`, that folder is remounted read-only; then,
# with `signal`, SIGTERM arrives and the update takes `sleep` seconds more. `grace` is the stop's
# grace.
DRIVER = """
import json
import os
import signal
import subprocess
import sys
import time

import cleanba.cleanba_ppo as script
from cleanba_utils import signals

command = json.loads(sys.argv[1])
signals.STOP_GRACE_SECONDS = command["grace"]
open_run = script.open_run


def fill(folder, room):
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    with open(os.path.join(folder, "filler"), "wb") as f:
        f.write(bytes(max(free - room, 0)))


def failing_open_run(*args, **kwargs):
    run = open_run(*args, **kwargs)
    after_update = run.after_update

    def after(state, update):
        if update == command["at"]:
            if command["read_only"]:
                subprocess.run(["mount", "-o", "remount,ro", command["read_only"]], check=True)
            else:
                fill(".", command["room"])
            print(f"failing from {time.time()}", flush=True)
            if command["signal"]:
                os.kill(os.getpid(), signal.SIGTERM)
                while not run.received_signals:
                    time.sleep(0.01)
            time.sleep(command["sleep"])
        return after_update(state, update)

    run.after_update = after
    return run


script.open_run = failing_open_run
script.main(command["argv"])
"""


def mount_tmpfs(folder, size: int):
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode:
        why = (mounted.stderr.strip().splitlines() or [f"exit {mounted.returncode}"])[0]
        skip_unless_required(
            f"cannot mount a tmpfs ({why}): these tests mount small tmpfs folders, which needs "
            "root (run the tests as root)"
        )


def unmount(folder):
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.fixture
def disk(tmp_path):
    """A 32 MB tmpfs, unmounted after the test."""
    folder = tmp_path / "disk"
    mount_tmpfs(folder, DISK_BYTES)
    try:
        yield folder
    finally:
        unmount(folder)


def failing_run(cwd, argv: list, at: int, **how):
    """The driver's run in `cwd` and the seconds from the failure it staged to its exit."""
    command = dict(
        argv=list(map(str, argv)),
        at=at,
        room=0,
        read_only=None,
        signal=False,
        sleep=0.0,
        grace=10.0,
    )
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(command | how)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    exited_at = time.time()
    failed_at = [line for line in result.stdout.splitlines() if line.startswith("failing from ")]
    assert failed_at, result.stdout[-3000:] + result.stderr[-3000:]
    return result, exited_at - float(failed_at[0].split()[-1])


def assert_one_line(result, seconds: float, pattern: str):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
    assert re.fullmatch(pattern, lines[0]), lines[0]
    assert seconds < 10


def checkpoints_of(cwd) -> list[str]:
    """The names in the run's checkpoint folder; no temporary file is left in the run folder."""
    assert not glob.glob(f"{cwd}/runs/r/**/*.tmp", recursive=True)
    return sorted(os.path.basename(path) for path in glob.glob(f"{cwd}/runs/r/checkpoints/*"))


def no_room_for(written: str, kept: int) -> str:
    """The line of a write that found the disk full, the checkpoint of update `kept` kept."""
    return (
        rf"error: could not write {written}: \[Errno 28\] No space left on device; the newest "
        rf"checkpoint \(update {kept}\) is kept"
    )


CHECKPOINT_2 = r"checkpoint runs/r/checkpoints/update_000000002\.ckpt"
CHECKPOINT_3 = r"checkpoint runs/r/checkpoints/update_000000003\.ckpt"


def assert_resumes_from(disk, tmp_path, update: int):
    """A copy of the run folder, away from the full disk, resumes from `update` and finishes."""
    subprocess.run(["cp", "-r", str(disk / "runs"), str(tmp_path)], check=True)
    result = run_script("cleanba_ppo.py", [*PPO, "--resume"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming r from update {update}" in result.stdout


def test_a_stop_on_a_full_disk_is_one_line_and_keeps_the_checkpoint(disk, tmp_path):
    # SIGTERM after the checkpoint of update 1, the disk full: the checkpoint of update 2 fails.
    result, seconds = failing_run(disk, [*PPO, "--checkpoint-every", 1], at=2, signal=True)
    # The events of the run, written in a thread of their own, may be the first to fail.
    events = r"TensorBoard events runs/r/events\.out\.tfevents\.\S+"
    assert_one_line(result, seconds, no_room_for(f"({CHECKPOINT_2}|{events})", kept=1))
    assert checkpoints_of(disk) == ["update_000000001.ckpt"]
    assert_resumes_from(disk, tmp_path, 1)


def test_a_periodic_checkpoint_that_does_not_fit_is_one_line(disk):
    result, seconds = failing_run(disk, [*PPO, "--checkpoint-every", 1], at=2, room=ROOM_BYTES)
    assert_one_line(result, seconds, no_room_for(CHECKPOINT_2, kept=1))
    assert checkpoints_of(disk) == ["update_000000001.ckpt"]


def test_a_checkpoint_the_stop_thread_cannot_write_is_one_line(disk):
    # Update 4 outlasts the stop's grace: the stop thread saves the last completed update, 3, which
    # does not fit.
    argv = [*PPO, "--checkpoint-every", 2]
    result, seconds = failing_run(
        disk, argv, at=4, room=ROOM_BYTES, signal=True, sleep=30.0, grace=0.5
    )
    assert_one_line(result, seconds, no_room_for(CHECKPOINT_3, kept=2))
    assert checkpoints_of(disk) == ["update_000000002.ckpt"]


def test_a_checkpoint_folder_made_read_only_is_one_line(tmp_path):
    checkpoint_folder = tmp_path / "runs" / "r" / "checkpoints"
    mount_tmpfs(checkpoint_folder, DISK_BYTES)
    try:
        result, seconds = failing_run(
            tmp_path,
            [*PPO, "--checkpoint-every", 1],
            at=2,
            read_only=str(checkpoint_folder),
        )
        assert_one_line(
            result,
            seconds,
            rf"error: could not write {CHECKPOINT_2}: \[Errno 30\] Read-only file system; the "
            r"newest checkpoint \(update 1\) is kept",
        )
        assert checkpoints_of(tmp_path) == ["update_000000001.ckpt"]
    finally:
        unmount(checkpoint_folder)


def test_a_json_file_that_does_not_fit_keeps_the_old_one(tmp_path):
    folder = tmp_path / "small"
    mount_tmpfs(folder, 64 * 1024)
    try:
        path = folder / "evaluations.json"
        run_files.write_json_atomically(path, [[16, 2.0]])
        with pytest.raises(OSError) as error:
            run_files.write_json_atomically(path, [[16, 2.0]] * 100_000)
        assert error.value.filename == str(path) and error.value.errno == 28
        assert json.loads(path.read_text()) == [[16, 2.0]]
        assert os.listdir(folder) == ["evaluations.json"]
    finally:
        unmount(folder)


def test_tensorboard_events_on_a_full_disk_fail_once_without_a_traceback(tmp_path, capsys):
    folder = tmp_path / "small"
    mount_tmpfs(folder, 64 * 1024)
    try:
        failures = []
        writer = SummaryWriter(str(folder), flush_secs=1)
        guard_events(writer, lambda path, error: failures.append((path, error.errno)))
        with open(folder / "filler", "wb") as filler:
            filler.write(bytes(os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize))

        def log():
            # tensorboardX's queue holds 10 events: a dead writer thread blocks the 11th.
            for step in range(200):
                writer.add_scalar("x", 1.0, step)
            writer.close()

        logging = threading.Thread(target=log)
        logging.start()
        logging.join(timeout=30)
        assert not logging.is_alive()
        assert [errno for _, errno in failures] == [28]
        assert failures[0][0].startswith(str(folder / "events.out.tfevents."))
        assert "Traceback" not in capsys.readouterr().err
    finally:
        unmount(folder)
