"""Cleanba Ape-X DQN (Horgan et al., 2018, "Distributed Prioritized Experience Replay"): actor
threads play with per-environment exploration rates and compute n-step transitions with their
initial priorities; the learner inserts each rollout in global environment order into one
prioritized replay, makes exactly --updates-per-rollout sampled double-Q optimizer steps (pmap'd)
and publishes the parameters, which actors play one version behind (--concurrency, as Cleanba).
The replay's work runs in a background thread in one fixed order (`learn`), so the same seed gives
the same run on every layout, pipelined or not."""

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
import rlax
from flax.training.train_state import TrainState

from cleanba_utils import (
    accelerators,
    compiled_rollout,
    distributed,
    hub,
    kept_lag,
    parsing,
    split_envs,
)
from cleanba_utils.checkpoints import resume_or_start
from cleanba_utils.devices import first_replica, gathered_rollouts, local_shares, replicate
from cleanba_utils.env_ids import is_jax_env
from cleanba_utils.envs import make_env
from cleanba_utils.errors import fail
from cleanba_utils.evaluation_episodes import play_episodes
from cleanba_utils.fields import Need, in_range, non_negative, positive
from cleanba_utils.handoff import ActorTimes, LagRule, OnResume, start_actor_threads
from cleanba_utils.huge_pages import restart_with_huge_pages
from cleanba_utils.kept_lag import Continuation
from cleanba_utils.max_pool import max_pool_3x3_stride_2
from cleanba_utils.replay.frame_ring import (
    FrameRing,
    frame_ring_bytes,
    frame_spec,
    make_frame_ring,
    stacks_frames,
)
from cleanba_utils.replay.n_step import n_step_transitions
from cleanba_utils.replay.prioritized_learning import (
    PRIORITY_EPSILON,
    Sampled,
    learn,
    log_priorities,
)
from cleanba_utils.replay.store import Mark, ReplayStore, store_bytes
from cleanba_utils.run import open_run
from cleanba_utils.run_args import GYMNASIUM_IMAGES, JAX_ENV, RUN_NEEDS, DeviceArgs
from cleanba_utils.run_logs import LearnerTimes
from cleanba_utils.sizes import Sizes, rollout_sizes
from cleanba_utils.threads import BackgroundJobs, queue_get, queue_put
from cleanba_utils.torsos import (
    MINATAR_HIDDENS,
    TORSO_CHANNELS,
    check_torso_channels,
    observes_small_images,
)

# === Args ===


