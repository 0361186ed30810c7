"""Cleanba SAC: Soft Actor-Critic (Haarnoja et al., 2018) for envpool's MuJoCo and dm_control tasks:
the algorithm and hyperparameters of CleanRL's `sac_continuous_action.py`, in Cleanba's shape.

Actor threads play rollouts of --local-num-envs x --num-steps steps with a tanh-squashed Gaussian
policy (uniform random actions for the first --learning-starts steps) and hand them to the learner
through queues of size 1. The learner inserts each rollout into a uniform replay, then makes
--replay-ratio optimizer steps per environment step (CleanRL: one per step), all of a rollout's in
one compiled scan, each on a batch drawn with a generator seeded by (seed, optimizer step). With
--concurrency (the default) the actors play with parameters one version behind, as in Cleanba's
IMPALA: the next rollout is played, inserted and sampled while the learner trains on the last.

Which data a gradient sees never depends on timing, so a seed gives the same `params_fingerprint`
on every layout (learner devices, actor threads, processes) up to float rounding, with or without
evaluation; a run resumed from a checkpoint (the learner, the replay, the policy the actors play
next, what each environment did since its reset) repeats the uninterrupted one exactly."""

import dataclasses
import functools
import os
import time
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from cleanba_utils import (
    compiled_rollout,
    distributed,
    handoff,
    hub,
    kept_lag,
    parsing,
    split_envs,
)
from cleanba_utils.devices import first_replica, gathered_rollouts, local_shares, replicate
from cleanba_utils.env_ids import is_gymnasium_env
from cleanba_utils.env_records import EnvRecord
from cleanba_utils.envs import action_space_of, flat_observation, make_env, observation_size
from cleanba_utils.errors import fail
from cleanba_utils.evaluation_episodes import play_episodes
from cleanba_utils.fields import Need, in_range, non_negative, positive
from cleanba_utils.handoff import ActorTimes, LagRule, OnResume
from cleanba_utils.kept_lag import Continuation
from cleanba_utils.replay.store import ReplayStore, store_bytes
from cleanba_utils.run import open_run
from cleanba_utils.run_args import RUN_NEEDS, DeviceArgs
from cleanba_utils.run_logs import LearnerTimes
from cleanba_utils.sizes import Sizes, rollout_sizes
from cleanba_utils.threads import queue_get, queue_put

# === Args ===


@dataclasses.dataclass
class Args(DeviceArgs):
    # The run options of `DeviceArgs` whose default or meaning differ here.
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    eval_every: int = non_negative(100)
    concurrency: bool = True
    checkpoint_every: int = non_negative(0)
    """checkpoint (with the replay) every this many updates (0: at the end, SIGTERM, SIGUSR1)"""

    env_id: str = "HalfCheetah-v4"
    """the environment, with continuous actions: an envpool id (MuJoCo or dm_control:
    HalfCheetah-v4, CheetahRun-v1), gymnax:<id> for gymnax's JAX environment (gymnax:Pendulum-v1)
    or jax:<module>:<class> for your own with gymnax's interface (docs/jax_environments.md)"""
    total_timesteps: int = positive(1_000_000)
    """total environment steps of the run"""
    buffer_size: int = positive(1_000_000)
    """the replay capacity in transitions, first in first out"""
    gamma: float = in_range(0.99, 0, 1, low_open=True)
    """the discount factor"""
    tau: float = in_range(0.005, 0, 1, low_open=True)
    """the target critics' Polyak step: the fraction they move to the critics per optimizer step"""
    batch_size: int = positive(256)
    """the transitions of one optimizer step, split equally over the learner devices"""
    learning_starts: int = non_negative(5000)
    """environment steps of uniformly random actions before the policy acts; the first optimizer
    step follows the first rollout that completes this many steps (CleanRL's follows step 5001)"""
    policy_lr: float = positive(3e-4)
    """the learning rate of the actor's Adam"""
    q_lr: float = positive(1e-3)
    """the learning rate of the twin critics' Adam"""
    alpha_lr: float = positive(1e-3)
    """the learning rate of the temperature's Adam (CleanRL's script: q_lr, 1e-3; its docs: 3e-4)"""
    policy_frequency: int = positive(2)
    """update the actor and the temperature every this many optimizer steps, this many times
    each (making up for the skipped ones), as CleanRL's delayed policy update"""
    autotune: bool = True
    """tune the temperature alpha towards the target entropy -|A| (else keep it at --alpha)"""
    alpha: float = positive(0.2)
    """the temperature with --no-autotune"""
    replay_ratio: float = positive(1.0)
    """optimizer steps per environment step (CleanRL's: 1)"""
    hiddens: tuple[int, ...] = (256, 256)
    """the ReLU hidden layers of the actor and of each critic"""
    local_num_envs: int = positive(1)
    """the number of environments of each actor thread (CleanRL's: 1)"""
    num_actor_threads: int = positive(1)
    """the number of actor threads per actor device"""
    num_steps: int = positive(64)
    """the steps of each environment per rollout, one learner update, which makes the rollout's
    optimizer steps in one compiled call; with --concurrency the actors are one update behind"""


