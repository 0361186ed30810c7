"""Checkpoints of the learner: msgpack files with a sha256 checksum in front, written under a
temporary name and renamed into place, so that a crash while writing leaves the previous one intact
and a damaged file is recognized and skipped on resume."""

import dataclasses
import glob
import hashlib
import json
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import flax.serialization
import jax
import numpy as np

from cleanba_utils.devices import first_replica
from cleanba_utils.errors import fail
from cleanba_utils.run_args import RESUMABLE_CHANGES
from cleanba_utils.run_files import atomic_file

CHECKSUM_BYTES = 64  # a hex sha256


class Checkpointing(NamedTuple):
    """How a run's checkpoint is made of what `Run.after_update` gets (`open_run`'s
    `checkpointing`)."""

    on_host: Callable = first_replica
    """what the checkpoint saves of it: by default the first replica, where the learner devices hold
    copies of one state; GALA, whose devices hold different agents, gathers them (on every process:
    a collective); a "keep_lag" script's (`kept_lag.run_origin`) adds the replay at its mark"""
    collective: bool = False
    """True where `on_host` is a collective of the processes, which a stop in the middle of an
    update cannot make: a distributed run then keeps its newest checkpoint"""
    frozen_by: tuple = ()
    """locks of what the learner changes on the host (the replay): a stop in the middle of an
    update holds them, so the state stands still while it is saved"""


FIRST_REPLICA = Checkpointing()
"""The checkpoints of a script whose learner devices hold copies of one state: its first replica."""


def save_checkpoint(run_dir: str, state, counters: dict, keep: int = 2):
    """Saves `state` (the host copy of the learner's, `Checkpointing.on_host`) with `counters`
    (which hold "update"); of the files up to this update, keeps the newest `keep` (one of a later
    update is left alone). A file that cannot be written raises an
    OSError that names it, the older files intact and no temporary file left."""
    saved_state = flax.serialization.to_state_dict(jax.device_get(state))
    payload = flax.serialization.msgpack_serialize({"state": saved_state, "counters": counters})
    directory = os.path.join(run_dir, "checkpoints")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"update_{counters['update']:09d}.ckpt")
    with atomic_file(path) as f:
        # Two writes, not one of their concatenation, which would copy a payload that holds the
        # whole replay where the script checkpoints one.
        f.write(hashlib.sha256(payload).hexdigest().encode())
        f.write(payload)
    # Pruned among the checkpoints up to this one: one of a later update (left by a run whose
    # checkpoints could not be read) is never the older.
    written = counters["update"]
    kept_before = [
        path
        for path in sorted(glob.glob(os.path.join(directory, "*.ckpt")))
        if os.path.isfile(path) and update_of(path) is not None and update_of(path) <= written
    ]
    for old in kept_before[:-keep]:
        os.remove(old)


def update_of(path: str) -> int | None:
    """The update of a checkpoint file's name (`update_000000042.ckpt`: 42), None for another."""
    number = os.path.basename(path).removeprefix("update_").removesuffix(".ckpt")
    return int(number) if number.isdigit() else None


def newest_checkpoint(run_dir: str):
    """(path, contents) of the newest checkpoint of `run_dir` whose checksum holds (a damaged one is
    skipped with a warning), or None when the run folder holds no checkpoint; the contents hold
    "state" (a state dict) and "counters". Checkpoints that are all damaged are one line and exit
    2: starting afresh would let the new run's checkpoints be pruned beside them, and a requeued
    job start from zero again and again."""
    directory = os.path.join(run_dir, "checkpoints")
    damaged = []
    for path in sorted(glob.glob(os.path.join(directory, "*.ckpt")), reverse=True):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as error:
            damaged.append(f"{os.path.basename(path)}: {error.strerror}")
            print(
                f"warning: checkpoint {path} cannot be read; trying the one before", file=sys.stderr
            )
            continue
        payload = data[CHECKSUM_BYTES:]
        if hashlib.sha256(payload).hexdigest().encode() != data[:CHECKSUM_BYTES]:
            damaged.append(f"{os.path.basename(path)}: its checksum does not hold")
            print(f"warning: checkpoint {path} is damaged; trying the one before", file=sys.stderr)
            continue
        return path, flax.serialization.msgpack_restore(payload)
    if damaged:
        fail(
            f"--resume: no checkpoint in {directory} can be read ({'; '.join(damaged)}); "
            "restore the folder from a copy, or move it away to start the run afresh"
        )
    return None


