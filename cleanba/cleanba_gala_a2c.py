"""Cleanba GALA-A2C (Assran et al., 2019): n A2C actor-learners ("agents") gossiping over a directed
ring. Every agent has its own environments, optimizer and parameters x_i. After each local update,
agent i sends x_i to its out-peers i+1 .. i+k and averages with the messages it holds: x_i <- (x_i +
sum of messages) / (1 + their number). The agents stay in a ball around their average x̄, which is
saved. The agents share the devices there are, in blocks of consecutive agents. `--gossip sync`
(default): lock step, one `shard_map` over the devices, each computing its block's gradients with
`vmap`, the in-peers' new parameters by `lax.ppermute`: the same seed gives the same run.
`--gossip async` (the paper's): a learner thread per agent, messages left in mailboxes without
waiting. `--topology allreduce`: A2C, gradients averaged over the agents; `none`: independent
agents. Each agent's actor thread keeps Cleanba's protocol (queues of size 1, lag 1)."""

import dataclasses
import functools
import operator
import os
import sys
import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import envpool
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding

from cleanba_utils import (
    accelerators,
    compiled_rollout,
    distributed,
    env_records,
    gymnasium_envs,
    hub,
    jax_envs,
    kept_lag,
    parsing,
    split_envs,
)
from cleanba_utils.checkpoints import Checkpointing, resume_or_start
from cleanba_utils.devices import first_replica, gathered_rollouts
from cleanba_utils.env_ids import is_gymnasium_env, is_jax_env
from cleanba_utils.envs import envpool_num_threads, is_atari
from cleanba_utils.errors import fail
from cleanba_utils.evaluation_episodes import play_episodes
from cleanba_utils.fields import Need, in_range, non_negative, positive
from cleanba_utils.gala.agent_arrays import (
    agent_devices_of,
    agent_slice,
    agents_mean,
    agents_sharding,
    from_slices,
    gathered_agents,
    ring_shift,
    sharded,
)
from cleanba_utils.gala.consensus import consensus_line, consensus_of, consensus_stats
from cleanba_utils.gala.mailboxes import Mailbox, Message, broadcast, receive
from cleanba_utils.handoff import (
    ActorTimes,
    LagRule,
    OnResume,
    start_actor_threads,
    take_rollouts,
)
from cleanba_utils.huge_pages import restart_with_huge_pages
from cleanba_utils.kept_lag import Continuation
from cleanba_utils.max_pool import max_pool_3x3_stride_2
from cleanba_utils.run import open_run
from cleanba_utils.run_args import GYMNASIUM_IMAGES, RUN_NEEDS, RunArgs
from cleanba_utils.run_logs import LearnerTimes
from cleanba_utils.sizes import Sizes, rollout_sizes
from cleanba_utils.threads import POLL_SECONDS, Stopped, queue_get, queue_put, start_thread
from cleanba_utils.torsos import (
    MINATAR_HIDDENS,
    check_torso_channels,
    observes_small_images,
    torso_channels,
)

# === Args ===


