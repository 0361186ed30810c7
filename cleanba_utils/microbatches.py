"""How a learner update runs on its devices: the microbatch steps of a schedule over one prepared
rollout, in a rolled `lax.scan` or in a Python loop over one compiled step; and, for a learner whose
minibatches are whole environment sequences (IMPALA's, a recurrent core's), which minibatch each
environment joins (`minibatch_ids`). The algorithm (what `prepare` and the step compute, and the
loops the schedule unrolls) stays in the script."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np


def rolls(platform: str, convolutional: bool) -> bool:
    """Whether the update runs its steps in a `lax.scan` (`microbatch_update`'s `rolled`): on GPUs,
    and on a CPU for a network without convolutions, where a loop of calls costs a dispatch per
    step. XLA's CPU backend runs convolutions slower inside a loop than outside one, so a CPU's
    convolutional network loops in Python over one compiled step (an unrolled loop would keep every
    step's activations alive)."""
    return platform != "cpu" or not convolutional


def minibatch_ids(key, env_ids, num_minibatches):
    """Environment g goes to minibatch perm[g % M] of its block of M = num_minibatches consecutive
    indices, perm being a random permutation keyed by the block: the global index alone decides, and
    a device that holds whole blocks has equally many environments in every minibatch."""
    block_permutation = lambda g: jax.random.permutation(
        jax.random.fold_in(key, g // num_minibatches), num_minibatches
    )
    return jax.vmap(lambda g: block_permutation(g)[g % num_minibatches])(env_ids)


def microbatch_update(
    prepare,
    microbatch_step,
    schedule: list[tuple[int, ...]],
    optimizer_steps: int,
    devices: list,
    rolled: bool,
    on_step_timed=None,
):
    """`update_fn(state, rollouts, update) -> (state, metrics)`, pmap'd over `devices` (axis
    "devices").

    `prepare(rollouts, update)` turns the rollouts into what every step reads; `schedule` lists the
    loop indices of each microbatch step in the order the steps run (the script's nested loops, e.g.
    `(epoch, minibatch, microbatch)`); `microbatch_step(state, prepared, update, *indices)` makes
    one step and returns its metrics as shares of its minibatch's, so the metrics of the update are
    their sum per optimizer step.

    Memory holds one microbatch's activations either way. `rolled` runs the steps in a `lax.scan`,
    which compiles once and fast; otherwise a Python loop calls one compiled step (`rolls`). The two
    give the same run up to float rounding.

    `on_step_timed(seconds, steps)`: called once, by the Python loop's first update, with the
    seconds of its second step (compiled by then) and the steps of an update: a run on a CPU learns
    its learner's pace minutes before its first update ends."""
    per_optimizer_step = lambda metrics: jax.tree.map(
        lambda m: m.sum(-1) / optimizer_steps, metrics
    )
    pmap = functools.partial(jax.pmap, axis_name="devices", devices=devices)
    if rolled:

        def rolled_update(state, rollouts, update):
            prepared = prepare(rollouts, update)
            step = lambda state, indices: microbatch_step(state, prepared, update, *indices)
            state, metrics = jax.lax.scan(step, state, jnp.asarray(schedule, dtype=jnp.int32))
            return state, per_optimizer_step(metrics)

        return pmap(rolled_update, in_axes=(0, 0, None))

    num_indices = len(schedule[0])
    prepare_on_devices = pmap(prepare, in_axes=(0, None))
    step_on_devices = pmap(microbatch_step, in_axes=(0, 0, None, *[None] * num_indices))

    step_to_time = on_step_timed is not None and len(schedule) > 1

    def update_fn(state, rollouts, update):
        nonlocal step_to_time
        prepared = prepare_on_devices(rollouts, update)
        metrics = []
        for number, indices in enumerate(schedule):
            timed = step_to_time and number == 1
            if timed:
                jax.block_until_ready(state)
                start = time.time()
            state, step_metrics = step_on_devices(
                state, prepared, update, *[np.int32(index) for index in indices]
            )
            if timed:
                jax.block_until_ready(state)
                step_to_time = False
                on_step_timed(time.time() - start, len(schedule))
            metrics.append(step_metrics)
        return state, per_optimizer_step(jax.tree.map(lambda *m: jnp.stack(m, axis=-1), *metrics))

    return update_fn
