"""Cleanba PPO for continuous control: a diagonal Gaussian policy on envpool's MuJoCo and dm_control
tasks, with the hyperparameters of CleanRL's `ppo_continuous_action.py`.

The default layout, 8 environments x 256 steps, keeps CleanRL's batch of 2048 steps; CleanRL's own
layout, `--local-num-envs 1 --num-steps 2048`, runs too. An actor's rollout is one compiled program,
the policy and envpool's step in a `lax.scan` (`compiled_rollout`): no Python call per step.

Actor threads collect rollouts, a pmap'd learner trains on them: on data of the policy one version
behind with `--concurrency`, of its current policy without (`cleanba_utils.handoff`).

Observation normalization and reward scaling. The running statistics (mean and variance of the
observations; variance of each environment's discounted return) belong to the learner, are saved
with its checkpoints and with the model, and travel to the actors with the parameters. An actor
plays a whole rollout with the statistics it received (frozen), and returns the raw observations
and rewards with its environments' discounted-return accumulators. The learner normalizes the
rollout with the statistics the actor played with, trains on it, then folds the whole rollout's
observations and returns into the statistics at once: one batched mean / variance update over every
environment of the run, summed in a fixed order. The statistics therefore never depend on thread
timing or on the layout (threads, learner devices, processes) beyond float rounding.

How this differs from gym's `NormalizeObservation` / `NormalizeReward` wrappers, which CleanRL
uses: the wrappers update their statistics at every step, before normalizing that step, separately
in each process; here the statistics move once per rollout, so an actor plays with statistics up to
one rollout old (two with `--concurrency`), and the first rollout is played with the initial ones
(mean 0, variance 1). The batched update is the wrappers' parallel-moments formula, so over the same
data the statistics agree up to rounding. As with the wrappers, every observation the policy acted
on is counted, and the observation an episode ends with (envpool returns it on the episode's last
step, gym's vector environments in `info`) is not.
"""

import dataclasses
import functools
import os
import time
from typing import Any, Literal, NamedTuple

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import rlax
from flax.training.train_state import TrainState

from cleanba_utils import (
    compiled_rollout,
    cores,
    distributed,
    hub,
    kept_lag,
    parsing,
    split_envs,
)
from cleanba_utils.devices import first_replica, gathered_rollouts, learner_sharding, replicate
from cleanba_utils.env_ids import is_gymnasium_env
from cleanba_utils.env_records import EnvRecord
from cleanba_utils.envs import action_space_of, flat_observation, make_env
from cleanba_utils.errors import fail
from cleanba_utils.evaluation_episodes import carrying_state, play_episodes
from cleanba_utils.fields import in_range, non_negative, positive
from cleanba_utils.handoff import ActorTimes, LagRule, OnResume, start_actor_threads
from cleanba_utils.kept_lag import Continuation
from cleanba_utils.microbatches import minibatch_ids
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
    save_model: bool = False
    """save the final parameters and normalizer statistics to
    `runs/{run_name}/{exp_name}.cleanba_model`"""

    env_id: str = "HalfCheetah-v4"
    """the environment, with continuous actions: an envpool id (MuJoCo or dm_control:
    HalfCheetah-v4, CheetahRun-v1), gymnax:<id> for gymnax's JAX environment (gymnax:Pendulum-v1)
    or jax:<module>:<class> for your own with gymnax's interface (docs/jax_environments.md)"""
    total_timesteps: int = positive(1_000_000)
    """total environment steps of the run"""
    learning_rate: float = positive(3e-4)
    """the learning rate of the optimizer"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
    local_num_envs: int = positive(8)
    """the number of environments of each actor thread"""
    num_actor_threads: int = positive(1)
    """the number of actor threads per actor device"""
    num_steps: int = positive(256)
    """the number of steps each environment runs per rollout"""
    gamma: float = in_range(0.99, 0, 1, low_open=True)
    """the discount factor (of the advantages and of the returns that scale the rewards)"""
    gae_lambda: float = in_range(0.95, 0, 1)
    """the lambda of generalized advantage estimation"""
    bootstrap_truncations: bool = True
    """bootstrap an episode cut by the time limit from the value of its last observation;
    --no-bootstrap-truncations treats the time limit as a termination, as CleanRL's
    ppo_continuous_action.py does (for comparisons with it)"""
    num_minibatches: int = positive(32)
    """the number of minibatches per epoch"""
    update_epochs: int = positive(10)
    """the number of epochs over each rollout"""
    norm_adv: bool = True
    """normalize advantages with the statistics of the whole minibatch"""
    clip_coef: float = positive(0.2)
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """clip the value loss: per sample, the larger of the squared errors of the new value and of the
    rollout's value moved towards it by at most --clip-coef"""
    ent_coef: float = non_negative(0.0)
    """the entropy coefficient"""
    vf_coef: float = non_negative(0.5)
    """the value function coefficient"""
    max_grad_norm: float = positive(0.5)
    """the maximum global norm of the gradient"""
    hiddens: tuple[int, ...] = (64, 64)
    """the sizes of the tanh hidden layers of each of the separate actor and critic MLPs"""
    core: Literal["none", "lstm", "gru"] = "none"
    """a recurrent core before the actor and critic MLPs (cleanba_utils/cores.py), its state
    carried per environment and reset where an episode starts: for tasks whose observation does not
    show all the agent needs. With one, a minibatch is a set of whole environment sequences, which
    the loss replays from the state their first step met (so --num-minibatches must divide the
    environments of each learner device)"""
    core_size: int = positive(256)
    """the units of the core, and of the dense layer (ReLU) before it"""