@dataclasses.dataclass
class Args(RunArgs):
    # The run options of `RunArgs` whose default or meaning differ here.
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    save_model: bool = False
    """save the consensus average of the agents' final parameters to
    `runs/{run_name}/{exp_name}.cleanba_model`"""
    eval_episodes: int = non_negative(0)
    """play this many episodes with the consensus average x̄ of the agents' parameters every
    --eval-every updates and after the last, their mean logged as charts/eval_return (0: none)"""
    eval_every: int = non_negative(0)
    """evaluate every this many updates, and the untrained x̄ at step 0 (0: only after the last;
    agents in lock step only: those of --gossip async make no update together); evaluation never
    changes the run"""
    log_frequency: int = positive(100)
    """print a console line and log the losses every this many updates"""
    concurrency: bool = True
    """let each actor collect the next rollout while its learner trains (policy lag 1, Cleanba's
    protocol); in the paper's Algorithm 1 an agent acts with its current parameters (lag 0)"""
    distributed: bool = False
    """join a multi-process run with jax.distributed (--gossip sync and allreduce; agents split over
    processes)"""

    eval_actions: Literal["greedy", "sampled"] = "greedy"
    """how the evaluation of x̄ chooses actions: greedy (argmax π(a|s), as the paper's Table 1) or
    sampled from π as in training"""
    env_id: str = "Breakout-v5"
    """the environment: an envpool id (Breakout-v5, CartPole-v1), gymnax:<id> for gymnax's JAX
    environment (gymnax:Breakout-MinAtar) or jax:<module>:<class> for your own with gymnax's
    interface (docs/jax_environments.md), gymnasium:<id> for Gymnasium's (gymnasium:CartPole-v1) or
    gymnasium:<module>:<class> for your own with Gymnasium's interface
    (docs/gymnasium_environments.md)"""
    total_timesteps: int = positive(10_000_000)
    """total environment steps (agent steps, not frames) of the run, all agents together"""
    learning_rate: float = non_negative(7e-4)
    """the base learning rate of RMSProp (the paper's Table 2), constant; each agent's is this times
    √(--num-agents) unless --no-scale-learning-rate (1.4e-3 for the default 4 agents)"""
    scale_learning_rate: bool = True
    """multiply the base learning rate by √(number of learners), the paper's scaling (Table 2, for
    A2C and GALA-A2C alike: --topology allreduce scales it too)"""
    rmsprop_decay: float = in_range(0.99, 0, 1)
    """RMSProp's decay of the mean square. The paper does not give it; 0.99 is the A2C of Dhariwal
    et al. (2017) and the PyTorch A2C code the GALA authors built on"""
    rmsprop_eps: float = positive(0.01)
    """RMSProp's epsilon (the paper's Table 2, with momentum 0), added to the root of the mean
    square as in PyTorch's RMSprop, which the authors ran (optax eps_in_sqrt=False)"""
    local_num_envs: int = positive(16)
    """the number of environments of each agent"""
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
    num_steps: int = positive(5)
    """the number of steps each environment runs per rollout: the horizon of the bootstrapped
    returns"""
    gamma: float = in_range(0.99, 0, 1, low_open=True)
    """the discount factor"""
    ent_coef: float = non_negative(0.01)
    """the entropy coefficient"""
    vf_coef: float = non_negative(0.5)
    """the value loss coefficient: the loss has vf_coef x mean((G - V)^2), 0.5 x the mean squared
    error as in the A2C of Dhariwal et al. (2017)"""
    max_grad_norm: float = positive(0.5)
    """the maximum global norm of each agent's gradient"""
    torso: Literal["nature", "impala", "minatar"] | None = None
    """the torso for image observations: "nature", the network of Dhariwal et al. (2017), the
    paper's (three convolutions 8x8 stride 4, 4x4 stride 2, 3x3 stride 1, then --hiddens),
    "impala", the IMPALA ResNet, or "minatar", Young & Tian's (2019) MinAtar network (a 3x3 stride-1
    convolution per --channels entry). Default: "minatar" for small images (a JAX environment's
    float images, as MinAtar's 10x10 channels: the paper's 8x8 stride-4 convolutions cannot take
    them), "nature" otherwise (Atari's frames)"""
    channels: tuple[int, ...] | None = None
    """the channels of the torso's convolutions: --torso nature takes exactly three (default 32 64
    64, the paper's), --torso impala one per ResNet stack (default 16 32 32, the IMPALA paper's),
    --torso minatar one per convolution (default 16, Young & Tian's)"""
    hiddens: tuple[int, ...] | None = None
    """dense layers after the torso (images), or hidden layers of each of the separate actor and
    critic MLPs (vector observations: e.g. --hiddens 64 64 for CartPole). Default: 512 (the
    paper's), 128 for small images (Young & Tian's MinAtar network's one hidden layer)"""
    num_agents: int = positive(4)
    """the number of actor-learners. They share the devices there are, as in the paper, which runs
    several agents in parallel on one GPU (its Figure 3: one V100 and 48 CPUs): each process's
    agents go in equal blocks of consecutive agents to as many of its devices as divide them (4
    agents: all on 1 device, 2 on each of 2 or 3 devices, 1 on each of 4 or more)"""
    topology: Literal["gossip", "allreduce", "none"] = "gossip"
    """gossip over a directed ring, gradients averaged over all agents (A2C), or independent agents
    """
    gossip: Literal["sync", "async"] = "sync"
    """async is the paper's: threads and mailboxes, messages mixed when they arrive. The default,
    sync, is not: lock step, every message arrives at once; it is reproducible, and it is Algorithm
    1 with no message delays"""
    num_peers: int = 1
    """the out-peers of each agent: agent i sends to agents i+1 .. i+num_peers (mod num_agents)"""
    staleness_bound: int = non_negative(0)
    """--gossip async: an agent that made this many updates without a message from an in-peer waits
    (0: never)"""
    similarity_every: int | None = positive(None)
    """measure the cosine similarity of ring neighbours' gradients every this many updates (default
    10). Lock-step modes only: the agents of --gossip async never hold gradients of the same moment,
    so it is refused there"""


def lock_step(args: Args) -> bool:
    return args.topology != "gossip" or args.gossip == "sync"


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
    "eval_actions": Need(lambda args: args.eval_episodes > 0, "--eval-episodes"),
    "eval_every": Need(
        lambda args: args.eval_episodes > 0 and lock_step(args),
        "--eval-episodes, agents in lock step (--gossip sync or --topology allreduce/none)",
    ),
    "torso": parsing.IMAGE_OBSERVATIONS,
    "channels": parsing.IMAGE_OBSERVATIONS,
    "gossip": Need(lambda args: args.topology == "gossip", "--topology gossip"),
    "num_peers": Need(lambda args: args.topology == "gossip", "--topology gossip"),
    "staleness_bound": Need(lambda args: not lock_step(args), "--gossip async"),
    # The agents of --gossip async never hold gradients of the same moment.
    "similarity_every": Need(
        lock_step, "--gossip sync or --topology allreduce/none (agents in lock step)"
    ),
}

DEFAULT_SIMILARITY_EVERY = 10


def sizes_of(args: Args) -> Sizes:
    return rollout_sizes(
        args.local_num_envs * args.num_agents, args.num_steps, args.total_timesteps
    )


def parse_args(argv=None) -> Args:
    args = parsing.parse_args(Args, argv)
    validate(args)
    return args


def validate(args: Args):
    """Checks every argument that needs no device, before any other work; exits 2 on the first
    problem. Gives --torso and --hiddens left unset (None) their default for the task's
    observations (`resolve_network_defaults`)."""
    parsing.check_fields(args)
    if args.topology == "gossip" and not 1 <= args.num_peers < args.num_agents:
        fail(
            "--topology gossip needs --num-agents >= 2, --num-peers in 1 .. agents - 1; got "
            f"{args.num_agents} and {args.num_peers}"
        )
    parsing.check_run_options(args)
    parsing.check_discrete_actions(args)
    parsing.check_needs(args, NEEDS)
    resolve_network_defaults(args)
    parsing.check_layers(args, ["channels", "hiddens"])
    check_torso_channels(args)
    if args.torso == "nature" and observes_small_images(args.env_id):
        fail(
            f"--torso nature cannot take the small images of --env-id {args.env_id}: its 8x8 "
            "stride-4 convolutions need Atari's 84x84 frames; use --torso minatar (the default "
            "here) or impala"
        )
    if args.gossip == "async" and (args.distributed or args.checkpoint_every or args.resume):
        fail(
            "--gossip async runs in one process without checkpoints: not with "
            "--distributed/--checkpoint-every/--resume"
        )


