"""Learning at published budgets on a CPU: Cleanba's discrete scripts on gymnax's MinAtar games,
stepped inside the actor's compiled rollout, against the published PPO and DQN figures.

    python benchmark/learning_minatar_cpu.py                  # every run in order, then the report
    python benchmark/learning_minatar_cpu.py --runs ppo_breakout_s1 ppo_space_invaders_s1
    python benchmark/learning_minatar_cpu.py --report-only    # the report from the runs so far

A finished run is never rerun; one stopped before its end continues from its newest checkpoint, so
the runs can be made over several sittings (on a JAX environment every script resumes bit for bit).
The runs go one at a time under `nice -n 10`, in --work-dir. Writes
benchmark/results/learning_minatar_cpu.md (the table, the exact commands, the published figures),
learning_minatar_cpu.png and learning_minatar_cpu.csv (one row per run).

The runs, in order:
- PPO, 10M steps on each game (seeds 1-3 on Breakout and SpaceInvaders), with PureJaxRL's MinAtar
  settings (`examples/brax_minatar.ipynb`: 64 environments x 128 steps, 4 epochs of 8 minibatches,
  lr 5e-3 annealed to 0, clip 0.2, gamma 0.99, GAE lambda 0.95, entropy 0.01, value 0.5, gradient
  norm 0.5), Sync (policy lag 0), with Young & Tian's (2019) MinAtar network (one 3x3 convolution of
  16 channels, a dense layer of 128: the script's default for small images) where PureJaxRL
  flattens the image into an MLP of 64 x 64.
- PPO again on every game with MinAtar as Young & Tian (2019) and pgx play it: sticky actions of
  0.1 (`--env-params sticky_action_prob=0.1`) and no cap on an episode's length.
- IMPALA, 10M steps on Breakout and SpaceInvaders, the script's defaults (the paper's: 2 x 64
  environments, unrolls of 20, 4 minibatches, RMSProp at 6e-4 annealed; lag 1) with the same
  network.
- Ape-X DQN, 5M steps on Breakout, Young & Tian's budget (5M frames: MinAtar has no frame skip),
  the script's defaults (Ape-X's) but its replay, Young & Tian's 100,000 transitions, on their
  environment (sticky actions, no cap).
- GALA-A2C, 10M steps on Breakout, its defaults (4 agents x 16 environments, 5-step returns), with
  sync gossip (the script's default) and with an all-reduce of the gradients.
"""

import csv
import json
import platform
import sys
from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from csv_columns import RUN_COLUMNS
from measure import code_of_runs, resumable_benchmark_options, run_resumable

from cleanba_utils.experiments.events import read_scalars, running_mean

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from test_learning import APEX_DPG_PENDULUM, PPO_CONTINUOUS_PENDULUM, SAC_PENDULUM  # noqa: E402

GAMES = {
    "breakout": "Breakout-MinAtar",
    "space_invaders": "SpaceInvaders-MinAtar",
    "asterix": "Asterix-MinAtar",
    "freeway": "Freeway-MinAtar",
    "seaquest": "Seaquest-MinAtar",
}
PUREJAXRL_SETTINGS = [
    *["--local-num-envs", "64", "--num-actor-threads", "1", "--num-steps", "128"],
    *["--update-epochs", "4", "--num-minibatches", "8", "--learning-rate", "5e-3"],
    *["--clip-coef", "0.2", "--gamma", "0.99", "--gae-lambda", "0.95", "--ent-coef", "0.01"],
    *["--vf-coef", "0.5", "--max-grad-norm", "0.5", "--gradient-accumulation-steps", "1"],
]
YOUNG_TIAN_REPLAY = ["--buffer-size", "100000"]


def young_tian_env(game: str) -> list[str]:
    """MinAtar as Young & Tian (2019) played it, and pgx's MinAtar by default: sticky actions of
    0.1 and no cap on an episode's length (Freeway's 2,500 steps are its game's own end)."""
    no_cap = [] if game == "freeway" else ["max_steps_in_episode=100000"]
    return ["--env-params", "sticky_action_prob=0.1", *no_cap]


class Run(NamedTuple):
    script: str
    mode: str
    """the CSV's mode column"""
    env_id: str
    seed: int
    steps: int
    options: list
    last_n: int = 100
    """the episodes whose mean return is the run's score"""


def minatar(game: str) -> str:
    return f"gymnax:{GAMES[game]}"


