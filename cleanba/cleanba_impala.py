"""Cleanba IMPALA: actor threads collect rollouts with envpool, a pmap'd learner trains on them with
V-trace.

Each actor thread owns one `param_queue` and one `rollout_queue` (both maxsize 1). With
`--concurrency` (the default, "Cleanba IMPALA"), the actor skips `param_queue.get()` on its second
iteration, so the learner always trains on data from the policy exactly one version behind; with
`--no-concurrency` ("IMPALA (Sync)") actor and learner take turns and the lag is zero. V-trace
corrects for the difference between the behaviour policy and the policy being trained.
"""

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
    cores,
    distributed,
    hub,
    kept_lag,
    parsing,
    split_envs,
)
from cleanba_utils.checkpoints import resume_or_start
from cleanba_utils.devices import first_replica, gathered_rollouts, learner_sharding, replicate
from cleanba_utils.env_ids import is_jax_env
from cleanba_utils.envs import has_image_observations, make_env
from cleanba_utils.errors import fail
from cleanba_utils.evaluation_episodes import carrying_state, play_episodes
from cleanba_utils.fields import in_range, non_negative, positive
from cleanba_utils.handoff import ActorTimes, LagRule, OnResume, start_actor_threads
from cleanba_utils.huge_pages import restart_with_huge_pages
from cleanba_utils.kept_lag import Continuation
from cleanba_utils.max_pool import max_pool_3x3_stride_2
from cleanba_utils.microbatches import microbatch_update, minibatch_ids, rolls
from cleanba_utils.run import open_run
from cleanba_utils.run_args import GYMNASIUM_IMAGES, RUN_NEEDS, DeviceArgs
from cleanba_utils.run_logs import LearnerTimes
from cleanba_utils.sizes import Sizes, rollout_sizes
from cleanba_utils.threads import queue_get, queue_put
from cleanba_utils.torsos import CPU_SIZED, resolve_image_defaults

# === Args ===


@dataclasses.dataclass
class Args(DeviceArgs):
    # The run options of `DeviceArgs` whose default or meaning differ here.
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    concurrency: bool = True

    env_id: str = "Breakout-v5"
    """the environment: an envpool id (Breakout-v5, CartPole-v1), gymnax:<id> for gymnax's JAX
    environment (gymnax:Breakout-MinAtar) or jax:<module>:<class> for your own with gymnax's
    interface (docs/jax_environments.md), gymnasium:<id> for Gymnasium's (gymnasium:CartPole-v1) or
    gymnasium:<module>:<class> for your own with Gymnasium's interface
    (docs/gymnasium_environments.md)"""
    total_timesteps: int = positive(50_000_000)
    """total environment steps (agent steps, not frames) of the run"""
    learning_rate: float = positive(6e-4)
    """the learning rate of RMSProp (decay 0.99, momentum 0)"""
    rmsprop_eps: float = positive(0.01)
    """RMSProp's epsilon, added to the mean square under the root as in TensorFlow's RMSProp, which
    the IMPALA paper ran (optax eps_in_sqrt=True); 0.01 is the Cleanba and IMPALA papers'. The
    IMPALA paper's losses are sums over the batch's steps, these are means (the Cleanba paper's), so
    the same gradients are smaller here by the minibatch's number of steps: where nearly every
    parameter's mean square is below epsilon, RMSProp steps as SGD at learning rate / √epsilon.
    A smaller epsilon lets it scale small gradients (MinAtar's: docs/impala.md)"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
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
    num_steps: int = positive(20)
    """the number of steps each environment runs per rollout"""
    gamma: float = in_range(0.99, 0, 1, low_open=True)
    """the discount factor"""
    vtrace_lambda: float = in_range(1.0, 0, 1)
    """the lambda of V-trace: trace coefficients are c = lambda * min(1, rho) (rlax fixes c bar
    at 1)"""
    clip_rho_threshold: float = positive(1.0)
    """the clip of the importance ratios in the V-trace targets (rho bar)"""
    clip_pg_rho_threshold: float = positive(1.0)
    """the clip of the importance ratios in the policy-gradient advantages"""
    num_minibatches: int = positive(4)
    """the number of optimizer steps per rollout, each on a subset of whole environment sequences"""
    ent_coef: float = non_negative(0.01)
    """the entropy coefficient"""
    vf_coef: float = non_negative(0.5)
    """the value function coefficient"""
    max_grad_norm: float = positive(40.0)
    """the maximum global norm of the gradient"""
    channels: tuple[int, ...] | None = None
    """the channels of the IMPALA ResNet stacks (Atari frames; default 16 32 32), or of the 3x3
    convolutions of Young & Tian's (2019) MinAtar network (small images; default 16)"""
    hiddens: tuple[int, ...] | None = None
    """the sizes of the dense layers after the torso (images; default 256 after the ResNet, 128
    after MinAtar's convolution), or of the hidden layers of each of the separate actor and critic
    MLPs (vector observations; default 256)"""
    core: Literal["none", "lstm", "gru"] = "none"
    """a recurrent core between the torso and the heads (cleanba_utils/cores.py), its state carried
    per environment and reset where an episode starts, each environment's sequence replayed by the
    learner from the state its first step met: for tasks whose observation does not show all the
    agent needs. The IMPALA paper's deep agent has an LSTM; the default has none, as the Cleanba
    paper's runs"""
    core_size: int = positive(256)
    """the units of the core (the IMPALA paper's LSTM: 256); for vector observations, also of the
    dense layer before it"""

    gradient_accumulation_steps: int = positive(1)
    """split each minibatch into this many microbatches whose gradients are summed before one
    optimizer step: the same result (up to float rounding) in less learner memory"""


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
    "channels": parsing.IMAGE_OBSERVATIONS,
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
    """Checks every argument that needs no device, before any other work; exits 2 on the first
    problem."""
    parsing.check_fields(args)
    parsing.check_run_options(args)
    resolve_image_defaults(args, atari_channels=(16, 32, 32), atari_hiddens=(256,))
    parsing.check_layers(args, ["channels", "hiddens"])
    parsing.check_discrete_actions(args)
    parsing.check_needs(args, NEEDS)