def resolve_network_defaults(args: Args):
    """Gives --torso and --hiddens left unset (None) their default for the task's observations, in
    `args` itself: Young & Tian's (2019) MinAtar network (its torso, one hidden layer of 128) for
    small images, the paper's otherwise (the torso of Dhariwal et al., 512 units). After
    `check_needs`, which refuses a --torso set where there are no images."""
    small = observes_small_images(args.env_id)
    if args.torso is None:
        args.torso = "minatar" if small else "nature"
    if args.hiddens is None:
        args.hiddens = MINATAR_HIDDENS if small else (512,)


def validate_layout(args: Args):
    """The checks that need the number of processes (--distributed) or the update's size, and a note
    where the agents leave devices of a process idle. First gives the options of
    `PLATFORM_DEFAULTS` left unset their platform's value."""
    accelerators.apply_platform_defaults(args, PLATFORM_DEFAULTS)
    sizes = sizes_of(args)
    num_processes = jax.process_count()
    if args.num_agents % num_processes:
        fail(
            f"--num-agents {args.num_agents} does not divide into the {num_processes} processes "
            "of the run: every process takes the same number of agents"
        )
    if sizes.num_updates < 1:
        fail(
            f"--total-timesteps {args.total_timesteps} is less than one update "
            f"({sizes.steps_per_update} steps)"
        )
    local_agents = args.num_agents // num_processes
    num_devices = len(jax.local_devices())
    used = len(set(agent_devices_of(args.num_agents).local))
    if used < min(local_agents, num_devices):
        print(
            f"note: the {local_agents} agents of each process share {used} of its {num_devices} "
            "devices, in equal blocks; a number of agents that more devices divide uses more",
            file=sys.stderr,
        )


# === Environment ===


GALA_ATARI = dict(
    repeat_action_probability=0.0,
    full_action_space=False,
    episodic_life=True,
    noop_max=30,
    max_episode_steps=27_000,
    reward_clip=True,
)
"""The paper's Atari settings (Table 2): a life lost ends the episode for learning, rewards clipped
to [-1, 1], up to 30 no-ops at the start; deterministic actions and the minimal action set, as the
A2C of Dhariwal et al. (2017) that it follows; 84x84 grayscale, 4 repeats with a max over the last 2
frames and 4 stacked frames are envpool's defaults."""


def make_env(args: Args, seed: int, num_envs: int):
    """envpool seeds its environment i with `seed + i`. Atari takes the paper's options
    (`GALA_ATARI`), not the Machado et al. (2018) protocol of the other scripts, so that the runs
    compare with the paper's; the logged returns and the evaluation count whole games. A JAX
    environment (`gymnax:` or `jax:` id) is a `jax_envs.JaxVectorEnv` with --env-params, and a
    Gymnasium environment (`gymnasium:` id) a `gymnasium_envs.GymnasiumVectorEnv`, as
    `cleanba_utils.envs.make_env` makes them (the paper's Atari options do not apply)."""
    if is_jax_env(args.env_id):
        return jax_envs.JaxVectorEnv(args.env_id, args.env_params, seed, num_envs)
    if is_gymnasium_env(args.env_id):
        return gymnasium_envs.GymnasiumVectorEnv(
            args.env_id, seed, num_envs, args.vectorization_mode, getattr(args, "frame_stack", 1)
        )
    num_threads = envpool_num_threads(
        args.envpool_num_threads, num_envs=num_envs, instances=args.num_agents
    )
    options = GALA_ATARI if is_atari(args.env_id) else {}
    return envpool.make(
        args.env_id,
        env_type="gymnasium",
        num_envs=num_envs,
        seed=seed,
        num_threads=num_threads,
        **options,
    )


def episode_over(terminated, truncated, info):
    """Which environments ended a whole episode at this step: with episodic life, a lost life
    terminates an Atari episode for learning, and the game is over when envpool's
    `info["terminated"]` says so."""
    if "lives" in info:
        return truncated | info["terminated"].astype(bool)
    return terminated | truncated


# === Network ===


class NatureTorso(nn.Module):
    """The convolutions of the Nature DQN (Mnih et al., 2015), also the torso of the Dueling DDQN
    agent and of Dhariwal et al.'s (2017) A2C: 8x8 stride 4, 4x4 stride 2, 3x3 stride 1, no
    padding, ReLU."""

    channels: tuple[int, ...]
    kernel_init: Callable = nn.linear.default_kernel_init

    @nn.compact
    def __call__(self, x):
        for channels, size, stride in zip(self.channels, (8, 4, 3), (4, 2, 1)):
            conv = nn.Conv(
                channels,
                (size, size),
                strides=(stride, stride),
                padding="VALID",
                kernel_init=self.kernel_init,
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


class ConvSequence(nn.Module):
    """A convolution, a max pool and two residual blocks of two convolutions: a stack of the IMPALA
    ResNet."""

    channels: int

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.channels, (3, 3))(x)
        x = max_pool_3x3_stride_2(x)
        for _ in range(2):
            # flax names a layer when it is built: the outer convolution is built first.
            x = x + nn.Conv(self.channels, (3, 3))(
                nn.relu(nn.Conv(self.channels, (3, 3))(nn.relu(x)))
            )
        return x


