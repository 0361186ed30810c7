"""The cost of Ape-X DQN's replay against the learner's step, at the script's defaults (Breakout-v5,
a full replay of 2M transitions, 128 environments x 32 steps per rollout, batch 512, the Nature
CNN).

python benchmark/replay_apex.py --date 2026-11-23      # needs about 16 GiB of free memory at 2M

Fills every slot of the replay (frames written, so that their pages are resident), then times:
- the median of repeats of inserting one rollout of every environment, sampling a batch (stacks
  rebuilt from single frames, importance weights) and writing a batch's priorities;
- the learner's loop (`learn`, 50 optimizer steps) with the update replaced by a stand-in that
  sleeps 20 ms, as a GPU step might take, pipelined (the next batch sampled while the update runs)
  and serial (`--no-pipeline`): pipelined it should make at least 95 % of 50 steps per second,
  serial 1 / (20 ms + sample + priority write);
- the learner's real step on this machine's CPU, after compilation (median of a few).
Reports the peak resident memory, and writes benchmark/results/replay_apex.md.
"""

import argparse
import dataclasses
import platform
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from cleanba import cleanba_apex_dqn as apex
from cleanba_utils import parsing
from cleanba_utils.devices import first_replica, replicate
from cleanba_utils.replay.prioritized_learning import write_priorities
from cleanba_utils.threads import BackgroundJobs

REPO = Path(__file__).resolve().parents[1]
STAND_IN_SECONDS = 0.02
PIPELINE_STEPS = 50