def validate_layout(args: Args):
    """The checks that need the devices (and, with --distributed, the number of processes). First
    gives the options of `PLATFORM_DEFAULTS` left unset their platform's value."""
    accelerators.apply_platform_defaults(args, PLATFORM_DEFAULTS)
    sizes = sizes_of(args, jax.process_count())
    parsing.check_devices(args, sizes.num_updates, sizes.steps_per_update)
    envs_per_device = args.local_num_envs // len(args.learner_device_ids)
    microbatches = args.num_minibatches * args.gradient_accumulation_steps
    if envs_per_device % microbatches:
        fail(
            f"--local-num-envs {args.local_num_envs} over {len(args.learner_device_ids)} learner "
            f"device(s) gives {envs_per_device} envs per device, not divisible by "
            f"--num-minibatches {args.num_minibatches} x --gradient-accumulation-steps "
            f"{args.gradient_accumulation_steps}: every device puts equally many envs in each "
            "microbatch"
        )


# === Environment ===


# `cleanba_utils.envs.make_env`: envpool's environments, Atari as Machado et al. (2018) play it.


# === Network ===


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


class ConvSequence(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.channels, (3, 3))(x)
        x = max_pool_3x3_stride_2(x)
        return ResidualBlock(self.channels)(ResidualBlock(self.channels)(x))


