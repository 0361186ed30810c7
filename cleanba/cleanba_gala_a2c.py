"""Cleanba GALA-A2C (Assran et al., 2019): n A2C actor-learners ("agents") gossiping over a directed
ring.

Every agent has its own environments, optimizer and parameters x_i. After each local update, agent i
sends x_i to its out-peers i+1 .. i+k and averages with the messages it holds: x_i <- (x_i + sum of
messages) / (1 + their number). The agents stay in a ball around their average x̄, which is saved.
`--gossip sync` (default): lock step, one `pmap` over the agents' devices; at update t agent i mixes
with its in-peers' parameters after update t-1 (a `lax.ppermute`), and the same seed gives the same
run. `--gossip async` (the paper's): a learner thread per agent, messages left in mailboxes without
waiting. `--topology allreduce`: A2C, gradients averaged over the agents; `none`: independent
agents. Each agent's actor thread keeps Cleanba's protocol (queues of size 1, lag 1)."""

import dataclasses
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cleanba_utils import distributed, parsing
from cleanba_utils.checkpoints import resume_from
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
    """name of the run folder under `runs/` (default: `{env_id}__{exp_name}__{seed}__{unix time}`)
    """
    group: str = ""
    """free-form label of the experiment this run belongs to, recorded in spec.json"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project_name: str = "cleanba"
    """the Weights & Biases project"""
    wandb_entity: str | None = None
    """the Weights & Biases entity (team)"""
    save_model: bool = False
    """save the consensus average of the agents' final parameters to
    `runs/{run_name}/{exp_name}.cleanba_model`"""
    eval_episodes: int = 0
    """after training, play this many episodes with the consensus average and log their returns"""
    log_frequency: int = 100
    """print a console line every this many updates"""
    env_id: str = "Breakout-v5"
    """the id of the envpool environment"""
    total_timesteps: int = 10_000_000
    """total environment steps (agent steps, not frames) of the run, all agents together"""
    learning_rate: float = 7e-4
    """RMSProp's learning rate, constant (decay 0.99, epsilon 1e-5 added to the root as in PyTorch).
    7e-4 is A2C's for a batch of 16 envs x 5 steps, each agent's batch here; the GALA authors' code
    runs 4 agents at 1.4e-3"""
    local_num_envs: int = 16
    """the number of environments of each agent"""
    envpool_num_threads: int | None = None
    """worker threads of each envpool instance (default: CPUs / agents); results do not depend on it
    """
    num_steps: int = 5
    """the number of steps each environment runs per rollout: the horizon of the bootstrapped returns
    """
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
    """dense layers after the ResNet (images), or hidden layers of each of the separate actor, critic
    MLPs (vectors)"""
    num_agents: int = 4
    """the number of actor-learners, each on its own device (CPU:
    XLA_FLAGS=--xla_force_host_platform_device_count)"""
    topology: Literal["gossip", "allreduce", "none"] = "gossip"
    """gossip over a directed ring, gradients averaged over all agents (A2C), or independent agents
    """
    gossip: Literal["sync", "async"] = "sync"
    """sync: lock step, peers' parameters one update old, reproducible; async: threads and mailboxes
    (the paper's)"""
    num_peers: int = 1
    """the out-peers of each agent: agent i sends to agents i+1 .. i+num_peers (mod num_agents)"""
    staleness_bound: int = 0
    """--gossip async: an agent that made this many updates without a message from an in-peer waits (0:
    never)"""
    similarity_every: int = 10
    """measure the cosine similarity of ring neighbours' gradients every this many updates (lock-step
    modes)"""
    concurrency: bool = True
    """let each actor collect the next rollout while its learner trains (policy lag 1 instead of 0)
    """
    distributed: bool = False
    """join a multi-process run with jax.distributed (--gossip sync and allreduce; agents split over
    processes)"""
    coordinator_address: str | None = None
    """host:port of process 0, for --distributed outside SLURM"""
    num_processes: int | None = None
    """the number of processes, for --distributed outside SLURM"""
    process_id: int | None = None
    """this process's index in 0 .. num_processes - 1, for --distributed outside SLURM"""
    checkpoint_every: int = 0
    """save a checkpoint of all agents every this many updates (0: only at the end and on SIGTERM /
    SIGUSR1)"""
    resume: bool = False
    """continue from the newest readable checkpoint of `runs/{run_name}` (start fresh if there is none)
    """


@dataclasses.dataclass(frozen=True)
class Sizes:
    num_envs: int
    batch_size: int
    num_updates: int


def sizes_of(args: Args) -> Sizes:
    num_envs = args.local_num_envs * args.num_agents
    return Sizes(
        num_envs, num_envs * args.num_steps, args.total_timesteps // (num_envs * args.num_steps)
    )


def parse_args(argv=None) -> Args:
    args = parsing.parse_args(Args, argv)
    validate(args)
    return args


def validate(args: Args):
    """Checks every argument that needs no device, before any other work; exits 2 on the first problem."""
    positive = "total_timesteps local_num_envs num_steps max_grad_norm log_frequency num_agents similarity_every"
    non_negative = "learning_rate ent_coef vf_coef eval_episodes checkpoint_every staleness_bound"
    parsing.check_signs(args, positive.split(), non_negative.split())
    parsing.check_in(args, "gamma", 0, 1, low_open=True)
    n, k = args.num_agents, args.num_peers
    if args.topology == "gossip" and not 1 <= k < n:
        parsing.fail(
            f"--topology gossip needs --num-agents >= 2, --num-peers in 1 .. agents - 1; got {n} and {k}"
        )
    one_process_without_checkpoints = args.distributed or args.checkpoint_every or args.resume
    if args.gossip == "async" and (args.topology != "gossip" or one_process_without_checkpoints):
        parsing.fail(
            "--gossip async needs --topology gossip, in one process: not with --distributed/--checkpoint-every/--resume"
        )
    if args.staleness_bound and args.gossip != "async":
        parsing.fail("--staleness-bound bounds asynchronous messages; use it with --gossip async")
    parsing.check_run_options(args)


def validate_layout(args: Args):
    """The checks that need the devices (and, with --distributed, the number of processes)."""
    sizes, num_processes, num_devices = (
        sizes_of(args),
        jax.process_count(),
        len(jax.local_devices()),
    )
    if args.num_agents % num_processes or num_devices < args.num_agents // num_processes:
        parsing.fail(
            f"--num-agents {args.num_agents} needs one device per agent in each of {num_processes} process(es), this "
            f"one has {num_devices}; on CPU run with XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{args.num_agents // num_processes}"
        )
    if sizes.num_updates < 1:
        parsing.fail(
            f"--total-timesteps {args.total_timesteps} is less than one update ({sizes.batch_size} steps)"
        )


def make_env(args: Args, seed: int, num_envs: int):
    """envpool seeds its environment i with `seed + i`; Atari follows Machado et al. (2018): sticky
    actions, the full action space, no life-loss signal, one no-op at reset at most, 108k frames per
    episode at most."""
    num_threads = args.envpool_num_threads or max(
        1, min(num_envs, len(os.sched_getaffinity(0)) // args.num_agents)
    )
    atari = dict(
        repeat_action_probability=0.25, full_action_space=True, episodic_life=False, noop_max=1
    )
    atari.update(max_episode_steps=27_000, reward_clip=True)
    options = (
        atari
        if "repeat_action_probability" in envpool.make_spec(args.env_id).config._fields
        else {}
    )
    return envpool.make(
        args.env_id, "gymnasium", num_envs=num_envs, seed=seed, num_threads=num_threads, **options
    )


class ConvSequence(nn.Module):
    """A convolution, a max pool and two residual blocks of two convolutions: a stack of the IMPALA
    ResNet."""

    channels: int

    @nn.compact
    def __call__(self, x):
        x = nn.max_pool(nn.Conv(self.channels, (3, 3))(x), (3, 3), strides=(2, 2), padding="SAME")
        for _ in range(2):
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
    """IMPALA ResNet torso shared by both heads for stacked frames (N, C, H, W); separate actor and
    critic MLPs for vector observations (N, D): through a shared torso, the critic's gradients swamp
    the policy's."""

    channels: tuple[int, ...]
    hiddens: tuple[int, ...]
    num_actions: int

    @nn.compact
    def __call__(self, obs):
        if obs.ndim != 4:
            x = obs.astype(jnp.float32)
            return mlp(x, self.hiddens, self.num_actions, 0.01), mlp(x, self.hiddens, 1, 1.0)[:, 0]
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
    """An actor's rollout for `update` by parameters `policy_version`: (1, envs, steps, ...) arrays on
    its device."""

    update: int
    policy_version: int
    data: dict
    param_queue_get_time: float


def actor(args, sizes, run, network, first_update, agent, device, param_queue, rollout_queue):
    """Agent `agent`'s actor thread: environments with global indices agent x local_num_envs + 0, 1,
    ..."""
    env_offset = agent * args.local_num_envs
    envs = make_env(args, args.seed + env_offset, args.local_num_envs)
    env_ids = jax.device_put(
        np.arange(env_offset, env_offset + args.local_num_envs, dtype=np.int32), device
    )
    action_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 1)
    get_action = jax.jit(
        lambda p, obs, step: sample_actions(network.apply(p, obs)[0], action_key, step, env_ids)
    )
    episodes = run.episodes(args.local_num_envs)
    next_obs, _ = envs.reset()
    # envpool resets an environment on the step after its episode ended: that step ignores the
    # action, returns the first observation of the next episode, and is masked out of learning.
    next_is_reset = np.zeros(args.local_num_envs, dtype=bool)
    for update in range(first_update, sizes.num_updates + 1):
        param_wait_start = time.time()
        if not (args.concurrency and update == first_update + 1):
            policy_version, params = queue_get(param_queue, run.stop)
        param_queue_get_time, steps = time.time() - param_wait_start, []
        for step in range(args.num_steps):
            policy_step = (update - 1) * args.num_steps + step
            action = np.asarray(get_action(params, jax.device_put(next_obs, device), policy_step))
            obs, reward, terminated, truncated, info = envs.step(action)
            played = dict(obs=next_obs, actions=action, is_reset=next_is_reset)
            steps.append(
                dict(played, rewards=reward, terminations=terminated, truncations=truncated)
            )
            done = terminated | truncated
            global_step = policy_step * sizes.num_envs
            for episode_return in episodes.step(
                info.get("reward", reward), done, next_is_reset, global_step
            ):
                run.log({f"charts/agent_{agent}/episodic_return": episode_return}, global_step)
            next_obs, next_is_reset = obs, done
        data = {key: np.stack([s[key] for s in steps], axis=1)[None] for key in steps[0]}
        data["bootstrap_obs"] = next_obs[None]
        rollout = Rollout(
            update, policy_version, jax.device_put(data, device), param_queue_get_time
        )
        queue_put(rollout_queue, rollout, run.stop)


def nstep_returns(rewards, next_values, terminations, truncations, gamma):
    """Bootstrapped returns of one environment's rollout: R_t = r_t + γ R_{t+1}, from the value after
    the last step; a termination stops bootstrapping, a truncation bootstraps from the value of its
    last observation. `next_values[t]`: the value after step t. (rlax.lambda_returns is the same,
    but importing it takes seconds.)"""

    def step(following, t):
        reward, next_value, terminated, truncated = t
        following = reward + gamma * (1.0 - terminated) * jnp.where(
            truncated > 0, next_value, following
        )
        return following, following

    inputs = (rewards, next_values, terminations, truncations)
    return jax.lax.scan(step, next_values[-1], inputs, reverse=True)[1]


def a2c_loss(params, apply_fn, data, args):
    """A2C on one agent's rollout (envs, steps, ...); means over its valid (non-reset) steps."""
    obs = jnp.concatenate([data["obs"], data["bootstrap_obs"][:, None]], axis=1)
    logits, values = apply_fn(params, obs.reshape(-1, *obs.shape[2:]))
    logits, values = logits.reshape(*obs.shape[:2], -1)[:, :-1], values.reshape(obs.shape[:2])
    f = {
        key: data[key].astype(jnp.float32)
        for key in ["rewards", "terminations", "truncations", "is_reset"]
    }
    inputs = (
        f["rewards"],
        jax.lax.stop_gradient(values[:, 1:]),
        f["terminations"],
        f["truncations"],
    )
    returns = jax.vmap(nstep_returns, (0, 0, 0, 0, None))(*inputs, args.gamma)
    values, log_probs = values[:, :-1], jax.nn.log_softmax(logits)
    logprob = jnp.take_along_axis(log_probs, data["actions"][..., None].astype(jnp.int32), axis=-1)[
        ..., 0
    ]
    valid = 1.0 - f["is_reset"]
    mean = lambda x: (x * valid).sum() / jnp.maximum(valid.sum(), 1.0)
    policy_loss = mean(-(returns - jax.lax.stop_gradient(values)) * logprob)
    value_loss, entropy = (
        mean(0.5 * (returns - values) ** 2),
        mean(-(jax.nn.softmax(logits) * log_probs).sum(-1)),
    )
    loss = policy_loss + args.vf_coef * value_loss - args.ent_coef * entropy
    return loss, dict(policy_loss=policy_loss, value_loss=value_loss, entropy=entropy)


def cosine(a, b):
    dot = lambda u, v: sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(v)))
    return dot(a, b) / (jnp.sqrt(dot(a, a) * dot(b, b)) + 1e-12)


