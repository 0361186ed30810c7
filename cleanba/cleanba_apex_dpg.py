"""Cleanba Ape-X DPG (Horgan et al., 2018, "Distributed Prioritized Experience Replay", section 3.2
and appendix D) for envpool's MuJoCo and DeepMind Control tasks. Actor threads play the policy with
Gaussian noise and compute n-step transitions with initial priorities; each learner update inserts
every rollout into one prioritized replay (global env order), makes --updates-per-rollout optimizer
steps of the critic and the actor (pmap'd) and publishes the parameters, which the actors play one
version behind with --concurrency (the default).

The replay's work runs in a background thread in a fixed order (`prioritized_learning.learn`),
every random draw seeded by the seed and a counter: a seed gives the same run on every layout.
Unlike Ape-X DQN's, a transition stores its bootstrap observation (as the paper's did), so the
replay holds valid transitions only, evicted by priority (the paper's choice for DPG) or FIFO. A
checkpoint saves the replay and what the actors continue from: a resumed run repeats the
uninterrupted one. Defaults are the paper's, or Ape-X DQN's where it names none (each field says
which); results: benchmark/results/learning_apex_dpg_cpu.md."""

import dataclasses
import functools
import os
import time
from typing import Any, Literal, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training.train_state import TrainState

from cleanba_utils import (
    compiled_rollout,
    distributed,
    handoff,
    hub,
    kept_lag,
    parsing,
    split_envs,
)
from cleanba_utils.devices import (
    first_replica,
    gathered_rollouts,
    learner_sharding,
    local_shares,
    replicate,
)
from cleanba_utils.env_ids import is_gymnasium_env
from cleanba_utils.env_records import EnvRecord
from cleanba_utils.envs import action_space_of, flat_observation, make_env, observation_size
from cleanba_utils.errors import fail
from cleanba_utils.evaluation_episodes import play_episodes
from cleanba_utils.fields import Need, at_most, in_range, non_negative, positive
from cleanba_utils.kept_lag import Continuation
from cleanba_utils.replay.n_step import n_step_transitions
from cleanba_utils.replay.prioritized_learning import (
    PRIORITY_EPSILON,
    Sampled,
    learn,
    log_priorities,
)
from cleanba_utils.replay.store import ReplayStore, store_bytes
from cleanba_utils.rollout_steps import Steps
from cleanba_utils.run import open_run
from cleanba_utils.run_args import RUN_NEEDS, DeviceArgs
from cleanba_utils.run_logs import LearnerTimes
from cleanba_utils.sizes import Sizes, rollout_sizes
from cleanba_utils.threads import BackgroundJobs, queue_get, queue_put