# Options that act only in some configurations: `validate` refuses one set where its need fails.
NEEDS = {
    **RUN_NEEDS,
    "alpha": Need(lambda args: not args.autotune, "--no-autotune"),
    "alpha_lr": Need(lambda args: args.autotune, "--autotune"),
}


def sizes_of(args: Args, num_processes: int) -> Sizes:
    num_envs = args.local_num_envs * args.num_actor_threads * len(args.actor_device_ids)
    return rollout_sizes(num_envs * num_processes, args.num_steps, args.total_timesteps)


def optimizer_steps_per_update(args: Args, sizes: Sizes) -> int:
    """Optimizer steps per learner update once learning starts: replay_ratio x steps_per_update."""
    return round(args.replay_ratio * sizes.steps_per_update)


def parse_args(argv=None) -> Args:
    args = parsing.parse_args(Args, argv)
    validate(args)
    return args


def validate(args: Args):
    """Checks every argument that needs no device, first; exits 2 on the first problem."""
    parsing.check_fields(args)
    parsing.check_continuous_actions(args)
    if args.learning_starts >= args.total_timesteps:
        fail(
            f"--learning-starts {args.learning_starts} is not below --total-timesteps "
            f"{args.total_timesteps}: the run would never learn"
        )
    parsing.check_run_options(args)
    parsing.check_layers(args, ["hiddens"])
    parsing.check_needs(args, NEEDS)


def validate_layout(args: Args):
    """The checks that need the devices, the process count (--distributed) or the machine."""
    sizes = sizes_of(args, jax.process_count())
    parsing.check_devices(
        args, sizes.num_updates, sizes.steps_per_update, split_rollouts=False, split_batches=True
    )
    optimizer_steps = args.replay_ratio * sizes.steps_per_update
    if round(optimizer_steps) < 1 or abs(optimizer_steps - round(optimizer_steps)) > 1e-6:
        fail(
            f"--replay-ratio {args.replay_ratio} x {sizes.steps_per_update} steps per update "
            f"(num envs x --num-steps) = {optimizer_steps:g} optimizer steps: it must be a "
            "whole number, at least 1"
        )
    if args.buffer_size < sizes.steps_per_update:
        fail(
            f"--buffer-size {args.buffer_size} holds fewer transitions than one update inserts "
            f"({sizes.num_envs} envs x {args.num_steps} steps); raise it"
        )
    parsing.check_memory(args, "buffer_size", replay_bytes(args), MEMORY_RESERVE_BYTES)


# === Environment ===


class Bounds(NamedTuple):
    """The affine map from the squashed action in (-1, 1) to the task's action box."""

    scale: Any
    bias: Any


def bounds_of(action_space) -> Bounds:
    low = np.asarray(action_space.low, np.float32)
    high = np.asarray(action_space.high, np.float32)
    return Bounds(scale=(high - low) / 2.0, bias=(high + low) / 2.0)


# === Network ===

LOG_STD_MIN = -5.0
LOG_STD_MAX = 2.0


def dense(features: int, fan_in: int) -> nn.Dense:
    """A dense layer initialized as PyTorch's (CleanRL's): kernel and bias U(+-1/sqrt(fan_in))."""
    bound = 1.0 / np.sqrt(fan_in)
    init = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
    return nn.Dense(features, kernel_init=init, bias_init=init)