def mix(params, messages: list):
    """x <- (x + sum of messages) / (1 + number of messages): the gossip step."""
    return jax.tree.map(lambda x, *ms: (x + sum(ms)) / (1 + len(ms)), params, *messages)


def consensus_stats(stacked):
    """Of the agents' stacked parameters: each one's distance ‖x_i - x̄‖, their RMS and maximum (the
    radius of the ε-ball around x̄) and its share of ‖x̄‖, and the largest difference of a parameter
    between agents (0: all the same)."""
    leaves = [x.reshape(x.shape[0], -1) for x in jax.tree.leaves(stacked)]
    squared = sum(jnp.sum((x - x.mean(0)) ** 2, axis=1) for x in leaves)
    mean_norm = jnp.sqrt(sum(jnp.sum(x.mean(0) ** 2) for x in leaves))
    distances, spread = (
        jnp.sqrt(squared),
        jnp.max(jnp.stack([jnp.max(x.max(0) - x.min(0)) for x in leaves])),
    )
    stats = dict(
        consensus_distances=distances,
        consensus_distance=jnp.sqrt(squared.mean()),
        consensus_spread=spread,
    )
    return dict(
        stats, consensus_distance_max=distances.max(), consensus_share=distances.max() / mean_norm
    )


def make_sync_update(args, agent_devices):
    """The lock-step update of every agent, pmap'd over their devices: an A2C step (gradients averaged
    for allreduce), the gossip with the in-peers' parameters of the last update (j sends to j + d),
    consensus, gradient similarity."""
    n = args.num_agents
    ring_shift = lambda tree, d: jax.lax.ppermute(
        tree, "agents", [(j, (j + d) % n) for j in range(n)]
    )

    def update(state, data, with_similarity):
        grads, metrics = jax.grad(a2c_loss, has_aux=True)(state.params, state.apply_fn, data, args)
        if with_similarity:
            metrics["gradient_similarity"] = jax.lax.pmean(
                cosine(grads, ring_shift(grads, 1)), "agents"
            )
        if args.topology == "allreduce":
            grads = jax.lax.pmean(grads, "agents")
        peers = [
            ring_shift(state.params, d)
            for d in range(1, args.num_peers + 1)
            if args.topology == "gossip"
        ]
        state = state.apply_gradients(grads=grads)
        if args.topology == "gossip":
            state = state.replace(params=mix(state.params, peers))
        metrics = jax.lax.pmean(metrics, "agents")
        return state, dict(metrics, **consensus_stats(jax.lax.all_gather(state.params, "agents")))

    return jax.pmap(update, axis_name="agents", devices=agent_devices, static_broadcasted_argnums=2)


