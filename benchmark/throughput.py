"""Throughput against its ceiling: each stage of a script measured alone, then the whole script.

python benchmark/throughput.py    # PPO and IMPALA, small and default network, on this machine
python benchmark/throughput.py --scripts cleanba_impala --networks small

In this process, for each script and network (Breakout-v5, 2 actor threads x 8 environments, 32
steps per rollout, every other hyperparameter the script's default), each stage alone, in seconds
per environment step:
- (a) `t_env`: every actor thread's envpool stepped at once with random actions, as the actor
  threads do;
- (b) `t_infer`: the actor's policy (network, action sampling, log-probabilities) at the actor's
  batch;
- (c) `t_learn`: one learner update at the run's own batch and minibatches, on rollouts the script's
  own actors played; with its FLOPs (XLA's cost analysis of the network's forward and backward
  pass at the microbatch size, times the samples the update passes through it: the loss, the
  returns and the optimizer add little) as a share of the CPU's FMA peak (see `fma_peak`).
The ceiling: stages that share hardware add up, stages on separate hardware overlap, so on a CPU (or
with the actor and the learner on one device) it is 1 / (t_env + t_infer + t_learn), and with the
actor and the learner on separate accelerators 1 / max(t_env + t_infer, t_learn). Then the script
itself runs in a child process for --updates updates: its steady SPS (from the end of the first
update, which compiles, to the end of the last), the stage times it logged, and the peak resident
memory. Writes benchmark/results/throughput_<platform>.md.
"""

import argparse
import dataclasses
import importlib
import os
import platform
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from measure import run_measured, stack_line
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cleanba_utils.devices import first_replica, replicate
from cleanba_utils.envs import has_image_observations
from cleanba_utils.episodes import Episodes
from cleanba_utils.handoff import LagRule, start_actor_threads
from cleanba_utils.huge_pages import restart_with_huge_pages
from cleanba_utils.microbatches import rolls
from cleanba_utils.threads import queue_get

REPO = Path(__file__).resolve().parents[1]
LAYOUT = [
    "--env-id",
    "Breakout-v5",
    "--local-num-envs",
    "8",
    "--num-actor-threads",
    "2",
    "--num-steps",
    "32",
]
NETWORKS = {"small": ["--channels", "4", "8", "--hiddens", "64"], "default": []}


class NoWriter:
    """The actors log finished episodes; the stage measurements keep none."""

    def add_scalar(self, *args):
        pass


