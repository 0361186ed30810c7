"""What a run asks of the accelerator (cleanba_utils/accelerators.py): deterministic GPU
operations unless --nondeterministic-gpu-ops, added after the user's own XLA_FLAGS and recorded in
spec.json and the first line; the hint of a CPU-only JAX on a machine with an NVIDIA GPU (nvidia-smi
simulated by a program of the same name on PATH); the suite's JAX on the CPU."""

import json
import os
import stat
import types

import jax
import pytest
from helpers import run_script

from cleanba_utils import accelerators

FLAG = "--xla_gpu_deterministic_ops=true"
CARTPOLE = [
    *["--env-id", "CartPole-v1", "--hiddens", "16", "--local-num-envs", "4"],
    *["--num-actor-threads", "1", "--num-steps", "16", "--num-minibatches", "2"],
    *["--gradient-accumulation-steps", "1", "--total-timesteps", "128", "--log-frequency", "100"],
]


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Each test as a new process: no XLA_FLAGS remembered from another test's parse."""
    monkeypatch.setattr(accelerators, "_requested", {})


def test_the_flag_is_appended_to_the_users_flags_once():
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    accelerators.request_deterministic_ops(False, environ)
    assert environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=4 {FLAG}"
    accelerators.request_deterministic_ops(False, environ)
    assert environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=4 {FLAG}"
    empty = {}
    accelerators.request_deterministic_ops(False, empty)
    assert empty == {"XLA_FLAGS": FLAG}


def test_the_opt_out_leaves_the_users_flags_as_they_were():
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    accelerators.request_deterministic_ops(True, environ)
    assert environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    # A command line parsed again in the same process (tests, the random baseline) starts from
    # the user's flags, not from the flag the first parse added.
    accelerators.request_deterministic_ops(False, environ)
    accelerators.request_deterministic_ops(True, environ)
    assert environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    none = {}
    accelerators.request_deterministic_ops(True, none)
    assert "XLA_FLAGS" not in none


@pytest.mark.parametrize(
    ("xla_flags", "nondeterministic", "refused"),
    [
        ("--xla_gpu_deterministic_ops=false", False, True),
        ("--xla_gpu_deterministic_ops=true", True, True),
        ("--xla_gpu_deterministic_ops", True, True),
        ("--xla_gpu_deterministic_ops=true", False, False),
        ("--xla_gpu_deterministic_ops=false", True, False),
    ],
)
def test_xla_flags_that_contradict_the_option_are_refused(
    xla_flags, nondeterministic, refused, capsys
):
    environ = {"XLA_FLAGS": xla_flags}
    if not refused:
        accelerators.request_deterministic_ops(nondeterministic, environ)
        assert environ["XLA_FLAGS"] == xla_flags
        return
    with pytest.raises(SystemExit) as exit_:
        accelerators.request_deterministic_ops(nondeterministic, environ)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--xla_gpu_deterministic_ops" in lines[0], lines


def test_the_first_line_on_a_gpu_says_which_operations():
    deterministic = types.SimpleNamespace(nondeterministic_gpu_ops=False)
    nondeterministic = types.SimpleNamespace(nondeterministic_gpu_ops=True)
    assert " deterministic operations" in accelerators.backend_note(deterministic, "gpu")
    assert "nondeterministic operations" in accelerators.backend_note(nondeterministic, "gpu")


def fake_nvidia_smi(folder) -> str:
    """A PATH whose `nvidia-smi -L` lists one GPU, as NVIDIA's does."""
    program = folder / "nvidia-smi"
    program.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-00000000)"\n')
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def first_line(result) -> str:
    assert result.returncode == 0, result.stderr[-2000:]
    return next(line for line in result.stdout.splitlines() if "JAX backend" in line)


def test_a_run_asks_for_deterministic_ops_and_says_so(tmp_path):
    """The run's record has the user's XLA_FLAGS (two host devices: kept) with the flag after
    them; a CPU-only JAX on a machine whose nvidia-smi lists a GPU says how to install for it."""
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    environ = {"PATH": fake_nvidia_smi(bin_folder), "JAX_PLATFORMS": ""}
    result = run_script(
        "cleanba_ppo.py", [*CARTPOLE, "--run-name", "r"], tmp_path, devices=2, extra_env=environ
    )
    line = first_line(result)
    assert "JAX backend cpu although nvidia-smi lists 1 GPU(s)" in line, line
    assert "--extra cuda" in line, line
    with open(tmp_path / "runs" / "r" / "spec.json") as f:
        spec = json.load(f)
    assert spec["xla_flags"] == f"--xla_force_host_platform_device_count=2 {FLAG}"
    assert len(spec["devices"]) == 2
    assert spec["args"]["nondeterministic_gpu_ops"] is False