# The order of the runs: PPO on seed 1 of every game, seeds 2 and 3 of Breakout and
# SpaceInvaders, then the other scripts.
RUNS = {
    f"ppo_{game}_s{seed}": Run(
        "cleanba_ppo", "sync", minatar(game), seed, 10_000_000, PUREJAXRL_SETTINGS
    )
    for game, seed in [
        ("breakout", 1),
        ("space_invaders", 1),
        ("asterix", 1),
        ("freeway", 1),
        ("seaquest", 1),
        ("breakout", 2),
        ("space_invaders", 2),
        ("breakout", 3),
        ("space_invaders", 3),
    ]
}
RUNS |= {
    f"ppo_{game}_sticky_s1": Run(
        "cleanba_ppo",
        "sync",
        minatar(game),
        1,
        10_000_000,
        [*PUREJAXRL_SETTINGS, *young_tian_env(game)],
    )
    for game in GAMES
}
RUNS |= {
    f"impala_{game}_s1": Run("cleanba_impala", "async", minatar(game), 1, 10_000_000, [])
    for game in ("breakout", "space_invaders")
}
RUNS["apex_dqn_breakout_s1"] = Run(
    "cleanba_apex_dqn",
    "async",
    minatar("breakout"),
    1,
    5_000_000,
    [*YOUNG_TIAN_REPLAY, *young_tian_env("breakout")],
)
RUNS["gala_gossip_breakout_s1"] = Run(
    "cleanba_gala_a2c", "gossip", minatar("breakout"), 1, 10_000_000, []
)
RUNS["gala_allreduce_breakout_s1"] = Run(
    "cleanba_gala_a2c", "allreduce", minatar("breakout"), 1, 10_000_000, ["--topology", "allreduce"]
)


def without(options: list[str], *flags: str) -> list[str]:
    """`options` less the `flags` and their values (which `command_of` sets)."""
    kept = []
    skip_value = False
    for word in options:
        if skip_value:
            skip_value = False
        elif word in flags:
            skip_value = True
        else:
            kept.append(word)
    return kept


# The continuous scripts on Pendulum-v1 at their learning tests' settings (tests/test_learning.py),
# gymnax's and envpool's side by side: the same task from either source.
PENDULUM = {
    "sac": ("cleanba_sac", "async", 20_000, SAC_PENDULUM),
    "apex_dpg": ("cleanba_apex_dpg", "async", 20_000, APEX_DPG_PENDULUM),
    "ppo_continuous": ("cleanba_ppo_continuous", "sync", 1_000_000, PPO_CONTINUOUS_PENDULUM),
}
RUNS |= {
    f"{name}_pendulum_{source}_s{seed}": Run(
        script,
        mode,
        env_id,
        seed,
        steps,
        without(options.split(), "--env-id", "--total-timesteps", "--log-frequency"),
        last_n=20,
    )
    for name, (script, mode, steps, options) in PENDULUM.items()
    for source, env_id in [("gymnax", "gymnax:Pendulum-v1"), ("envpool", "Pendulum-v1")]
    for seed in (1, 2, 3)
}
# Published final returns (see the report for what each environment and budget is).
PUBLISHED = {
    "Asterix-MinAtar": ("15", "–", "≈ 22–25", "≈ 17 / ≈ 19"),
    "Breakout-MinAtar": ("28 (43 at lr 1e-3)", "≈ 40", "≈ 50", "≈ 10 / ≈ 17.5"),
    "Freeway-MinAtar": ("58", "–", "≈ 63", "≈ 50 / ≈ 47"),
    "Seaquest-MinAtar": ("–", "–", "≈ 54", "≈ 20 / ≈ 16"),
    "SpaceInvaders-MinAtar": ("131", "≈ 170", "≈ 145", "≈ 43 / ≈ 185"),
}


def command_of(name: str) -> list[str]:
    run = RUNS[name]
    return [
        f"cleanba/{run.script}.py",
        *run.options,
        *["--env-id", run.env_id, "--total-timesteps", str(run.steps)],
        *["--seed", str(run.seed), "--run-name", name, "--checkpoint-every", "100"],
        *["--log-frequency", "50"],
    ]


