"""The SLURM path, run for real on a one-node cluster of this machine (benchmark/slurm_local.sh):
the launcher's job arrays, a multi-process run under srun, preemption and requeue, and a failing
task, each compared with the same runs without SLURM; then the checks of benchmark/slurm_stops.py
(preemption without periodic checkpoints, a time limit, scancel).

    python benchmark/slurm_local.py                   # starts the cluster if none runs (as root)
    python benchmark/slurm_local.py --work-dir DIR    # where the runs go (default: a new folder
                                                      # under /tmp)

Writes benchmark/results/slurm_local.md (what ran, the exact commands, the results), .csv (one row
per run) and .png (the preempted runs' steps against wall time, the stops marked).
"""

import csv
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import matplotlib
import numpy as np
import slurm_stops
from csv_columns import RUN_COLUMNS
from slurm_lab import (
    REPO,
    RESULTS,
    Lab,
    launcher,
    leaves,
    load_model,
    log,
    open_lab,
    row,
    task_states,
    wait_for_text,
)

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# CleanRL's CartPole settings, shortened; SAC on Hopper with small networks (resumes bit for bit).
PPO_CARTPOLE = (
    f"python {REPO}/cleanba/cleanba_ppo.py --hiddens 64 64 --local-num-envs 4 "
    "--num-actor-threads 1 --num-steps 128 --clip-coef 0.2 --clip-vloss --total-timesteps 20480"
)
SAC_HOPPER = f"python {REPO}/cleanba/cleanba_sac.py --hiddens 64 64 --learning-starts 1024"
ARRAY_STEPS = 6400
PREEMPTED_STEPS = 25600
# The multi-process run: 2 processes x 4 environments, one CPU device each (actor and learner);
# the 1-process run of the same global configuration: 8 environments, 2 learner devices.
MULTI_PROCESS = [
    *["--hiddens", "64", "64", "--num-actor-threads", "1", "--num-steps", "128"],
    *["--total-timesteps", "8192", "--env-id", "CartPole-v1", "--save-model"],
]


def job_arrays(lab: Lab) -> dict:
    """PPO on CartPole x 3 seeds and SAC on Hopper x 2 as SLURM arrays, then the same runs with the
    launcher's local workers: every task ends, the fingerprints agree, and `analyze` reads them."""
    rows = []
    outputs = []
    for name, env_id, seeds, command in [
        ("ppo_cartpole", "CartPole-v1", 3, PPO_CARTPOLE),
        ("sac_hopper", "Hopper-v4", 2, f"{SAC_HOPPER} --total-timesteps {ARRAY_STEPS}"),
    ]:
        for mode in ("slurm", "local"):
            started = time.time()
            result = lab.run(
                launcher(f"{mode}_{name}", env_id, seeds, command, slurm=mode == "slurm")
            )
            log(f"{mode}_{name}: exit {result.returncode} after {time.time() - started:.0f} s")
            outputs.append((f"launch {mode}_{name} (exit {result.returncode})", result.stdout))
        analyzed = lab.run(
            [
                sys.executable,
                "-m",
                "cleanba_utils.experiments.analyze",
                f"runs/_experiments/slurm_{name}",
            ]
        )
        outputs.append(
            (
                f"analyze slurm_{name} (exit {analyzed.returncode})",
                analyzed.stdout + analyzed.stderr,
            )
        )
        for slurm_run, local_run in zip(
            lab.run_names(f"slurm_{name}"), lab.run_names(f"local_{name}")
        ):
            local = lab.summary(local_run).get("params_fingerprint")
            slurm_row = row(lab, "job array", "slurm array", slurm_run)
            equal = bool(local) and lab.summary(slurm_run).get("params_fingerprint") == local
            rows.append(dict(slurm_row, same_as=local_run, equal=equal))
            rows.append(row(lab, "job array", "local workers", local_run))
    return dict(rows=rows, outputs=outputs)