def test_no_hint_where_the_cpu_was_chosen_or_no_gpu_answers(tmp_path):
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    chosen = run_script(
        "cleanba_ppo.py",
        CARTPOLE,
        tmp_path,
        extra_env={"PATH": fake_nvidia_smi(bin_folder), "JAX_PLATFORMS": "cpu"},
    )
    assert first_line(chosen).split("JAX backend cpu")[1].startswith(";")
    (bin_folder / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    failing = run_script("cleanba_ppo.py", CARTPOLE, tmp_path, extra_env={"JAX_PLATFORMS": ""})
    assert first_line(failing).split("JAX backend cpu")[1].startswith(";")


def test_the_opt_out_is_refused_off_a_gpu(tmp_path):
    result = run_script("cleanba_ppo.py", [*CARTPOLE, "--nondeterministic-gpu-ops"], tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--nondeterministic-gpu-ops has no effect here" in lines[0], lines


def test_the_suite_keeps_jax_on_the_cpu():
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    assert jax.default_backend() == "cpu"


def test_a_run_names_the_defaults_it_chose_for_its_platform(tmp_path):
    """PPO on the CPU with neither --env-splits nor --gradient-accumulation-steps: the CPU's values
    in the first line, in spec.json's `platform_defaults` and in its recorded options; a value given
    on the command line is the user's, not the platform's."""
    at = CARTPOLE.index("--gradient-accumulation-steps")
    options = CARTPOLE[:at] + CARTPOLE[at + 2 :]
    result = run_script("cleanba_ppo.py", [*options, "--run-name", "r"], tmp_path)
    line = first_line(result)
    assert "; CPU defaults: --env-splits 1, --gradient-accumulation-steps 4;" in line, line
    with open(tmp_path / "runs" / "r" / "spec.json") as f:
        spec = json.load(f)
    assert spec["platform_defaults"] == {"env_splits": 1, "gradient_accumulation_steps": 4}
    assert spec["args"]["gradient_accumulation_steps"] == 4
    given = run_script("cleanba_ppo.py", [*CARTPOLE, "--env-splits", "2"], tmp_path)
    assert "defaults:" not in first_line(given)


def test_the_gpu_defaults(monkeypatch):
    """What PPO and IMPALA choose where JAX runs on a GPU (its backend simulated): two envpool
    instances per actor thread (one for a thread with one environment), no gradient accumulation."""
    from cleanba import cleanba_impala, cleanba_ppo

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(accelerators, "_platform_chosen", {})
    args = cleanba_ppo.parse_args(["--local-num-envs", "4"])
    accelerators.apply_platform_defaults(args, cleanba_ppo.PLATFORM_DEFAULTS)
    assert (args.env_splits, args.gradient_accumulation_steps) == (2, 1)
    note = accelerators.platform_defaults_note("gpu")
    assert note == "; GPU defaults: --env-splits 2, --gradient-accumulation-steps 1"
    single = cleanba_impala.parse_args(["--local-num-envs", "1", "--num-minibatches", "1"])
    accelerators.apply_platform_defaults(single, cleanba_impala.PLATFORM_DEFAULTS)
    assert single.env_splits == 1
    assert accelerators.platform_defaults() == {"env_splits": 1}
    given = cleanba_ppo.parse_args(["--gradient-accumulation-steps", "2"])
    accelerators.apply_platform_defaults(given, cleanba_ppo.PLATFORM_DEFAULTS)
    assert given.gradient_accumulation_steps == 2
    assert accelerators.platform_defaults() == {"env_splits": 2}
    # A JAX environment's steps run inside the compiled rollout: no envpool instance to split.
    jax_env = cleanba_ppo.parse_args(["--env-id", "gymnax:CartPole-v1"])
    accelerators.apply_platform_defaults(jax_env, cleanba_ppo.PLATFORM_DEFAULTS)
    assert jax_env.env_splits == 1
