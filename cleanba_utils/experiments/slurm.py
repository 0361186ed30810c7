"""An experiment as one SLURM job array, one array task per run: the sizes of a task, the sbatch
script filled in from its template (cleanba.slurm_template), and its submission."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import time

SQUEUE_POLL_SECONDS = 2

SLURM_DEFAULTS = {
    "slurm_gpus_per_task": 1,
    "slurm_ntasks": 1,
    "slurm_nodes": 1,
    "slurm_total_cpus": 8,
    "slurm_time": None,
    "slurm_signal_lead": 120,
}
TIME_FORMATS = (
    "MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES or "
    "DAYS-HOURS:MINUTES:SECONDS"
)
MAX_SIGNAL_LEAD = 65535
"""the longest lead SLURM's --signal takes (seconds)"""


def time_limit_seconds(text: str) -> int:
    """A time limit in SLURM's formats (sbatch --time), in seconds; a ValueError names them."""
    days, dash, clock = text.partition("-")
    if not dash:
        clock = days
        days = "0"
    parts = clock.split(":")
    if not all(part.isdigit() for part in [days, *parts]) or len(parts) > 3:
        raise ValueError(f"--slurm-time {text!r} is not a SLURM time limit; give {TIME_FORMATS}")
    numbers = [int(part) for part in parts]
    if dash:  # DAYS-HOURS[:MINUTES[:SECONDS]]
        hours, minutes, seconds = numbers + [0] * (3 - len(numbers))
    elif len(numbers) == 3:  # HOURS:MINUTES:SECONDS
        hours, minutes, seconds = numbers
    else:  # MINUTES[:SECONDS]
        hours = 0
        minutes, seconds = numbers + [0] * (2 - len(numbers))
    return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds


def job_options(args):
    """The SLURM sizes with their defaults filled in, or None without --slurm-template-path; a
    ValueError says what is wrong with them."""
    given = [
        name
        for name in [*SLURM_DEFAULTS, "slurm_job_name", "slurm_partition"]
        if getattr(args, name) is not None
    ]
    if args.slurm_template_path is None:
        if given:
            option = "--" + given[0].replace("_", "-")
            raise ValueError(
                f"{option} needs --slurm-template-path, e.g. --slurm-template-path "
                "cleanba.slurm_template"
            )
        return None
    if not os.path.isfile(args.slurm_template_path):
        raise ValueError(
            f"no SLURM template at {args.slurm_template_path!r}; give the path of "
            "cleanba.slurm_template"
        )
    options = {
        name: default if getattr(args, name) is None else getattr(args, name)
        for name, default in SLURM_DEFAULTS.items()
    }
    if options["slurm_ntasks"] < options["slurm_nodes"]:
        raise ValueError(
            "--slurm-ntasks is smaller than --slurm-nodes; give each node at least one task"
        )
    if options["slurm_total_cpus"] < options["slurm_ntasks"]:
        raise ValueError(
            "--slurm-total-cpus is smaller than --slurm-ntasks; give each task at least one CPU"
        )
    lead = options["slurm_signal_lead"]
    if lead > MAX_SIGNAL_LEAD:
        raise ValueError(f"--slurm-signal-lead must be at most {MAX_SIGNAL_LEAD} s, got {lead}")
    if options["slurm_time"] is not None:
        limit = time_limit_seconds(options["slurm_time"])
        if lead >= limit:
            raise ValueError(
                f"--slurm-signal-lead {lead} s is not shorter than --slurm-time "
                f"{options['slurm_time']} ({limit} s): the task would be signalled before it "
                "starts; give a longer time or a shorter lead"
            )
    with open(args.slurm_template_path) as file:
        template = file.read()
    for name, placeholder in [("slurm_time", "{{time}}"), ("slurm_signal_lead", "{{signal_lead}}")]:
        if getattr(args, name) is not None and placeholder not in template:
            raise ValueError(
                f"--{name.replace('_', '-')} needs a place in the SLURM template "
                f"{args.slurm_template_path}, which has no {placeholder} "
                "(see cleanba.slurm_template)"
            )
    return options