class Message(NamedTuple):
    sender: int
    version: int  # the sender's update count when it sent the message
    params: dict


class Mailbox:
    """An agent's incoming messages in --gossip async: one slot per in-peer, written without waiting. A
    message from a peer whose previous one is unread overwrites it (counted), so the receiver mixes
    with the newest parameters sent to it; the GALA authors' code drops the new message instead,
    leaving older ones to mix with."""

    def __init__(self):
        self.slots, self.finished, self.overwritten, self.condition = (
            {},
            set(),
            0,
            threading.Condition(),
        )

    def post(self, message: Message):
        with self.condition:
            self.overwritten += message.sender in self.slots
            self.slots[message.sender] = message
            self.condition.notify_all()

    def close(self, sender: int):  # the sender made its last update: nobody waits for it any more
        with self.condition:
            self.finished.add(sender)
            self.condition.notify_all()

    def take(self, wait_for: list, stop: threading.Event) -> list:
        """Every unread message, by sender; first waits until each running sender in `wait_for` has
        left one."""
        with self.condition:
            while any(s not in self.slots and s not in self.finished for s in wait_for):
                if stop.is_set():
                    raise Stopped
                self.condition.wait(POLL_SECONDS)
            return [self.slots.pop(sender) for sender in sorted(self.slots)]


