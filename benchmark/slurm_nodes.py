"""Several nodes on one machine (benchmark/slurm_local.sh start --nodes 2): runs across two nodes
through the launcher, against the one-process run of the same global configuration, and a node that
dies while a two-node run trains.

    python benchmark/slurm_nodes.py                   # starts the 2-node cluster (as root)
    python benchmark/slurm_nodes.py --work-dir DIR    # where the runs go (default: a new folder
                                                      # under /tmp)

Writes benchmark/results/slurm_nodes.md (what ran, the exact commands, the node failure's
timeline), .csv (one row per run) and .png (the failed run's updates against wall time, with the
events).
"""

import csv
import datetime
import os
import platform
import subprocess
import time
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt
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
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

SLURM_LOCAL = REPO / "benchmark" / "slurm_local.sh"
TWO_NODES = ["--slurm-nodes", 2, "--slurm-ntasks", 2]
SETTLE_SECONDS = 5
"""how long a requeued job waits in the queue before this benchmark lets it start (see
slurm_stops.SETTLE_SECONDS)"""
# One process per node, one CPU device each; the one-process run of the same global configuration
# has both processes' environments and two learner devices.
ACROSS_NODES = {
    "cleanba_ppo": (
        "CartPole-v1",
        "--hiddens 64 64 --num-actor-threads 1 --num-steps 128 --total-timesteps 8192",
        4,
    ),
    "cleanba_ppo_continuous": (
        "Hopper-v4",
        "--num-steps 256 --num-minibatches 8 --update-epochs 4 --total-timesteps 16384",
        4,
    ),
}
# The run a node failure interrupts: continuous PPO resumes bit for bit; 2 processes x 4
# environments x 256 steps per update, a checkpoint every 10 updates.
FAILED = (
    f"python {REPO}/cleanba/cleanba_ppo_continuous.py --local-num-envs 4 --total-timesteps 204800 "
    "--checkpoint-every 10 --distributed"
)
KILL_AT_UPDATE = 30


def layout_rows(lab: Lab) -> list:
    """Each script of ACROSS_NODES as a 2-node, 2-task array through the launcher and as one
    process with two learner devices; the largest difference of their parameters."""
    results = []
    for script, (env_id, options, num_envs) in ACROSS_NODES.items():
        command = (
            f"python {REPO}/cleanba/{script}.py {options} --local-num-envs {num_envs} "
            "--save-model --distributed"
        )
        experiment = f"{script}_two_nodes"
        submitted = lab.run(
            launcher(experiment, env_id, 1, command, *TWO_NODES, slurm=True, cpus=2)
        )
        log(f"{experiment}: launcher exit {submitted.returncode}")
        [run_name] = lab.run_names(experiment)
        task_log = next((lab.dir / "runs" / "_launcher" / experiment).glob("*.log"))
        one = lab.run(
            [
                *["python", REPO / "cleanba" / f"{script}.py", *options.split()],
                *["--env-id", env_id, "--seed", 1, "--local-num-envs", 2 * num_envs],
                *["--learner-device-ids", 0, 1, "--save-model", "--run-name", f"{script}_one"],
            ],
            env=dict(lab.env, XLA_FLAGS="--xla_force_host_platform_device_count=2"),
        )
        a = np.concatenate(
            leaves(load_model(lab.dir / "runs" / run_name / f"{script}.cleanba_model"))
        )
        b = np.concatenate(
            leaves(load_model(lab.dir / "runs" / f"{script}_one" / f"{script}.cleanba_model"))
        )
        text = task_log.read_text(errors="replace")
        results.append(
            dict(
                script=script,
                exit_codes=(submitted.returncode, one.returncode),
                nodes=sorted(
                    {
                        line.split(" on ")[1].split(":")[0]
                        for line in text.splitlines()
                        if line.startswith("task 0 (job ")
                    }
                ),
                fingerprints=sorted(
                    {
                        line[19:35]
                        for line in text.splitlines()
                        if line.startswith("params_fingerprint=")
                    }
                ),
                max_abs_difference=float(np.abs(a - b).max()),
                num_params=int(a.size),
                rows=[
                    row(lab, "across nodes", "2 nodes x 1 process", run_name),
                    row(lab, "across nodes", "1 process, 2 learner devices", f"{script}_one"),
                ],
            )
        )
    return results


def node_of_batch(job_id: str) -> str:
    out = subprocess.run(
        ["squeue", "--noheader", "--array", f"--jobs={job_id}", "--format=%B"],
        capture_output=True,
        text=True,
    ).stdout
    return out.split()[0]