# The options that act only in some configurations, with what each needs: `validate` refuses one
# set away from its default where its need does not hold.
NEEDS = {
    **RUN_NEEDS,
    "core_size": cores.A_CORE,
}


def sizes_of(args: Args, num_processes: int) -> Sizes:
    num_envs = (
        args.local_num_envs * args.num_actor_threads * len(args.actor_device_ids) * num_processes
    )
    return rollout_sizes(num_envs, args.num_steps, args.total_timesteps)


def parse_args(argv=None) -> Args:
    args = parsing.parse_args(Args, argv)
    validate(args)
    return args


def validate(args: Args):
    """Checks every argument that needs no device, first; exits 2 on the first problem."""
    parsing.check_fields(args)
    parsing.check_continuous_actions(args)
    parsing.check_needs(args, NEEDS)
    parsing.check_run_options(args)
    parsing.check_layers(args, ["hiddens"])


def validate_layout(args: Args):
    """The checks that need the devices (and, with --distributed, the number of processes)."""
    sizes = sizes_of(args, jax.process_count())
    parsing.check_devices(args, sizes.num_updates, sizes.steps_per_update)
    envs_per_device = args.local_num_envs // len(args.learner_device_ids)
    if args.core != "none" and envs_per_device % args.num_minibatches:
        fail(
            f"--local-num-envs {args.local_num_envs} over {len(args.learner_device_ids)} learner "
            f"device(s) gives {envs_per_device} envs per device, not divisible by "
            f"--num-minibatches {args.num_minibatches}: with --core {args.core} a minibatch holds "
            "whole environment sequences (set --num-minibatches to a divisor, or more "
            "--local-num-envs)"
        )
    if args.core == "none" and args.num_steps % args.num_minibatches:
        fail(
            f"--num-steps {args.num_steps} must be divisible by --num-minibatches "
            f"{args.num_minibatches}: a minibatch takes an equal chunk of every environment's steps"
        )


# === Environment ===


# `cleanba_utils.envs.make_env`: envpool's tasks; a MuJoCo or dm_control time limit truncates.


# === Normalization ===

OBS_CLIP = 10.0
REWARD_CLIP = 10.0
EPSILON = 1e-8


class MeanVar(NamedTuple):
    """Running statistics, from a count of 1e-4 (mean 0, variance 1) as gym's RunningMeanStd."""

    mean: jax.Array
    var: jax.Array
    count: jax.Array


class Normalizer(NamedTuple):
    """The observations' statistics (per feature) and the discounted returns' (a scalar)."""

    obs: MeanVar
    returns: MeanVar


def initial_normalizer(obs_dim: int) -> Normalizer:
    fresh = lambda shape: MeanVar(
        mean=np.zeros(shape, np.float32),
        var=np.ones(shape, np.float32),
        count=np.float32(1e-4),
    )
    return Normalizer(obs=fresh((obs_dim,)), returns=fresh(()))


def normalize_observations(stats: MeanVar, obs):
    return jnp.clip((obs - stats.mean) / jnp.sqrt(stats.var + EPSILON), -OBS_CLIP, OBS_CLIP)


def scale_rewards(stats: MeanVar, rewards):
    """Divided by the standard deviation of the discounted return (not centered), then clipped."""
    return jnp.clip(rewards / jnp.sqrt(stats.var + EPSILON), -REWARD_CLIP, REWARD_CLIP)


def combined(stats: MeanVar, batch: MeanVar) -> MeanVar:
    """The statistics of the union of two sets of samples (Chan et al.'s parallel formula)."""
    delta = batch.mean - stats.mean
    count = stats.count + batch.count
    mean = stats.mean + delta * batch.count / count
    sum_of_squares = stats.var * stats.count + batch.var * batch.count
    sum_of_squares += delta**2 * stats.count * batch.count / count
    return MeanVar(mean=mean, var=sum_of_squares / count, count=count)