def mlp(x, hiddens: tuple, outputs: int, output_scale: float):
    """Inside a compact module: tanh hidden layers and a linear output, orthogonally initialized."""
    for hidden in hiddens:
        x = nn.tanh(nn.Dense(hidden, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
    return nn.Dense(outputs, kernel_init=nn.initializers.orthogonal(output_scale))(x)


class Network(nn.Module):
    """For images (N, C, H, W), stacked frames of uint8 pixels (scaled to [0, 1]) or small float
    images (taken as they are), a torso (`torso`: the paper's network, the IMPALA ResNet or Young &
    Tian's MinAtar network) and dense layers shared by both heads; for vector observations (N, D),
    separate actor and critic MLPs: through a shared torso, the critic's gradients swamp the
    policy's."""

    torso: str
    channels: tuple[int, ...]
    hiddens: tuple[int, ...]
    num_actions: int

    @nn.compact
    def __call__(self, obs):
        if obs.ndim != 4:
            x = obs.astype(jnp.float32)
            logits = mlp(x, self.hiddens, self.num_actions, 0.01)
            value = mlp(x, self.hiddens, 1, 1.0)
            return logits, value[:, 0]
        if obs.dtype == jnp.uint8:
            x = jnp.transpose(obs, (0, 2, 3, 1)).astype(jnp.float32) / 255.0
        else:
            x = jnp.transpose(obs, (0, 2, 3, 1)).astype(jnp.float32)
        if self.torso == "nature":
            x = NatureTorso(self.channels, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x)
        elif self.torso == "minatar":
            x = MinAtarTorso(self.channels)(x)
        else:
            for channels in self.channels:
                x = ConvSequence(channels)(x)
            x = nn.relu(x).reshape(x.shape[0], -1)
        for hidden in self.hiddens:
            x = nn.relu(nn.Dense(hidden, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        logits = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01))(x)
        value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(x)
        return logits, value[:, 0]


def network_of(args: Args, num_actions: int) -> Network:
    return Network(args.torso, torso_channels(args), args.hiddens, num_actions)


# === Actor ===

# How the policy lag goes on across a resume (cleanba_utils.handoff): restarted on envpool's
# environments, which a resumed run makes anew from the run's seeds; kept on a JAX environment,
# whose state the checkpoint holds with every agent's parameters sent last: the resumed run is then
# the uninterrupted one, bit for bit (--gossip async keeps no checkpoint).
ON_RESUME: OnResume = "restart_lag"
ON_RESUME_JAX_ENVS: OnResume = "keep_lag"


def on_resume_of(args) -> OnResume:
    return ON_RESUME_JAX_ENVS if is_jax_env(args.env_id) else ON_RESUME


class Transitions(NamedTuple):
    """What an actor played, (1, envs, steps, ...) arrays: `is_reset` marks envpool's reset steps,
    which belong to no episode and are left out of learning."""

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    is_reset: np.ndarray


class Rollout(NamedTuple):
    """An actor's rollout for `update` by parameters `policy_version`, on its agent's device:
    `bootstrap_obs` (1, envs, ...) is the observation after the last step; `record`, its
    environments' record after it (a JAX environment's state, for a checkpoint to bring them back;
    None on envpool's); `timing`, the seconds the actor waited for the parameters."""

    update: int
    policy_version: int
    transitions: Transitions
    bootstrap_obs: jax.Array
    record: Any
    timing: ActorTimes


def sample_actions(logits, key, step, env_ids):
    """Gumbel-max sampling keyed by (step, global env index): the same draws whatever the layout."""
    step_key = jax.random.fold_in(key, step)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(step_key, env_ids)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[1:]))(keys)
    return jnp.argmax(logits + gumbel, axis=1)


def policy_step(network, action_key, params, obs, env_ids, step, step_input):
    """The policy's step on a batch of environments (`env_ids`, their global indices) at policy
    step `step`: the sampled actions, and no outputs beside them (the learner evaluates every
    observation with its agent's parameters). `step_input` is unused (the compiled rollout's
    per-step input)."""
    logits = network.apply(params, obs)[0]
    return sample_actions(logits, action_key, step, env_ids), None


def actor_thread(
    args, sizes, run, network, lag, env_offset, device, param_queue, rollout_queue, env_record
):
    """An agent's actor thread (`handoff.start_actor_threads`, one per agent), playing the
    updates of `lag`: environments with global indices env_offset .. env_offset + local_num_envs -
    1, the agent's (agent x local_num_envs onwards). envpool's environments step in Python beside
    the policy's inference; a JAX environment's steps and the policy's run in one compiled
    program, continued from their part of `env_record` in a resumed run (None: a fresh run, or
    envpool's environments)."""
    agent = env_offset // args.local_num_envs
    action_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 1)
    if is_jax_env(args.env_id):
        start_rollout = compiled_rollout.start
    else:
        # An Atari episode that ends for learning at a lost life goes on, for the returns logged,
        # to the end of the game (`episode_over`).
        start_rollout = functools.partial(split_envs.start_splits, episode_over=episode_over)
    envs = start_rollout(
        make_env,
        args,
        episodes=run.logs.episodes(args.local_num_envs),
        num_envs=sizes.num_envs,
        env_offset=env_offset,
        env_record=env_record,
        act=functools.partial(policy_step, network, action_key),
        device=device,
    )

    for update in lag.updates():
        param_wait_start = time.time()
        if lag.actor_fetches_params(update):
            policy_version, params = queue_get(param_queue, run.stop)
        param_queue_get_time = time.time() - param_wait_start
        played = envs.play(params, update)
        steps = played.steps
        # Each finished episode is also logged as the agent's own.
        for end in played.episode_ends:
            scalars = {f"charts/agent_{agent}/episodic_return": end.episode_return}
            run.logs.log(scalars, end.global_step)
        transitions = Transitions(
            obs=steps.obs,
            actions=steps.env_actions,
            rewards=steps.rewards,
            terminations=steps.terminations,
            truncations=steps.truncations,
            is_reset=steps.is_reset,
        )
        agent_first = lambda x: x[None]
        rollout = Rollout(
            update=update,
            policy_version=policy_version,
            transitions=jax.device_put(jax.tree.map(agent_first, transitions), device),
            bootstrap_obs=jax.device_put(agent_first(played.next_obs), device),
            record=played.record,
            timing=ActorTimes(param_queue_get_time=param_queue_get_time),
        )
        queue_put(rollout_queue, rollout, run.stop)