class Actor(nn.Module):
    """The mean and the log standard deviation of a Gaussian over pre-squashing actions, from a ReLU
    MLP; the log std is squashed into [LOG_STD_MIN, LOG_STD_MAX] by a rescaled tanh."""

    hiddens: tuple[int, ...]
    action_dim: int

    @nn.compact
    def __call__(self, obs):
        x = obs
        for hidden in self.hiddens:
            x = nn.relu(dense(hidden, x.shape[-1])(x))
        mean = dense(self.action_dim, x.shape[-1])(x)
        log_std = jnp.tanh(dense(self.action_dim, x.shape[-1])(x))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1.0)
        return mean, log_std


class Critic(nn.Module):
    """Q(s, a) from a ReLU MLP on the observation and the action (in the task's units)."""

    hiddens: tuple[int, ...]

    @nn.compact
    def __call__(self, obs, actions):
        x = jnp.concatenate([obs, actions], axis=-1)
        for hidden in self.hiddens:
            x = nn.relu(dense(hidden, x.shape[-1])(x))
        return dense(1, x.shape[-1])(x)[..., 0]


class TwinCritic(nn.Module):
    """Two critics of their own initializations, evaluated together: Q-values (2, N)."""

    hiddens: tuple[int, ...]

    @nn.compact
    def __call__(self, obs, actions):
        critics = nn.vmap(
            Critic,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=None,
            out_axes=0,
            axis_size=2,
        )
        return critics(self.hiddens)(obs, actions)


class Networks(NamedTuple):
    actor: Actor
    critic: TwinCritic
    bounds: Bounds


def networks_of(args: Args) -> Networks:
    action_space = action_space_of(args)
    return Networks(
        actor=Actor(args.hiddens, action_space.shape[0]),
        critic=TwinCritic(args.hiddens),
        bounds=bounds_of(action_space),
    )


def squashed_gaussian(mean, log_std, noise, bounds: Bounds):
    """a = tanh(u) * scale + bias for u = mean + std * noise, and log pi(a): the Gaussian's of u
    minus log |da/du| = log(scale (1 - tanh(u)^2) + 1e-6, CleanRL's guard), summed over dims."""
    squashed = jnp.tanh(mean + jnp.exp(log_std) * noise)
    gaussian = -0.5 * noise**2 - log_std - 0.5 * jnp.log(2 * jnp.pi)
    log_prob = gaussian - jnp.log(bounds.scale * (1.0 - squashed**2) + 1e-6)
    return squashed * bounds.scale + bounds.bias, log_prob.sum(-1)


# === Actor ===

# How the policy lag goes on across a resume (cleanba_utils.handoff): kept at 1, as in the
# uninterrupted run, which the bitwise resume needs.
ON_RESUME: OnResume = "keep_lag"


class Transitions(NamedTuple):
    """One rollout of an actor thread, env-major (envs, steps, ...), actions in the task's units.
    `valid` is False on envpool's reset steps (after an episode's end it ignores the action and
    returns the next episode's first observation): no transitions. On a truncating step `next_obs`
    is the episode's last (envpool resets on the next step), which the target bootstraps from."""

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    next_obs: np.ndarray
    terminations: np.ndarray
    valid: np.ndarray


class Rollout(NamedTuple):
    """An actor thread's queue item: the update it is for, the parameters' version that played it,
    its transitions, its environments' record after it, and its timings in seconds."""

    update: int
    policy_version: int
    data: Transitions
    record: EnvRecord
    timing: ActorTimes


class Draws(NamedTuple):
    """The random draws of one step's actions, (envs, action dims): the policy's Gaussian noise, and
    uniform draws in [-1, 1] for the random actions before learning starts."""

    normal: jax.Array
    uniform: jax.Array


def step_draws(key, env_ids, step, action_dim: int) -> Draws:
    """The `Draws` of `step`, keyed by (step, global env index): the same on every layout."""
    step_key = jax.random.fold_in(key, step)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(step_key, env_ids)
    normal = lambda k: jax.random.normal(jax.random.fold_in(k, 0), (action_dim,), jnp.float32)
    uniform = lambda k: jax.random.uniform(
        jax.random.fold_in(k, 1), (action_dim,), jnp.float32, minval=-1
    )
    return Draws(normal=jax.vmap(normal)(keys), uniform=jax.vmap(uniform)(keys))


def explore(networks: Networks, params, obs, draws: Draws, random_actions):
    """The policy's sampled actions or (`random_actions`) uniform ones, from one step's `draws`."""
    mean, log_std = networks.actor.apply(params, obs)
    action, _ = squashed_gaussian(mean, log_std, draws.normal, networks.bounds)
    random = draws.uniform * networks.bounds.scale + networks.bounds.bias
    return jnp.where(random_actions, random, action)