class MLP(nn.Module):
    """tanh hidden layers and a linear output, orthogonally initialized (scale sqrt 2, then
    `output_scale`)."""

    hiddens: tuple[int, ...]
    outputs: int
    output_scale: float

    @nn.compact
    def __call__(self, x):
        for hidden in self.hiddens:
            x = nn.tanh(nn.Dense(hidden, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return nn.Dense(self.outputs, kernel_init=nn.initializers.orthogonal(self.output_scale))(x)


class Network(nn.Module):
    """IMPALA ResNet torso shared by both heads for stacked frames (N, C, H, W) of uint8 pixels;
    Young & Tian's (2019) MinAtar torso for small float images (MinAtar's 10x10 channels); separate
    actor and critic MLPs for vector observations (N, D), as in the classic-control PPO references:
    through a shared torso, the critic's gradients (its targets, discounted returns, approach 1 /
    (1 - gamma) on CartPole) swamp the policy's.

    With a recurrent `core` (--core) it takes sequences, time-major (`cores`): `(obs (T, N, ...),
    the state entering step 0, is_reset (T, N)) -> (logits, values, the state after step T - 1)`.
    Images: the core after the torso's dense layers, linear heads (the IMPALA paper's deep agent,
    without its last action and reward as inputs); vectors: a dense layer of `core_size` units
    (ReLU), the core, then the separate MLPs (PureJaxRL's `ppo_rnn.py` has one such layer)."""

    channels: tuple[int, ...]
    hiddens: tuple[int, ...]
    num_actions: int
    core: str = "none"
    core_size: int = 256

    @nn.compact
    def __call__(self, obs, core_state=None, is_reset=None):
        if self.core != "none":
            return self.through_core(obs, core_state, is_reset)
        if obs.ndim != 4:
            x = obs.astype(jnp.float32)
            return MLP(self.hiddens, self.num_actions, 0.01)(x), MLP(self.hiddens, 1, 1.0)(x)[:, 0]
        x = self.image_torso(obs)
        logits = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01))(x)
        value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(x)
        return logits, value[:, 0]

    def through_core(self, obs, core_state, is_reset):
        """The network with its core on sequences: every step's torso at once, the core step by
        step, every step's heads at once."""
        steps_and_envs = obs.shape[:2]
        flat = obs.reshape(-1, *obs.shape[2:])
        if flat.ndim != 4:
            dense = nn.Dense(self.core_size, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))
            x = nn.relu(dense(flat.astype(jnp.float32)))
        else:
            x = self.image_torso(flat)
        core_state, x = cores.Core(self.core, self.core_size)(
            core_state, x.reshape(*steps_and_envs, -1), is_reset
        )
        x = x.reshape(-1, self.core_size)
        if flat.ndim != 4:
            logits = MLP(self.hiddens, self.num_actions, 0.01)(x)
            value = MLP(self.hiddens, 1, 1.0)(x)[:, 0]
        else:
            logits = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01))(x)
            value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(x)[:, 0]
        return logits.reshape(*steps_and_envs, -1), value.reshape(steps_and_envs), core_state

    def image_torso(self, obs):
        """An image's features (N, C, H, W -> N, hidden): the torso and its dense layers."""
        if obs.dtype != jnp.uint8:
            x = MinAtarTorso(self.channels)(jnp.transpose(obs, (0, 2, 3, 1)))
        else:
            x = jnp.transpose(obs, (0, 2, 3, 1)).astype(jnp.float32) / 255.0
            for channels in self.channels:
                x = ConvSequence(channels)(x)
            x = nn.relu(x).reshape(x.shape[0], -1)
        for hidden in self.hiddens:
            x = nn.relu(nn.Dense(hidden, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return x


# === Actor ===

# How the policy lag goes on across a resume (cleanba_utils.handoff): restarted on envpool's
# environments, which a resumed run makes anew from the run's seeds; kept on a JAX environment,
# whose state the checkpoint holds with the parameters sent last (`kept_lag`): the resumed run is
# then the uninterrupted one, bit for bit.
ON_RESUME: OnResume = "restart_lag"
ON_RESUME_JAX_ENVS: OnResume = "keep_lag"


def on_resume_of(args) -> OnResume:
    return ON_RESUME_JAX_ENVS if is_jax_env(args.env_id) else ON_RESUME


class Trajectories(NamedTuple):
    """One rollout, env-major (envs, steps, ...): what each environment saw and did at each step
    (`obs` has one more entry per environment, the last observation, which the learner evaluates
    with its current parameters), and the environments' global indices. `is_reset` marks envpool's
    reset steps (the step after an episode's end: the action is ignored and the observation is the
    next episode's first)."""

    obs: np.ndarray
    actions: np.ndarray
    logprobs: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    is_reset: np.ndarray
    env_ids: np.ndarray
    first_core_state: Any = None
    """with a recurrent core: the state each environment's first step met (None without one)"""


class Rollout(NamedTuple):
    """What an actor thread puts on its rollout queue: the learner update it is for, the version of
    the parameters that played it, its trajectories with one slice of environments per learner
    device, its environments' record after it (a JAX environment's state, for a checkpoint to bring
    them back; None on envpool's) and the seconds the actor spent waiting for parameters, playing,
    stepping and inferring."""

    update: int
    policy_version: int
    data: Trajectories
    record: Any
    timing: ActorTimes
    next_core_state: Any = None
    """with a recurrent core, the state after the rollout, on the host: a JAX environment's
    checkpoint holds it"""


def sample_actions(logits, key, step, env_ids):
    """Gumbel-max sampling keyed by (step, global env index): the same draws whatever the layout."""
    step_key = jax.random.fold_in(key, step)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(step_key, env_ids)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[1:]))(keys)
    return jnp.argmax(logits + gumbel, axis=1)


