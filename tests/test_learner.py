"""The learner update of both scripts on a fixed synthetic rollout, in this process: the rolled
`lax.scan` (the GPU path) and the Python loop over one compiled microbatch step (the CPU path) give
the same parameters, and so does a minibatch split into microbatches with gradient accumulation;
both paths run the steps in the order of the script's schedule."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_abs_difference

from cleanba import cleanba_impala, cleanba_ppo
from cleanba_utils.devices import first_replica, replicate
from cleanba_utils.microbatches import microbatch_update

NUM_ENVS, NUM_STEPS = 8, 8
# Measured 2026-11-21 on CPU (max abs parameter difference after one update of 4 Adam / 2 RMSProp
# steps at learning rate 1e-3): rolled vs loop 8e-8 (PPO) and 3e-8 (IMPALA); 2 or 4 microbatches vs
# 1: 3e-8 for both.
ATOL = 1e-6
SCRIPTS = {
    "ppo": (cleanba_ppo, dict(update_epochs=2, num_minibatches=2, clip_coef=0.2)),
    "impala": (cleanba_impala, dict(num_minibatches=2)),
}


def synthetic_rollout(script, seed=0):
    """One actor's rollout as the learner receives it: (1 learner device, envs, steps, ...), with
    episode ends and envpool's reset steps."""
    rng = np.random.default_rng(seed)
    num_obs = NUM_STEPS + (script is cleanba_impala)
    terminations = rng.random((NUM_ENVS, NUM_STEPS)) < 0.1
    data = dict(
        obs=rng.integers(0, 255, (NUM_ENVS, num_obs, 4, 84, 84), dtype=np.uint8),
        actions=rng.integers(0, 18, (NUM_ENVS, NUM_STEPS)).astype(np.int32),
        logprobs=np.log(rng.uniform(0.02, 0.1, (NUM_ENVS, NUM_STEPS))).astype(np.float32),
        rewards=rng.choice([0.0, 1.0], (NUM_ENVS, NUM_STEPS)).astype(np.float32),
        terminations=terminations,
        truncations=(rng.random((NUM_ENVS, NUM_STEPS)) < 0.05) & ~terminations,
        is_reset=np.concatenate([np.zeros((NUM_ENVS, 1), bool), terminations[:, :-1]], axis=1),
        env_ids=np.arange(NUM_ENVS, dtype=np.int32),
    )
    if script is cleanba_ppo:
        data["values"] = rng.normal(size=(NUM_ENVS, NUM_STEPS + 1)).astype(np.float32)
    return script.Trajectories(**{key: value[None] for key, value in data.items()})


def initial_state(script, **options):
    """The script's arguments for the synthetic rollout (a small ResNet) and its initial learner
    state."""
    args = script.Args(
        env_id="Breakout-v5",
        channels=(4,),
        hiddens=(16,),
        local_num_envs=NUM_ENVS,
        num_actor_threads=1,
        num_steps=NUM_STEPS,
        total_timesteps=NUM_ENVS * NUM_STEPS * 2,
        **options,
    )
    started = script.init_state(args, script.sizes_of(args, 1))[1]
    # Where the run starts (`kept_lag.Origin`): its learner state.
    return args, started.learner


def params_after_update(name, rolled, gradient_accumulation_steps=1):
    script, options = SCRIPTS[name]
    args, state = initial_state(
        script,
        learning_rate=1e-3,
        gradient_accumulation_steps=gradient_accumulation_steps,
        **options,
    )
    devices = jax.local_devices()[:1]
    update_fn = script.make_update(args, devices, rolled=rolled)
    state, metrics = update_fn(replicate(state, devices), (synthetic_rollout(script),), np.int32(1))
    return jax.device_get(first_replica(state.params)), jax.device_get(first_replica(metrics))


@pytest.fixture(scope="module", params=SCRIPTS)
def reference(request):
    return request.param, *params_after_update(request.param, rolled=False)


def test_the_update_moves_the_parameters(reference):
    name, params, _ = reference
    _, initial = initial_state(SCRIPTS[name][0])
    assert max_abs_difference(params, initial.params) > 1e-4


def test_rolled_scan_and_python_loop_agree(reference):
    name, params, metrics = reference
    rolled_params, rolled_metrics = params_after_update(name, rolled=True)
    assert max_abs_difference(params, rolled_params) < ATOL
    for key in metrics:
        np.testing.assert_allclose(rolled_metrics[key], metrics[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("steps", [2, 4])
def test_gradient_accumulation_equals_whole_minibatches(reference, steps):
    name, params, metrics = reference
    accumulated_params, accumulated_metrics = params_after_update(
        name, rolled=False, gradient_accumulation_steps=steps
    )
    assert max_abs_difference(params, accumulated_params) < ATOL
    # Losses are reported per optimizer step, whatever the number of microbatches.
    for key in metrics:
        np.testing.assert_allclose(accumulated_metrics[key], metrics[key], rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_with_the_rolled_scan(reference):
    name, params, _ = reference
    assert (
        max_abs_difference(
            params, params_after_update(name, rolled=True, gradient_accumulation_steps=2)[0]
        )
        < ATOL
    )


@pytest.mark.parametrize("rolled", [False, True])
def test_steps_run_in_schedule_order_and_metrics_are_per_optimizer_step(rolled):
    # Each step appends its flat index as a digit of the state, so the state spells the order.
    schedule = [(epoch, minibatch) for epoch in range(2) for minibatch in range(3)]

    def step(state, prepared, update, epoch, minibatch):
        index = 3 * epoch + minibatch
        return state * 10 + index + prepared, dict(index=index.astype(jnp.float32))

    devices = jax.local_devices()[:1]
    update_fn = microbatch_update(
        prepare=lambda rollouts, update: rollouts * update,
        microbatch_step=step,
        schedule=schedule,
        optimizer_steps=2,
        devices=devices,
        rolled=rolled,
    )
    state, metrics = update_fn(replicate(jnp.zeros(()), devices), jnp.zeros(1), np.int32(1))
    assert first_replica(state) == 12345
    assert first_replica(metrics)["index"] == (0 + 1 + 2 + 3 + 4 + 5) / 2


def test_dataclass_fields_have_docstrings():
    # tyro shows each field's docstring as its --help text; a field without one shows nothing. A
    # script's Args may redeclare a shared field's default alone: the docstring is then its base's.
    for script, _ in SCRIPTS.values():
        for field in dataclasses.fields(script.Args):
            documented = False
            for cls in script.Args.__mro__[:-1]:
                lines = inspect.getsource(cls).splitlines()
                declared = [
                    i for i, text in enumerate(lines) if text.startswith(f"    {field.name}:")
                ]
                documented |= any(lines[i + 1].strip().startswith('"""') for i in declared)
            assert documented, (script.__name__, field.name)