def updated_stats(stats: MeanVar, samples, valid) -> MeanVar:
    """`stats` with the valid samples of (envs, steps, ...) arrays of every learner device (inside
    the learner's pmap): a two-pass mean and variance of the batch, then `combined`."""
    weights = valid.reshape(*valid.shape, *[1] * (samples.ndim - valid.ndim))
    count = jax.lax.psum(valid.sum(), "devices")
    safe_count = jnp.maximum(count, 1.0)
    mean = jax.lax.psum((samples * weights).sum((0, 1)), "devices") / safe_count
    var = jax.lax.psum((((samples - mean) ** 2) * weights).sum((0, 1)), "devices") / safe_count
    return combined(stats, MeanVar(mean=mean, var=var, count=count))


# === Network ===


class MLP(nn.Module):
    """tanh hidden layers and a linear output, orthogonally initialized (scale sqrt 2, then
    `output_scale`), biases zero."""

    hiddens: tuple[int, ...]
    outputs: int
    output_scale: float

    @nn.compact
    def __call__(self, x):
        for hidden in self.hiddens:
            x = nn.tanh(nn.Dense(hidden, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return nn.Dense(self.outputs, kernel_init=nn.initializers.orthogonal(self.output_scale))(x)


class Network(nn.Module):
    """Separate actor and critic MLPs on normalized observations (N, D): the actor gives the mean of
    a diagonal Gaussian, its log standard deviation a state-independent parameter (initially 0).

    With a recurrent `core` (--core) it takes sequences, time-major (`cores`): `(obs (T, N, D), the
    state entering step 0, is_reset (T, N)) -> (mean, log_std, values, the state after step T -
    1)`, the MLPs on the core's outputs after a dense layer of `core_size` units (ReLU) and the
    core (PureJaxRL's `ppo_rnn.py`'s embedding and GRU)."""

    hiddens: tuple[int, ...]
    action_dim: int
    core: str = "none"
    core_size: int = 256

    @nn.compact
    def __call__(self, obs, core_state=None, is_reset=None):
        x = obs
        if self.core != "none":
            steps_and_envs = obs.shape[:2]
            dense = nn.Dense(self.core_size, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))
            x = nn.relu(dense(obs))
            core_state, x = cores.Core(self.core, self.core_size)(core_state, x, is_reset)
            x = x.reshape(-1, self.core_size)
        mean = MLP(self.hiddens, self.action_dim, 0.01)(x)
        log_std = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
        value = MLP(self.hiddens, 1, 1.0)(x)[:, 0]
        if self.core == "none":
            return mean, log_std, value
        return mean.reshape(*steps_and_envs, -1), log_std, value.reshape(steps_and_envs), core_state


def log_2pi(dtype):
    """log(2π) in `dtype`, also where 64-bit types are on (the compiled rollout's)."""
    return jnp.log(jnp.asarray(2 * jnp.pi, dtype))


def gaussian_log_prob(mean, log_std, action):
    """log density of `action` under the diagonal Gaussian, summed over the action's dimensions."""
    z = (action - mean) * jnp.exp(-log_std)
    return (-0.5 * z**2 - log_std - 0.5 * log_2pi(log_std.dtype)).sum(-1)


def gaussian_entropy(log_std):
    """The diagonal Gaussian's entropy, which depends on its standard deviation only."""
    return (0.5 + 0.5 * log_2pi(log_std.dtype) + log_std).sum(-1)


# === Actor ===

# Across a resume the policy lag stays 1 (cleanba_utils.handoff), which the bitwise resume needs.
ON_RESUME: OnResume = "keep_lag"


class Policy(NamedTuple):
    """What the learner sends its actors, and what the model file holds: the parameters and the
    normalizer statistics to play with."""

    params: dict
    normalizer: Normalizer


def policy_from_dict(saved: dict) -> Policy:
    """A Policy from the flax state dict the model file holds (`to_state_dict`)."""
    normalizer = saved["normalizer"]
    return Policy(
        params=saved["params"],
        normalizer=Normalizer(
            obs=MeanVar(**normalizer["obs"]), returns=MeanVar(**normalizer["returns"])
        ),
    )


def policy_outputs(network: Network, policy: Policy, obs, *core):
    """The network on observations normalized with the policy's statistics: mean, log_std, value.
    With a recurrent core, `core` is (the state, `is_reset`), and the state after the step follows
    (one step of the sequence)."""
    obs = normalize_observations(policy.normalizer.obs, obs)
    if not core:
        return network.apply(policy.params, obs)
    core_state, is_reset = core
    mean, log_std, value, core_state = network.apply(
        policy.params, obs[None], core_state, is_reset[None]
    )
    return mean[0], log_std, value[0], core_state


def sample_actions(mean, log_std, key, step, env_ids):
    """Unclipped Gaussian actions, the noise keyed by (step, global env index): the same draws
    whatever the layout."""
    step_key = jax.random.fold_in(key, step)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(step_key, env_ids)
    noise = jax.vmap(lambda k: jax.random.normal(k, mean.shape[1:], mean.dtype))(keys)
    return mean + jnp.exp(log_std) * noise


class Trajectories(NamedTuple):
    """One rollout, env-major (envs, steps, ...): raw observations and rewards, the unclipped
    actions and their log-probabilities, the values (one more step: the bootstrap), each
    environment's discounted return so far (what scales the rewards), and the reset steps (envpool's
    step after an episode's end, masked out of learning and of the statistics)."""

    obs: np.ndarray
    actions: np.ndarray
    logprobs: np.ndarray
    values: np.ndarray
    rewards: np.ndarray
    discounted_returns: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    is_reset: np.ndarray
    env_ids: np.ndarray
    first_core_state: Any = None
    """with a recurrent core: the state each environment's first step met (None without one)"""


class Rollout(NamedTuple):
    """What an actor thread puts on its rollout queue: the update it is for, the policy version that
    played it and the normalizer statistics it played with, its trajectories (one slice of
    environments per learner device), its environments' record and discounted returns after it
    (for a checkpoint to bring them back) and the seconds it spent waiting for parameters, playing,
    stepping and inferring."""

    update: int
    policy_version: int
    normalizer: Normalizer
    data: Trajectories
    record: EnvRecord
    discounted_return: np.ndarray
    """each environment's discounted return after the rollout, which scales its next rewards"""
    timing: ActorTimes
    next_core_state: Any = None
    """with a recurrent core, its state after the rollout, on the host (for a checkpoint)"""


class PolicyOutputs(NamedTuple):
    """What the rollout keeps of each step's policy, besides the clipped actions the environments
    receive: the unclipped action, its log-probability and the value."""

    actions: jax.Array
    logprobs: jax.Array
    values: jax.Array


def act(network: Network, key, low, high, policy: Policy, obs, env_ids, step, _, *core):
    """One step of the compiled rollout (`compiled_rollout`): the sampled actions, clipped to the
    action bounds (in the task's action type) for the environments. With a recurrent core, `core`
    is (the state, `is_reset`) and the state after the step follows."""
    mean, log_std, value, *core_state = policy_outputs(network, policy, obs, *core)
    action = sample_actions(mean=mean, log_std=log_std, key=key, step=step, env_ids=env_ids)
    env_action = jnp.clip(action.astype(low.dtype), low, high)
    logprob = gaussian_log_prob(mean, log_std, action)
    outputs = PolicyOutputs(actions=action, logprobs=logprob, values=value)
    return env_action, outputs, *core_state


def bootstrap_value(network: Network, policy: Policy, obs, *core_state):
    """The critic's value of the observation after the rollout's last step (with a recurrent core,
    from the state after that step)."""
    if core_state:
        no_reset = jnp.zeros(obs.shape[0], bool)
        return policy_outputs(network, policy, obs, core_state[0], no_reset)[2]
    return policy_outputs(network, policy, obs)[2]


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
    env_record,
    discounted_returns,
    core_state,
):
    """One actor thread (`start_actor_threads`) on `device`, playing the updates of `lag`:
    environments with global indices env_offset .. env_offset + local_num_envs - 1 in a compiled
    rollout (Gymnasium's: in Python), their rollouts split among the local `learner_devices`; a
    resumed run continues them from their part of `env_record`, every environment's `EnvRecord` at
    the checkpoint, and of `discounted_returns` (None: a fresh run). The policy's actions are stored
    unclipped (their log-probabilities are the Gaussian's); the environments receive them clipped to
    the action bounds. Which policy plays which rollout: `cleanba_utils.handoff`, with
    `ON_RESUME`. `core_state`: with a recurrent core, every environment's state before the first
    rollout (zeros, or the checkpoint's), else None."""
    action_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 1)
    on_learner_devices = learner_sharding(learner_devices)
    # Each environment's discounted return, restarted with each episode: a resumed run's from the
    # checkpoint.
    own_envs = slice(env_offset, env_offset + args.local_num_envs)
    discounted_return = np.zeros(args.local_num_envs)
    if discounted_returns is not None:
        discounted_return = np.array(discounted_returns[own_envs])
    env_ids = np.arange(env_offset, env_offset + args.local_num_envs, dtype=np.int32)
    action_space = action_space_of(args)
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
        act=functools.partial(act, network, action_key, action_space.low, action_space.high),
        bootstrap=functools.partial(bootstrap_value, network),
        core_state=None if core_state is None else jax.tree.map(lambda x: x[own_envs], core_state),
    )
    for update in lag.updates():
        param_wait_start = time.time()
        if lag.actor_fetches_params(update):
            policy_version, policy = queue_get(param_queue, run.stop)
        param_queue_get_time = time.time() - param_wait_start

        rollout_start = time.time()
        played = envs.play(policy, update)
        steps = played.steps
        # The discounted returns that scale the rewards, step by step.
        discounted_returns = np.zeros(steps.rewards.shape)
        for step in range(args.num_steps):
            discounted_return = discounted_return * args.gamma + steps.rewards[:, step]
            discounted_returns[:, step] = discounted_return
            discounted_return[steps.terminations[:, step] | steps.truncations[:, step]] = 0.0
        last_value = np.asarray(played.bootstrap_value)[:, None]
        data = Trajectories(
            obs=steps.obs,
            actions=steps.outputs.actions,
            logprobs=steps.outputs.logprobs,
            values=np.concatenate([steps.outputs.values, last_value], axis=1),
            rewards=steps.rewards.astype(np.float32),
            discounted_returns=discounted_returns.astype(np.float32),
            terminations=steps.terminations,
            truncations=steps.truncations,
            is_reset=steps.is_reset,
            env_ids=env_ids,
            first_core_state=played.first_core_state,
        )
        # One slice of environments per learner device: a single host-to-device copy of the whole
        # rollout, overlapped with the learner's work.
        by_device = jax.tree.map(lambda x: x.reshape(len(learner_devices), -1, *x.shape[1:]), data)
        rollout = Rollout(
            update=update,
            policy_version=policy_version,
            normalizer=jax.device_get(policy.normalizer),
            data=jax.device_put(by_device, on_learner_devices),
            record=played.record,
            discounted_return=discounted_return.copy(),
            timing=ActorTimes(
                param_queue_get_time=param_queue_get_time,
                rollout_time=time.time() - rollout_start,
                env_step_time=played.env_step_time,
            ),
            next_core_state=played.next_core_state,
        )
        queue_put(rollout_queue, rollout, run.stop)