def receive(mailbox: Mailbox, silent: dict, staleness_bound: int, stop: threading.Event) -> list:
    """After a local update: the messages to mix with. `silent[j]` counts the local updates since the
    last message from in-peer j; with a bound τ > 0, the agent waits only for the in-peers silent
    for τ updates."""
    for sender in silent:
        silent[sender] += 1
    wait_for = [
        sender for sender, count in silent.items() if staleness_bound and count >= staleness_bound
    ]
    messages = mailbox.take(wait_for, stop)
    for message in messages:
        silent[message.sender] = 0
    return messages


def evaluate(params, args: Args, num_episodes: int, seed: int) -> list[float]:
    """Plays one episode in each of `num_episodes` fresh environments with the sampled policy."""
    envs = make_env(args, seed, num_episodes)
    network = Network(args.channels, args.hiddens, envs.action_space.n)
    env_ids = jnp.arange(num_episodes)
    act = jax.jit(
        lambda p, o, step: sample_actions(
            network.apply(p, o)[0], jax.random.PRNGKey(seed), step, env_ids
        )
    )
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
    """The network, every agent's state stacked on a leading axis (host arrays) and the counters, fresh
    or from the newest checkpoint (--resume). Agents start from different initializations, except
    allreduce's (one policy)."""
    probe_env = make_env(args, args.seed, 1)
    network, obs = (
        Network(args.channels, args.hiddens, probe_env.action_space.n),
        probe_env.reset()[0],
    )
    rmsprop = optax.rmsprop(args.learning_rate, decay=0.99, eps=1e-5, eps_in_sqrt=False)
    optimizer = optax.chain(optax.clip_by_global_norm(args.max_grad_norm), rmsprop)
    init_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 0)
    keys = [
        jax.random.fold_in(init_key, 0 if args.topology == "allreduce" else i)
        for i in range(args.num_agents)
    ]
    states = [
        TrainState.create(apply_fn=network.apply, params=network.init(k, obs), tx=optimizer)
        for k in keys
    ]
    state = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *states)
    identity = dict(
        sizes=dataclasses.asdict(sizes),
        seed=args.seed,
        topology=args.topology,
        num_peers=args.num_peers,
    )
    checkpoint = resume_from(run_dir_of(args), state, identity) if args.resume else None
    state, counters = checkpoint or (state, dict(update=0, wall_time_s=0.0))
    return network, state, dict(counters, **identity)


