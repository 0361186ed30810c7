"""benchmark/speed_gpu.py: every section at --small on the CPU, and the XLA_FLAGS its learner
processes get."""

import csv
import math
import os
import subprocess
import sys

import pytest
from helpers import REPO

# helpers puts benchmark/ on the import path.
import speed_gpu  # isort: skip

USER_FLAGS = "--xla_force_host_platform_device_count=1"


def positive(value: str) -> bool:
    return value != "" and math.isfinite(float(value)) and float(value) > 0


def test_deterministic_ops_are_appended_to_the_users_xla_flags():
    env = speed_gpu.with_deterministic_ops({"XLA_FLAGS": f" {USER_FLAGS} ", "OTHER": "kept"})
    assert env == {
        "XLA_FLAGS": f"{USER_FLAGS} --xla_gpu_deterministic_ops=true",
        "OTHER": "kept",
    }
    assert speed_gpu.with_deterministic_ops({})["XLA_FLAGS"] == "--xla_gpu_deterministic_ops=true"


# In the long checks (`-m long`): its runs cost the README's test command about 65 s of a worker.
@pytest.mark.long
def test_small_run_of_every_section(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmark" / "speed_gpu.py"),
            "--small",
            "--env-seconds",
            "0.5",
            "--learner-seconds",
            "0",
            "--out",
            str(tmp_path),
        ],
        env={**os.environ, "XLA_FLAGS": USER_FLAGS},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "speed_gpu.csv") as file:
        rows = list(csv.DictReader(file))
    section = lambda name: [row for row in rows if row["section"] == name]

    envpool = section("envpool")
    assert {row["pools_per_thread"] for row in envpool} == {"1", "2"}
    assert all(positive(row["sps"]) and row["actor_threads"] == "2" for row in envpool)

    learner = {(row["script"], row["deterministic_ops"]): row for row in section("learner")}
    assert set(learner) == {
        (f"cleanba_{algorithm}", setting)
        for algorithm in ("ppo", "impala")
        for setting in ("off", "on")
    }
    for (_, setting), row in learner.items():
        columns = ["seconds_per_update", "sps", "flops_per_update", "flops_per_update_lowered"]
        for column in [*columns, "flop_rate"]:
            assert positive(row[column]), (column, row)
        assert row["peak"] == "unknown peak"
        # The user's flags come first, the deterministic one after them; without it, they alone.
        expected = (
            f"{USER_FLAGS} --xla_gpu_deterministic_ops=true" if setting == "on" else USER_FLAGS
        )
        assert row["xla_flags"] == expected

    runs = section("runs")
    assert [(row["script"], row["deterministic_ops"]) for row in runs] == [
        *[(f"cleanba_{algorithm}", "off") for algorithm in ("ppo", "impala")],
        *[
            (f"{prefix}cleanba_{algorithm}", "on")
            for algorithm in ("ppo", "impala")
            for prefix in ("", "ours with the CPU defaults ")
        ],
    ]
    for row in runs:
        if row["script"].startswith("ours with the CPU defaults"):
            # Off a GPU the platform's defaults are the CPU's: nothing to compare.
            assert row["last_stderr_line"] == "skipped: the platform's defaults are these on a CPU"
            continue
        if row["last_stderr_line"].startswith("skipped"):
            # Off a GPU the scripts refuse --nondeterministic-gpu-ops.
            assert row["deterministic_ops"] == "off" and "GPU" in row["last_stderr_line"]
            continue
        assert row["exit_code"] == "0" and positive(row["sps"]), row
        assert int(row["steady_points"]) >= 3
    assert any(row["deterministic_ops"] == "on" and positive(row["sps"]) for row in runs)

    report = (tmp_path / "speed_gpu.md").read_text()
    for table in ["| envpool alone", "| learner alone", "| whole run", "| ours |"]:
        assert table in report
    assert report in result.stdout
    assert "learner cleanba_impala, deterministic ops on: " in result.stdout
