"""Learning parity with CleanRL's PPO on CartPole-v1: our PPO with `ppo.py`'s published
hyperparameters.

python benchmark/parity_cartpole.py                          # every variant below
python benchmark/parity_cartpole.py --variants cleanrl --seeds 1 2 3 4 5
python benchmark/parity_cartpole.py --report-only

CleanRL's `ppo.py` CartPole-v1 settings: 4 environments x 128 steps, 500k steps, Adam lr 2.5e-4
annealed, 4 minibatches x 4 epochs, clip 0.2, clipped value loss, GAE lambda 0.95, gamma 0.99,
entropy 0.01, value 0.5, max grad norm 0.5, separate 64-64 tanh actor and critic MLPs. Variants:
- `cleanrl`: those settings (the parity result);
- `unclipped_value_loss`: without --clip-vloss (the paper's Atari runs do not clip it);
- `shared_torso`: the network before separate MLPs (the script at revision ca8dbf1, unclipped value
  loss);
- `truncation_as_termination`, `unmasked_reset_steps`, `flat_minibatches`: `cleanrl` with one of our
  deliberate differences from CleanRL undone, by replacing one or two lines of a copy of the script
  (see ABLATIONS): a truncated episode not bootstrapped; envpool's reset steps (one per episode)
  learned from; minibatches drawn from all samples rather than an equal share of every environment's
  steps.
Writes benchmark/results/parity_cartpole.md, parity_cartpole.png and parity_cartpole.csv.
"""

import argparse
import csv
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from measure import run_measured, stack_line

from cleanba_utils.experiments.hns import collect

REPO = Path(__file__).resolve().parents[1]
CLEANRL = (
    "--env-id CartPole-v1 --hiddens 64 64 --local-num-envs 4 --num-actor-threads 1 --num-steps 128"
)
CLEANRL += " --clip-coef 0.2 --gradient-accumulation-steps 1 --log-frequency 1000"
# CleanRL's published ppo.py result on CartPole-v1: 490.04 ± 6.12 (docs.cleanrl.dev, PPO page,
# "ppo.py" experiment results; the mean episodic return at the end of 500k steps, over seeds).
CLEANRL_REFERENCE = 490.04
ABLATIONS = {
    "truncation_as_termination": [
        (
            "discount = gamma * (1.0 - terminations)",
            "discount = gamma * (1.0 - jnp.maximum(terminations, truncations))",
        )
    ],
    "unmasked_reset_steps": [
        (
            "valid = 1.0 - data.is_reset.astype(jnp.float32)",
            "valid = jnp.ones(data.is_reset.shape)",
        )
    ],
    "flat_minibatches": [
        (
            "return batch, data.env_ids",
            "flat = lambda x: x.reshape(1, -1, *x.shape[2:])\n"
            "        return jax.tree.map(flat, batch), data.env_ids[:1]",
        ),
        (
            "jax.random.fold_in(epoch_key, env_id), args.num_steps",
            "jax.random.fold_in(epoch_key, env_id), batch.valid.shape[1]",
        ),
        (
            "minibatch_steps = args.num_steps // args.num_minibatches",
            "minibatch_steps = args.num_steps * args.local_num_envs // args.num_minibatches",
        ),
    ],
}
VARIANTS = {
    "cleanrl": ("--clip-vloss", None),
    "unclipped_value_loss": ("", None),
    "shared_torso": ("", "ca8dbf1"),
    **{name: ("--clip-vloss", name) for name in ABLATIONS},
}
LAST_N = 100


