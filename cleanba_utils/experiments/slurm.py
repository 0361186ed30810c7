"""An experiment as one SLURM job array, one array task per run: the sizes of a task, the sbatch
script filled in from its template (cleanba.slurm_template), and its submission."""

import os
import re
import shlex
import shutil
import subprocess

SLURM_DEFAULTS = {
    "slurm_gpus_per_task": 1,
    "slurm_ntasks": 1,
    "slurm_nodes": 1,
    "slurm_total_cpus": 8,
}


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
    options = {name: getattr(args, name) or default for name, default in SLURM_DEFAULTS.items()}
    if options["slurm_ntasks"] < options["slurm_nodes"]:
        raise ValueError(
            "--slurm-ntasks is smaller than --slurm-nodes; give each node at least one task"
        )
    if options["slurm_total_cpus"] < options["slurm_ntasks"]:
        raise ValueError(
            "--slurm-total-cpus is smaller than --slurm-ntasks; give each task at least one CPU"
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
        "gpus_per_task": str(options["slurm_gpus_per_task"]),
        "cpus_per_task": str(options["slurm_total_cpus"] // options["slurm_ntasks"]),
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


def submit(script, log_dir, experiment):
    """Save the sbatch script under the log dir and submit it when sbatch is available; returns an
    exit code."""
    os.makedirs(log_dir, exist_ok=True)  # SLURM does not create the folder of --output
    path = os.path.join(log_dir, f"{experiment}.sbatch")
    with open(path, "w") as file:
        file.write(script)
    if shutil.which("sbatch") is None:
        print(f"wrote {path}; sbatch is not on PATH, submit it on the cluster with: sbatch {path}")
        return 0
    print(f"wrote {path}; submitting", flush=True)
    return subprocess.run(["sbatch", path]).returncode
