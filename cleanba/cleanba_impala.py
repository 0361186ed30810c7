"""Cleanba IMPALA: actor threads collect rollouts with envpool, a pmap'd learner trains on them with V-trace.

Each actor thread owns one `param_queue` and one `rollout_queue` (both maxsize 1). With
`--concurrency` (the default, "Cleanba IMPALA"), the actor skips `param_queue.get()` on its second
iteration, so the learner always trains on data from the policy exactly one version behind; with
`--no-concurrency` ("IMPALA (Sync)") actor and learner take turns and the lag is zero. V-trace
corrects for the difference between the behaviour policy and the policy being trained.
"""

import contextlib
import dataclasses
import glob
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from typing import Optional

import envpool
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import rlax
import tyro
from flax.training.train_state import TrainState
from jax._src import distributed
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tensorboardX import SummaryWriter


@dataclasses.dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment: environments, action sampling, initialization and minibatch order"""
    run_name: Optional[str] = None
    """name of the run folder under `runs/` (default: `{env_id}__{exp_name}__{seed}__{unix time}`)"""
    group: str = ""
    """free-form label of the experiment this run belongs to, recorded in spec.json"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project_name: str = "cleanba"
    """the Weights & Biases project"""
    wandb_entity: Optional[str] = None
    """the Weights & Biases entity (team)"""
    save_model: bool = False
    """save the final parameters to `runs/{run_name}/{exp_name}.cleanba_model`"""
    eval_episodes: int = 0
    """after training, play this many episodes with the final policy and log their returns"""
    log_frequency: int = 10
    """print and log losses every this many updates"""

    env_id: str = "Breakout-v5"
    """the id of the envpool environment"""
    total_timesteps: int = 50_000_000
    """total environment steps (agent steps, not frames) of the run"""
    learning_rate: float = 6e-4
    """the learning rate of the optimizer"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
    local_num_envs: int = 64
    """the number of environments of each actor thread"""
    num_actor_threads: int = 2
    """the number of actor threads per actor device"""
    envpool_num_threads: Optional[int] = None
    """worker threads of each envpool instance (default: CPUs / actor threads); results do not depend on it"""
    num_steps: int = 20
    """the number of steps each environment runs per rollout"""
    gamma: float = 0.99
    """the discount factor"""
    vtrace_lambda: float = 1.0
    """the lambda of V-trace: trace coefficients are c = lambda * min(1, rho) (rlax fixes c bar at 1)"""
    clip_rho_threshold: float = 1.0
    """the clip of the importance ratios in the V-trace targets (rho bar)"""
    clip_pg_rho_threshold: float = 1.0
    """the clip of the importance ratios in the policy-gradient advantages"""
    num_minibatches: int = 4
    """the number of gradient steps per rollout, each on a subset of whole environment sequences"""
    ent_coef: float = 0.01
    """the entropy coefficient"""
    vf_coef: float = 0.5
    """the value function coefficient"""
    max_grad_norm: float = 40.0
    """the maximum global norm of the gradient"""
    channels: tuple[int, ...] = (16, 32, 32)
    """the channels of the IMPALA ResNet stacks (image observations)"""
    hiddens: tuple[int, ...] = (256,)
    """the sizes of the dense layers after the torso"""

    actor_device_ids: tuple[int, ...] = (0,)
    """the local device ids that run actor threads"""
    learner_device_ids: tuple[int, ...] = (0,)
    """the local device ids the learner update is pmap'd over"""
    concurrency: bool = True
    """let actors collect the next rollout while the learner trains (policy lag 1 instead of 0)"""
    distributed: bool = False
    """join a multi-process run with jax.distributed (configured by SLURM or the three options below)"""
    coordinator_address: Optional[str] = None
    """host:port of process 0, for --distributed outside SLURM"""
    num_processes: Optional[int] = None
    """the number of processes, for --distributed outside SLURM"""
    process_id: Optional[int] = None
    """this process's index in 0 .. num_processes - 1, for --distributed outside SLURM"""
    checkpoint_every: int = 0
    """save a checkpoint every this many updates (0: only at the end and on SIGTERM / SIGUSR1)"""
    resume: bool = False
    """continue from the newest readable checkpoint of `runs/{run_name}` (start fresh if there is none)"""