def start_actors(args, sizes, run, network, agent_devices, first_update: int = 1):
    """One param queue, one rollout queue and one actor thread per local agent."""
    new_queues = lambda: [queue.Queue(maxsize=1) for _ in agent_devices]
    param_queues, rollout_queues, threads = new_queues(), new_queues(), []
    for index, (device, param_queue, rollout_queue) in enumerate(
        zip(agent_devices, param_queues, rollout_queues)
    ):
        agent = jax.process_index() * len(agent_devices) + index
        kwargs = dict(
            args=args, sizes=sizes, run=run, network=network, first_update=first_update, agent=agent
        )
        kwargs.update(device=device, param_queue=param_queue, rollout_queue=rollout_queue)
        threads.append(start_thread(actor, f"actor-{agent}", run.stop, run.failures, **kwargs))
    return param_queues, rollout_queues, threads


def check_lag(
    args, rollout: Rollout, update: int, learner_policy_version: int, first_update: int = 1
):
    """The Cleanba protocol: an agent trains on data exactly one policy version old with --concurrency."""
    expected_lag, lag = (
        int(args.concurrency and update > first_update),
        learner_policy_version - rollout.policy_version,
    )
    if rollout.update != update or lag != expected_lag:
        raise RuntimeError(
            f"update {update}: rollout {rollout.update} from policy {rollout.policy_version} while the learner is "
            f"at {learner_policy_version} (lag {lag}, expected {expected_lag})"
        )