def evaluate(saved_policy: dict, args: Args, num_episodes: int, seed: int) -> list[float]:
    """Plays one episode in each of `num_episodes` fresh environments with the mean action (clipped)
    and the normalizer statistics frozen; `saved_policy` is a Policy's state dict."""
    policy = policy_from_dict(saved_policy)
    envs = make_env(args, seed, num_episodes)
    network = network_of(args, envs.action_space.shape[0])
    low = envs.action_space.low
    high = envs.action_space.high
    if args.core == "none":
        mean_action = jax.jit(lambda policy, obs: policy_outputs(network, policy, obs)[0])
        act = lambda obs, _: np.clip(
            np.asarray(mean_action(policy, flat_observation(obs))), low, high
        )
        return play_episodes(envs, num_episodes, act)
    # Each environment plays one episode: its state never resets.
    no_reset = np.zeros(num_episodes, bool)
    step_core = jax.jit(
        lambda policy, obs, state: policy_outputs(network, policy, obs, state, no_reset)
    )

    def mean_action(obs, _, state):
        mean, _, _, state = step_core(policy, flat_observation(obs), state)
        return np.clip(np.asarray(mean), low, high), state

    first_state = cores.initial_state(args.core, args.core_size, num_episodes)
    return play_episodes(envs, num_episodes, carrying_state(mean_action, first_state))