@dataclasses.dataclass(frozen=True)
class Sizes:
    num_envs: int
    batch_size: int
    minibatch_size: int
    num_updates: int


def sizes_of(args: Args, num_processes: int) -> Sizes:
    num_envs = args.local_num_envs * args.num_actor_threads * len(args.actor_device_ids) * num_processes
    batch_size = num_envs * args.num_steps
    return Sizes(num_envs, batch_size, batch_size // args.num_minibatches, args.total_timesteps // batch_size)


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv=None) -> Args:
    """tyro's parser, with its multi-line error box reduced to one line."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = tyro.cli(Args, args=argv)
    except SystemExit as exit_:
        if exit_.code:
            lines = [line.strip(" │╭╮╰╯─-") for line in captured.getvalue().splitlines()]
            lines = [line for line in lines if line]
            fail(f"{lines[1] if len(lines) > 1 else 'invalid arguments'} (see --help)")
        print(captured.getvalue(), end="")
        raise
    validate(args)
    return args


def validate(args: Args):
    """Checks every argument that needs no device, before any other work; exits 2 on the first problem."""
    distributed_options = [args.coordinator_address, args.num_processes, args.process_id]
    if any(o is not None for o in distributed_options) and not (args.distributed and all(
            o is not None for o in distributed_options)):
        fail("--coordinator-address, --num-processes and --process-id go together, with --distributed")
    if args.num_processes is not None and not 0 <= args.process_id < args.num_processes:
        fail(f"--process-id must be in 0 .. {args.num_processes - 1} (--num-processes), got {args.process_id}")
    if args.resume and args.run_name is None:
        fail("--resume needs --run-name: the run folder whose checkpoints to continue from")
    positive = ["total_timesteps", "learning_rate", "local_num_envs", "num_actor_threads", "num_steps",
                "num_minibatches", "clip_rho_threshold", "clip_pg_rho_threshold", "max_grad_norm", "log_frequency"]
    for name in positive:
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ["ent_coef", "vf_coef", "eval_episodes", "checkpoint_every"]:
        if getattr(args, name) < 0:
            fail(f"--{name.replace('_', '-')} must be non-negative, got {getattr(args, name)}")
    if not 0 < args.gamma <= 1:
        fail(f"--gamma must be in (0, 1], got {args.gamma}")
    if not 0 <= args.vtrace_lambda <= 1:
        fail(f"--vtrace-lambda must be in [0, 1], got {args.vtrace_lambda}")
    if args.envpool_num_threads is not None and args.envpool_num_threads <= 0:
        fail(f"--envpool-num-threads must be positive, got {args.envpool_num_threads}")
    if not args.channels and not args.hiddens:
        fail("--channels and --hiddens are both empty; give the network at least one layer")
    if any(c <= 0 for c in args.channels + args.hiddens):
        fail("--channels and --hiddens take positive layer sizes")
    if args.env_id not in envpool.list_all_envs():
        fail(f"--env-id {args.env_id} is not an envpool environment; try Breakout-v5 or CartPole-v1")


def validate_layout(args: Args):
    """The checks that need the devices (and, with --distributed, the number of processes), before any
    environment or device work."""
    num_devices = len(jax.local_devices())
    for name in ["actor_device_ids", "learner_device_ids"]:
        ids = getattr(args, name)
        if not ids or len(set(ids)) != len(ids) or not all(0 <= i < num_devices for i in ids):
            fail(f"--{name.replace('_', '-')} must list distinct ids among the {num_devices} local devices "
                 f"(0..{num_devices - 1}), got {list(ids)}")
    if args.local_num_envs % len(args.learner_device_ids):
        fail(f"--local-num-envs {args.local_num_envs} must be divisible by the number of learner devices "
             f"({len(args.learner_device_ids)}): each learner device takes an equal share of every rollout")
    if (args.local_num_envs // len(args.learner_device_ids)) % args.num_minibatches:
        fail(f"--local-num-envs {args.local_num_envs} over {len(args.learner_device_ids)} learner device(s) gives "
             f"{args.local_num_envs // len(args.learner_device_ids)} envs per device, not divisible by "
             f"--num-minibatches {args.num_minibatches}: every device puts equally many envs in each minibatch")
    sizes = sizes_of(args, jax.process_count())
    if sizes.num_updates < 1:
        fail(f"--total-timesteps {args.total_timesteps} is less than one rollout ({sizes.batch_size} steps = "
             "num envs x num steps); raise it or shrink --local-num-envs / --num-steps")


def is_atari(env_id: str) -> bool:
    return "repeat_action_probability" in envpool.make_spec(env_id).config._fields


def make_env(args: Args, seed: int, num_envs: int):
    """envpool seeds its environment i with `seed + i`; Atari follows Machado et al. (2018)."""
    atari = dict(episodic_life=False, reward_clip=True, repeat_action_probability=0.25,
                 full_action_space=True, noop_max=1, max_episode_steps=27_000)
    return envpool.make(
        args.env_id,
        env_type="gymnasium",
        num_envs=num_envs,
        seed=seed,
        # sched_getaffinity counts the CPUs this process may use (a SLURM allocation), not the node's.
        num_threads=args.envpool_num_threads or max(1, min(num_envs, len(os.sched_getaffinity(0)) // (
            args.num_actor_threads * len(args.actor_device_ids)))),
        **(atari if is_atari(args.env_id) else {}),
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


class Network(nn.Module):
    """IMPALA ResNet for stacked frames (N, C, H, W); an MLP for vector observations (N, D)."""

    channels: tuple[int, ...]
    hiddens: tuple[int, ...]
    num_actions: int

    @nn.compact
    def __call__(self, obs):
        if obs.ndim == 4:
            x = jnp.transpose(obs, (0, 2, 3, 1)).astype(jnp.float32) / 255.0
            for channels in self.channels:
                x = ConvSequence(channels)(x)
            x = nn.relu(x).reshape(x.shape[0], -1)
        else:
            x = obs.astype(jnp.float32)
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


def queue_get(q: queue.Queue, stop: threading.Event):
    """A get that gives up when another thread has failed, so that no thread stays blocked."""
    while True:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            if stop.is_set():
                raise SystemExit(1)


def queue_put(q: queue.Queue, item, stop: threading.Event):
    while True:
        try:
            return q.put(item, timeout=0.2)
        except queue.Full:
            if stop.is_set():
                raise SystemExit(1)


def rollout(args, sizes, network, first_update, env_offset, actor_device, learner_devices,
            param_queue, rollout_queue, writer, stop, recent_returns):
    """One actor thread: environments with global indices env_offset .. env_offset + local_num_envs - 1."""
    envs = make_env(args, args.seed + env_offset, args.local_num_envs)
    env_ids = np.arange(env_offset, env_offset + args.local_num_envs, dtype=np.int32)
    env_ids_on_device = jax.device_put(env_ids, actor_device)
    action_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 1)
    learner_sharding = NamedSharding(Mesh(np.array(learner_devices), ("devices",)), PartitionSpec("devices"))

    @jax.jit
    def get_action(params, obs, step):
        logits, _ = network.apply(params, obs)
        action = sample_actions(logits, action_key, step, env_ids_on_device)
        logprob = jax.nn.log_softmax(logits)[jnp.arange(action.shape[0]), action]
        return action, logprob

    next_obs, _ = envs.reset()
    # envpool resets an environment on the step after its episode ended: that step ignores the action,
    # returns the first observation of the next episode, and is masked out of learning.
    next_is_reset = np.zeros(args.local_num_envs, dtype=bool)
    episode_return = np.zeros(args.local_num_envs)
    episode_length = np.zeros(args.local_num_envs, dtype=np.int64)
    for iteration in range(first_update, sizes.num_updates + 1):
        param_wait_start = time.time()
        if not (args.concurrency and iteration == first_update + 1):
            actor_policy_version, params = queue_get(param_queue, stop)
        param_queue_get_time = time.time() - param_wait_start

        rollout_start = time.time()
        inference_time = env_step_time = 0.0
        storage = {k: [] for k in ["obs", "actions", "logprobs", "rewards",
                                   "terminations", "truncations", "is_reset"]}
        for step in range(args.num_steps):
            global_step = (iteration - 1) * sizes.batch_size + step * sizes.num_envs
            tic = time.time()
            obs_on_device = jax.device_put(next_obs, actor_device)
            action, logprob = jax.device_get(
                get_action(params, obs_on_device, (iteration - 1) * args.num_steps + step))
            inference_time += time.time() - tic
            tic = time.time()
            obs, reward, terminated, truncated, info = envs.step(action)
            env_step_time += time.time() - tic
            for key, x in zip(storage, [next_obs, action, logprob, reward, terminated, truncated, next_is_reset]):
                storage[key].append(x)

            playing = ~next_is_reset
            episode_return += info.get("reward", reward) * playing
            episode_length += playing
            done = terminated | truncated
            for i in np.flatnonzero(done):
                writer.add_scalar("charts/episodic_return", episode_return[i], global_step)
                writer.add_scalar("charts/episodic_length", episode_length[i], global_step)
                recent_returns.append(episode_return[i])
            episode_return[done] = 0.0
            episode_length[done] = 0
            next_obs, next_is_reset = obs, done

        # The learner evaluates every observation with its current parameters, the last one included.
        storage["obs"].append(next_obs)
        # Env-major (envs, steps, ...) split into one slice of envs per learner device: a single
        # host-to-device copy of the whole rollout, overlapped with the learner's work.
        data = {k: np.stack(v, axis=1) for k, v in storage.items()}
        data["env_ids"] = env_ids
        data = {k: v.reshape(len(learner_devices), -1, *v.shape[1:]) for k, v in data.items()}
        data = jax.device_put(data, learner_sharding)
        timing = dict(param_queue_get_time=param_queue_get_time, rollout_time=time.time() - rollout_start,
                      inference_time=inference_time, env_step_time=env_step_time)
        queue_put(rollout_queue, (iteration, actor_policy_version, data, timing), stop)


def vtrace(values, rewards, terminations, truncations, log_rhos, gamma, vtrace_lambda, clip_rho, clip_pg_rho):
    """V-trace targets and policy-gradient advantages of one environment's rollout; values has one more
    entry (the last observation) and log_rhos are log pi(a|x) - log mu(a|x) of the actions taken.

    A termination stops bootstrapping; a truncation bootstraps from the last observation's value
    but, like a termination, cuts the trace so that no correction flows across episodes."""
    discount = gamma * (1.0 - terminations)
    trace = vtrace_lambda * (1.0 - jnp.maximum(terminations, truncations))
    out = rlax.vtrace_td_error_and_advantage(values[:-1], values[1:], rewards, discount, jnp.exp(log_rhos), trace,
                                             clip_rho, clip_pg_rho)
    return out.errors + values[:-1], out.pg_advantage


def impala_loss(params, apply_fn, mb, count, args):
    """Sums of per-sample losses over this device's valid samples, divided by the global count.

    The current parameters evaluate all T + 1 observations of each environment, so V-trace corrects
    for the actor's policy having been older than the one being trained."""
    obs = mb["obs"].reshape(-1, *mb["obs"].shape[2:])
    logits, values = apply_fn(params, obs)
    logits, values = logits.reshape(*mb["obs"].shape[:2], -1), values.reshape(mb["obs"].shape[:2])
    log_probs = jax.nn.log_softmax(logits[:, :-1])
    logprob = jnp.take_along_axis(log_probs, mb["actions"][..., None].astype(jnp.int32), axis=-1)[..., 0]
    logratio = logprob - mb["logprobs"]
    per_env = jax.vmap(lambda *xs: vtrace(*xs, args.gamma, args.vtrace_lambda, args.clip_rho_threshold,
                                          args.clip_pg_rho_threshold))
    targets, pg_advantages = jax.lax.stop_gradient(
        per_env(values, mb["rewards"], mb["terminations"], mb["truncations"], logratio))
    pg_loss = -pg_advantages * logprob
    baseline_loss = 0.5 * (targets - values[:, :-1]) ** 2
    entropy = -(jax.nn.softmax(logits[:, :-1]) * log_probs).sum(-1)
    mean = lambda x: (x * mb["valid"]).sum() / count
    loss = mean(pg_loss) + args.vf_coef * mean(baseline_loss) - args.ent_coef * mean(entropy)
    metrics = dict(pg_loss=mean(pg_loss), baseline_loss=mean(baseline_loss), entropy=mean(entropy),
                   approx_kl=mean(jnp.exp(logratio) - 1 - logratio))
    return loss, metrics


