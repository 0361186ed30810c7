"""Cleanba GALA-A2C: n A2C actor-learners ("agents") that gossip their parameters over a directed ring.

GALA (Assran et al., 2019, "Gossip-based Actor-Learner Architectures for Deep Reinforcement Learning"):
every agent has its own environments, optimizer and parameters x_i. After each local update, agent i sends
x_i to its out-peers i+1 .. i+k and averages with the messages it holds: x_i <- (x_i + sum of messages) /
(1 + number of messages). The agents stay in a ball around their average x̄, which is what is saved.

- `--gossip sync` (default): the agents update in lock step, one `pmap` over their devices (axis "agents");
  at update t, agent i mixes its freshly updated parameters with its in-peers' parameters after update
  t-1 (a `lax.ppermute`), exactly one version old. The same seed gives the same run.
- `--gossip async` (the paper's): one learner thread per agent, messages left in mailboxes without waiting;
  a new message overwrites an unread one from the same peer. Fast agents never wait for slow ones (unless
  `--staleness-bound`), and runs are not reproducible.
- `--topology allreduce`: A2C with the gradients averaged over the agents (one shared policy);
  `--topology none`: n independent agents.

Every agent keeps the Cleanba protocol: one actor thread with a `param_queue` and a `rollout_queue`
(maxsize 1); with `--concurrency` (default) the actor plays with parameters exactly one version behind.
"""

import dataclasses
import functools
import operator
import os
import queue
import sys
import threading
import time
from typing import Literal, NamedTuple

import envpool
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.experimental import multihost_utils
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cleanba_utils import distributed, parsing
from cleanba_utils.checkpoints import resume_from
from cleanba_utils.parsing import fail
from cleanba_utils.run import open_run, run_dir_of
from cleanba_utils.run_files import first_replica
from cleanba_utils.threads import POLL_SECONDS, Stopped, queue_get, queue_put, start_thread


@dataclasses.dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment: environments, action sampling and initialization"""
    run_name: str | None = None
    """name of the run folder under `runs/` (default: `{env_id}__{exp_name}__{seed}__{unix time}`)"""
    group: str = ""
    """free-form label of the experiment this run belongs to, recorded in spec.json"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project_name: str = "cleanba"
    """the Weights & Biases project"""
    wandb_entity: str | None = None
    """the Weights & Biases entity (team)"""
    save_model: bool = False
    """save the consensus average of the agents' final parameters to `runs/{run_name}/{exp_name}.cleanba_model`"""
    eval_episodes: int = 0
    """after training, play this many episodes with the consensus average and log their returns"""
    log_frequency: int = 100
    """print a console line every this many updates"""

    env_id: str = "Breakout-v5"
    """the id of the envpool environment"""
    total_timesteps: int = 10_000_000
    """total environment steps (agent steps, not frames) of the run, all agents together"""
    learning_rate: float = 7e-4
    """RMSProp's learning rate, constant. 7e-4 is A2C's value for a batch of 16 environments x 5 steps, which is
    each agent's batch here; the GALA authors' code runs 4 agents at 1.4e-3 (pass it to compare)"""
    rmsprop_decay: float = 0.99
    """RMSProp's decay of the squared-gradient average"""
    rmsprop_eps: float = 1e-5
    """RMSProp's epsilon, added to the root of the average as in PyTorch's RMSprop"""
    local_num_envs: int = 16
    """the number of environments of each agent"""
    envpool_num_threads: int | None = None
    """worker threads of each envpool instance (default: CPUs / agents); results do not depend on it"""
    num_steps: int = 5
    """the number of steps each environment runs per rollout: the horizon of the bootstrapped returns"""
    gamma: float = 0.99
    """the discount factor"""
    ent_coef: float = 0.01
    """the entropy coefficient"""
    vf_coef: float = 0.5
    """the value function coefficient"""
    max_grad_norm: float = 0.5
    """the maximum global norm of each agent's gradient"""
    channels: tuple[int, ...] = (16, 32, 32)
    """the channels of the IMPALA ResNet stacks (image observations)"""
    hiddens: tuple[int, ...] = (256,)
    """the sizes of the dense layers after the ResNet (image observations), or of the hidden layers of each of
    the separate actor and critic MLPs (vector observations)"""

    num_agents: int = 4
    """the number of actor-learners, each on its own device (CPU: XLA_FLAGS=--xla_force_host_platform_device_count)"""
    topology: Literal["gossip", "allreduce", "none"] = "gossip"
    """gossip over a directed ring, gradients averaged over all agents (A2C), or independent agents"""
    gossip: Literal["sync", "async"] = "sync"
    """sync: lock step, peers' parameters one update old, reproducible; async: threads and mailboxes (the paper's)"""
    num_peers: int = 1
    """the out-peers of each agent: agent i sends to agents i+1 .. i+num_peers (mod num_agents)"""
    staleness_bound: int = 0
    """--gossip async: an agent that made this many updates without a message from an in-peer waits for one
    (0: never waits)"""
    similarity_every: int = 10
    """measure the cosine similarity of ring neighbours' gradients every this many updates"""
    concurrency: bool = True
    """let each actor collect the next rollout while its learner trains (policy lag 1 instead of 0)"""
    distributed: bool = False
    """join a multi-process run with jax.distributed (--gossip sync and allreduce; agents split over processes)"""
    coordinator_address: str | None = None
    """host:port of process 0, for --distributed outside SLURM"""
    num_processes: int | None = None
    """the number of processes, for --distributed outside SLURM"""
    process_id: int | None = None
    """this process's index in 0 .. num_processes - 1, for --distributed outside SLURM"""
    checkpoint_every: int = 0
    """save a checkpoint of all agents every this many updates (0: only at the end and on SIGTERM / SIGUSR1)"""
    resume: bool = False
    """continue from the newest readable checkpoint of `runs/{run_name}` (start fresh if there is none)"""