def log_update(args, sizes, run, global_step: int, stats: dict, agent_scalars: dict, console: bool):
    """TensorBoard: the group's `stats`, `agent_scalars[agent]` and SPS per agent; with `console`, a
    console line."""
    elapsed = time.time() - run.start_time
    sps = int((global_step - run.counters["update"] * sizes.batch_size) / elapsed)
    losses = ["policy_loss", "value_loss", "entropy"]
    run.log(
        {f"{'losses' if key in losses else 'stats'}/{key}": value for key, value in stats.items()},
        global_step,
    )
    run.log({"charts/SPS": sps}, global_step)
    for agent, scalars in agent_scalars.items():
        run.log(
            {f"stats/agent_{agent}/{key}": value for key, value in scalars.items()}, global_step
        )
        run.log({f"charts/agent_{agent}/SPS": int(scalars["steps"] / elapsed)}, global_step)
    if console:
        mean_return = f"{np.mean(run.recent_returns):.1f}" if run.recent_returns else "n/a"
        line = f"update {global_step // sizes.batch_size}/{sizes.num_updates} step={global_step} SPS={sps} "
        line += f"return={mean_return} consensus distance={stats['consensus_distance_max']:.3g} "
        print(line + f"share={stats['consensus_share']:.3g}", flush=True)


