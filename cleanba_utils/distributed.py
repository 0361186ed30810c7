"""Multi-process runs: joining `jax.distributed` (from SLURM's environment or three explicit
options) with every device the process's layout uses, and the devices that the learner's pmap spans
across processes."""

import os
import subprocess

import jax

from cleanba_utils.errors import fail

# When a peer dies, a collective of the survivors fails at once (its connection closes), and
# each survivor ends with the line of `broken_run_line`. A peer that stops answering without
# closing its connections is named by JAX's coordination service ("... stopped sending
# heartbeats ...: <task>") within its heartbeat timeout, which then ends every process.
BROKEN_RUN = "error: distributed run broken"
HEARTBEAT_TIMEOUT_SECONDS = 30
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "heartbeat timeout")
"""what the error of a collective says when a peer's connection is gone"""


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


def is_broken_run(error: BaseException) -> bool:
    """The error of a collective whose peer died or left the run (XLA's runtime error, or the
    ValueError that process_allgather raises from it)."""
    return isinstance(error, (jax.errors.JaxRuntimeError, ValueError)) and any(
        text in str(error) for text in PEER_GONE
    )


def slurm_nodes_of_processes(num_processes: int) -> list[str] | None:
    """Under srun, the node of each process: SLURM's tasks node by node (`block`) or dealt to the
    nodes in turn (`cyclic`, what srun in a batch job of as many tasks as nodes reports); None
    where that is not known."""
    node_list = os.environ.get("SLURM_STEP_NODELIST")
    tasks_per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE")
    distribution = os.environ.get("SLURM_DISTRIBUTION", "block").split(":")[0]
    if not node_list or not tasks_per_node or distribution not in ("block", "cyclic"):
        return None
    try:
        hostnames = ["scontrol", "show", "hostnames", node_list]
        nodes = subprocess.run(hostnames, capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    counts = []
    for part in tasks_per_node.split(","):  # e.g. "2(x3),1": 2 tasks on each of 3 nodes, then 1
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    if len(counts) != len(nodes) or sum(counts) != num_processes:
        return None
    if distribution == "block":
        return [node for node, count in zip(nodes, counts) for _ in range(count)]
    of_processes = []
    for turn in range(max(counts)):
        of_processes += [node for node, count in zip(nodes, counts) if count > turn]
    return of_processes


def broken_run_line() -> str:
    """One line for a survivor of a lost peer: who is gone (its SLURM node where known), and what
    to do."""
    me = jax.process_index()
    num_processes = jax.process_count()
    nodes = slurm_nodes_of_processes(num_processes)
    names = [
        f"process {p}" + (f" (node {nodes[p]})" if nodes else "")
        for p in range(num_processes)
        if p != me
    ]
    lost = names[0] if len(names) == 1 else "one of " + ", ".join(names)
    return (
        f"{BROKEN_RUN}: {lost} failed or left the run, and process {me} stops; continue with "
        "--resume from the newest checkpoint"
    )
