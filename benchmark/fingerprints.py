"""The parameters' fingerprint of every script at one small configuration each: what a pure
restructuring of a script must leave unchanged, bit for bit, on the same machine and versions.

python benchmark/fingerprints.py                        # print them (about 2 minutes on 2 cores)
python benchmark/fingerprints.py --save before.json     # keep them
python benchmark/fingerprints.py --compare before.json  # exit 1 if any differs

Each run is a subprocess in a temporary folder, with 4 host devices (GALA's agents). Each script
runs on envpool's environments (`cleanba_ppo`) and on a JAX environment (`cleanba_ppo:jax`:
gymnax's MinAtar Breakout or Pendulum-v1)."""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    "cleanba_ppo": [
        *["--env-id", "Breakout-v5", "--channels", "4", "--hiddens", "32"],
        *["--local-num-envs", "8", "--num-actor-threads", "1", "--num-steps", "16"],
        *["--num-minibatches", "2", "--update-epochs", "2", "--total-timesteps", "256"],
    ],
    "cleanba_impala": [
        *["--env-id", "Breakout-v5", "--channels", "4", "--hiddens", "32"],
        *["--local-num-envs", "8", "--num-actor-threads", "1", "--num-steps", "16"],
        *["--num-minibatches", "2", "--total-timesteps", "256"],
    ],
    "cleanba_apex_dqn": [
        *["--env-id", "CartPole-v1", "--hiddens", "16", "16", "--local-num-envs", "4"],
        *["--num-steps", "8", "--total-timesteps", "2048", "--learning-starts", "256"],
        *["--batch-size", "32", "--updates-per-rollout", "2", "--buffer-size", "4096"],
        *["--target-update-period", "10"],
    ],
    "cleanba_gala_a2c": [
        *["--env-id", "CartPole-v1", "--hiddens", "16", "--local-num-envs", "2"],
        *["--num-steps", "4", "--total-timesteps", "320"],
    ],
    "cleanba_ppo_continuous": [
        *["--env-id", "HalfCheetah-v4", "--num-steps", "16", "--num-minibatches", "2"],
        *["--update-epochs", "2", "--total-timesteps", "384"],
    ],
    "cleanba_sac": [
        *["--env-id", "Hopper-v4", "--hiddens", "16", "16", "--batch-size", "32"],
        *["--num-steps", "16", "--local-num-envs", "4", "--total-timesteps", "384"],
        *["--learning-starts", "128", "--replay-ratio", "0.5", "--buffer-size", "1000"],
    ],
    "cleanba_apex_dpg": [
        *["--env-id", "Hopper-v4", "--critic-hiddens", "32", "32", "--actor-hiddens", "32", "32"],
        *["--local-num-envs", "4", "--num-actor-threads", "1", "--num-steps", "8"],
        *["--total-timesteps", "512", "--learning-starts", "64", "--random-steps", "48"],
        *["--buffer-size", "256", "--batch-size", "16", "--updates-per-rollout", "4"],
        *["--steps-per-call", "2"],
    ],
}


# The same configurations on a JAX environment, stepped inside the actors' compiled rollouts.
JAX_ENVS = {"discrete": "gymnax:Breakout-MinAtar", "continuous": "gymnax:Pendulum-v1"}
CONTINUOUS = ["cleanba_ppo_continuous", "cleanba_sac", "cleanba_apex_dpg"]
for _script, _config in list(CONFIGS.items()):
    _config = list(_config)
    _config[_config.index("--env-id") + 1] = JAX_ENVS[
        "continuous" if _script in CONTINUOUS else "discrete"
    ]
    if "--channels" in _config:
        del _config[_config.index("--channels") : _config.index("--channels") + 2]
    CONFIGS[f"{_script}:jax"] = _config


def script_of(name: str) -> str:
    """The script of a configuration's name (`cleanba_ppo:jax` -> `cleanba_ppo`)."""
    return name.split(":")[0]


def command_of(name: str) -> list[str]:
    return [f"cleanba/{script_of(name)}.py", *CONFIGS[name], "--log-frequency", "1000"]


def fingerprint_of(script: str) -> str:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    with tempfile.TemporaryDirectory() as folder:
        command = command_of(script)
        command[0] = str(REPO / command[0])
        result = subprocess.run(
            [sys.executable, *command], cwd=folder, env=env, capture_output=True, text=True
        )
    lines = [line for line in result.stdout.splitlines() if line.startswith("params_fingerprint=")]
    if result.returncode or not lines:
        sys.exit(f"{script} failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    return lines[-1].split("=", 1)[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--save", type=Path, help="write the fingerprints to this JSON file")
    parser.add_argument("--compare", type=Path, help="compare with the fingerprints of this file")
    options = parser.parse_args()
    expected = json.loads(options.compare.read_text()) if options.compare else {}
    fingerprints = {}
    differ = []
    for script in options.scripts:
        start = time.time()
        fingerprints[script] = fingerprint_of(script)
        verdict = ""
        if script in expected:
            same = expected[script] == fingerprints[script]
            verdict = "same" if same else f"DIFFERS from {expected[script]}"
            differ += [] if same else [script]
        print(
            f"{script}: {fingerprints[script]} ({time.time() - start:.0f} s) {verdict}", flush=True
        )
        print(f"  python {' '.join(command_of(script))}", flush=True)
    if options.save:
        options.save.write_text(json.dumps(fingerprints, indent=1) + "\n")
    if differ:
        sys.exit(f"fingerprints differ: {', '.join(differ)}")


if __name__ == "__main__":
    main()
