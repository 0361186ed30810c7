"""The files of a run and what they hold: spec.json, the model file, and the parameter fingerprint
that summary.json and the last line of stdout give; how they are written, atomically (the
experiment tools write theirs so too, and import this module without JAX and flax, which its
functions import where they need them)."""

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

PACKAGES = ["jax", "jaxlib", "flax", "optax", "rlax", "envpool", "gymnax", "gymnasium", "numpy"]
PACKAGES += ["tyro"]
MODEL_SUFFIX = ".cleanba_model"
"""the ending of a model file's name (`--save-model`)"""


def params_fingerprint(params) -> str:
    """sha256 of the little-endian float32 bytes of the leaves, in tree order."""
    import jax

    digest = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(params):
        digest.update(np.ascontiguousarray(leaf, dtype="<f4").tobytes())
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_file(path, mode: str = "wb"):
    """A file opened in `mode` that takes the place of `path` once written: it is written under a
    temporary name beside `path`, flushed to the disk and renamed into place, so that a reader (a
    resume, another worker) finds the old contents or the new, never a part. On a failure the
    temporary file is removed, and an OSError (a full disk, a read-only folder) names `path`."""
    temporary = f"{os.fspath(path)}.{os.getpid()}.tmp"
    try:
        with open(temporary, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        if isinstance(error, OSError):
            raise OSError(error.errno, error.strerror, os.fspath(path)) from error
        raise


def write_json_atomically(path, obj):
    """`obj` as JSON in the file `path`, written as `atomic_file` writes."""
    with atomic_file(path, "w") as f:
        json.dump(obj, f, indent=2)


def write_failure(what: str, path, error: OSError) -> str:
    """The line that says a file of the run could not be written, and why."""
    return (
        f"error: could not write {what} {os.fspath(path)}: [Errno {error.errno}] {error.strerror}"
    )


def git_sha(path: str):
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(path)),
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None


def run_description(args, sizes, run_name: str, script_path: str) -> dict:
    """Enough to rerun the run: every argument, the derived sizes, the code version, the library
    versions (for a Gymnasium environment, also those of the packages that make it), the XLA flags
    its backend started with (on a GPU, whether its operations are deterministic) and the options
    whose default is the platform's (`accelerators`)."""
    import jax

    from cleanba_utils import accelerators, gymnasium_envs
    from cleanba_utils.env_ids import is_gymnasium_env

    versions = {p: importlib.metadata.version(p) for p in PACKAGES}
    if is_gymnasium_env(args.env_id):
        versions |= gymnasium_envs.environment_versions(args.env_id)
    return dict(
        run_name=run_name,
        script=os.path.basename(script_path),
        command=sys.argv,
        args=dataclasses.asdict(args),
        sizes=dataclasses.asdict(sizes),
        git_sha=git_sha(script_path),
        python=platform.python_version(),
        versions=versions,
        devices=[str(d) for d in jax.devices()],
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        platform_defaults=accelerators.platform_defaults(),
        start_time=time.time(),
    )


def args_from_dict(args_type, saved: dict):
    """A script's `Args` from the arguments a model file saved (msgpack stores tuples as lists)."""
    return args_type(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})


def save_model(args, params, run_dir: str, script_path: str) -> str:
    """A flax msgpack of the script's name, its arguments and the parameters: no pickle."""
    import flax.serialization

    path = os.path.join(run_dir, f"{args.exp_name}{MODEL_SUFFIX}")
    saved_args = json.loads(json.dumps(dataclasses.asdict(args)))  # msgpack takes lists, not tuples
    script = os.path.splitext(os.path.basename(script_path))[0]
    with atomic_file(path) as f:
        f.write(
            flax.serialization.msgpack_serialize(
                {"script": script, "args": saved_args, "params": params}
            )
        )
    return path
