"""How runs stop and continue on a SLURM cluster, run for real on the one-node cluster of this
machine (benchmark/slurm_local.sh): preemption by a job of a higher-priority partition, `scontrol
requeue`, a time limit shorter than the run, and a user's `scancel`, all without periodic
checkpoints (`--checkpoint-every 0`).

    python benchmark/slurm_stops.py                  # starts the cluster if none runs (as root)
    python benchmark/slurm_stops.py --work-dir DIR   # where the runs go (default: a new folder
                                                     # under /tmp)

`python benchmark/slurm_local.py` runs these checks after its own. Writes
benchmark/results/slurm_stops.md (what ran, the exact commands, the seconds from each signal to its
checkpoint), .csv (one row per run) and .png (the time-limited run's steps against wall time).
"""

import csv
import datetime
import os
import platform
import re
import subprocess
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from csv_columns import RUN_COLUMNS
from slurm_lab import (
    REPO,
    RESULTS,
    Lab,
    launcher,
    log,
    open_lab,
    task_states,
    wait_for_text,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

POLL_SECONDS = 0.2
SETTLE_SECONDS = 5
"""how long a requeued task waits in the queue before this benchmark lets it start: started at once,
it can be allocated before SLURM has cleaned up its previous start, and SLURM then fails it ("Job
credential revoked")"""
# Updates that outlast the stop grace (signals.STOP_GRACE_SECONDS) on one CPU: the default IMPALA
# network on a mid-size rollout.
IMPALA_MID_SIZE = (
    f"python {REPO}/cleanba/cleanba_impala.py --num-actor-threads 1 --local-num-envs 64 "
    "--num-steps 20 --log-frequency 1 --total-timesteps 10000000"
)
PPO_HOPPER = f"python {REPO}/cleanba/cleanba_ppo_continuous.py --total-timesteps 1000000"
SAC_HOPPER = f"python {REPO}/cleanba/cleanba_sac.py --total-timesteps 1000000"
# A checkpoint that holds a large replay: SAC on Humanoid (376 observations), 16 environments.
SAC_HUMANOID = (
    f"python {REPO}/cleanba/cleanba_sac.py --local-num-envs 16 --total-timesteps 10000000"
)
PREEMPTED = [
    ("impala_breakout", "Breakout-v5", IMPALA_MID_SIZE, "update 2/"),
    ("ppo_continuous_hopper", "Hopper-v4", PPO_HOPPER, "update 40/"),
    ("sac_humanoid", "Humanoid-v4", SAC_HUMANOID, "update 40/"),
]
# The time limit: continuous PPO (bitwise resume) for about 8 minutes under a 3-minute limit.
TIME_LIMITED = f"python {REPO}/cleanba/cleanba_ppo_continuous.py --total-timesteps 2000000"
TIME_LIMIT = ["--slurm-time", "3", "--slurm-signal-lead", "60"]
CANCELLED = (
    f"python {REPO}/cleanba/cleanba_ppo.py --hiddens 64 64 --local-num-envs 4 "
    "--num-actor-threads 1 --num-steps 128 --total-timesteps 2000000"
)


def submit(lab: Lab, experiment: str, env_id: str, command: str, *extra) -> str:
    """One run as a one-task array in the `local` partition; returns its job id."""
    argv = launcher(experiment, env_id, 1, command, *extra, slurm=True)
    argv.remove("--slurm-wait")
    result = lab.run(argv)
    if "submitted job array " not in result.stdout:
        raise RuntimeError(f"{experiment}: not submitted: {result.stdout}{result.stderr}")
    return result.stdout.split("submitted job array ")[1].split()[0]


def task_log(lab: Lab, experiment: str, job_id: str) -> Path:
    return lab.dir / "runs" / "_launcher" / experiment / f"{experiment}_{job_id}_0.log"


def newest_checkpoint(lab: Lab, run_name: str) -> Path | None:
    checkpoints = sorted((lab.dir / "runs" / run_name / "checkpoints").glob("*.ckpt"))
    return checkpoints[-1] if checkpoints else None


def wait_for_checkpoint(lab: Lab, run_name: str, newer_than: float, timeout: float = 120) -> Path:
    deadline = time.time() + timeout
    while time.time() < deadline:
        checkpoint = newest_checkpoint(lab, run_name)
        if checkpoint is not None and checkpoint.stat().st_mtime > newer_than:
            return checkpoint
        time.sleep(POLL_SECONDS)
    raise RuntimeError(f"{run_name}: no checkpoint within {timeout:.0f} s")


def release_when_pending(job_id: str, timeout: float = 120) -> float:
    """Waits until the requeued task is back in the queue and lets it start at once (SLURM holds
    a requeued job back for a while: BeginTime); returns when it was seen pending."""
    deadline = time.time() + timeout
    while not task_states(job_id).get(f"{job_id}_0", "").startswith("PENDING"):
        if time.time() > deadline:
            raise RuntimeError(f"{job_id}_0 was not requeued within {timeout:.0f} s")
        time.sleep(POLL_SECONDS)
    pending = time.time()
    time.sleep(SETTLE_SECONDS)
    subprocess.run(["scontrol", "update", f"JobId={job_id}_0", "StartTime=now"], check=True)
    return pending


def wait_until_gone(job_id: str, timeout: float = 3600):
    deadline = time.time() + timeout
    while task_states(job_id):
        if time.time() > deadline:
            raise RuntimeError(f"job {job_id} still queued or running after {timeout:.0f} s")
        time.sleep(1)


def resumed_update(text: str) -> int:
    updates = re.findall(r"^resuming \S+ from update (\d+)", text, re.MULTILINE)
    return int(updates[-1]) if updates else 0


def stop_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("got ", "stopped by a signal"))]