# === Args ===
@dataclasses.dataclass
class Args(DeviceArgs):
    # The run options of `DeviceArgs` whose default or meaning differ here.
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    eval_every: int = non_negative(100)
    concurrency: bool = True
    env_id: str = "HalfCheetah-v4"
    """the environment, with continuous actions: an envpool id (MuJoCo or dm_control; the paper's
    HumanoidStand/Walk/Run, ManipulatorBringBall-v1), gymnax:<id> for gymnax's JAX environment
    (gymnax:Pendulum-v1) or jax:<module>:<class> for your own with gymnax's interface
    (docs/jax_environments.md)"""
    total_timesteps: int = positive(10_000_000)
    """total environment steps of the run (the paper gives wall time, not steps)"""
    learning_rate: float = positive(1e-4)
    """Adam's learning rate, for the actor and the critic (the paper's)"""
    local_num_envs: int = positive(32)
    """the number of environments of each actor thread (2 threads x 32: the paper's 64 actors)"""
    num_actor_threads: int = positive(2)
    """the number of actor threads per actor device"""
    num_steps: int = positive(40)
    """the number of steps each environment runs per rollout (one learner update)"""
    gamma: float = in_range(0.99, 0, 1, low_open=True)
    """the discount factor"""
    n_step: int = positive(3)
    """the rewards in a return before it bootstraps (Ape-X DQN's 3; no off-policy correction)"""
    noise_std: float = in_range(0.3, 0, 1)
    """the Gaussian action noise's std in half action ranges (the paper's); clipped to the bounds"""
    random_steps: int = non_negative(0)
    """environment steps (over all actors) of uniformly random actions before the policy acts (the
    paper's 0; CleanRL's DDPG and TD3 play 25,000): widens the actions the critic first sees"""
    noise_alpha: float = non_negative(0.0)
    """env g of N explores with noise_std ** (1 + noise_alpha g / (N - 1)) (the paper's 0)"""
    buffer_size: int = positive(1_000_000)
    """the replay capacity in transitions (the paper's)"""
    eviction: Literal["prioritized", "fifo"] = "prioritized"
    """how a full replay makes room: "prioritized", drawn in proportion to priority **
    --eviction-exponent (the paper's choice for DPG), or "fifo", oldest first (Ape-X DQN's)"""
    eviction_exponent: float = at_most(-0.4, 0)
    """the exponent of prioritized eviction (the paper's: low priorities leave first)"""
    learning_starts: int = non_negative(50_000)
    """the transitions in the replay before the learner starts updating (Ape-X DQN's)"""
    batch_size: int = positive(256)
    """the number of transitions of one optimizer step (the paper's)"""
    updates_per_rollout: int = positive(16)
    """optimizer steps per learner update: a replay ratio of steps x batch / (envs x num_steps)
    samples per inserted transition (1.6 at the defaults; the paper's learner: 1.57)"""
    steps_per_call: int = positive(8)
    """optimizer steps compiled into one learner call; it must divide --updates-per-rollout and
    sets the priority lag: a step's TD errors reach the sampler K to 2K - 1 steps late (the paper's
    learner prefetched up to 16 batches, so its priorities came as late)"""
    priority_exponent: float = non_negative(0.6)
    """alpha: a transition is sampled in proportion to its priority ** alpha (the paper's)"""
    importance_sampling_exponent: float = in_range(0.4, 0, 1)
    """beta: the critic's loss weights, (1 / probability) ** beta / batch max (Ape-X DQN's)"""
    target_update_period: int = positive(100)
    """optimizer steps between copies to the target networks (the paper's)"""
    actor_grad_clip: float = positive(1.0)
    """dq/da, which the actor follows, is clipped element-wise to ± this (the paper's)"""
    max_grad_norm: float = positive(40.0)
    """the maximum global norm of the critic's gradient (Ape-X DQN's)"""
    critic_hiddens: tuple[int, ...] = (400, 300)
    """the critic's layers (the paper's); the action joins after the first"""
    actor_hiddens: tuple[int, ...] = (300, 200)
    """the actor's layers (the paper's)"""
    first_activation: Literal["tanh", "relu"] = "tanh"
    """after both networks' first layer (relu after the others): the paper's tanh, or DDPG's relu
    (tanh saturates on large observations, as gym MuJoCo's unnormalized velocities)"""
    pipeline: bool = True
    """sample batches and write priorities while the learner computes (--no-pipeline: same run)"""
    checkpoint_replay: bool = True
    """save the replay with every checkpoint (most of its size); --no-checkpoint-replay: a resumed
    run refills an empty replay to --learning-starts before it learns again"""


# Options that act only in some configurations: `validate` refuses one set where its need fails.
NEEDS = {
    **RUN_NEEDS,
    "eviction_exponent": Need(
        lambda args: args.eviction == "prioritized", "--eviction prioritized"
    ),
    "importance_sampling_exponent": Need(
        lambda args: args.priority_exponent > 0,
        "--priority-exponent above 0 (uniform sampling weights every item 1)",
    ),
}


def sizes_of(args: Args, num_processes: int) -> Sizes:
    """One learner update: a rollout of every environment, then --updates-per-rollout steps."""
    threads = args.num_actor_threads * len(args.actor_device_ids) * num_processes
    return rollout_sizes(args.local_num_envs * threads, args.num_steps, args.total_timesteps)


def parse_args(argv=None) -> Args:
    args = parsing.parse_args(Args, argv)
    validate(args)
    return args


