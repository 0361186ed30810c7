"""An actor thread's environments as several envpool instances stepped in turn: double-buffered
sampling (Sample Factory's `worker_num_splits`). While envpool's worker threads step one split, the
actor thread receives the next split's observations, infers its actions and sends them, so the
network's inference and the copies between host and device hide behind the environments' stepping
instead of adding to it.

Deterministic, unlike envpool's asynchronous `recv`: each split is its own instance, a contiguous
block of the thread's environments seeded as one instance would seed them (environment i with `seed
+ i`), and its synchronous `recv` gives back exactly the environments it was sent. With actions
drawn per environment, the data are those of one instance, step for step, whatever the number of
splits.

`start_splits` gives an actor thread's rollouts the compiled rollout's interface (`rollout_steps`):
the script's policy step in the same signature, the steps env-major, the episodes counted here."""

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cleanba_utils import env_records
from cleanba_utils.env_ids import is_jax_env
from cleanba_utils.env_records import EnvRecord
from cleanba_utils.episodes import Episodes
from cleanba_utils.evaluation_episodes import ended
from cleanba_utils.rollout_steps import EpisodeEnd, PlayedRollout, Steps


class EnvStep(NamedTuple):
    """One step of every environment of the thread, in environment order."""

    actions: np.ndarray
    outputs: object
    """what `act` returned beside the actions (a pytree of NumPy or device arrays: whatever the
    script keeps of the observations and of its inference)"""
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    info: dict
    """envpool's, its environment indices (`env_id`) the thread's"""
    is_reset: np.ndarray
    """envpool's step after an episode's end: it ignores the action, returns the first observation
    of the next episode and belongs to no episode"""


class Played(NamedTuple):
    steps: list[EnvStep]
    """the rollout's steps, in order"""
    inference_time: float
    """seconds in `act` (inference and copies)"""
    env_step_time: float
    """seconds waiting for envpool's `recv`"""


def _join(parts: list):
    """The splits' pytrees joined along the environment axis (NumPy stays NumPy)."""
    if len(parts) == 1:
        return parts[0]
    return jax.tree.map(
        lambda *xs: np.concatenate(xs) if isinstance(xs[0], np.ndarray) else jnp.concatenate(xs),
        *parts,
    )


def _with_thread_env_ids(info: dict, first: int) -> dict:
    """A split's `info` with its environments' indices (`env_id`, also under `players` for Atari)
    counted among the thread's, not the split's."""
    if not first:
        return info
    info = dict(info)
    if "env_id" in info:
        info["env_id"] = info["env_id"] + first
    if isinstance(info.get("players"), dict) and "env_id" in info["players"]:
        info["players"] = {**info["players"], "env_id": info["players"]["env_id"] + first}
    return info


class SplitEnvs:
    """`num_envs` environments as `num_splits` envpool instances made by `make(seed, num_envs)`,
    reset at once. `env_slices[s]`: the environments of split s; `env_ids`: their indices (int32,
    the thread's first is 0 unless `of_actor_thread` counts them among the run's). `next_obs`: every
    environment's observation to act on next (host, environment order)."""

    def __init__(self, make: Callable, seed: int, num_envs: int, num_splits: int):
        self.env_ids = np.arange(num_envs, dtype=np.int32)
        blocks = np.array_split(np.arange(num_envs), num_splits)
        self.env_slices = [slice(int(block[0]), int(block[-1]) + 1) for block in blocks]
        self.instances = [make(seed + s.start, s.stop - s.start) for s in self.env_slices]
        self.split_obs = [instance.reset()[0] for instance in self.instances]
        self.is_reset = np.zeros(num_envs, dtype=bool)

    @classmethod
    def of_actor_thread(cls, make_env: Callable, args, env_offset: int) -> "SplitEnvs":
        """An actor thread's environments: global indices env_offset .. env_offset +
        --local-num-envs - 1 (`env_ids`), in --env-splits splits (one for a script without the
        option: the continuous scripts), made by the script's `make_env(args, seed, num_envs)`
        from the run's seed."""
        envs = cls(
            lambda seed, num_envs: make_env(args, seed, num_envs),
            seed=args.seed + env_offset,
            num_envs=args.local_num_envs,
            num_splits=getattr(args, "env_splits", 1),
        )
        envs.env_ids = envs.env_ids + np.int32(env_offset)
        return envs

    @property
    def next_obs(self):
        return _join(self.split_obs)

    def bring_back(self, record: EnvRecord, on_step: Callable):
        """Brings every split's environments to where `record` (the thread's) left them
        (`env_records.fast_forward`); `on_step(env_ids, reward, terminated, truncated)` sees each
        replayed step, its environments counted among the thread's."""
        for split, (instance, envs) in enumerate(zip(self.instances, self.env_slices)):
            shifted = lambda env_ids, *step, first=envs.start: on_step(env_ids + first, *step)
            obs, is_reset = env_records.fast_forward(
                instance, env_records.part(record, envs), on_step=shifted
            )
            self.split_obs[split] = obs
            self.is_reset[envs] = is_reset

    def play(self, first_step: int, num_steps: int, act: Callable, record: Callable) -> Played:
        """Plays steps `first_step` .. `first_step + num_steps - 1` of every environment. At step
        t, for each split in turn, `act(t, split, obs, is_reset)` gets the split's observations
        (host) and which of its environments play a reset step, and returns its actions (host) and
        what else to keep; the actions go to the split's instance,
        whose worker threads step them while the next splits take their turn. Once step t's results
        are in for every split, `record(t, EnvStep)` gets them while the environments play step
        t + 1."""
        steps = []
        inference_time = 0.0
        env_step_time = 0.0
        playing = None
        for step in range(first_step, first_step + num_steps + 1):
            results = []
            chosen = []
            for split, instance in enumerate(self.instances):
                is_reset = self.is_reset[self.env_slices[split]]
                if playing:
                    tic = time.time()
                    obs, rewards, terminations, truncations, info = instance.recv()
                    env_step_time += time.time() - tic
                    info = _with_thread_env_ids(info, self.env_slices[split].start)
                    results.append((rewards, terminations, truncations, info))
                    self.split_obs[split] = obs
                    # The step after an episode's end is a reset step.
                    is_reset = terminations | truncations
                if step < first_step + num_steps:
                    tic = time.time()
                    actions, outputs = act(step, split, self.split_obs[split], is_reset)
                    inference_time += time.time() - tic
                    instance.send(actions)
                    chosen.append((actions, outputs))
            if playing:
                rewards, terminations, truncations, info = (_join(r) for r in zip(*results))
                actions, outputs = playing
                steps.append(
                    EnvStep(
                        actions=actions,
                        outputs=outputs,
                        rewards=rewards,
                        terminations=terminations,
                        truncations=truncations,
                        info=info,
                        is_reset=self.is_reset,
                    )
                )
                record(step - 1, steps[-1])
                self.is_reset = terminations | truncations
            playing = tuple(_join(list(part)) for part in zip(*chosen)) if chosen else None
        return Played(steps=steps, inference_time=inference_time, env_step_time=env_step_time)