RENAMED_FIELDS = {"own": "actor_carry", "pending": "pending_priorities"}
"""the saved keys of `kept_lag.Continuation`'s fields before their renaming, and their names now:
a checkpoint written before resumes"""


def restored_state(path: str, state, saved_state: dict):
    """`state` (an unreplicated template) with the values of the checkpoint at `path`; a field the
    template has under a name of RENAMED_FIELDS is read under its old name where the checkpoint
    has that one."""
    fields = getattr(state, "_fields", ())
    for old, new in RENAMED_FIELDS.items():
        if new in fields and new not in saved_state and old in saved_state:
            saved_state = {new if key == old else key: value for key, value in saved_state.items()}
    try:
        return flax.serialization.from_state_dict(state, saved_state)
    except (ValueError, KeyError) as error:
        fail(
            f"--resume: {path} holds other contents than this script's checkpoints "
            f"({error}); it was written by another version: resume with that version, or "
            "start a new run"
        )


OPTIONS_RECORD = "options"
"""the counters' key of the run's script and options (`options_record`)"""


def options_record(args, script_path: str) -> dict:
    """What a checkpoint records of its experiment: the script's file name and every option (msgpack
    and JSON hold lists, not tuples)."""
    return dict(
        script=os.path.basename(script_path),
        args=json.loads(json.dumps(dataclasses.asdict(args))),
    )


def option_value(value) -> str:
    """An option's value as the command line gives it."""
    if isinstance(value, list):
        return " ".join(map(str, value)) if value else "(empty)"
    if value == "":
        return '""'
    return str(value)


MISSING = object()
"""an option that a record lacks"""


ADDED_OPTIONS = {"env_params": [], "frame_stack": 1}
"""Options added since checkpoints were first written, with the value that does what the versions
before them did (as `options_record` records it): a checkpoint that does not record one resumes
with that value (--env-params: none, the envpool environments of those versions; --frame-stack: 1,
a Gymnasium environment's image alone). An added option that a resume may change anyway
(`run_args.RESUMABLE_CHANGES`: --vectorization-mode, --capture-video) needs no entry."""


def changed_options(saved_args: dict, args: dict, allowed) -> list[str]:
    """`--option saved -> new` for each option of `saved_args` or `args` (two `options_record`
    args) whose values differ, except the `allowed` ones; an option that one of them lacks (another
    version's) counts as changed, unless `saved_args` lacks one of `ADDED_OPTIONS` that `args`
    gives the value the older version had."""
    changes = []
    for name in [*args, *(name for name in saved_args if name not in args)]:
        saved = saved_args.get(name, ADDED_OPTIONS.get(name, MISSING))
        if name in allowed or saved == args.get(name, MISSING):
            continue
        saved = option_value(saved_args[name]) if name in saved_args else "(not recorded)"
        new = option_value(args[name]) if name in args else "(no such option)"
        changes.append(f"--{name.replace('_', '-')} {saved} -> {new}")
    return changes


def changed_sizes(saved_identity: dict, identity: dict, option_names) -> list[str]:
    """`name saved -> new` for each entry of `identity` (global sizes, the seed, ...; a dict of them
    is read entry by entry) that differs from `saved_identity`, except the options among them,
    which `changed_options` names."""
    changes = []
    for key, value in identity.items():
        if key in option_names:
            continue
        saved = saved_identity.get(key)
        if isinstance(value, dict):
            saved = saved or {}
            changes += [f"{k} {saved.get(k)} -> {v}" for k, v in value.items() if saved.get(k) != v]
        elif saved != value:
            changes.append(f"{key} {saved} -> {value}")
    return changes