def minibatch_ids(key, env_ids, num_minibatches):
    """Environment g goes to minibatch perm[g % M] of its block of M = num_minibatches consecutive
    indices, perm being a random permutation keyed by the block: the global index alone decides, and
    a device that holds whole blocks has equally many environments in every minibatch."""
    block_permutation = lambda g: jax.random.permutation(jax.random.fold_in(key, g // num_minibatches),
                                                         num_minibatches)
    return jax.vmap(lambda g: block_permutation(g)[g % num_minibatches])(env_ids)


def make_update(args, learner_devices):
    """The learner update, pmap'd over the learner devices: one pass over the rollout in
    `num_minibatches` gradient steps, each on whole environment sequences.

    Layout invariance: minibatch membership depends only on global env indices (`minibatch_ids`),
    and every mean is a global one (psum of sums over psum of counts), so the number of learner
    devices changes the result only by float rounding."""
    learner_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 2)
    # XLA's CPU backend runs convolutions inside a loop about 18x slower than unrolled ones (measured:
    # 7 vs 135 forward-backward observations per second); elsewhere the loop keeps compilation short.
    unroll = learner_devices[0].platform == "cpu"

    def minibatch_step(state, mb):
        count = jnp.maximum(jax.lax.psum(mb["valid"].sum(), "devices"), 1.0)
        grads, metrics = jax.grad(impala_loss, has_aux=True)(state.params, state.apply_fn, mb, count, args)
        # Each device's loss is its share of the global mean, so the global gradient is their sum.
        grads, metrics = jax.lax.psum((grads, metrics), "devices")
        return state.apply_gradients(grads=grads), metrics

    def update(state, rollouts, update_index):
        data = jax.tree.map(lambda *xs: jnp.concatenate(xs), *rollouts)
        fields = dict(obs=data["obs"], actions=data["actions"], logprobs=data["logprobs"], rewards=data["rewards"],
                      terminations=data["terminations"].astype(jnp.float32),
                      truncations=data["truncations"].astype(jnp.float32),
                      valid=1.0 - data["is_reset"].astype(jnp.float32))
        ids = minibatch_ids(jax.random.fold_in(learner_key, update_index), data["env_ids"], args.num_minibatches)
        order = jnp.argsort(ids, stable=True)
        minibatches = jax.tree.map(lambda x: x[order].reshape(args.num_minibatches, -1, *x.shape[1:]), fields)
        state, metrics = jax.lax.scan(minibatch_step, state, minibatches, unroll=unroll)
        return state, jax.tree.map(jnp.mean, metrics)

    return jax.pmap(update, axis_name="devices", devices=learner_devices, in_axes=(0, 0, None))