def validate(args: Args):
    """Checks every argument that needs no device; exits 2 on the first problem."""
    parsing.check_fields(args)
    parsing.check_continuous_actions(args)
    parsing.check_run_options(args)
    for layers in ("critic_hiddens", "actor_hiddens"):
        parsing.check_layers(args, [layers])
    parsing.check_needs(args, NEEDS)
    if args.learning_starts > args.buffer_size:
        fail(f"--learning-starts {args.learning_starts} exceeds --buffer-size {args.buffer_size}")
    if args.updates_per_rollout % args.steps_per_call:
        fail(f"--steps-per-call must divide --updates-per-rollout {args.updates_per_rollout}")


def validate_layout(args: Args):
    """The checks that need the devices, the number of processes or the machine's memory."""
    sizes = sizes_of(args, jax.process_count())
    parsing.check_devices(args, sizes.num_updates, sizes.steps_per_update, split_batches=True)
    parsing.check_memory(args, "buffer_size", replay_bytes(args), MEMORY_RESERVE_BYTES)


# === Environment ===
# `cleanba_utils.envs.make_env`: envpool's environments, a time limit (1000 steps) a truncation.


class Spaces(NamedTuple):
    """The size of a flat observation and the action bounds (one per action dimension)."""

    obs_dim: int
    action_low: tuple[float, ...]
    action_high: tuple[float, ...]


def spaces_of(args: Args) -> Spaces:
    """From the task's spaces; dm_control's dict observations count every key's features."""
    action_space = action_space_of(args)
    return Spaces(
        obs_dim=observation_size(args.env_id),
        action_low=tuple(float(x) for x in action_space.low),
        action_high=tuple(float(x) for x in action_space.high),
    )


# === Network ===
def small_uniform(key, shape, dtype=jnp.float32):
    """DDPG's output init (Lillicrap et al., 2016): first actions central, first values near 0."""
    return jax.random.uniform(key, shape, dtype, minval=-3e-3, maxval=3e-3)


ACTIVATIONS = {"tanh": nn.tanh, "relu": nn.relu}


class Critic(nn.Module):
    """q(s, a): the action joins the first layer's features (as in DDPG), relu after the others."""

    hiddens: tuple[int, ...]
    first_activation: str

    @nn.compact
    def __call__(self, obs, action):
        x = ACTIVATIONS[self.first_activation](nn.Dense(self.hiddens[0])(obs))
        x = jnp.concatenate([x, action], axis=-1)
        for hidden in self.hiddens[1:]:
            x = nn.relu(nn.Dense(hidden)(x))
        return nn.Dense(1, kernel_init=small_uniform, bias_init=small_uniform)(x)[..., 0]


class Actor(nn.Module):
    """π(s): the first activation, relu after the other layers, then tanh scaled to the bounds."""

    hiddens: tuple[int, ...]
    first_activation: str
    action_low: tuple[float, ...]
    action_high: tuple[float, ...]

    @nn.compact
    def __call__(self, obs):
        x = ACTIVATIONS[self.first_activation](nn.Dense(self.hiddens[0])(obs))
        for hidden in self.hiddens[1:]:
            x = nn.relu(nn.Dense(hidden)(x))
        x = nn.Dense(len(self.action_low), kernel_init=small_uniform, bias_init=small_uniform)(x)
        low = jnp.asarray(self.action_low, jnp.float32)
        high = jnp.asarray(self.action_high, jnp.float32)
        return (high + low) / 2 + (high - low) / 2 * nn.tanh(x)


class Networks(NamedTuple):
    actor: Actor
    critic: Critic


def networks_of(args: Args, spaces: Spaces) -> Networks:
    actor = Actor(args.actor_hiddens, args.first_activation, spaces.action_low, spaces.action_high)
    critic = Critic(hiddens=args.critic_hiddens, first_activation=args.first_activation)
    return Networks(actor=actor, critic=critic)


# === Actor ===

# Across a resume the policy lag stays 1 (cleanba_utils.handoff), which the bitwise resume needs.
ON_RESUME: handoff.OnResume = "keep_lag"


class Transitions(NamedTuple):
    """The n-step transitions of the previous tail and all but the rollout's last n steps (envs,
    steps); `valid` is False where a step starts none (a reset step, padding)."""

    obs: np.ndarray
    actions: np.ndarray
    returns: np.ndarray
    discounts: np.ndarray
    next_obs: np.ndarray
    valid: np.ndarray
    priorities: np.ndarray