def multi_process(lab: Lab) -> dict:
    """A 2-task SLURM job (srun, --distributed: jax.distributed reads SLURM's environment), one CPU
    device per task, against the 1-process run of the same global configuration."""
    two = [
        *["srun", "--ntasks", 2, "--cpus-per-task", 1, "python", REPO / "cleanba/cleanba_ppo.py"],
        *MULTI_PROCESS,
        *["--local-num-envs", 4, "--distributed", "--run-name", "srun_two_processes"],
    ]
    started = time.time()
    result = lab.run(two, env=dict(lab.env, XLA_FLAGS="--xla_force_host_platform_device_count=1"))
    log(f"srun 2 tasks: exit {result.returncode} after {time.time() - started:.0f} s")
    one = [
        "python",
        REPO / "cleanba/cleanba_ppo.py",
        *MULTI_PROCESS,
        *["--local-num-envs", 8, "--learner-device-ids", 0, 1, "--run-name", "one_process"],
    ]
    single = lab.run(one, env=dict(lab.env, XLA_FLAGS="--xla_force_host_platform_device_count=2"))
    a = np.concatenate(
        leaves(load_model(lab.dir / "runs/srun_two_processes/cleanba_ppo.cleanba_model"))
    )
    b = np.concatenate(leaves(load_model(lab.dir / "runs/one_process/cleanba_ppo.cleanba_model")))
    fingerprints = [
        line for line in result.stdout.splitlines() if line.startswith("params_fingerprint=")
    ]
    return dict(
        exit_codes=(result.returncode, single.returncode),
        both_tasks_fingerprint=sorted(set(fingerprints)),
        max_abs_difference=float(np.abs(a - b).max()),
        relative_difference=float(np.linalg.norm(a - b) / np.linalg.norm(b)),
        num_params=int(a.size),
        rows=[
            row(lab, "srun multi-process", "srun --ntasks 2", "srun_two_processes"),
            row(lab, "srun multi-process", "1 process, 2 devices", "one_process"),
        ],
        output=result.stdout[-2000:] + result.stderr[-2000:],
    )


def with_step(line: str, steps_per_update: int) -> str:
    """A log line that names an update ("... after update 45; ..."), with its environment step."""
    update = int(line.split("update ")[1].split(";")[0].split()[0])
    return f"{line} (step {update * steps_per_update})"


def preemption(lab: Lab) -> dict:
    """Two SAC runs as one array. Task 0 is requeued (`scontrol requeue`) while it trains; then a
    job of the higher-priority partition `urgent` that needs every CPU preempts the running tasks.
    Each saves a checkpoint on SIGTERM and SLURM requeues it; it starts again and resumes; its
    fingerprint is compared with the same run uninterrupted."""
    command = f"{SAC_HOPPER} --total-timesteps {PREEMPTED_STEPS} --checkpoint-every 25"
    argv = launcher("preempted", "Hopper-v4", 2, command, slurm=True)
    argv.remove("--slurm-wait")
    result = lab.run(argv)
    job_id = result.stdout.split("submitted job array ")[1].split()[0]
    log_dir = lab.dir / "runs" / "_launcher" / "preempted"
    logs = [log_dir / f"preempted_{job_id}_{task}.log" for task in (0, 1)]
    events = []
    hows = []
    for task, (how, actions) in enumerate(
        [
            ("scontrol requeue", [["scontrol", "requeue", f"{job_id}_0"]]),
            (
                "preempted by a job of the partition urgent",
                [
                    [
                        *["sbatch", "--parsable", "--partition", "urgent", "--output", "/dev/null"],
                        *["--cpus-per-task", os.cpu_count(), "--wrap", "sleep 5"],
                    ]
                ],
            ),
        ]
    ):
        hows.append(how)
        wait_for_text(logs[task], "update 40/")
        for action in actions:
            lab.run(action)
            events.append((task, time.time(), shlex.join(map(str, action))))
            log(f"task {task}: {shlex.join(map(str, action))}")
    # Until both end: when each requeued task waits, starts again and ends.
    last = {}
    while True:
        states = task_states(job_id)
        for task in (0, 1):
            state = states.get(f"{job_id}_{task}", "ended")
            if last.get(task) != state:
                events.append((task, time.time(), f"squeue: {state}"))
                last[task] = state
        if not states:
            break
        time.sleep(0.5)
    log("preempted array ended")
    local = lab.run(launcher("uninterrupted", "Hopper-v4", 2, command, slurm=False))
    rows = []
    timelines = []
    for task, (run_name, reference) in enumerate(
        zip(lab.run_names("preempted"), lab.run_names("uninterrupted"))
    ):
        text = logs[task].read_text(errors="replace")
        steps_per_update = json.loads((lab.dir / "runs" / run_name / "spec.json").read_text())[
            "sizes"
        ]["steps_per_update"]
        stops = [
            with_step(line, steps_per_update)
            for line in text.splitlines()
            if line.startswith("stopped by a signal")
        ]
        resumes = [
            with_step(line, steps_per_update)
            for line in text.splitlines()
            if line.startswith("resuming ")
        ]
        equal = lab.summary(run_name).get("params_fingerprint") == lab.summary(reference).get(
            "params_fingerprint"
        )
        rows.append(
            dict(
                row(lab, "preemption", "slurm, preempted", run_name), same_as=reference, equal=equal
            )
        )
        rows.append(row(lab, "preemption", "local, uninterrupted", reference))
        timelines.append(
            dict(
                task=task,
                how=hows[task],
                stops=stops,
                resumes=resumes,
                exit=(log_dir / f"{job_id}_{task}.exit").read_text().strip(),
            )
        )
    return dict(
        rows=rows,
        timelines=timelines,
        events=events,
        local_exit=local.returncode,
        logs=[str(p) for p in logs],
    )