@dataclasses.dataclass(frozen=True)
class Sizes:
    num_envs: int
    batch_size: int
    num_updates: int


def sizes_of(args: Args) -> Sizes:
    num_envs = args.local_num_envs * args.num_agents
    batch_size = num_envs * args.num_steps
    return Sizes(num_envs, batch_size, args.total_timesteps // batch_size)


def parse_args(argv=None) -> Args:
    args = parsing.parse_args(Args, argv)
    validate(args)
    return args


def validate(args: Args):
    """Checks every argument that needs no device, before any other work; exits 2 on the first problem."""
    positive = "total_timesteps local_num_envs num_steps max_grad_norm rmsprop_eps log_frequency num_agents"
    non_negative = "learning_rate ent_coef vf_coef eval_episodes checkpoint_every staleness_bound"
    parsing.check_signs(args, (positive + " similarity_every").split(), non_negative.split())
    parsing.check_in(args, "gamma", 0, 1, low_open=True)
    parsing.check_in(args, "rmsprop_decay", 0, 1)
    if args.topology == "gossip" and args.num_agents < 2:
        fail(f"--topology gossip needs at least 2 agents, got --num-agents {args.num_agents}")
    if args.topology == "gossip" and not 1 <= args.num_peers < args.num_agents:
        fail(f"--num-peers must be in 1 .. {args.num_agents - 1} (--num-agents - 1), got {args.num_peers}")
    if args.gossip == "async" and args.topology != "gossip":
        fail(f"--gossip async needs --topology gossip; --topology {args.topology} runs in lock step")
    if args.staleness_bound and args.gossip != "async":
        fail("--staleness-bound bounds asynchronous messages; use it with --gossip async")
    if args.gossip == "async" and (args.distributed or args.checkpoint_every or args.resume):
        fail("--gossip async runs its agents as threads of one process, without checkpoints; use --gossip sync")
    parsing.check_run_options(args)


def validate_layout(args: Args):
    """The checks that need the devices (and, with --distributed, the number of processes)."""
    sizes, num_processes = sizes_of(args), jax.process_count()
    if args.num_agents % num_processes:
        fail(f"--num-agents {args.num_agents} must be divisible by the number of processes ({num_processes})")
    local_agents, num_devices = args.num_agents // num_processes, len(jax.local_devices())
    if num_devices < local_agents:
        fail(
            f"--num-agents {args.num_agents} needs {local_agents} devices per process, this one has {num_devices}; "
            f"on CPU run with XLA_FLAGS=--xla_force_host_platform_device_count={local_agents}"
        )
    if sizes.num_updates < 1:
        fail(
            f"--total-timesteps {args.total_timesteps} is less than one update ({sizes.batch_size} steps = "
            "agents x envs x steps); raise it or shrink --local-num-envs / --num-steps"
        )


def is_atari(env_id: str) -> bool:
    return "repeat_action_probability" in envpool.make_spec(env_id).config._fields


def make_env(args: Args, seed: int, num_envs: int):
    """envpool seeds its environment i with `seed + i`; Atari follows Machado et al. (2018): sticky actions, the
    full action space, no life-loss signal, one no-op at reset at most, 108k frames per episode at most."""
    cpus_per_agent = len(os.sched_getaffinity(0)) // args.num_agents
    num_threads = args.envpool_num_threads or max(1, min(num_envs, cpus_per_agent))
    atari = dict(repeat_action_probability=0.25, full_action_space=True, episodic_life=False, noop_max=1)
    options = dict(atari, max_episode_steps=27_000, reward_clip=True) if is_atari(args.env_id) else {}
    return envpool.make(
        args.env_id, env_type="gymnasium", num_envs=num_envs, seed=seed, num_threads=num_threads, **options
    )


class ResidualBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(self.channels, (3, 3))(nn.relu(x))
        y = nn.Conv(self.channels, (3, 3))(nn.relu(y))
        return x + y


class ConvSequence(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.channels, (3, 3))(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        return ResidualBlock(self.channels)(ResidualBlock(self.channels)(x))


class MLP(nn.Module):
    """tanh hidden layers and a linear output, orthogonally initialized (scale sqrt 2, then `output_scale`)."""

    hiddens: tuple[int, ...]
    outputs: int
    output_scale: float

    @nn.compact
    def __call__(self, x):
        for hidden in self.hiddens:
            x = nn.tanh(nn.Dense(hidden, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return nn.Dense(self.outputs, kernel_init=nn.initializers.orthogonal(self.output_scale))(x)


class Network(nn.Module):
    """IMPALA ResNet torso shared by both heads for stacked frames (N, C, H, W); separate actor and critic
    MLPs for vector observations (N, D): through a shared torso, the critic's gradients swamp the policy's."""

    channels: tuple[int, ...]
    hiddens: tuple[int, ...]
    num_actions: int

    @nn.compact
    def __call__(self, obs):
        if obs.ndim != 4:
            x = obs.astype(jnp.float32)
            return MLP(self.hiddens, self.num_actions, 0.01)(x), MLP(self.hiddens, 1, 1.0)(x)[:, 0]
        x = jnp.transpose(obs, (0, 2, 3, 1)).astype(jnp.float32) / 255.0
        for channels in self.channels:
            x = ConvSequence(channels)(x)
        x = nn.relu(x).reshape(x.shape[0], -1)
        for hidden in self.hiddens:
            x = nn.relu(nn.Dense(hidden, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        logits = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01))(x)
        value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(x)
        return logits, value[:, 0]


def sample_actions(logits, key, step, env_ids):
    """Gumbel-max sampling keyed by (step, global env index): the same draws whatever the layout."""
    step_key = jax.random.fold_in(key, step)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(step_key, env_ids)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[1:]))(keys)
    return jnp.argmax(logits + gumbel, axis=1)


class Rollout(NamedTuple):
    """What an actor thread puts on its rollout queue: the update it is for, the version of the parameters
    that played it, env-major arrays (1, envs, steps, ...) on the agent's device (plus the observations
    after the last step, to bootstrap from), and the seconds the actor spent waiting and playing."""

    update: int
    policy_version: int
    data: dict
    timing: dict


def actor(args, sizes, run, network, first_update, agent, device, param_queue, rollout_queue):
    """Agent `agent`'s actor thread: environments with global indices agent x local_num_envs + 0, 1, ..."""
    env_offset = agent * args.local_num_envs
    envs = make_env(args, args.seed + env_offset, args.local_num_envs)
    env_ids = jax.device_put(np.arange(env_offset, env_offset + args.local_num_envs, dtype=np.int32), device)
    action_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 1)
    get_action = jax.jit(
        lambda params, obs, step: sample_actions(network.apply(params, obs)[0], action_key, step, env_ids)
    )
    episodes = run.episodes(args.local_num_envs)
    next_obs, _ = envs.reset()
    # envpool resets an environment on the step after its episode ended: that step ignores the action,
    # returns the first observation of the next episode, and is masked out of learning.
    next_is_reset = np.zeros(args.local_num_envs, dtype=bool)
    for update in range(first_update, sizes.num_updates + 1):
        param_wait_start = time.time()
        if not (args.concurrency and update == first_update + 1):
            policy_version, params = queue_get(param_queue, run.stop)
        param_queue_get_time = time.time() - param_wait_start
        rollout_start, steps = time.time(), []
        for step in range(args.num_steps):
            policy_step = (update - 1) * args.num_steps + step
            action = np.asarray(get_action(params, jax.device_put(next_obs, device), policy_step))
            obs, reward, terminated, truncated, info = envs.step(action)
            played = dict(obs=next_obs, actions=action, is_reset=next_is_reset)
            steps.append(dict(played, rewards=reward, terminations=terminated, truncations=truncated))
            done = terminated | truncated
            global_step = policy_step * sizes.num_envs
            for episode_return in episodes.step(info.get("reward", reward), done, next_is_reset, global_step):
                run.log({f"charts/agent_{agent}/episodic_return": episode_return}, global_step)
            next_obs, next_is_reset = obs, done
        data = {key: np.stack([s[key] for s in steps], axis=1)[None] for key in steps[0]}
        data["bootstrap_obs"] = next_obs[None]
        timing = dict(param_queue_get_time=param_queue_get_time, rollout_time=time.time() - rollout_start)
        rollout = Rollout(update, policy_version, jax.device_put(data, device), timing)
        queue_put(rollout_queue, rollout, run.stop)


def nstep_returns(rewards, next_values, terminations, truncations, gamma):
    """Bootstrapped returns of one environment's rollout: R_t = r_t + γ R_{t+1}, from the value after the last
    step; a termination stops bootstrapping, a truncation bootstraps from the value of its last observation.
    `next_values[t]` is the value of the observation after step t. (rlax.lambda_returns computes the same, but
    importing rlax costs seconds at every start.)"""

    def step(following, t):
        reward, next_value, terminated, truncated = t
        following = reward + gamma * (1.0 - terminated) * jnp.where(truncated > 0, next_value, following)
        return following, following

    inputs = (rewards, next_values, terminations, truncations)
    return jax.lax.scan(step, next_values[-1], inputs, reverse=True)[1]


def a2c_loss(params, apply_fn, data, gamma, ent_coef, vf_coef):
    """A2C on one agent's rollout (envs, steps, ...); means over its valid (non-reset) steps."""
    obs = jnp.concatenate([data["obs"], data["bootstrap_obs"][:, None]], axis=1)
    logits, values = apply_fn(params, obs.reshape(-1, *obs.shape[2:]))
    logits, values = logits.reshape(*obs.shape[:2], -1)[:, :-1], values.reshape(obs.shape[:2])
    as_float = lambda key: data[key].astype(jnp.float32)
    returns = jax.vmap(nstep_returns, in_axes=(0, 0, 0, 0, None))(
        as_float("rewards"),
        jax.lax.stop_gradient(values[:, 1:]),
        as_float("terminations"),
        as_float("truncations"),
        gamma,
    )
    values = values[:, :-1]
    advantages = returns - jax.lax.stop_gradient(values)
    log_probs = jax.nn.log_softmax(logits)
    logprob = jnp.take_along_axis(log_probs, data["actions"][..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -(jax.nn.softmax(logits) * log_probs).sum(-1)
    valid = 1.0 - as_float("is_reset")
    mean = lambda x: (x * valid).sum() / jnp.maximum(valid.sum(), 1.0)
    policy_loss, value_loss = mean(-advantages * logprob), mean(0.5 * (returns - values) ** 2)
    loss = policy_loss + vf_coef * value_loss - ent_coef * mean(entropy)
    return loss, dict(policy_loss=policy_loss, value_loss=value_loss, entropy=mean(entropy))


def tree_dot(a, b):
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def cosine(a, b):
    return tree_dot(a, b) / (jnp.sqrt(tree_dot(a, a) * tree_dot(b, b)) + 1e-12)


def ring_shift(tree, distance: int, num_agents: int):
    """What agent i - distance holds, for every agent i: agent j sends to j + distance."""
    perm = [(j, (j + distance) % num_agents) for j in range(num_agents)]
    return jax.lax.ppermute(tree, "agents", perm)


def mix(params, messages: list):
    """x <- (x + sum of messages) / (1 + number of messages): the gossip step."""
    return jax.tree.map(lambda x, *ms: (x + sum(ms)) / (1 + len(ms)), params, *messages)


def make_sync_update(args, agent_devices):
    """The lock-step update of every agent, pmap'd over the agents' devices: a local A2C step (with the
    gradients averaged for allreduce), then the gossip with the in-peers' parameters of the previous update;
    the consensus statistics, and every --similarity-every updates the cosine of ring neighbours' gradients."""
    n = args.num_agents

    def update(state, data, with_similarity):
        grads, metrics = jax.grad(a2c_loss, has_aux=True)(
            state.params, state.apply_fn, data, args.gamma, args.ent_coef, args.vf_coef
        )
        if with_similarity:
            metrics["gradient_similarity"] = cosine(grads, ring_shift(grads, 1, n))
        if args.topology == "allreduce":
            grads = jax.lax.pmean(grads, "agents")
        peers = [ring_shift(state.params, d, n) for d in range(1, args.num_peers + 1)]
        state = state.apply_gradients(grads=grads)
        if args.topology == "gossip":
            state = state.replace(params=mix(state.params, peers))
        return state, dict(metrics, **consensus_stats(state.params))

    return jax.pmap(update, axis_name="agents", devices=agent_devices, static_broadcasted_argnums=2)


def consensus_stats(params):
    """Inside the agents' pmap: ‖x_i - x̄‖ of this agent, their root mean square and maximum (the radius of the
    ε-ball around x̄), that maximum as a share of ‖x̄‖, and the largest difference of one parameter between
    two agents (exactly 0 when all agents hold the same parameters)."""
    mean = jax.lax.pmean(params, "agents")
    squared = sum(jnp.sum((x - m) ** 2) for x, m in zip(jax.tree.leaves(params), jax.tree.leaves(mean)))
    distance, mean_norm = jnp.sqrt(squared), jnp.sqrt(tree_dot(mean, mean))
    spread = jnp.max(
        jnp.stack([jnp.max(jax.lax.pmax(x, "agents") - jax.lax.pmin(x, "agents")) for x in jax.tree.leaves(params)])
    )
    radius = jax.lax.pmax(distance, "agents")
    return dict(
        consensus_distance_agent=distance,
        consensus_distance=jnp.sqrt(jax.lax.pmean(squared, "agents")),
        consensus_distance_max=radius,
        consensus_share=radius / mean_norm,
        consensus_spread=spread,
    )


class Message(NamedTuple):
    sender: int
    version: int
    """the sender's update count when it sent the message"""
    params: dict


class Mailbox:
    """An agent's incoming messages in --gossip async: one slot per in-peer, written without waiting. A message
    that arrives while the previous one from the same peer is unread overwrites it, so the receiver always
    mixes with the newest parameters sent to it (the GALA authors' code drops the new message instead, which
    leaves the receiver mixing with older ones); `overwritten` counts the replaced messages."""

    def __init__(self):
        self.slots, self.finished, self.overwritten = {}, set(), 0
        self.condition = threading.Condition()

    def post(self, message: Message):
        with self.condition:
            self.overwritten += message.sender in self.slots
            self.slots[message.sender] = message
            self.condition.notify_all()

    def close(self, sender: int):
        """The sender made its last update: nobody waits for its messages any more."""
        with self.condition:
            self.finished.add(sender)
            self.condition.notify_all()

    def take(self, wait_for: list, stop: threading.Event) -> list:
        """Every unread message, in order of sender; first waits until each sender in `wait_for` that is still
        running has left one."""
        with self.condition:
            while any(s not in self.slots and s not in self.finished for s in wait_for):
                if stop.is_set():
                    raise Stopped
                self.condition.wait(POLL_SECONDS)
            return [self.slots.pop(sender) for sender in sorted(self.slots)]


def receive(mailbox: Mailbox, silent: dict, staleness_bound: int, stop: threading.Event) -> list:
    """After a local update: the messages to mix with. `silent[j]` counts the local updates since the last
    message from in-peer j; with a bound τ > 0, the agent waits only for the in-peers silent for τ updates."""
    for sender in silent:
        silent[sender] += 1
    wait_for = [sender for sender, count in silent.items() if staleness_bound and count >= staleness_bound]
    messages = mailbox.take(wait_for, stop)
    for message in messages:
        silent[message.sender] = 0
    return messages


def evaluate(params, args: Args, num_episodes: int, seed: int) -> list[float]:
    """Plays one episode in each of `num_episodes` fresh environments with the sampled policy."""
    envs = make_env(args, seed, num_episodes)
    network = Network(args.channels, args.hiddens, envs.action_space.n)
    env_ids = jnp.arange(num_episodes)
    act = jax.jit(lambda p, o, step: sample_actions(network.apply(p, o)[0], jax.random.PRNGKey(seed), step, env_ids))
    obs, _ = envs.reset()
    returns, finished = np.zeros(num_episodes), np.zeros(num_episodes, dtype=bool)
    step = 0
    while not finished.all():
        obs, reward, terminated, truncated, info = envs.step(np.asarray(act(params, obs, step)))
        returns += info.get("reward", reward) * ~finished
        finished |= terminated | truncated
        step += 1
    return returns.tolist()


def init_state(args: Args, sizes: Sizes):
    """The network and every agent's learner state, stacked on a leading agent axis (on the host), with the
    counters: fresh from the seed, or with --resume from the newest checkpoint of the run. Agents start from
    different initializations (keyed by the agent), except with allreduce, whose agents share one policy."""
    probe_env = make_env(args, args.seed, 1)
    network = Network(args.channels, args.hiddens, probe_env.action_space.n)
    obs = probe_env.reset()[0]
    probe_env.close()
    optimizer = optax.chain(
        optax.clip_by_global_norm(args.max_grad_norm),
        optax.rmsprop(args.learning_rate, decay=args.rmsprop_decay, eps=args.rmsprop_eps, eps_in_sqrt=False),
    )
    init_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 0)
    agent_keys = [
        jax.random.fold_in(init_key, 0 if args.topology == "allreduce" else i) for i in range(args.num_agents)
    ]
    states = [TrainState.create(apply_fn=network.apply, params=network.init(k, obs), tx=optimizer) for k in agent_keys]
    state = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *states)
    identity = dict(sizes=dataclasses.asdict(sizes), seed=args.seed, topology=args.topology, num_peers=args.num_peers)
    checkpoint = resume_from(run_dir_of(args), state, identity) if args.resume else None
    state, counters = checkpoint or (state, dict(update=0, wall_time_s=0.0))
    return network, state, dict(counters, **identity)


def start_actors(args, sizes, run, network, first_update, agent_devices):
    """One param queue, one rollout queue and one actor thread per local agent."""
    param_queues, rollout_queues, threads = [], [], []
    for local_index, device in enumerate(agent_devices):
        agent = jax.process_index() * len(agent_devices) + local_index
        param_queues.append(queue.Queue(maxsize=1))
        rollout_queues.append(queue.Queue(maxsize=1))
        kwargs = dict(args=args, sizes=sizes, run=run, network=network, first_update=first_update, agent=agent)
        kwargs.update(device=device, param_queue=param_queues[-1], rollout_queue=rollout_queues[-1])
        threads.append(start_thread(actor, f"actor-{agent}", run.stop, run.failures, **kwargs))
    return param_queues, rollout_queues, threads


def check_lag(args, rollout: Rollout, update: int, learner_policy_version: int, first_update: int):
    """The Cleanba protocol: an agent trains on data exactly one policy version old with --concurrency."""
    expected_lag = 1 if args.concurrency and update > first_update else 0
    lag = learner_policy_version - rollout.policy_version
    if rollout.update != update or lag != expected_lag:
        raise RuntimeError(
            f"update {update}: rollout {rollout.update} from policy {rollout.policy_version} while the learner is "
            f"at {learner_policy_version} (lag {lag}, expected {expected_lag})"
        )


def log_agent(run, agent: int, global_step: int, agent_step: int, scalars: dict):
    run.log({f"charts/agent_{agent}/SPS": int(agent_step / (time.time() - run.start_time))}, global_step)
    run.log({f"stats/agent_{agent}/{key}": value for key, value in scalars.items()}, global_step)


def console(args, sizes, run, update: int, global_step: int, group: dict):
    if update % args.log_frequency and update != sizes.num_updates:
        return
    mean_return = f"{np.mean(run.recent_returns):.1f}" if run.recent_returns else "n/a"
    sps = int((global_step - run.counters["update"] * sizes.batch_size) / (time.time() - run.start_time))
    print(
        f"update {update}/{sizes.num_updates} step={global_step} SPS={sps} return={mean_return} "
        f"consensus distance={group['consensus_distance_max']:.3g} share={group['consensus_share']:.3g}",
        flush=True,
    )


def shard_on(x, device):
    """The slice of a pmap'd array that lives on `device`."""
    return next(shard.data[0] for shard in x.addressable_shards if shard.device == device)


def train_sync(args: Args, sizes: Sizes, network, state, run, agent_devices, global_devices):
    """All agents in lock step: one pmap'd update per step over the agents' devices. Returns the last update."""
    sharding = NamedSharding(Mesh(np.array(global_devices), ("agents",)), PartitionSpec("agents"))
    state = jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, sharding, lambda index: x[index]), state)
    update_fn = make_sync_update(args, global_devices)
    consensus = jax.pmap(lambda p: jax.lax.pmean(p, "agents"), axis_name="agents", devices=global_devices)
    run.host_copy = multihost_utils.process_allgather
    start_update = learner_policy_version = run.counters["update"]
    param_queues, rollout_queues, threads = start_actors(args, sizes, run, network, start_update + 1, agent_devices)
    local_agents = [jax.process_index() * len(agent_devices) + i for i in range(len(agent_devices))]

    def send_params(version):
        for q, device in zip(param_queues, agent_devices):
            queue_put(q, (version, jax.tree.map(functools.partial(shard_on, device=device), state.params)), run.stop)

    exit_code = 0
    try:
        send_params(learner_policy_version)
        for update in range(start_update + 1, sizes.num_updates + 1):
            wait_start = time.time()
            rollouts = [queue_get(q, run.stop) for q in rollout_queues]
            rollout_queue_get_time = time.time() - wait_start
            for rollout in rollouts:
                check_lag(args, rollout, update, learner_policy_version, start_update + 1)
            data = jax.tree.map(
                lambda *xs: jax.make_array_from_single_device_arrays((args.num_agents, *xs[0].shape[1:]), sharding, xs),
                *[r.data for r in rollouts],
            )
            learn_start = time.time()
            state, metrics = update_fn(state, data, update % args.similarity_every == 0)
            metrics = jax.device_get(metrics)
            learner_policy_version += 1
            global_step = update * sizes.batch_size
            group = {key: value[0] for key, value in metrics.items() if key != "consensus_distance_agent"}
            stats = dict(
                group,
                rollout_queue_get_time=rollout_queue_get_time,
                learn_time=time.time() - learn_start,
                param_queue_get_time=np.mean([r.timing["param_queue_get_time"] for r in rollouts]),
                actor_policy_version=rollouts[0].policy_version,
                learner_policy_version=learner_policy_version,
            )
            losses = {key: stats.pop(key) for key in ["policy_loss", "value_loss", "entropy"]}
            run.log({f"losses/{key}": value for key, value in losses.items()}, global_step)
            run.log({f"stats/{key}": value for key, value in stats.items()}, global_step)
            run.log({"charts/SPS": int(global_step / (time.time() - run.start_time))}, global_step)
            for index, agent in enumerate(local_agents):
                log_agent(
                    run,
                    agent,
                    global_step,
                    update * sizes.batch_size // args.num_agents,
                    dict(
                        consensus_distance=metrics["consensus_distance_agent"][index],
                        policy_loss=metrics["policy_loss"][index],
                    ),
                )
            console(args, sizes, run, update, global_step, group)
            exit_code = run.after_update(state, update)
            if exit_code:
                break
            if update < sizes.num_updates:
                send_params(learner_policy_version)
    except KeyboardInterrupt:
        print("interrupted: stopping threads and flushing logs", file=sys.stderr)
        exit_code = 130
    except Stopped:
        exit_code = 1
    except Exception:
        run.record_failure()
    run.exit_if_stopped(exit_code, threads)
    return jax.device_get(first_replica(consensus(state.params))), learner_policy_version


