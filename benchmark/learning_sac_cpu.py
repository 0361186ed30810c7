"""Evidence that cleanba_sac.py learns MuJoCo, on a CPU: 1M steps of the README's command
(`python cleanba/cleanba_sac.py --env-id ENV`, every hyperparameter at its default) on
HalfCheetah-v4 and Hopper-v4, seeds 1 and 2 (Walker2d-v4 and seed 3 on request), against CleanRL's
published sac_continuous_action results; and how fast the whole run trains against the script's own
update alone.

python benchmark/learning_sac_cpu.py                              # every run, one after another
python benchmark/learning_sac_cpu.py --envs HalfCheetah-v4 Hopper-v4 Walker2d-v4 --seeds 1 2 3
python benchmark/learning_sac_cpu.py --report-only                # the report of the runs so far

Each run saves a checkpoint (the replay included) every 500 updates (32,000 steps) and on SIGTERM:
running the same command again resumes an unfinished run from its newest checkpoint, where it
continues exactly as if never stopped, and skips a finished one (whose checkpoints are then
deleted: a checkpoint of a full replay takes 170 MB). Before and after each run it measures the
bare update: the script's own compiled update (`make_update`, the scan of one learner update's 64
gradient updates) on random batches, after compilation, in a process of its own under the same
`nice -n 10` as the runs. Writes benchmark/results/learning_sac_cpu.md (tables, commands,
references), .csv (one row per run, unfinished ones marked) and .png (the curves).
"""

import argparse
import csv
import json
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from csv_columns import RUN_COLUMNS
from measure import command_line, run_resumable, stack_line
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "cleanba_sac"
COMMON = ["--eval-episodes", "10", "--eval-every", "100", "--log-frequency", "100"]
LAST_EPISODES = 100
# CleanRL's sac_continuous_action.py, 1M steps, the v4 tasks: the mean and standard deviation over
# seeds of the final episodic returns (CleanRL's documentation, "SAC: continuous action" benchmark).
CLEANRL = {"HalfCheetah-v4": (9635, 1424), "Walker2d-v4": (3591, 911), "Hopper-v4": (2310, 343)}
CSV_COLUMNS = [*RUN_COLUMNS, "updates_per_second"]
BARE_CALLS = 20
BARE_MEASURE = """
import json
import os
import sys
import time

import jax
import numpy as np

from cleanba import cleanba_sac as sac
from cleanba_utils.devices import replicate
from cleanba_utils.envs import observation_size

args = sac.parse_args(["--env-id", sys.argv[1]])
sizes = sac.sizes_of(args, 1)
networks = sac.networks_of(args)
obs_size = observation_size(args.env_id)
action_size = len(networks.bounds.scale)
replay = sac.make_replay(sac.Args(buffer_size=1), obs_size, action_size)
state = sac.init_state(args, sizes, networks, replay).learner
devices = jax.local_devices()[:1]
update_fn = sac.make_update(args, devices, networks)
state = replicate(state, devices)
count = sac.optimizer_steps_per_update(args, sizes)
rng = np.random.default_rng(0)
shape = (1, count, args.batch_size)
batches = sac.Batch(
    obs=rng.normal(size=(*shape, obs_size)).astype(np.float32),
    actions=rng.uniform(-1, 1, (*shape, action_size)).astype(np.float32),
    rewards=rng.normal(size=shape).astype(np.float32),
    next_obs=rng.normal(size=(*shape, obs_size)).astype(np.float32),
    terminations=np.zeros(shape, np.float32),
)
state, _ = update_fn(state, batches)
jax.block_until_ready(state)
rates = []
for _ in range(int(sys.argv[2])):
    tic = time.time()
    state, _ = update_fn(state, batches)
    jax.block_until_ready(state)
    rates.append(count / (time.time() - tic))
print(
    json.dumps(
        dict(
            env_id=args.env_id,
            updates_per_call=count,
            rates=rates,
            time=time.time(),
            load=os.getloadavg()[0],
        )
    )
)
"""


def name_of(env_id: str, seed: int) -> str:
    return f"{env_id.split('-')[0].lower()}_{seed}"


def command_of(env_id: str, seed: int) -> list[str]:
    args = ["--env-id", env_id, *COMMON, "--seed", str(seed), "--run-name", name_of(env_id, seed)]
    return [f"cleanba/{SCRIPT}.py", *args]


