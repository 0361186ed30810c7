"""Recurrent cores on a CPU: a task that needs memory, where Cleanba PPO with a GRU core learns and
the feed-forward agent cannot, side by side with PureJaxRL's `purejaxrl/ppo_rnn.py` on the same
task; and the core's cost in steps per second on a task where both learn.

    git clone https://github.com/luchris429/purejaxrl /tmp/purejaxrl
    uv venv -p 3.11 /tmp/pjvenv && uv pip install --python /tmp/pjvenv/bin/python jax==0.10.2 \\
        gymnax==1.0.1 distrax flax optax brax navix    # PureJaxRL's wrappers import brax and navix
    python benchmark/recurrent_cpu.py --purejaxrl /tmp/purejaxrl \\
        --purejaxrl-python /tmp/pjvenv/bin/python

The memory task is bsuite's MemoryChain (gymnax's `MemoryChain-bsuite`, its default parameters): an
episode of 6 steps whose first observation shows a context bit and whose last action is rewarded +1
if it names that bit, -1 if not; the observations between show only the time left. A feed-forward
policy can only guess (a mean return of 0); one that remembers scores 1. The cost task is gymnax's
CartPole-v1, which both learn.

Every run uses `ppo_rnn.py`'s own hyperparameters (4 environments x 128 steps, 4 epochs of 4
minibatches, learning rate 2.5e-4 annealed, clip 0.2, entropy 0.01, 500k steps) and its network's
sizes: a dense layer of 128 units (ReLU), a GRU of 128, actor and critic heads of one hidden layer
of 128. What differs: Cleanba's heads use tanh where `ppo_rnn.py`'s use ReLU, and Cleanba's
minibatches are sets of whole environment sequences chosen by the environments' global indices where
`ppo_rnn.py` permutes the environments with one key (both replay each sequence from the state its
first step met); Cleanba's actor and learner are two threads that hand over through queues of size
one (Sync: lag 0), PureJaxRL's whole loop is one compiled program. PureJaxRL's code runs
unchanged but for two compatibility shims: gymnax 1.0's six-value `step` is wrapped in
`gymnax.wrappers.compat.LegacyStepAPIWrapper`, and flax 0.12's `GRUCell` is given `ppo_rnn.py`'s
size (128) as `features` and `ScannedRNN.initialize_carry` the zeros the older flax gave.

Scores: Cleanba's, the mean return of the last 100 episodes; PureJaxRL's, the mean return of the
episodes that ended in the last tenth of its updates. Steps per second leave compilation out:
Cleanba's from the end of its first update to the end of its last, PureJaxRL's from a compiled
program's start to its end. Each run is a process of its own, one at a time. Writes
benchmark/results/recurrent_cpu.md, .png and .csv (`--report-only`: from --work-dir's runs)."""

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from csv_columns import RUN_COLUMNS
from measure import stack_line

REPO = Path(__file__).resolve().parents[1]
TOTAL_TIMESTEPS = 500_000
PUREJAXRL_CONFIG = dict(
    LR=2.5e-4,
    NUM_ENVS=4,
    NUM_STEPS=128,
    TOTAL_TIMESTEPS=TOTAL_TIMESTEPS,
    UPDATE_EPOCHS=4,
    NUM_MINIBATCHES=4,
    GAMMA=0.99,
    GAE_LAMBDA=0.95,
    CLIP_EPS=0.2,
    ENT_COEF=0.01,
    VF_COEF=0.5,
    MAX_GRAD_NORM=0.5,
    ANNEAL_LR=True,
    DEBUG=False,
)
CLEANBA_SETTINGS = [
    *["--local-num-envs", "4", "--num-actor-threads", "1", "--num-steps", "128"],
    *["--update-epochs", "4", "--num-minibatches", "4", "--learning-rate", "2.5e-4"],
    *["--clip-coef", "0.2", "--ent-coef", "0.01", "--vf-coef", "0.5", "--max-grad-norm", "0.5"],
    *["--clip-vloss", "--gradient-accumulation-steps", "1", "--hiddens", "128"],
    *["--total-timesteps", str(TOTAL_TIMESTEPS), "--log-frequency", "100"],
]
TASKS = {"memory": "MemoryChain-bsuite", "cost": "CartPole-v1"}
# (name, program, task, seed): the memory task on 3 seeds each, the cost task on one.
RUNS = [
    *[
        (f"{program}_memory_s{seed}", program, "memory", seed)
        for seed in (1, 2, 3)
        for program in ("gru", "feed_forward", "purejaxrl")
    ],
    *[
        (f"{program}_cost_s1", program, "cost", 1)
        for program in ("gru", "feed_forward", "purejaxrl")
    ],
]
PROGRAMS = {
    "gru": "Cleanba PPO, --core gru",
    "feed_forward": "Cleanba PPO, no core",
    "purejaxrl": "PureJaxRL ppo_rnn.py (GRU)",
}