def preemptions(lab: Lab) -> list[dict]:
    """Each run alone in `local`; once it trains, a job of `urgent` that needs every CPU of the
    node preempts it (SIGTERM, KillWait, requeue). The run saves the update in flight or, if it
    outlasts the grace, the last completed one; the requeued task resumes from it."""
    rows = []
    for name, env_id, command, after in PREEMPTED:
        experiment = f"preempted_{name}"
        job_id = submit(lab, experiment, env_id, f"{command} --checkpoint-every 0")
        path = task_log(lab, experiment, job_id)
        wait_for_text(path, after, timeout=1800)
        run_name = f"{env_id}__{experiment}__0__1"
        signalled = time.time()
        urgent = lab.run(
            [
                *["sbatch", "--parsable", "--partition", "urgent"],
                *["--cpus-per-task", os.cpu_count(), "--output", "/dev/null", "--wrap", "sleep 5"],
            ]
        )
        log(f"{experiment}: preempted by urgent job {urgent.stdout.strip()}")
        checkpoint = wait_for_checkpoint(lab, run_name, newer_than=signalled)
        saved = time.time()
        pending = release_when_pending(job_id)
        wait_for_text(path, "resuming ", timeout=600)
        resumed = time.time()
        subprocess.run(["scancel", job_id], check=True)
        wait_until_gone(job_id)
        text = path.read_text(errors="replace")
        rows.append(
            dict(
                check="preemption (urgent partition)",
                run_name=run_name,
                script=command.split()[1].rsplit("/", 1)[-1],
                env_id=env_id,
                saved_update=int(checkpoint.stem.split("_")[1]),
                checkpoint_mb=round(checkpoint.stat().st_size / 2**20, 1),
                signal_to_checkpoint_s=round(checkpoint.stat().st_mtime - signalled, 1),
                seen_saved_s=round(saved - signalled, 1),
                requeued_after_s=round(pending - signalled, 1),
                resumed_update=resumed_update(text),
                resumed_after_s=round(resumed - signalled, 1),
                stops=" / ".join(stop_lines(text)),
            )
        )
        log(f"{experiment}: {rows[-1]}")
    return rows


def requeue(lab: Lab) -> dict:
    """`scontrol requeue` of the SAC run: SLURM signals it (SIGTERM) and requeues it itself."""
    experiment = "requeued_sac_hopper"
    job_id = submit(lab, experiment, "Hopper-v4", f"{SAC_HOPPER} --checkpoint-every 0")
    path = task_log(lab, experiment, job_id)
    wait_for_text(path, "update 200/", timeout=1800)
    run_name = f"Hopper-v4__{experiment}__0__1"
    signalled = time.time()
    lab.run(["scontrol", "requeue", f"{job_id}_0"])
    checkpoint = wait_for_checkpoint(lab, run_name, newer_than=signalled)
    pending = release_when_pending(job_id)
    wait_for_text(path, "resuming ", timeout=600)
    subprocess.run(["scancel", job_id], check=True)
    wait_until_gone(job_id)
    text = path.read_text(errors="replace")
    return dict(
        check="scontrol requeue",
        run_name=run_name,
        script="cleanba_sac.py",
        env_id="Hopper-v4",
        saved_update=int(checkpoint.stem.split("_")[1]),
        checkpoint_mb=round(checkpoint.stat().st_size / 2**20, 1),
        signal_to_checkpoint_s=round(checkpoint.stat().st_mtime - signalled, 1),
        requeued_after_s=round(pending - signalled, 1),
        resumed_update=resumed_update(text),
        stops=" / ".join(stop_lines(text)),
    )