def train_sync(args: Args, sizes: Sizes, network, state, run, agent_devices, global_devices):
    """All agents in lock step, one pmap'd update over their devices. Returns the consensus average,
    the version."""
    sharding = NamedSharding(Mesh(np.array(global_devices), ("agents",)), PartitionSpec("agents"))
    state = jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, sharding, lambda index: x[index]), state
    )
    gather = lambda tree: multihost_utils.process_allgather(
        tree, tiled=True
    )  # all agents', from every process
    update_fn, run.host_copy = make_sync_update(args, global_devices), gather
    start = version = run.counters["update"]
    param_queues, rollout_queues, threads = start_actors(
        args, sizes, run, network, agent_devices, start + 1
    )
    # An actor's parameters: the slice of the pmap'd ones on its agent's device, without a copy.
    on_device = lambda x, device: next(
        shard.data[0] for shard in x.addressable_shards if shard.device == device
    )
    params_on = lambda device: jax.tree.map(lambda x: on_device(x, device), state.params)
    to_global = lambda *xs: jax.make_array_from_single_device_arrays(
        (args.num_agents, *xs[0].shape[1:]), sharding, xs
    )

    def loop() -> int:
        nonlocal state, version
        for update in range(start + 1, sizes.num_updates + 1):
            for q, device in zip(param_queues, agent_devices):
                queue_put(q, (version, params_on(device)), run.stop)
            wait_start = time.time()
            rollouts = [queue_get(q, run.stop) for q in rollout_queues]
            rollout_queue_get_time, learn_start = time.time() - wait_start, time.time()
            for rollout in rollouts:
                check_lag(args, rollout, update, version, start + 1)
            data = jax.tree.map(to_global, *[r.data for r in rollouts])
            state, metrics = update_fn(state, data, update % args.similarity_every == 0)
            stats = dict(
                jax.device_get(first_replica(metrics)), learn_time=time.time() - learn_start
            )
            version += 1
            stats.update(
                rollout_queue_get_time=rollout_queue_get_time, learner_policy_version=version
            )
            stats.update(param_queue_get_time=np.mean([r.param_queue_get_time for r in rollouts]))
            stats.update(actor_policy_version=rollouts[0].policy_version)
            steps, distances = (
                (update - start) * sizes.batch_size // args.num_agents,
                stats.pop("consensus_distances"),
            )
            agent_scalars = {
                agent: dict(consensus_distance=d, steps=steps) for agent, d in enumerate(distances)
            }
            console = update % args.log_frequency == 0 or update == sizes.num_updates
            log_update(args, sizes, run, update * sizes.batch_size, stats, agent_scalars, console)
            exit_code = run.after_update(state, update)
            if exit_code:
                return exit_code
        return 0

    run.exit_if_stopped(run.run_learner(loop), threads)
    return jax.tree.map(lambda x: x.mean(0), gather(state.params)), version


