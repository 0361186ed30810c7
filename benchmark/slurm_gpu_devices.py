"""On a GPU machine: what each process of a 2-process `--distributed` run sees under SLURM's
variables, with JAX's default (one device per process, the one of its SLURM_LOCALID) and with
cleanba's rule (`cleanba_utils.distributed.join`: every GPU of the task). The processes are started
as a 2-task srun on one node starts them (SLURM_LOCALID 0 and 1, no CUDA_VISIBLE_DEVICES from gres),
and each then sums a value over every process's first device.

    python benchmark/slurm_gpu_devices.py          # prints one line per process and rule

Needs only jax with GPU support (no envpool)."""

import os
import random
import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(rule: str):
    import jax
    import numpy as np

    sys.path.insert(0, str(REPO))
    from cleanba_utils import distributed

    args = types.SimpleNamespace(
        distributed=True,
        coordinator_address=None,
        num_processes=None,
        process_id=None,
        actor_device_ids=(0,),
        learner_device_ids=(0,),
    )
    if rule == "jax default":
        jax.distributed.initialize()
    else:
        distributed.join(args)
    devices = jax.local_devices()
    print(
        f"{rule}: process {jax.process_index()} (SLURM_LOCALID {os.environ['SLURM_LOCALID']}): "
        f"asked jax_cuda_visible_devices={jax.config.read('jax_cuda_visible_devices')}, sees "
        f"{[str(d) for d in devices]}",
        flush=True,
    )
    # A collective over the processes' first devices. On a machine of one GPU both processes hold
    # the same GPU, which NCCL refuses ("Duplicate GPU detected").
    every_first = [jax.local_devices(process_index=p)[0] for p in range(jax.process_count())]
    total = jax.pmap(lambda x: jax.lax.psum(x, "p"), axis_name="p", devices=every_first)(
        np.full(1, jax.process_index() + 1.0, np.float32)
    )
    print(f"{rule}: process {jax.process_index()}: psum = {float(total[0])}", flush=True)


def main():
    for rule in sys.argv[1:] or ["jax default", "cleanba"]:
        job_id = random.randrange(10_000, 90_000)
        processes = []
        for process in range(2):
            env = dict(
                os.environ,
                SLURM_JOB_ID=str(job_id),
                SLURM_STEP_NODELIST="localhost",
                SLURM_NTASKS="2",
                SLURM_PROCID=str(process),
                SLURM_LOCALID=str(process),
                SLURM_STEP_NUM_NODES="1",
                XLA_PYTHON_CLIENT_PREALLOCATE="false",
            )
            env.pop("CUDA_VISIBLE_DEVICES", None)
            processes.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--child", rule],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        for process in processes:
            output = process.communicate(timeout=240)[0]
            lines = [line for line in output.splitlines() if line.startswith(rule)]
            error = [line for line in output.splitlines() if "Error" in line or "error" in line]
            print(*(lines or [f"{rule}: exit {process.returncode}: {' | '.join(error[-3:])}"]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    else:
        main()