class Rollout(NamedTuple):
    """An actor thread's rollout, with what a checkpoint needs to continue its environments."""

    update: int
    policy_version: int
    data: Transitions
    record: EnvRecord
    tail: Steps
    timing: handoff.ActorTimes


class CriticValues(NamedTuple):
    """What a step of the compiled rollout keeps besides the actions: the critic's values of the
    action taken and of the policy's action (the initial priority's)."""

    q_taken: jax.Array
    q_policy: jax.Array


def padding_tail(num_envs: int, n: int, spaces: Spaces) -> Steps:
    """The tail before the first rollout: n reset steps, which start no transition. A rollout's
    last n steps, its tail, wait for the next rollout's rewards."""
    per_step = lambda dtype, *shape: np.zeros((num_envs, n, *shape), dtype)
    return Steps(
        obs=per_step(np.float32, spaces.obs_dim),
        env_actions=per_step(np.float32, len(spaces.action_low)),
        outputs=CriticValues(q_taken=per_step(np.float32), q_policy=per_step(np.float32)),
        rewards=per_step(np.float32),
        terminations=per_step(bool),
        truncations=per_step(bool),
        is_reset=np.ones((num_envs, n), bool),
    )


def noise_stds_of(env_ids, num_envs: int, std: float, alpha: float) -> np.ndarray:
    """Environment g of N explores with std ** (1 + alpha g / (N - 1))."""
    return std ** (1.0 + alpha * np.asarray(env_ids, np.float64) / max(num_envs - 1, 1))


def explore(policy_actions, stds, bounds: tuple, key, step, env_ids, random_actions):
    """The actions plus noise of std_g x half the range, clipped to `bounds`, or `random_actions`
    uniform; keyed by (step, global env index), so the draws do not depend on the layout."""
    low = jnp.asarray(bounds[0], jnp.float32)
    high = jnp.asarray(bounds[1], jnp.float32)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.fold_in(key, step), env_ids)
    shape = policy_actions.shape[1:]
    noise = jax.vmap(lambda k: jax.random.normal(k, shape, jnp.float32))(keys)
    noisy = policy_actions + stds[:, None] * (high - low) / 2 * noise
    uniform = jax.vmap(
        lambda k: jax.random.uniform(
            jax.random.fold_in(k, 1), shape, jnp.float32, minval=low, maxval=high
        )
    )(keys)
    return jnp.where(random_actions, uniform, jnp.clip(noisy, low, high))


def act(networks: Networks, key, noise_stds, params, obs, env_ids, step, random_actions):
    """One step of the compiled rollout (`compiled_rollout`): the actions of `explore`, each
    environment's noise std `noise_stds(env_ids)`, and the critic's values."""
    policy_action = networks.actor.apply(params["actor"], obs)
    action = explore(
        policy_action,
        stds=np.asarray(noise_stds(env_ids), np.float32),
        bounds=(networks.actor.action_low, networks.actor.action_high),
        key=key,
        step=step,
        env_ids=env_ids,
        random_actions=random_actions,
    )
    values = CriticValues(
        q_taken=networks.critic.apply(params["critic"], obs, action),
        q_policy=networks.critic.apply(params["critic"], obs, policy_action),
    )
    return action, values