def measure_bare(work_dir: Path, env_id: str):
    """Appends one measurement of the bare update on `env_id`'s shapes (the rates of BARE_CALLS
    calls, and the machine's load average) to bare_update.json."""
    result = subprocess.run(
        ["nice", "-n", "10", sys.executable, "-c", BARE_MEASURE, env_id, str(BARE_CALLS)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    path = work_dir / "bare_update.json"
    measurements = json.loads(path.read_text()) if path.exists() else []
    measurements.append(json.loads(result.stdout.strip().splitlines()[-1]))
    path.write_text(json.dumps(measurements, indent=1))
    print(f"bare update on {env_id}: {np.median(measurements[-1]['rates']):.0f}/s", flush=True)


def run(env_id: str, seed: int, work_dir: Path):
    """Runs one (env, seed) under `nice -n 10` between two measurements of the bare update; an
    unfinished run continues from its newest checkpoint, a finished one is skipped and its
    checkpoints removed."""
    name = name_of(env_id, seed)
    run_dir = work_dir / "runs" / name
    if not (run_dir / "summary.json").exists():
        measure_bare(work_dir, env_id)
        run_resumable(name, command_of(env_id, seed), work_dir, REPO)
        measure_bare(work_dir, env_id)
    print(f"{name}: finished", flush=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def scalar(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return []
    return sorted((e.step, e.value) for e in events.Scalars(tag))


def result_of(env_id: str, seed: int, work_dir: Path) -> dict:
    """A run's row: the mean of its last 100 training episodes, its last evaluation (10 episodes of
    the deterministic policy), and the median of its gradient updates per second over the console
    windows of its learning phase (evaluations and checkpoints included). An unfinished run's steps
    are those logged so far, marked `partial`."""
    run_dir = work_dir / "runs" / name_of(env_id, seed)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    returns = [value for _, value in scalar(run_dir, "charts/episodic_return")]
    evaluations = scalar(run_dir, "charts/eval_return")
    rates = [value for _, value in scalar(run_dir, "stats/optimizer_steps_per_second") if value > 0]
    sps = scalar(run_dir, "charts/SPS")
    steps = summary["global_step"] if summary else max([s for s, _ in sps], default=0)
    return dict(
        script=SCRIPT,
        mode="defaults" if summary else "defaults (partial)",
        env_id=env_id,
        seed=seed,
        steps=steps,
        final_return=round(float(np.mean(returns[-LAST_EPISODES:])), 1) if returns else None,
        eval_return=round(evaluations[-1][1], 1) if evaluations else None,
        sps=summary["sps"] if summary else (int(sps[-1][1]) if sps else None),
        wall_time_s=round(summary["wall_time_s"]) if summary else None,
        updates_per_second=round(float(np.median(rates)), 1) if rates else None,
    )


def plot(results: list[dict], work_dir: Path, path: Path):
    env_ids = list(dict.fromkeys(r["env_id"] for r in results))
    fig, axes = plt.subplots(1, len(env_ids), figsize=(5 * len(env_ids), 4), squeeze=False)
    for ax, env_id in zip(axes[0], env_ids):
        for index, row in enumerate(r for r in results if r["env_id"] == env_id):
            run_dir = work_dir / "runs" / name_of(env_id, row["seed"])
            curve = scalar(run_dir, "charts/episodic_return")
            if len(curve) >= LAST_EPISODES:
                steps = np.array([step for step, _ in curve])
                window = np.ones(LAST_EPISODES) / LAST_EPISODES
                smoothed = np.convolve([value for _, value in curve], window, mode="valid")
                ax.plot(
                    steps[LAST_EPISODES - 1 :],
                    smoothed,
                    color=f"C{index}",
                    label=f"seed {row['seed']}, training (last {LAST_EPISODES})",
                )
            evaluations = scalar(run_dir, "charts/eval_return")
            if evaluations:
                ax.plot(
                    *zip(*evaluations),
                    color=f"C{index}",
                    linestyle=":",
                    label=f"seed {row['seed']}, evaluation",
                )
        reference, spread = CLEANRL[env_id]
        ax.axhspan(reference - spread, reference + spread, color="grey", alpha=0.2)
        ax.axhline(reference, color="grey", linestyle="--", label=f"CleanRL 1M ({reference})")
        ax.set(xlabel="environment steps", ylabel="episodic return", title=env_id)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def number(value, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def bare_summary(work_dir: Path) -> tuple[str, float | None]:
    """The bare update's measurements as a sentence, and their median rate."""
    path = work_dir / "bare_update.json"
    if not path.exists():
        return "The bare update was not measured.", None
    measurements = json.loads(path.read_text())
    medians = [float(np.median(m["rates"])) for m in measurements]
    described = [
        f"{median:.0f}/s ({m['env_id']}, "
        f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(m['time']))}, load {m['load']:.1f})"
        for median, m in zip(medians, measurements)
    ]
    text = (
        f"The bare update (`make_update`'s compiled scan of {measurements[0]['updates_per_call']} "
        f"gradient updates on random batches, after compilation, the median of {BARE_CALLS} "
        "calls; measured before and after every run this benchmark made): "
        + ", ".join(described)
        + f". Their median, {np.median(medians):.0f} updates/s, is the `% of bare` reference; "
        "the machine's load moves both rates."
    )
    return text, float(np.median(medians))


def report(work_dir: Path, out: Path, plan: list, date: str, note: str, argv: list[str]):
    results = [
        result_of(env_id, seed, work_dir)
        for seed, env_id in plan
        if (work_dir / "runs" / name_of(env_id, seed)).exists()
    ]
    if not results:
        sys.exit(f"no run under {work_dir / 'runs'} yet")
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(results)
    plot(results, work_dir, out.with_suffix(".png"))
    bare_text, bare_rate = bare_summary(work_dir)
    percent = lambda rate: "n/a" if rate is None or bare_rate is None else f"{rate / bare_rate:.0%}"
    table = [
        f"| task | seed | steps | final return (last {LAST_EPISODES} episodes) | eval return "
        "(10 episodes, deterministic) | updates/s | % of bare | SPS | wall time (h) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    table += [
        f"| {r['env_id']} | {r['seed']} | {r['steps']:,}"
        f"{' (partial)' if 'partial' in r['mode'] else ''} | {number(r['final_return'])} | "
        f"{number(r['eval_return'])} | {number(r['updates_per_second'])} | "
        f"{percent(r['updates_per_second'])} | {number(r['sps'])} | "
        f"{number(r['wall_time_s'] and r['wall_time_s'] / 3600, 1)} |"
        for r in results
    ]
    groups = [
        "| task | finished seeds | final return, mean ± std | eval return, mean ± std | CleanRL 1M "
        "| target: CleanRL's mean - std | met (final return) |",
        "|---|---|---|---|---|---|---|",
    ]
    for env_id in dict.fromkeys(env_id for _, env_id in plan):
        finished = [r for r in results if r["env_id"] == env_id and r["mode"] == "defaults"]
        reference, spread = CLEANRL[env_id]
        target = reference - spread
        if not finished:
            groups.append(f"| {env_id} | 0 | n/a | n/a | {reference} ± {spread} | {target} | |")
            continue
        finals = [r["final_return"] for r in finished]
        evaluations = [r["eval_return"] for r in finished]
        groups.append(
            f"| {env_id} | {len(finished)} | {np.mean(finals):.0f} ± {np.std(finals):.0f} | "
            f"{np.mean(evaluations):.0f} ± {np.std(evaluations):.0f} | {reference} ± {spread} | "
            f"{target} | {'yes' if np.mean(finals) >= target else 'no'} |"
        )
    commands = "\n".join(shlex.join(["python", *command_of(env_id, seed)]) for seed, env_id in plan)
    missing = [
        name_of(env_id, seed)
        for seed, env_id in plan
        if not (work_dir / "runs" / name_of(env_id, seed)).exists()
    ]
    out.write_text(
        f"# SAC on MuJoCo on a CPU ({date})\n\n"
        f"{stack_line()}\n\n"
        f"Machine: {platform.machine()}, 2 CPU cores, 24 GiB, Python "
        f"{platform.python_version()}. Made by `{command_line(argv)}`; the runs, one at a time "
        f"under `nice -n 10`, are (from the repository root):\n\n```\n{commands}\n```\n\n"
        "Every hyperparameter is the script's default (CleanRL's, with 1 environment x 64 steps "
        "per rollout and 64 gradient updates per learner update); the flags add evaluation, "
        "checkpoints and fewer console lines. Final return: the mean of the last "
        f"{LAST_EPISODES} training episodes; eval return: the last evaluation, 10 episodes with "
        "the deterministic action; updates/s: the median over the run's console windows (every "
        "100 updates, evaluations and checkpoints included) of its gradient updates per second.\n\n"
        + "\n".join(table)
        + "\n\n"
        + "\n".join(groups)
        + f"\n\n{bare_text}\n"
        + (f"\n\nNot run yet: {', '.join(missing)}." if missing else "")
        + (f"\n\n{note}" if note else "")
        + f"\n\n![curves]({out.with_suffix('.png').name})\n"
    )
    print(out.read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", default=["HalfCheetah-v4", "Hopper-v4"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument(
        "--report-only", action="store_true", help="write the report from the runs so far"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cleanba_learning_sac_cpu"))
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmark" / "results" / "learning_sac_cpu.md"
    )
    parser.add_argument(
        "--total-timesteps",
        type=int,
        default=None,
        help="shorter runs, to try the benchmark itself (default: the script's 1M)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=500,
        help="updates between checkpoints (500: 32,000 steps)",
    )
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument(
        "--note", default="", help="a paragraph under the tables: how the machine was shared"
    )
    options = parser.parse_args()
    unknown = [env_id for env_id in options.envs if env_id not in CLEANRL]
    if unknown:
        parser.error(f"no CleanRL reference for {unknown}; choose among {list(CLEANRL)}")
    COMMON.extend(["--checkpoint-every", str(options.checkpoint_every)])
    if options.total_timesteps:
        COMMON.extend(["--total-timesteps", str(options.total_timesteps)])
    options.work_dir.mkdir(parents=True, exist_ok=True)
    # One seed of every task first.
    plan = [(seed, env_id) for seed in options.seeds for env_id in options.envs]
    if not options.report_only:
        for seed, env_id in plan:
            run(env_id, seed, options.work_dir)
    report(options.work_dir, options.out, plan, options.date, options.note, sys.argv)


if __name__ == "__main__":
    main()