def evaluate(params, args: Args, num_episodes: int, seed: int) -> list[float]:
    """Plays one whole episode (game) in each of `num_episodes` fresh environments, choosing
    actions as --eval-actions says: greedy (argmax π) or sampled."""
    envs = make_env(args, seed, num_episodes)
    network = network_of(args, envs.action_space.n)
    env_ids = jnp.arange(num_episodes)

    @jax.jit
    def act(params, obs, step):
        logits = network.apply(params, obs)[0]
        if args.eval_actions == "greedy":
            return jnp.argmax(logits, axis=1)
        return sample_actions(logits, jax.random.PRNGKey(seed), step, env_ids)

    return play_episodes(
        envs, num_episodes, lambda obs, step: act(params, obs, step), episode_over=episode_over
    )


# The model card of --upload-model: the algorithm, its papers and how `evaluate` acts.
MODEL_CARD = hub.ModelCard(
    name="GALA-A2C",
    papers=(hub.GALA,),
    evaluation_policy=lambda args: (
        "greedy: the most probable action of the agents' average policy (argmax π)"
        if args.eval_actions == "greedy"
        else "actions sampled from the agents' average policy π"
    ),
)


# === Loss ===


def nstep_returns(rewards, next_values, terminations, truncations, gamma):
    """Bootstrapped returns of one environment's rollout: R_t = r_t + γ R_{t+1}, from the value
    after the last step; a termination stops bootstrapping, a truncation bootstraps from the value
    of its last observation. `next_values[t]`: the value after step t. (rlax.lambda_returns is the
    same, but this script does not import rlax, whose import is slow.)"""

    def step(following, t):
        reward, next_value, terminated, truncated = t
        bootstrap = jnp.where(truncated > 0, next_value, following)
        following = reward + gamma * (1.0 - terminated) * bootstrap
        return following, following

    inputs = (rewards, next_values, terminations, truncations)
    return jax.lax.scan(step, next_values[-1], inputs, reverse=True)[1]


class Batch(NamedTuple):
    """One agent's rollout for the loss, (envs, steps, ...): `obs` has the bootstrap observation as
    its last step; `valid` is 0 on envpool's reset steps."""

    obs: jax.Array
    actions: jax.Array
    rewards: jax.Array
    terminations: jax.Array
    truncations: jax.Array
    valid: jax.Array


def batch_of(transitions: Transitions, bootstrap_obs) -> Batch:
    return Batch(
        obs=jnp.concatenate([transitions.obs, bootstrap_obs[:, None]], axis=1),
        actions=transitions.actions,
        rewards=transitions.rewards.astype(jnp.float32),
        terminations=transitions.terminations.astype(jnp.float32),
        truncations=transitions.truncations.astype(jnp.float32),
        valid=1.0 - transitions.is_reset.astype(jnp.float32),
    )


class Losses(NamedTuple):
    policy_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array


def a2c_loss(params, apply_fn, batch: Batch, *, gamma, ent_coef, vf_coef):
    """A2C on one agent's rollout; means over its valid (non-reset) steps."""
    envs_and_obs = batch.obs.shape[:2]
    logits, values = apply_fn(params, batch.obs.reshape(-1, *batch.obs.shape[2:]))
    logits = logits.reshape(*envs_and_obs, -1)[:, :-1]
    values = values.reshape(envs_and_obs)
    returns = jax.vmap(nstep_returns, (0, 0, 0, 0, None))(
        batch.rewards,
        jax.lax.stop_gradient(values[:, 1:]),
        batch.terminations,
        batch.truncations,
        gamma,
    )
    values = values[:, :-1]
    log_probs = jax.nn.log_softmax(logits)
    actions = batch.actions[..., None].astype(jnp.int32)
    logprob = jnp.take_along_axis(log_probs, actions, axis=-1)[..., 0]
    mean = lambda x: (x * batch.valid).sum() / jnp.maximum(batch.valid.sum(), 1.0)
    policy_loss = mean(-(returns - jax.lax.stop_gradient(values)) * logprob)
    value_loss = mean((returns - values) ** 2)
    entropy = mean(-(jax.nn.softmax(logits) * log_probs).sum(-1))
    loss = policy_loss + vf_coef * value_loss - ent_coef * entropy
    return loss, Losses(policy_loss=policy_loss, value_loss=value_loss, entropy=entropy)


# === Gossip ===


def mix(params, messages: list):
    """x <- (x + sum of messages) / (1 + number of messages): the gossip step."""
    return jax.tree.map(lambda x, *ms: (x + sum(ms)) / (1 + len(ms)), params, *messages)


def cosine(a, b):
    dot = lambda u, v: sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(v)))
    return dot(a, b) / (jnp.sqrt(dot(a, a) * dot(b, b)) + 1e-12)


# === Update ===


