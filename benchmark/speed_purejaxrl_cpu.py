"""Speed side by side with PureJaxRL on one CPU machine: PureJaxRL's `purejaxrl/ppo.py`, its
computation unchanged, against Cleanba PPO with the same hyperparameters (Sync, the same algorithm)
on the same gymnax environment, at PureJaxRL's MinAtar settings (64 environments x 128 steps,
`examples/brax_minatar.ipynb`) and at its CartPole settings (4 x 128, `ppo.py`'s own). Beside both,
the ceiling: the environments alone in a `lax.scan` with random actions, and with the policy's
forward pass.

    git clone https://github.com/luchris429/purejaxrl /tmp/purejaxrl
    uv venv -p 3.11 /tmp/pjvenv && uv pip install --python /tmp/pjvenv/bin/python jax==0.10.2 \
        gymnax==1.0.1 distrax flax optax brax navix    # PureJaxRL's wrappers import brax and navix
    python benchmark/speed_purejaxrl_cpu.py --purejaxrl /tmp/purejaxrl \
        --purejaxrl-python /tmp/pjvenv/bin/python

Each measurement runs in a process of its own, one at a time; each program runs --repeats times
per setting, the two taking turns, and the report gives the median and every run. Steps per second
leave compilation
out: PureJaxRL's whole training is one compiled program, compiled first and then timed; Cleanba's
are measured from the end of its first update to the end of its last (TensorBoard's wall times of
`charts/SPS`). gymnax 1.0 returns six values from `step`: PureJaxRL's environment is wrapped in
`gymnax.wrappers.compat.LegacyStepAPIWrapper`, which gives the five it expects. PureJaxRL's MLP
takes the image flattened (its `FlattenObservationWrapper`); Cleanba PPO takes the same 400 features
through `benchmark/minatar_flat.py` and its MLP of the same sizes (64 x 64, separate actor and
critic). Writes benchmark/results/speed_purejaxrl_cpu.md, .png and .csv.

What differs besides speed: PureJaxRL's MinAtar MLP uses ReLU, Cleanba PPO's tanh (the same
arithmetic cost); PureJaxRL's minibatches are random subsets of all samples, Cleanba's a chunk of
every environment's shuffled steps (which keeps the data independent of the layout); both clip the
value loss (Cleanba: --clip-vloss). Cleanba's actor and learner are two threads that hand over
through queues of size one (Sync: lag 0), PureJaxRL's whole loop is one compiled program."""

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from csv_columns import RUN_COLUMNS

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "minatar": dict(
        config=dict(
            LR=5e-3,
            NUM_ENVS=64,
            NUM_STEPS=128,
            TOTAL_TIMESTEPS=2_000_000,
            UPDATE_EPOCHS=4,
            NUM_MINIBATCHES=8,
            GAMMA=0.99,
            GAE_LAMBDA=0.95,
            CLIP_EPS=0.2,
            ENT_COEF=0.01,
            VF_COEF=0.5,
            MAX_GRAD_NORM=0.5,
            ACTIVATION="relu",
            ENV_NAME="Breakout-MinAtar",
            ANNEAL_LR=True,
            DEBUG=False,
        ),
        env_id="jax:minatar_flat:FlatBreakout",
    ),
    "cartpole": dict(
        config=dict(
            LR=2.5e-4,
            NUM_ENVS=4,
            NUM_STEPS=128,
            TOTAL_TIMESTEPS=500_000,
            UPDATE_EPOCHS=4,
            NUM_MINIBATCHES=4,
            GAMMA=0.99,
            GAE_LAMBDA=0.95,
            CLIP_EPS=0.2,
            ENT_COEF=0.01,
            VF_COEF=0.5,
            MAX_GRAD_NORM=0.5,
            ACTIVATION="tanh",
            ENV_NAME="CartPole-v1",
            ANNEAL_LR=True,
            DEBUG=False,
        ),
        env_id="gymnax:CartPole-v1",
    ),
}