def time_limit(lab: Lab) -> dict:
    """Continuous PPO for about 8 minutes under a 3-minute limit: each USR1 saves and requeues,
    until the run ends; its fingerprint against the same run without SLURM (run beside it)."""
    experiment = "time_limited"
    command = f"{TIME_LIMITED} --checkpoint-every 0"
    started = time.time()
    job_id = submit(lab, experiment, "Hopper-v4", command, *TIME_LIMIT)
    uninterrupted = lab.start(
        launcher("time_limit_uninterrupted", "Hopper-v4", 1, command, slurm=False)
    )
    path = task_log(lab, experiment, job_id)
    events = []
    while task_states(job_id):
        state = task_states(job_id).get(f"{job_id}_0", "")
        if state.startswith("PENDING") and "BeginTime" in state:
            events.append((time.time(), "requeued (held: BeginTime), released"))
            time.sleep(SETTLE_SECONDS)
            subprocess.run(["scontrol", "update", f"JobId={job_id}_0", "StartTime=now"])
        time.sleep(1)
    uninterrupted.wait()
    text = path.read_text(errors="replace")
    run_name = f"Hopper-v4__{experiment}__0__1"
    summary = lab.summary(run_name)
    reference = lab.summary("Hopper-v4__time_limit_uninterrupted__0__1")
    exit_file = path.parent / f"{job_id}_0.exit"
    return dict(
        check="time limit (--slurm-time 3 --slurm-signal-lead 60)",
        run_name=run_name,
        script="cleanba_ppo_continuous.py",
        env_id="Hopper-v4",
        restarts=len(re.findall(r"^task 0 \(job", text, re.MULTILINE)) - 1,
        resumed_updates=" ".join(re.findall(r"^resuming \S+ from update (\d+)", text, re.M)),
        exit=exit_file.read_text().strip() if exit_file.exists() else "",
        wall_time_s=round(time.time() - started),
        fingerprint=summary.get("params_fingerprint", "")[:16],
        uninterrupted_fingerprint=reference.get("params_fingerprint", "")[:16],
        equal=bool(summary)
        and summary.get("params_fingerprint") == reference.get("params_fingerprint"),
        stops=" / ".join(stop_lines(text)),
        events=events,
    )


def cancel(lab: Lab) -> dict:
    """A user's `scancel` of a running task: the run saves, the task ends for good; `scontrol
    requeue` of the ended task continues it from its checkpoint."""
    experiment = "cancelled"
    job_id = submit(lab, experiment, "CartPole-v1", CANCELLED)
    path = task_log(lab, experiment, job_id)
    wait_for_text(path, "update 20/", timeout=600)
    lab.run(["scancel", f"{job_id}_0"])
    wait_until_gone(job_id, timeout=120)
    time.sleep(5)
    back_in_queue = bool(task_states(job_id))
    requeued = lab.run(["scontrol", "requeue", f"{job_id}_0"])
    resumed = None
    if requeued.returncode == 0:
        release_when_pending(job_id)
        wait_for_text(path, "resuming ", timeout=300)
        resumed = resumed_update(path.read_text(errors="replace"))
        subprocess.run(["scancel", job_id], check=True)
        wait_until_gone(job_id)
    return dict(
        check="scancel",
        run_name=f"CartPole-v1__{experiment}__0__1",
        back_in_queue_after_5_s=back_in_queue,
        requeue_after_cancel=(requeued.stdout + requeued.stderr).strip() or "accepted",
        resumed_update=resumed,
        stops=" / ".join(stop_lines(path.read_text(errors="replace"))),
    )


