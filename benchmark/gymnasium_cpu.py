"""Gymnasium's environments on a CPU: what they learn and what they cost beside envpool's.

    uv run --with minatar==1.0.15 python benchmark/gymnasium_cpu.py  # everything, in order
    uv run --with minatar==1.0.15 python benchmark/gymnasium_cpu.py --runs speed
    uv run --with minatar==1.0.15 python benchmark/gymnasium_cpu.py --report-only

A finished run is never rerun; one stopped before its end continues from its newest checkpoint, so
the runs can be made over several sittings. The runs go one at a time under `nice -n 10`, in
--work-dir. Writes benchmark/results/gymnasium_cpu.md (the tables, the exact commands, the published
figures), gymnasium_cpu.png and gymnasium_cpu.csv (one row per learning run).

In order:
- `speed`: HalfCheetah-v5 through envpool and through Gymnasium's sync and async vector
  environments, side by side: the environments alone (8 of them, random actions) and whole runs of
  continuous PPO at its defaults (200k steps, start and compilation included).
- continuous PPO, 1M steps, seeds 1-3, at its defaults, on HalfCheetah-v5 and Hopper-v5 through
  Gymnasium (`gymnasium[mujoco]`) and through envpool (1.2.5 has the same -v5 tasks): the same
  tasks from either source, beside CleanRL's `ppo_continuous_action.py` figures (on -v4).
- PPO, 5M steps, on MinAtar's Breakout as the `minatar` package (1.0.15) registers it for Gymnasium
  (`MinAtar/Breakout-v1`: sticky actions of 0.1, no cap on an episode's length, the minimal action
  set), a discrete task that envpool does not list; Young & Tian's (2019) budget and environment,
  beside their figures. The settings are `learning_minatar_cpu.py`'s (PureJaxRL's MinAtar settings,
  Young & Tian's network), so the run also stands beside that benchmark's gymnax run of the same
  game with sticky actions.
- SAC, 1M steps, seeds 1-2, at its defaults (CleanRL's hyperparameters) on HalfCheetah-v5 through
  Gymnasium, beside CleanRL's `sac_continuous_action.py` figure (on -v4).
"""

import csv
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from csv_columns import RUN_COLUMNS
from learning_minatar_cpu import PUREJAXRL_SETTINGS
from measure import code_of_runs, resumable_benchmark_options, run_resumable

from cleanba_utils.experiments.events import read_scalars, running_mean

REPO = Path(__file__).resolve().parents[1]
MINATAR_FACTORY = "gymnasium:gymnasium_minatar:breakout"
"""`benchmark/gymnasium_minatar.py`'s factory of the minatar package's Breakout"""


class Run(NamedTuple):
    script: str
    env_id: str
    seed: int
    steps: int
    options: list[str]


RUNS = {}
for seed in (1, 2, 3):
    for task in ("HalfCheetah-v5", "Hopper-v5"):
        for source, env_id in [("gymnasium", f"gymnasium:{task}"), ("envpool", task)]:
            name = f"ppo_continuous_{task.split('-')[0].lower()}_{source}_s{seed}"
            RUNS[name] = Run("cleanba_ppo_continuous", env_id, seed, 1_000_000, [])
RUNS["ppo_minatar_breakout_gymnasium_s1"] = Run(
    "cleanba_ppo", MINATAR_FACTORY, 1, 5_000_000, PUREJAXRL_SETTINGS
)
for seed in (1, 2):
    RUNS[f"sac_halfcheetah_gymnasium_s{seed}"] = Run(
        "cleanba_sac", "gymnasium:HalfCheetah-v5", seed, 1_000_000, []
    )
LAST_EPISODES = 100

# Published figures: CleanRL's documentation (ppo_continuous_action.py and sac_continuous_action.py,
# 1M steps, the -v4 tasks, mean ± std over seeds of the final returns), as the other MuJoCo reports
# quote them; Young & Tian (2019), Breakout at 5M frames, read from their learning curves.
CLEANRL = {
    ("cleanba_ppo_continuous", "HalfCheetah"): "CleanRL PPO 1443 ± 46 (HalfCheetah-v4)",
    ("cleanba_ppo_continuous", "Hopper"): "CleanRL PPO 2383 ± 272 (Hopper-v4)",
    ("cleanba_sac", "HalfCheetah"): "CleanRL SAC 9635 ± 1424 (HalfCheetah-v4)",
}
YOUNG_TIAN_BREAKOUT = "DQN ≈ 10, AC(λ) ≈ 17.5 (5M frames, read from their plot)"

SPEED_TASK = "HalfCheetah-v5"
SPEED_ENVS = 8
SPEED_STEPS = 200_000
SPEED_SOURCES = {
    "envpool": SPEED_TASK,
    "gymnasium sync": f"gymnasium:{SPEED_TASK}",
    "gymnasium async": f"gymnasium:{SPEED_TASK}",
}


