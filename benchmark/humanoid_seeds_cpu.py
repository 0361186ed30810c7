"""Humanoid-v4 at continuous PPO's defaults, 1M steps, seeds 1-10, with the rollout as one compiled
program and with the rollout played in Python (a policy call per step, the script before
2026-11-26): whether the compiled rollout, which rounds the sampled actions' log-probabilities
differently (about one unit in the last place), changes what the script learns on the task where
CleanRL's table leaves the least margin.

python benchmark/humanoid_seeds_cpu.py --label compiled --checkout . --seeds 1 2 3 4 5 6 7 8 9 10
python benchmark/humanoid_seeds_cpu.py --label python --checkout PATH --seeds 4 5 6 7 8 9 10
python benchmark/humanoid_seeds_cpu.py --report-only

The Python rollout's seeds 1-3 are those of CleanRL's table report at PYTHON_ROLLOUT_COMMIT.

PATH: a checkout of the commit before the compiled rollout (`git worktree add PATH 6088613`); its
scripts run with its own `cleanba_utils` (PYTHONPATH). Runs go to
--work-dir/runs/humanoid_LABEL_SEED under `nice -n 10`; a finished run is never rerun, an
unfinished one continues from its newest checkpoint. Writes benchmark/results/humanoid_seeds_cpu.md,
.csv (one row per run) and .png.
"""

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from csv_columns import RUN_COLUMNS
from learning_mujoco_cpu import LAST_EPISODES, REPO, SCRIPT, scalar
from learning_mujoco_table_cpu import CLEANRL
from measure import command_line, run_resumable

OUT = REPO / "benchmark" / "results" / "humanoid_seeds_cpu"
PYTHON_ROLLOUT_COMMIT = "6088613"
"""The last commit whose continuous PPO played its rollout in Python: its table report's Humanoid-v4
seeds 1-3 (benchmark/learning_mujoco_table_cpu.py, 2026-11-25) join this report's own runs."""
ENV_ID = "Humanoid-v4"
LABELS = {
    "compiled": "the rollout as one compiled program (envpool's XLA step in a lax.scan)",
    "python": "the rollout played in Python, a policy call per step (the script at commit 6088613)",
}


def name_of(label: str, seed: int) -> str:
    return f"humanoid_{label}_{seed}"


def run(label: str, checkout: Path, seed: int, work_dir: Path):
    if (work_dir / "runs" / name_of(label, seed) / "summary.json").exists():
        print(f"{name_of(label, seed)}: already run", flush=True)
        return
    command = [f"cleanba/{SCRIPT}.py", "--env-id", ENV_ID, "--total-timesteps", "1000000"]
    command += ["--checkpoint-every", "50", "--seed", str(seed), "--run-name", name_of(label, seed)]
    os.environ["PYTHONPATH"] = str(checkout.resolve())
    run_resumable(name_of(label, seed), command, work_dir, checkout.resolve())


def finished(work_dir: Path, label: str) -> list[Path]:
    runs = (work_dir / "runs").glob(f"humanoid_{label}_*")
    return sorted(run_dir for run_dir in runs if (run_dir / "summary.json").exists())


def table_rows_before() -> list[dict]:
    """The Humanoid-v4 runs at the defaults of the table report at PYTHON_ROLLOUT_COMMIT."""
    text = subprocess.run(
        ["git", "show", f"{PYTHON_ROLLOUT_COMMIT}:benchmark/results/learning_mujoco_table_cpu.csv"],
        cwd=REPO,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout
    rows = []
    for row in csv.DictReader(text.splitlines()):
        if row["env_id"] == ENV_ID and row["mode"] == "defaults":
            row = dict(row, script=f"{SCRIPT} (python rollout)", mode="python", eval_return="")
            row["seed"] = int(row["seed"])
            row["final_return"] = float(row["final_return"])
            rows.append(row)
    return rows


def results(work_dir: Path) -> list[dict]:
    rows = table_rows_before()
    for label in LABELS:
        for run_dir in finished(work_dir, label):
            summary = json.loads((run_dir / "summary.json").read_text())
            returns = [value for _, value in scalar(run_dir, "charts/episodic_return")]
            rows.append(
                dict(
                    script=f"{SCRIPT} ({label} rollout)",
                    mode=label,
                    env_id=ENV_ID,
                    seed=int(run_dir.name.rsplit("_", 1)[1]),
                    steps=summary["global_step"],
                    final_return=round(float(np.mean(returns[-LAST_EPISODES:])), 2),
                    eval_return="",
                    sps=summary["sps"],
                    wall_time_s=round(summary["wall_time_s"]),
                )
            )
    return sorted(rows, key=lambda row: (row["mode"], row["seed"]))


def welch_t(a: np.ndarray, b: np.ndarray) -> float:
    return (a.mean() - b.mean()) / np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))


