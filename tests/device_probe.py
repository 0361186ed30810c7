"""Runs a script's `main` up to its device checks under whatever distributed environment the caller
set (SLURM's variables, srun), prints what the process asked JAX to make visible and the devices it
sees, then exits: what `jax.distributed` is asked for, without a GPU.

    python tests/device_probe.py cleanba_ppo --distributed --actor-device-ids 0 ..."""

import importlib
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cleanba"))


def report(args):
    print(
        f"process {jax.process_index()}/{jax.process_count()}: "
        f"jax_cuda_visible_devices={jax.config.read('jax_cuda_visible_devices')} "
        f"local_devices={len(jax.local_devices())}",
        flush=True,
    )
    sys.exit(0)


if __name__ == "__main__":
    script = importlib.import_module(sys.argv[1])
    script.validate_layout = report
    script.main(sys.argv[2:])
