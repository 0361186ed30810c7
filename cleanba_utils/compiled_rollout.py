"""An actor thread's rollout compiled as one program, as the continuous-control scripts (SAC,
continuous PPO, Ape-X DPG) play theirs and every script plays a JAX environment's: the steps of the
script's policy and of the environments (envpool's XLA interface or a JAX environment's own step,
`envs.compiled_step`) in one `lax.scan`, with no Python call and no copy to the host per step; then,
step by step in Python, what the steps mean for the environments' records (`env_records`, which a
checkpoint holds to bring them back) and for the episodes logged.

The script gives its policy's step, `act(params, obs, env_ids, step, step_input) -> (env_actions,
outputs)`: the actions the environments receive and its own per-step outputs (a NamedTuple: the
sampled actions, log-probabilities, values…), `env_ids` the environments' global indices (NumPy, a
constant of the program) and `step` the policy step of the run (0, 1, …). It gets back the rollout
as `rollout_steps.PlayedRollout`, its `Steps` env-major (envs, steps, ...). A network with a
recurrent core acts with its state, which the program carries from step to step
(`rollout_steps`).

Made and called with 64-bit types on for envpool (`envs.needs_x64`; `jax.enable_x64`, for the
calling thread only): envpool's MuJoCo and dm_control tasks take float64 actions and give float64
observations and rewards; every array of the policy stays float32. A JAX environment computes in its
own types, its observations and rewards cast to float32 at its boundary (`jax_envs`). The
computation is that of a call of the policy per step; XLA fuses the loop otherwise, which can round
the actions differently in the last place."""

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cleanba_utils import env_records, jax_envs
from cleanba_utils.env_records import EnvRecord
from cleanba_utils.envs import compiled_step, flat_observation, needs_x64
from cleanba_utils.episodes import Episodes
from cleanba_utils.rollout_steps import EpisodeEnd, PlayedRollout, Steps


@dataclasses.dataclass
class CompiledRollout:
    """An actor thread's environments and their compiled rollout (`start`); `play` plays the next
    rollout."""

    envs: Any
    """the envpool instance (held while the program steps it through its handle) or the
    `jax_envs.JaxVectorEnv`"""
    handle: Any
    """the environments' handle (envpool's, or a JAX environment's state), which each compiled
    rollout takes and gives back"""
    program: Callable
    record: EnvRecord
    episodes: Any
    next_obs: np.ndarray
    next_is_reset: np.ndarray
    num_steps: int
    num_envs: int
    """the run's environments (global steps count them)"""
    device: Any = None
    """where the program runs: the actor's device, to which `play` puts the parameters (None: where
    they are)"""
    core_state: Any = None
    """the recurrent core's state that the next rollout's first step meets (None: no core)"""

    def play(self, params, update: int, step_inputs=None) -> PlayedRollout:
        """The rollout of `update` with `params`, its steps' policy steps (update - 1) x
        --num-steps onwards; `step_inputs` (steps, ...) are what `act` takes at each step (SAC:
        whether it acts at random), or None."""
        first_step = (update - 1) * self.num_steps
        if self.device is not None:
            params = jax.device_put(params, self.device)
        start = time.time()
        with jax.enable_x64(needs_x64(self.envs)):
            first_core_state = self.core_state
            core = None if first_core_state is None else (first_core_state, self.next_is_reset)
            self.handle, steps, last_obs, bootstrap_value, core = self.program(
                handle=self.handle,
                params=params,
                obs=self.next_obs,
                first_step=np.int32(first_step),
                step_inputs=step_inputs,
                core=core,
            )
            steps = jax.device_get(steps)
            if core is not None:
                self.core_state = core[0]
        env_step_time = time.time() - start
        obs, env_actions, outputs, rewards, terminations, truncations = steps
        is_reset = np.zeros(terminations.shape, bool)
        episode_ends = []
        for step in range(self.num_steps):
            env_records.record_step(self.record, env_actions[step], self.next_is_reset)
            is_reset[step] = self.next_is_reset
            done = terminations[step] | truncations[step]
            global_step = (first_step + step) * self.num_envs
            finished = self.episodes.step(rewards[step], done, self.next_is_reset, global_step)
            episode_ends += [
                EpisodeEnd(global_step, int(env), episode_return)
                for env, episode_return in zip(np.flatnonzero(done), finished)
            ]
            self.next_is_reset = done
        self.next_obs = np.asarray(last_obs)
        if isinstance(self.record, jax_envs.EnvsState):
            self.record = jax.device_get(self.handle)
        env_major = lambda x: np.swapaxes(x, 0, 1)
        steps = Steps(
            obs=env_major(obs),
            env_actions=env_major(env_actions),
            outputs=jax.tree.map(env_major, outputs),
            rewards=env_major(rewards),
            terminations=env_major(terminations),
            truncations=env_major(truncations),
            is_reset=env_major(is_reset),
        )
        return PlayedRollout(
            steps=steps,
            next_obs=self.next_obs,
            bootstrap_value=bootstrap_value,
            record=env_records.copy_of(self.record),
            episode_ends=episode_ends,
            inference_time=0.0,
            env_step_time=env_step_time,
            first_core_state=None if first_core_state is None else jax.device_get(first_core_state),
            next_core_state=None if core is None else jax.device_get(self.core_state),
        )