def median_seconds(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        function()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def rollout(args, num_envs: int, length: int, rng, fill: int) -> apex.Transitions:
    """Synthetic transitions of `length` steps of every environment, all valid; frames of value
    `fill` (distinct bytes in every page written: no shared zero pages)."""
    shape = (num_envs, length)
    return apex.Transitions(
        env_ids=np.arange(num_envs),
        frames=np.full((*shape, 84, 84), fill % 251, np.uint8),
        episode_step=np.full(shape, 255, np.uint8),
        actions=rng.integers(0, 18, shape).astype(np.int32),
        returns=rng.normal(size=shape).astype(np.float32),
        discounts=np.full(shape, args.gamma**args.n_step, np.float32),
        offsets=np.full(shape, args.n_step, np.uint8),
        valid=np.ones(shape, bool),
        priorities=rng.uniform(0, 2, shape).astype(np.float32),
    )


def filled_replay(args, num_envs: int, rng) -> apex.Replay:
    replay = apex.make_replay(args, num_envs)
    chunk = 256
    for index in range(-(-replay.frames.ring // chunk)):
        apex.replay_insert(replay, rollout(args, num_envs, chunk, rng, fill=index), args.n_step)
    return replay


def stand_in_update(state, shards):
    """What the learner gets from `update_fn`, 20 ms after it asked: the state, metrics and TD
    errors (a device array, as the pmap'd update's)."""
    time.sleep(STAND_IN_SECONDS)
    return state, {}, STAND_IN_TD


STAND_IN_TD = None


def steps_per_second(args, replay, pipeline: bool) -> float:
    """`learn` for PIPELINE_STEPS optimizer steps with the stand-in update."""
    stop = threading.Event()
    jobs = BackgroundJobs("replay", stop, [])
    loop_args = dataclasses.replace(args, updates_per_rollout=PIPELINE_STEPS, pipeline=pipeline)
    tic = time.perf_counter()
    _, _, pending = apex.learn(
        loop_args,
        replay=replay,
        jobs=jobs,
        state=None,
        update_fn=stand_in_update,
        first_step=0,
        pending=None,
    )
    jobs.wait(jobs.submit(lambda: write_priorities(replay.transitions, pending)))
    seconds = time.perf_counter() - tic
    stop.set()
    return PIPELINE_STEPS / seconds


def learner_step_seconds(args, batch, repeats: int) -> float:
    sizes = apex.sizes_of(args, 1)
    _, state, _ = apex.init_state(args, sizes)
    device = jax.local_devices()[0]
    state = replicate(state, [device])
    update_fn = apex.make_update(args, [device])
    shards = jax.tree.map(lambda value: value[None], batch)

    def step():
        nonlocal state
        state, _, td = update_fn(state, shards)
        np.asarray(first_replica(td))

    step()  # compiles
    return median_seconds(step, repeats)


def main():
    global STAND_IN_TD
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffer-size", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--learner-repeats", type=int, default=3)
    parser.add_argument("--shared", default="", help="how the machine was shared, for the report")
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmark" / "results" / "replay_apex.md"
    )
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    options = parser.parse_args()
    args = apex.Args(buffer_size=options.buffer_size)
    sizes = apex.sizes_of(args, 1)
    replay_bytes = apex.replay_bytes(args, sizes.num_envs)
    parsing.check_memory(args, "buffer_size", replay_bytes, apex.MEMORY_RESERVE_BYTES)
    rng = np.random.default_rng(0)
    tic = time.time()
    replay = filled_replay(args, sizes.num_envs, rng)
    fill_seconds = time.time() - tic
    data = rollout(args, sizes.num_envs, args.num_steps, rng, fill=7)
    insert = median_seconds(lambda: apex.replay_insert(replay, data, args.n_step), 10)
    batch_rng = np.random.default_rng(1)
    sample_once = lambda: apex.replay_sample(
        replay, args.batch_size, batch_rng, args.importance_sampling_exponent
    )
    sample = median_seconds(sample_once, options.repeats)
    batch, drawn = sample_once()
    new_priorities = rng.uniform(0, 2, args.batch_size)
    write = median_seconds(
        lambda: replay.transitions.update_priorities(
            drawn.slots, new_priorities, sampled_at=drawn.inserted
        ),
        options.repeats,
    )
    STAND_IN_TD = jnp.zeros((1, args.batch_size))
    # Untimed first: the first loop pays one-off costs (the first device_get of the TD errors, the
    # job thread's start, cold pages of the trees), which would fall on whichever mode ran first.
    steps_per_second(args, replay, pipeline=True)
    pipelined = steps_per_second(args, replay, pipeline=True)
    serial = steps_per_second(args, replay, pipeline=False)
    learner = learner_step_seconds(args, batch, options.learner_repeats)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30

    per_update = sample + write + insert / args.updates_per_rollout
    rows = [
        (f"insert one rollout ({sizes.num_envs} envs x {args.num_steps} steps)", insert),
        ("sample 512 (tree descent, stacks and next stacks rebuilt, IS weights)", sample),
        ("write 512 priorities", write),
        (
            f"replay work per optimizer step (sample + write + insert / "
            f"{args.updates_per_rollout})",
            per_update,
        ),
        ("one learner step on this CPU (Nature CNN, batch 512, 1 device)", learner),
    ]
    shown = [argument if argument != options.shared else '"..."' for argument in sys.argv[1:]]
    command = "python benchmark/replay_apex.py " + " ".join(shown)
    ideal = 1 / STAND_IN_SECONDS
    lines = [
        f"# Ape-X DQN replay vs learner step ({options.date})",
        "",
        f"Machine: {platform.machine()}, 2 CPU cores, Python {platform.python_version()}, "
        f"JAX {jax.__version__} on {jax.devices()[0].platform}. Made by `{command}`. "
        f"{options.shared}",
        "",
        f"Replay of {options.buffer_size:,} transitions ({replay_bytes / 2**30:.1f} GiB, "
        f"{replay_bytes / options.buffer_size:.0f} bytes per transition), every slot filled "
        f"(in {fill_seconds:.0f} s). Medians of {options.repeats} repeats (10 for inserts, "
        f"{options.learner_repeats} for the learner). Peak resident memory of the process: "
        f"{peak_gib:.1f} GiB.",
        "",
        "| operation | milliseconds |",
        "|---|---|",
        *[f"| {name} | {seconds * 1000:.2f} |" for name, seconds in rows],
        "",
        f"Replay work per optimizer step / update time: **{per_update / learner:.4f}** for the CPU "
        f"update, **{per_update / STAND_IN_SECONDS:.2f}** for a 20 ms update.",
        "",
        f"The learner's loop (`learn`, {PIPELINE_STEPS} optimizer steps) with the update replaced "
        "by a 20 ms stand-in:",
        "",
        "| learner | optimizer steps per second | of 50 |",
        "|---|---|---|",
        f"| pipelined (default) | {pipelined:.1f} | {100 * pipelined / ideal:.1f} % |",
        f"| serial (`--no-pipeline`) | {serial:.1f} | {100 * serial / ideal:.1f} % |",
        f"| serial, expected 1 / (20 ms + sample + write) | "
        f"{1 / (STAND_IN_SECONDS + sample + write):.1f} | |",
        "",
    ]
    options.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