def default_splits(args, platform: str) -> int:
    """--env-splits left unset: 2 on a GPU (1 for a thread with one environment), where inference
    hides behind the stepping of the other split; 1 on a CPU, where inference would take the cores
    the environments step on; 1 for a JAX environment, which has no envpool instance to split (its
    steps run inside the compiled rollout)."""
    if platform != "gpu" or is_jax_env(args.env_id):
        return 1
    return min(2, args.local_num_envs)


@dataclasses.dataclass
class SplitRollout:
    """An actor thread's envpool environments stepped in Python (`SplitEnvs`), with the compiled
    rollout's interface: `play(params, update) -> rollout_steps.PlayedRollout`."""

    envs: SplitEnvs
    split_policies: list
    """per split, the script's `act` jitted with the split's environment indices (NumPy, a
    constant of the program, as in a compiled rollout): `policy(params, obs, step, step_input)`,
    with a recurrent core `policy(params, obs, step, step_input, core_state, is_reset)`"""
    bootstrap: Callable | None
    episodes: Any
    episode_over: Callable
    device: Any
    stack: Callable
    num_steps: int
    num_envs: int
    """the run's environments (global steps count them)"""
    record: EnvRecord | None = None
    """the environments' record (`env_records`), kept step by step where the script's checkpoints
    bring them back (the continuous scripts on Gymnasium's environments), else None"""
    core_states: list | None = None
    """per split, the recurrent core's state that its environments' next step meets, on the
    actor's device (None: no core)"""

    def play(self, params, update: int, step_inputs=None) -> PlayedRollout:
        """The rollout of `update` with `params`, its steps' policy steps (update - 1) x
        --num-steps onwards: at each step, for each split in turn, the policy's step on the
        split's observations (put on the actor's device, where they stay), its actions sent to
        the split while the next split takes its turn. `step_inputs` (steps, ...): what `act`
        takes at each step, or None."""
        first_step = (update - 1) * self.num_steps
        episode_ends = []
        first_core_state = None if self.core_states is None else _join(self.core_states)

        def act(step, split, obs, is_reset):
            obs = jax.device_put(obs, self.device)
            step_input = None if step_inputs is None else step_inputs[step - first_step]
            policy = self.split_policies[split]
            if self.core_states is None:
                actions, outputs = jax.device_get(policy(params, obs, step, step_input))
            else:
                actions, outputs, self.core_states[split] = policy(
                    params, obs, step, step_input, self.core_states[split], is_reset
                )
                actions, outputs = jax.device_get((actions, outputs))
            return actions, (obs, outputs)

        def record(step, played):
            if self.record is not None:
                env_records.record_step(self.record, played.actions, played.is_reset)
            done = self.episode_over(played.terminations, played.truncations, played.info)
            # Atari's clipped rewards are for learning: the episodes' returns are envpool's
            # unclipped ones.
            reward = played.info.get("reward", played.rewards)
            global_step = step * self.num_envs
            finished = self.episodes.step(reward, done, played.is_reset, global_step)
            episode_ends.extend(
                EpisodeEnd(global_step, int(env), episode_return)
                for env, episode_return in zip(np.flatnonzero(done), finished)
            )

        # envpool's environment reset on the step after an episode's end ignores the action,
        # returns the first observation of the next episode, and is masked out of learning
        # (`is_reset`).
        played = self.envs.play(
            first_step=first_step, num_steps=self.num_steps, act=act, record=record
        )
        env_major = lambda arrays: np.stack(arrays, axis=1)
        outputs = [s.outputs[1] for s in played.steps]
        steps = Steps(
            obs=self.stack([s.outputs[0] for s in played.steps]),
            env_actions=env_major([s.actions for s in played.steps]),
            outputs=jax.tree.map(lambda *xs: np.stack(xs, axis=1), *outputs),
            rewards=env_major([s.rewards for s in played.steps]),
            terminations=env_major([s.terminations for s in played.steps]),
            truncations=env_major([s.truncations for s in played.steps]),
            is_reset=env_major([s.is_reset for s in played.steps]),
        )
        next_obs = self.envs.next_obs
        next_core_state = None if self.core_states is None else _join(self.core_states)
        bootstrap_value = None
        if self.bootstrap is not None:
            on_device = jax.device_put(next_obs, self.device)
            if next_core_state is None:
                bootstrap_value = np.asarray(self.bootstrap(params, on_device))
            else:
                bootstrap_value = np.asarray(self.bootstrap(params, on_device, next_core_state))
        return PlayedRollout(
            steps=steps,
            next_obs=next_obs,
            bootstrap_value=bootstrap_value,
            record=None if self.record is None else env_records.copy_of(self.record),
            episode_ends=episode_ends,
            inference_time=played.inference_time,
            env_step_time=played.env_step_time,
            first_core_state=jax.device_get(first_core_state),
            next_core_state=jax.device_get(next_core_state),
        )