class PolicyOutputs(NamedTuple):
    """What the actor keeps of the policy's step beside the actions."""

    logprobs: jax.Array


def policy_step(network, action_key, params, obs, env_ids, step, step_input, *core):
    """The policy's step on a batch of environments (`env_ids`, their global indices) at policy
    step `step`: the sampled actions and their log-probabilities (V-trace's behaviour policy μ).
    `step_input` is unused (the compiled rollout's per-step input). With a recurrent core, `core`
    is (the state, `is_reset`) and the step also returns the state after it (one step of the
    sequence)."""
    if core:
        core_state, is_reset = core
        logits, _, core_state = network.apply(params, obs[None], core_state, is_reset[None])
        logits = logits[0]
    else:
        logits = network.apply(params, obs)[0]
    action = sample_actions(logits, action_key, step, env_ids)
    logprob = jax.nn.log_softmax(logits)[jnp.arange(action.shape[0]), action]
    outputs = PolicyOutputs(logprobs=logprob)
    return (action, outputs, core_state) if core else (action, outputs)


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
    core_state,
):
    """One actor thread (`start_actor_threads`) on `device`, playing the updates of `lag`:
    environments with global indices env_offset .. env_offset + local_num_envs - 1, their rollouts
    split among the local `learner_devices`. envpool's environments step in Python beside the
    policy's inference; a JAX environment's steps and the policy's run in one compiled program,
    continued from their part of `env_record` in a resumed run (None: a fresh run, or envpool's
    environments). `core_state`: with a recurrent core, the run's environments' state before the
    first rollout (zeros, or a resumed JAX environment's), else None."""
    action_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 1)
    on_learner_devices = learner_sharding(learner_devices)
    num_slices = len(learner_devices)
    start_rollout = compiled_rollout.start if is_jax_env(args.env_id) else split_envs.start_splits
    env_ids = np.arange(env_offset, env_offset + args.local_num_envs, dtype=np.int32)
    envs = start_rollout(
        make_env,
        args,
        episodes=run.logs.episodes(args.local_num_envs),
        num_envs=sizes.num_envs,
        env_offset=env_offset,
        env_record=env_record,
        act=functools.partial(policy_step, network, action_key),
        device=device,
        core_state=None if core_state is None else jax.tree.map(lambda x: x[env_ids], core_state),
    )
    # The observations with the one after the last step, which the learner evaluates with its
    # current parameters, env-major on the actor's device.
    with_next_obs = jax.jit(lambda obs, next_obs: jnp.concatenate([obs, next_obs[:, None]], axis=1))

    for update in lag.updates():
        param_wait_start = time.time()
        if lag.actor_fetches_params(update):
            policy_version, params = queue_get(param_queue, run.stop)
        param_queue_get_time = time.time() - param_wait_start

        rollout_start = time.time()
        played = envs.play(params, update)
        steps = played.steps
        # Env-major (envs, steps, ...) split into one slice of envs per learner device: a single
        # host-to-device copy of what the actor holds on the host, overlapped with the learner's
        # work. The learner evaluates every observation with its current parameters, the last one
        # included.
        split = lambda v: v.reshape(num_slices, -1, *v.shape[1:])
        data = Trajectories(
            obs=split(with_next_obs(steps.obs, played.next_obs)),
            actions=split(steps.env_actions),
            logprobs=split(steps.outputs.logprobs),
            rewards=split(steps.rewards),
            terminations=split(steps.terminations),
            truncations=split(steps.truncations),
            is_reset=split(steps.is_reset),
            env_ids=split(env_ids),
            first_core_state=jax.tree.map(split, played.first_core_state),
        )
        timing = ActorTimes(
            param_queue_get_time=param_queue_get_time,
            rollout_time=time.time() - rollout_start,
            inference_time=played.inference_time,
            env_step_time=played.env_step_time,
        )
        rollout = Rollout(
            update=update,
            policy_version=policy_version,
            data=jax.device_put(data, on_learner_devices),
            record=played.record,
            timing=timing,
            next_core_state=played.next_core_state,
        )
        queue_put(rollout_queue, rollout, run.stop)


