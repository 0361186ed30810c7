"""Evidence that cleanba_apex_dqn.py learns, on a CPU: CartPole-v1 x 3 seeds, one short Breakout run,
and the agreement of the parameters of one run on 1 and on 2 learner devices.

python benchmark/learning_apex_cpu.py    # one run after another; see the report for each run's time

Writes benchmark/results/learning_apex_cpu.md and .png. The CartPole and Breakout runs change the
script's defaults only where a CPU needs it: a small network, few environments, a small replay and
batch, an early start of learning, and (CartPole) a higher learning rate and target period counted
in fewer updates.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import flax.serialization
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from measure import command_line
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cleanba_utils.experiments.events import running_mean

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "cleanba" / "cleanba_apex_dqn.py"
CARTPOLE = (
    "--env-id CartPole-v1 --hiddens 64 64 --local-num-envs 4 --num-steps 8 --learning-starts 1000"
)
CARTPOLE += " --buffer-size 20000 --batch-size 32 --updates-per-rollout 4 --learning-rate 1e-3"
CARTPOLE += " --target-update-period 200 --log-frequency 500"
BREAKOUT = "--env-id Breakout-v5 --channels 4 8 --hiddens 64 --local-num-envs 8 --num-steps 16 --learning-starts 2000"
BREAKOUT += " --buffer-size 100000 --batch-size 64 --updates-per-rollout 2 --target-update-period 500 --log-frequency 10"
DEVICES = "--env-id Breakout-v5 --channels 4 --hiddens 32 --local-num-envs 4 --num-actor-threads 1 --num-steps 8"
DEVICES += " --total-timesteps 320 --learning-starts 64 --batch-size 32 --updates-per-rollout 2 --buffer-size 2048"
DEVICES += " --save-model --seed 1"


def run(args: str, work_dir: Path, devices: int = 1) -> Path:
    run_name = args.split("--run-name ")[1].split()[0]
    run_dir = work_dir / "runs" / run_name
    if not (run_dir / "summary.json").exists():
        command = [sys.executable, str(SCRIPT), *args.split()]
        print(" ".join(command[1:]), flush=True)
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        with open(work_dir / f"{run_name}.log", "w") as log:
            subprocess.run(
                command, cwd=work_dir, stdout=log, stderr=subprocess.STDOUT, check=True, env=env
            )
    return run_dir


def scalar(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return (
        sorted((e.step, e.value) for e in events.Scalars(tag))
        if tag in events.Tags()["scalars"]
        else []
    )


def summary_row(run_dir: Path, label: str) -> str:
    summary = json.loads((run_dir / "summary.json").read_text())
    returns = [value for _, value in scalar(run_dir, "charts/episodic_return")]
    updates = scalar(run_dir, "stats/learner_updates")
    rate = [value for _, value in scalar(run_dir, "stats/learner_updates_per_second")]
    last100 = f"{np.mean(returns[-100:]):.1f}" if returns else "n/a"
    return (
        f"| {label} | {summary['global_step']:,} | {len(returns)} | {last100} | {summary['sps']} | "
        f"{int(updates[-1][1]) if updates else 0:,} | {np.median(rate) if rate else 0:.1f} | "
        f"{summary['wall_time_s'] / 60:.1f} |"
    )


def plot_cartpole(run_dirs: dict, path: Path):
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    for label, run_dir in run_dirs.items():
        steps, returns = zip(*scalar(run_dir, "charts/episodic_return"))
        ax.plot(steps, running_mean(np.array(returns), 100), label=label)
    ax.axhline(490, color="grey", linestyle="--", label="CleanRL DQN at 500k steps (about 490)")
    ax.set(
        xlabel="environment steps",
        ylabel="return, mean of the last 100 episodes",
        title="Ape-X DQN, CartPole-v1",
    )
    ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load_params(model: Path) -> dict:
    def flatten(tree, prefix=""):
        if isinstance(tree, dict):
            return {k: v for key in tree for k, v in flatten(tree[key], f"{prefix}/{key}").items()}
        return {prefix: np.asarray(tree, np.float64)}

    return flatten(flax.serialization.msgpack_restore(model.read_bytes())["params"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cartpole-timesteps", type=int, default=500_000)
    parser.add_argument("--breakout-timesteps", type=int, default=51_200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cleanba_learning_apex_cpu"))
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmark" / "results" / "learning_apex_cpu.md"
    )
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument(
        "--note", default="", help="a paragraph under the table: how the machine was shared"
    )
    options = parser.parse_args()
    options.work_dir.mkdir(parents=True, exist_ok=True)

    commands, rows, cartpole_runs = [], [], {}
    for seed in options.seeds:
        commands.append(
            f"{CARTPOLE} --total-timesteps {options.cartpole_timesteps} --seed {seed} --run-name cartpole_{seed}"
        )
        cartpole_runs[f"seed {seed}"] = run(commands[-1], options.work_dir)
        rows.append(summary_row(cartpole_runs[f"seed {seed}"], f"CartPole-v1, seed {seed}"))
    plot_cartpole(cartpole_runs, options.out.with_suffix(".png"))
    commands.append(
        f"{BREAKOUT} --total-timesteps {options.breakout_timesteps} --seed 1 --run-name breakout_1"
    )
    rows.append(summary_row(run(commands[-1], options.work_dir), "Breakout-v5, seed 1"))

    layouts = {
        "1 learner device": "--learner-device-ids 0",
        "2 learner devices": "--learner-device-ids 0 1",
    }
    params = {}
    for name, flags in layouts.items():
        commands.append(f"{DEVICES} {flags} --run-name devices_{flags.count(' ')}")
        run_dir = run(commands[-1], options.work_dir, devices=2)
        params[name] = load_params(run_dir / "cleanba_apex_dqn.cleanba_model")
        device_updates = int(scalar(run_dir, "stats/learner_updates")[-1][1])
    one, two = params.values()
    difference = max(float(np.max(np.abs(one[k] - two[k]))) for k in one)
    scale = max(float(np.max(np.abs(one[k]))) for k in one)

    command_lines = "\n".join(f"python cleanba/cleanba_apex_dqn.py {c}" for c in commands)
    text = f"""# Ape-X DQN learning on a CPU ({options.date})

Machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}.
Made by `{command_line(sys.argv)}`, which ran (the device runs with
`XLA_FLAGS=--xla_force_host_platform_device_count=2`):

```
{command_lines}
```

| run | steps | episodes | return (last 100 episodes) | SPS | learner updates | updates/s (median) | wall time (min) |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

![CartPole-v1](learning_apex_cpu.png)

Returns are those of all environments, each with its own exploration rate (0.4 down to 0.4^8). CleanRL's DQN
reaches about 490 on CartPole-v1 after 500k steps; these runs stop at {options.cartpole_timesteps:,} steps.

{options.note}

**1 vs 2 learner devices.** The same Breakout run (batch 32, 2 updates per iteration, {device_updates} learner updates)
with the batch on one device or split over two: the largest parameter difference is {difference:.2e}
(parameters up to {scale:.2f} in magnitude), float rounding of the summed gradients. The batches are sampled on
the host from one sum tree, so they are the same on both layouts as long as the priorities, which are computed
from the TD errors, round the same way.
"""
    options.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