def network_of(args, action_dim: int) -> Network:
    return Network(args.hiddens, action_dim, core=args.core, core_size=args.core_size)


# The model card of --upload-model: the algorithm, its papers and how `evaluate` acts.
MODEL_CARD = hub.ModelCard(
    name="PPO with a Gaussian policy",
    papers=(hub.PPO,),
    evaluation_policy=lambda args: (
        "the Gaussian policy's mean action, clipped to the action bounds, with the observation "
        "normalizer frozen"
    ),
)


# === Loss ===


def treated_as_terminations(terminations, truncations, bootstrap_truncations: bool):
    """What GAE takes as terminations: the episodes' terminations, and with
    --no-bootstrap-truncations their truncations too (CleanRL's done: terminated or truncated)."""
    return terminations if bootstrap_truncations else terminations | truncations


def gae(rewards, values, terminations, truncations, *, gamma, gae_lambda):
    """Advantages and returns of one environment's rollout; `values` has one more entry (the
    bootstrap).

    A termination stops bootstrapping. A truncation bootstraps from the value of the episode's last
    observation and, like a termination, cuts the trace so that no advantage flows across episodes:
    envpool returns that last observation on the truncating step and resets on the next one (the
    reset step), so `values[t + 1]` of a truncating step t is the value of the last observation. The
    reset step's own advantage is computed but masked out of the loss."""
    discount = gamma * (1.0 - terminations)
    trace = gae_lambda * (1.0 - jnp.maximum(terminations, truncations))
    advantages = rlax.truncated_generalized_advantage_estimation(rewards, discount, trace, values)
    return advantages, advantages + values[:-1]


