"""What CI's tests need of the machine, checked in seconds before anything is installed: one line
for each thing missing, naming it and how to provide it, and exit 2. The tests check the same where
they need it (with CLEANBA_REQUIRE_ALL_TESTS=1 they fail, minutes in, instead of skipping)."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The repository's, before anything is installed.
from cleanba_utils import huge_pages


def missing_root() -> str | None:
    if os.geteuid() != 0:
        return (
            "not root: the local SLURM cluster (benchmark/slurm_local.sh) and the tmpfs mounts of "
            "tests/test_write_failures.py need root; run CI as root"
        )
    return None


def missing_tmpfs() -> str | None:
    with tempfile.TemporaryDirectory() as folder:
        try:
            mounted = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", folder],
                capture_output=True,
                text=True,
            )
        except FileNotFoundError:
            return "no mount command: install util-linux (its mount mounts the tests' tmpfs)"
        if mounted.returncode:
            why = (mounted.stderr.strip().splitlines() or [f"exit {mounted.returncode}"])[0]
            return (
                f"cannot mount a tmpfs ({why}): tests/test_write_failures.py fills small tmpfs "
                "folders; run CI as root in a container allowed to mount (docker --privileged or "
                "--cap-add SYS_ADMIN)"
            )
        subprocess.run(["umount", folder], capture_output=True)
    return None


def missing_huge_pages() -> str | None:
    if not huge_pages.madvised_huge_pages():
        return (
            f"transparent huge pages are not in madvise mode ({huge_pages.THP_MODE_FILE}): the "
            f"scripts' huge-pages restart is tested there; as root, echo madvise > "
            f"{huge_pages.THP_MODE_FILE}"
        )
    return None


def missing_glibc() -> str | None:
    if not huge_pages.glibc_has_the_tunable():
        return (
            "glibc is older than 2.35 (or not glibc): the huge-pages restart needs its "
            "glibc.malloc.hugetlb tunable; run CI on Debian 12, Ubuntu 22.04 or newer"
        )
    return None


CHECKS = [missing_root, missing_tmpfs, missing_huge_pages, missing_glibc]


def main() -> int:
    missing = [line for line in (check() for check in CHECKS) if line]
    for line in missing:
        print(f"error: CI needs what this machine lacks: {line}", file=sys.stderr)
    return 2 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