def act(networks: Networks, key, params, obs, env_ids, step, random_actions):
    """One step of the compiled rollout (`compiled_rollout`): the actions of `explore`, which the
    environments receive as they are; no other output."""
    draws = step_draws(key, env_ids, step, len(networks.bounds.scale))
    return explore(networks, params, obs, draws, random_actions), ()


def actor_thread(
    args,
    sizes,
    run,
    networks,
    lag,
    env_offset,
    device,
    param_queue,
    rollout_queue,
    env_record,
):
    """One actor thread (`start_actor_threads`), playing the environments env_offset ..
    env_offset + local_num_envs - 1 in a compiled rollout (Gymnasium's: in Python), continued from
    their part of `env_record`, every environment's `EnvRecord` at a resumed run's checkpoint (None:
    a fresh run). Update u's rollout is played by parameters version u - 1, or u - 2 with
    --concurrency (`lag`, a `handoff.LagRule`)."""
    action_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 1)
    # Gymnasium's environments step in Python beside the policy (`split_envs`), keeping their
    # record for the checkpoint; envpool's and JAX environments step with it in one program.
    start_rollout = compiled_rollout.start
    if is_gymnasium_env(args.env_id):
        start_rollout = functools.partial(split_envs.start_splits, keep_record=True)
    envs = start_rollout(
        make_env,
        args,
        episodes=run.logs.episodes(args.local_num_envs),
        num_envs=sizes.num_envs,
        env_offset=env_offset,
        env_record=env_record,
        act=functools.partial(act, networks, action_key),
    )
    for update in lag.updates():
        param_wait_start = time.time()
        if lag.actor_fetches_params(update):
            policy_version, params = queue_get(param_queue, run.stop)
        param_queue_get_time = time.time() - param_wait_start

        rollout_start = time.time()
        global_steps = ((update - 1) * args.num_steps + np.arange(args.num_steps)) * sizes.num_envs
        played = envs.play(params, update, step_inputs=global_steps < args.learning_starts)
        steps = played.steps
        obs = np.concatenate([steps.obs, played.next_obs[:, None]], axis=1)
        data = Transitions(
            obs=obs[:, :-1],
            actions=steps.env_actions,
            rewards=steps.rewards.astype(np.float32),
            next_obs=obs[:, 1:],
            terminations=steps.terminations.astype(np.float32),
            valid=~steps.is_reset,
        )
        rollout = Rollout(
            update=update,
            policy_version=policy_version,
            data=data,
            record=played.record,
            timing=ActorTimes(
                param_queue_get_time=param_queue_get_time,
                rollout_time=time.time() - rollout_start,
                env_step_time=played.env_step_time,
            ),
        )
        queue_put(rollout_queue, rollout, run.stop)


def evaluate(params, args: Args, num_episodes: int, seed: int) -> list[float]:
    """Plays one episode in each of `num_episodes` fresh environments with the deterministic action
    (tanh of the mean, in the task's box); `params` are the model's (`params["actor"]` plays)."""
    envs = make_env(args, seed, num_episodes)
    actor_network = Actor(args.hiddens, envs.action_space.shape[0])
    bounds = bounds_of(envs.action_space)
    act = jax.jit(lambda p, o: jnp.tanh(actor_network.apply(p, o)[0]) * bounds.scale + bounds.bias)
    policy = lambda obs, _: act(params["actor"], flat_observation(obs))
    return play_episodes(envs, num_episodes, policy)


# The model card of --upload-model: the algorithm, its papers and how `evaluate` acts.
MODEL_CARD = hub.ModelCard(
    name="Soft Actor-Critic",
    papers=(hub.SAC,),
    evaluation_policy=lambda args: (
        "the deterministic action: tanh of the policy's mean, scaled to the action bounds"
    ),
)


# === Replay ===

MEMORY_RESERVE_BYTES = 2 * 2**30  # for the rest of the process: networks, environments, batches


class Batch(NamedTuple):
    """Transitions: observation, action, reward, next observation and termination (1.0: the
    episode ended there and the target does not bootstrap; a truncation is 0.0)."""

    obs: Any
    actions: Any
    rewards: Any
    next_obs: Any
    terminations: Any