class Batch(NamedTuple):
    """This device's minibatch (envs, steps of each env, ...); `valid` is 0 on reset steps. With a
    recurrent core, whole environment sequences and the state their first step met."""

    obs: jax.Array
    actions: jax.Array
    logprobs: jax.Array
    values: jax.Array
    returns: jax.Array
    advantages: jax.Array
    valid: jax.Array
    first_core_state: Any = None


def ppo_loss(params, apply_fn, batch: Batch, count, *, clip_coef, ent_coef, vf_coef, clip_vloss):
    """Sums of per-sample losses over this device's valid samples, divided by the global count.
    With a recurrent core, each environment's sequence replayed from the state its first step met,
    the state reset after its reset steps as the actor's was (`cores`)."""
    if batch.first_core_state is None:
        obs = batch.obs.reshape(-1, batch.obs.shape[-1])
        mean, log_std, value = apply_fn(params, obs)
        mean = mean.reshape(batch.actions.shape)
        value = value.reshape(batch.values.shape)
    else:
        time_major = lambda x: jnp.swapaxes(x, 0, 1)
        is_reset = batch.valid == 0
        mean, log_std, value, _ = apply_fn(
            params, time_major(batch.obs), batch.first_core_state, time_major(is_reset)
        )
        mean, value = time_major(mean), time_major(value)
    logratio = gaussian_log_prob(mean, log_std, batch.actions) - batch.logprobs
    ratio = jnp.exp(logratio)
    pg_loss = jnp.maximum(
        -batch.advantages * ratio,
        -batch.advantages * jnp.clip(ratio, 1 - clip_coef, 1 + clip_coef),
    )
    value_loss = (value - batch.returns) ** 2
    if clip_vloss:
        clipped_value = batch.values + jnp.clip(value - batch.values, -clip_coef, clip_coef)
        value_loss = jnp.maximum(value_loss, (clipped_value - batch.returns) ** 2)
    value_loss = 0.5 * value_loss
    entropy = jnp.broadcast_to(gaussian_entropy(log_std), batch.valid.shape)
    masked_mean = lambda x: (x * batch.valid).sum() / count
    loss = masked_mean(pg_loss) - ent_coef * masked_mean(entropy)
    loss += vf_coef * masked_mean(value_loss)
    metrics = dict(
        policy_loss=masked_mean(pg_loss),
        value_loss=masked_mean(value_loss),
        entropy=masked_mean(entropy),
        approx_kl=masked_mean((ratio - 1) - logratio),
        clipfrac=masked_mean(jnp.abs(ratio - 1) > clip_coef),
    )
    return loss, metrics


# === Update ===


class LearnerState(TrainState):
    """The train state and the normalizer statistics, which checkpoints save together."""

    normalizer: Normalizer


def init_state(args: Args, sizes: Sizes):
    """The network and where the run starts (`kept_lag.Origin`): the learner state and counters,
    and with --resume the newest checkpoint's policy and environments."""
    probe_env = make_env(args, args.seed, 1)
    obs_dim = flat_observation(probe_env.reset()[0]).shape[1]
    network = network_of(args, probe_env.action_space.shape[0])
    probe_env.close()
    params = cores.init_network(
        network,
        jax.random.fold_in(jax.random.PRNGKey(args.seed), 0),
        np.zeros((1, obs_dim), np.float32),
    )
    steps_per_update = args.update_epochs * args.num_minibatches
    learning_rate = lambda count: learning_rate_at(args, sizes, 1 + count // steps_per_update)
    optimizer = optax.chain(
        optax.clip_by_global_norm(args.max_grad_norm),
        optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate, eps=1e-5),
    )
    state = LearnerState.create(
        apply_fn=network.apply,
        params=params,
        tx=optimizer,
        normalizer=initial_normalizer(obs_dim),
    )
    acting_policy = Policy(params=params, normalizer=state.normalizer)
    # The actors' carry: every environment's discounted return, and with a recurrent core its
    # state.
    actor_carry = np.zeros(sizes.num_envs)
    if args.core != "none":
        core_state = cores.initial_state(args.core, args.core_size, sizes.num_envs)
        actor_carry = (actor_carry, jax.device_get(core_state))
    return network, kept_lag.run_origin(
        args, sizes, __file__, state, acting_policy, actor_carry=actor_carry
    )