def nodes_of_job(job_id: str) -> str:
    out = subprocess.run(
        ["squeue", "--noheader", "--array", f"--jobs={job_id}", "--format=%N"],
        capture_output=True,
        text=True,
    ).stdout
    return out.strip()


def node_states() -> str:
    return (
        subprocess.run(
            ["sinfo", "--noheader", "-N", "--format=%N %T"], capture_output=True, text=True
        )
        .stdout.strip()
        .replace("\n", ", ")
    )


def node_failure(lab: Lab) -> dict:
    """A 2-node run of FAILED; at update KILL_AT_UPDATE the node without the batch script dies
    (slurm_local.sh kill-node: its slurmd and job steps SIGKILLed). Every event is timed: the
    survivor's stop, SLURM's NODE_FAIL and requeue, the node's return, the resumed run and its end;
    the final fingerprint is compared with the same run uninterrupted."""
    argv = launcher("node_failure", "Hopper-v4", 1, FAILED, *TWO_NODES, slurm=True, cpus=2)
    argv.remove("--slurm-wait")
    result = lab.run(argv)
    job_id = result.stdout.split("submitted job array ")[1].split()[0]
    task = f"{job_id}_0"
    task_log = lab.dir / "runs" / "_launcher" / "node_failure" / f"node_failure_{job_id}_0.log"
    events = []

    def event(what: str, at: float | None = None):
        events.append((at or time.time(), what))
        log(what)

    wait_for_text(task_log, f"update {KILL_AT_UPDATE}/")
    batch_node = node_of_batch(task)
    job_nodes = nodes_of_job(task)
    victim = next(
        n
        for n in subprocess.run(
            ["scontrol", "show", "hostnames", job_nodes], capture_output=True, text=True
        ).stdout.split()
        if n != batch_node
    )
    killed = lab.run(["bash", SLURM_LOCAL, "kill-node", victim])
    event(
        f"kill-node {victim} (the job ran on {job_nodes}, its batch script on {batch_node}): "
        f"{killed.stdout.strip()}"
    )
    seen = {}
    deadline = time.time() + 600
    revived = False
    while time.time() < deadline:
        text = task_log.read_text(errors="replace")
        for key, needle in [
            ("survivor", "error: distributed run broken"),
            ("survivor_signal", "got TERM"),
            ("resumed", "resuming "),
        ]:
            if key not in seen and needle in text:
                seen[key] = time.time()
                line = next(line for line in text.splitlines() if needle in line)
                event(f"task log: {line.strip()[:200]}")
        states = task_states(job_id).get(task, "ended")
        if seen.get("state") != states:
            seen["state"] = states
            event(f"squeue: {states}; sinfo: {node_states()}")
        if not revived and states.startswith("PENDING"):
            # The job is queued again: the node comes back, and the job may start once it is.
            time.sleep(SETTLE_SECONDS)
            revive = lab.run(["bash", SLURM_LOCAL, "revive-node", victim])
            event(revive.stdout.strip())
            revived = True
            for _ in range(120):
                if victim in node_states() and f"{victim} idle" in node_states():
                    break
                time.sleep(0.5)
            event(f"sinfo: {node_states()}")
            lab.run(["scontrol", "update", f"JobId={task}", "StartTime=now"])
            event(f"scontrol update JobId={task} StartTime=now")
        if states == "ended":
            break
        time.sleep(0.5)
    exit_file = task_log.parent / f"{job_id}_0.exit"
    reference = lab.run(
        launcher("uninterrupted", "Hopper-v4", 1, FAILED, *TWO_NODES, slurm=True, cpus=2)
    )
    log(f"uninterrupted run: launcher exit {reference.returncode}")
    [run_name] = lab.run_names("node_failure")
    [reference_name] = lab.run_names("uninterrupted")
    equal = lab.summary(run_name).get("params_fingerprint") == lab.summary(reference_name).get(
        "params_fingerprint"
    )
    return dict(
        events=events,
        exit=exit_file.read_text().strip() if exit_file.exists() else "none",
        equal=equal,
        log=task_log.read_text(errors="replace"),
        rows=[
            dict(row(lab, "node failure", "2 nodes, one killed", run_name), equal=equal),
            row(lab, "node failure", "2 nodes, uninterrupted", reference_name),
        ],
    )


