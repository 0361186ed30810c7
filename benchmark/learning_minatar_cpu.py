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
  network; then, since those do not learn, 2M steps on Breakout with the defaults and with RMSProp
  changed one way each (a learning rate ten times larger; epsilon 1e-5 and 1e-8; epsilon and the
  gradient's clip of the IMPALA paper's summed loss, rescaled to a mean over the minibatch's 640
  steps: 0.01 / 640² and 40 / 640; epsilon 1e-8 with an entropy cost ten times smaller, a learning
  rate five times larger, no lag (Sync) or rollouts of 128 steps), and 10M steps on both games with
  epsilon 1e-8.
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
import numpy as np
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
    """the CSV's mode column (with the options that set the run apart from its script's others)"""
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
# IMPALA's RMSProp beside its defaults: 2M steps on Breakout, one change each, then 10M on both
# games with the epsilon that learns.
IMPALA_RMSPROP = {
    "defaults": [],
    "lr6e-3": ["--learning-rate", "6e-3"],
    "eps1e-5": ["--rmsprop-eps", "1e-5"],
    "eps1e-8": ["--rmsprop-eps", "1e-8"],
    "summed_loss": ["--rmsprop-eps", "2.44e-8", "--max-grad-norm", "0.0625"],
    "eps1e-8_ent1e-3": ["--rmsprop-eps", "1e-8", "--ent-coef", "1e-3"],
    "eps1e-8_lr3e-3": ["--rmsprop-eps", "1e-8", "--learning-rate", "3e-3"],
    "eps1e-8_sync": ["--rmsprop-eps", "1e-8", "--no-concurrency"],
    "eps1e-8_steps128": ["--rmsprop-eps", "1e-8", "--num-steps", "128"],
}
RUNS |= {
    f"impala_breakout_2m_{name}_s1": Run(
        "cleanba_impala",
        " ".join(["async", *options]),
        minatar("breakout"),
        1,
        2_000_000,
        options,
    )
    for name, options in IMPALA_RMSPROP.items()
}
RUNS |= {
    f"impala_{game}_eps1e-8_s1": Run(
        "cleanba_impala",
        "async --rmsprop-eps 1e-8",
        minatar(game),
        1,
        10_000_000,
        IMPALA_RMSPROP["eps1e-8"],
    )
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


def impala_probes(rows: list[dict]) -> list[str]:
    """The 2M runs of IMPALA on Breakout, each as its options and final return."""
    return [
        f"{r['mode'].removeprefix('async').strip() or 'the defaults'} {r['final_return']:.1f}"
        for r in rows
        if r["script"] == "cleanba_impala" and r["steps"] <= 2_000_000 and r["finished"]
    ]


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


def second_moments(tree, inside_nu: bool = False) -> list:
    """The leaves under every `nu` key of a checkpoint's optimizer state (RMSProp's ν), flat."""
    if not isinstance(tree, dict):
        return [np.asarray(tree).ravel()] if inside_nu else []
    return [
        leaf
        for key, value in tree.items()
        for leaf in second_moments(value, inside_nu or key == "nu")
    ]


def rmsprop_scale(work_dir: Path) -> list[str]:
    """What RMSProp divides the gradients of IMPALA's runs at their defaults by, read from their
    newest checkpoints: the root of its mean square ν per parameter against √ε = 0.1."""
    from cleanba_utils.checkpoints import newest_checkpoint

    lines = []
    for name in ("impala_breakout_s1", "impala_space_invaders_s1"):
        run_dir = work_dir / "runs" / name
        if not (run_dir / "summary.json").exists():
            continue
        path, saved = newest_checkpoint(str(run_dir))
        opt_state = saved["state"]["learner"]["opt_state"]
        root = np.sqrt(np.concatenate(second_moments(opt_state)))
        lines.append(
            f"- {name}, {Path(path).name}: √ν of its {root.size:,} parameters: median "
            f"{np.median(root):.1e}, 99th percentile {np.percentile(root, 99):.1e}, largest "
            f"{root.max():.1e}; {100 * np.mean(root < 0.1):.3f} % below √ε = 0.1."
        )
    return lines


def entropy_drift(work_dir: Path) -> list[str]:
    """How the policy's entropy and policy-gradient loss of IMPALA's 10M runs with epsilon 1e-8 went
    (TensorBoard's `losses/`): their first and last logged values."""
    lines = []
    for name in ("impala_breakout_eps1e-8_s1", "impala_space_invaders_eps1e-8_s1"):
        run_dir = work_dir / "runs" / name
        if not (run_dir / "summary.json").exists():
            continue
        logged = {
            tag: read_scalars(run_dir, f"losses/{tag}").values for tag in ("entropy", "pg_loss")
        }
        lines.append(
            f"- {name}: the policy's entropy from {logged['entropy'][0]:.2f} to "
            f"{logged['entropy'][-1]:.2f} (uniform over 3 and 6 actions: 1.10 and 1.79); the "
            f"policy-gradient loss's largest magnitude in the last half "
            f"{np.abs(logged['pg_loss'][len(logged['pg_loss']) // 2 :]).max():.1e}."
        )
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

    def finals(script: str, mode: str, game: str) -> list[float]:
        return [
            r["final_return"]
            for r in rows
            if r["script"] == script
            and r["mode"] == mode
            and r["env_id"] == f"gymnax:{game}"
            and r["finished"]
            and r["steps"] > 9_000_000
            and not r["sticky"]
        ]

    def with_eps(game: str) -> str:
        scores = finals("cleanba_impala", "async --rmsprop-eps 1e-8", game)
        return f"{scores[0]:.1f}" if scores else "(not run yet)"

    def ppo_range(game: str) -> str:
        scores = finals("cleanba_ppo", "sync", game)
        return f"{min(scores):.1f} to {max(scores):.1f}" if scores else "(not run yet)"

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
        + "\n\n## IMPALA's RMSProp on MinAtar\n\n"
        "IMPALA at its defaults (the Cleanba paper's: RMSProp, ε = 0.01 under the root, lr 6e-4) "
        "does not learn these games. Its losses are means over a minibatch's steps (the Cleanba "
        "paper's), where the IMPALA paper's are sums: the same gradients are smaller by the "
        "minibatch's 640 steps, and MinAtar's small network gives small ones. RMSProp divides "
        "each parameter's gradient by √(ν + ε); with ν far below ε it steps as SGD at lr / √ε. "
        "Read from the runs' last checkpoints:\n\n"
        + ("\n".join(rmsprop_scale(work_dir)) or "(not run yet)")
        + "\n\nThe 2M runs on Breakout (`impala_breakout_2m_*`, one change each, in the table) "
        "show which change makes it learn: "
        + ("; ".join(impala_probes(rows)) or "(not run yet)")
        + ". The summed-loss run sets ε and the gradient's clip to the IMPALA paper's for its sum "
        "over 640 steps, rescaled to the mean (RMSProp on a loss k times larger with ε is RMSProp "
        "on the loss with ε / k², and the clip scales by k): 0.01 / 640² and 40 / 640. "
        "`--rmsprop-eps` sets ε (docs/impala.md); the default stays the Cleanba paper's, with "
        "which its Atari results were published.\n\n"
        "With ε = 1e-8 (`impala_*_eps1e-8_s1` in the table) IMPALA learns SpaceInvaders, "
        f"{with_eps('SpaceInvaders-MinAtar')} at 10M (PPO on the same network: "
        f"{ppo_range('SpaceInvaders-MinAtar')}), but stops near {with_eps('Breakout-MinAtar')} on "
        f"Breakout (PPO: {ppo_range('Breakout-MinAtar')}). On Breakout its policy's entropy "
        "drifts back towards uniform while its policy-gradient loss stays small; on SpaceInvaders "
        "the entropy falls:\n\n"
        + ("\n".join(entropy_drift(work_dir)) or "(not run yet)")
        + "\n\nNo other change of the 2M list lifts Breakout's result above 6 (a smaller entropy "
        "cost, a larger learning rate, no lag, rollouts of 128 steps): what holds IMPALA on "
        "Breakout is not measured yet.\n\n"
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
