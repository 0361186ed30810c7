"""The cost of Ape-X DQN's replay against the learner's step, at the script's defaults (Breakout-v5, a
full replay of 2M transitions, 128 environments x 32 steps per rollout, batch 512, the default
IMPALA ResNet).

python benchmark/replay_apex.py --date 2026-11-21      # needs about 17 GiB of free memory at 2M

Fills every slot of the replay (frames written, so that their pages are resident), then times the
median of repeats of: inserting one rollout of every environment, sampling a batch (stacks rebuilt
from single frames, importance weights), updating the batch's priorities, and one learner update
(pmap'd, on one device). The replay's work per learner update is sample + priority update + insert /
--updates-per-rollout. Writes benchmark/results/replay_apex.md.
"""

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from cleanba import cleanba_apex_dqn as apex
from cleanba_utils import parsing, sum_tree
from cleanba_utils.run_files import first_replica, replicate

REPO = Path(__file__).resolve().parents[1]


def median_seconds(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        function()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def filled_replay(args, num_envs: int, rng) -> dict:
    replay = apex.make_replay(args, num_envs)
    capacity = len(replay["valid"])
    chunk = 1 << 16
    for start in range(0, capacity, chunk):  # distinct bytes in every page: no shared zero pages
        replay["frames"][start : start + chunk] = (start // chunk) % 251
    replay["episode_step"][:] = 255
    replay["offsets"][:] = args.n_step
    replay["actions"][:] = rng.integers(0, 18, capacity)
    replay["returns"][:] = rng.normal(size=capacity)
    replay["discounts"][:] = args.gamma**args.n_step
    replay["valid"][:] = True
    sum_tree.set_weights(
        replay["tree"], np.arange(capacity), rng.uniform(0.01, 2.0, capacity) ** 0.6
    )
    replay["steps"] = 10 * replay["ring"] + 7  # mid-ring: inserts wrap around the ring's end
    return replay


def rollout(args, num_envs: int, rng) -> dict:
    shape = (num_envs, args.num_steps)
    return dict(
        env_ids=np.arange(num_envs),
        frames=rng.integers(0, 255, (*shape, 84, 84), dtype=np.uint8),
        episode_step=np.full(shape, 255, np.uint8),
        actions=rng.integers(0, 18, shape).astype(np.int32),
        returns=rng.normal(size=shape).astype(np.float32),
        discounts=np.full(shape, args.gamma**args.n_step, np.float32),
        offsets=np.full(shape, args.n_step, np.uint8),
        valid=np.ones(shape, bool),
        priorities=rng.uniform(0, 2, shape).astype(np.float32),
    )


def replay_seconds(args, repeats: int):
    """(insert, sample, priority update, fill) seconds, and a sampled batch; the replay is freed on
    return."""
    rng = np.random.default_rng(0)
    num_envs = apex.sizes_of(args, 1).num_envs
    tic = time.time()
    replay = filled_replay(args, num_envs, rng)
    fill_seconds = time.time() - tic
    data = rollout(args, num_envs, rng)
    insert = median_seconds(
        lambda: apex.replay_insert(replay, data, args.n_step, args.priority_exponent), 10
    )
    batch_rng = np.random.default_rng(1)
    sample_once = lambda: apex.replay_sample(
        replay, args.batch_size, batch_rng, args.importance_sampling_exponent
    )
    sample = median_seconds(sample_once, repeats)
    batch, slots = sample_once()
    new_priorities = rng.uniform(0, 2, args.batch_size) ** args.priority_exponent
    update_priorities = median_seconds(
        lambda: sum_tree.set_weights(replay["tree"], slots, new_priorities), repeats
    )
    return (insert, sample, update_priorities, fill_seconds), batch


def learner_step_seconds(args, batch, repeats: int) -> float:
    sizes = apex.sizes_of(args, 1)
    _, state, _ = apex.init_state(args, sizes)
    device = jax.local_devices()[0]
    state = replicate(state, [device])
    update = apex.make_update(args, [device])
    shards = {key: value[None] for key, value in batch.items()}

    def step():
        nonlocal state
        state, _, td = update(state, shards)
        np.asarray(first_replica(td))

    step()  # compiles
    return median_seconds(step, repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffer-size", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--learner-repeats", type=int, default=5)
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmark" / "results" / "replay_apex.md"
    )
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    options = parser.parse_args()
    args = apex.Args(buffer_size=options.buffer_size)
    parsing.check_memory(args, "buffer_size", apex.replay_bytes(args), apex.MEMORY_RESERVE_BYTES)
    (insert, sample, update_priorities, fill_seconds), batch = replay_seconds(args, options.repeats)
    learner = learner_step_seconds(args, batch, options.learner_repeats)

    per_update = sample + update_priorities + insert / args.updates_per_rollout
    rows = [
        ("insert one rollout (128 envs x 32 steps, 29 MB of frames)", insert),
        ("sample 512 (tree descent, stacks and next stacks rebuilt, IS weights)", sample),
        ("update 512 priorities", update_priorities),
        (
            f"replay work per learner update (sample + update + insert / {args.updates_per_rollout})",
            per_update,
        ),
        ("one learner update (default network, batch 512, 1 device)", learner),
    ]
    command = "python benchmark/replay_apex.py " + " ".join(sys.argv[1:])
    lines = [
        f"# Ape-X DQN replay vs learner step ({options.date})",
        "",
        f"Machine: {platform.machine()}, 2 CPU cores shared with other jobs, Python {platform.python_version()}, "
        f"JAX {jax.__version__} on {jax.devices()[0].platform}. Made by `{command}`.",
        "",
        f"Replay of {options.buffer_size:,} transitions ({apex.replay_bytes(args) / 2**30:.1f} GiB, "
        f"{apex.replay_bytes(args) / options.buffer_size:.0f} bytes per transition), every slot filled "
        f"(in {fill_seconds:.0f} s). Medians of {options.repeats} repeats (10 for inserts, "
        f"{options.learner_repeats} for the learner).",
        "",
        "| operation | milliseconds |",
        "|---|---|",
        *[f"| {name} | {seconds * 1000:.2f} |" for name, seconds in rows],
        "",
        f"Replay work is **{100 * per_update / learner:.2f} %** of the learner's step (target: at most 5 %).",
        "",
    ]
    options.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
