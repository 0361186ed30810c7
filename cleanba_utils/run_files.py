"""The files of a run and what they hold: spec.json, the model file, and the parameter fingerprint
that summary.json and the last line of stdout give."""

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time

import flax.serialization
import jax
import numpy as np

PACKAGES = ["jax", "jaxlib", "flax", "optax", "rlax", "envpool", "numpy", "tyro"]


def params_fingerprint(params) -> str:
    """sha256 of the little-endian float32 bytes of the leaves, in tree order."""
    digest = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(params):
        digest.update(np.ascontiguousarray(leaf, dtype="<f4").tobytes())
    return digest.hexdigest()


def write_json(path: str, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def add_to_summary(run_dir: str, fields: dict):
    """Adds a script's own results (its learner's counts) to the summary.json that `Run.finish`
    wrote."""
    path = os.path.join(run_dir, "summary.json")
    with open(path) as f:
        summary = json.load(f)
    write_json(path, summary | fields)


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
    """Enough to rerun the run: every argument, the derived sizes, the code version and the library
    versions."""
    return dict(
        run_name=run_name,
        script=os.path.basename(script_path),
        command=sys.argv,
        args=dataclasses.asdict(args),
        sizes=dataclasses.asdict(sizes),
        git_sha=git_sha(script_path),
        python=platform.python_version(),
        versions={p: importlib.metadata.version(p) for p in PACKAGES},
        devices=[str(d) for d in jax.devices()],
        start_time=time.time(),
    )


def args_from_dict(args_type, saved: dict):
    """A script's `Args` from the arguments a model file saved (msgpack stores tuples as lists)."""
    return args_type(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})


def save_model(args, params, run_dir: str, script_path: str) -> str:
    """A flax msgpack of the script's name, its arguments and the parameters: no pickle."""
    path = os.path.join(run_dir, f"{args.exp_name}.cleanba_model")
    saved_args = json.loads(json.dumps(dataclasses.asdict(args)))  # msgpack takes lists, not tuples
    script = os.path.splitext(os.path.basename(script_path))[0]
    with open(path, "wb") as f:
        f.write(
            flax.serialization.msgpack_serialize(
                {"script": script, "args": saved_args, "params": params}
            )
        )
    return path
