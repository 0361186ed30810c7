"""The README's training commands as they stand, on this machine: steady steps per second and peak
memory.

python benchmark/defaults_cpu.py                       # both scripts, 2 updates each
python benchmark/defaults_cpu.py --scripts cleanba_impala --updates 4

Each script runs with every default (the paper's settings: Breakout-v5, the IMPALA ResNet, 2 actor
threads x 64 environments) and `--total-timesteps` cut to a few updates. Steady SPS is measured
between the ends of the first and the last update (the first one compiles); peak memory is the
maximum resident set size of the run's process (envpool's workers are its threads). Writes
benchmark/results/defaults_cpu.md.
"""

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

from measure import run_measured, stack_line
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
# The number of environment steps of one update at the defaults: 2 threads x 64 envs x num_steps.
STEPS_PER_UPDATE = {"cleanba_ppo": 2 * 64 * 128, "cleanba_impala": 2 * 64 * 20}


def measure(script: str, updates: int, work_dir: Path) -> dict:
    run_name = f"{script}_defaults"
    command = [
        "python",
        f"cleanba/{script}.py",
        "--env-id",
        "Breakout-v5",
        "--total-timesteps",
        str(updates * STEPS_PER_UPDATE[script]),
        "--run-name",
        run_name,
    ]
    measured = run_measured(
        [str(REPO / command[1]), *command[2:]], work_dir, work_dir / f"{run_name}.log"
    )
    exit_code = measured["exit_code"]
    events = EventAccumulator(str(work_dir / "runs" / run_name), size_guidance={"scalars": 0})
    events.Reload()
    updates_logged = events.Scalars("stats/learner_policy_version") if exit_code == 0 else []
    steady_sps = None
    if len(updates_logged) > 1:
        first, last = updates_logged[0], updates_logged[-1]
        steady_sps = (last.step - first.step) / (last.wall_time - first.wall_time)
    return dict(
        command=" ".join(command),
        exit_code=exit_code,
        peak_rss_gib=measured["peak_rss_gib"],
        steady_sps=steady_sps,
        wall_time_min=measured["wall_time_s"] / 60,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scripts", nargs="+", default=list(STEPS_PER_UPDATE), choices=list(STEPS_PER_UPDATE)
    )
    parser.add_argument(
        "--updates", type=int, default=2, help="updates per run (the first one compiles)"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmark" / "results" / "defaults_cpu.md"
    )
    options = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work_dir:
        for script in options.scripts:
            result = measure(script, options.updates, Path(work_dir))
            sps = f"{result['steady_sps']:.1f}" if result["steady_sps"] else "n/a"
            rows.append(
                f"| `{result['command']}` | {result['exit_code']} | {sps} | "
                f"{result['peak_rss_gib']:.1f} | {result['wall_time_min']:.1f} |"
            )
            print(rows[-1], flush=True)
    options.out.write_text(
        f"# The README's commands at their defaults ({time.strftime('%Y-%m-%d')})\n\n"
        f"{stack_line()}\n\n"
        f"Machine: {platform.machine()}, 2 CPU cores, 24 GiB, Python {platform.python_version()}. "
        f"Made by `python benchmark/defaults_cpu.py {' '.join(sys.argv[1:])}`.\n\n"
        "| command | exit code | steady SPS | peak RSS (GiB) | wall time (min) |\n"
        "|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    print(options.out.read_text())


if __name__ == "__main__":
    main()