def network_of(args, num_actions: int) -> Network:
    return Network(
        args.channels,
        args.hiddens,
        num_actions,
        core=args.core,
        core_size=args.core_size,
    )


def evaluate(params, args: Args, num_episodes: int, seed: int) -> list[float]:
    """Plays one episode in each of `num_episodes` fresh environments with the sampled policy (with
    a recurrent core, each episode from a zero state)."""
    envs = make_env(args, seed, num_episodes)
    network = network_of(args, envs.action_space.n)
    env_ids = jnp.arange(num_episodes)
    key = jax.random.PRNGKey(seed)
    if args.core == "none":
        act = jax.jit(lambda p, o, step: sample_actions(network.apply(p, o)[0], key, step, env_ids))
        return play_episodes(envs, num_episodes, lambda obs, step: act(params, obs, step))
    # Each environment plays one episode: its state never resets.
    no_reset = np.zeros(num_episodes, bool)
    act = jax.jit(
        lambda p, o, step, state: policy_step(
            network, key, p, o, env_ids, step, None, state, no_reset
        )[::2]  # the actions and the state after the step
    )
    first_state = cores.initial_state(args.core, args.core_size, num_episodes)
    return play_episodes(
        envs, num_episodes, carrying_state(functools.partial(act, params), first_state)
    )


# The model card of --upload-model: the algorithm, its papers and how `evaluate` acts.
MODEL_CARD = hub.ModelCard(
    name="Cleanba IMPALA",
    papers=(hub.CLEANBA, hub.IMPALA),
    evaluation_policy=lambda args: "actions sampled from the policy π",
)


# === Loss ===


def vtrace(
    values,
    rewards,
    terminations,
    truncations,
    log_rhos,
    *,
    gamma,
    vtrace_lambda,
    clip_rho,
    clip_pg_rho,
):
    """V-trace targets and policy-gradient advantages of one environment's rollout; values has one
    more entry (the last observation) and log_rhos are log pi(a|x) - log mu(a|x) of the actions
    taken.

    A termination stops bootstrapping; a truncation bootstraps from the last observation's value
    but, like a termination, cuts the trace so that no correction flows across episodes."""
    discount = gamma * (1.0 - terminations)
    trace = vtrace_lambda * (1.0 - jnp.maximum(terminations, truncations))
    out = rlax.vtrace_td_error_and_advantage(
        v_tm1=values[:-1],
        v_t=values[1:],
        r_t=rewards,
        discount_t=discount,
        rho_tm1=jnp.exp(log_rhos),
        lambda_=trace,
        clip_rho_threshold=clip_rho,
        clip_pg_rho_threshold=clip_pg_rho,
    )
    return out.errors + values[:-1], out.pg_advantage


class Batch(NamedTuple):
    """Whole environment sequences (envs, steps) of the learner: what the actor played (`obs` with
    the last observation), and `valid` (0 on envpool's reset steps, which do not count)."""

    obs: jax.Array
    actions: jax.Array
    logprobs: jax.Array
    rewards: jax.Array
    terminations: jax.Array
    truncations: jax.Array
    valid: jax.Array
    first_core_state: Any = None
    """with a recurrent core: the state each environment's first step met"""