def agent_learner(
    args, sizes, run, agent, device, state, shared, mailboxes, param_queue, rollout_queue
):
    """An agent of --gossip async: A2C update, post to the out-peers' mailboxes, mix with the messages
    in its own. `shared`: every agent's newest parameters and update count, and the agents that made
    their first update."""
    n, k = args.num_agents, args.num_peers
    silent, mix_on_device = {(agent - d) % n: 0 for d in range(1, k + 1)}, jax.jit(mix)

    @jax.jit
    def local_update(state, data):
        data = jax.tree.map(lambda x: x[0], data)
        grads, metrics = jax.grad(a2c_loss, has_aux=True)(state.params, state.apply_fn, data, args)
        return state.apply_gradients(grads=grads), metrics

    for update in range(1, sizes.num_updates + 1):
        queue_put(param_queue, (update - 1, state.params), run.stop)
        rollout = queue_get(rollout_queue, run.stop)
        check_lag(args, rollout, update, update - 1)
        state, metrics = local_update(state, rollout.data)
        shared["started"] += [agent] if update == 1 else []
        while (
            len(shared["started"]) < n
        ):  # the agents start together, whatever they took to compile
            if run.stop.is_set():
                raise Stopped
            time.sleep(POLL_SECONDS / 10)
        for d in range(1, k + 1):
            mailboxes[(agent + d) % n].post(Message(agent, update, state.params))
        messages = receive(mailboxes[agent], silent, args.staleness_bound, run.stop)
        if messages:
            peers = [jax.device_put(m.params, device) for m in messages]
            state = state.replace(params=mix_on_device(state.params, peers))
        shared["params"][agent], shared["updates"][agent] = state.params, update
        global_step = sum(shared["updates"]) * sizes.batch_size // n
        scalars = dict(metrics, steps=update * sizes.batch_size // n, messages_mixed=len(messages))
        scalars.update(messages_overwritten=mailboxes[agent].overwritten)
        if messages:
            scalars["message_staleness"] = np.mean([update - m.version for m in messages])
        log_update(
            args, sizes, run, global_step, {}, {agent: jax.device_get(scalars)}, console=False
        )
    for d in range(1, k + 1):
        mailboxes[(agent + d) % n].close(agent)


def train_async(args: Args, sizes: Sizes, network, state, run, agent_devices, global_devices):
    """A learner thread per agent; the main thread measures the consensus after every n updates of all
    agents."""
    shared = dict(params=[None] * args.num_agents, updates=[0] * args.num_agents, started=[])
    mailboxes = [Mailbox() for _ in range(args.num_agents)]
    param_queues, rollout_queues, threads = start_actors(args, sizes, run, network, agent_devices)
    for agent, device in enumerate(agent_devices):
        agent_state = jax.device_put(jax.tree.map(operator.itemgetter(agent), state), device)
        shared["params"][agent] = agent_state.params
        kwargs = dict(
            args=args,
            sizes=sizes,
            run=run,
            agent=agent,
            device=device,
            state=agent_state,
            shared=shared,
        )
        kwargs.update(
            mailboxes=mailboxes,
            param_queue=param_queues[agent],
            rollout_queue=rollout_queues[agent],
        )
        threads.append(
            start_thread(agent_learner, f"agent-{agent}", run.stop, run.failures, **kwargs)
        )

    def loop() -> int:
        measured, per_line = 0, args.num_agents * args.log_frequency
        while not run.stop.is_set() and not run.received_signals:
            running, updates = (
                any(t.is_alive() for t in threads[args.num_agents :]),
                sum(shared["updates"]),
            )
            if updates >= measured + args.num_agents or not running:
                params, counts = (
                    list(shared["params"]),
                    list(shared["updates"]),
                )  # together: the agents go on
                stats = jax.device_get(
                    consensus_stats(jax.tree.map(lambda *xs: np.stack(xs), *jax.device_get(params)))
                )
                steps = [u * sizes.batch_size // args.num_agents for u in counts]
                distances = enumerate(zip(stats.pop("consensus_distances"), steps))
                agent_scalars = {a: dict(consensus_distance=d, steps=s) for a, (d, s) in distances}
                console = updates // per_line > measured // per_line or not running
                log_update(args, sizes, run, sum(steps), stats, agent_scalars, console)
                measured = updates
            if not running:
                return 0
            time.sleep(POLL_SECONDS / 10)
        if run.received_signals:
            print("stopped by a signal; --gossip async runs keep no checkpoint", file=sys.stderr)
            return 128 + run.received_signals[0]
        return 0

    run.exit_if_stopped(run.run_learner(loop), threads)
    return jax.tree.map(
        lambda *xs: np.mean(xs, axis=0), *jax.device_get(shared["params"])
    ), sizes.num_updates


def train(args: Args):
    sizes, local_agents = sizes_of(args), args.num_agents // jax.process_count()
    agent_devices = jax.local_devices()[:local_agents]
    global_devices = distributed.global_learner_devices(range(local_agents))
    network, state, counters = init_state(args, sizes)
    run = open_run(args, sizes, __file__, counters, global_devices)
    train_agents = train_async if args.gossip == "async" else train_sync
    consensus, version = train_agents(
        args, sizes, network, state, run, agent_devices, global_devices
    )
    run.finish(consensus, version, evaluate)


def main(argv=None):
    args = parse_args(argv)
    distributed.join(args)
    validate_layout(args)
    train(args)


if __name__ == "__main__":
    main()
