"""Transparent huge pages for the large blocks glibc's malloc maps, on a CPU learner.

XLA's CPU runtime allocates an update's buffers afresh on every call; glibc maps each large block
anew and the kernel then faults it in one 4 KiB page at a time (the faults' share of an update, with
and without huge pages: benchmark/results/speed_cpu.md, 2026-11-25). With glibc's
`glibc.malloc.hugetlb=1` tunable, malloc asks for transparent huge pages for the blocks it maps
(2 MiB a fault) and the peak memory stays the same. glibc reads its tunables only when a process
starts, so a script restarts itself once with the tunable set: the scripts whose networks see images
(PPO, IMPALA, GALA A2C, Ape-X DQN). The MLPs of continuous control allocate blocks small enough for
glibc to keep in its heap."""

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
NO_HUGE_PAGES_VARIABLE = "CLEANBA_NO_HUGE_PAGES"
"""Set to 1 to run without the restart (e.g. under a debugger that does not follow exec)."""


def madvised_huge_pages() -> bool:
    """Whether the kernel gives transparent huge pages to the blocks a process asks for (mode
    `madvise`); with `always` every process has them, with `never` none can."""
    try:
        with open(THP_MODE_FILE) as file:
            return "[madvise]" in file.read()
    except OSError:
        return False


def glibc_has_the_tunable() -> bool:
    """glibc 2.35 added `glibc.malloc.hugetlb`."""
    library, version = platform.libc_ver()
    if library != "glibc":
        return False
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= (2, 35)


def restart_with_huge_pages():
    """Re-executes this Python process (same interpreter, arguments and process id) with the
    tunable added to GLIBC_TUNABLES, where it helps and is not set yet; otherwise returns."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (
        os.environ.get(NO_HUGE_PAGES_VARIABLE) == "1"
        or "glibc.malloc.hugetlb" in tunables
        or sys.platform != "linux"
        or sys.gettrace() is not None
        or not sys.executable
        or not glibc_has_the_tunable()
        or not madvised_huge_pages()
    ):
        return
    os.environ["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}" if tunables else TUNABLE
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