def script_of(variant: str, work_dir: Path) -> Path:
    """The script a variant runs: ours, an older revision of it, or a copy with an ablation's lines
    replaced."""
    _, source = VARIANTS[variant]
    if source is None:
        return REPO / "cleanba" / "cleanba_ppo.py"
    if source in ABLATIONS:
        text = (REPO / "cleanba" / "cleanba_ppo.py").read_text()
        for old, new in ABLATIONS[source]:
            assert text.count(old) == 1, (
                f"{variant}: the line to replace is not in the script: {old}"
            )
            text = text.replace(old, new)
    else:
        text = subprocess.run(
            ["git", "show", f"{source}:cleanba/cleanba_ppo.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    path = work_dir / "scripts" / f"cleanba_ppo_{variant}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def command_of(variant: str, seed: int, timesteps: int) -> list[str]:
    flags, _ = VARIANTS[variant]
    return [
        *CLEANRL.split(),
        "--total-timesteps",
        str(timesteps),
        *flags.split(),
        "--exp-name",
        variant,
        "--seed",
        str(seed),
        "--run-name",
        f"{variant}_{seed}",
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument(
        "--timesteps", type=int, default=500_000, help="steps of each run (CleanRL's: 500k)"
    )
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cleanba_parity_cartpole"))
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmark" / "results")
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    options = parser.parse_args()
    (options.work_dir / "runs").mkdir(parents=True, exist_ok=True)
    options.out_dir.mkdir(parents=True, exist_ok=True)
    for variant in [] if options.report_only else options.variants:
        script = script_of(variant, options.work_dir)
        for seed in options.seeds:
            if (options.work_dir / "runs" / f"{variant}_{seed}" / "summary.json").exists():
                continue
            print(f"{variant} seed {seed}", flush=True)
            log = options.work_dir / f"{variant}_{seed}.log"
            if run_measured(
                [str(script), *command_of(variant, seed, options.timesteps)], options.work_dir, log
            )["exit_code"]:
                sys.exit(f"{variant} seed {seed} failed; see {log}")
    report(options)


def report(options):
    _, curve_rows = collect(options.work_dir / "runs", "episodic_return", LAST_N, {})
    curves = {}
    finished = lambda row: (
        options.work_dir / "runs" / f"{row['algorithm']}_{row['seed']}" / "summary.json"
    ).exists()
    for row in filter(finished, curve_rows):
        curves.setdefault(row["algorithm"], {}).setdefault(row["seed"], []).append(row)
    with open(options.out_dir / "parity_cartpole.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["variant", "seed", "global_step", "score"])
        writer.writeheader()
        for variant, seeds in curves.items():
            for seed, rows in seeds.items():
                writer.writerows(
                    dict(variant=variant, seed=seed, global_step=r["global_step"], score=r["score"])
                    for r in rows
                )
    table = [
        f"| variant | seeds | final return per seed (last {LAST_N} episodes) | mean | min "
        "| SPS (mean) |",
        "|---|---|---|---|---|---|",
    ]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for variant in VARIANTS:
        if variant not in curves:
            continue
        seeds = sorted(curves[variant])
        finals = [curves[variant][s][-1]["score"] for s in seeds]
        sps = [
            json.loads((options.work_dir / "runs" / f"{variant}_{s}" / "summary.json").read_text())[
                "sps"
            ]
            for s in seeds
        ]
        table.append(
            f"| `{variant}` | {' '.join(map(str, seeds))} | "
            f"{' / '.join(f'{x:.1f}' for x in finals)} | "
            f"{np.mean(finals):.1f} | {min(finals):.1f} | {np.mean(sps):.0f} |"
        )
        grid = np.linspace(0, options.timesteps, 201)
        on_grid = np.array(
            [
                np.interp(
                    grid,
                    [r["global_step"] for r in curves[variant][s]],
                    [r["score"] for r in curves[variant][s]],
                )
                for s in seeds
            ]
        )
        style = dict(linewidth=2.5) if variant == "cleanrl" else dict(linewidth=1, alpha=0.8)
        (line,) = ax.plot(grid, on_grid.mean(0), label=f"{variant} ({len(seeds)} seeds)", **style)
        if variant == "cleanrl":
            ax.fill_between(
                grid, on_grid.min(0), on_grid.max(0), color=line.get_color(), alpha=0.15
            )
    ax.axhline(
        CLEANRL_REFERENCE,
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"CleanRL ppo.py ({CLEANRL_REFERENCE})",
    )
    ax.set(
        title=(
            f"CartPole-v1, CleanRL's PPO settings (mean over seeds of the last-{LAST_N} mean; "
            "band: cleanrl min-max)"
        ),
        xlabel="environment steps",
        ylabel="episodic return",
    )
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(options.out_dir / "parity_cartpole.png", dpi=110)
    plt.close(fig)
    script_name = lambda v: f"<{VARIANTS[v][1]}>" if VARIANTS[v][1] else "cleanba/cleanba_ppo.py"
    commands = "\n".join(
        f"python {script_name(v)} {' '.join(command_of(v, 1, options.timesteps))}"
        for v in VARIANTS
        if v in curves
    )
    (options.out_dir / "parity_cartpole.md").write_text(
        f"# PPO parity with CleanRL on CartPole-v1 ({options.date})\n\n"
        f"{stack_line()}\n\n"
        f"Machine: {platform.machine()}, 2 CPU cores, Python {platform.python_version()}. Made by "
        "`python benchmark/parity_cartpole.py --variants VARIANT --seeds SEEDS` with the seeds of "
        "the table; the seed-1 command of each variant (`<name>`: the script with that ablation or "
        "at that revision, see the benchmark's docstring):\n\n"
        f"```\n{commands}\n```\n\n"
        f"Reference: CleanRL's `ppo.py` on CartPole-v1 reaches {CLEANRL_REFERENCE} ± 6.12 "
        "(docs.cleanrl.dev, PPO page, `ppo.py` experiment results, 500k steps). Target: a mean of "
        "the last 100 episodes of at least 450 over 5 seeds, and no seed below 300. SPS: other "
        "benchmark runs shared the 2 cores, so compare learning, not speed.\n\n"
        + "\n".join(table)
        + "\n\n![CartPole parity](parity_cartpole.png)\n"
    )
    print((options.out_dir / "parity_cartpole.md").read_text())


if __name__ == "__main__":
    main()
