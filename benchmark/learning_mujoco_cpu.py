"""Evidence that cleanba_ppo_continuous.py learns MuJoCo, on a CPU: 1M steps of HalfCheetah-v4,
Hopper-v4 and Walker2d-v4 with the script's defaults, and of HalfCheetah-v4 in CleanRL's exact
setting (1 environment x 2048 steps; `cleanrl_exact`: also CleanRL's time limits, a truncation
treated as a termination), against CleanRL's published ppo_continuous_action results.

python benchmark/learning_mujoco_cpu.py                        # every run, one after another
python benchmark/learning_mujoco_cpu.py --runs halfcheetah_defaults_1    # some runs
python benchmark/learning_mujoco_cpu.py --report-only          # the report of the finished runs

A finished run is never rerun; an unfinished one (stopped by SIGTERM, or killed) continues from its
newest checkpoint (one every 50 updates). Writes benchmark/results/learning_mujoco_cpu.md (table,
commands, references), .csv (one row per finished run) and .png (the curves).
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
from measure import command_line, run_resumable, stack_line
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "cleanba_ppo_continuous"
MODES = {
    "defaults": [],
    "cleanrl": ["--local-num-envs", "1", "--num-steps", "2048", "--num-actor-threads", "1"],
    "cleanrl_exact": [
        *["--local-num-envs", "1", "--num-steps", "2048", "--num-actor-threads", "1"],
        "--no-bootstrap-truncations",
    ],
}
COMMON = ["--total-timesteps", "1000000", "--eval-episodes", "10", "--eval-every", "50"]
COMMON += ["--checkpoint-every", "50", "--log-frequency", "50"]
# In the order they run: one seed of everything first.
PLAN = [
    ("HalfCheetah-v4", "defaults"),
    ("Hopper-v4", "defaults"),
    ("Walker2d-v4", "defaults"),
    ("HalfCheetah-v4", "cleanrl"),
    ("HalfCheetah-v4", "cleanrl_exact"),
]
SEEDS = [1, 2, 3]
RUNS = {
    f"{env_id.split('-')[0].lower()}_{mode}_{seed}": (env_id, mode, seed)
    for seed in SEEDS
    for env_id, mode in PLAN
}
LAST_EPISODES = 100
# CleanRL's ppo_continuous_action.py, 1M steps, 3 seeds, the v4 tasks: the mean and standard
# deviation over seeds of the final episodic returns (CleanRL's documentation, "PPO: continuous
# action" benchmark table).
CLEANRL = {"HalfCheetah-v4": (1443, 46), "Hopper-v4": (2383, 272), "Walker2d-v4": (2288, 572)}


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


def scalar(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return []
    return sorted((e.step, e.value) for e in events.Scalars(tag))


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
        final_return=round(float(np.mean(returns[-LAST_EPISODES:])), 1),
        eval_return=round(float(np.mean(evaluation)), 1),
        sps=summary["sps"],
        wall_time_s=round(summary["wall_time_s"]),
    )


def plot(names: list[str], work_dir: Path, path: Path):
    env_ids = sorted({RUNS[name][0] for name in names})
    fig, axes = plt.subplots(1, len(env_ids), figsize=(5 * len(env_ids), 4), squeeze=False)
    for ax, env_id in zip(axes[0], env_ids):
        for name in names:
            if RUNS[name][0] != env_id:
                continue
            _, mode, seed = RUNS[name]
            curve = scalar(work_dir / "runs" / name, "charts/episodic_return")
            steps = np.array([step for step, _ in curve])
            returns = np.array([value for _, value in curve])
            window = np.ones(LAST_EPISODES) / LAST_EPISODES
            smoothed = np.convolve(returns, window, mode="valid")
            ax.plot(
                steps[LAST_EPISODES - 1 :],
                smoothed,
                linestyle="-" if mode == "defaults" else ":",
                label=f"{mode}, seed {seed}",
            )
        reference, spread = CLEANRL[env_id]
        ax.axhspan(reference - spread, reference + spread, color="grey", alpha=0.2)
        ax.axhline(reference, color="grey", linestyle="--", label=f"CleanRL 1M ({reference})")
        ax.set(
            xlabel="environment steps",
            ylabel=f"episodic return (mean of {LAST_EPISODES})",
            title=env_id,
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(work_dir: Path, out: Path, date: str, note: str, argv: list[str]):
    names = [name for name in RUNS if (work_dir / "runs" / name / "summary.json").exists()]
    results = [result_of(name, work_dir) for name in names]
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results[0]))
        writer.writeheader()
        writer.writerows(results)
    plot(names, work_dir, out.with_suffix(".png"))
    table = [
        f"| task | mode | seed | steps | final return (last {LAST_EPISODES} episodes) | eval "
        "return (10 episodes, mean action) | SPS | wall time (min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    table += [
        f"| {r['env_id']} | {r['mode']} | {r['seed']} | {r['steps']:,} | "
        f"{r['final_return']:.0f} | {r['eval_return']:.0f} | {r['sps']} | "
        f"{r['wall_time_s'] / 60:.1f} |"
        for r in results
    ]
    groups = [
        "| task | mode | seeds | final return, mean ± std | CleanRL 1M (3 seeds) | target: "
        "CleanRL's mean - std | met |"
    ]
    groups.append("|---|---|---|---|---|---|---|")
    for env_id, mode in PLAN:
        finals = [r["final_return"] for r in results if (r["env_id"], r["mode"]) == (env_id, mode)]
        if finals:
            reference, spread = CLEANRL[env_id]
            target = reference - spread
            groups.append(
                f"| {env_id} | {mode} | {len(finals)} | {np.mean(finals):.0f} ± "
                f"{np.std(finals):.0f} | {reference} ± {spread} | {target} | "
                f"{'yes' if np.mean(finals) >= target else 'no'} |"
            )
    missing = [name for name in RUNS if name not in names]
    commands = "\n".join(shlex.join(["python", *command_of(name)]) for name in names)
    out.write_text(
        f"# MuJoCo learning on a CPU ({date})\n\n"
        f"{stack_line()}\n\n"
        f"Machine: {platform.machine()}, 2 CPU cores, 24 GiB, Python "
        f"{platform.python_version()}. Made by `{command_line(argv)}`; the runs, one at a time "
        f"under `nice -n 10`, were (from the repository root):\n\n```\n{commands}\n```\n\n"
        "`defaults`: the script's defaults (8 environments x 256 steps); `cleanrl`: CleanRL's "
        "exact layout (1 environment x 2048 steps); `cleanrl_exact`: that layout and CleanRL's "
        "time limits (a truncation treated as a termination). Final return: the mean of the last "
        f"{LAST_EPISODES} training episodes; eval return: "
        "10 episodes with the mean action after training.\n\n"
        + "\n".join(table)
        + "\n\n"
        + "\n".join(groups)
        + (f"\n\nNot run (time): {', '.join(missing)}." if missing else "")
        + (f"\n\n{note}" if note else "")
        + f"\n\n![curves]({out.with_suffix('.png').name})\n"
    )
    print(out.read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument(
        "--report-only", action="store_true", help="write the report from finished runs"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cleanba_learning_mujoco_cpu"))
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmark" / "results" / "learning_mujoco_cpu.md"
    )
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument(
        "--note", default="", help="a paragraph under the table: how the machine was shared"
    )
    options = parser.parse_args()
    options.work_dir.mkdir(parents=True, exist_ok=True)
    if not options.report_only:
        for name in options.runs:
            run(name, options.work_dir)
    report(options.work_dir, options.out, options.date, options.note, sys.argv)


if __name__ == "__main__":
    main()