def stage_times(script, argv: list[str], repeats: int) -> dict:
    """(a), (b) and (c) in seconds per environment step, and whether actor and learner share
    hardware."""
    args = script.parse_args(argv)
    script.validate_layout(args)
    sizes = script.sizes_of(args, 1)
    actor_devices = [jax.local_devices()[i] for i in args.actor_device_ids]
    learner_devices = [jax.local_devices()[i] for i in args.learner_device_ids]
    network, origin = script.init_state(args, sizes)
    state = origin.learner
    num_threads = args.num_actor_threads * len(actor_devices)

    envs = [
        script.make_env(args, args.seed + i * args.local_num_envs, args.local_num_envs)
        for i in range(num_threads)
    ]
    first_obs = [env.reset()[0] for env in envs]
    rng = np.random.default_rng(0)
    actions = [
        rng.integers(0, envs[0].action_space.n, (repeats * args.num_steps, args.local_num_envs))
        for _ in envs
    ]

    def play(env, thread_actions):
        for action in thread_actions:
            env.step(action.astype(np.int32))

    start = time.perf_counter()
    threads = [threading.Thread(target=play, args=pair) for pair in zip(envs, actions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    t_env = (time.perf_counter() - start) / (repeats * args.num_steps * sizes.num_envs)
    for env in envs:
        env.close()

    env_ids = jnp.arange(args.local_num_envs)

    @jax.jit
    def policy(params, obs, step):
        logits, value = network.apply(params, obs)
        action = script.sample_actions(logits, jax.random.PRNGKey(0), step, env_ids)
        return action, jax.nn.log_softmax(logits)[jnp.arange(action.shape[0]), action], value

    params = jax.device_put(state.params, actor_devices[0])
    obs = jax.device_put(first_obs[0], actor_devices[0])
    jax.device_get(policy(params, obs, 0))
    calls = repeats * args.num_steps
    start = time.perf_counter()
    for step in range(calls):
        jax.device_get(policy(params, jax.device_put(first_obs[0], actor_devices[0]), step))
    t_infer = (time.perf_counter() - start) / (calls * args.local_num_envs)

    # One rollout per actor thread, played by the script's own actors, as the learner receives them.
    sizes_one = dataclasses.replace(sizes, num_updates=1)
    stop = threading.Event()
    run = SimpleNamespace(
        stop=stop,
        failures=[],
        episodes=lambda n: Episodes(
            NoWriter(), deque(maxlen=100), np.zeros(n), np.zeros(n, dtype=np.int64)
        ),
    )
    replicated = replicate(state, learner_devices)
    actors = start_actor_threads(
        script.actor_thread,
        actor_devices,
        args=args,
        run=run,
        lag=LagRule(first_update=1, num_updates=1, concurrency=False, on_resume="restart_lag"),
        sizes=sizes_one,
        network=network,
        learner_devices=learner_devices,
        env_record=None,
    )
    actors.send_first(first_replica(replicated.params))
    rollouts = tuple(queue_get(q, stop).data for q in actors.rollout_queues)
    stop.set()
    update_fn = script.make_update(
        args,
        learner_devices,
        rolled=rolls(learner_devices[0].platform, has_image_observations(args.env_id)),
    )
    replicated, _ = update_fn(replicated, rollouts, np.int32(1))
    jax.block_until_ready(replicated)
    start = time.perf_counter()
    for update in range(2, 2 + repeats):
        replicated, _ = update_fn(replicated, rollouts, np.int32(update))
        jax.block_until_ready(replicated)
    t_learn = (time.perf_counter() - start) / (repeats * sizes.steps_per_update)
    learner_flops = update_flops(args, network, state.params, rollouts)
    separate = (
        not set(actor_devices) & set(learner_devices) and learner_devices[0].platform != "cpu"
    )
    ceiling = 1 / max(t_env + t_infer, t_learn) if separate else 1 / (t_env + t_infer + t_learn)
    return dict(
        t_env=t_env,
        t_infer=t_infer,
        t_learn=t_learn,
        learner_flops_per_second=learner_flops / (t_learn * sizes.steps_per_update),
        ceiling=ceiling,
        separate=separate,
        sizes=sizes,
    )


def update_flops(args, network, params, rollouts) -> float:
    """The FLOPs of one learner update's network passes: XLA's count for the forward and backward
    pass of one microbatch, times the microbatches of the update (every epoch's). Each environment
    contributes the observations its rollout holds (IMPALA's include the bootstrap one)."""
    obs = np.concatenate([np.concatenate(rollout.obs) for rollout in rollouts])
    obs = obs.reshape(-1, *obs.shape[-3:])
    epochs = getattr(args, "update_epochs", 1)
    microbatches = args.num_minibatches * args.gradient_accumulation_steps
    microbatch = obs[: len(obs) // microbatches]

    def passes(params, obs):
        logits, value = network.apply(params, obs)
        return logits.sum() + value.sum()

    compiled = jax.jit(jax.grad(passes)).lower(params, microbatch).compile()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return analysis["flops"] * microbatches * epochs


def fma_peak() -> tuple[float, str]:
    """FLOP/s of this process's CPUs if every core retired two fused multiply-adds of its widest
    vectors per cycle at its nominal clock (two FMA units, as on AMD Zen 2 and later and Intel's
    server cores since Skylake-SP), and the line that says so."""
    info = Path("/proc/cpuinfo").read_text()
    megahertz = float(
        next(line for line in info.splitlines() if line.startswith("cpu MHz")).split(":")[1]
    )
    flags = next(line for line in info.splitlines() if line.startswith("flags")).split()
    lanes = 16 if "avx512f" in flags else 8 if "fma" in flags else 4
    cores = len(os.sched_getaffinity(0))
    model = next(line for line in info.splitlines() if line.startswith("model name")).split(":")[1]
    peak = cores * megahertz * 1e6 * 2 * lanes * 2
    return peak, (
        f"{model.strip()}, {cores} cores at {megahertz:.0f} MHz, {lanes} float32 lanes per FMA "
        f"({'AVX-512' if lanes == 16 else 'AVX2' if lanes == 8 else 'SSE'}): FMA peak "
        f"{peak / 1e9:.0f} GFLOP/s (2 FMA units per core assumed)"
    )


def whole_run(
    script_name: str, argv: list[str], steps_per_update: int, updates: int, work_dir: Path
) -> dict:
    """The script as a user runs it: steady SPS, the stage times it logged per environment step,
    peak RSS."""
    run_name = f"{script_name}_{len(list(work_dir.glob('*.log')))}"
    command = [
        str(REPO / "cleanba" / f"{script_name}.py"),
        *argv,
        "--total-timesteps",
        str(updates * steps_per_update),
    ]
    measured = run_measured(
        [*command, "--run-name", run_name], work_dir, work_dir / f"{run_name}.log"
    )
    if measured["exit_code"]:
        raise SystemExit(f"{script_name} failed; see {work_dir / run_name}.log")
    events = EventAccumulator(str(work_dir / "runs" / run_name), size_guidance={"scalars": 0})
    events.Reload()
    versions = events.Scalars("stats/learner_policy_version")
    sps = (versions[-1].step - versions[0].step) / (versions[-1].wall_time - versions[0].wall_time)
    # Per update after the first: an actor thread's seconds over its own environments' steps, the
    # learner's over the whole batch.
    in_run = lambda tag: np.mean([e.value for e in events.Scalars(tag)[1:]])
    threads_steps = int(LAYOUT[LAYOUT.index("--local-num-envs") + 1]) * int(
        LAYOUT[LAYOUT.index("--num-steps") + 1]
    )
    return dict(
        sps=sps,
        peak_rss_gib=measured["peak_rss_gib"],
        run_env=in_run("stats/env_step_time") / threads_steps,
        run_infer=in_run("stats/inference_time") / threads_steps,
        run_learn=in_run("stats/learn_time") / steps_per_update,
        run_rollout=in_run("stats/rollout_time") / threads_steps,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", nargs="+", default=["cleanba_ppo", "cleanba_impala"])
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    parser.add_argument(
        "--repeats", type=int, default=3, help="rollouts of environment steps and updates timed"
    )
    parser.add_argument(
        "--updates", type=int, default=6, help="updates of each whole run (the first compiles)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="default: benchmark/results/throughput_<platform>.md"
    )
    options = parser.parse_args()
    platform_name = jax.devices()[0].platform
    peak, peak_line = fma_peak()
    rows = []
    with tempfile.TemporaryDirectory() as work_dir:
        for script_name in options.scripts:
            script = importlib.import_module(f"cleanba.{script_name}")
            for network in options.networks:
                argv = [*LAYOUT, *NETWORKS[network]]
                stages = stage_times(script, argv, options.repeats)
                run = whole_run(
                    script_name=script_name,
                    argv=argv,
                    steps_per_update=stages["sizes"].steps_per_update,
                    updates=options.updates,
                    work_dir=Path(work_dir),
                )
                us = lambda seconds: f"{seconds * 1e6:.0f}"
                actor_other = run["run_rollout"] - run["run_env"] - run["run_infer"]
                rows.append(
                    f"| {script_name} | {network} | {run['sps']:.0f} | {stages['ceiling']:.0f} | "
                    f"{100 * run['sps'] / stages['ceiling']:.0f} % | {us(stages['t_env'])} | "
                    f"{us(stages['t_infer'])} | {us(stages['t_learn'])} | {us(run['run_env'])} / "
                    f"{us(run['run_infer'])} / {us(actor_other)} / {us(run['run_learn'])} | "
                    f"{run['peak_rss_gib']:.1f} | {stages['learner_flops_per_second'] / 1e9:.1f} "
                    f"({100 * stages['learner_flops_per_second'] / peak:.1f} %) |"
                )
                print(rows[-1], flush=True)
    formula = (
        "1 / max(t_env + t_infer, t_learn)"
        if stages["separate"]
        else "1 / (t_env + t_infer + t_learn)"
    )
    out = options.out or REPO / "benchmark" / "results" / f"throughput_{platform_name}.md"
    out.write_text(
        f"# Throughput against the ceiling, {platform_name} ({time.strftime('%Y-%m-%d')})\n\n"
        f"{stack_line()}\n\n"
        f"Machine: {platform.machine()}, {jax.device_count()} {platform_name} device(s); "
        f"{peak_line}. Made by "
        "`python benchmark/throughput.py`: Breakout-v5, 2 actor threads x 8 environments, 32 steps "
        f"per rollout, the script's other defaults; {options.updates} updates per whole run. "
        f"Ceiling = {formula}.\n\n"
        "Stage times are microseconds per environment step: alone (a, b, c), and as the run logged "
        "them (an actor thread's env step / inference / the rest of its rollout loop, and the "
        "learner's update). The learner's GFLOP/s: its update's network passes alone, with the "
        "share of the FMA peak.\n\n"
        "| script | network | SPS | ceiling | SPS / ceiling | t_env (a) | t_infer (b) "
        "| t_learn (c) | in the run: env / infer / actor other / learn | peak RSS (GiB) "
        "| learner GFLOP/s (share of peak) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    print(out.read_text())


if __name__ == "__main__":
    # The stages alone run in this process: with the allocator the scripts give themselves.
    restart_with_huge_pages()
    main()