def init_state(args: Args, sizes: Sizes):
    """The network, and where the run starts (`kept_lag.Origin`): every agent's state stacked on a
    leading axis (host arrays) and the counters, fresh or from the newest checkpoint (--resume); on
    a JAX environment also every agent's parameters sent last and the environments' state
    (`ON_RESUME_JAX_ENVS`). Agents start from different initializations, except allreduce's (one
    policy)."""
    probe_env = make_env(args, args.seed, 1)
    network = network_of(args, probe_env.action_space.n)
    obs = probe_env.reset()[0]
    rmsprop = optax.rmsprop(
        scaled_learning_rate(args),
        decay=args.rmsprop_decay,
        eps=args.rmsprop_eps,
        eps_in_sqrt=False,
    )
    optimizer = optax.chain(optax.clip_by_global_norm(args.max_grad_norm), rmsprop)
    init_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 0)
    keys = [
        jax.random.fold_in(init_key, 0 if args.topology == "allreduce" else i)
        for i in range(args.num_agents)
    ]
    states = [
        TrainState.create(apply_fn=network.apply, params=network.init(key, obs), tx=optimizer)
        for key in keys
    ]
    state = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *states)
    identity = dict(
        sizes=dataclasses.asdict(sizes),
        seed=args.seed,
        topology=args.topology,
        num_peers=args.num_peers,
    )
    if not is_jax_env(args.env_id):
        saved, counters = resume_or_start(args, state, identity, __file__)
        origin = kept_lag.learner_origin(state if saved is None else saved, counters)
        # Every agent's state, gathered from every process (a collective).
        checkpointing = Checkpointing(on_host=gathered_agents, collective=True)
        return network, origin._replace(checkpointing=checkpointing)
    template = Continuation(
        learner=state,
        acting_params=state.params,
        env_record=env_records.empty_record(sizes.num_envs, args.env_id, args.env_params),
    )
    saved, counters = resume_or_start(args, template, identity, __file__)
    checkpointing = Checkpointing(on_host=gathered_kept_lag, collective=True)
    origin = kept_lag.learner_origin(state, counters)._replace(checkpointing=checkpointing)
    if saved is None:
        return network, origin
    return network, origin._replace(
        learner=saved.learner, acting_params=saved.acting_params, env_record=saved.env_record
    )


def gathered_kept_lag(kept: Continuation) -> Continuation:
    """The checkpoint of a JAX environment's run: every agent's state and parameters sent last on
    the host (a collective), with the environments' record."""
    return kept._replace(
        learner=gathered_agents(kept.learner), acting_params=gathered_agents(kept.acting_params)
    )


def scaled_learning_rate(args: Args) -> float:
    """Every agent's learning rate: the base one times √(number of learners) (the paper's)."""
    if not args.scale_learning_rate:
        return args.learning_rate
    return args.learning_rate * np.sqrt(args.num_agents)


def a2c_gradients(args: Args, state, transitions: Transitions, bootstrap_obs):
    """The gradient of one agent's A2C loss on its rollout, and the losses."""
    return jax.grad(a2c_loss, has_aux=True)(
        state.params,
        apply_fn=state.apply_fn,
        batch=batch_of(transitions, bootstrap_obs),
        gamma=args.gamma,
        ent_coef=args.ent_coef,
        vf_coef=args.vf_coef,
    )


def lockstep_update(args: Args):
    """One device's share of the lock-step update, inside a `shard_map` over the mesh axis "agents":
    its block of agents (a leading axis), each taking an A2C step (gradients averaged over every
    agent for allreduce), then the gossip step with the in-peers' new parameters (j sends to j +
    d); the consensus, and with `with_similarity` the mean cosine similarity of ring neighbours'
    gradients."""

    def update_block(state, transitions, bootstrap_obs, with_similarity):
        gradients = jax.vmap(functools.partial(a2c_gradients, args))
        grads, losses = gradients(state, transitions, bootstrap_obs)
        similarity = None
        if with_similarity:
            similarity = agents_mean(jax.vmap(cosine)(grads, ring_shift(grads, 1)))
        if args.topology == "allreduce":
            grads = jax.tree.map(
                lambda mean, agent_grads: jnp.broadcast_to(mean, agent_grads.shape),
                agents_mean(grads),
                grads,
            )
        # The optimizer steps go agent by agent: each is then the program of an agent alone on its
        # device (vmap's batched clipping and RMSProp step round differently).
        state = jax.lax.map(lambda pair: pair[0].apply_gradients(grads=pair[1]), (state, grads))
        if args.topology == "gossip":
            # Algorithm 1: after its step each agent sends its new parameters to its out-peers and
            # averages its own with the ones it receives, so the agents' mean moves by the mean of
            # their steps (mixing with the peers' parameters from before the step would halve it).
            in_peers = [ring_shift(state.params, d) for d in range(1, args.num_peers + 1)]
            state = state.replace(params=mix(state.params, in_peers))
        losses = agents_mean(losses)
        consensus = consensus_of(jax.lax.all_gather(state.params, "agents", tiled=True))
        # What every device holds alike comes back with a leading axis of devices, as from a pmap
        # (`first_replica` reads it).
        replicas = jax.tree.map(lambda x: x[None], (losses, consensus, similarity))
        return state, *replicas

    return update_block


def make_update(args: Args, sharding: NamedSharding):
    """The lock-step update of every agent: a `shard_map` over the devices of `sharding`, each with
    its block of agents."""
    block_update = lockstep_update(args)

    def update_all(state, transitions, bootstrap_obs, with_similarity):
        return jax.shard_map(
            functools.partial(block_update, with_similarity=with_similarity),
            mesh=sharding.mesh,
            in_specs=sharding.spec,
            out_specs=sharding.spec,
        )(state, transitions, bootstrap_obs)

    return jax.jit(update_all, static_argnums=3)


def make_agent_update(args: Args):
    """One agent's A2C step in --gossip async, on its own device."""

    @jax.jit
    def agent_update(state, transitions, bootstrap_obs):
        transitions = jax.tree.map(lambda x: x[0], transitions)
        grads, losses = a2c_gradients(args, state, transitions, bootstrap_obs[0])
        return state.apply_gradients(grads=grads), losses

    return agent_update


# === Learner loop ===


