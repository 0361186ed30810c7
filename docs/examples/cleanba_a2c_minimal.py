"""A minimal Cleanba script, the complete example of docs/writing_a_script.md: synchronous
advantage actor-critic (A2C) with n-step returns, an MLP, CartPole from envpool.

One actor thread plays short rollouts; a learner pmap'd over the learner devices trains on them.
They hand each other parameters and rollouts through one `param_queue` and one `rollout_queue`
(both maxsize 1): without --concurrency they take turns, with it the actor plays the next rollout
while the learner trains, one policy version behind. Everything else (the run folder and its logs,
evaluation, checkpoints, stop signals, --resume) is the same `cleanba_utils` calls as in cleanba/.

    uv run python docs/examples/cleanba_a2c_minimal.py --total-timesteps 20000
"""

import dataclasses
import functools
import os
import time
from typing import ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cleanba_utils import distributed, parsing
from cleanba_utils.checkpoints import resume_or_start
from cleanba_utils.devices import first_replica, replicate
from cleanba_utils.envs import has_image_observations, make_env
from cleanba_utils.errors import fail
from cleanba_utils.evaluation_episodes import play_episodes
from cleanba_utils.fields import in_range, non_negative, positive
from cleanba_utils.handoff import ActorTimes, LagRule, OnResume, start_actor_threads
from cleanba_utils.run import open_run
from cleanba_utils.run_args import RUN_NEEDS, DeviceArgs
from cleanba_utils.run_logs import LearnerTimes
from cleanba_utils.sizes import Sizes, rollout_sizes
from cleanba_utils.threads import queue_get, queue_put

# === Args ===


@dataclasses.dataclass
class Args(DeviceArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    num_actor_threads: ClassVar[int] = 1
    """one actor thread per process, on the one device of --actor-device-ids (not an option:
    `handoff.start_actor_threads` and `envs.make_env` read it)"""

    env_id: str = "CartPole-v1"
    """the id of the envpool environment (vector observations, discrete actions)"""
    total_timesteps: int = positive(200_000)
    """total environment steps of the run"""
    learning_rate: float = positive(1e-3)
    """the learning rate of the Adam optimizer"""
    local_num_envs: int = positive(16)
    """the number of environments of the actor thread"""
    num_steps: int = positive(8)
    """the number of steps each environment runs per rollout: the n of the n-step returns"""
    gamma: float = in_range(0.99, 0, 1, low_open=True)
    """the discount factor"""
    ent_coef: float = non_negative(0.01)
    """the entropy coefficient"""
    vf_coef: float = non_negative(0.5)
    """the value function coefficient"""
    max_grad_norm: float = positive(0.5)
    """the maximum global norm of the gradient"""
    hiddens: tuple[int, ...] = (64, 64)
    """the sizes of the hidden layers of each of the separate actor and critic MLPs"""


def sizes_of(args: Args, num_processes: int) -> Sizes:
    return rollout_sizes(args.local_num_envs * num_processes, args.num_steps, args.total_timesteps)


def parse_args(argv=None) -> Args:
    args = parsing.parse_args(Args, argv)
    validate(args)
    return args


def validate(args: Args):
    """Checks every argument that needs no device, before any other work; exits 2 on the first
    problem."""
    parsing.check_fields(args)
    parsing.check_run_options(args)
    parsing.check_layers(args, ["hiddens"])
    parsing.check_discrete_actions(args)
    if has_image_observations(args.env_id):
        fail(f"--env-id {args.env_id} observes images; this script's MLPs take vectors")
    parsing.check_needs(args, RUN_NEEDS)


def validate_layout(args: Args):
    """The checks that need the devices (and, with --distributed, the number of processes)."""
    sizes = sizes_of(args, jax.process_count())
    parsing.check_devices(args, sizes.num_updates, sizes.steps_per_update)
    if len(args.actor_device_ids) != 1:
        fail(f"--actor-device-ids takes one device (one actor thread), got {args.actor_device_ids}")


# === Environment ===


# `cleanba_utils.envs.make_env`: envpool's environments, environment i seeded with seed + i.


# === Network ===


class MLP(nn.Module):
    """tanh hidden layers and a linear output."""

    hiddens: tuple[int, ...]
    outputs: int

    @nn.compact
    def __call__(self, x):
        for hidden in self.hiddens:
            x = nn.tanh(nn.Dense(hidden)(x))
        return nn.Dense(self.outputs)(x)


class Network(nn.Module):
    """The policy's logits and the value of observations (..., features), from separate MLPs:
    through a shared torso, the critic's gradients (its targets approach 1 / (1 - gamma) on
    CartPole) swamp the policy's."""

    hiddens: tuple[int, ...]
    num_actions: int

    @nn.compact
    def __call__(self, obs):
        x = obs.astype(jnp.float32)
        return MLP(self.hiddens, self.num_actions)(x), MLP(self.hiddens, 1)(x)[..., 0]


# === Actor ===

# How the policy lag goes on across a resume (cleanba_utils.handoff): restarted, as a resumed run's
# environments start anew from the run's seeds.
ON_RESUME: OnResume = "restart_lag"


class Trajectories(NamedTuple):
    """One rollout, env-major (envs, steps, ...). `obs` has one more step, the observation after the
    rollout (its value bootstraps the returns). `is_reset` marks envpool's reset steps (the step
    after an episode's end: the action is ignored and the observation is the next episode's first),
    which do not count."""

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    is_reset: np.ndarray


class Rollout(NamedTuple):
    """What the actor thread puts on its rollout queue: the learner update it is for, the version of
    the parameters that played it, its trajectories with one slice of environments per learner
    device, and the seconds the actor spent waiting for parameters and playing."""

    update: int
    policy_version: int
    data: Trajectories
    timing: ActorTimes


def actor_thread(
    args,
    sizes,
    run,
    network,
    lag,
    env_offset,
    device,
    learner_devices,
    param_queue,
    rollout_queue,
):
    """The actor thread (`handoff.start_actor_threads`) on `device`, playing the updates of `lag`:
    environments with global indices env_offset .. env_offset + local_num_envs - 1, their rollouts
    split among the local `learner_devices`."""
    envs = make_env(args, args.seed + env_offset, args.local_num_envs)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(args.seed), 1), env_offset)
    learner_sharding = NamedSharding(
        Mesh(np.array(learner_devices), ("devices",)), PartitionSpec("devices")
    )

    @jax.jit
    def get_action(params, obs, step):
        logits, _ = network.apply(params, obs)
        return jax.random.categorical(jax.random.fold_in(key, step), logits)

    episodes = run.logs.episodes(args.local_num_envs)
    next_obs, _ = envs.reset()
    next_is_reset = np.zeros(args.local_num_envs, dtype=bool)
    for update in lag.updates():
        param_wait_start = time.time()
        if lag.actor_fetches_params(update):
            policy_version, params = queue_get(param_queue, run.stop)
        param_queue_get_time = time.time() - param_wait_start

        rollout_start = time.time()
        steps = []
        for step in range(args.num_steps):
            policy_step = (update - 1) * args.num_steps + step
            obs_on_device = jax.device_put(next_obs, device)
            action = np.asarray(get_action(params, obs_on_device, policy_step))
            obs, reward, terminated, truncated, _ = envs.step(action)
            steps.append(
                Trajectories(
                    obs=next_obs,
                    actions=action,
                    rewards=reward,
                    terminations=terminated,
                    truncations=truncated,
                    is_reset=next_is_reset,
                )
            )
            done = terminated | truncated
            episodes.step(reward, done, next_is_reset, policy_step * sizes.num_envs)
            next_obs = obs
            next_is_reset = done

        data = jax.tree.map(lambda *xs: np.stack(xs, axis=1), *steps)
        data = data._replace(obs=np.concatenate([data.obs, next_obs[:, None]], axis=1))
        data = jax.tree.map(lambda x: x.reshape(len(learner_devices), -1, *x.shape[1:]), data)
        timing = ActorTimes(
            param_queue_get_time=param_queue_get_time, rollout_time=time.time() - rollout_start
        )
        # Copied to the learner devices here, while the learner works.
        data = jax.device_put(data, learner_sharding)
        queue_put(rollout_queue, Rollout(update, policy_version, data, timing), run.stop)