def command_of(name: str) -> list[str]:
    run = RUNS[name]
    return [
        f"cleanba/{run.script}.py",
        *run.options,
        *["--env-id", run.env_id, "--total-timesteps", str(run.steps)],
        *["--seed", str(run.seed), "--run-name", name, "--checkpoint-every", "50"],
        *["--log-frequency", "50"],
    ]


def speed_command(source: str) -> list[str]:
    mode = ["--vectorization-mode", "async"] if source.endswith("async") else []
    name = "speed_" + source.replace(" ", "_")
    return [
        "cleanba/cleanba_ppo_continuous.py",
        *["--env-id", SPEED_SOURCES[source], *mode, "--total-timesteps", str(SPEED_STEPS)],
        *["--run-name", name, "--log-frequency", "50"],
    ]


def environments_alone(source: str, steps: int = 20_000) -> float:
    """Steps per second of SPEED_ENVS environments stepped with random actions in a loop, the
    first 200 steps (starting, warming) not counted."""
    if source == "envpool":
        import envpool

        envs = envpool.make(SPEED_TASK, env_type="gymnasium", num_envs=SPEED_ENVS, seed=1)
    else:
        from cleanba_utils.gymnasium_envs import GymnasiumVectorEnv

        mode = source.split()[-1]
        envs = GymnasiumVectorEnv(SPEED_SOURCES[source], 1, SPEED_ENVS, mode)
    envs.reset()
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, (steps + 200, SPEED_ENVS, 6)).astype(np.float32)
    for step in range(steps + 200):
        if step == 200:
            start = time.perf_counter()
        envs.step(actions[step])
    seconds = time.perf_counter() - start
    envs.close()
    return steps * SPEED_ENVS / seconds


def measure_speed(work_dir: Path) -> dict:
    """The speed section's figures (kept in --work-dir/speed.json: measured once)."""
    path = work_dir / "speed.json"
    if path.exists():
        return json.loads(path.read_text())
    figures = {"environments alone": {}, "whole run": {}}
    for source in SPEED_SOURCES:
        figures["environments alone"][source] = round(environments_alone(source))
        print(f"speed, {source}, environments alone: {figures['environments alone'][source]}")
    for source in SPEED_SOURCES:
        command = speed_command(source)
        name = command[command.index("--run-name") + 1]
        run_resumable(name, command, work_dir, REPO)
        summary = json.loads((work_dir / "runs" / name / "summary.json").read_text())
        figures["whole run"][source] = round(summary["global_step"] / summary["wall_time_s"])
        print(f"speed, {source}, whole run: {figures['whole run'][source]}")
    figures["measured"] = time.strftime("%Y-%m-%d %H:%M")
    path.write_text(json.dumps(figures, indent=1))
    return figures


def row_of(name: str, run: Run, work_dir: Path):
    run_dir = work_dir / "runs" / name
    if not (run_dir / "spec.json").exists():
        return None, None
    logged = read_scalars(run_dir)
    if not len(logged.steps):
        return None, None
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    steps = summary["global_step"] if summary else int(logged.steps[-1])
    wall_time_s = summary["wall_time_s"] if summary else float(logged.wall_times[-1])
    scores = running_mean(logged.values, LAST_EPISODES)
    row = dict(
        script=run.script,
        mode="defaults" if not run.options else "purejaxrl_minatar",
        env_id=run.env_id,
        seed=run.seed,
        steps=steps,
        final_return=round(float(scores[-1]), 2),
        eval_return="",
        sps=int(steps / wall_time_s),
        wall_time_s=round(wall_time_s),
        finished=summary is not None,
    )
    return row, (logged.steps, scores)


def task_of(env_id: str) -> str:
    if env_id == MINATAR_FACTORY:
        return "MinAtar Breakout"
    return env_id.removeprefix("gymnasium:").split("-")[0]


def source_of(env_id: str) -> str:
    return "Gymnasium" if env_id.startswith("gymnasium:") else "envpool"


def summary_lines(rows: list[dict]) -> list[str]:
    """Per script, task and source: the finished seeds' mean ± std, beside the published figure."""
    groups = {}
    for r in rows:
        if r["finished"]:
            key = (r["script"], task_of(r["env_id"]), source_of(r["env_id"]))
            groups.setdefault(key, []).append(r["final_return"])
    lines = [
        "| script | task | source | finished seeds | final return, mean ± std | published |",
        "|---|---|---|---|---|---|",
    ]
    for (script, task, source), scores in sorted(groups.items()):
        published = CLEANRL.get((script, task), YOUNG_TIAN_BREAKOUT if "MinAtar" in task else "–")
        lines.append(
            f"| {script} | {task} | {source} | {len(scores)} "
            f"| {np.mean(scores):.1f} ± {np.std(scores):.1f} | {published} |"
        )
    return lines


