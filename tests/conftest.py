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
# JAX on the CPU, whatever is installed: the multi-device tests simulate their devices on the CPU
# (XLA_FLAGS=--xla_force_host_platform_device_count), and a GPU would give other floats than the
# CPU figures the tests compare with.
os.environ["JAX_PLATFORMS"] = "cpu"
# The scripts run by the tests do not restart themselves for huge pages
# (cleanba_utils/huge_pages.py): a restart repeats the imports, and the pages change the speed, not
# the results.
os.environ.setdefault("CLEANBA_NO_HUGE_PAGES", "1")

# The costliest files first (their tests' seconds in one run on 2 CPU cores, 2026-11-24), the others
# after them in their usual order: xdist's workers take whole files in collection order
# (--no-loadscope-reorder), so the last files to start are short ones. xdist's own order, most tests
# first, started the costliest, test_scale_out.py (9 tests), third from last: the suite took 15 min
# 40 s in that order and 14 min 58 s and 15 min 32 s in this one (clean clones, empty compilation
# cache).
COSTLIEST_FIRST = [
    "test_scale_out.py",  # 434
    "test_apex_dqn.py",  # 352
    "test_learning.py",  # 314
    "test_ppo.py",  # 198
    "test_experiments.py",  # 195
    "test_layouts.py",  # 187
    "test_gala_a2c.py",  # 116
    "test_apex_dpg.py",  # 113
    "test_original_readme.py",  # 92, 130; 107, 114 with 2 updates (2026-11-26/27, cores shared)
    "test_hub.py",  # 94 (2026-11-26, the cores shared with other jobs)
    "test_sac.py",  # 104
    "test_jax_envs.py",  # 100 (2026-11-29)
    "test_small_configs.py",  # 80 (2026-11-29: 14 configurations)
]


def pytest_collection_modifyitems(items):
    rank = {name: index for index, name in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