def bootstrap_interval(a: np.ndarray, b: np.ndarray, draws: int = 20_000) -> tuple[float, float]:
    """95 % percentile interval of mean(a) - mean(b), resampling each group's seeds."""
    rng = np.random.default_rng(0)
    differences = [
        rng.choice(a, len(a)).mean() - rng.choice(b, len(b)).mean() for _ in range(draws)
    ]
    return tuple(np.percentile(differences, [2.5, 97.5]))


def report(work_dir: Path, argv_note: str):
    rows = results(work_dir)
    with open(OUT.with_suffix(".csv"), "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=RUN_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    finals = {
        label: np.array([row["final_return"] for row in rows if row["mode"] == label])
        for label in LABELS
    }
    mean, spread = CLEANRL[ENV_ID]
    lines = [
        f"# Humanoid-v4, compiled against Python rollout, CPU ({time.strftime('%Y-%m-%d')})\n",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores. {argv_note}\n",
        "Commands (each seed): `python cleanba/cleanba_ppo_continuous.py --env-id Humanoid-v4 "
        "--total-timesteps 1000000 --checkpoint-every 50 --seed S`, from each checkout "
        "(`python benchmark/humanoid_seeds_cpu.py --label LABEL --checkout PATH --seeds ...`).\n",
        "".join(f"- `{label}`: {text}\n" for label, text in LABELS.items()),
        f"Final return: the mean of the last {LAST_EPISODES} training episodes. CleanRL's "
        f"Humanoid-v4 at 1M steps: {mean:.2f} ± {spread:.2f}; the table's target, its mean - "
        f"std: {mean - spread:.2f}.\n",
        "| rollout | seeds | final returns | mean ± std | median | seeds 1-3 mean |",
        "|---|---|---|---|---|---|",
    ]
    for label, values in finals.items():
        seeds = [row["seed"] for row in rows if row["mode"] == label]
        first_three = [v for s, v in zip(seeds, values) if s <= 3]
        first_three_mean = f"{np.mean(first_three):.1f}" if first_three else ""
        lines.append(
            f"| {label} | {len(values)} | {', '.join(f'{v:.0f}' for v in values)} | "
            f"{values.mean():.1f} ± {values.std():.1f} | {np.median(values):.1f} | "
            f"{first_three_mean} |"
        )
    if all(len(values) >= 2 for values in finals.values()):
        compiled = finals["compiled"]
        python = finals["python"]
        low, high = bootstrap_interval(compiled, python)
        lines.append(
            f"\nDifference of the means, compiled - python: {compiled.mean() - python.mean():.1f} "
            f"(95 % bootstrap interval {low:.1f} to {high:.1f}; Welch's t "
            f"{welch_t(compiled, python):.2f})."
        )
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n\n![runs](humanoid_seeds_cpu.png)\n")
    figure, (curves, points) = plt.subplots(1, 2, figsize=(13, 4.5))
    for color, label in zip(["C0", "C1"], LABELS):
        for index, run_dir in enumerate(finished(work_dir, label)):
            returns = scalar(run_dir, "charts/episodic_return")
            steps = [step for step, _ in returns]
            values = [value for _, value in returns]
            window = np.convolve(values, np.ones(LAST_EPISODES) / LAST_EPISODES, mode="valid")
            curves.plot(
                steps[LAST_EPISODES - 1 :],
                window,
                color=color,
                alpha=0.6,
                label=label if index == 0 else None,
            )
        points.scatter([label] * len(finals[label]), finals[label], color=color)
    for axis in (curves, points):
        axis.axhline(mean - spread, color="gray", linestyle="--", label="CleanRL's mean - std")
    curves.set_xlabel("environment steps")
    curves.set_ylabel(f"mean of the last {LAST_EPISODES} training returns")
    curves.legend(fontsize=8)
    points.set_ylabel("final return")
    figure.suptitle("Humanoid-v4, continuous PPO defaults, 1M steps")
    figure.tight_layout()
    figure.savefig(OUT.with_suffix(".png"), dpi=110)
    print(OUT.with_suffix(".md").read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", choices=list(LABELS))
    parser.add_argument("--checkout", type=Path, default=REPO)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(1, 11)))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cleanba_humanoid_seeds"))
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--note", default="", help="how the machine was shared, for the report")
    options = parser.parse_args()
    if not options.report_only:
        if options.label is None:
            parser.error("--label is needed to run (or --report-only)")
        (options.work_dir / "runs").mkdir(parents=True, exist_ok=True)
        for seed in options.seeds:
            run(options.label, options.checkout, seed, options.work_dir)
    note = f"Made by `{command_line(sys.argv)}`. {options.note}".strip()
    report(options.work_dir, note)


if __name__ == "__main__":
    main()