def refuse_another_experiment(run_dir: str, counters: dict, identity: dict, record: dict):
    """Exit 2 with one line where the checkpoint's `counters` are of another experiment than
    `record` (this run's `options_record`) and `identity`."""
    saved_record = counters.get(OPTIONS_RECORD)
    if saved_record is None:
        fail(
            f"--resume: the checkpoint of {run_dir} predates the record of a run's options, so "
            "it cannot be compared with this run; resume it with the version that wrote it (its "
            f"git sha is in {os.path.join(run_dir, 'spec.json')}) or start a new run"
        )
    if saved_record["script"] != record["script"]:
        fail(
            f"--resume: the checkpoint of {run_dir} is {saved_record['script']}'s, not "
            f"{record['script']}'s; start a new run under another --run-name"
        )
    changes = changed_options(saved_record["args"], record["args"], RESUMABLE_CHANGES)
    size_changes = changed_sizes(counters, identity, record["args"])
    if size_changes:
        changes.append(f"global sizes {', '.join(size_changes)}")
    if changes:
        fail(
            f"--resume: the checkpoint of {run_dir} is of another experiment: "
            f"{', '.join(changes)}; resume with the options it was trained with (its spec.json "
            "has them), or start a new run under another --run-name"
        )


def agree_on_update(run_dir: str, update: int):
    """In a multi-process run: exit 2 with one line unless every process found the checkpoint of
    the same `update` (0: none)."""
    from jax.experimental import multihost_utils

    updates = multihost_utils.process_allgather(np.int32(update)).tolist()
    if len(set(updates)) > 1:
        found = ", ".join(
            f"process {process} update {found}" if found else f"process {process} none"
            for process, found in enumerate(updates)
        )
        fail(
            f"--resume: the processes of this run found other checkpoints in {run_dir} "
            f"({found}); every process must read the same run folder (one shared between the "
            "nodes)"
        )


def resume_from(run_dir: str, state, identity: dict, record: dict):
    """(state, counters) of the newest checkpoint whose checksum holds, or None when there is none;
    `state` is an unreplicated template of the saved state. Refuses (exit 2) a checkpoint of another
    experiment: another script or an option outside `run_args.RESUMABLE_CHANGES` than `record`
    (`options_record`), or another `identity` (the global sizes, the seed); resuming it would
    silently change the experiment. Every process of a multi-process run must find the same
    update."""
    newest = newest_checkpoint(run_dir)
    if jax.process_count() > 1:
        agree_on_update(run_dir, newest[1]["counters"]["update"] if newest else 0)
    if newest is None:
        return None
    path, saved = newest
    refuse_another_experiment(run_dir, saved["counters"], identity, record)
    return restored_state(path, state, saved["state"]), saved["counters"]


def run_dir_of(args) -> str | None:
    """The folder of a named run (where --resume looks for checkpoints)."""
    return os.path.join("runs", args.run_name) if args.run_name else None


def resume_or_start(args, template, identity: dict, script_path: str) -> tuple:
    """What a run starts from: `(saved, counters)`. With --resume, `saved` is the newest checkpoint
    whose checksum holds, restored into the structure of `template` (`checkpoints.resume_from`,
    which refuses another experiment's with one line); otherwise, or where the run has written no
    checkpoint yet, None. A named run without --resume whose folder holds checkpoints is refused
    with one line. `counters`: the update done (0 for a fresh start), the wall time before
    the resume, `identity` (the global sizes and the seed, and what else the script adds) and the
    record of the script and its options (`checkpoints.options_record`), which a resume must
    match: what a script hands to `open_run`."""
    record = options_record(args, script_path)
    checkpoint = None
    run_dir = run_dir_of(args)
    if args.resume:
        checkpoint = resume_from(run_dir, template, identity, record)
    elif run_dir and glob.glob(os.path.join(run_dir, "checkpoints", "*.ckpt")):
        # A fresh run there would write beside them, and a later --resume take the newest of both.
        fail(
            f"--run-name {args.run_name}: {run_dir}/checkpoints holds the checkpoints of a run; "
            "continue it with --resume, or give another --run-name (or move the folder away)"
        )
    saved, counters = checkpoint or (None, dict(update=0, wall_time_s=0.0))
    kept = dict(update=counters["update"], wall_time_s=counters["wall_time_s"], **identity)
    return saved, kept | {OPTIONS_RECORD: record}