@dataclasses.dataclass
class Args(DeviceArgs):
    # The run options of `DeviceArgs` whose default or meaning differ here.
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    eval_every: int = non_negative(100)
    concurrency: bool = True
    resume: bool = False
    """continue from the newest readable checkpoint of `runs/{run_name}`. On a JAX environment the
    checkpoint holds the environments' state, the actors' n-step tails and, with
    --checkpoint-replay, the replay: the resumed run is the uninterrupted one, bit for bit. On
    envpool's, the replay restarts empty and the environments anew from the run's seeds (docs,
    "What a resumed run is")"""

    env_id: str = "Breakout-v5"
    """the environment: an envpool id (Breakout-v5, CartPole-v1), gymnax:<id> for gymnax's JAX
    environment (gymnax:Breakout-MinAtar) or jax:<module>:<class> for your own with gymnax's
    interface (docs/jax_environments.md), gymnasium:<id> for Gymnasium's (gymnasium:CartPole-v1) or
    gymnasium:<module>:<class> for your own with Gymnasium's interface
    (docs/gymnasium_environments.md)"""
    total_timesteps: int = positive(50_000_000)
    """total environment steps (agent steps, not frames) of the run"""
    learning_rate: float = positive(0.00025 / 4)
    """the learning rate of centered RMSProp as TensorFlow's, Ape-X's optimizer: decay 0.95, epsilon
    1.5e-7 inside the square root, no momentum, and the second-moment estimate starting at 1
    (optax's `initial_scale`), not 0, so that the first steps are not huge"""
    anneal_lr: bool = False
    """decay the learning rate linearly towards 0 over --updates-per-rollout x the run's updates
    optimizer steps (the updates before --learning-starts take none, so it ends a little above 0);
    Ape-X keeps it constant. Annealing lets a small task's final policy settle, where under a
    constant rate it keeps swinging between good and poor"""
    local_num_envs: int = positive(64)
    """the number of environments of each actor thread"""
    num_actor_threads: int = positive(2)
    """the number of actor threads per actor device"""
    env_splits: int | None = positive(None)
    """the envpool instances an actor thread's environments are split into, stepped in turn: while
    one split steps, the thread infers the next one's actions (double-buffered sampling,
    cleanba_utils/split_envs.py). Default: 2 on a GPU (1 for a thread with one environment), 1 on
    a CPU, where inference would take the cores the environments step on, and for a JAX
    environment (its steps run inside the compiled rollout); the results are the same up to float
    rounding"""
    frame_stack: int = positive(1)
    """a Gymnasium environment's image observation as its last this many images (`gymnasium:`
    --env-id of images; Gymnasium's FrameStackObservation, their channels one after another), as
    envpool stacks Atari's last 4 frames: where a network needs motion that one image does not
    show. 1: the image alone"""
    num_steps: int = positive(32)
    """the number of steps each environment runs per rollout (one update of the learner)"""
    gamma: float = in_range(0.99, 0, 1, low_open=True)
    """the discount factor"""
    n_step: int = positive(3)
    """the number of rewards in a transition's return before it bootstraps"""
    epsilon_base: float = in_range(0.4, 0, 1)
    """environment g of N explores with epsilon_base ** (1 + epsilon_alpha * g / (N - 1))"""
    epsilon_alpha: float = non_negative(7.0)
    """see --epsilon-base. Ape-X's 7 spreads hundreds of actors from 0.4 to 0.4^8; with a few
    environments it gives most of them a small ε (4 environments: 0.4, 0.047, 0.0056, 0.00066), so
    the replay sees few failures: a few environments take a smaller value (3: from 0.4 to 0.4^4)"""
    buffer_size: int = positive(2_000_000)
    """the replay capacity in transitions, first in first out"""
    learning_starts: int = non_negative(50_000)
    """the number of transitions in the replay before the learner starts updating"""
    batch_size: int = positive(512)
    """the number of transitions of one learner update (sampled from the replay)"""
    updates_per_rollout: int = positive(6)
    """optimizer steps per learner update: a fixed replay ratio of steps x batch / (num envs x num
    steps) samples per inserted transition (0.75 at the defaults, near Ape-X's)"""
    priority_exponent: float = non_negative(0.6)
    """alpha: an item is sampled in proportion to its priority ** alpha"""
    importance_sampling_exponent: float = in_range(0.4, 0, 1)
    """beta: the importance-sampling weights are (1 / probability) ** beta, normalized by their
    batch maximum"""
    target_update_period: int = positive(2500)
    """copy the parameters to the target network every this many optimizer steps"""
    max_grad_norm: float = positive(40.0)
    """the maximum global norm of the gradient"""
    torso: Literal["nature", "impala", "minatar"] | None = None
    """the torso of image observations: "nature", the Nature DQN CNN of the Dueling DDQN agent that
    Ape-X uses (Wang et al., 2016: 8x8 stride 4, 4x4 stride 2, 3x3 stride 1), "impala", the IMPALA
    ResNet, or "minatar", Young & Tian's (2019) MinAtar network (a 3x3 stride-1 convolution per
    --channels entry). Default: "minatar" for small images (a JAX environment's float images, as
    MinAtar's 10x10 channels: the Nature DQN's 8x8 stride-4 convolutions cannot take them), "nature"
    otherwise (Atari's frames)"""
    channels: tuple[int, ...] | None = None
    """the channels of the torso's convolutions: --torso nature takes exactly three (default 32 64
    64, the Nature DQN's), --torso impala one per ResNet stack (default 16 32 32, the IMPALA
    paper's), --torso minatar one per convolution (default 16, Young & Tian's)"""
    hiddens: tuple[int, ...] | None = None
    """dense layers: all but the last continue the torso (after the CNN, or the MLP of vector
    observations); the last is the hidden layer of each of the dueling value and advantage streams.
    Default: 512 (the Dueling DDQN agent's), 128 for small images (Young & Tian's MinAtar network's
    one hidden layer)"""
    pipeline: bool = True
    """sample the next batch and write the priorities in a background thread while the update runs;
    --no-pipeline waits for them (the same run, slower)"""
    checkpoint_replay: bool = True
    """on a JAX environment, save the replay with every checkpoint (most of its size, and as much
    memory again while it is written); --no-checkpoint-replay: a resumed run refills an empty replay
    to --learning-starts before it learns again. On envpool's environments the replay is never
    saved (see --resume)"""


# The options whose default depends on the platform JAX runs on (`None` in `Args`), given their
# value by `validate_layout`: {option: rule(args, platform)}.
PLATFORM_DEFAULTS = {
    "env_splits": split_envs.default_splits,
}


# The options that act only in some configurations, with what each needs: `validate` refuses one
# set away from its default where its need does not hold.
NEEDS = {
    **RUN_NEEDS,
    "frame_stack": GYMNASIUM_IMAGES,
    "importance_sampling_exponent": Need(
        lambda args: args.priority_exponent > 0,
        "--priority-exponent above 0 (uniform sampling weights every item 1)",
    ),
    "torso": parsing.IMAGE_OBSERVATIONS,
    "channels": parsing.IMAGE_OBSERVATIONS,
    "checkpoint_replay": JAX_ENV,
}


def sizes_of(args: Args, num_processes: int) -> Sizes:
    """One learner update: a rollout of every actor thread, then --updates-per-rollout optimizer
    steps."""
    num_envs = args.local_num_envs * args.num_actor_threads * len(args.actor_device_ids)
    return rollout_sizes(num_envs * num_processes, args.num_steps, args.total_timesteps)


def parse_args(argv=None) -> Args:
    args = parsing.parse_args(Args, argv)
    validate(args)
    return args


def validate(args: Args):
    """Checks every argument that needs no device, before any other work; exits 2 on the first
    problem. Gives --hiddens and --torso left unset (None) their default for the task's
    observations (--torso after the check that refuses it set for vector observations)."""
    parsing.check_fields(args)
    parsing.check_run_options(args)
    if args.hiddens is None:
        args.hiddens = default_hiddens(args.env_id)
    parsing.check_layers(args, ["channels", "hiddens"])
    parsing.check_discrete_actions(args)
    parsing.check_needs(args, NEEDS)
    if args.torso is None:
        args.torso = default_torso(args.env_id)
    check_torso_channels(args)
    if args.torso == "nature" and observes_small_images(args.env_id):
        fail(
            f"--torso nature cannot take the small images of --env-id {args.env_id}: its 8x8 "
            "stride-4 convolutions need Atari's 84x84 frames; use --torso minatar (the default "
            "here) or impala"
        )
    if args.learning_starts > args.buffer_size:
        fail(
            f"--learning-starts {args.learning_starts} exceeds --buffer-size {args.buffer_size}: "
            "it would never start"
        )