def evaluate(params, args: Args, num_episodes: int, seed: int) -> list[float]:
    """Plays one episode in each of `num_episodes` fresh environments (seeded seed + i) with the
    greedy policy, the most probable action; returns the episodes' returns."""
    envs = make_env(args, seed, num_episodes)
    network = Network(args.hiddens, envs.action_space.n)
    act = jax.jit(lambda obs: jnp.argmax(network.apply(params, obs)[0], axis=-1))
    return play_episodes(envs, num_episodes, lambda obs, step: act(obs))


# === Loss ===


def n_step_returns(rewards, values, terminations, truncations, *, gamma):
    """The returns of one environment's rollout, G_t = r_t + gamma G_(t+1), bootstrapped at the end
    of the rollout with the value of the observation after it (`values` has one more entry). A
    termination ends the return; a truncation bootstraps from the value of the episode's last
    observation, values[t + 1] (the observation of the reset step after it)."""

    def step(next_return, inputs):
        reward, next_value, terminated, truncated = inputs
        following = jnp.where(truncated, next_value, next_return)
        returned = reward + gamma * (1.0 - terminated) * following
        return returned, returned

    inputs = (rewards, values[1:], terminations, truncations)
    _, returns = jax.lax.scan(step, values[-1], inputs, reverse=True)
    return returns