def failing_task(lab: Lab) -> dict:
    """An array whose second element has an invalid option (a learning rate of NaN)."""
    result = lab.run(
        launcher(
            "failing",
            "CartPole-v1",
            1,
            PPO_CARTPOLE,
            "--sweep",
            "--learning-rate=2.5e-4,nan",
            slurm=True,
        )
    )
    return dict(exit_code=result.returncode, output=result.stdout + result.stderr)


def timeline_plot(lab: Lab, preempted: dict, path: Path):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, run_row, timeline in zip(axes, preempted["rows"][::2], preempted["timelines"]):
        events = EventAccumulator(
            str(lab.dir / "runs" / run_row["run_name"]), size_guidance={"scalars": 0}
        )
        events.Reload()
        points = events.Scalars("stats/learner_policy_version")
        start = points[0].wall_time
        axis.plot([p.wall_time - start for p in points], [p.step for p in points], ".", ms=2)
        for task, at, what in preempted["events"]:
            if task == timeline["task"]:
                axis.axvline(at - start, color="red" if "requeue" in what else "gray", lw=0.8)
        axis.set(
            title=f"task {timeline['task']}: {run_row['run_name']}",
            xlabel="wall time (s)",
            ylabel="environment steps",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def report(lab: Lab, checks: dict, started: float) -> str:
    arrays = checks["arrays"]
    mp = checks["multi_process"]
    pre = checks["preemption"]
    failing = checks["failing"]
    table = lambda rows, keys: "\n".join(
        ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        + ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    )
    sinfo = subprocess.run(["sinfo"], capture_output=True, text=True).stdout
    version = subprocess.run(["sinfo", "--version"], capture_output=True, text=True).stdout.strip()
    keys = [
        "run_name",
        "mode",
        "steps",
        "final_return",
        "sps",
        "wall_time_s",
        "fingerprint",
        "equal",
    ]
    lines = [
        "# The SLURM path on a one-node cluster",
        "",
        f"Made {datetime.date.today()} by `python benchmark/slurm_local.py` in "
        f"{time.time() - started:.0f} s, on {platform.node()} ({os.cpu_count()} CPUs, "
        f"{platform.machine()}), {version}; the load average over the last 15 minutes at the "
        f"end: {os.getloadavg()[2]:.1f}. The cluster: "
        "`benchmark/slurm_local.sh start`.",
        "",
        "```",
        sinfo.strip(),
        "```",
        "",
        "## 1. Job arrays",
        "",
        "The launcher submitted each as one array (`--slurm-wait`), then ran the same runs with "
        "its local workers; `equal`: the SLURM run's `params_fingerprint` is the local run's.",
        "",
        table(arrays["rows"], keys),
        "",
    ]
    for title, output in arrays["outputs"]:
        lines += [f"`{title}`:", "", "```", output.strip()[-1500:], "```", ""]
    lines += [
        "## 2. Multi-process under srun",
        "",
        "`srun --ntasks 2` of PPO with `--distributed` (jax.distributed reads SLURM's "
        "environment), one CPU device per task, 4 environments each, against the 1-process run of "
        "the same global configuration (8 environments, 2 learner devices).",
        "",
        f"- exit codes (2 tasks, 1 process): {mp['exit_codes']}; the fingerprint both tasks print: "
        f"{', '.join(f[19:35] for f in mp['both_tasks_fingerprint'])}",
        f"- parameters ({mp['num_params']}): max |difference| {mp['max_abs_difference']:.3g}, "
        f"relative difference ‖a − b‖ / ‖b‖ = {mp['relative_difference']:.3g} (the README: layouts "
        "differ by float rounding only)",
        "",
        table(mp["rows"], keys[:-1]),
        "",
        "## 3. Preemption",
        "",
        "SAC on Hopper, 2 seeds, one array. Each task, once its log showed update 40, was stopped: "
        "task 0 with `scontrol requeue`, task 1 by a job of the higher-priority partition `urgent` "
        "that asked for every CPU of the node (it preempts every running task of the array: "
        "SIGTERM, then SLURM requeues it). `equal`: the preempted run's final fingerprint is the "
        "uninterrupted run's (SAC resumes bit for bit). The other stops (preemption without "
        "periodic checkpoints, time limits, scancel) are in [slurm_stops.md](slurm_stops.md).",
        "",
        table(pre["rows"], keys),
        "",
    ]
    for timeline in pre["timelines"]:
        lines += [
            f"Task {timeline['task']}, {timeline['how']} (final exit {timeline['exit']}):",
            "",
        ]
        lines += [f"- {line}" for line in timeline["stops"] + timeline["resumes"]]
        lines.append("")
    lines += ["Events (seconds after the first):", ""]
    first = min(at for _, at, _ in pre["events"])
    lines += [f"- task {task}, +{at - first:.0f} s: {what}" for task, at, what in pre["events"]]
    lines += [
        "",
        "![steps against wall time](slurm_local.png)",
        "",
        "## 4. A failing task",
        "",
        "An array whose second element has `--learning-rate nan`: the launcher exits "
        f"{failing['exit_code']}:",
        "",
        "```",
        failing["output"].strip()[-2000:],
        "```",
        "",
        "## Commands",
        "",
        "```",
        *lab.commands,
        "```",
        "",
    ]
    return "\n".join(lines)


def main():
    started = time.time()
    lab = open_lab(__doc__.splitlines()[0], "slurm_local")
    checks = dict(
        arrays=job_arrays(lab),
        multi_process=multi_process(lab),
        preemption=preemption(lab),
        failing=failing_task(lab),
    )
    RESULTS.mkdir(exist_ok=True)
    timeline_plot(lab, checks["preemption"], RESULTS / "slurm_local.png")
    rows = [
        *checks["arrays"]["rows"],
        *checks["multi_process"]["rows"],
        *checks["preemption"]["rows"],
    ]
    keys = [*RUN_COLUMNS, *dict.fromkeys(key for r in rows for key in r if key not in RUN_COLUMNS)]
    with open(RESULTS / "slurm_local.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=keys, restval="")
        writer.writeheader()
        writer.writerows(rows)
    (RESULTS / "slurm_local.md").write_text(report(lab, checks, started))
    log(f"wrote {RESULTS / 'slurm_local.md'}")
    stops_started = time.time()
    slurm_stops.write_results(lab, slurm_stops.run_checks(lab), stops_started)


if __name__ == "__main__":
    main()
