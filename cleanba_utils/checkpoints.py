"""Checkpoints of the learner: msgpack files with a sha256 checksum in front, written under a
temporary name and renamed into place, so that a crash while writing leaves the previous one intact
and a damaged file is recognized and skipped on resume."""

import glob
import hashlib
import os
import sys

import flax.serialization
import jax

from cleanba_utils.devices import first_replica
from cleanba_utils.parsing import fail

CHECKSUM_BYTES = 64  # a hex sha256


def save_checkpoint(run_dir: str, state, counters: dict, keep: int = 2, host_copy=first_replica):
    """Saves `host_copy(state)` (by default the first replica of the pmap'd `state`) with `counters`
    (which hold "update"); keeps the newest `keep` files."""
    saved_state = flax.serialization.to_state_dict(jax.device_get(host_copy(state)))
    payload = flax.serialization.msgpack_serialize({"state": saved_state, "counters": counters})
    directory = os.path.join(run_dir, "checkpoints")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"update_{counters['update']:09d}.ckpt")
    with open(path + ".tmp", "wb") as f:
        # Two writes, not one of their concatenation: a checkpoint with a replay is hundreds of MB.
        f.write(hashlib.sha256(payload).hexdigest().encode())
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    for old in sorted(glob.glob(os.path.join(directory, "*.ckpt")))[:-keep]:
        os.remove(old)


def load_checkpoint(run_dir: str, state):
    """(state, counters) of the newest checkpoint whose checksum holds, or None when there is none.
    `state` is an unreplicated template of the saved state."""
    for path in sorted(glob.glob(os.path.join(run_dir, "checkpoints", "*.ckpt")), reverse=True):
        with open(path, "rb") as f:
            data = f.read()
        payload = data[CHECKSUM_BYTES:]
        if hashlib.sha256(payload).hexdigest().encode() != data[:CHECKSUM_BYTES]:
            print(f"warning: checkpoint {path} is damaged; trying the one before", file=sys.stderr)
            continue
        saved = flax.serialization.msgpack_restore(payload)
        try:
            restored = flax.serialization.from_state_dict(state, saved["state"])
        except (ValueError, KeyError) as error:
            fail(
                f"--resume: {path} holds other contents than this script's checkpoints "
                f"({error}); it was written by another version: resume with that version, or "
                "start a new run"
            )
        return restored, saved["counters"]
    return None


def resume_from(run_dir: str, state, identity: dict):
    """Like `load_checkpoint`, but refuses (exit 2) a checkpoint whose `identity` (the global sizes
    and the seed) differs from this run's: resuming it would silently change the experiment."""
    checkpoint = load_checkpoint(run_dir, state)
    if checkpoint:
        saved = {key: checkpoint[1].get(key) for key in identity}
        if saved != identity:
            fail(
                f"--resume: the checkpoint of {run_dir} is of another run ({saved}, "
                f"this run {identity}); resume with the same global hyperparameters"
            )
    return checkpoint