# PureJaxRL's `ppo_rnn.py`, imported from the checkout and run as its `__main__` does (see the
# module's docstring for the two shims); prints its compile time, run time, final score and the
# mean return of the episodes that ended in each update.
PUREJAXRL = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import flax.linen as nn
import gymnax, jax, jax.numpy as jnp, numpy as np
from gymnax.wrappers.compat import LegacyStepAPIWrapper
make = gymnax.make
def legacy_make(name, **kwargs):
    env, params = make(name, **kwargs)
    return LegacyStepAPIWrapper(env), params
gymnax.make = legacy_make
import ppo_rnn
class GRUCell(nn.GRUCell):
    features: int = 128
nn.GRUCell = GRUCell
ppo_rnn.ScannedRNN.initialize_carry = staticmethod(
    lambda batch_size, hidden_size: jnp.zeros((batch_size, hidden_size))
)
config = json.loads(sys.argv[2])
rng = jax.random.PRNGKey(int(sys.argv[3]))
start = time.time()
compiled = jax.jit(ppo_rnn.make_train(config)).lower(rng).compile()
compile_s = time.time() - start
start = time.time()
out = jax.block_until_ready(compiled(rng))
run_s = time.time() - start
metric = out["metric"]
returned = np.asarray(metric["returned_episode"])
returns = np.asarray(metric["returned_episode_returns"])
last = max(1, len(returned) // 10)
per_update = [float(r[d].mean()) if d.any() else None for r, d in zip(returns, returned)]
final = float(returns[-last:][returned[-last:]].mean())
print(json.dumps(dict(compile_s=compile_s, run_s=run_s, final_return=final, curve=per_update)))
"""


def purejaxrl(checkout: Path, python: str, task: str, seed: int) -> dict:
    config = dict(PUREJAXRL_CONFIG, ENV_NAME=TASKS[task])
    result = subprocess.run(
        [python, "-c", PUREJAXRL, str(checkout / "purejaxrl"), json.dumps(config), str(seed)],
        capture_output=True,
        text=True,
    )
    if result.returncode:
        sys.exit(f"PureJaxRL failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    measured = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    steps_per_update = config["NUM_ENVS"] * config["NUM_STEPS"]
    measured["curve"] = [
        [(update + 1) * steps_per_update, value]
        for update, value in enumerate(measured["curve"])
        if value is not None
    ]
    return dict(
        sps=TOTAL_TIMESTEPS / measured["run_s"],
        wall_time_s=measured["compile_s"] + measured["run_s"],
        final_return=measured["final_return"],
        curve=measured["curve"],
    )


def cleanba(program: str, task: str, seed: int, folder: Path) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import scalars
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    core = ["--core", "gru", "--core-size", "128"] if program == "gru" else []
    name = f"{program}_{task}_s{seed}"
    command = [
        str(REPO / "cleanba" / "cleanba_ppo.py"),
        *["--env-id", f"gymnax:{TASKS[task]}", *core, *CLEANBA_SETTINGS],
        *["--seed", str(seed), "--run-name", name],
    ]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{name}.log", "w") as log:
        subprocess.run([sys.executable, *command], cwd=folder, stdout=log, stderr=log, check=True)
    run_dir = folder / "runs" / name
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    logged = events.Scalars("charts/SPS")
    steady = (logged[-1].step - logged[0].step) / (logged[-1].wall_time - logged[0].wall_time)
    returns = sorted(scalars(run_dir, "charts/episodic_return"))
    summary = json.loads((run_dir / "summary.json").read_text())
    window = 100
    curve = [
        [returns[i][0], float(np.mean([v for _, v in returns[max(0, i - window + 1) : i + 1]]))]
        for i in range(0, len(returns), max(1, len(returns) // 200))
    ]
    return dict(
        sps=steady,
        wall_time_s=summary["wall_time_s"],
        final_return=float(np.mean([v for _, v in returns[-window:]])),
        curve=curve,
    )


def run_all(options):
    options.work_dir.mkdir(parents=True, exist_ok=True)
    for name, program, task, seed in RUNS:
        path = options.work_dir / f"{name}.json"
        if path.exists():
            print(f"{name}: already run", flush=True)
            continue
        print(f"{name}: running", flush=True)
        start = time.time()
        if program == "purejaxrl":
            measured = purejaxrl(options.purejaxrl, options.purejaxrl_python, task, seed)
        else:
            measured = cleanba(program, task, seed, options.work_dir)
        measured.update(name=name, program=program, task=task, seed=seed)
        path.write_text(json.dumps(measured))
        print(
            f"{name}: {measured['final_return']:.2f} at {measured['sps']:,.0f} steps/s "
            f"({time.time() - start:.0f} s)",
            flush=True,
        )


def update_times(work_dir: Path, name: str) -> str:
    """Where a Cleanba run's update went: the actor's rollout and the learner's update, mean
    milliseconds per update (TensorBoard's `stats/`, the compiling first update left out)."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import scalars

    run_dir = work_dir / "runs" / name
    means = {
        key: 1000 * np.mean([value for _, value in scalars(run_dir, f"stats/{key}")[1:]])
        for key in ("rollout_time", "learn_time")
    }
    return f"rollout {means['rollout_time']:.0f} ms, learner update {means['learn_time']:.0f} ms"


def report(options):
    measured = [
        json.loads((options.work_dir / f"{name}.json").read_text())
        for name, *_ in RUNS
        if (options.work_dir / f"{name}.json").exists()
    ]
    results = REPO / "benchmark" / "results"
    with open(results / "recurrent_cpu.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*RUN_COLUMNS, "program"])
        writer.writeheader()
        for m in measured:
            writer.writerow(
                dict(
                    script="cleanba_ppo" if m["program"] != "purejaxrl" else "purejaxrl_ppo_rnn",
                    mode="sync",
                    env_id=f"gymnax:{TASKS[m['task']]}",
                    seed=m["seed"],
                    steps=TOTAL_TIMESTEPS,
                    final_return=round(m["final_return"], 3),
                    eval_return="",
                    sps=round(m["sps"]),
                    wall_time_s=round(m["wall_time_s"]),
                    program=m["program"],
                )
            )
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"gru": "tab:blue", "feed_forward": "tab:red", "purejaxrl": "tab:green"}
    for axis, task in zip(axes, TASKS):
        for m in measured:
            if m["task"] == task:
                steps, values = zip(*m["curve"])
                label = PROGRAMS[m["program"]] if m["seed"] == 1 else None
                axis.plot(steps, values, color=colors[m["program"]], alpha=0.8, label=label)
        axis.set_title(f"gymnax {TASKS[task]}")
        axis.set_xlabel("environment steps")
        axis.set_ylabel("episode return")
        axis.legend()
    figure.tight_layout()
    figure.savefig(results / "recurrent_cpu.png", dpi=120)

    def cell(program, task, key, fmt):
        values = [m[key] for m in measured if m["program"] == program and m["task"] == task]
        if not values:
            return "not run yet"
        each = ", ".join(fmt.format(v) for v in values)
        return f"{fmt.format(np.mean(values))} ({each})" if len(values) > 1 else each

    lines = [
        f"# Recurrent cores on a CPU ({time.strftime('%Y-%m-%d')})",
        "",
        f"{stack_line()} Made by `python benchmark/recurrent_cpu.py --purejaxrl /tmp/purejaxrl "
        "--purejaxrl-python /tmp/pjvenv/bin/python`; the settings and what differs between the "
        "programs are in its docstring. Cleanba's command (the feed-forward runs without `--core "
        "gru --core-size 128`):",
        "",
        "```",
        "python cleanba/cleanba_ppo.py --env-id gymnax:MemoryChain-bsuite --core gru "
        + "--core-size 128 "
        + " ".join(CLEANBA_SETTINGS)
        + " --seed 1",
        "```",
        "",
        f"{options.note}",
        "",
        "| task | program | final return: mean (seeds) | steps/s: mean (seeds) |",
        "|---|---|---|---|",
    ]
    for task in TASKS:
        for program in PROGRAMS:
            score = cell(program, task, "final_return", "{:.2f}")
            speed = cell(program, task, "sps", "{:,.0f}")
            lines.append(f"| {TASKS[task]} | {PROGRAMS[program]} | {score} | {speed} |")
    lines += [
        "",
        "Where each update of 512 steps went (Cleanba, seed 1; the actor plays the next rollout "
        "while the learner updates only with `--concurrency`, off here):",
        "",
    ]
    for task in TASKS:
        for program in ("gru", "feed_forward"):
            name = f"{program}_{task}_s1"
            if (options.work_dir / "runs" / name).is_dir():
                times = update_times(options.work_dir, name)
                lines.append(f"- {TASKS[task]}, {PROGRAMS[program]}: {times}.")
    for finding in options.findings:
        lines += ["", finding]
    lines += ["", "![recurrent cores](recurrent_cpu.png)", ""]
    (results / "recurrent_cpu.md").write_text("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--purejaxrl", type=Path, default=Path("/tmp/purejaxrl"))
    parser.add_argument("--purejaxrl-python", default="/tmp/pjvenv/bin/python")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cleanba-recurrent"))
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--note", default="", help="how the machine was shared")
    parser.add_argument(
        "--finding", action="append", default=[], dest="findings", help="a paragraph of findings"
    )
    options = parser.parse_args()
    if not options.report_only:
        run_all(options)
    report(options)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(REPO / "benchmark"))
    main()