def carried(args: Args, sizes: Sizes, actor_carry) -> tuple:
    """(every environment's discounted return, its core state) from the actors' carry, the
    checkpoint's or None: a fresh run's discounted returns are None (the actors start them at
    zero), its core states zeros, and without a core the states are None."""
    if args.core == "none":
        return actor_carry, None
    if actor_carry is None:
        return None, jax.device_get(cores.initial_state(args.core, args.core_size, sizes.num_envs))
    return actor_carry


def take_steps(x, steps):
    """`x[e, steps[e, i]]` for every environment e: the chosen steps of its rollout."""
    return jnp.take_along_axis(x, steps.reshape(*steps.shape, *[1] * (x.ndim - 2)), axis=1)


def make_update(args: Args, learner_devices: list):
    """`update_fn(state, rollouts, played_normalizer, update) -> (state, metrics)`, pmap'd over the
    learner devices: the rollouts normalized with the statistics they were played with, GAE, then
    `update_epochs` epochs of `num_minibatches` optimizer steps, and last the statistics updated
    with the rollouts' raw observations and returns.

    Layout invariance: minibatch membership depends only on global env indices (each environment's
    steps are permuted by its own key and cut into `num_minibatches` chunks; a minibatch is the
    union of every environment's chunk), and every mean is a global one (psum of sums over psum of
    counts), so the layout changes the result only by float rounding. With one environment this is
    CleanRL's uniform shuffle of the batch. The whole update is one compiled program, a scan over
    epochs of a scan over minibatches (the network needs no gradient accumulation)."""
    learner_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 2)
    minibatch_steps = args.num_steps // args.num_minibatches
    per_env_gae = functools.partial(gae, gamma=args.gamma, gae_lambda=args.gae_lambda)

    def normalized_advantages(batch: Batch, count):
        """Per minibatch, over every learner device; the standard deviation with Bessel's
        correction, as CleanRL's torch.std."""
        mean = jax.lax.psum((batch.advantages * batch.valid).sum(), "devices") / count
        squares = jax.lax.psum((((batch.advantages - mean) ** 2) * batch.valid).sum(), "devices")
        std = jnp.sqrt(squares / jnp.maximum(count - 1.0, 1.0))
        return (batch.advantages - mean) / (std + 1e-8)

    def update_on_device(state: LearnerState, rollouts, played: Normalizer, update):
        data = jax.tree.map(lambda *xs: jnp.concatenate(xs), *rollouts)
        terminations = treated_as_terminations(
            data.terminations, data.truncations, args.bootstrap_truncations
        )
        advantages, returns = jax.vmap(per_env_gae)(
            scale_rewards(played.returns, data.rewards),
            data.values,
            terminations.astype(jnp.float32),
            data.truncations.astype(jnp.float32),
        )
        rollout = Batch(
            obs=normalize_observations(played.obs, data.obs),
            actions=data.actions,
            logprobs=data.logprobs,
            values=data.values[:, :-1],
            returns=returns,
            advantages=advantages,
            valid=1.0 - data.is_reset.astype(jnp.float32),
            first_core_state=data.first_core_state,
        )

        def epoch_step(state, epoch):
            epoch_key = jax.random.fold_in(jax.random.fold_in(learner_key, update), epoch)
            if args.core == "none":
                orders = jax.vmap(
                    lambda g: jax.random.permutation(
                        jax.random.fold_in(epoch_key, g), args.num_steps
                    )
                )(data.env_ids)
            else:
                # Whole environment sequences: minibatch m is the m-th block of this order.
                order = jnp.argsort(
                    minibatch_ids(epoch_key, data.env_ids, args.num_minibatches), stable=True
                )
                envs_per_minibatch = order.shape[0] // args.num_minibatches

            def minibatch_step(state, minibatch):
                if args.core == "none":
                    first = minibatch * minibatch_steps
                    picked = jax.lax.dynamic_slice_in_dim(orders, first, minibatch_steps, axis=1)
                    batch = jax.tree.map(lambda x: take_steps(x, picked), rollout)
                else:
                    first = minibatch * envs_per_minibatch
                    picked = jax.lax.dynamic_slice_in_dim(order, first, envs_per_minibatch)
                    batch = jax.tree.map(lambda x: x[picked], rollout)
                count = jnp.maximum(jax.lax.psum(batch.valid.sum(), "devices"), 1.0)
                if args.norm_adv:
                    batch = batch._replace(advantages=normalized_advantages(batch, count))
                grads, metrics = jax.grad(ppo_loss, has_aux=True)(
                    state.params,
                    apply_fn=state.apply_fn,
                    batch=batch,
                    count=count,
                    clip_coef=args.clip_coef,
                    ent_coef=args.ent_coef,
                    vf_coef=args.vf_coef,
                    clip_vloss=args.clip_vloss,
                )
                # Each device's loss is a share of the global mean: summed, the global gradient.
                grads, metrics = jax.lax.psum((grads, metrics), "devices")
                return state.apply_gradients(grads=grads), metrics

            return jax.lax.scan(minibatch_step, state, jnp.arange(args.num_minibatches))

        state, metrics = jax.lax.scan(epoch_step, state, jnp.arange(args.update_epochs))
        normalizer = Normalizer(
            obs=updated_stats(state.normalizer.obs, data.obs, rollout.valid),
            returns=updated_stats(state.normalizer.returns, data.discounted_returns, rollout.valid),
        )
        return state.replace(normalizer=normalizer), jax.tree.map(jnp.mean, metrics)

    return jax.pmap(
        update_on_device, axis_name="devices", devices=learner_devices, in_axes=(0, 0, 0, None)
    )