def rollout_data(steps: Steps, tail: Steps, gamma: float, n: int):
    """The rollout's `Transitions` after `tail` (first `padding_tail`) and the new tail; the
    rewards as float32."""
    length = steps.rewards.shape[1]
    steps = steps._replace(rewards=steps.rewards.astype(np.float32))
    window = jax.tree.map(lambda old, new: np.concatenate([old, new], axis=1), tail, steps)
    returns, discounts, offsets, valid = n_step_transitions(
        rewards=window.rewards,
        terminations=window.terminations,
        truncations=window.truncations,
        is_reset=window.is_reset,
        gamma=gamma,
        n=n,
    )
    # The bootstrap observation follows the last reward (a truncated episode's last observation).
    bootstrap = np.arange(length) + offsets.astype(np.int64)
    next_obs = np.take_along_axis(window.obs, bootstrap[:, :, None], axis=1)
    # Initial priority: |n-step TD error| under the actor's parameters, online and target alike.
    q_bootstrap = np.take_along_axis(window.outputs.q_policy, bootstrap, axis=1)
    td = returns + discounts * q_bootstrap - window.outputs.q_taken[:, :length]
    data = Transitions(
        obs=window.obs[:, :length],
        actions=window.env_actions[:, :length],
        returns=returns,
        discounts=discounts,
        next_obs=next_obs,
        valid=valid,
        priorities=np.abs(td).astype(np.float32),
    )
    return data, jax.tree.map(lambda field: field[:, -n:], window)


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
    tails,
):
    """One actor thread, global envs from env_offset in a compiled rollout (Gymnasium's: in
    Python), resumed from their part of a checkpoint's `env_record` and `tails` (None: a fresh
    run). Update u is played by version u - 1, or u - 2 with --concurrency (`lag`, a
    `handoff.LagRule`)."""
    noise_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 1)
    noise_stds = functools.partial(
        noise_stds_of, num_envs=sizes.num_envs, std=args.noise_std, alpha=args.noise_alpha
    )
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
        act=functools.partial(act, networks, noise_key, noise_stds),
    )
    if tails is None:
        tail = padding_tail(args.local_num_envs, args.n_step, spaces_of(args))
    else:
        own_envs = slice(env_offset, env_offset + args.local_num_envs)
        tail = jax.tree.map(lambda field: np.array(field[own_envs]), tails)
    for update in lag.updates():
        param_wait_start = time.time()
        if lag.actor_fetches_params(update):
            policy_version, params = queue_get(param_queue, run.stop)
        param_queue_get_time = time.time() - param_wait_start
        rollout_start = time.time()
        policy_steps = (update - 1) * args.num_steps + np.arange(args.num_steps)
        random_actions = policy_steps * sizes.num_envs < args.random_steps
        played = envs.play(params, update, step_inputs=random_actions)
        data, tail = rollout_data(played.steps, tail=tail, gamma=args.gamma, n=args.n_step)
        rollout = Rollout(
            update=update,
            policy_version=policy_version,
            data=data,
            record=played.record,
            tail=tail,
            timing=handoff.ActorTimes(
                param_queue_get_time=param_queue_get_time,
                rollout_time=time.time() - rollout_start,
                env_step_time=played.env_step_time,
            ),
        )
        queue_put(rollout_queue, rollout, run.stop)


def evaluate(params, args: Args, num_episodes: int, seed: int) -> list[float]:
    """One episode in each of `num_episodes` fresh environments with the noiseless policy."""
    envs = make_env(args, seed, num_episodes)
    act = jax.jit(networks_of(args, spaces_of(args)).actor.apply)
    policy = lambda obs, _: act(params["actor"], flat_observation(obs))
    return play_episodes(envs, num_episodes, policy)


# The model card of --upload-model: the algorithm, its papers and how `evaluate` acts.
MODEL_CARD = hub.ModelCard(
    name="Ape-X DPG",
    papers=(hub.APE_X,),
    evaluation_policy=lambda args: "the actor's deterministic action, without noise",
)


# === Replay ===

MEMORY_RESERVE_BYTES = 2 * 2**30  # for the rest of the process: networks, environments, batches


class Stored(NamedTuple):
    """A transition as the replay stores it."""

    obs: np.ndarray
    actions: np.ndarray
    returns: np.ndarray
    discounts: np.ndarray
    next_obs: np.ndarray


def stored_example(spaces: Spaces) -> Stored:
    obs = np.zeros(spaces.obs_dim, np.float32)
    actions = np.zeros(len(spaces.action_low), np.float32)
    zero = np.float32(0)
    return Stored(obs=obs, actions=actions, returns=zero, discounts=zero, next_obs=obs)


def replay_bytes(args: Args) -> int:
    """The replay's memory; twice with --checkpoint-replay (a checkpoint holds a copy)."""
    example = stored_example(spaces_of(args))
    prioritized = args.eviction == "prioritized"
    replay = store_bytes(example, args.buffer_size, prioritized_eviction=prioritized)
    return 2 * replay if args.checkpoint_replay else replay


def make_replay(args: Args, spaces: Spaces) -> ReplayStore:
    return ReplayStore(
        stored_example(spaces),
        args.buffer_size,
        priority_exponent=args.priority_exponent,
        eviction_exponent=args.eviction_exponent if args.eviction == "prioritized" else None,
    )