def report(work_dir: Path, out_dir: Path, date: str, note: str):
    rows = []
    curves = {}
    for name, run in RUNS.items():
        row, curve = row_of(name, run, work_dir)
        if row is not None:
            rows.append(row)
            curves[name] = (run, curve)
    with open(out_dir / "gymnasium_cpu.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*RUN_COLUMNS, "finished"])
        writer.writeheader()
        writer.writerows(rows)
    panels = sorted({(r["script"], task_of(r["env_id"])) for r in rows})
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.4 * max(1, len(panels)), 3.8))
    axes = np.atleast_1d(axes)
    for ax, (script, task) in zip(axes, panels):
        for run, (steps, scores) in curves.values():
            if (run.script, task_of(run.env_id)) == (script, task):
                ax.plot(steps, scores, label=f"{source_of(run.env_id)}, seed {run.seed}")
        ax.set(
            title=f"{script.removeprefix('cleanba_')}, {task}",
            xlabel="environment steps",
            ylabel=f"return (mean of the last {LAST_EPISODES} episodes)",
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "gymnasium_cpu.png", dpi=110)
    plt.close(fig)
    table = [
        "| script | environment | seed | steps | final return | SPS | wall time (min) |",
        "|---|---|---|---|---|---|---|",
    ]
    table += [
        f"| {r['script']} | {r['env_id']} | {r['seed']} "
        f"| {r['steps']:,}{'' if r['finished'] else ' (stopped)'} | {r['final_return']:.1f} "
        f"| {r['sps']:,} | {r['wall_time_s'] / 60:.0f} |"
        for r in rows
    ]
    speed_path = work_dir / "speed.json"
    speed = json.loads(speed_path.read_text()) if speed_path.exists() else None
    speed_section = "(not measured yet)"
    if speed:
        speed_lines = [
            "| source | environments alone (steps/s) | whole run (steps/s) |",
            "|---|---|---|",
        ]
        speed_lines += [
            f"| {source} | {speed['environments alone'][source]:,} "
            f"| {speed['whole run'][source]:,} |"
            for source in SPEED_SOURCES
        ]
        speed_section = (
            f"{SPEED_TASK}, {SPEED_ENVS} environments (measured {speed['measured']}). "
            "Environments alone: 20,000 steps of random actions in a loop (envpool's `step`, "
            "`GymnasiumVectorEnv.step`). Whole run: continuous PPO at its defaults, "
            f"{SPEED_STEPS:,} steps, start and compilation included (`global_step` / wall time "
            "of its summary); on envpool the policy and the environments step in one compiled "
            "program, on Gymnasium in Python, step by step:\n\n"
            + "\n".join(speed_lines)
            + "\n\n```\n"
            + "\n".join("python " + " ".join(speed_command(s)) for s in SPEED_SOURCES)
            + "\n```"
        )
    made = [name for name in RUNS if (work_dir / "runs" / name).is_dir()]
    pending = [name for name in RUNS if name not in made]
    speed_runs = [run.name for run in (work_dir / "runs").glob("speed_*")] if speed else []
    commands = "\n".join("python " + " ".join(command_of(name)) for name in made)
    (out_dir / "gymnasium_cpu.md").write_text(
        f"# Gymnasium's environments on a CPU ({date})\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python "
        f"{platform.python_version()}. Code and libraries of the runs (their spec files): "
        f"{code_of_runs([work_dir / 'runs' / name for name in [*made, *speed_runs]])}. Made by "
        "`uv run --with minatar==1.0.15 python "
        "benchmark/gymnasium_cpu.py`, which runs, from the repository root, one at a time under "
        "`nice -n 10`, with `PYTHONPATH=benchmark` for the MinAtar factory:"
        f"\n\n```\n{commands}\n```\n\n"
        "## Speed: envpool, Gymnasium sync and async\n\n"
        f"{speed_section}\n\n"
        "## Learning\n\n"
        f"Final return: the mean of the last {LAST_EPISODES} training episodes.\n\n"
        + "\n".join(summary_lines(rows))
        + "\n\n"
        + "\n".join(table)
        + (f"\n\nNot run yet: {', '.join(pending)}." if pending else "")
        + (f"\n\n{note}" if note else "")
        + "\n\nCleanRL's figures are on the -v4 tasks, which Gymnasium's -v5 revise (fixes and "
        "new options of the models), so they stand beside, not against, these; the Gymnasium "
        "and envpool runs play the same -v5 task. Young & Tian played "
        "MinAtar with sticky actions of 0.1 and no cap, as `MinAtar/Breakout-v1` does.\n\n"
        "![Gymnasium](gymnasium_cpu.png)\n"
    )
    print((out_dir / "gymnasium_cpu.md").read_text())


def main():
    args = resumable_benchmark_options(
        __doc__.splitlines()[0], ["speed", *RUNS], "/tmp/cleanba_gymnasium_cpu"
    )
    # The MinAtar factory's module, for the runs (children inherit it).
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO / "benchmark"), os.environ.get("PYTHONPATH")])
    )
    if not args.report_only:
        for name in args.runs:
            if name == "speed":
                measure_speed(args.work_dir)
            elif (args.work_dir / "runs" / name / "summary.json").exists():
                print(f"{name}: already run", flush=True)
            else:
                run_resumable(name, command_of(name), args.work_dir, REPO)
    report(args.work_dir, args.out_dir, args.date, args.note)


if __name__ == "__main__":
    sys.exit(main())
