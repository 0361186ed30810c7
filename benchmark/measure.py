"""Runs a command in a child process and reports its exit code, wall time and peak resident memory.

`ru_maxrss` of RUSAGE_CHILDREN covers only the processes a process waited for, so each command runs
under a fresh Python that waits for it alone and writes the result to a file (envpool's workers are
threads of the script's process, so they are counted)."""

import argparse
import importlib.metadata
import json
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEASURE = (
    "import resource, subprocess, sys; code = subprocess.run(sys.argv[2:]).returncode; "
    "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss; "
    "open(sys.argv[1], 'w').write(f'{peak} {code}')"
)


def run_measured(command: list[str], cwd: Path, log_path: Path, env: dict | None = None) -> dict:
    """`command` is a script and its arguments, run with this interpreter; stdout and stderr go to
    `log_path`."""
    start = time.time()
    with tempfile.NamedTemporaryFile("r", suffix=".rusage") as result, open(log_path, "w") as log:
        subprocess.run(
            [sys.executable, "-c", MEASURE, result.name, sys.executable, *command],
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        peak_kib, exit_code = map(int, Path(result.name).read_text().split())
    return dict(exit_code=exit_code, peak_rss_gib=peak_kib / 2**20, wall_time_s=time.time() - start)


def run_resumable(name: str, command: list[str], work_dir: Path, repo: Path):
    """Runs a training command (`cleanba/SCRIPT.py ARGS` from the repository root `repo`) as the run
    `work_dir/runs/name` under `nice -n 10`, appending to `work_dir/name.log`; a run stopped before
    its end (SIGTERM, or killed) continues from its newest checkpoint. Exits if the run fails."""
    resume = (work_dir / "runs" / name / "checkpoints").exists()
    command = [str(repo / command[0]), *command[1:], *(["--resume"] if resume else [])]
    print(f"{name}: {'resuming' if resume else 'running'}", flush=True)
    with open(work_dir / f"{name}.log", "a") as log:
        code = subprocess.run(
            ["nice", "-n", "10", sys.executable, *command],
            cwd=work_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
        ).returncode
    if code:
        sys.exit(f"{name} stopped (exit {code}); run the same command to resume it")


def command_line(argv: list[str]) -> str:
    """The benchmark command a report quotes: `python SCRIPT ARGS` without the report's own prose
    (--note)."""
    shown = []
    skip = False
    for arg in argv[1:]:
        if not skip and arg != "--note":
            shown.append(arg)
        skip = arg == "--note"
    return shlex.join(["python", f"benchmark/{Path(argv[0]).name}", *shown])


def code_of_runs(run_dirs: list[Path]) -> str:
    """What the runs ran: the commits of their code (each start's and resume's spec file, short) and
    the library versions of their spec.json, for a report's header."""
    commits = []
    versions = {}
    for run_dir in run_dirs:
        for spec_path in sorted(Path(run_dir).glob("spec*.json")):
            spec = json.loads(spec_path.read_text())
            sha = (spec.get("git_sha") or "unknown")[:7]
            if sha not in commits:
                commits.append(sha)
            versions |= spec.get("versions", {})
    listed = ", ".join(f"{name} {version}" for name, version in sorted(versions.items()))
    return f"commits {', '.join(commits) or 'none yet'}; {listed or 'no versions recorded'}"


STACK_PACKAGES = ("jax", "jaxlib", "envpool", "numpy", "flax", "optax")


def stack_line() -> str:
    """A report's line on the code and libraries that wrote it: this checkout's commit (short, its
    date, whether files differ from it) and the installed versions of the packages that decide
    the numbers."""
    repo = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
        except OSError:
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    sha = git("rev-parse", "--short", "HEAD")
    if sha:
        changed = ", with uncommitted changes" if git("status", "--porcelain", "-uno") else ""
        code = f"commit {sha} ({git('log', '-1', '--format=%ad', '--date=short')}{changed})"
    else:
        code = "a copy outside git (commit unknown)"
    versions = []
    for name in STACK_PACKAGES:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} not installed")
    return (
        f"Code and stack: written with {code}; installed: {', '.join(versions)}; "
        f"Python {platform.python_version()}."
    )


def resumable_benchmark_options(description: str, run_names: list[str], work_dir: str):
    """The options of a benchmark of resumable runs (its folders made): --runs (of `run_names`, all
    by default), --report-only, --work-dir (default `work_dir`), --out-dir (the repository's
    benchmark/results), --date and --note (a paragraph for the report)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--runs", nargs="+", default=run_names, choices=run_names)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--work-dir", type=Path, default=Path(work_dir))
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument("--note", default="", help="a paragraph for the report")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    return args