def lag_rule_of(args: Args, sizes: Sizes, first_update: int) -> LagRule:
    return LagRule(first_update, sizes.num_updates, args.concurrency, on_resume_of(args))


def start_agent_actors(args, sizes, run, network, agent_devices, lag, env_record=None):
    """One actor thread per local agent (`handoff.start_actor_threads`), on its agent's device,
    playing the updates of `lag`."""
    return start_actor_threads(
        actor_thread,
        agent_devices,
        args=args,
        run=run,
        lag=lag,
        threads_per_device=1,
        sizes=sizes,
        network=network,
        env_record=env_record,
    )


def log_agents(run, global_step: int, agent_scalars: dict):
    """`agent_scalars[agent]` under `stats/agent_{agent}/`, and the agent's SPS (from its
    `steps`)."""
    elapsed = time.time() - run.logs.start_time
    for agent, values in agent_scalars.items():
        scalars = {f"stats/agent_{agent}/{key}": value for key, value in values.items()}
        scalars[f"charts/agent_{agent}/SPS"] = int(values["steps"] / elapsed)
        run.logs.log(scalars, global_step)


def log_distances(run, global_step: int, consensus, agent_steps: list):
    """Each agent's distance to the consensus, and its SPS from its environment steps."""
    for agent, (distance, steps) in enumerate(zip(consensus.distances, agent_steps)):
        log_agents(run, global_step, {agent: dict(consensus_distance=distance, steps=steps)})


def train_sync(args: Args, sizes: Sizes, run, network, origin: kept_lag.Origin):
    """All agents in lock step, one update over their devices. Returns the consensus average and the
    updates done."""
    agent_devices, global_devices = agent_devices_of(args.num_agents)
    sharding = agents_sharding(global_devices)
    state = sharded(origin.learner, sharding)
    update_fn = make_update(args, sharding)
    first_agent = jax.process_index() * len(agent_devices)
    lag = lag_rule_of(args, sizes, first_update=run.logs.first_update + 1)
    actors = start_agent_actors(args, sizes, run, network, agent_devices, lag, origin.env_record)

    def send(params, policy_version: int):
        """Each local agent's row of `params` (every agent's, sharded) to its actor."""
        for index, param_queue in enumerate(actors.param_queues):
            row = agent_slice(params, first_agent + index)
            queue_put(param_queue, (policy_version, row), run.stop)

    with run.learner_loop(actors.threads) as end:
        # A resumed JAX environment's run with --concurrency first sends the checkpoint's
        # parameters, which play the actors' next rollout (`handoff.ActorThreads.send_first`).
        resumed = lag.first_update > 1
        if resumed and args.concurrency and origin.acting_params is not None:
            if lag.first_update <= sizes.num_updates:
                send(sharded(origin.acting_params, sharding), lag.first_update - 2)
        send(state.params, lag.first_update - 1)
        last_sent = state.params
        update = lag.first_update - 1  # the updates done, where the loop makes none (finished)
        for update in lag.updates():
            rollouts, rollout_queue_get_time = actors.take_rollouts(update)
            learn_start = time.time()
            transitions = jax.tree.map(
                lambda *slices: from_slices(slices, sharding), *[r.transitions for r in rollouts]
            )
            bootstrap_obs = from_slices([r.bootstrap_obs for r in rollouts], sharding)
            with_similarity = update % (args.similarity_every or DEFAULT_SIMILARITY_EVERY) == 0
            state, losses, consensus, similarity = update_fn(
                state, transitions, bootstrap_obs, with_similarity
            )
            consensus = jax.device_get(first_replica(consensus))
            learner_times = LearnerTimes(
                rollout_queue_get_time=rollout_queue_get_time,
                learn_time=time.time() - learn_start,
            )
            stats = consensus_stats(consensus)
            if with_similarity:
                stats["gradient_similarity"] = jax.device_get(first_replica(similarity))
            run.logs.log_update(
                update,
                rollouts=rollouts,
                metrics=losses._asdict(),
                learner_times=learner_times,
                stats=stats,
                optimizer_steps=update,
                learning_rate=scaled_learning_rate(args),
                details=consensus_line(consensus),
            )
            steps = (update - lag.first_update + 1) * sizes.steps_per_update // args.num_agents
            log_distances(
                run, update * sizes.steps_per_update, consensus, [steps] * args.num_agents
            )
            if run.evaluation_due(update):
                # Every process gathers (a collective); the one that logs plays the episodes. Each
                # agent has made one optimizer step per update.
                consensus_params = jax.tree.map(lambda x: x.mean(0), gathered_agents(state.params))
                run.evaluate_and_log(update, consensus_params, update)
            saved = state
            if is_jax_env(args.env_id):
                # Every process's environments after the rollouts, in global env order.
                record = gathered_rollouts([r.record for r in rollouts], args.distributed)
                saved = Continuation(state, acting_params=last_sent, env_record=record)
            end.exit_code = run.after_update(saved, update)
            if end.exit_code:
                break
            if update < sizes.num_updates:
                send(state.params, policy_version=update)
                last_sent = state.params
    consensus_params = jax.tree.map(lambda x: x.mean(0), gathered_agents(state.params))
    return consensus_params, update


@dataclasses.dataclass
class Board:
    """What the agents of --gossip async show the main thread: each one's newest parameters and its
    update count, and the agents that made their first update."""

    params: list
    updates: list
    started: list