# The published figures that PPO's results compare with at the same environment settings (numbers of
# `PUBLISHED`): gymnax-blines' and PureJaxRL's on gymnax's MinAtar (no sticky actions, episodes
# capped), pgx's and Young & Tian's on MinAtar with sticky actions of 0.1 and no cap.
GYMNAX_SETTINGS = {
    "Asterix-MinAtar": {"gymnax-blines PPO": 15},
    "Breakout-MinAtar": {"gymnax-blines PPO": 28, "PureJaxRL PPO": 40},
    "Freeway-MinAtar": {"gymnax-blines PPO": 58},
    "Seaquest-MinAtar": {},
    "SpaceInvaders-MinAtar": {"gymnax-blines PPO": 131, "PureJaxRL PPO": 170},
}
STICKY_SETTINGS = {
    "Asterix-MinAtar": {"pgx PPO (20M)": 22, "Young & Tian AC(λ) (5M)": 19},
    "Breakout-MinAtar": {"pgx PPO (20M)": 50, "Young & Tian AC(λ) (5M)": 17.5},
    "Freeway-MinAtar": {"pgx PPO (20M)": 63, "Young & Tian AC(λ) (5M)": 47},
    "Seaquest-MinAtar": {"pgx PPO (20M)": 54, "Young & Tian AC(λ) (5M)": 16},
    "SpaceInvaders-MinAtar": {"pgx PPO (20M)": 145, "Young & Tian AC(λ) (5M)": 185},
}
YOUNG_TIAN_DQN = {"Breakout-MinAtar": 10}


def comparison(rows: list[dict]) -> list[str]:
    """The written comparison: each finished result beside the published figures of the same
    environment settings (above or below each), the mean over seeds where there are several."""
    lines = []

    def finished(script: str, env_id: str, sticky: bool) -> list[float]:
        return [
            r["final_return"]
            for r in rows
            if r["script"] == script
            and r["env_id"] == env_id
            and r["finished"]
            and r["sticky"] == sticky
        ]

    def line(what: str, scores: list[float], published: dict) -> str:
        mean = sum(scores) / len(scores)
        seeds = f"{len(scores)} seeds" if len(scores) > 1 else "1 seed"
        beside = "; ".join(
            f"{'above' if mean >= figure else 'BELOW'} {name}'s {figure}"
            for name, figure in published.items()
        )
        return (
            f"- {what}: {mean:.1f} ({seeds}): {beside or 'no published figure at these settings'}."
        )

    for game, published in GYMNAX_SETTINGS.items():
        scores = finished("cleanba_ppo", f"gymnax:{game}", sticky=False)
        if scores:
            lines.append(line(f"PPO, {game}, gymnax's settings", scores, published))
    for game, published in STICKY_SETTINGS.items():
        scores = finished("cleanba_ppo", f"gymnax:{game}", sticky=True)
        if scores:
            lines.append(line(f"PPO, {game}, sticky actions, no cap", scores, published))
    for script, _, _, _ in PENDULUM.values():
        by_source = {
            source: [
                r["final_return"]
                for r in rows
                if r["script"] == script and r["env_id"] == env_id and r["finished"]
            ]
            for source, env_id in [("gymnax", "gymnax:Pendulum-v1"), ("envpool", "Pendulum-v1")]
        }
        if all(by_source.values()):
            means = {source: sum(v) / len(v) for source, v in by_source.items()}
            lines.append(
                f"- {script}, Pendulum-v1: gymnax's {means['gymnax']:.1f} "
                f"({len(by_source['gymnax'])} seeds), envpool's {means['envpool']:.1f} "
                f"({len(by_source['envpool'])} seeds): the same task from either source (a learned "
                "policy scores about -150 to -200, a random one about -1,200)."
            )
    for game, figure in YOUNG_TIAN_DQN.items():
        scores = finished("cleanba_apex_dqn", f"gymnax:{game}", sticky=True)
        if scores:
            lines.append(line(f"Ape-X DQN, {game}", scores, {"Young & Tian DQN (5M)": figure}))
    return lines