def sbatch_script(template, runs, workers, log_dir, job_name, partition, options):
    """Fill the sbatch template's {{placeholders}}; the lines of an unset one (the partition) are
    dropped."""
    commands = [
        f"    {shlex.quote(shlex.join(argv))}  # {index}" for index, (_, argv) in enumerate(runs)
    ]
    values = {
        "job_name": job_name,
        "partition": partition,
        "array": f"0-{len(runs) - 1}%{workers}",
        "nodes": str(options["slurm_nodes"]),
        "ntasks": str(options["slurm_ntasks"]),
        # No GPU request at all on a cluster of CPU nodes (its line is dropped).
        "gpus_per_task": str(options["slurm_gpus_per_task"] or "") or None,
        "cpus_per_task": str(options["slurm_total_cpus"] // options["slurm_ntasks"]),
        # No time limit of the job's own (its line is dropped): the partition's applies.
        "time": options["slurm_time"],
        "signal_lead": str(options["slurm_signal_lead"]),
        "log_dir": os.path.abspath(log_dir),
        "commands": "\n".join(commands),
    }
    unset = ["{{" + key + "}}" for key, value in values.items() if value is None]
    script = "".join(
        line for line in template.splitlines(keepends=True) if not any(key in line for key in unset)
    )
    for key, value in values.items():
        script = script.replace("{{" + key + "}}", value or "")
    unknown = sorted(set(re.findall(r"\{\{\w*\}\}", script)))
    if unknown:
        known = ", ".join(values)
        raise ValueError(
            f"the SLURM template has unknown placeholders {', '.join(unknown)}; known ones: {known}"
        )
    return script


def submit(script, log_dir, experiment) -> str | None:
    """Saves the sbatch script under the log dir and submits it when sbatch is available; returns
    the job's id (None when only written). sbatch's refusal is its message and exit 1."""
    os.makedirs(log_dir, exist_ok=True)  # SLURM does not create the folder of --output
    path = os.path.join(log_dir, f"{experiment}.sbatch")
    with open(path, "w") as file:
        file.write(script)
    if shutil.which("sbatch") is None:
        print(f"wrote {path}; sbatch is not on PATH, submit it on the cluster with: sbatch {path}")
        return None
    print(f"wrote {path}; submitting", flush=True)
    result = subprocess.run(["sbatch", "--parsable", path], capture_output=True, text=True)
    if result.returncode:
        print(f"launch: error: sbatch refused the job: {result.stderr.strip()}", file=sys.stderr)
        sys.exit(1)
    job_id = result.stdout.strip().split(";")[0] or None
    print(f"submitted job array {job_id}", flush=True)
    return job_id


def task_log(log_dir: str, job_name: str, job_id: str, task: int) -> str:
    """The log of an array task (the template's --output, %x_%A_%a.log)."""
    return os.path.join(os.path.abspath(log_dir), f"{job_name}_{job_id}_{task}.log")


def wait_for_array(job_id: str | None, run_names: list, log_dir: str) -> dict:
    """Waits until no task of the array is queued or running (a requeued task counts as queued),
    printing each task's end as it comes; returns {run name: exit code}, -1 for a task that ended
    without writing one (killed, or cancelled before it ran)."""
    if job_id is None:
        sys.exit(0)
    exit_codes = {}
    while True:
        queue = subprocess.run(
            ["squeue", "--noheader", "--array", f"--jobs={job_id}", "--format=%i"],
            capture_output=True,
            text=True,
        )
        listed = queue.stdout.split() if queue.returncode == 0 else None
        if "Invalid job id" in queue.stderr:
            listed = []  # the controller has forgotten the finished job
        for task, run_name in enumerate(run_names):
            exit_file = os.path.join(os.path.abspath(log_dir), f"{job_id}_{task}.exit")
            still_there = listed is None or f"{job_id}_{task}" in listed
            if run_name in exit_codes or still_there or not os.path.exists(exit_file):
                continue
            with open(exit_file) as file:
                exit_codes[run_name] = int(file.read().strip() or -1)
            print(f"[{len(exit_codes)}/{len(run_names)}] exit {exit_codes[run_name]}: {run_name}")
        if listed is not None and not any(f"{job_id}_" in task for task in listed):
            break
        time.sleep(SQUEUE_POLL_SECONDS)
    for run_name in run_names:
        exit_codes.setdefault(run_name, -1)
    return exit_codes