def replay_insert(replay: ReplayStore, data: Transitions, rng) -> int:
    """Stores a rollout's valid transitions, evicting with `rng`; returns their number."""
    valid = data.valid.ravel()
    flat = lambda x: x.reshape(-1, *x.shape[2:])[valid]
    stored = Stored(*[flat(getattr(data, field)) for field in Stored._fields])
    replay.insert(stored, flat(data.priorities) + PRIORITY_EPSILON, rng=rng)
    return int(valid.sum())


# === Loss ===
class Batch(NamedTuple):
    """Sampled `Stored` transitions and their importance-sampling weights."""

    obs: Any
    actions: Any
    returns: Any
    discounts: Any
    next_obs: Any
    weights: Any


def n_step_targets(batch: Batch, target_actor_apply, target_critic_apply, target_params):
    """G = R_t+1 + ... + gamma^(n-1) R_t+n + gamma^n q(S_t+n, π(S_t+n; φ⁻); ψ⁻) (the discount is 0
    after a termination, gamma ** k after a truncation k steps on)."""
    next_actions = target_actor_apply(target_params["actor"], batch.next_obs)
    next_q = target_critic_apply(target_params["critic"], batch.next_obs, next_actions)
    return batch.returns + batch.discounts * next_q


def critic_loss(critic_params, critic_apply, batch: Batch, targets, batch_size: int):
    """Importance-weighted ½ (G - q(S_t, A_t; ψ))² (this device's share), the TD errors and q."""
    q = critic_apply(critic_params, batch.obs, batch.actions)
    td = targets - q
    return (batch.weights * 0.5 * td**2).sum() / batch_size, (td, q)


class ActorStats(NamedTuple):
    """What the actor's loss reports besides its surrogate."""

    policy_q_loss: Any
    dqda_clipped: Any


def actor_loss(
    actor_params, actor_apply, critic_apply, critic_params, batch: Batch, batch_size, dqda_clip
):
    """The deterministic policy gradient, dq/da clipped element-wise to ±dqda_clip, as a surrogate
    whose gradient in φ is -Σ clip(∂q/∂a) ∂π/∂φ / batch; not importance-weighted (the paper weights
    only the critic's loss). Also -q(S_t, π(S_t)) and the share clipped (this device's shares)."""
    actions = actor_apply(actor_params, batch.obs)
    q, q_vjp = jax.vjp(lambda a: critic_apply(critic_params, batch.obs, a), actions)
    # Each q depends on its own action only: the VJP with ones is every sample's dq/da.
    (dqda,) = q_vjp(jnp.ones_like(q))
    # rlax.dpg_loss clips dq/da by its L2 norm; the paper clips element-wise.
    clipped_dqda = jax.lax.stop_gradient(jnp.clip(dqda, -dqda_clip, dqda_clip))
    surrogate = -(clipped_dqda * actions).sum() / batch_size
    stats = ActorStats(
        policy_q_loss=-jax.lax.stop_gradient(q).sum() / batch_size,
        dqda_clipped=jnp.mean(jnp.abs(dqda) > dqda_clip),
    )
    return surrogate, stats


# === Update ===
class LearnerState(struct.PyTreeNode):
    """The actor's and the critic's train states and their target networks' parameters."""

    actor: TrainState
    critic: TrainState
    target_params: dict
    """{"actor": φ⁻, "critic": ψ⁻}"""

    def params(self) -> dict:
        return {"actor": self.actor.params, "critic": self.critic.params}


