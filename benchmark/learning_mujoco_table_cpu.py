"""cleanba_ppo_continuous.py on the rest of CleanRL's published ppo_continuous_action table, on a
CPU: 1M steps at the script's defaults of InvertedPendulum-v4, Pusher-v4, Humanoid-v4 and three
dm_control tasks (envpool's AcrobotSwingup-v1, AcrobotSwingupSparse-v1, BallInCupCatch-v1), and
ablations on Humanoid-v4. HalfCheetah-v4, Hopper-v4 and Walker2d-v4 come from
benchmark/results/learning_mujoco_cpu.csv (benchmark/learning_mujoco_cpu.py), so the per-task
table covers all nine tasks.

python benchmark/learning_mujoco_table_cpu.py                      # the table's runs, in order
python benchmark/learning_mujoco_table_cpu.py --runs humanoid_cleanrl_1   # some runs (ablations)
python benchmark/learning_mujoco_table_cpu.py --report-only        # the report of finished runs

A finished run is never rerun; an unfinished one (stopped by SIGTERM, or killed) continues from its
newest checkpoint (one every 50 updates). Writes benchmark/results/learning_mujoco_table_cpu.md
(tables, commands, ablations), .csv (one row per finished run) and .png (the curves).
"""

import argparse
import csv
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from learning_mujoco_cpu import COMMON, LAST_EPISODES, REPO, SCRIPT, scalar
from measure import command_line, run_resumable, stack_line

LAYOUT_CLEANRL = ["--local-num-envs", "1", "--num-steps", "2048", "--num-actor-threads", "1"]
MODES = {
    "defaults": [],
    # Ablations: CleanRL's layout, CleanRL's time limits, both.
    "cleanrl": LAYOUT_CLEANRL,
    "no_bootstrap": ["--no-bootstrap-truncations"],
    "cleanrl_exact": [*LAYOUT_CLEANRL, "--no-bootstrap-truncations"],
    # The normalizer statistics two rollouts old instead of one (and the policy one version old).
    "concurrency": ["--concurrency"],
}
MODE_DESCRIPTIONS = {
    "defaults": "the script's defaults (8 environments x 256 steps, truncations bootstrapped)",
    "cleanrl": "CleanRL's layout: `--local-num-envs 1 --num-steps 2048`",
    "no_bootstrap": "CleanRL's time limits: `--no-bootstrap-truncations` (a truncation treated "
    "as a termination)",
    "cleanrl_exact": "CleanRL's layout and time limits",
    "concurrency": "`--concurrency`: actors play with normalizer statistics two rollouts old "
    "(one at the defaults) and a policy one version old",
}
# The table's runs at the defaults, in the order they run: one seed of every task first. Each task
# gets 3 seeds (every run costs less than 15 minutes here).
TASKS = [
    "InvertedPendulum-v4",
    "Pusher-v4",
    "AcrobotSwingup-v1",
    "AcrobotSwingupSparse-v1",
    "BallInCupCatch-v1",
    "Humanoid-v4",
]
SEEDS = [1, 2, 3]
# The ablations on Humanoid-v4, in the order they ran.
ABLATIONS = [
    ("Humanoid-v4", "cleanrl", 1),
    ("Humanoid-v4", "no_bootstrap", 1),
    ("Humanoid-v4", "cleanrl", 2),
    ("Humanoid-v4", "concurrency", 1),
    ("Humanoid-v4", "cleanrl", 3),
]


def name_of(env_id: str, mode: str, seed: int) -> str:
    return f"{env_id.split('-')[0].lower()}_{mode}_{seed}"


TABLE_RUNS = {
    name_of(env_id, "defaults", seed): (env_id, "defaults", seed)
    for seed in SEEDS
    for env_id in TASKS
}
ABLATION_RUNS = {name_of(*run_key): run_key for run_key in ABLATIONS}
RUNS = TABLE_RUNS | ABLATION_RUNS
# CleanRL's ppo_continuous_action.py, 1M steps: mean and standard deviation over seeds of the final
# episodic returns (CleanRL's documentation, "PPO: continuous action" benchmark table; the
# dm_control rows are its dm_control/... tasks, named here by their envpool ids).
CLEANRL = {
    "HalfCheetah-v4": (1442.64, 46.03),
    "Walker2d-v4": (2287.95, 571.78),
    "Hopper-v4": (2382.86, 271.74),
    "InvertedPendulum-v4": (963.09, 22.20),
    "Humanoid-v4": (716.11, 49.08),
    "Pusher-v4": (-40.38, 7.15),
    "AcrobotSwingup-v1": (25.60, 6.30),
    "AcrobotSwingupSparse-v1": (1.35, 0.27),
    "BallInCupCatch-v1": (619.26, 278.67),
}
CLEANRL_NAMES = {
    "AcrobotSwingup-v1": "dm_control acrobot-swingup",
    "AcrobotSwingupSparse-v1": "dm_control acrobot-swingup_sparse",
    "BallInCupCatch-v1": "dm_control ball_in_cup-catch",
}
EARLIER_CSV = REPO / "benchmark" / "results" / "learning_mujoco_cpu.csv"
EARLIER_TASKS = ["HalfCheetah-v4", "Hopper-v4", "Walker2d-v4"]