def validate_layout(args: Args):
    """The checks that need the devices (and, with --distributed, the number of processes) or the
    machine. First gives the options of `PLATFORM_DEFAULTS` left unset their platform's value."""
    accelerators.apply_platform_defaults(args, PLATFORM_DEFAULTS)
    sizes = sizes_of(args, jax.process_count())
    parsing.check_devices(args, sizes.num_updates, sizes.steps_per_update, split_batches=True)
    if args.buffer_size < sizes.steps_per_update:
        fail(
            f"--buffer-size {args.buffer_size} holds fewer transitions than one update inserts "
            f"({sizes.num_envs} envs x {args.num_steps} steps); raise it"
        )
    replay_memory = replay_bytes(args, sizes.num_envs)
    if saves_replay(args):
        replay_memory *= 2  # a checkpoint holds a copy
    parsing.check_memory(args, "buffer_size", replay_memory, MEMORY_RESERVE_BYTES)


def default_torso(env_id: str) -> str:
    """Young & Tian's (2019) MinAtar network for small images, the Nature DQN's otherwise."""
    return "minatar" if observes_small_images(env_id) else "nature"


def default_hiddens(env_id: str) -> tuple[int, ...]:
    """Young & Tian's one hidden layer of 128 for small images, the Dueling DDQN agent's 512
    otherwise."""
    return MINATAR_HIDDENS if observes_small_images(env_id) else (512,)


# === Environment ===


# `cleanba_utils.envs.make_env`: envpool's environments, Atari as Machado et al. (2018) play it.


# === Network ===


class NatureTorso(nn.Module):
    """The convolutions of the Nature DQN (Mnih et al., 2015), also the torso of the Dueling DDQN
    agent and of Dhariwal et al.'s (2017) A2C: 8x8 stride 4, 4x4 stride 2, 3x3 stride 1, no
    padding, ReLU."""

    channels: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for channels, size, stride in zip(self.channels, (8, 4, 3), (4, 2, 1)):
            conv = nn.Conv(
                channels,
                (size, size),
                strides=(stride, stride),
                padding="VALID",
            )
            x = nn.relu(conv(x))
        return x.reshape(x.shape[0], -1)


class MinAtarTorso(nn.Module):
    """Young & Tian's (2019) MinAtar network's torso: a 3x3 convolution of stride 1, no padding, per
    entry of `channels` (theirs: one of 16), ReLU; flattened."""

    channels: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for channels in self.channels:
            x = nn.relu(nn.Conv(channels, (3, 3), padding="VALID")(x))
        return x.reshape(x.shape[0], -1)


class ResidualBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(self.channels, (3, 3))(nn.relu(x))
        y = nn.Conv(self.channels, (3, 3))(nn.relu(y))
        return x + y


class ImpalaTorso(nn.Module):
    """The IMPALA ResNet: per stack, a convolution, a max pool and two residual blocks."""

    channels: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for channels in self.channels:
            x = nn.Conv(channels, (3, 3))(x)
            x = max_pool_3x3_stride_2(x)
            x = ResidualBlock(channels)(ResidualBlock(channels)(x))
        return nn.relu(x).reshape(x.shape[0], -1)


TORSOS = {"nature": NatureTorso, "impala": ImpalaTorso, "minatar": MinAtarTorso}


class Network(nn.Module):
    """Dueling Q-network (Wang et al., 2016): a CNN torso (`TORSOS`) for images (N, C, H, W),
    stacked frames of uint8 pixels (scaled to [0, 1]) or small float images (taken as they are),
    the observation itself for vector observations (N, D), then the dense layers of `hiddens` but
    the last, then a value and an advantage stream with a hidden layer of hiddens[-1] each, Q = V +
    A - mean(A)."""

    torso: str
    channels: tuple[int, ...]
    hiddens: tuple[int, ...]
    num_actions: int

    @nn.compact
    def __call__(self, obs):
        if obs.ndim == 4:
            x = jnp.transpose(obs, (0, 2, 3, 1)).astype(jnp.float32)
            if obs.dtype == jnp.uint8:
                x = x / 255.0
            x = TORSOS[self.torso](self.channels)(x)
        else:
            x = obs.astype(jnp.float32)
        for hidden in self.hiddens[:-1]:
            x = nn.relu(nn.Dense(hidden)(x))
        stream = lambda outputs: nn.Dense(outputs)(
            nn.relu(nn.Dense(self.hiddens[-1])(x)) if self.hiddens else x
        )
        value = stream(1)
        advantage = stream(self.num_actions)
        return value + advantage - advantage.mean(axis=-1, keepdims=True)


def network_of(args: Args, num_actions: int) -> Network:
    """The network of `args`, its unset options (None) at their defaults for the task."""
    torso = args.torso or default_torso(args.env_id)
    channels = TORSO_CHANNELS[torso] if args.channels is None else args.channels
    hiddens = default_hiddens(args.env_id) if args.hiddens is None else args.hiddens
    return Network(torso, channels, hiddens, num_actions)


# === Actor ===

# How the policy lag goes on across a resume (cleanba_utils.handoff): restarted on envpool's
# environments, which a resumed run makes anew from the run's seeds; kept on a JAX environment,
# whose state the checkpoint holds with the parameters sent last, the actors' n-step tails and the
# replay (`kept_lag`): the resumed run is then the uninterrupted one, bit for bit.
ON_RESUME: OnResume = "restart_lag"
ON_RESUME_JAX_ENVS: OnResume = "keep_lag"


def on_resume_of(args) -> OnResume:
    return ON_RESUME_JAX_ENVS if is_jax_env(args.env_id) else ON_RESUME