def _acting_on(act: Callable, env_ids: np.ndarray, params, obs, step, step_input, *core):
    return act(params, obs, env_ids, step, step_input, *core)


def start_splits(
    make_env: Callable,
    args,
    episodes: Episodes,
    num_envs: int,
    env_offset: int,
    env_record,
    act: Callable,
    bootstrap: Callable | None = None,
    device=None,
    episode_over: Callable = ended,
    keep_record: bool = False,
    core_state=None,
) -> SplitRollout:
    """The environments env_offset .. env_offset + --local-num-envs - 1 of the run's `num_envs` (the
    script's `make_env(args, seed, num_envs)`, seeded --seed + env_offset onwards, in --env-splits
    splits), played by `act(params, obs, env_ids, step, step_input) -> (env_actions, outputs)` on
    `device` (the actor thread's), as `compiled_rollout.start` plays them in one program, their
    episodes counted in `episodes` (the run's `RunLogs.episodes`). The episodes logged end where
    `episode_over(terminated, truncated, info)` says (GALA's Atari: at the game's end, where a lost
    life terminates for learning).

    With `keep_record` (a script whose checkpoints bring the environments back: the continuous
    scripts on Gymnasium's environments) the rollouts keep the environments' record, and a resumed
    run (`env_record`, the thread's part of the checkpoint's) brings them back to it; else a resumed
    run makes them anew (envpool's Atari cannot be brought back).

    `core_state`: the recurrent core's state of the thread's environments before the first rollout
    (`cores`), with which `act` and `bootstrap(params, obs, core_state)` take the state; None
    without a core."""
    assert keep_record or env_record is None, "a record is kept only with keep_record"
    envs = SplitEnvs.of_actor_thread(make_env, args, env_offset)
    record = None
    if keep_record and env_record is None:
        record = env_records.empty_record(args.local_num_envs, args.env_id, args.env_params)
    elif keep_record:
        record = env_records.part(env_record, slice(env_offset, env_offset + args.local_num_envs))
        envs.bring_back(record, on_step=episodes.replayed_step)
    return SplitRollout(
        envs=envs,
        split_policies=[
            jax.jit(functools.partial(_acting_on, act, envs.env_ids[split]))
            for split in envs.env_slices
        ],
        bootstrap=None if bootstrap is None else jax.jit(bootstrap),
        episodes=episodes,
        episode_over=episode_over,
        device=device,
        # The observations stay on the actor's device, where inference put them, stacked there
        # env-major.
        stack=jax.jit(lambda observations: jnp.stack(observations, axis=1)),
        num_steps=args.num_steps,
        num_envs=num_envs,
        record=record,
        core_states=None
        if core_state is None
        else [
            jax.device_put(jax.tree.map(lambda x, s=split: x[s], core_state), device)
            for split in envs.env_slices
        ],
    )