# PureJaxRL's `ppo.py`, imported from the checkout and run as its `__main__` does, with gymnax 1.0's
# six-value step wrapped; prints the compile time, the run's time and the mean return of the
# episodes that ended in the last tenth of its updates.
PUREJAXRL = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import gymnax, jax, numpy as np
from gymnax.wrappers.compat import LegacyStepAPIWrapper
make = gymnax.make
def legacy_make(name, **kwargs):
    env, params = make(name, **kwargs)
    return LegacyStepAPIWrapper(env), params
gymnax.make = legacy_make
import ppo
config = json.loads(sys.argv[2])
rng = jax.random.PRNGKey(int(sys.argv[3]))
start = time.time()
compiled = jax.jit(ppo.make_train(config)).lower(rng).compile()
compile_s = time.time() - start
start = time.time()
out = jax.block_until_ready(compiled(rng))
run_s = time.time() - start
metrics = out["metrics"]
returned = np.asarray(metrics["returned_episode"])
returns = np.asarray(metrics["returned_episode_returns"])
last = max(1, len(returned) // 10)
final = float(returns[-last:][returned[-last:]].mean())
print(json.dumps(dict(compile_s=compile_s, run_s=run_s, final_return=final)))
"""

# The environments alone in a `lax.scan` (random actions), and with the policy's forward pass
# (Cleanba PPO's MLP of 64 x 64 on the same observations): steps per second of the compiled
# rollout's environment part, the ceiling of any actor.
CEILING = """
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, sys.argv[4])
from cleanba_utils import jax_envs
sys.path.insert(0, sys.argv[5])
import cleanba.cleanba_ppo as ppo
env_id, num_envs, num_steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
env = jax_envs.load_env(env_id)
reset, step = jax_envs.compiled(env)
n = jax_envs.action_space(env).n
network = ppo.Network(None, (64, 64), n)
state = reset(jnp.arange(num_envs, dtype=jnp.uint32))
params = network.init(jax.random.PRNGKey(0), state.obs)
def rollout(state, first, with_policy):
    def one(carry, t):
        state, key = carry
        key, draw = jax.random.split(key)
        if with_policy:
            logits, _ = network.apply(params, state.obs)
            actions = jax.random.categorical(draw, logits)
        else:
            actions = jax.random.randint(draw, (num_envs,), 0, n)
        state, obs, reward, term, trunc = step(state, actions, first + t)
        return (state, key), reward
    (state, _), rewards = jax.lax.scan(one, (state, jax.random.PRNGKey(1)), jnp.arange(num_steps))
    return state, rewards.sum()
result = {}
for with_policy in (False, True):
    program = jax.jit(lambda s, f: rollout(s, f, with_policy))
    s = jax.block_until_ready(program(state, 0))[0]
    calls = max(1, 200_000 // (num_envs * num_steps))
    best = 0.0
    for repeat in range(3):
        start = time.time()
        for i in range(calls):
            s = program(s, (repeat * calls + i + 1) * num_steps)[0]
        jax.block_until_ready(s)
        best = max(best, calls * num_envs * num_steps / (time.time() - start))
    result["policy" if with_policy else "random"] = best
print(json.dumps(result))
"""


def last_json(output: str) -> dict:
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


def purejaxrl(checkout: Path, python: str, setting: str, seed: int) -> dict:
    config = SETTINGS[setting]["config"]
    result = subprocess.run(
        [python, "-c", PUREJAXRL, str(checkout / "purejaxrl"), json.dumps(config), str(seed)],
        capture_output=True,
        text=True,
    )
    if result.returncode:
        sys.exit(f"PureJaxRL failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    measured = last_json(result.stdout)
    measured["sps"] = config["TOTAL_TIMESTEPS"] / measured["run_s"]
    return measured


def cleanba(setting: str, seed: int) -> dict:
    """Cleanba PPO with PureJaxRL's hyperparameters: its steady steps per second (from the end of
    the first update, which compiles, to the end of the last) and where its time went."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import scalars

    config = SETTINGS[setting]["config"]
    command = [
        str(REPO / "cleanba" / "cleanba_ppo.py"),
        *["--env-id", SETTINGS[setting]["env_id"], "--hiddens", "64", "64"],
        *["--local-num-envs", str(config["NUM_ENVS"]), "--num-actor-threads", "1"],
        *["--num-steps", str(config["NUM_STEPS"]), "--update-epochs", str(config["UPDATE_EPOCHS"])],
        *[
            "--num-minibatches",
            str(config["NUM_MINIBATCHES"]),
            "--learning-rate",
            str(config["LR"]),
        ],
        *["--clip-coef", str(config["CLIP_EPS"]), "--clip-vloss"],
        *["--gradient-accumulation-steps", "1"],
        *["--total-timesteps", str(int(config["TOTAL_TIMESTEPS"])), "--seed", str(seed)],
        *["--run-name", "run"],
    ]
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, PYTHONPATH=str(REPO / "benchmark"))
        subprocess.run(
            [sys.executable, *command], cwd=folder, env=env, check=True, capture_output=True
        )
        run_dir = Path(folder) / "runs" / "run"
        sps = scalars(run_dir, "charts/SPS")
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        events.Reload()
        logged = events.Scalars("charts/SPS")
        steady = (logged[-1].step - logged[0].step) / (logged[-1].wall_time - logged[0].wall_time)
        means = {
            key: float(np.mean([v for _, v in scalars(run_dir, f"stats/{key}")[1:]]))
            for key in (
                "rollout_time",
                "learn_time",
                "param_queue_get_time",
                "rollout_queue_get_time",
            )
        }
        returns = [v for _, v in scalars(run_dir, "charts/episodic_return")]
        summary = json.loads((run_dir / "summary.json").read_text())
    return dict(
        sps=steady,
        whole_sps=summary["sps"],
        wall_time_s=summary["wall_time_s"],
        final_return=float(np.mean(returns[-100:])),
        steps_logged=len(sps),
        **means,
    )