def saves_replay(args) -> bool:
    """Whether the checkpoints hold the replay: on a JAX environment, with --checkpoint-replay."""
    return is_jax_env(args.env_id) and args.checkpoint_replay


EVAL_EPSILON = 0.01


class Played(NamedTuple):
    """One rollout as an actor thread played it, env-major (envs, steps): the newest frame of each
    observation, its step in its episode (uint8, to 255), the action, the actor's Q-value of that
    action and its greedy Q-value, the reward and the episode's end. `is_reset` marks envpool's
    reset steps (the step after an episode's end: the action is ignored and the observation is the
    next episode's first)."""

    frames: np.ndarray
    episode_step: np.ndarray
    actions: np.ndarray
    q_taken: np.ndarray
    q_max: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    is_reset: np.ndarray


class Tail(NamedTuple):
    """The last n steps of an environment's previous rollout, whose transitions wait for the next
    rollout's rewards (the fields of `Played` that make transitions), env-major (envs, n)."""

    actions: np.ndarray
    q_taken: np.ndarray
    q_max: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    is_reset: np.ndarray


class ActorCarry(NamedTuple):
    """What an actor thread carries from one rollout to the next, per environment: the n-step
    `Tail` and the step in its episode of the next observation (`count_episode_steps`). A JAX
    environment's checkpoint holds every environment's."""

    tail: Tail
    episode_step: np.ndarray


def first_carry(num_envs: int, n: int) -> ActorCarry:
    """The carry before the first rollout: a tail of padding (reset steps, which start no
    transition) and episodes at their first step."""
    tail = Tail(
        actions=np.zeros((num_envs, n), np.int32),
        q_taken=np.zeros((num_envs, n), np.float32),
        q_max=np.zeros((num_envs, n), np.float32),
        rewards=np.zeros((num_envs, n), np.float32),
        terminations=np.zeros((num_envs, n), bool),
        truncations=np.zeros((num_envs, n), bool),
        is_reset=np.ones((num_envs, n), bool),
    )
    return ActorCarry(tail=tail, episode_step=np.zeros(num_envs, np.uint8))


class Transitions(NamedTuple):
    """What a rollout adds to the replay, env-major (envs, steps): the frames of its L steps, and
    the n-step transitions of the L steps that start n steps earlier (the last n of the previous
    rollout, all but the last n of this one) with their initial priorities; `valid` is False where a
    step starts no transition (a reset step, or the padding before the first rollout). `env_ids` are
    the environments' global indices."""

    env_ids: np.ndarray
    frames: np.ndarray
    episode_step: np.ndarray
    actions: np.ndarray
    returns: np.ndarray
    discounts: np.ndarray
    offsets: np.ndarray
    valid: np.ndarray
    priorities: np.ndarray


class Rollout(NamedTuple):
    """What an actor thread puts on its rollout queue: the learner update it is for, the version of
    the parameters that played it, its transitions, its environments' record and its `ActorCarry`
    after it (for a JAX environment's checkpoint: the record is None on envpool's), and the seconds
    the actor spent waiting for parameters, playing, stepping and inferring."""

    update: int
    policy_version: int
    data: Transitions
    record: Any
    carry: ActorCarry
    timing: ActorTimes


def epsilons_of(env_ids, num_envs: int, base: float, alpha: float) -> np.ndarray:
    """Ape-X's exploration rates: environment g of N gets base ** (1 + alpha g / (N - 1)), fixed for
    the run."""
    return base ** (1.0 + alpha * np.asarray(env_ids, np.float64) / max(num_envs - 1, 1))


def epsilon_greedy(q_values, epsilons, key, step, env_ids):
    """Per environment, a uniform action with probability epsilon, else the greedy one; the draws
    are keyed by (step, global env index), so they do not depend on the layout."""
    step_key = jax.random.fold_in(key, step)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(step_key, env_ids)
    explore = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 0)))(keys) < epsilons
    random = jax.vmap(
        lambda k: jax.random.randint(jax.random.fold_in(k, 1), (), 0, q_values.shape[1])
    )(keys)
    return jnp.where(explore, random, jnp.argmax(q_values, axis=1))


class QOutputs(NamedTuple):
    """What the actor keeps of its policy's step beside the actions: the Q-value of the action taken
    and the greedy Q-value (the terms of the initial priorities)."""

    q_taken: jax.Array
    q_max: jax.Array


def policy_step(network, action_key, epsilons, params, obs, env_ids, step, step_input):
    """The actor's step on a batch of environments (`env_ids`, their global indices) at policy step
    `step`: ε-greedy actions with each environment's own ε (`epsilons`: every environment's of the
    run, `epsilons_of`) and their `QOutputs`. `step_input` is unused (the rollout's per-step
    input)."""
    q_values = network.apply(params, obs)
    action = epsilon_greedy(
        q_values,
        epsilons=jnp.asarray(epsilons)[env_ids],
        key=action_key,
        step=step,
        env_ids=env_ids,
    )
    q_taken = q_values[jnp.arange(action.shape[0]), action]
    return action, QOutputs(q_taken=q_taken, q_max=q_values.max(axis=1))


def stored_frames(obs, stacked: bool):
    """What the replay stores of observations (..., C, H, W) or (..., D): the newest frame of
    stacked frames (`frame_ring.stacks_frames`), else the whole observation."""
    return np.asarray(obs[..., -1, :, :] if stacked else obs)


def count_episode_steps(episode_step, is_reset):
    """Each step's observation's step in its episode (uint8, to 255: enough to rebuild a stack),
    env-major (envs, steps), and the count after the rollout, given `episode_step` before it. The
    observation after a reset step is its episode's first."""
    steps = []
    for t in range(is_reset.shape[1]):
        steps.append(episode_step)
        episode_step = np.where(is_reset[:, t], 0, np.minimum(episode_step, 254) + 1)
        episode_step = episode_step.astype(np.uint8)
    return np.stack(steps, axis=1), episode_step