def agent_learner(
    args, sizes, run, lag, agent, device, state, board, mailboxes, param_queue, rollout_queue
):
    """An agent of --gossip async: A2C update, post to the out-peers' mailboxes, mix with the
    messages in its own."""
    num_agents = args.num_agents
    out_peers = [(agent + d) % num_agents for d in range(1, args.num_peers + 1)]
    silent = {(agent - d) % num_agents: 0 for d in range(1, args.num_peers + 1)}
    update_fn = make_agent_update(args)
    mix_on_device = jax.jit(mix)
    for update in lag.updates():
        queue_put(param_queue, (update - 1, state.params), run.stop)
        [rollout], _ = take_rollouts([rollout_queue], update, lag, run.stop)
        state, losses = update_fn(state, rollout.transitions, rollout.bootstrap_obs)
        if update == 1:
            board.started.append(agent)
        # The agents start together, whatever each took to compile.
        while len(board.started) < num_agents:
            if run.stop.is_set():
                raise Stopped
            time.sleep(POLL_SECONDS / 10)
        # The gossip step (Algorithm 1): broadcast the new parameters without waiting, then mix with
        # the messages that have arrived.
        broadcast(mailboxes, out_peers, Message(sender=agent, version=update, params=state.params))
        messages = receive(mailboxes[agent], silent, args.staleness_bound, run.stop)
        if messages:
            peers = [jax.device_put(m.params, device) for m in messages]
            state = state.replace(params=mix_on_device(state.params, peers))
        board.params[agent] = state.params
        board.updates[agent] = update
        global_step = sum(board.updates) * sizes.steps_per_update // num_agents
        agent_values = {
            **jax.device_get(losses)._asdict(),
            "steps": update * sizes.steps_per_update // num_agents,
            "messages_mixed": len(messages),
            "messages_overwritten": mailboxes[agent].overwritten,
        }
        if messages:
            agent_values["message_staleness"] = np.mean([update - m.version for m in messages])
        log_agents(run, global_step, {agent: agent_values})
    for peer in out_peers:
        mailboxes[peer].close(agent)


def train_async(args: Args, sizes: Sizes, run, network, origin: kept_lag.Origin):
    """A learner thread per agent; the main thread measures the consensus after every n updates of
    all agents."""
    state = origin.learner
    agent_devices = agent_devices_of(args.num_agents).local
    board = Board(params=[None] * args.num_agents, updates=[0] * args.num_agents, started=[])
    mailboxes = [Mailbox() for _ in range(args.num_agents)]
    # --gossip async keeps no checkpoint: a run starts at update 1.
    lag = lag_rule_of(args, sizes, first_update=1)
    actors = start_agent_actors(args, sizes, run, network, agent_devices, lag)
    threads = list(actors.threads)
    for agent, device in enumerate(agent_devices):
        agent_state = jax.device_put(jax.tree.map(operator.itemgetter(agent), state), device)
        board.params[agent] = agent_state.params
        thread = start_thread(
            target=agent_learner,
            name=f"agent-{agent}",
            stop=run.stop,
            failures=run.failures,
            args=args,
            sizes=sizes,
            run=run,
            lag=lag,
            agent=agent,
            device=device,
            state=agent_state,
            board=board,
            mailboxes=mailboxes,
            param_queue=actors.param_queues[agent],
            rollout_queue=actors.rollout_queues[agent],
        )
        threads.append(thread)
    learners = threads[args.num_agents :]
    measured = 0
    updates_per_line = args.num_agents * args.log_frequency
    with run.learner_loop(threads) as end:
        while not run.stop.is_set() and not run.received_signals:
            running = any(t.is_alive() for t in learners)
            updates = sum(board.updates)
            if updates >= measured + args.num_agents or not running:
                # Read together, while the agents go on.
                params = list(board.params)
                counts = list(board.updates)
                stacked = jax.tree.map(lambda *xs: np.stack(xs), *jax.device_get(params))
                consensus = jax.device_get(consensus_of(stacked))
                steps = [count * sizes.steps_per_update // args.num_agents for count in counts]
                global_step = sum(steps)
                scalars = {
                    f"stats/{key}": value for key, value in consensus_stats(consensus).items()
                }
                run.logs.log(scalars | {"charts/SPS": run.logs.sps(global_step)}, global_step)
                log_distances(run, global_step, consensus, steps)
                if updates // updates_per_line > measured // updates_per_line or not running:
                    update = global_step // sizes.steps_per_update
                    run.logs.print_progress(update, global_step, consensus_line(consensus))
                measured = updates
            if not running:
                break
            time.sleep(POLL_SECONDS / 10)
        if run.received_signals:
            print("stopped by a signal; --gossip async runs keep no checkpoint", file=sys.stderr)
            end.exit_code = 128 + run.received_signals[0]
    consensus_params = jax.tree.map(lambda *xs: np.mean(xs, axis=0), *jax.device_get(board.params))
    return consensus_params, sizes.num_updates


def train(args: Args):
    sizes = sizes_of(args)
    network, origin = init_state(args, sizes)
    run = open_run(
        args=args,
        sizes=sizes,
        script_path=__file__,
        counters=origin.counters,
        global_learner_devices=agent_devices_of(args.num_agents).every,
        evaluate=evaluate,
        model_card=MODEL_CARD,
        checkpointing=origin.checkpointing,
    )
    run.evaluate_untrained(lambda: jax.tree.map(lambda x: x.mean(0), origin.learner.params))
    train_agents = train_async if args.gossip == "async" else train_sync
    consensus_params, update = train_agents(args, sizes, run, network, origin)
    # Each agent has made one optimizer step per update.
    run.finish(consensus_params, update, optimizer_steps=update)


# === Main ===


def main(argv=None):
    args = parse_args(argv)
    # Up to one device per agent of this process, which its agents share (validate_layout refuses
    # agents that do not divide over the processes).
    agents_per_process = max(1, args.num_agents // distributed.num_processes_of(args))
    distributed.join(args, num_layout_devices=agents_per_process)
    validate_layout(args)
    train(args)


if __name__ == "__main__":
    restart_with_huge_pages()
    main()