def init_state(args: Args, sizes: Sizes, replay: ReplayStore):
    """The networks and where the run starts (`kept_lag.Origin`), with --resume the replay
    restored where the checkpoint holds it."""
    spaces = spaces_of(args)
    networks = networks_of(args, spaces)
    init_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 0)
    obs = np.zeros((1, spaces.obs_dim), np.float32)
    actor_params = networks.actor.init(jax.random.fold_in(init_key, 0), obs)
    action = np.zeros((1, len(spaces.action_low)), np.float32)
    critic_params = networks.critic.init(jax.random.fold_in(init_key, 1), obs, action)
    # Adam for both; the critic's gradient norm is clipped here, the actor's dq/da in its loss.
    adam = optax.adam(args.learning_rate)
    critic_tx = optax.chain(optax.clip_by_global_norm(args.max_grad_norm), adam)
    state = LearnerState(
        actor=TrainState.create(apply_fn=networks.actor.apply, params=actor_params, tx=adam),
        critic=TrainState.create(
            apply_fn=networks.critic.apply, params=critic_params, tx=critic_tx
        ),
        target_params={"actor": actor_params, "critic": critic_params},
    )
    origin = kept_lag.run_origin(
        args,
        sizes,
        __file__,
        learner=state,
        acting_params=state.params(),
        actor_carry=padding_tail(sizes.num_envs, args.n_step, spaces),
        replay=replay,
        save_replay=args.checkpoint_replay,
    )
    return networks, origin


def make_update(args: Args, learner_devices):
    """--steps-per-call optimizer steps, pmap'd (gradients summed); returns all TD errors."""

    def update_step(state: LearnerState, batch: Batch):
        targets = n_step_targets(
            batch, state.actor.apply_fn, state.critic.apply_fn, state.target_params
        )
        (loss_critic, (td, q)), critic_grads = jax.value_and_grad(critic_loss, has_aux=True)(
            state.critic.params,
            critic_apply=state.critic.apply_fn,
            batch=batch,
            targets=targets,
            batch_size=args.batch_size,
        )
        # Both losses see the critic before this step: the two networks learn side by side.
        (_, actor_stats), actor_grads = jax.value_and_grad(actor_loss, has_aux=True)(
            state.actor.params,
            actor_apply=state.actor.apply_fn,
            critic_apply=state.critic.apply_fn,
            critic_params=state.critic.params,
            batch=batch,
            batch_size=args.batch_size,
            dqda_clip=args.actor_grad_clip,
        )
        # Each device's losses are its share of the global means: the global gradients are sums.
        critic_grads, actor_grads, loss_critic, loss_actor = jax.lax.psum(
            (critic_grads, actor_grads, loss_critic, actor_stats.policy_q_loss), "devices"
        )
        critic = state.critic.apply_gradients(grads=critic_grads)
        actor = state.actor.apply_gradients(grads=actor_grads)
        copy = critic.step % args.target_update_period == 0
        target_params = jax.tree.map(
            lambda target, online: jnp.where(copy, online, target),
            state.target_params,
            {"actor": actor.params, "critic": critic.params},
        )
        metrics = dict(
            critic_loss=loss_critic,
            actor_loss=loss_actor,
            q_values=jax.lax.pmean(q.mean(), "devices"),
            actor_grad_clipped=jax.lax.pmean(actor_stats.dqda_clipped, "devices"),
        )
        state = LearnerState(actor=actor, critic=critic, target_params=target_params)
        return state, (metrics, td)

    def update_steps(state: LearnerState, batches: Batch):
        state, (metrics, td) = jax.lax.scan(update_step, state, batches)
        all_td = jax.lax.all_gather(td, "devices", axis=1, tiled=True)
        return state, jax.tree.map(jnp.mean, metrics), all_td

    return jax.pmap(update_steps, axis_name="devices", devices=learner_devices)


# === Learner loop ===
def sample_batches(args, replay: ReplayStore, learner_devices, first_step: int) -> Sampled:
    """A call's batches, each seeded by (seed, step), put on the learner devices in the background
    (sparing the learner's thread the copy)."""
    tic = time.time()
    steps = range(first_step, first_step + args.steps_per_call)
    rngs = [np.random.default_rng([args.seed, 3, step]) for step in steps]
    sample = replay.sample_many(args.batch_size, rngs, beta=args.importance_sampling_exponent)
    batches = Batch(*sample.items, weights=sample.weights)
    shares = local_shares(batches, len(args.learner_device_ids), batch_axis=1)
    shards = jax.device_put(shares, learner_sharding(learner_devices))
    return Sampled(shards, sample.slots, sample.inserted, seconds=time.time() - tic)


def model_params(state: LearnerState) -> dict:
    """The actor's and the critic's parameters: what the model file saves and evaluation plays."""
    return jax.device_get(first_replica(state.params()))


