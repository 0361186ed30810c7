"""The same run twice on this machine's accelerator: every script's small configuration (the
configurations of benchmark/fingerprints.py) run twice, with each run's parameter fingerprint,
whether the two repeat, the deterministic-operations setting and the run's steps per second.

python benchmark/gpu_check.py                          # every script, twice each, one at a time
python benchmark/gpu_check.py --parallel 4 --out DIR   # 4 runs at a time; DIR/gpu_check.{csv,md}
python benchmark/gpu_check.py --nondeterministic       # the same with --nondeterministic-gpu-ops

With --parallel the runs share the GPU and the CPUs, so their steps per second are not each
script's speed alone, and each run's XLA_CLIENT_MEM_FRACTION is its share of the GPU's
memory. Steps per second: the console's SPS at the last update (compilation included).
Exit code 1 if a run fails or, with deterministic operations, a fingerprint does not repeat."""

import argparse
import concurrent.futures
import csv
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from csv_columns import RUN_COLUMNS
from fingerprints import CONFIGS, script_of

REPO = Path(__file__).resolve().parents[1]
RUNS_PER_SCRIPT = 2
SEED = 1
COLUMNS = [*RUN_COLUMNS, "attempt", "exit_code", "fingerprint", "deterministic_ops", "device"]
"""One row per run: the benchmark columns (`mode` is deterministic or nondeterministic)."""


def environment_steps(args: list[str]) -> int:
    return int(args[args.index("--total-timesteps") + 1])


def run_once(script: str, nondeterministic: bool, memory_fraction: float | None) -> dict:
    """One run of `script`'s small configuration in a fresh folder: its fingerprint, exit code,
    steps per second (the console's last SPS) and wall time."""
    command = [sys.executable, str(REPO / "cleanba" / f"{script_of(script)}.py"), *CONFIGS[script]]
    command += ["--log-frequency", "1000"]
    command += ["--nondeterministic-gpu-ops"] if nondeterministic else []
    xla_flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    environ = dict(os.environ, XLA_FLAGS=xla_flags.strip())
    # JAX's name for the share of the GPU's memory a process reserves (the older
    # XLA_PYTHON_CLIENT_MEM_FRACTION beside it is an error), unless the user set either.
    user_fraction = {"XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"} & set(environ)
    if memory_fraction is not None and not user_fraction:
        environ["XLA_CLIENT_MEM_FRACTION"] = f"{memory_fraction:.2f}"
    start = time.time()
    with tempfile.TemporaryDirectory() as folder:
        result = subprocess.run(
            command, cwd=folder, env=environ, capture_output=True, text=True, timeout=600
        )
    wall_time = time.time() - start
    fingerprints = re.findall(r"^params_fingerprint=(\w+)$", result.stdout, re.MULTILINE)
    speeds = re.findall(r"\bSPS=(\d+)", result.stdout)
    backends = re.findall(r"JAX backend (\w+)", result.stdout)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    return dict(
        script=script,
        mode="nondeterministic" if nondeterministic else "deterministic",
        env_id=CONFIGS[script][CONFIGS[script].index("--env-id") + 1],
        seed=SEED,
        steps=environment_steps(CONFIGS[script]),
        final_return="",
        eval_return="",
        sps=int(speeds[-1]) if speeds else "",
        wall_time_s=round(wall_time, 1),
        exit_code=result.returncode,
        fingerprint=fingerprints[-1] if fingerprints else "",
        deterministic_ops=not nondeterministic,
        device=backends[-1] if backends else "",
        error=errors[-1][:300] if result.returncode and errors else "",
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument(
        "--nondeterministic",
        action="store_true",
        help="run with --nondeterministic-gpu-ops (a GPU only): fingerprints may differ",
    )
    parser.add_argument("--out", type=Path, help="write gpu_check.csv and gpu_check.md here")
    options = parser.parse_args()
    if options.parallel < 1:
        parser.error(f"--parallel must be positive, got {options.parallel}")
    memory_fraction = 0.9 / options.parallel if options.parallel > 1 else None
    jobs = [(script, attempt) for script in options.scripts for attempt in range(RUNS_PER_SCRIPT)]
    rows = {}
    with concurrent.futures.ThreadPoolExecutor(options.parallel) as pool:
        futures = {
            pool.submit(run_once, script, options.nondeterministic, memory_fraction): (
                script,
                attempt,
            )
            for script, attempt in jobs
        }
        for future in concurrent.futures.as_completed(futures):
            script, attempt = futures[future]
            row = future.result() | {"attempt": attempt + 1}
            rows[script, attempt] = row
            print(
                f"{script} run {attempt + 1}: exit {row['exit_code']}, {row['wall_time_s']} s, "
                f"SPS {row['sps']}, {row['fingerprint'][:16]} {row['error']}",
                flush=True,
            )
    lines = [
        f"runs at a time: {options.parallel}; deterministic GPU operations: "
        f"{'no (--nondeterministic-gpu-ops)' if options.nondeterministic else 'yes'}",
        "",
        "| script | device | fingerprint, run 1 | run 2 | repeats | SPS (run 1, run 2) |",
        "|---|---|---|---|---|---|",
    ]
    failed = False
    for script in options.scripts:
        first, second = rows[script, 0], rows[script, 1]
        ran = first["exit_code"] == 0 and second["exit_code"] == 0
        repeats = ran and first["fingerprint"] == second["fingerprint"]
        failed |= not ran or (not repeats and not options.nondeterministic)
        verdict = "yes" if repeats else ("no" if ran else "a run failed")
        lines.append(
            f"| {script} | {first['device']} | `{first['fingerprint'][:16]}` | "
            f"`{second['fingerprint'][:16]}` | {verdict} | {first['sps']}, {second['sps']} |"
        )
    print("\n".join(lines), flush=True)
    if options.out:
        options.out.mkdir(parents=True, exist_ok=True)
        (options.out / "gpu_check.md").write_text("\n".join(lines) + "\n")
        with open(options.out / "gpu_check.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            for script, attempt in jobs:
                writer.writerow(rows[script, attempt])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