def ceiling(setting: str) -> dict:
    config = SETTINGS[setting]["config"]
    env_id = SETTINGS[setting]["env_id"]
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            CEILING,
            env_id,
            str(config["NUM_ENVS"]),
            str(config["NUM_STEPS"]),
            str(REPO),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PYTHONPATH=str(REPO / "benchmark")),
    )
    return last_json(result.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--purejaxrl", type=Path, required=True, help="a checkout of PureJaxRL")
    parser.add_argument(
        "--purejaxrl-python",
        default=sys.executable,
        help="the interpreter of PureJaxRL (with jax, gymnax, distrax, brax, navix)",
    )
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each program per setting, taking turns"
    )
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmark" / "results")
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument(
        "--note", default="", help="what follows the table: how the machine was shared, analysis"
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="write the report again from --out-dir's CSV (another --note), measuring nothing",
    )
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "-C", str(args.purejaxrl), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    if args.report_only:
        with open(args.out_dir / "speed_purejaxrl_cpu.csv", newline="") as f:
            rows = [
                dict(row, sps=int(row["sps"]) if row["sps"] else "") for row in csv.DictReader(f)
            ]
        args.settings = list(dict.fromkeys(row["setting"] for row in rows))
        args.repeats = max(int(row["repeat"]) for row in rows if row["repeat"])
        report(rows, args, commit)
        return
    rows = []
    for setting in args.settings:
        # The two programs take turns, so that a drift of the machine's speed meets both.
        measurements = []
        for repeat in range(1, args.repeats + 1):
            print(f"{setting}: PureJaxRL, run {repeat}", flush=True)
            theirs = purejaxrl(args.purejaxrl, args.purejaxrl_python, setting, args.seed)
            measurements.append(("purejaxrl_ppo", repeat, theirs))
            print(f"{setting}: Cleanba PPO, run {repeat}", flush=True)
            measurements.append(("cleanba_ppo", repeat, cleanba(setting, args.seed)))
        print(f"{setting}: ceiling", flush=True)
        ceilings = ceiling(setting)
        config = SETTINGS[setting]["config"]
        for program, repeat, measured in measurements:
            rows.append(
                dict(
                    script=program,
                    mode="sync",
                    env_id=SETTINGS[setting]["config"]["ENV_NAME"],
                    seed=args.seed,
                    steps=int(config["TOTAL_TIMESTEPS"]),
                    final_return=round(measured["final_return"], 2),
                    eval_return="",
                    sps=round(measured["sps"]),
                    wall_time_s=round(measured.get("run_s", measured.get("wall_time_s", 0)), 1),
                    setting=setting,
                    repeat=repeat,
                    detail=json.dumps({k: round(v, 4) for k, v in measured.items()}),
                )
            )
        rows.append(
            dict(
                script="ceiling",
                mode="",
                env_id=config["ENV_NAME"],
                seed="",
                steps="",
                final_return="",
                eval_return="",
                sps="",
                wall_time_s="",
                setting=setting,
                repeat="",
                detail=json.dumps({k: round(v) for k, v in ceilings.items()}),
            )
        )
        print(json.dumps(dict(setting=setting, measurements=measurements, ceiling=ceilings)))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with open(args.out_dir / "speed_purejaxrl_cpu.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*RUN_COLUMNS, "setting", "repeat", "detail"])
        writer.writeheader()
        writer.writerows(rows)
    report(rows, args, commit)


def median_run(rows: list) -> dict:
    """The run of median steps per second (of an odd number; the slower middle one of an even)."""
    ordered = sorted(rows, key=lambda row: row["sps"])
    return ordered[(len(ordered) - 1) // 2]


def report(rows, args, commit):
    table = [
        "| setting | program | steps/s (compile apart): median of the runs | every run | return "
        "at the end | notes |",
        "|---|---|---|---|---|---|",
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    labels, values = [], []
    medians = {}
    for setting in args.settings:
        for program in ("purejaxrl_ppo", "cleanba_ppo", "ceiling"):
            runs = [r for r in rows if r["setting"] == setting and r["script"] == program]
            if program == "ceiling":
                detail = json.loads(runs[0]["detail"])
                for kind, what in (("random", "random actions"), ("policy", "with the policy")):
                    table.append(
                        f"| {setting} | environments alone, {what} | {detail[kind]:,} | – | – "
                        "| `lax.scan` of the compiled step |"
                    )
                    labels.append(f"{setting}\nceiling ({kind})")
                    values.append(detail[kind])
                continue
            row = median_run(runs)
            medians[setting, program] = row["sps"]
            detail = json.loads(row["detail"])
            if program == "purejaxrl_ppo":
                notes = f"compile {detail['compile_s']:.1f} s"
            else:
                notes = (
                    f"per update: rollout {detail['rollout_time']:.3f} s, learn "
                    f"{detail['learn_time']:.3f} s, actor waits for parameters "
                    f"{detail['param_queue_get_time']:.3f} s; whole run {detail['whole_sps']:,} "
                    "steps/s"
                )
            every = ", ".join(f"{r['sps']:,}" for r in runs)
            table.append(
                f"| {setting} | {program} | {row['sps']:,} | {every} | {row['final_return']} "
                f"| {notes} |"
            )
            labels.append(f"{setting}\n{program}")
            values.append(row["sps"])
    ax.barh(labels, values)
    ax.set(xscale="log", xlabel="environment steps per second (log)", title="PPO on 2 CPU cores")
    fig.tight_layout()
    fig.savefig(args.out_dir / "speed_purejaxrl_cpu.png", dpi=110)
    plt.close(fig)
    ratios = []
    for setting in args.settings:
        ratio = medians[setting, "cleanba_ppo"] / medians[setting, "purejaxrl_ppo"]
        ratios.append(
            f"- {setting}: Cleanba PPO at {ratio:.2f}x PureJaxRL's steps per second (medians of "
            f"{args.repeats} runs each)."
        )
    (args.out_dir / "speed_purejaxrl_cpu.md").write_text(
        f"# Cleanba PPO and PureJaxRL side by side on a CPU ({args.date})\n\n"
        f"Machine: {platform.machine()}, 2 CPU cores, Python {platform.python_version()}; "
        f"PureJaxRL at commit {commit}. Made by `python benchmark/speed_purejaxrl_cpu.py "
        f"--purejaxrl <checkout> --purejaxrl-python <its interpreter>` (the docstring says what "
        "is measured and how).\n\n"
        + "\n".join(table)
        + "\n\n"
        + "\n".join(ratios)
        + (f"\n\n{args.note}" if args.note else "")
        + "\n\n![speed](speed_purejaxrl_cpu.png)\n"
    )
    print((args.out_dir / "speed_purejaxrl_cpu.md").read_text())


if __name__ == "__main__":
    main()