def learning_rate_at(args: Args, sizes: Sizes, update: int) -> float:
    """Constant within an update, linearly down to zero over the run."""
    return args.learning_rate * (1.0 - (update - 1) / sizes.num_updates) if args.anneal_lr else args.learning_rate


def first_replica(tree):
    return jax.tree.map(lambda x: x.addressable_shards[0].data[0], tree)


def params_fingerprint(params) -> str:
    digest = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(params):
        digest.update(np.asarray(leaf, dtype="<f4").tobytes())
    return digest.hexdigest()


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def run_spec(args: Args, sizes: Sizes, run_name: str) -> dict:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                             capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        sha = None
    packages = ["jax", "jaxlib", "flax", "optax", "rlax", "envpool", "numpy", "tyro"]
    return dict(run_name=run_name, script=os.path.basename(__file__), command=sys.argv, args=dataclasses.asdict(args),
                sizes=dataclasses.asdict(sizes), git_sha=sha, python=platform.python_version(),
                versions={p: importlib.metadata.version(p) for p in packages},
                devices=[str(d) for d in jax.devices()], start_time=time.time())


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


def save_checkpoint(run_dir: str, state, counters: dict, keep: int = 2):
    """Written beside its final name and renamed into place, with a checksum in front: a crash while
    writing leaves the previous checkpoint intact, and a damaged file is recognized on resume."""
    payload = flax.serialization.msgpack_serialize(
        {"state": flax.serialization.to_state_dict(jax.device_get(first_replica(state))), "counters": counters})
    directory = os.path.join(run_dir, "checkpoints")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"update_{counters['update']:09d}.ckpt")
    with open(path + ".tmp", "wb") as f:
        f.write(hashlib.sha256(payload).hexdigest().encode() + payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    for old in sorted(glob.glob(os.path.join(directory, "*.ckpt")))[:-keep]:
        os.remove(old)


def load_checkpoint(run_dir: str, state):
    """(state, counters) of the newest checkpoint whose checksum holds, or None when there is none."""
    for path in sorted(glob.glob(os.path.join(run_dir, "checkpoints", "*.ckpt")), reverse=True):
        with open(path, "rb") as f:
            data = f.read()
        if hashlib.sha256(data[64:]).hexdigest().encode() != data[:64]:
            print(f"warning: checkpoint {path} is damaged; trying the one before", file=sys.stderr)
            continue
        saved = flax.serialization.msgpack_restore(data[64:])
        return flax.serialization.from_state_dict(state, saved["state"]), saved["counters"]
    return None


def lost_peers() -> str:
    """Names the processes the coordinator no longer hears from, for the error of a broken run."""
    everyone = list(range(jax.process_count()))
    try:
        live = distributed.global_state.client.get_live_nodes(everyone)
    except Exception:
        return "the coordinator (process 0) is gone"
    lost = sorted(set(everyone) - set(live))
    return f"process(es) {lost} left the run" if lost else "a peer process failed"


def train(args: Args):
    sizes = sizes_of(args, jax.process_count())
    is_main = jax.process_index() == 0
    run_name = args.run_name or f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = os.path.join("runs", run_name)

    local_devices = jax.local_devices()
    actor_devices = [local_devices[i] for i in args.actor_device_ids]
    learner_devices = [local_devices[i] for i in args.learner_device_ids]
    global_learner_devices = [jax.local_devices(process_index=p)[i]
                              for p in range(jax.process_count()) for i in args.learner_device_ids]
    probe_env = make_env(args, args.seed, 1)
    network = Network(args.channels, args.hiddens, probe_env.action_space.n)
    params = network.init(jax.random.fold_in(jax.random.PRNGKey(args.seed), 0), probe_env.reset()[0])
    probe_env.close()
    optimizer = optax.chain(
        optax.clip_by_global_norm(args.max_grad_norm),
        optax.inject_hyperparams(optax.rmsprop)(
            learning_rate=lambda count: learning_rate_at(args, sizes, 1 + count // args.num_minibatches),
            decay=0.99, eps=0.01),
    )
    state = TrainState.create(apply_fn=network.apply, params=params, tx=optimizer)
    counters = dict(update=0, wall_time_s=0.0)
    checkpoint = load_checkpoint(run_dir, state) if args.resume else None
    if checkpoint:
        state, counters = checkpoint
        if counters["sizes"] != dataclasses.asdict(sizes) or counters["seed"] != args.seed:
            fail(f"--resume: the checkpoint of {run_dir} is of another run (sizes {counters['sizes']}, seed "
                 f"{counters['seed']}); resume with the same global hyperparameters")
        print(f"resuming {run_name} from update {counters['update']}")
    learner_sharding = NamedSharding(Mesh(np.array(learner_devices), ("devices",)), PartitionSpec("devices"))
    state = jax.device_put(jax.tree.map(lambda x: np.stack([np.asarray(x)] * len(learner_devices)), state),
                           learner_sharding)
    update = make_update(args, global_learner_devices)
    any_process = jax.pmap(lambda flag: jax.lax.psum(flag, "devices"), axis_name="devices",
                           devices=global_learner_devices)

    start_update = counters["update"]
    if is_main:
        os.makedirs(run_dir, exist_ok=True)
        spec = run_spec(args, sizes, run_name)
        write_json(os.path.join(run_dir, "spec.json" if not checkpoint else f"spec_resume_{start_update}.json"),
                   spec)
    if args.track and is_main:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=dataclasses.asdict(args), name=run_name, group=args.group or None, save_code=True,
                   id=run_name if args.resume else None, resume="allow" if args.resume else None)
    # purge_step makes TensorBoard drop what a preempted run logged after its checkpoint.
    writer = SummaryWriter(run_dir, write_to_disk=is_main,
                           purge_step=start_update * sizes.batch_size + 1 if checkpoint else None)
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
        f"|{k}|{v}|" for k, v in dataclasses.asdict(args).items()))

    stop = threading.Event()
    failures: list[str] = []
    recent_returns: deque = deque(maxlen=100)
    param_queues, rollout_queues, threads = [], [], []

    def guarded(fn, *fn_args):
        try:
            fn(*fn_args)
        except SystemExit:
            pass
        except BaseException:
            failures.append(traceback.format_exc())
            stop.set()

    for device_index, actor_device in enumerate(actor_devices):
        for thread_id in range(args.num_actor_threads):
            thread_index = ((jax.process_index() * len(actor_devices) + device_index) * args.num_actor_threads
                            + thread_id)
            param_queues.append(queue.Queue(maxsize=1))
            rollout_queues.append(queue.Queue(maxsize=1))
            threads.append(threading.Thread(target=guarded, daemon=True, name=f"actor-{thread_index}", args=(
                rollout, args, sizes, network, start_update + 1, thread_index * args.local_num_envs, actor_device,
                learner_devices, param_queues[-1], rollout_queues[-1], writer, stop, recent_returns)))

    def send_params(version):
        host_copy = first_replica(state.params)
        for device_index, actor_device in enumerate(actor_devices):
            on_device = jax.device_put(host_copy, actor_device)
            for q in param_queues[device_index * args.num_actor_threads:(device_index + 1) * args.num_actor_threads]:
                queue_put(q, (version, on_device), stop)

    received_signal = []
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, lambda signum, frame: received_signal.append(signum))

    def checkpoint_now(update_index):
        if is_main:
            save_checkpoint(run_dir, state, dict(
                update=update_index, global_step=update_index * sizes.batch_size, sizes=dataclasses.asdict(sizes),
                seed=args.seed, wall_time_s=counters["wall_time_s"] + time.time() - start_time))

    start_time = time.time()
    learner_policy_version = start_update
    global_step = start_update * sizes.batch_size
    exit_code = 0
    try:
        send_params(learner_policy_version)
        for thread in threads:
            thread.start()
        for update_index in range(start_update + 1, sizes.num_updates + 1):
            wait_start = time.time()
            payloads = [queue_get(q, stop) for q in rollout_queues]
            rollout_queue_get_time = time.time() - wait_start
            expected_lag = 1 if args.concurrency and update_index > start_update + 1 else 0
            for iteration, actor_policy_version, _, _ in payloads:
                lag = learner_policy_version - actor_policy_version
                if iteration != update_index or lag != expected_lag:
                    raise RuntimeError(f"update {update_index}: rollout {iteration} from policy {actor_policy_version}"
                                       f" while the learner is at {learner_policy_version} (lag {lag}, expected "
                                       f"{expected_lag})")
            learn_start = time.time()
            state, metrics = update(state, tuple(p[2] for p in payloads), np.int32(update_index))
            jax.block_until_ready(state)
            learn_time = time.time() - learn_start
            learner_policy_version += 1
            global_step = update_index * sizes.batch_size
            sps = int((global_step - start_update * sizes.batch_size) / (time.time() - start_time))
            timing = {k: np.mean([p[3][k] for p in payloads]) for k in payloads[0][3]}
            scalars = dict(timing, rollout_queue_get_time=rollout_queue_get_time, learn_time=learn_time,
                           actor_policy_version=payloads[0][1], learner_policy_version=learner_policy_version)
            for key, value in scalars.items():
                writer.add_scalar(f"stats/{key}", value, global_step)
            writer.add_scalar("charts/SPS", sps, global_step)
            writer.add_scalar("charts/learning_rate", learning_rate_at(args, sizes, update_index), global_step)
            if update_index % args.log_frequency == 0 or update_index == sizes.num_updates:
                for key, value in jax.device_get(first_replica(metrics)).items():
                    writer.add_scalar(f"losses/{key}", value, global_step)
                returns = list(recent_returns)
                mean_return = f"{np.mean(returns):.1f}" if returns else "n/a"
                eta = (sizes.num_updates - update_index) * (time.time() - start_time) / (update_index - start_update)
                print(f"update {update_index}/{sizes.num_updates} step={global_step} SPS={sps} "
                      f"return={mean_return} policy actor={payloads[0][1]} learner={learner_policy_version} "
                      f"wait rollout={rollout_queue_get_time:.2f}s param={timing['param_queue_get_time']:.2f}s "
                      f"ETA={eta / 60:.1f}min", flush=True)
            # Every process must stop after the same update, or the others would wait for it forever.
            stop_requested = np.full(len(learner_devices), bool(received_signal), np.int32)
            if args.distributed:
                stop_requested = np.asarray(any_process(stop_requested))
            if stop_requested[0] and update_index < sizes.num_updates:
                checkpoint_now(update_index)
                print(f"stopped by a signal after update {update_index}; checkpoint saved, continue with --resume",
                      file=sys.stderr)
                exit_code = 128 + (received_signal[0] if received_signal else signal.SIGTERM)
                break
            if args.checkpoint_every and (update_index % args.checkpoint_every == 0
                                          or update_index == sizes.num_updates):
                checkpoint_now(update_index)
            if update_index < sizes.num_updates:
                send_params(learner_policy_version)
    except KeyboardInterrupt:
        print("interrupted: stopping threads and flushing logs", file=sys.stderr)
        exit_code = 130
    except SystemExit:
        exit_code = 1
    except Exception:
        failures.append(traceback.format_exc() + (f"error: distributed run broken: {lost_peers()}\n"
                                                  if args.distributed else ""))
        exit_code = 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
    if failures:
        print("".join(failures), file=sys.stderr, end="")
        exit_code = 1
    if exit_code:
        writer.close()
        sys.exit(exit_code)

    final_params = jax.device_get(first_replica(state.params))
    fingerprint = params_fingerprint(final_params)
    if args.save_model and is_main:
        model_path = os.path.join(run_dir, f"{args.exp_name}.cleanba_model")
        saved_args = json.loads(json.dumps(dataclasses.asdict(args)))  # msgpack takes lists, not tuples
        with open(model_path, "wb") as f:
            f.write(flax.serialization.msgpack_serialize(
                {"script": os.path.basename(__file__)[: -len(".py")], "args": saved_args, "params": final_params}))
        print(f"model saved to {model_path}")
    if args.eval_episodes and is_main:
        eval_returns = evaluate(final_params, args, args.eval_episodes, args.seed + 1_000_000)
        for episode, episode_return in enumerate(eval_returns):
            writer.add_scalar("eval/episodic_return", episode_return, episode)
        print(f"eval: mean return {np.mean(eval_returns):.1f} over {len(eval_returns)} episodes")
    wall_time = counters["wall_time_s"] + time.time() - start_time
    if is_main:
        write_json(os.path.join(run_dir, "summary.json"), dict(
            params_fingerprint=fingerprint, global_step=global_step, learner_policy_version=learner_policy_version,
            sps=int(global_step / wall_time), wall_time_s=wall_time))
    writer.close()
    if args.track and is_main:
        wandb.finish()
    print(f"params_fingerprint={fingerprint}", flush=True)


def args_from_dict(saved: dict) -> Args:
    """Rebuilds Args from a saved model (msgpack stores tuples as lists)."""
    return Args(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})


def main(argv=None):
    args = parse_args(argv)
    if args.distributed:
        try:
            jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id,
                                       heartbeat_timeout_seconds=30)
        except (ValueError, RuntimeError) as error:
            fail(f"--distributed could not join the run ({str(error).splitlines()[0]}); run it under SLURM or "
                 "give --coordinator-address, --num-processes and --process-id")
    validate_layout(args)
    train(args)


if __name__ == "__main__":
    main()
