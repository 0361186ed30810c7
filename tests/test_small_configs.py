"""Every script trains at its small configurations of benchmark/fingerprints.py, on envpool's
environments and on a JAX environment, and prints the fingerprint of its parameters. With
tests/test_options.py this is the part of the suite that .ci/run also runs on Python 3.12 and 3.13,
where nothing else of the suite runs: there each fingerprint must be 3.11's of the same CI run
(`uv.lock` gives the three versions the same packages, so the same computation)."""

import os
import re
from pathlib import Path

import pytest
from helpers import run_script

# helpers puts benchmark/ on the import path.
from fingerprints import CONFIGS, command_of  # isort: skip


SAVE_VARIABLE = "CLEANBA_SAVE_FINGERPRINTS"
"""a folder: each fingerprint is written there, one file a configuration (.ci/run, on 3.11)"""
EXPECTED_VARIABLE = "CLEANBA_EXPECTED_FINGERPRINTS"
"""a folder of such files: each fingerprint must equal its file's (.ci/run, on 3.12 and 3.13)"""


@pytest.mark.parametrize("script", list(CONFIGS))
def test_small_configuration_trains_and_prints_its_fingerprint(tmp_path, script):
    # command_of() starts with the script's path; run_script takes its name under cleanba/.
    command = command_of(script)
    result = run_script(command[0].split("/")[-1], command[1:], cwd=tmp_path, devices=4)
    assert result.returncode == 0, result.stderr[-3000:]
    fingerprints = re.findall(r"^params_fingerprint=(\S+)$", result.stdout, flags=re.MULTILINE)
    assert len(fingerprints) == 1, result.stdout[-3000:]
    file_name = f"{script.replace(':', '_')}.txt"
    if os.environ.get(SAVE_VARIABLE):
        Path(os.environ[SAVE_VARIABLE], file_name).write_text(fingerprints[0])
    if os.environ.get(EXPECTED_VARIABLE):
        expected = Path(os.environ[EXPECTED_VARIABLE], file_name).read_text()
        assert fingerprints[0] == expected, f"{script}: not the fingerprint of Python 3.11's run"