def command_of(name: str) -> list[str]:
    env_id, mode, seed = RUNS[name]
    args = ["--env-id", env_id, *MODES[mode], *COMMON, "--seed", str(seed), "--run-name", name]
    return [f"cleanba/{SCRIPT}.py", *args]


def run(name: str, work_dir: Path):
    """Runs `name` under `nice -n 10`; an unfinished run continues from its newest checkpoint."""
    run_dir = work_dir / "runs" / name
    if (run_dir / "summary.json").exists():
        print(f"{name}: already run", flush=True)
        return
    run_resumable(name, command_of(name), work_dir, REPO)


def result_of(name: str, work_dir: Path) -> dict:
    run_dir = work_dir / "runs" / name
    env_id, mode, seed = RUNS[name]
    summary = json.loads((run_dir / "summary.json").read_text())
    returns = [value for _, value in scalar(run_dir, "charts/episodic_return")]
    evaluation = [value for _, value in scalar(run_dir, "eval/episodic_return")]
    return dict(
        script=SCRIPT,
        mode=mode,
        env_id=env_id,
        seed=seed,
        steps=summary["global_step"],
        final_return=round(float(np.mean(returns[-LAST_EPISODES:])), 2),
        eval_return=round(float(np.mean(evaluation)), 2),
        sps=summary["sps"],
        wall_time_s=round(summary["wall_time_s"]),
    )


def earlier_finals() -> dict[str, list[float]]:
    """The final returns of the defaults runs of benchmark/learning_mujoco_cpu.py, by task."""
    with open(EARLIER_CSV, newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["mode"] == "defaults"]
    return {
        env_id: [float(row["final_return"]) for row in rows if row["env_id"] == env_id]
        for env_id in EARLIER_TASKS
    }