def insert_rollouts(replay: ReplayStore, data: Transitions, rng) -> int:
    """Inserts the update's transitions (a full replay evicts with `rng`); the replay's size."""
    replay_insert(replay, data, rng=rng)
    return replay.num_sampleable()


def train(args: Args):
    sizes = sizes_of(args, jax.process_count())
    learner_devices = [jax.local_devices()[i] for i in args.learner_device_ids]
    global_learner_devices = distributed.global_learner_devices(args.learner_device_ids)
    replay = make_replay(args, spaces_of(args))
    networks, origin = init_state(args, sizes, replay)
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
    optimizer_steps = int(origin.learner.critic.step)
    run.evaluate_untrained(lambda: model_params(state))
    update_fn = make_update(args, global_learner_devices)
    lag = handoff.LagRule(
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
        tails=origin.actor_carry,
    )
    jobs = BackgroundJobs("replay", run.stop, run.failures)
    sample = functools.partial(sample_batches, args, replay, learner_devices)
    noise_stds = noise_stds_of(
        np.arange(sizes.num_envs), sizes.num_envs, args.noise_std, args.noise_alpha
    )
    # The `Learned` of the last update that learned, and the last call's TD errors not yet written
    # as priorities (`learn`).
    learned = None
    pending = origin.pending_priorities
    if pending is not None:
        pending = pending._replace(td=replicate(pending.td, learner_devices))
    with run.learner_loop([*actors.threads, jobs.thread]) as end:
        actors.send_first(first_replica(state.params()), acting_params=origin.acting_params)
        update = lag.first_update - 1  # the updates done, where the loop makes none (finished)
        for update in lag.updates():
            rollouts, rollout_queue_get_time = actors.take_rollouts(update)
            learn_start = time.time()
            # Every process's rollouts in global env order: each process holds the whole replay.
            parts = [(r.data, r.record, r.tail) for r in rollouts]
            data, env_record, tail = gathered_rollouts(parts, args.distributed)
            evicting = np.random.default_rng([args.seed, 4, update])
            insert = functools.partial(insert_rollouts, replay, data, evicting)
            replay_size = jobs.wait(jobs.submit(insert))
            insert_time = time.time() - learn_start
            if replay_size >= max(args.learning_starts, 1):
                state, learned, pending = learn(
                    args,
                    jobs=jobs,
                    replay=replay,
                    state=state,
                    update_fn=update_fn,
                    sample=sample,
                    first_step=optimizer_steps,
                    pending=pending,
                    steps_per_call=args.steps_per_call,
                )
                optimizer_steps += args.updates_per_rollout
            # Ape-X DPG's own statistics: the seconds inserting the rollouts, the exploration
            # noise and the last batch's importance weights every update, the priorities (an O(N)
            # pass) every --log-frequency.
            stats = dict(
                insert_time=insert_time,
                noise_std_min=noise_stds.min(),
                noise_std_max=noise_stds.max(),
                **({} if learned is None else learned.stats),
            )
            run.logs.log_update(
                update,
                rollouts=rollouts,
                metrics=None if learned is None else learned.metrics,
                learner_times=LearnerTimes(rollout_queue_get_time, time.time() - learn_start),
                stats=stats,
                optimizer_steps=optimizer_steps,
                replay_size=replay_size,
            )
            read_priorities = lambda: jobs.wait(jobs.submit(replay.priorities))
            log_priorities(run, update, read_priorities, args.priority_exponent)
            if run.evaluation_due(update):
                run.evaluate_and_log(update, model_params(state), optimizer_steps)
            kept = Continuation(
                state,
                acting_params=actors.last_sent,
                env_record=env_record,
                replay=replay.mark(),
                pending_priorities=pending,
                actor_carry=tail,
            )
            end.exit_code = run.after_update(kept, update)
            if end.exit_code:
                break
            if update < sizes.num_updates:
                actors.send(first_replica(state.params()), policy_version=update)
    run.finish(model_params(state), update, optimizer_steps)


# === Main ===
def main(argv=None):
    args = parse_args(argv)
    distributed.join(args)
    validate_layout(args)
    train(args)


if __name__ == "__main__":
    main()