def impala_loss(
    params,
    apply_fn,
    batch: Batch,
    count,
    *,
    gamma,
    vtrace_lambda,
    clip_rho,
    clip_pg_rho,
    ent_coef,
    vf_coef,
):
    """Sums of per-sample losses over this device's valid samples, divided by the global count.

    The current parameters evaluate all T + 1 observations of each environment, so V-trace corrects
    for the actor's policy having been older than the one being trained. With a recurrent core, each
    environment's sequence is replayed from the state its first step met, the state reset after
    its reset steps as the actor's was (`cores`)."""
    num_envs_and_obs = batch.obs.shape[:2]
    if batch.first_core_state is None:
        obs = batch.obs.reshape(-1, *batch.obs.shape[2:])
        logits, values = apply_fn(params, obs)
        logits = logits.reshape(*num_envs_and_obs, -1)
        values = values.reshape(num_envs_and_obs)
    else:
        time_major = lambda x: jnp.swapaxes(x, 0, 1)
        # The last observation follows the rollout's last step: its reset flag acts on no later one.
        is_reset = jnp.pad(batch.valid == 0, ((0, 0), (0, 1)))
        logits, values, _ = apply_fn(
            params, time_major(batch.obs), batch.first_core_state, time_major(is_reset)
        )
        logits, values = time_major(logits), time_major(values)
    log_probs = jax.nn.log_softmax(logits[:, :-1])
    actions = batch.actions[..., None].astype(jnp.int32)
    logprob = jnp.take_along_axis(log_probs, actions, axis=-1)[..., 0]
    logratio = logprob - batch.logprobs
    per_env_vtrace = functools.partial(
        vtrace,
        gamma=gamma,
        vtrace_lambda=vtrace_lambda,
        clip_rho=clip_rho,
        clip_pg_rho=clip_pg_rho,
    )
    targets, pg_advantages = jax.lax.stop_gradient(
        jax.vmap(per_env_vtrace)(
            values=values,
            rewards=batch.rewards,
            terminations=batch.terminations,
            truncations=batch.truncations,
            log_rhos=logratio,
        )
    )
    pg_loss = -pg_advantages * logprob
    baseline_loss = 0.5 * (targets - values[:, :-1]) ** 2
    entropy = -(jax.nn.softmax(logits[:, :-1]) * log_probs).sum(-1)
    mean = lambda x: (x * batch.valid).sum() / count
    loss = mean(pg_loss) + vf_coef * mean(baseline_loss) - ent_coef * mean(entropy)
    metrics = dict(
        pg_loss=mean(pg_loss),
        baseline_loss=mean(baseline_loss),
        entropy=mean(entropy),
        approx_kl=mean(jnp.exp(logratio) - 1 - logratio),
    )
    return loss, metrics


# === Update ===