def start(
    make_env: Callable,
    args,
    episodes: Episodes,
    num_envs: int,
    env_offset: int,
    env_record: EnvRecord | None,
    act: Callable,
    bootstrap: Callable | None = None,
    device=None,
    core_state=None,
) -> CompiledRollout:
    """The environments env_offset .. env_offset + --local-num-envs - 1 of the run's `num_envs` (the
    script's `make_env(args, seed, num_envs)`, seeded --seed + env_offset onwards) and the compiled
    rollout of --num-steps steps of `act` on them, their episodes counted in `episodes`
    (`RunLogs.episodes`). A fresh run (`env_record` None) resets them; a resumed one brings them to
    their part of `env_record`, every environment's at the checkpoint (`env_records.fast_forward`),
    and the episodes' running sums with them. `device`: the actor thread's, where the program runs
    (None: wherever the parameters are). `core_state`: the recurrent core's state of the thread's
    environments before the first rollout (`cores`: zeros, or a resumed run's), with which `act`
    and `bootstrap(params, obs, core_state)` take the state; None without a core."""
    envs = make_env(args, args.seed + env_offset, args.local_num_envs)
    env_ids = np.arange(env_offset, env_offset + args.local_num_envs, dtype=np.int32)

    def step(carry, step_input):
        handle, obs, params, core = carry
        policy_step, inputs = step_input
        if core is None:
            env_actions, outputs = act(params, obs, env_ids, policy_step, inputs)
        else:
            core_state, is_reset = core
            env_actions, outputs, core_state = act(
                params, obs, env_ids, policy_step, inputs, core_state, is_reset
            )
        handle, next_obs, rewards, terminations, truncations = step_envs(
            handle, env_actions, policy_step
        )
        if core is not None:
            # The step after an episode's end is a reset step.
            core = (core_state, terminations | truncations)
        played = (obs, env_actions, outputs, rewards, terminations, truncations)
        return (handle, next_obs, params, core), played

    @jax.jit
    def program(handle, params, obs, first_step, step_inputs, core):
        steps = first_step + jnp.arange(args.num_steps, dtype=jnp.int32)
        carry = (handle, obs, params, core)
        (handle, obs, _, core), played = jax.lax.scan(step, carry, (steps, step_inputs))
        if bootstrap is None:
            bootstrap_value = None
        elif core is None:
            bootstrap_value = bootstrap(params, obs)
        else:
            bootstrap_value = bootstrap(params, obs, core[0])
        return handle, played, obs, bootstrap_value, core

    if env_record is None:
        record = env_records.empty_record(args.local_num_envs, args.env_id, args.env_params)
        obs = envs.reset()[0]
        next_obs = (
            np.asarray(obs) if isinstance(envs, jax_envs.JaxVectorEnv) else flat_observation(obs)
        )
        next_is_reset = np.zeros(args.local_num_envs, bool)
    else:
        record = env_records.part(env_record, slice(env_offset, env_offset + args.local_num_envs))
        next_obs, next_is_reset = env_records.fast_forward(
            envs, record, on_step=episodes.replayed_step
        )
        if isinstance(record, jax_envs.EnvsState):
            episodes.resume_running(record)
    with jax.enable_x64(needs_x64(envs)):
        handle, step_envs = compiled_step(envs)
    if device is not None:
        handle = jax.device_put(handle, device)
        core_state = jax.device_put(core_state, device)
    return CompiledRollout(
        envs=envs,
        handle=handle,
        program=program,
        record=record,
        episodes=episodes,
        next_obs=next_obs,
        next_is_reset=next_is_reset,
        num_steps=args.num_steps,
        num_envs=num_envs,
        device=device,
        core_state=core_state,
    )
