"""Steady-state throughput of both scripts on this machine, at the same environment count and rollout length.

    python benchmark/throughput_cpu.py

Runs each script on Breakout-v5 with 2 actor threads x 8 environments and 32 steps per rollout (512
environment steps per update), once with a small network and once with the default IMPALA ResNet, and
prints a Markdown table. The first update (compilation) is left out: steps per second are measured
between the ends of the second and the last update.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
COMMON = ["--env-id", "Breakout-v5", "--local-num-envs", "8", "--num-steps", "32", "--log-frequency", "1000"]
NETWORKS = {
    "small (`--channels 4 8 --hiddens 64`)": (["--channels", "4", "8", "--hiddens", "64"], 6),
    "default (IMPALA ResNet 16-32-32, 256)": ([], 3),
}


def steady_sps(run_dir: Path) -> float:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    updates = events.Scalars("stats/learner_policy_version")
    return (updates[-1].step - updates[0].step) / (updates[-1].wall_time - updates[0].wall_time)


def main():
    rows = ["| network | cleanba_ppo.py SPS | cleanba_impala.py SPS |", "|---|---|---|"]
    with tempfile.TemporaryDirectory() as work_dir:
        for network, (network_args, num_updates) in NETWORKS.items():
            sps = []
            for script in ["cleanba_ppo", "cleanba_impala"]:
                run_name = f"{script}_{len(rows)}"
                args = [*COMMON, *network_args, "--total-timesteps", str(512 * num_updates), "--run-name", run_name]
                subprocess.run(
                    [sys.executable, str(REPO / "cleanba" / f"{script}.py"), *args],
                    cwd=work_dir,
                    check=True,
                    capture_output=True,
                )
                sps.append(steady_sps(Path(work_dir) / "runs" / run_name))
            rows.append(f"| {network} | {sps[0]:.0f} | {sps[1]:.0f} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