def actor_thread(
    args,
    sizes,
    run,
    network,
    lag,
    env_offset,
    device,
    param_queue,
    rollout_queue,
    env_record,
    carry,
):
    """One actor thread, playing the updates of `lag`: environments with global indices env_offset
    .. env_offset + local_num_envs - 1. envpool's environments step in Python beside the policy's
    inference; a JAX environment's steps and the policy's run in one compiled program, continued
    from their part of `env_record` in a resumed run (None: a fresh run, or envpool's environments).
    Either way the rollout's n-step transitions and initial priorities are computed here
    (`rollout_data`), from the thread's part of `carry`, every environment's `ActorCarry`."""
    env_ids = np.arange(env_offset, env_offset + args.local_num_envs, dtype=np.int32)
    tail, episode_step = jax.tree.map(lambda every_env: every_env[env_ids], carry)
    action_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 1)
    # float32, as the policy's step takes them.
    epsilons = epsilons_of(
        np.arange(sizes.num_envs), sizes.num_envs, args.epsilon_base, args.epsilon_alpha
    ).astype(np.float32)
    start_rollout = compiled_rollout.start if is_jax_env(args.env_id) else split_envs.start_splits
    envs = start_rollout(
        make_env,
        args,
        episodes=run.logs.episodes(args.local_num_envs),
        num_envs=sizes.num_envs,
        env_offset=env_offset,
        env_record=env_record,
        act=functools.partial(policy_step, network, action_key, epsilons),
        device=device,
    )
    stacked = stacks_frames(args.env_id)
    # The quarter of the run's environments with the lowest ε (at least one) log their returns
    # under their own key too.
    lowest_epsilon_quarter = env_ids >= sizes.num_envs - max(1, sizes.num_envs // 4)

    for update in lag.updates():
        param_wait_start = time.time()
        if lag.actor_fetches_params(update):
            policy_version, params = queue_get(param_queue, run.stop)
        param_queue_get_time = time.time() - param_wait_start

        rollout_start = time.time()
        rollout = envs.play(params, update)
        steps = rollout.steps
        for end in rollout.episode_ends:
            if lowest_epsilon_quarter[end.env]:
                run.logs.log({"charts/lowest_epsilon_return": end.episode_return}, end.global_step)
        episode_steps, episode_step = count_episode_steps(episode_step, steps.is_reset)
        played = Played(
            frames=stored_frames(steps.obs, stacked),
            episode_step=episode_steps,
            actions=steps.env_actions,
            q_taken=steps.outputs.q_taken,
            q_max=steps.outputs.q_max,
            rewards=steps.rewards,
            terminations=steps.terminations,
            truncations=steps.truncations,
            is_reset=steps.is_reset,
        )
        data, tail = rollout_data(
            played=played, tail=tail, env_ids=env_ids, gamma=args.gamma, n=args.n_step
        )
        timing = ActorTimes(
            param_queue_get_time=param_queue_get_time,
            rollout_time=time.time() - rollout_start,
            inference_time=rollout.inference_time,
            env_step_time=rollout.env_step_time,
        )
        queued = Rollout(
            update=update,
            policy_version=policy_version,
            data=data,
            record=rollout.record,
            carry=ActorCarry(tail=tail, episode_step=episode_step),
            timing=timing,
        )
        queue_put(rollout_queue, queued, run.stop)


def rollout_data(played: Played, tail: Tail, env_ids, gamma: float, n: int):
    """The rollout's `Transitions` and the new tail (its last n steps), after `tail`, the previous
    rollout's (`first_carry`'s padding before the first)."""
    length = played.rewards.shape[1]
    window = Tail(
        *[
            np.concatenate([getattr(tail, key), getattr(played, key)], axis=1)
            for key in Tail._fields
        ]
    )
    returns, discounts, offsets, valid = n_step_transitions(
        rewards=window.rewards,
        terminations=window.terminations,
        truncations=window.truncations,
        is_reset=window.is_reset,
        gamma=gamma,
        n=n,
    )
    # Initial priority: |n-step TD error| under the actor's parameters, which are its online and its
    # target network, so the double-Q bootstrap is the max of the bootstrap observation's Q-values.
    bootstrap = np.take_along_axis(
        window.q_max, np.arange(length) + offsets.astype(np.int64), axis=1
    )
    td = returns + discounts * bootstrap - window.q_taken[:, :length]
    data = Transitions(
        env_ids=env_ids,
        frames=played.frames,
        episode_step=played.episode_step,
        actions=window.actions[:, :length],
        returns=returns,
        discounts=discounts,
        offsets=offsets,
        valid=valid,
        priorities=np.abs(td).astype(np.float32),
    )
    return data, Tail(*[field[:, -n:] for field in window])


def evaluate(params, args: Args, num_episodes: int, seed: int) -> list[float]:
    """Plays one episode in each of `num_episodes` fresh environments, epsilon-greedy with
    EVAL_EPSILON (a greedy Atari policy that never fires would play the whole 27,000 steps)."""
    envs = make_env(args, seed, num_episodes)
    network = network_of(args, envs.action_space.n)
    env_ids = jnp.arange(num_episodes)
    key = jax.random.PRNGKey(seed)
    act = jax.jit(
        lambda p, o, step: epsilon_greedy(
            network.apply(p, o), epsilons=EVAL_EPSILON, key=key, step=step, env_ids=env_ids
        )
    )
    return play_episodes(envs, num_episodes, lambda obs, step: act(params, obs, step))


# The model card of --upload-model: the algorithm, its papers and how `evaluate` acts.
MODEL_CARD = hub.ModelCard(
    name="Ape-X DQN",
    papers=(hub.APE_X,),
    evaluation_policy=lambda args: f"ε-greedy with ε = {EVAL_EPSILON} (argmax Q otherwise)",
)


# === Replay ===

MEMORY_RESERVE_BYTES = 3 * 2**30  # for the rest of the process: networks, environments, batches


class Stored(NamedTuple):
    """A transition as the replay stores it: the frame slots of the newest frames of its observation
    and of its bootstrap observation stand for the stacks."""

    actions: np.ndarray
    returns: np.ndarray
    discounts: np.ndarray
    obs: np.ndarray
    next_obs: np.ndarray


class ReplayMark(NamedTuple):
    """The replay at the end of an update (`Replay.mark`)."""

    transitions: Mark
    frame_steps: int


class Replay(NamedTuple):
    """The transitions in a prioritized FIFO store (`cleanba_utils.replay.store`), their frames in a
    `FrameRing`, both changed under the store's lock. The ring outlives every transition that
    points into it: a transition lives while fewer than --buffer-size transitions are inserted after
    it, at most buffer_size // num_envs steps of every environment, so its frames, from stack - 1
    steps before it to n steps after, are within buffer_size // num_envs + n + stack steps of the
    newest. The ring holds two rollouts more (`frame_ring_steps`): one that is being inserted, and
    one inserted after a mark whose snapshot is still to be saved (a checkpoint made by a stop in
    the middle of an update)."""

    transitions: ReplayStore
    frames: FrameRing

    @property
    def lock(self):
        return self.transitions.lock

    def mark(self) -> ReplayMark:
        with self.lock:
            return ReplayMark(self.transitions.mark(), self.frames.steps)

    def ring_part(self, field: np.ndarray) -> np.ndarray:
        """The slots of a frame ring's `field` that were written, per environment (envs, steps,
        ...): a view once the ring has gone round."""
        ring = self.frames.ring
        per_env = field.reshape(-1, ring, *field.shape[1:])
        return per_env[:, : min(self.frames.steps, ring)]

    def snapshot(self) -> dict:
        """What a checkpoint holds of the replay (`kept_lag`): the store's snapshot and the frame
        ring's written slots (views, as `ReplayStore.snapshot`'s, once it has gone round)."""
        with self.lock:
            return dict(
                transitions=self.transitions.snapshot(),
                frames=self.ring_part(self.frames.frames),
                episode_step=self.ring_part(self.frames.episode_step),
                frame_steps=self.frames.steps,
            )

    def snapshot_at(self, mark: ReplayMark) -> dict:
        """The replay as it was at `mark`: the frames written since overwrote none that a
        transition of the mark points into, so the ring is saved as it is, with its count of steps
        at the mark."""
        with self.lock:
            return dict(
                self.snapshot(),
                transitions=self.transitions.snapshot_at(mark.transitions),
                frame_steps=mark.frame_steps,
            )

    def restore(self, snapshot: dict):
        """Sets an empty replay of the same sizes to a `snapshot`."""
        self.transitions.restore(snapshot["transitions"])
        written = snapshot["frames"].shape[1]
        for field, saved in [
            (self.frames.frames, snapshot["frames"]),
            (self.frames.episode_step, snapshot["episode_step"]),
        ]:
            field.reshape(-1, self.frames.ring, *field.shape[1:])[:, :written] = saved
        self.frames.steps = int(snapshot["frame_steps"])


def frame_ring_steps(args: Args, num_envs: int) -> int:
    stack = frame_spec(args.env_id)[0]
    return args.buffer_size // num_envs + 2 * args.num_steps + args.n_step + stack


STORED_EXAMPLE = Stored(
    actions=np.int32(0),
    returns=np.float32(0),
    discounts=np.float32(0),
    obs=np.int64(0),
    next_obs=np.int64(0),
)


def replay_bytes(args: Args, num_envs: int) -> int:
    frames = frame_ring_bytes(args.env_id, num_envs, frame_ring_steps(args, num_envs))
    return frames + store_bytes(STORED_EXAMPLE, args.buffer_size)


def make_replay(args: Args, num_envs: int) -> Replay:
    transitions = ReplayStore(
        STORED_EXAMPLE, args.buffer_size, priority_exponent=args.priority_exponent
    )
    frames = make_frame_ring(args.env_id, num_envs, frame_ring_steps(args, num_envs))
    return Replay(transitions=transitions, frames=frames)


def replay_insert(replay: Replay, data: Transitions, n: int) -> int:
    """Writes one rollout of every environment (env-major, in global env order): its frames, and its
    transitions in the store in that order, those that are not valid as placeholders (priority 0:
    never sampled). Returns the number of valid transitions."""
    priorities = np.where(data.valid, data.priorities + PRIORITY_EPSILON, 0.0)
    with replay.lock:
        steps = replay.frames.steps - n + np.arange(data.frames.shape[1])
        stored = Stored(
            actions=data.actions.ravel(),
            returns=data.returns.ravel(),
            discounts=data.discounts.ravel(),
            obs=replay.frames.slots(data.env_ids, steps).ravel(),
            next_obs=replay.frames.slots(data.env_ids, steps + data.offsets).ravel(),
        )
        replay.frames.write(data.env_ids, data.frames, data.episode_step)
        replay.transitions.insert(stored, priorities.ravel())
    return int(data.valid.sum())


def replay_sample(replay: Replay, batch_size: int, rng, beta: float):
    """A prioritized `Batch` (host NumPy) and the `Sample` it came from (its slots, for the priority
    update); the importance weights are normalized by the batch maximum."""
    sample = replay.transitions.sample(batch_size, rng, beta)
    batch = Batch(
        obs=replay.frames.stacked(sample.items.obs),
        actions=sample.items.actions,
        returns=sample.items.returns,
        discounts=sample.items.discounts,
        next_obs=replay.frames.stacked(sample.items.next_obs),
        weights=sample.weights,
    )
    return batch, sample


# === Loss ===


class Batch(NamedTuple):
    """Sampled transitions: the observation, the action, the n-step return, the bootstrap's discount
    and observation, and the importance-sampling weight."""

    obs: Any
    actions: Any
    returns: Any
    discounts: Any
    next_obs: Any
    weights: Any


def dqn_loss(params, apply_fn, batch: Batch, q_next_target, q_next_online, batch_size: int):
    """Importance-weighted ½ TD² of the n-step double-Q targets, this device's share of the global
    mean."""
    q_values = apply_fn(params, batch.obs)
    td = jax.vmap(rlax.double_q_learning)(
        q_values,
        batch.actions,
        batch.returns,
        batch.discounts,
        q_next_target,
        q_next_online,
    )
    return (batch.weights * 0.5 * td**2).sum() / batch_size, (td, q_values)


# === Update ===


class QState(TrainState):
    target_params: Any


def init_state(args: Args, sizes: Sizes, replay: Replay | None):
    """The network, and where the run starts (`kept_lag.Origin`): fresh from the seed, or with
    --resume from the newest checkpoint of the run. On envpool's environments the checkpoint holds
    the learner state alone; on a JAX environment also the environments' state, the parameters sent
    last, the actors' carry, the pending priorities and with --checkpoint-replay the replay,
    restored into `replay` (`ON_RESUME_JAX_ENVS`; None: the learner's start alone is wanted)."""
    probe_env = make_env(args, args.seed, 1)
    network = network_of(args, probe_env.action_space.n)
    params = network.init(
        jax.random.fold_in(jax.random.PRNGKey(args.seed), 0), probe_env.reset()[0]
    )
    probe_env.close()
    # Centered RMSProp as TensorFlow's (see --learning-rate).
    rmsprop = optax.rmsprop(
        learning_rate_of(args, sizes), decay=0.95, eps=1.5e-7, initial_scale=1.0, centered=True
    )
    optimizer = optax.chain(optax.clip_by_global_norm(args.max_grad_norm), rmsprop)
    state = QState.create(apply_fn=network.apply, params=params, target_params=params, tx=optimizer)
    if is_jax_env(args.env_id):
        origin = kept_lag.run_origin(
            args,
            sizes,
            __file__,
            learner=state,
            acting_params=params,
            actor_carry=first_carry(sizes.num_envs, args.n_step),
            replay=replay,
            save_replay=saves_replay(args),
        )
        return network, origin
    identity = dict(sizes=dataclasses.asdict(sizes), seed=args.seed)
    saved, counters = resume_or_start(args, state, identity, __file__)
    return network, kept_lag.learner_origin(state if saved is None else saved, counters)


def actor_carry_of(args: Args, sizes: Sizes, origin: kept_lag.Origin) -> ActorCarry:
    """Every environment's `ActorCarry` where the actor threads start: a fresh run's, or the
    checkpoint's. A resumed run whose replay was not saved starts its tails anew (padding): their
    frames are not in the empty replay."""
    fresh = first_carry(sizes.num_envs, args.n_step)
    if origin.actor_carry is None:
        return fresh
    if saves_replay(args):
        return origin.actor_carry
    return origin.actor_carry._replace(tail=fresh.tail)


def learning_rate_of(args: Args, sizes: Sizes):
    """The constant learning rate, or with --anneal-lr its schedule over optimizer steps."""
    if not args.anneal_lr:
        return args.learning_rate
    return optax.linear_schedule(
        args.learning_rate, 0.0, transition_steps=args.updates_per_rollout * sizes.num_updates
    )


def make_update(args: Args, learner_devices):
    """One optimizer step, pmap'd over the learner devices, each with its slice of the batch
    (gradients summed); the target is copied every --target-update-period steps; all devices return
    the whole batch's TD errors."""

    def update_step(state, batch: Batch):
        q_next_target = state.apply_fn(state.target_params, batch.next_obs)
        q_next_online = state.apply_fn(state.params, batch.next_obs)
        (loss, (td, q_values)), grads = jax.value_and_grad(dqn_loss, has_aux=True)(
            state.params,
            apply_fn=state.apply_fn,
            batch=batch,
            q_next_target=q_next_target,
            q_next_online=q_next_online,
            batch_size=args.batch_size,
        )
        grads, loss = jax.lax.psum((grads, loss), "devices")
        state = state.apply_gradients(grads=grads)
        copy = state.step % args.target_update_period == 0
        target = jax.tree.map(lambda t, p: jnp.where(copy, p, t), state.target_params, state.params)
        metrics = dict(td_loss=loss, q_values=jax.lax.pmean(q_values.mean(), "devices"))
        all_td = jax.lax.all_gather(td, "devices").reshape(-1)
        return state.replace(target_params=target), metrics, all_td

    return jax.pmap(update_step, axis_name="devices", devices=learner_devices)


# === Learner loop ===


def gather_rollouts(args, rollouts: list) -> Transitions:
    """Every process's rollouts, env-major in global env order (each process holds the whole
    replay): a collective."""
    return gathered_rollouts([r.data for r in rollouts], args.distributed)


def insert_rollouts(args, jobs: BackgroundJobs, replay: Replay, rollouts: list) -> int:
    """Inserts the rollouts of every process, in `jobs` (the replay's thread); returns the valid
    transitions in the replay."""
    data = gather_rollouts(args, rollouts)

    def insert_and_count() -> int:
        replay_insert(replay, data, n=args.n_step)
        return replay.transitions.num_sampleable()

    return jobs.wait(jobs.submit(insert_and_count))


def sample_batch(args, replay: Replay, step: int) -> Sampled:
    """The batch of optimizer step `step`, drawn with a generator seeded by (seed, step): the same
    batches on every layout."""
    tic = time.time()
    rng = np.random.default_rng([args.seed, 3, step])
    batch, sample = replay_sample(
        replay, args.batch_size, rng, beta=args.importance_sampling_exponent
    )
    shards = local_shares(batch, len(args.learner_device_ids))
    return Sampled(
        shards=shards, slots=sample.slots, inserted=sample.inserted, seconds=time.time() - tic
    )


def model_params(state: QState):
    """What `evaluate` plays, the model file saves and the fingerprint hashes: the online network's
    parameters."""
    return jax.device_get(first_replica(state.params))


def train(args: Args):
    sizes = sizes_of(args, jax.process_count())
    actor_devices = [jax.local_devices()[i] for i in args.actor_device_ids]
    learner_devices = [jax.local_devices()[i] for i in args.learner_device_ids]
    global_learner_devices = distributed.global_learner_devices(args.learner_device_ids)
    replay = make_replay(args, sizes.num_envs)
    network, origin = init_state(args, sizes, replay)
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
    optimizer_steps = int(origin.learner.step)
    state = replicate(origin.learner, learner_devices)
    run.evaluate_untrained(lambda: model_params(state))
    update_fn = make_update(args, global_learner_devices)
    lag = LagRule(
        first_update=origin.counters["update"] + 1,
        num_updates=sizes.num_updates,
        concurrency=args.concurrency,
        on_resume=on_resume_of(args),
    )
    actors = start_actor_threads(
        actor_thread,
        actor_devices,
        args=args,
        run=run,
        lag=lag,
        sizes=sizes,
        network=network,
        env_record=origin.env_record,
        carry=actor_carry_of(args, sizes, origin),
    )
    jobs = BackgroundJobs("replay", run.stop, run.failures)
    # One optimizer step per call: prioritized_learning.learn's order with a one-step priority lag.
    learn_batches = functools.partial(
        learn,
        args,
        jobs=jobs,
        replay=replay.transitions,
        update_fn=update_fn,
        sample=functools.partial(sample_batch, args, replay),
        steps_per_call=1,
    )
    epsilons = epsilons_of(
        np.arange(sizes.num_envs), sizes.num_envs, args.epsilon_base, args.epsilon_alpha
    )
    schedule = learning_rate_of(args, sizes)
    # The `Learned` of the last update that learned, and the last call's TD errors not yet written
    # as priorities (`learn`).
    learned = None
    pending = origin.pending_priorities
    if pending is not None:
        pending = pending._replace(td=replicate(pending.td, learner_devices))
    with run.learner_loop([*actors.threads, jobs.thread]) as end:
        actors.send_first(first_replica(state.params), acting_params=origin.acting_params)
        update = lag.first_update - 1  # the updates done, where the loop makes none (finished)
        for update in lag.updates():
            rollouts, rollout_queue_get_time = actors.take_rollouts(update)
            learn_start = time.time()
            replay_size = insert_rollouts(args, jobs=jobs, replay=replay, rollouts=rollouts)
            insert_time = time.time() - learn_start
            if replay_size >= max(args.learning_starts, 1):
                state, learned, pending = learn_batches(
                    state=state, first_step=optimizer_steps, pending=pending
                )
                optimizer_steps += args.updates_per_rollout
            # Ape-X's own statistics: the seconds inserting the rollouts, the exploration rates
            # and the last batch's importance weights every update, the priorities (an O(N)
            # pass) every --log-frequency.
            stats = dict(
                insert_time=insert_time,
                epsilon_min=epsilons.min(),
                epsilon_max=epsilons.max(),
                **({} if learned is None else learned.stats),
            )
            run.logs.log_update(
                update,
                rollouts=rollouts,
                metrics=None if learned is None else learned.metrics,
                learner_times=LearnerTimes(rollout_queue_get_time, time.time() - learn_start),
                stats=stats,
                optimizer_steps=optimizer_steps,
                learning_rate=schedule(optimizer_steps) if callable(schedule) else schedule,
                replay_size=replay_size,
            )
            read_priorities = lambda: jobs.wait(jobs.submit(replay.transitions.priorities))
            log_priorities(run, update, read_priorities, args.priority_exponent)
            if run.evaluation_due(update):
                run.evaluate_and_log(update, model_params(state), optimizer_steps)
            saved = state
            if is_jax_env(args.env_id):
                # Every process's environments and actor carries, in global env order.
                record, carry = gathered_rollouts(
                    [(r.record, r.carry) for r in rollouts], args.distributed
                )
                saved = Continuation(
                    state,
                    acting_params=actors.last_sent,
                    env_record=record,
                    replay=replay.mark(),
                    pending_priorities=pending,
                    actor_carry=carry,
                )
            end.exit_code = run.after_update(saved, update)
            if end.exit_code:
                break
            if update < sizes.num_updates:
                actors.send(first_replica(state.params), policy_version=update)
    run.finish(model_params(state), update, optimizer_steps)


# === Main ===


def main(argv=None):
    args = parse_args(argv)
    distributed.join(args)
    validate_layout(args)
    train(args)


if __name__ == "__main__":
    restart_with_huge_pages()
    main()
