"""What the SLURM benchmarks share (benchmark/slurm_local.py, slurm_stops.py, slurm_nodes.py): the
work folder and its commands (`Lab`), the launcher's command line, the queue's task states, the
run rows of the reports and the local cluster started at the right size (`open_lab`)."""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import flax.serialization
import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmark" / "results"
TEMPLATE = str(REPO / "cleanba.slurm_template")


def log(message: str):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Lab:
    """The work folder (runs, launcher logs) and every command run there, for the report."""

    def __init__(self, work_dir: Path):
        self.dir = work_dir
        self.commands = []
        # The tasks start `python`: this environment's, first on the job's PATH (sbatch passes
        # the submitting environment on).
        bin_dir = os.path.dirname(sys.executable)
        self.env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def run(self, argv: list, timeout: float = 3600, env: dict | None = None):
        argv = [str(a) for a in argv]
        self.commands.append(shlex.join(argv))
        return subprocess.run(
            argv, cwd=self.dir, env=env or self.env, capture_output=True, text=True, timeout=timeout
        )

    def start(self, argv: list) -> subprocess.Popen:
        argv = [str(a) for a in argv]
        self.commands.append(shlex.join(argv))
        return subprocess.Popen(
            argv,
            cwd=self.dir,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def summary(self, run_name: str) -> dict:
        path = self.dir / "runs" / run_name / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def run_names(self, experiment: str) -> list:
        path = self.dir / "runs" / "_experiments" / experiment / "experiment.json"
        trials = json.loads(path.read_text())["trials"]
        return [run["run_name"] for trial in trials for run in trial["runs"]]

    def returns(self, run_name: str) -> list:
        events = EventAccumulator(str(self.dir / "runs" / run_name), size_guidance={"scalars": 0})
        events.Reload()
        if "charts/episodic_return" not in events.Tags()["scalars"]:
            return []
        return [e.value for e in events.Scalars("charts/episodic_return")]


def launcher(
    experiment: str, env_id: str, seeds: int, command: str, *extra, slurm: bool, cpus: int = 1
) -> list:
    argv = [sys.executable, "-m", "cleanba_utils.experiments.launch", "--env-ids", env_id]
    argv += ["--num-seeds", seeds, "--start-seed", 1, "--experiment", experiment, "--workers", 2]
    argv += ["--command", command, *extra]
    if slurm:
        argv += ["--slurm-template-path", TEMPLATE, "--slurm-gpus-per-task", 0]
        argv += ["--slurm-total-cpus", cpus, "--slurm-wait"]
    return argv


def row(lab: Lab, check: str, mode: str, run_name: str, **more) -> dict:
    summary = lab.summary(run_name)
    spec_path = lab.dir / "runs" / run_name / "spec.json"
    spec = json.loads(spec_path.read_text()) if spec_path.exists() else {}
    returns = lab.returns(run_name)
    return dict(
        check=check,
        script=spec.get("script", ""),
        mode=mode,
        env_id=spec.get("args", {}).get("env_id", ""),
        seed=spec.get("args", {}).get("seed", ""),
        steps=summary.get("global_step", ""),
        final_return=round(float(np.mean(returns[-100:])), 2) if returns else "",
        eval_return=summary.get("eval_return", ""),
        sps=summary.get("sps", ""),
        wall_time_s=round(summary["wall_time_s"], 1) if summary else "",
        run_name=run_name,
        fingerprint=summary.get("params_fingerprint", "")[:16],
        **more,
    )


def load_model(path: Path) -> dict:
    return flax.serialization.msgpack_restore(path.read_bytes())["params"]


def leaves(tree) -> list:
    if isinstance(tree, dict):
        return [leaf for key in sorted(tree) for leaf in leaves(tree[key])]
    return [np.asarray(tree, np.float64).ravel()]


def wait_for_text(path: Path, text: str, timeout: float = 900) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return time.time()
        time.sleep(0.5)
    raise RuntimeError(f"{path} did not show {text!r} within {timeout:.0f} s")


def task_states(job_id: str) -> dict:
    """{task id: its state, with the reason of a pending one}, for the queued and running tasks."""
    out = subprocess.run(
        ["squeue", "--noheader", "--array", f"--jobs={job_id}", "--format=%i %T %r"],
        capture_output=True,
        text=True,
    ).stdout
    states = {}
    for line in out.splitlines():
        task, state, reason = [*line.split(maxsplit=2), "", ""][:3]
        states[task] = f"{state} ({reason})" if state == "PENDING" else state
    return states


def open_lab(description: str, name: str, nodes: int = 1) -> Lab:
    """The command line's --work-dir (default: a new folder under /tmp) as a Lab, once the local
    cluster runs with `nodes` nodes (started, or restarted with that size, here)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--work-dir", type=Path)
    args = parser.parse_args()
    start = ["bash", REPO / "benchmark" / "slurm_local.sh", "start", "--nodes", str(nodes)]
    if subprocess.run(start).returncode:
        sys.exit(f"{name}: no SLURM cluster could be started (see the line above)")
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix=f"cleanba-{name}-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    log(f"work folder {work_dir}")
    return Lab(work_dir)