def plot(lab: Lab, limited: dict, path: Path):
    events = EventAccumulator(str(lab.dir / "runs" / limited["run_name"]), {"scalars": 0})
    events.Reload()
    points = events.Scalars("stats/learner_policy_version")
    start = points[0].wall_time
    fig, axis = plt.subplots(figsize=(7, 4))
    axis.plot([p.wall_time - start for p in points], [p.step for p in points], ".", ms=2)
    for at, _ in limited["events"]:
        axis.axvline(at - start, color="red", lw=0.8)
    axis.set(
        title="continuous PPO under a 3-minute limit (red: requeued)",
        xlabel="wall time since the first update (s)",
        ylabel="environment steps",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def report(lab: Lab, checks: dict, started: float) -> str:
    keys = [
        "run_name",
        "saved_update",
        "checkpoint_mb",
        "signal_to_checkpoint_s",
        "requeued_after_s",
        "resumed_update",
        "stops",
    ]
    table = lambda rows, keys: "\n".join(
        ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        + ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    )
    version = subprocess.run(["sinfo", "--version"], capture_output=True, text=True).stdout
    limited = checks["time_limit"]
    cancelled = checks["cancel"]
    lines = [
        "# Stops on a one-node SLURM cluster: preemption, requeue, time limits, scancel",
        "",
        f"Made {datetime.date.today()} by `python benchmark/slurm_stops.py` in "
        f"{time.time() - started:.0f} s, on {platform.node()} ({os.cpu_count()} CPUs, "
        f"{platform.machine()}), {version.strip()}; the load average over the last 15 minutes "
        f"at the end: {os.getloadavg()[2]:.1f}; the cluster: `benchmark/slurm_local.sh start` "
        "(KillWait 30 s, PreemptType=preempt/partition_prio, PreemptMode=REQUEUE). Every run has "
        "`--checkpoint-every 0`: its only checkpoints are the ones its stops save.",
        "",
        "## Preemption and requeue",
        "",
        "Each run alone in partition `local` (1 CPU); once it trained, a job of partition `urgent` "
        "asking for every CPU of the node preempted it, or `scontrol requeue` requeued it. "
        "`signal_to_checkpoint_s`: from the preempting submission (or the requeue) to the "
        "checkpoint file's modification time; SLURM kills what is left after KillWait (30 s). "
        "`requeued_after_s`: until the task was back in the queue, where SLURM holds it "
        f"(BeginTime) and this benchmark lets it start {SETTLE_SECONDS} s later. The resumed task "
        "was then cancelled.",
        "",
        table(checks["preemptions"] + [checks["requeue"]], keys),
        "",
        "## A time limit shorter than the run",
        "",
        f"`{TIME_LIMITED} --checkpoint-every 0` through the launcher with "
        f"`{' '.join(TIME_LIMIT)}`: SLURM sends USR1 60 s before each 3-minute limit, the run "
        "saves and the batch script requeues the task, which resumes; each requeued task was let "
        f"start {SETTLE_SECONDS} s after it was back in the queue. Beside it, the same run without "
        "SLURM.",
        "",
        f"- restarts: {limited['restarts']}, resumed from updates {limited['resumed_updates']}, "
        f"final exit {limited['exit']}, {limited['wall_time_s']} s from submission to the end",
        f"- fingerprint {limited['fingerprint']}, uninterrupted "
        f"{limited['uninterrupted_fingerprint']}: equal = {limited['equal']}",
        f"- stops: {limited['stops']}",
        "",
        "![steps against wall time](slurm_stops.png)",
        "",
        "## A user's scancel",
        "",
        f"`{CANCELLED}` (launcher, SLURM), `scancel JOB_0` once it showed update 20: the run saves "
        "and the task ends for good (not requeued by the batch script, nor by SLURM); `scontrol "
        "requeue JOB_0` afterwards continues it from its checkpoint.",
        "",
        f"- back in the queue 5 s after it ended: {cancelled['back_in_queue_after_5_s']}",
        f"- `scontrol requeue` of the cancelled task: {cancelled['requeue_after_cancel']}; resumed "
        f"from update {cancelled['resumed_update']}",
        f"- stops: {cancelled['stops']}",
        "",
        "## Commands",
        "",
        "```",
        *lab.commands,
        "```",
        "",
    ]
    return "\n".join(lines)


def run_checks(lab: Lab) -> dict:
    return dict(
        preemptions=preemptions(lab),
        requeue=requeue(lab),
        cancel=cancel(lab),
        time_limit=time_limit(lab),
    )


def write_results(lab: Lab, checks: dict, started: float):
    rows = [*checks["preemptions"], checks["requeue"], checks["time_limit"], checks["cancel"]]
    more = [key for r in rows for key in r if key not in RUN_COLUMNS and key != "events"]
    fields = [*RUN_COLUMNS, *dict.fromkeys(more)]
    with open(RESULTS / "slurm_stops.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=fields, restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    plot(lab, checks["time_limit"], RESULTS / "slurm_stops.png")
    (RESULTS / "slurm_stops.md").write_text(report(lab, checks, started))
    log(f"wrote {RESULTS / 'slurm_stops.md'}")


def main():
    started = time.time()
    lab = open_lab(__doc__.splitlines()[0], "slurm_stops")
    write_results(lab, run_checks(lab), started)


if __name__ == "__main__":
    main()