def a2c_loss(params, apply_fn, data: Trajectories, count, *, gamma, ent_coef, vf_coef):
    """Sums over this device's valid steps divided by the global `count` of valid steps. The policy
    gradient weighs each action's log-probability by its advantage, the n-step return minus the
    value; the value regresses on the return (a fixed target)."""
    logits, values = apply_fn(params, data.obs)
    terminations = data.terminations.astype(jnp.float32)
    returns = jax.vmap(functools.partial(n_step_returns, gamma=gamma))(
        data.rewards, values, terminations, data.truncations
    )
    advantages = jax.lax.stop_gradient(returns) - values[:, :-1]
    log_probs = jax.nn.log_softmax(logits[:, :-1])
    actions = data.actions[..., None].astype(jnp.int32)
    logprob = jnp.take_along_axis(log_probs, actions, axis=-1)[..., 0]
    entropy = -(jnp.exp(log_probs) * log_probs).sum(-1)
    valid = 1.0 - data.is_reset.astype(jnp.float32)
    mean = lambda x: (x * valid).sum() / count
    policy_loss = mean(-logprob * jax.lax.stop_gradient(advantages))
    value_loss = mean(0.5 * advantages**2)
    loss = policy_loss - ent_coef * mean(entropy) + vf_coef * value_loss
    return loss, dict(policy_loss=policy_loss, value_loss=value_loss, entropy=mean(entropy))


# === Update ===


def init_state(args: Args, sizes: Sizes):
    """The network, and the learner state with its counters: fresh from the seed, or with --resume
    from the newest checkpoint of the run (counters["update"] > 0 then)."""
    probe_env = make_env(args, args.seed, 1)
    network = Network(args.hiddens, probe_env.action_space.n)
    init_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 0)
    params = network.init(init_key, probe_env.reset()[0])
    probe_env.close()
    optimizer = optax.chain(
        optax.clip_by_global_norm(args.max_grad_norm), optax.adam(args.learning_rate)
    )
    state = TrainState.create(apply_fn=network.apply, params=params, tx=optimizer)
    # What a checkpoint must match besides the options: the global sizes and the seed.
    identity = dict(sizes=dataclasses.asdict(sizes), seed=args.seed)
    saved, counters = resume_or_start(args, state, identity, __file__)
    return network, state if saved is None else saved, counters


def make_update(args: Args, learner_devices: list):
    """One optimizer step on the whole rollout, pmap'd over the learner devices (each holds a slice
    of the environments): each device's loss is its share of the global mean, so the gradient of
    the global mean is the sum of the devices'."""

    loss = functools.partial(
        a2c_loss, gamma=args.gamma, ent_coef=args.ent_coef, vf_coef=args.vf_coef
    )

    def update(state, data):
        count = jnp.maximum(jax.lax.psum((1.0 - data.is_reset).sum(), "devices"), 1.0)
        grads, metrics = jax.grad(loss, has_aux=True)(state.params, state.apply_fn, data, count)
        grads, metrics = jax.lax.psum((grads, metrics), "devices")
        return state.apply_gradients(grads=grads), metrics

    return jax.pmap(update, axis_name="devices", devices=learner_devices)


# === Learner loop ===


def train(args: Args):
    sizes = sizes_of(args, jax.process_count())
    actor_devices = [jax.local_devices()[i] for i in args.actor_device_ids]
    learner_devices = [jax.local_devices()[i] for i in args.learner_device_ids]
    global_learner_devices = distributed.global_learner_devices(args.learner_device_ids)
    network, state, counters = init_state(args, sizes)
    run = open_run(
        args=args,
        sizes=sizes,
        script_path=__file__,
        counters=counters,
        global_learner_devices=global_learner_devices,
        evaluate=evaluate,
    )
    state = replicate(state, learner_devices)
    run.evaluate_untrained(lambda: jax.device_get(first_replica(state.params)))
    update_fn = make_update(args, global_learner_devices)
    # The updates of this session and the policy-lag rule, given once to the actor threads.
    lag = LagRule(
        first_update=counters["update"] + 1,
        num_updates=sizes.num_updates,
        concurrency=args.concurrency,
        on_resume=ON_RESUME,
    )
    # The actor thread, with its param queue and rollout queue of max size 1.
    actors = start_actor_threads(
        actor_thread,
        actor_devices,
        args=args,
        run=run,
        lag=lag,
        sizes=sizes,
        network=network,
        learner_devices=learner_devices,
    )
    with run.learner_loop(actors.threads) as end:
        actors.send_first(first_replica(state.params))
        update = lag.first_update - 1  # the updates done, where the loop makes none (finished)
        for update in lag.updates():
            rollouts, rollout_queue_get_time = actors.take_rollouts(update)
            learn_start = time.time()
            state, metrics = update_fn(state, rollouts[0].data)
            jax.block_until_ready(state)
            run.logs.log_update(
                update=update,
                rollouts=rollouts,
                metrics=metrics,
                learner_times=LearnerTimes(rollout_queue_get_time, time.time() - learn_start),
                optimizer_steps=update,
                learning_rate=args.learning_rate,
            )
            if run.evaluation_due(update):
                run.evaluate_and_log(update, jax.device_get(first_replica(state.params)), update)
            end.exit_code = run.after_update(state, update)
            if end.exit_code:
                break
            if update < sizes.num_updates:
                actors.send(first_replica(state.params), policy_version=update)
    run.finish(jax.device_get(first_replica(state.params)), update, update)


# === Main ===


def main(argv=None):
    args = parse_args(argv)
    distributed.join(args)
    validate_layout(args)
    train(args)


if __name__ == "__main__":
    main()