def smoothed_curve(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """The mean of the last LAST_EPISODES training episodes (fewer at the start), by step."""
    curve = scalar(run_dir, "charts/episodic_return")
    steps = np.array([step for step, _ in curve])
    returns = np.array([value for _, value in curve])
    sums = np.cumsum(returns)
    counts = np.minimum(np.arange(1, len(returns) + 1), LAST_EPISODES)
    shifted = np.concatenate([np.zeros(LAST_EPISODES), sums])[: len(sums)]
    return steps, (sums - shifted) / counts


def plot(names: list[str], work_dir: Path, path: Path):
    env_ids = [env_id for env_id in TASKS if any(RUNS[name][0] == env_id for name in names)]
    columns = 3
    rows = -(-len(env_ids) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    for ax, env_id in zip(axes.flat, env_ids):
        for name in names:
            if RUNS[name][0] != env_id:
                continue
            _, mode, seed = RUNS[name]
            steps, smoothed = smoothed_curve(work_dir / "runs" / name)
            ax.plot(
                steps,
                smoothed,
                linestyle="-" if mode == "defaults" else ":",
                label=f"{mode}, seed {seed}",
            )
        reference, spread = CLEANRL[env_id]
        ax.axhspan(reference - spread, reference + spread, color="grey", alpha=0.2)
        ax.axhline(reference, color="grey", linestyle="--", label=f"CleanRL 1M ({reference})")
        ax.set(
            xlabel="environment steps",
            ylabel=f"episodic return (mean of last {LAST_EPISODES})",
            title=CLEANRL_NAMES.get(env_id, env_id),
        )
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(env_ids) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def task_row(env_id: str, mode: str, finals: list[float], source: str) -> str:
    reference, spread = CLEANRL[env_id]
    target = reference - spread
    met = "yes" if np.mean(finals) >= target else "no"
    # The table's claim is about the defaults; an ablation row only shows its numbers.
    met = met if mode == "defaults" else f"({met}: ablation)"
    label = f"{CLEANRL_NAMES[env_id]} ({env_id})" if env_id in CLEANRL_NAMES else env_id
    return (
        f"| {label} | {mode} | {len(finals)} | "
        f"{np.mean(finals):.2f} ± {np.std(finals):.2f} | {reference:.2f} ± {spread:.2f} | "
        f"{target:.2f} | {met} | {source} |"
    )


def report(work_dir: Path, out: Path, date: str, note: str, argv: list[str]):
    names = [name for name in RUNS if (work_dir / "runs" / name / "summary.json").exists()]
    results = [result_of(name, work_dir) for name in names]
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results[0]))
        writer.writeheader()
        writer.writerows(results)
    plot(names, work_dir, out.with_suffix(".png"))
    runs_table = [
        f"| task | mode | seed | steps | final return (last {LAST_EPISODES} episodes) | eval "
        "return (10 episodes, mean action) | SPS | wall time (min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    runs_table += [
        f"| {r['env_id']} | {r['mode']} | {r['seed']} | {r['steps']:,} | "
        f"{r['final_return']:.2f} | {r['eval_return']:.2f} | {r['sps']} | "
        f"{r['wall_time_s'] / 60:.1f} |"
        for r in results
    ]
    tasks_table = [
        "| task | mode | seeds | final return, mean ± std | CleanRL 1M | target: CleanRL's mean - "
        "std | met | source |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for env_id, finals in earlier_finals().items():
        tasks_table.append(
            task_row(env_id, "defaults", finals, "[learning_mujoco_cpu](learning_mujoco_cpu.md)")
        )
    for env_id in TASKS:
        for mode in MODES:
            finals = [
                r["final_return"] for r in results if (r["env_id"], r["mode"]) == (env_id, mode)
            ]
            if finals:
                tasks_table.append(task_row(env_id, mode, finals, "this report"))
    missing = [name for name in RUNS if name not in names]
    commands = "\n".join(shlex.join(["python", *command_of(name)]) for name in names)
    modes = "\n".join(
        f"- `{mode}`: {MODE_DESCRIPTIONS[mode]}"
        for mode in MODES
        if any(r["mode"] == mode for r in results)
    )
    out.write_text(
        f"# Continuous PPO on CleanRL's ppo_continuous_action table, on a CPU ({date})\n\n"
        f"{stack_line()}\n\n"
        f"Machine: {platform.machine()}, 2 CPU cores, 24 GiB, Python "
        f"{platform.python_version()}. Made by `{command_line(argv)}`; the runs, one at a time "
        f"under `nice -n 10`, were (from the repository root):\n\n```\n{commands}\n```\n\n"
        f"Modes:\n\n{modes}\n\n"
        f"Final return: the mean of the last {LAST_EPISODES} training episodes (unnormalized "
        "`charts/episodic_return`, as CleanRL reports it); eval return: 10 episodes with the "
        "mean action after training. CleanRL's reference is its documented 1M-step table for "
        "ppo_continuous_action.py (gym's v4 MuJoCo tasks and dm_control through shimmy); ours "
        "runs envpool's ports of the same tasks.\n\n"
        "## Runs\n\n" + "\n".join(runs_table) + "\n\n"
        "## Per task\n\n"
        "HalfCheetah-v4, Hopper-v4 and Walker2d-v4: the defaults runs of "
        "[learning_mujoco_cpu.md](learning_mujoco_cpu.md) (3 seeds each, read from "
        "learning_mujoco_cpu.csv).\n\n"
        + "\n".join(tasks_table)
        + (f"\n\nNot run (time): {', '.join(missing)}." if missing else "")
        + (f"\n\n{note}" if note else "")
        + f"\n\n![curves]({out.with_suffix('.png').name})\n"
    )
    print(out.read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=list(TABLE_RUNS), choices=list(RUNS))
    parser.add_argument(
        "--report-only", action="store_true", help="write the report from finished runs"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cleanba_mujoco_table"))
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmark" / "results" / "learning_mujoco_table_cpu.md",
    )
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument(
        "--note",
        default="",
        help="paragraphs under the tables: how the machine was shared, the ablations",
    )
    options = parser.parse_args()
    options.work_dir.mkdir(parents=True, exist_ok=True)
    if not options.report_only:
        for name in options.runs:
            run(name, options.work_dir)
    report(options.work_dir, options.out, options.date, options.note, sys.argv)


if __name__ == "__main__":
    main()