def init_state(args: Args, sizes: Sizes):
    """The network, and where the run starts (`kept_lag.Origin`): fresh from the seed, or with
    --resume from the newest checkpoint of the run (counters["update"] > 0 then). On envpool's
    environments the checkpoint holds the learner state alone; on a JAX environment also the
    environments' state and the parameters sent last (`ON_RESUME_JAX_ENVS`)."""
    probe_env = make_env(args, args.seed, 1)
    network = network_of(args, probe_env.action_space.n)
    params = cores.init_network(
        network, jax.random.fold_in(jax.random.PRNGKey(args.seed), 0), probe_env.reset()[0]
    )
    probe_env.close()
    learning_rate = lambda count: learning_rate_at(args, sizes, 1 + count // args.num_minibatches)
    optimizer = optax.chain(
        optax.clip_by_global_norm(args.max_grad_norm),
        optax.inject_hyperparams(optax.rmsprop)(
            learning_rate=learning_rate, decay=0.99, eps=args.rmsprop_eps
        ),
    )
    # The gradients of a minibatch's microbatches are summed (each is its share of the minibatch's
    # mean).
    optimizer = optax.MultiSteps(optimizer, args.gradient_accumulation_steps, use_grad_mean=False)
    state = TrainState.create(apply_fn=network.apply, params=params, tx=optimizer)
    if is_jax_env(args.env_id):
        # With a recurrent core, the checkpoint holds every environment's state after the rollouts.
        origin = kept_lag.run_origin(
            args,
            sizes,
            __file__,
            state,
            acting_params=params,
            actor_carry=first_core_state(args, sizes),
        )
        if origin.actor_carry is None:
            origin = origin._replace(actor_carry=first_core_state(args, sizes))
        return network, origin
    identity = dict(sizes=dataclasses.asdict(sizes), seed=args.seed)
    saved, counters = resume_or_start(args, state, identity, __file__)
    origin = kept_lag.learner_origin(state if saved is None else saved, counters)
    # envpool's environments start anew on a resume, their cores' states with them.
    return network, origin._replace(actor_carry=first_core_state(args, sizes))


def first_core_state(args: Args, sizes: Sizes):
    """Every environment's core state before its first step: zeros (`cores`); () without a core."""
    if args.core == "none":
        return ()
    return jax.device_get(cores.initial_state(args.core, args.core_size, sizes.num_envs))


def make_update(args: Args, learner_devices: list, rolled: bool, on_step_timed=None):
    """The learner update, pmap'd over the learner devices: one pass over the rollout in
    `num_minibatches` optimizer steps, each on whole environment sequences and the sum of the
    gradients of `gradient_accumulation_steps` microbatches (subsets of its sequences).

    Layout invariance: minibatch membership depends only on global env indices (`minibatch_ids`),
    and every mean is a global one (psum of sums over psum of counts), so the number of learner
    devices changes the result only by float rounding. `rolled` and `on_step_timed`: see
    `microbatch_update`."""
    learner_key = jax.random.fold_in(jax.random.PRNGKey(args.seed), 2)

    def prepare(rollouts, update):
        """The whole rollout as one batch, and its environments in minibatch order: minibatch m is
        the m-th block of `order`."""
        data = jax.tree.map(lambda *xs: jnp.concatenate(xs), *rollouts)
        batch = Batch(
            obs=data.obs,
            actions=data.actions,
            logprobs=data.logprobs,
            rewards=data.rewards,
            terminations=data.terminations.astype(jnp.float32),
            truncations=data.truncations.astype(jnp.float32),
            valid=1.0 - data.is_reset.astype(jnp.float32),
            first_core_state=data.first_core_state,
        )
        ids = minibatch_ids(
            jax.random.fold_in(learner_key, update), data.env_ids, args.num_minibatches
        )
        order = jnp.argsort(ids, stable=True)
        return batch, order

    def microbatch_step(state, prepared, update, minibatch, microbatch):
        """One microbatch of one minibatch: its gradient, summed over the devices, accumulated into
        the minibatch's optimizer step."""
        batch, order = prepared
        envs_per_minibatch = order.shape[0] // args.num_minibatches
        minibatch_envs = jax.lax.dynamic_slice_in_dim(
            order, minibatch * envs_per_minibatch, envs_per_minibatch
        )
        # The count is the whole minibatch's, so that K microbatches sum to exactly its gradient.
        count = jnp.maximum(jax.lax.psum(batch.valid[minibatch_envs].sum(), "devices"), 1.0)
        envs_per_microbatch = envs_per_minibatch // args.gradient_accumulation_steps
        microbatch_envs = jax.lax.dynamic_slice_in_dim(
            minibatch_envs, microbatch * envs_per_microbatch, envs_per_microbatch
        )
        grads, metrics = jax.grad(impala_loss, has_aux=True)(
            state.params,
            apply_fn=state.apply_fn,
            batch=jax.tree.map(lambda x: x[microbatch_envs], batch),
            count=count,
            gamma=args.gamma,
            vtrace_lambda=args.vtrace_lambda,
            clip_rho=args.clip_rho_threshold,
            clip_pg_rho=args.clip_pg_rho_threshold,
            ent_coef=args.ent_coef,
            vf_coef=args.vf_coef,
        )
        # Each device's loss is its share of the global mean, so the global gradient is their sum.
        grads, metrics = jax.lax.psum((grads, metrics), "devices")
        return state.apply_gradients(grads=grads), metrics

    # The update's loops, outermost first: for every minibatch, one step per microbatch; the
    # optimizer steps once per minibatch (`optax.MultiSteps`). `microbatch_update` runs the steps in
    # this order, in a `lax.scan` or a Python loop (`microbatches.rolls`).
    schedule = [
        (minibatch, microbatch)
        for minibatch in range(args.num_minibatches)
        for microbatch in range(args.gradient_accumulation_steps)
    ]
    return microbatch_update(
        prepare=prepare,
        microbatch_step=microbatch_step,
        schedule=schedule,
        optimizer_steps=args.num_minibatches,
        devices=learner_devices,
        rolled=rolled,
        on_step_timed=on_step_timed,
    )


def learning_rate_at(args: Args, sizes: Sizes, update: int) -> float:
    """Constant within an update, linearly down to zero over the run."""
    if not args.anneal_lr:
        return args.learning_rate
    return args.learning_rate * (1.0 - (update - 1) / sizes.num_updates)


def optimizer_steps_after(args: Args, update: int) -> int:
    """One optimizer step per minibatch (the train state's `step` counts the microbatches of
    --gradient-accumulation-steps)."""
    return update * args.num_minibatches


# === Learner loop ===


def train(args: Args):
    sizes = sizes_of(args, jax.process_count())
    actor_devices = [jax.local_devices()[i] for i in args.actor_device_ids]
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
    run.evaluate_untrained(lambda: jax.device_get(first_replica(state.params)))
    rolled = rolls(learner_devices[0].platform, convolutional=has_image_observations(args.env_id))
    # On a CPU the learner's pace, from one timed step, says within minutes a run that would take
    # days, and a command sized for a CPU.
    instead = f"uv run python cleanba/cleanba_impala.py --env-id {args.env_id} {CPU_SIZED}"
    update_fn = make_update(
        args,
        global_learner_devices,
        rolled=rolled,
        on_step_timed=functools.partial(run.logs.note_learner_pace, instead=instead),
    )
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
        learner_devices=learner_devices,
        env_record=origin.env_record,
        core_state=None if args.core == "none" else origin.actor_carry,
    )
    with run.learner_loop(actors.threads) as end:
        actors.send_first(first_replica(state.params), acting_params=origin.acting_params)
        update = lag.first_update - 1  # the updates done, where the loop makes none (finished)
        for update in lag.updates():
            rollouts, rollout_queue_get_time = actors.take_rollouts(update)
            learn_start = time.time()
            state, metrics = update_fn(state, tuple(r.data for r in rollouts), np.int32(update))
            saved = state
            if is_jax_env(args.env_id):
                # Every process's environments after the rollouts, in global env order.
                record = gathered_rollouts([r.record for r in rollouts], args.distributed)
                core_state = ()
                if args.core != "none":
                    core_state = gathered_rollouts(
                        [r.next_core_state for r in rollouts], args.distributed
                    )
                saved = Continuation(state, actors.last_sent, record, actor_carry=core_state)
            jax.block_until_ready(state)
            learner_times = LearnerTimes(
                rollout_queue_get_time=rollout_queue_get_time,
                learn_time=time.time() - learn_start,
            )
            run.logs.log_update(
                update=update,
                rollouts=rollouts,
                metrics=metrics,
                learner_times=learner_times,
                optimizer_steps=optimizer_steps_after(args, update),
                learning_rate=learning_rate_at(args, sizes, update),
            )
            if run.evaluation_due(update):
                params = jax.device_get(first_replica(state.params))
                run.evaluate_and_log(update, params, optimizer_steps_after(args, update))
            end.exit_code = run.after_update(saved, update)
            if end.exit_code:
                break
            if update < sizes.num_updates:
                actors.send(first_replica(state.params), policy_version=update)
    params = jax.device_get(first_replica(state.params))
    run.finish(params, update, optimizer_steps_after(args, update))


# === Main ===


def main(argv=None):
    args = parse_args(argv)
    distributed.join(args)
    validate_layout(args)
    train(args)


if __name__ == "__main__":
    restart_with_huge_pages()
    main()
