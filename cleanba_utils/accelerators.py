"""What a run asks of the accelerator before JAX starts it, and what its first line says of it.

XLA's GPU backend picks some kernels by timing them (convolution algorithms) and adds some sums
with atomic operations in whatever order the threads arrive (a convolution's gradients, scatters),
so on a GPU the same command gives other floats on each run unless XLA is told to use
deterministic operations (`--xla_gpu_deterministic_ops=true`). A run asks for them unless
`--nondeterministic-gpu-ops` trades the repeatability for speed. XLA reads `XLA_FLAGS` once, when
its backend starts, so the flag is appended to the user's own `XLA_FLAGS` (never replacing them)
while the command line is parsed, before anything starts a backend. The CPU backend accepts the
flag and is deterministic anyway.

Some defaults differ by platform, where the CPU's choice costs on a GPU (say, the PPO script's
gradient accumulation, a bound for CPU memory): such an option defaults to None in `Args`, and
`apply_platform_defaults` gives it the value for the platform JAX runs on, once the backend has
started; the first line and spec.json name each value so chosen.

A CPU-only install of JAX on a machine with an NVIDIA GPU runs on the CPU without an error; the
run's first line then says how to install for the GPU."""

import importlib.metadata
import os
import subprocess
from collections.abc import Callable

from cleanba_utils.errors import fail

DETERMINISTIC_OPS_FLAG = "--xla_gpu_deterministic_ops"
GPU_OPT_OUT = "--nondeterministic-gpu-ops"
NVIDIA_SMI = "nvidia-smi"
"""The command that lists the machine's NVIDIA GPUs (`-L`), found on PATH."""
CUDA_PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin")
"""JAX's CUDA backends, installed by `jax[cuda13]` (the `cuda` extra) or `jax[cuda12]`."""

_platform_chosen: dict = {}
"""The options that `apply_platform_defaults` gave a value in this process, with that value."""


def apply_platform_defaults(args, rules: dict[str, Callable]):
    """Gives each option named in `rules` that is unset (None) its value for the platform JAX runs
    on, `rules[name](args, platform)` ("gpu", "cpu", ...), in `args` itself: the script's own
    choice where a CPU's default would cost on a GPU. Starts JAX's backend."""
    import jax

    platform = jax.default_backend()
    _platform_chosen.clear()
    for name, rule in rules.items():
        if getattr(args, name) is None:
            setattr(args, name, rule(args, platform))
            _platform_chosen[name] = getattr(args, name)


def platform_defaults() -> dict:
    """The options given their platform's value by the last `apply_platform_defaults`, with their
    values (spec.json's `platform_defaults`)."""
    return dict(_platform_chosen)


def platform_defaults_note(backend: str) -> str:
    """The first line's list of the values chosen for the platform, e.g. `; GPU defaults:
    --env-splits 2`."""
    if not _platform_chosen:
        return ""
    chosen = ", ".join(
        f"--{name.replace('_', '-')} {value}" for name, value in _platform_chosen.items()
    )
    return f"; {backend.upper()} defaults: {chosen}"


def flag_value_of(xla_flags: str, name: str) -> str | None:
    """The value the last occurrence of `--name=value` (or a bare `--name`: "true") sets in an
    XLA_FLAGS string, or None where it is not set."""
    value = None
    for word in xla_flags.split():
        key, _, given = word.partition("=")
        if key == name:
            value = given.lower() if given else "true"
    return value


_requested = {}
"""XLA_FLAGS as this process found them, by the XLA_FLAGS `request_deterministic_ops` made of them:
a process that parses a command line again (the tests) starts from the user's own flags."""


def request_deterministic_ops(nondeterministic: bool, environ=os.environ):
    """Appends `--xla_gpu_deterministic_ops=true` to `environ["XLA_FLAGS"]` unless
    `nondeterministic`; leaves the user's flags alone where they already say what the run asks.
    XLA_FLAGS that say the opposite are refused: the run's record (spec.json) would not say how it
    ran."""
    xla_flags = environ.get("XLA_FLAGS", "")
    xla_flags = _requested.get(xla_flags, xla_flags)
    wanted = "false" if nondeterministic else "true"
    given = flag_value_of(xla_flags, DETERMINISTIC_OPS_FLAG)
    if given is not None and given != wanted:
        if nondeterministic:
            fail(
                f"{GPU_OPT_OUT} asks for nondeterministic GPU operations, but XLA_FLAGS sets "
                f"{DETERMINISTIC_OPS_FLAG}={given}; remove one of the two"
            )
        fail(
            f"XLA_FLAGS sets {DETERMINISTIC_OPS_FLAG}={given}; runs use deterministic GPU "
            f"operations unless {GPU_OPT_OUT} is given: remove the flag from XLA_FLAGS and pass "
            f"{GPU_OPT_OUT} for faster, unrepeatable runs"
        )
    requested = xla_flags
    if given is None and not nondeterministic:
        requested = f"{xla_flags} {DETERMINISTIC_OPS_FLAG}=true".strip()
        _requested[requested] = xla_flags
    if requested:
        environ["XLA_FLAGS"] = requested
    else:
        environ.pop("XLA_FLAGS", None)


def check_opt_out(args, backend: str):
    """`--nondeterministic-gpu-ops` acts only on a GPU: elsewhere it is refused (an option that
    would have no effect)."""
    if args.nondeterministic_gpu_ops and backend != "gpu":
        fail(
            f"{GPU_OPT_OUT} has no effect here: it acts only on a GPU, and JAX runs on the "
            f"{backend}; leave it out"
        )


def nvidia_gpus() -> list[str]:
    """The lines of `nvidia-smi -L` that name a GPU (none where the command is missing or fails)."""
    try:
        listing = subprocess.run(
            [NVIDIA_SMI, "-L"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if listing.returncode:
        return []
    return [line for line in listing.stdout.splitlines() if line.startswith("GPU ")]


def cuda_plugin_installed() -> bool:
    for plugin in CUDA_PLUGINS:
        try:
            importlib.metadata.version(plugin)
        except importlib.metadata.PackageNotFoundError:
            continue
        return True
    return False


def backend_note(args, backend: str) -> str:
    """What the run's first line says of the accelerator after `JAX backend <backend>`: on a GPU,
    whether its operations are deterministic; on the CPU of a machine with an NVIDIA GPU (unless
    JAX_PLATFORMS chose the CPU), why the GPU is unused and what to do."""
    if backend == "gpu":
        if args.nondeterministic_gpu_ops:
            return f" with nondeterministic operations ({GPU_OPT_OUT}: another result each run)"
        return (
            f" with deterministic operations (the same result each run; {GPU_OPT_OUT} trades that "
            "for speed)"
        )
    if backend != "cpu" or os.environ.get("JAX_PLATFORMS"):
        return ""
    gpus = nvidia_gpus()
    if not gpus:
        return ""
    if cuda_plugin_installed():
        return (
            f" although nvidia-smi lists {len(gpus)} GPU(s): JAX's CUDA backend is installed "
            "but did not start (its warning above says why; CUDA 13 needs NVIDIA's driver R580 "
            "or newer)"
        )
    return (
        f" although nvidia-smi lists {len(gpus)} GPU(s): this JAX is CPU-only; install the CUDA "
        "build with `uv run --extra cuda python ...` (or `poetry install --extras cuda`)"
    )