def stored_example(obs_size: int, action_size: int) -> Batch:
    """A transition as the replay stores it."""
    obs = np.zeros(obs_size, np.float32)
    zero = np.float32(0)
    actions = np.zeros(action_size, np.float32)
    return Batch(obs=obs, actions=actions, rewards=zero, next_obs=obs, terminations=zero)


def replay_bytes(args: Args) -> int:
    """The replay's memory, twice: a checkpoint serializes a copy of it."""
    action_size = action_space_of(args).shape[0]
    example = stored_example(observation_size(args.env_id), action_size)
    return 2 * store_bytes(example, args.buffer_size)


def make_replay(args: Args, obs_size: int, action_size: int) -> ReplayStore:
    """A uniform, first-in-first-out store of `Batch` records, one transition each."""
    return ReplayStore(stored_example(obs_size, action_size), args.buffer_size, uniform=True)


def replay_insert(replay: ReplayStore, data: Transitions):
    """Inserts the valid transitions (no reset steps), env-major in global env order: the same order
    whatever the layout."""
    replay.insert(Batch(**{name: getattr(data, name)[data.valid] for name in Batch._fields}))


def sample_batches(args: Args, replay: ReplayStore, first: int, count: int) -> Batch:
    """The batches of optimizer steps first .. first + count - 1 (1-based, over the run), stacked
    (count, batch, ...), each drawn uniformly with a generator seeded by (seed, its index)."""
    rngs = [np.random.default_rng([args.seed, 3, index]) for index in range(first, first + count)]
    return replay.sample_many(args.batch_size, rngs, beta=0.0).items


# === Loss ===


def soft_target(batch: Batch, next_q_target, next_log_prob, alpha, gamma: float):
    """y = r + gamma (1 - terminated) (min_i Q'_i(s', a') - alpha log pi(a' | s')) with a' ~ pi(s')
    and Q'_i the target critics: `next_q_target` (2, N), `next_log_prob` (N,)."""
    next_value = jnp.min(next_q_target, axis=0) - alpha * next_log_prob
    return batch.rewards + gamma * (1.0 - batch.terminations) * next_value


def critic_loss(critic_params, critic_apply, batch: Batch, target):
    """The twin critics' summed MSE to the soft target; also each critic's loss and mean Q-value."""
    q_values = critic_apply(critic_params, batch.obs, batch.actions)
    losses = ((q_values - target) ** 2).mean(axis=1)
    return losses.sum(), (losses, q_values.mean(axis=1))


def actor_loss(actor_params, networks: Networks, critic_params, batch: Batch, noise, alpha):
    """mean(alpha log pi(a | s) - min_i Q_i(s, a)), a ~ pi(s) reparameterized by `noise`."""
    mean, log_std = networks.actor.apply(actor_params, batch.obs)
    actions, log_prob = squashed_gaussian(mean, log_std, noise, networks.bounds)
    q_values = networks.critic.apply(critic_params, batch.obs, actions)
    return (alpha * log_prob - jnp.min(q_values, axis=0)).mean()


def temperature_loss(log_alpha, log_prob, target_entropy: float):
    """mean(-alpha (log pi(a | s) + target entropy)), alpha = exp(log_alpha): alpha grows while the
    policy's entropy is below the target and shrinks while above."""
    return (-jnp.exp(log_alpha) * (log_prob + target_entropy)).mean()


# === Update ===


class SACState(NamedTuple):
    """Everything the learner updates, one pytree: the parameters, the target critics, the
    temperature, the three Adam states and the optimizer steps made so far."""

    actor_params: Any
    critic_params: Any
    target_critic_params: Any
    log_alpha: Any
    actor_opt_state: Any
    critic_opt_state: Any
    alpha_opt_state: Any
    step: Any


class Optimizers(NamedTuple):
    actor: optax.GradientTransformation
    critic: optax.GradientTransformation
    alpha: optax.GradientTransformation


def optimizers_of(args: Args) -> Optimizers:
    """Adam with PyTorch's defaults (betas 0.9 and 0.999, eps 1e-8), as CleanRL's."""
    return Optimizers(optax.adam(args.policy_lr), optax.adam(args.q_lr), optax.adam(args.alpha_lr))