def learning_rate_at(args: Args, sizes: Sizes, update: int) -> float:
    """Constant within an update, linearly down to zero over the run."""
    if not args.anneal_lr:
        return args.learning_rate
    return args.learning_rate * (1.0 - (update - 1) / sizes.num_updates)


def optimizer_steps_after(args: Args, update: int) -> int:
    """One optimizer step per minibatch of every epoch."""
    return update * args.update_epochs * args.num_minibatches


# === Learner loop ===


def host_policy(state: LearnerState) -> Policy:
    """The policy the actors play with next: this process's first replica of the learner's."""
    return first_replica(Policy(params=state.params, normalizer=state.normalizer))


def model_policy(state: LearnerState) -> dict:
    """The learner's policy as the model file saves it and evaluation plays it: the flax state dict
    of `host_policy`, on the host."""
    return flax.serialization.to_state_dict(jax.device_get(host_policy(state)))


def train(args: Args):
    sizes = sizes_of(args, jax.process_count())
    learner_devices = [jax.local_devices()[i] for i in args.learner_device_ids]
    global_learner_devices = distributed.global_learner_devices(args.learner_device_ids)
    network, origin = init_state(args, sizes)
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
    run.evaluate_untrained(lambda: model_policy(state))
    update_fn = make_update(args, global_learner_devices)
    lag = LagRule(
        first_update=origin.counters["update"] + 1,
        num_updates=sizes.num_updates,
        concurrency=args.concurrency,
        on_resume=ON_RESUME,
    )
    discounted_returns, core_state = carried(args, sizes, origin.actor_carry)
    actors = start_actor_threads(
        actor_thread,
        [jax.local_devices()[i] for i in args.actor_device_ids],
        args=args,
        run=run,
        lag=lag,
        sizes=sizes,
        network=network,
        learner_devices=learner_devices,
        env_record=origin.env_record,
        discounted_returns=discounted_returns,
        core_state=core_state,
    )
    with run.learner_loop(actors.threads) as end:
        actors.send_first(host_policy(state), acting_params=origin.acting_params)
        update = lag.first_update - 1  # the updates done, where the loop makes none (finished)
        for update in lag.updates():
            rollouts, rollout_queue_get_time = actors.take_rollouts(update)
            learn_start = time.time()
            # One policy version played all the rollouts of an update, with the same statistics.
            played_normalizer = replicate(rollouts[0].normalizer, learner_devices)
            state, metrics = update_fn(
                state, tuple(r.data for r in rollouts), played_normalizer, np.int32(update)
            )
            # Every process's environment records and discounted returns after the rollouts, in
            # global env order.
            record, discounted_returns = gathered_rollouts(
                [(r.record, r.discounted_return) for r in rollouts], args.distributed
            )
            actor_carry = discounted_returns
            if args.core != "none":
                core_state = gathered_rollouts(
                    [r.next_core_state for r in rollouts], args.distributed
                )
                actor_carry = (discounted_returns, core_state)
            kept = Continuation(state, actors.last_sent, record, actor_carry=actor_carry)
            jax.block_until_ready(state)
            learner_times = LearnerTimes(
                rollout_queue_get_time=rollout_queue_get_time,
                learn_time=time.time() - learn_start,
            )
            optimizer_steps = optimizer_steps_after(args, update)
            run.logs.log_update(
                update=update,
                rollouts=rollouts,
                metrics=metrics,
                learner_times=learner_times,
                optimizer_steps=optimizer_steps,
                learning_rate=learning_rate_at(args, sizes, update),
            )
            if run.evaluation_due(update):
                run.evaluate_and_log(update, model_policy(state), optimizer_steps)
            end.exit_code = run.after_update(kept, update)
            if end.exit_code:
                break
            if update < sizes.num_updates:
                actors.send(host_policy(state), update)
    run.finish(model_policy(state), update, optimizer_steps_after(args, update))


# === Main ===


def main(argv=None):
    args = parse_args(argv)
    distributed.join(args)
    validate_layout(args)
    train(args)


if __name__ == "__main__":
    main()
