"""Multi-process runs: joining `jax.distributed` (from SLURM's environment or three explicit
options) with every device the process's layout uses, and the devices that the learner's pmap spans
across processes."""

import os

import jax

from cleanba_utils.parsing import fail

# When a peer dies, JAX's coordination service names it ("... stopped sending heartbeats ...:
# <task>") within its heartbeat timeout; a collective that fails first raises here, and this line
# follows the error.
BROKEN_RUN = "error: distributed run broken: a peer process failed or left the run"
HEARTBEAT_TIMEOUT_SECONDS = 30


def num_processes_of(args) -> int:
    """The processes of the run before JAX knows them: --num-processes, else SLURM's task count
    (where JAX reads it), else 1."""
    if args.num_processes is not None:
        return args.num_processes
    return int(os.environ.get("SLURM_NTASKS", 1))


def local_device_ids(num_layout_devices: int) -> list[int]:
    """The local device ids a process of a --distributed run asks JAX for: every GPU its task was
    given (all of CUDA_VISIBLE_DEVICES, which SLURM sets to the task's GPUs, numbered from 0 by
    CUDA), else devices 0 .. `num_layout_devices` - 1. Never JAX's own default under SLURM, one
    device per process (the one of its local rank), which breaks every layout of several devices
    per task; and never only the ids the layout names, since the scripts index
    `jax.local_devices()` by id (a layout such as a0-l2 needs devices 0 to 2)."""
    given = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return list(range(len(given) or num_layout_devices))


def layout_devices(args) -> int:
    """How many local devices the actor and learner device ids reach: one more than the largest."""
    return max(*args.actor_device_ids, *args.learner_device_ids) + 1


def join(args, num_layout_devices: int | None = None):
    """Joins the run with --distributed, before anything starts a JAX backend, with every device
    the process uses (`local_device_ids`; `num_layout_devices`: by default `layout_devices(args)`).
    A failure to join is the user's configuration: one line, exit 2."""
    if not args.distributed:
        return
    if num_layout_devices is None:
        num_layout_devices = layout_devices(args)
    try:
        jax.distributed.initialize(
            args.coordinator_address,
            args.num_processes,
            args.process_id,
            local_device_ids=local_device_ids(num_layout_devices),
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_SECONDS,
        )
    except (ValueError, RuntimeError) as error:
        fail(
            f"--distributed could not join the run ({str(error).splitlines()[0]}); "
            "run it under SLURM or give --coordinator-address, --num-processes and --process-id"
        )


def global_learner_devices(learner_device_ids) -> list:
    """The learner devices of every process, in process order: the axis of the learner's pmap."""
    return [
        jax.local_devices(process_index=p)[i]
        for p in range(jax.process_count())
        for i in learner_device_ids
    ]