def plot(lab: Lab, failure: dict, path: Path):
    run_name = failure["rows"][0]["run_name"]
    events = EventAccumulator(str(lab.dir / "runs" / run_name), size_guidance={"scalars": 0})
    events.Reload()
    points = events.Scalars("stats/learner_policy_version")
    start = min(at for at, _ in failure["events"])
    fig, axis = plt.subplots(figsize=(9, 4))
    axis.plot([p.wall_time - start for p in points], [p.value for p in points], ".", ms=2)
    for at, what in failure["events"]:
        axis.axvline(at - start, color="red" if "kill-node" in what else "gray", lw=0.8)
    axis.set(
        title=f"{run_name}: a node killed at update {KILL_AT_UPDATE}",
        xlabel="seconds after the kill",
        ylabel="update",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def report(lab: Lab, across: list, failure: dict, started: float) -> str:
    keys = ["run_name", "mode", "steps", "final_return", "sps", "wall_time_s", "fingerprint"]
    table = lambda rows, keys: "\n".join(
        ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        + ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    )
    version = subprocess.run(["sinfo", "--version"], capture_output=True, text=True).stdout.strip()
    sinfo = subprocess.run(["sinfo", "-N"], capture_output=True, text=True).stdout.strip()
    first = min(at for at, _ in failure["events"])
    lines = [
        "# Several nodes on one machine: runs across two nodes, and a node that dies",
        "",
        f"Made {datetime.date.today()} by `python benchmark/slurm_nodes.py` in "
        f"{time.time() - started:.0f} s, on {platform.node()} ({os.cpu_count()} CPUs, "
        f"{platform.machine()}), {version}; the load average over the last 15 minutes at the "
        f"end: {os.getloadavg()[2]:.1f}. The cluster: "
        "`benchmark/slurm_local.sh start --nodes 2` (two slurmd of this machine, every CPU each, "
        "SlurmdTimeout 15 s, KillWait 30 s).",
        "",
        "```",
        sinfo,
        "```",
        "",
        "## 1. Runs across two nodes",
        "",
        "Each script through the launcher as a job array with `--slurm-nodes 2 --slurm-ntasks 2` "
        "(one process per node, `--distributed`, one CPU device each), against one process with "
        "both processes' environments and two learner devices (the same global configuration). "
        "The README: layouts differ by float rounding only.",
        "",
    ]
    for result in across:
        lines += [
            f"- `{result['script']}`: exit codes (launcher, one process) {result['exit_codes']}; "
            f"the job's nodes {', '.join(result['nodes'])}; the fingerprint both processes printed "
            f"{', '.join(result['fingerprints'])}; parameters ({result['num_params']}): max "
            f"|difference| {result['max_abs_difference']:.3g}",
        ]
    lines += [
        "",
        table([r for result in across for r in result["rows"]], keys),
        "",
        "## 2. A node that dies",
        "",
        "Continuous PPO on Hopper as a 2-node array task "
        f"(`{FAILED.replace(str(REPO) + '/', '')}`). "
        f"Once its log showed update {KILL_AT_UPDATE} (a line that may be the progress line of "
        "that update, still in flight), the node without the batch script died: "
        "`benchmark/slurm_local.sh kill-node NODE` SIGKILLs its slurmd and every process of its "
        "job steps at once. Then, as they happened (seconds after the kill):",
        "",
    ]
    lines += [f"- +{at - first:.1f} s: {what}" for at, what in failure["events"]]
    lines += [
        "",
        f"The task's final exit code: {failure['exit']}. `equal`: the final fingerprint is the "
        "uninterrupted 2-node run's (continuous PPO resumes bit for bit).",
        "",
        table(failure["rows"], [*keys, "equal"]),
        "",
        "![updates against wall time](slurm_nodes.png)",
        "",
        "The task's log:",
        "",
        "```",
        "\n".join(
            line
            for line in failure["log"].splitlines()
            if not line.startswith(("update ", "global_step="))
        )[-5000:],
        "```",
        "",
        "## What one machine cannot show",
        "",
        "A real network's latency and failures (every node here is 127.0.0.1), GPUs through gres, "
        "and run folders that are not shared between nodes (here every node sees the same disk).",
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
    lab = open_lab(__doc__.splitlines()[0], "slurm_nodes", nodes=2)
    across = layout_rows(lab)
    failure = node_failure(lab)
    rows = [*[r for result in across for r in result["rows"]], *failure["rows"]]
    more = [key for r in rows for key in r if key not in RUN_COLUMNS]
    with open(RESULTS / "slurm_nodes.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[*RUN_COLUMNS, *dict.fromkeys(more)], restval="")
        writer.writeheader()
        writer.writerows(rows)
    plot(lab, failure, RESULTS / "slurm_nodes.png")
    (RESULTS / "slurm_nodes.md").write_text(report(lab, across, failure, started))
    log(f"wrote {RESULTS / 'slurm_nodes.md'}")


if __name__ == "__main__":
    main()
