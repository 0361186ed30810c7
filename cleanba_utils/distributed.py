"""Multi-process runs: joining `jax.distributed` (from SLURM's environment or three explicit
options) and the devices that the learner's pmap spans across processes."""

import jax

from cleanba_utils.parsing import fail

# When a peer dies, JAX's coordination service names it ("... stopped sending heartbeats ...:
# <task>") within its heartbeat timeout; a collective that fails first raises here, and this line
# follows the error.
BROKEN_RUN = "error: distributed run broken: a peer process failed or left the run"
HEARTBEAT_TIMEOUT_SECONDS = 30


def join(args):
    """Joins the run with --distributed; a failure to join is the user's configuration: one line,
    exit 2."""
    if not args.distributed:
        return
    try:
        jax.distributed.initialize(
            args.coordinator_address,
            args.num_processes,
            args.process_id,
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