def init_state(args: Args, sizes: Sizes, networks: Networks, replay: ReplayStore):
    """Where the run starts (`kept_lag.Origin`): the learner state, counters and with --resume the
    newest checkpoint's parameters, environments and replay (`replay` restored)."""
    obs_size = observation_size(args.env_id)
    action_size = len(networks.bounds.scale)
    init_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 0)
    obs = np.zeros((1, obs_size), np.float32)
    actor_params = networks.actor.init(jax.random.fold_in(init_key, 0), obs)
    critic_params = networks.critic.init(
        jax.random.fold_in(init_key, 1), obs, np.zeros((1, action_size), np.float32)
    )
    log_alpha = np.float32(0.0 if args.autotune else np.log(args.alpha))
    optimizers = optimizers_of(args)
    state = SACState(
        actor_params=actor_params,
        critic_params=critic_params,
        target_critic_params=critic_params,
        log_alpha=log_alpha,
        actor_opt_state=optimizers.actor.init(actor_params),
        critic_opt_state=optimizers.critic.init(critic_params),
        alpha_opt_state=optimizers.alpha.init(log_alpha),
        step=np.int32(0),
    )
    return kept_lag.run_origin(
        args, sizes, __file__, learner=state, acting_params=actor_params, replay=replay
    )


def make_update(args: Args, learner_devices: list, networks: Networks):
    """`update_fn(state, batches) -> (state, metrics)`, pmap'd over the learner devices: a
    `lax.scan` of optimizer steps, one per batch of `batches` (count, device's share, ...). Each:
    the critics on the soft target; every --policy-frequency updates (by index over the run), that
    many actor steps, each followed by a temperature step; last the target critics' Polyak step.
    Gradients are pmean'd (the global batch's mean); action noise is drawn for the global batch
    from a (seed, optimizer step) key and sliced, so it does not depend on the layout either."""
    learner_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 2)
    optimizers = optimizers_of(args)
    share = args.batch_size // len(learner_devices)
    action_dim = len(networks.bounds.scale)
    target_entropy = -float(action_dim)

    def device_noise(key):
        noise = jax.random.normal(key, (args.batch_size, action_dim))
        first = jax.lax.axis_index("devices") * share
        return jax.lax.dynamic_slice_in_dim(noise, first, share)

    def apply(optimizer, grads, opt_state, params):
        deltas, opt_state = optimizer.update(jax.lax.pmean(grads, "devices"), opt_state, params)
        return optax.apply_updates(params, deltas), opt_state

    def actor_and_temperature_step(state: SACState, batch: Batch, key, iteration):
        """One actor step, then one temperature step on log-probabilities of the new actor."""
        loss, grads = jax.value_and_grad(actor_loss)(
            state.actor_params,
            networks=networks,
            critic_params=state.critic_params,
            batch=batch,
            noise=device_noise(jax.random.fold_in(key, 1 + 2 * iteration)),
            alpha=jnp.exp(state.log_alpha),
        )
        actor_params, actor_opt_state = apply(
            optimizers.actor, grads, state.actor_opt_state, state.actor_params
        )
        state = state._replace(actor_params=actor_params, actor_opt_state=actor_opt_state)
        alpha_loss = jnp.float32(0.0)
        if args.autotune:
            mean, log_std = networks.actor.apply(state.actor_params, batch.obs)
            noise = device_noise(jax.random.fold_in(key, 2 + 2 * iteration))
            _, log_prob = squashed_gaussian(mean, log_std, noise, networks.bounds)
            alpha_loss, grad = jax.value_and_grad(temperature_loss)(
                state.log_alpha, jax.lax.stop_gradient(log_prob), target_entropy
            )
            log_alpha, alpha_opt_state = apply(
                optimizers.alpha, grad, state.alpha_opt_state, state.log_alpha
            )
            state = state._replace(log_alpha=log_alpha, alpha_opt_state=alpha_opt_state)
        return state, jax.lax.pmean(dict(actor_loss=loss, alpha_loss=alpha_loss), "devices")

    def optimizer_step(state: SACState, batch: Batch):
        step = state.step + 1
        key = jax.random.fold_in(learner_key, step)
        mean, log_std = networks.actor.apply(state.actor_params, batch.next_obs)
        next_actions, next_log_prob = squashed_gaussian(
            mean, log_std, device_noise(jax.random.fold_in(key, 0)), networks.bounds
        )
        next_q_target = networks.critic.apply(
            state.target_critic_params, batch.next_obs, next_actions
        )
        target = soft_target(
            batch,
            next_q_target=next_q_target,
            next_log_prob=next_log_prob,
            alpha=jnp.exp(state.log_alpha),
            gamma=args.gamma,
        )
        grads, (qf_losses, qf_values) = jax.grad(critic_loss, has_aux=True)(
            state.critic_params, networks.critic.apply, batch, target
        )
        critic_params, critic_opt_state = apply(
            optimizers.critic, grads, state.critic_opt_state, state.critic_params
        )
        state = state._replace(critic_params=critic_params, critic_opt_state=critic_opt_state)

        def policy_updates(state):
            state, metrics = jax.lax.scan(
                lambda s, i: actor_and_temperature_step(s, batch, key, i),
                state,
                jnp.arange(args.policy_frequency),
            )
            return state, jax.tree.map(lambda m: m[-1], metrics)

        zero = jnp.float32(0.0)
        no_policy_update = lambda state: (state, dict(actor_loss=zero, alpha_loss=zero))

        is_policy_update = step % args.policy_frequency == 0
        state, policy_metrics = jax.lax.cond(
            is_policy_update, policy_updates, no_policy_update, state
        )
        target_critic_params = jax.tree.map(
            lambda target, online: args.tau * online + (1.0 - args.tau) * target,
            state.target_critic_params,
            state.critic_params,
        )
        state = state._replace(target_critic_params=target_critic_params, step=step)
        qf_losses, qf_values = jax.lax.pmean((qf_losses, qf_values), "devices")
        metrics = dict(
            qf1_loss=qf_losses[0],
            qf2_loss=qf_losses[1],
            qf_loss=qf_losses.mean(),
            qf1_values=qf_values[0],
            qf2_values=qf_values[1],
            alpha=jnp.exp(state.log_alpha),
            policy_updated=is_policy_update.astype(jnp.float32),
            **policy_metrics,
        )
        return state, metrics

    def update_on_device(state: SACState, batches: Batch):
        """Means over the scan's updates (the policy losses: over those that update the policy;
        alpha: the last)."""
        state, metrics = jax.lax.scan(optimizer_step, state, batches)
        policy_updated = metrics.pop("policy_updated")
        policy_updates = jnp.maximum(policy_updated.sum(), 1.0)
        summary = {name: values.mean() for name, values in metrics.items()}
        for name in ("actor_loss", "alpha_loss"):
            summary[name] = (metrics[name] * policy_updated).sum() / policy_updates
        summary["alpha"] = metrics["alpha"][-1]
        return state, summary

    return jax.pmap(update_on_device, axis_name="devices", devices=learner_devices)


