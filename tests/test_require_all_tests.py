"""CLEANBA_REQUIRE_ALL_TESTS=1 (`.ci/run` sets it): a test that needs what this machine lacks fails,
with one line naming what is missing and how to provide it; without it the test skips, and pytest's
summary lists the skip with that line. Shown on a SLURM test, in a pytest run whose `sinfo` fails
as where no cluster runs."""

import os
import subprocess
import sys

from helpers import REPO, REQUIRE_ALL_TESTS

# The cheapest test of tests/test_slurm.py (one srun), which needs the cluster and nothing else.
SLURM_TEST = (
    "tests/test_slurm.py::test_each_srun_task_asks_jax_for_every_device_of_the_workstation_layout"
)
MISSING_CLUSTER = (
    "no SLURM cluster answers sinfo (start one as root: bash benchmark/slurm_local.sh start "
    "--nodes 2)"
)


def pytest_without_a_cluster(tmp_path, required: bool) -> subprocess.CompletedProcess:
    """pytest, in one process, on SLURM_TEST with a `sinfo` first on the PATH that fails as it does
    where no controller answers."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sinfo = bin_dir / "sinfo"
    sinfo.write_text(
        "#!/bin/sh\n"
        'echo "slurm_load_partitions: Unable to contact slurm controller (connect failure)" >&2\n'
        "exit 1\n"
    )
    sinfo.chmod(0o755)
    env = {
        key: value
        for key, value in os.environ.items()
        if key != REQUIRE_ALL_TESTS and not key.startswith(("PYTEST_", "PYTEST_XDIST"))
    }
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    # pytest cuts a summary line's message to the terminal's width, which differs from machine to
    # machine (CI's is wider): one wide width makes the summary the same everywhere.
    env["COLUMNS"] = "1000"
    if required:
        env[REQUIRE_ALL_TESTS] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", SLURM_TEST],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def summary_lines(result) -> list[str]:
    """The lines of pytest's short test summary."""
    lines = result.stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if "short test summary info" in line]
    assert starts, result.stdout[-3000:]
    return lines[starts[0] + 1 : -1]


def test_with_the_variable_a_missing_cluster_fails_the_run_with_a_line_that_names_it(tmp_path):
    result = pytest_without_a_cluster(tmp_path, required=True)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    # The test's fixture fails: an error at its setup, reported by the line alone (no traceback).
    assert summary_lines(result) == [
        f"ERROR {SLURM_TEST} - Failed: {REQUIRE_ALL_TESTS}=1 and {MISSING_CLUSTER}"
    ]
    lines = result.stdout.splitlines()
    at = lines.index(f"{REQUIRE_ALL_TESTS}=1 and {MISSING_CLUSTER}")
    assert lines[at - 1].strip("_ ").startswith("ERROR at setup of "), lines[at - 1]


def test_without_it_the_test_skips_and_the_summary_says_why(tmp_path):
    result = pytest_without_a_cluster(tmp_path, required=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [line] = summary_lines(result)
    assert line.startswith("SKIPPED [1] tests/test_slurm.py:"), line
    assert line.endswith(f": {MISSING_CLUSTER}"), line
    assert "1 skipped" in result.stdout.splitlines()[-1]