def report(work_dir: Path, out_dir: Path, date: str, note: str):
    rows = []
    curves = {}
    for name, run in RUNS.items():
        run_dir = work_dir / "runs" / name
        if not (run_dir / "spec.json").exists():
            continue
        logged = read_scalars(run_dir)
        if not len(logged.steps):
            continue
        env_id = run.env_id
        curve = dict(
            steps=logged.steps,
            scores=running_mean(logged.values, run.last_n),
            env_id=env_id,
            run=run,
        )
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        steps = summary["global_step"] if summary else int(logged.steps[-1])
        wall_time_s = summary["wall_time_s"] if summary else float(logged.wall_times[-1])
        curves[name] = curve
        rows.append(
            dict(
                script=run.script,
                mode=run.mode,
                env_id=env_id,
                seed=run.seed,
                steps=steps,
                final_return=round(float(curve["scores"][-1]), 2),
                eval_return="",
                sps=int(steps / wall_time_s),
                wall_time_s=round(wall_time_s),
                finished=summary is not None,
                score_episodes=run.last_n,
                sticky=any(option.startswith("sticky_action_prob=") for option in run.options),
            )
        )
    with open(out_dir / "learning_minatar_cpu.csv", "w", newline="") as f:
        writer = csv.DictWriter(
            f, fieldnames=[*RUN_COLUMNS, "finished", "score_episodes", "sticky"]
        )
        writer.writeheader()
        writer.writerows(rows)
    games = sorted({r["env_id"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(games)), figsize=(4.2 * max(1, len(games)), 3.8))
    axes = axes if len(games) > 1 else [axes]
    for ax, env_id in zip(axes, games):
        for curve in curves.values():
            if curve["env_id"] == env_id:
                run = curve["run"]
                ax.plot(
                    curve["steps"],
                    curve["scores"],
                    label=f"{run.script.removeprefix('cleanba_')} {run.mode}, seed {run.seed}",
                )
        ax.set(
            title=env_id,
            xlabel="environment steps",
            ylabel="return (running mean of episodes)",
        )
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "learning_minatar_cpu.png", dpi=110)
    plt.close(fig)
    table = [
        "| script | mode | environment | seed | steps | final return (mean of the last N "
        "episodes) | N | SPS | wall time (min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    table += [
        f"| {r['script']} | {r['mode']} | {r['env_id']} | {r['seed']} "
        f"| {r['steps']:,}{'' if r['finished'] else ' (stopped)'} "
        f"| {r['final_return']:.1f} | {r['score_episodes']} | {r['sps']:,} "
        f"| {r['wall_time_s'] / 60:.0f} |"
        for r in rows
    ]
    published = [
        "| game | gymnax-blines PPO, 10M | PureJaxRL PPO, 10M | pgx PPO, 20M | Young & Tian DQN / "
        "AC(λ), 5M frames |",
        "|---|---|---|---|---|",
    ]
    published += [f"| {game} | {' | '.join(values)} |" for game, values in PUBLISHED.items()]
    made = [name for name in RUNS if (work_dir / "runs" / name).is_dir()]
    commands = "\n".join("python " + " ".join(command_of(name)) for name in made)
    pending = [name for name in RUNS if name not in made]
    to_come = f"\n\nNot run yet: {', '.join(pending)}."
    (out_dir / "learning_minatar_cpu.md").write_text(
        f"# MinAtar learning on a CPU ({date})\n\n"
        f"Machine: {platform.machine()}, 2 CPU cores, 24 GiB, Python "
        f"{platform.python_version()}. Code and libraries of the runs (their spec files): "
        f"{code_of_runs([work_dir / 'runs' / name for name in made])}. Made by `python "
        "benchmark/learning_minatar_cpu.py`, which runs (from the repository root, one at a time "
        "under `nice -n 10`):"
        f"\n\n```\n{commands}\n```\n\n"
        + "\n".join(table)
        + (to_come if pending else "")
        + (f"\n\n{note}" if note else "")
        + "\n\n## Beside the published figures\n\n"
        "Each finished result beside the published figures of the same environment settings "
        "(`GYMNAX_SETTINGS`, `STICKY_SETTINGS` and `YOUNG_TIAN_DQN` in the script; pgx's and Young "
        "& Tian's read from their plots):\n\n"
        + ("\n".join(comparison(rows)) or "(none finished yet)")
        + "\n\n"
        "## Published figures\n\n" + "\n".join(published) + "\n\n"
        "gymnax-blines' figures are those gymnax 1.0.1's README lists (R: 15, 28, 58, –, 131; "
        "checked in the installed package's metadata); the others are read from plots "
        "(PureJaxRL's `examples/brax_minatar.ipynb`, pgx's `examples/minatar-ppo` figures, Young & "
        "Tian's learning curves) and are approximate. gymnax-blines and PureJaxRL play gymnax's "
        "MinAtar (no sticky actions, episodes cut at 1,000 steps, Freeway's 2,500); pgx and Young "
        "& Tian play MinAtar with sticky actions of 0.1 (pgx's MinAtar environments' default) and "
        "no cap.\n\n"
        "![MinAtar](learning_minatar_cpu.png)\n"
    )
    print((out_dir / "learning_minatar_cpu.md").read_text())


def main():
    args = resumable_benchmark_options(
        __doc__.splitlines()[0], list(RUNS), "/tmp/cleanba_learning_minatar_cpu"
    )
    if not args.report_only:
        for name in args.runs:
            if (args.work_dir / "runs" / name / "summary.json").exists():
                print(f"{name}: already run", flush=True)
                continue
            run_resumable(name, command_of(name), args.work_dir, REPO)
    report(args.work_dir, args.out_dir, args.date, args.note)


if __name__ == "__main__":
    sys.exit(main())
