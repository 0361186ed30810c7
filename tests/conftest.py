"""The suite runs the scripts in many subprocesses with the same few configurations; compiling them
once and reading the compiled programs back from JAX's persistent cache halves a tiny run (31 s to
16 s on 2 CPU cores). The cache is keyed by the program and the JAX version, so a stale entry is
never used. Set here, before anything imports JAX, so that the in-process tests and every subprocess
(they inherit the environment) share it."""

import os
import tempfile

os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"cleanba-tests-jax-cache-{os.getuid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