class Board:
    """What the agents of --gossip async share besides their mailboxes: every agent's newest parameters
    and sampled gradients, and the number of updates made by all agents together."""

    def __init__(self, num_agents: int):
        self.params, self.grads = [None] * num_agents, [None] * num_agents
        self.updates, self.lock = 0, threading.Lock()

    def count_update(self) -> int:
        with self.lock:
            self.updates += 1
            return self.updates


def agent_learner(args, sizes, run, agent, device, state, board, mailboxes, param_queue, rollout_queue):
    """One agent of --gossip async: local A2C update, post to the out-peers' mailboxes, mix with the messages
    found in its own; agent 0 also measures the consensus of everybody's newest parameters."""
    n, k = args.num_agents, args.num_peers

    @jax.jit
    def local_update(state, data):
        data = jax.tree.map(lambda x: x[0], data)
        grads, metrics = jax.grad(a2c_loss, has_aux=True)(
            state.params, state.apply_fn, data, args.gamma, args.ent_coef, args.vf_coef
        )
        return state.apply_gradients(grads=grads), metrics, grads

    mix_on_device = jax.jit(mix)
    silent = {(agent - d) % n: 0 for d in range(1, k + 1)}
    queue_put(param_queue, (0, state.params), run.stop)
    for update in range(1, sizes.num_updates + 1):
        rollout = queue_get(rollout_queue, run.stop)
        check_lag(args, rollout, update, update - 1, 1)
        state, metrics, grads = local_update(state, rollout.data)
        for d in range(1, k + 1):
            mailboxes[(agent + d) % n].post(Message(agent, update, state.params))
        messages = receive(mailboxes[agent], silent, args.staleness_bound, run.stop)
        if messages:
            state = state.replace(
                params=mix_on_device(state.params, [jax.device_put(m.params, device) for m in messages])
            )
        board.params[agent] = state.params
        global_step = board.count_update() * sizes.batch_size // n
        scalars = {key: float(value) for key, value in metrics.items()}
        if messages:
            scalars["message_staleness"] = float(np.mean([update - m.version for m in messages]))
        scalars.update(messages_mixed=len(messages), messages_overwritten=mailboxes[agent].overwritten)
        if update % args.similarity_every == 0:
            board.grads[agent] = ravel_pytree(jax.device_get(grads))[0]
            peer_grads = board.grads[(agent + 1) % n]
            if peer_grads is not None:
                scalars["gradient_similarity"] = float(
                    np.dot(board.grads[agent], peer_grads)
                    / (np.linalg.norm(board.grads[agent]) * np.linalg.norm(peer_grads) + 1e-12)
                )
        log_agent(run, agent, global_step, update * sizes.batch_size // n, scalars)
        if agent == 0 and all(p is not None for p in board.params):
            group = host_consensus_stats([ravel_pytree(jax.device_get(p))[0] for p in board.params])
            run.log({f"stats/{key}": value for key, value in group.items()}, global_step)
            run.log({"charts/SPS": int(global_step / (time.time() - run.start_time))}, global_step)
            console(args, sizes, run, update, global_step, group)
        if update < sizes.num_updates:
            queue_put(param_queue, (update, state.params), run.stop)
    board.params[agent] = state.params
    for d in range(1, k + 1):
        mailboxes[(agent + d) % n].close(agent)


def host_consensus_stats(flat_params: list) -> dict:
    """consensus_stats for --gossip async, on host copies of the agents' newest parameters."""
    stacked = np.stack(flat_params)
    mean = stacked.mean(axis=0)
    distances = np.linalg.norm(stacked - mean, axis=1)
    return dict(
        consensus_distance=float(np.sqrt(np.mean(distances**2))),
        consensus_distance_max=float(distances.max()),
        consensus_share=float(distances.max() / np.linalg.norm(mean)),
        consensus_spread=float((stacked.max(axis=0) - stacked.min(axis=0)).max()),
    )


def train_async(args: Args, sizes: Sizes, network, state, run, agent_devices):
    """One learner thread per agent; the main thread waits for them (or a failure, or a signal)."""
    board, mailboxes = Board(args.num_agents), [Mailbox() for _ in range(args.num_agents)]
    param_queues, rollout_queues, threads = start_actors(args, sizes, run, network, 1, agent_devices)
    for agent, device in enumerate(agent_devices):
        agent_state = jax.device_put(jax.tree.map(operator.itemgetter(agent), state), device)
        kwargs = dict(args=args, sizes=sizes, run=run, agent=agent, device=device, state=agent_state, board=board)
        kwargs.update(mailboxes=mailboxes, param_queue=param_queues[agent], rollout_queue=rollout_queues[agent])
        threads.append(start_thread(agent_learner, f"agent-{agent}", run.stop, run.failures, **kwargs))
    exit_code = 0
    try:
        while any(t.is_alive() for t in threads[args.num_agents :]) and not run.stop.is_set():
            time.sleep(POLL_SECONDS)
            if run.received_signals:
                print("stopped by a signal; --gossip async runs keep no checkpoint", file=sys.stderr)
                exit_code = 128 + run.received_signals[0]
                break
    except KeyboardInterrupt:
        print("interrupted: stopping threads and flushing logs", file=sys.stderr)
        exit_code = 130
    run.exit_if_stopped(exit_code, threads)
    consensus = jax.tree.map(lambda *xs: np.mean(np.stack(xs), axis=0), *jax.device_get(board.params))
    return consensus, sizes.num_updates


def train(args: Args):
    sizes = sizes_of(args)
    local_agents = args.num_agents // jax.process_count()
    agent_devices = jax.local_devices()[:local_agents]
    global_devices = distributed.global_learner_devices(range(local_agents))
    network, state, counters = init_state(args, sizes)
    run = open_run(args, sizes, __file__, counters, global_devices)
    if args.gossip == "async":
        consensus, version = train_async(args, sizes, network, state, run, agent_devices)
    else:
        consensus, version = train_sync(args, sizes, network, state, run, agent_devices, global_devices)
    run.finish(consensus, version, evaluate)


def main(argv=None):
    args = parse_args(argv)
    distributed.join(args)
    validate_layout(args)
    train(args)


if __name__ == "__main__":
    main()