# === Learner loop ===


def optimizer_steps_after(args: Args, sizes: Sizes, update: int) -> int:
    """The optimizer steps of the run's first `update` updates: `optimizer_steps_per_update` in
    each from the first whose environment steps complete --learning-starts."""
    first_learning = max(1, -(-args.learning_starts // sizes.steps_per_update))
    return optimizer_steps_per_update(args, sizes) * max(0, update + 1 - first_learning)


class Received(NamedTuple):
    """The rollouts of one update, inserted, the batches of its optimizer steps (None before
    learning starts), the replay's size after them, the seconds the learner waited for them and
    stats: seconds inserting and sampling."""

    rollouts: list
    env_record: EnvRecord
    batches: Batch | None
    replay_size: int
    rollout_queue_get_time: float
    stats: dict


def receive(args, sizes, update: int, replay: ReplayStore, actors) -> Received:
    """Takes `update`'s rollouts (`take_rollouts` checks which policy played them), inserts them
    and samples the batches of its optimizer steps."""
    rollouts, rollout_queue_get_time = actors.take_rollouts(update)
    tic = time.time()
    # Every process's transitions and records in global env order (each holds the whole replay).
    data, env_record = gathered_rollouts([(r.data, r.record) for r in rollouts], args.distributed)
    replay_insert(replay, data)
    insert_time = time.time() - tic
    tic = time.time()
    done_before = optimizer_steps_after(args, sizes, update - 1)
    count = optimizer_steps_after(args, sizes, update) - done_before
    batches = None
    if count:
        stacked = sample_batches(args, replay, done_before + 1, count)
        batches = local_shares(stacked, len(args.learner_device_ids), batch_axis=1)
    return Received(
        rollouts=rollouts,
        env_record=env_record,
        batches=batches,
        replay_size=replay.size,
        rollout_queue_get_time=rollout_queue_get_time,
        stats=dict(insert_time=insert_time, sample_time=time.time() - tic),
    )


def log_update(args, sizes, run, update: int, current: Received, metrics, learn_time: float):
    """`RunLogs.log_update` with the replay's size and the seconds of insertion, sampling and
    learning (until the parameters are ready, a checkpoint included; with --concurrency the next
    update's receive overlaps it). `metrics`: the last learning update's (None before)."""
    run.logs.log_update(
        update,
        rollouts=current.rollouts,
        metrics=metrics,
        learner_times=LearnerTimes(current.rollout_queue_get_time, learn_time),
        stats=current.stats,
        optimizer_steps=optimizer_steps_after(args, sizes, update),
        replay_size=current.replay_size,
    )


def model_params(state: SACState) -> dict:
    """What the model file saves and the fingerprint hashes: parameters, not optimizer states."""
    params = dict(
        actor=state.actor_params,
        critic=state.critic_params,
        target_critic=state.target_critic_params,
        log_alpha=state.log_alpha,
    )
    return jax.device_get(first_replica(params))


def train(args: Args):
    sizes = sizes_of(args, jax.process_count())
    learner_devices = [jax.local_devices()[i] for i in args.learner_device_ids]
    global_learner_devices = distributed.global_learner_devices(args.learner_device_ids)
    networks = networks_of(args)
    replay = make_replay(args, observation_size(args.env_id), len(networks.bounds.scale))
    origin = init_state(args, sizes, networks, replay)
    run = open_run(
        args=args,
        sizes=sizes,
        script_path=__file__,
        counters=origin.counters,
        global_learner_devices=global_learner_devices,
        evaluate=evaluate,
        model_card=MODEL_CARD,
        checkpointing=origin.checkpointing,
    )
    state = replicate(origin.learner, learner_devices)
    run.evaluate_untrained(lambda: model_params(state))
    update_fn = make_update(args, global_learner_devices, networks)
    lag = LagRule(
        first_update=origin.counters["update"] + 1,
        num_updates=sizes.num_updates,
        concurrency=args.concurrency,
        on_resume=ON_RESUME,
    )
    actors = handoff.start_actor_threads(
        actor_thread,
        [jax.local_devices()[i] for i in args.actor_device_ids],
        args=args,
        run=run,
        lag=lag,
        sizes=sizes,
        networks=networks,
        env_record=origin.env_record,
    )
    receive_update = functools.partial(receive, args, sizes, replay=replay, actors=actors)
    metrics = None
    incoming = None
    with run.learner_loop(actors.threads) as end:
        actors.send_first(first_replica(state.actor_params), acting_params=origin.acting_params)
        update = lag.first_update - 1  # the updates done, where the loop makes none (finished)
        for update in lag.updates():
            current = receive_update(update) if incoming is None else incoming
            learn_start = time.time()
            if current.batches is not None:
                state, metrics = update_fn(state, current.batches)
            # The checkpoint holds the replay as this update left it.
            kept = Continuation(state, actors.last_sent, current.env_record, replay=replay.mark())
            end.exit_code = run.after_update(kept, update)
            incoming = None
            # With --concurrency take, insert and sample the next rollouts while the device trains
            # on these (after the checkpoint, which holds the replay as this update left it).
            if args.concurrency and update < sizes.num_updates and not end.exit_code:
                incoming = receive_update(update + 1)
            jax.block_until_ready(state)
            learn_time = time.time() - learn_start
            log_update(
                args,
                sizes,
                run=run,
                update=update,
                current=current,
                metrics=metrics,
                learn_time=learn_time,
            )
            if run.evaluation_due(update):
                optimizer_steps = optimizer_steps_after(args, sizes, update)
                run.evaluate_and_log(update, model_params(state), optimizer_steps)
            if end.exit_code:
                break
            if update < sizes.num_updates:
                actors.send(first_replica(state.actor_params), update)
    run.finish(model_params(state), update, optimizer_steps_after(args, sizes, update))


# === Main ===


def main(argv=None):
    args = parse_args(argv)
    distributed.join(args)
    validate_layout(args)
    train(args)


if __name__ == "__main__":
    main()
