"""Gymnasium's environments as a source of environments (`--env-id gymnasium:<id>`): a registered id
(`gymnasium:CartPole-v1`, `gymnasium:HalfCheetah-v5`, gymnasium's own `module:Env-v0` form that
imports the module registering it) or a researcher's own environment class or factory with
Gymnasium's interface, named by its import path (`gymnasium:my_package.envs:MyEnv`).

`GymnasiumVectorEnv` plays `num_envs` of them with envpool's interface and conventions, so that
the actors step them in Python as they step envpool's (`split_envs`): one after another in this
process (Gymnasium's `SyncVectorEnv`, `--vectorization-mode sync`) or each in a worker process of
its own (`AsyncVectorEnv`, `async`; the workers started by forkserver, never fork, beside JAX's
threads, so a researcher's class must be importable by its module's name). Its conventions:
- environment i of an instance made with seed s is reset with seed s + i, as envpool seeds its
  environment i: the run's environment g is the same whatever the layout;
- an episode's end is followed by a reset step, which ignores the action and returns the next
  episode's first observation with reward 0 and no end: Gymnasium's `NEXT_STEP` autoreset is
  envpool's reset step, taken as it is;
- termination and truncation (a `TimeLimit`) as the environment gives them;
- observations float32 (uint8 images stay uint8), images (height, width, channels) channels first
  as envpool's Atari frames are; rewards float32; discrete actions int32.

A researcher's own class is checked first by Gymnasium's `env_checker`.

Environments whose steps are deterministic given their actions (Gymnasium's MuJoCo tasks) can be
brought back to where a checkpoint left them as envpool's MuJoCo tasks are (`env_records`): made
with the same seeds, reset as often, their current episode's actions replayed (`restore`)."""

import atexit
import contextlib
import contextvars
import dataclasses
import functools
import importlib
import importlib.metadata
import os
import signal
import sys
import threading
import time
import warnings
import weakref

import gymnasium
import numpy as np
from gymnasium.utils.env_checker import check_env

from cleanba_utils import signals
from cleanba_utils.env_ids import GYMNASIUM_PREFIX, own_module
from cleanba_utils.errors import fail

WORKERS_GONE_SECONDS = 0.5
"""how long the ending of a process waits for an actor thread to let go of the vector environment
whose workers it killed (`end_workers`)"""


def _own_factory(env_id: str):
    """The class or factory a `gymnasium:<module>:<name>` id names, or None where the id is one for
    `gymnasium.make` (one line and exit 2 where the module does not import)."""
    name = env_id[len(GYMNASIUM_PREFIX) :]
    module_name, colon, attribute = name.partition(":")
    if colon:
        module = own_module(env_id, module_name)
        own = getattr(module, attribute, None)
        if callable(own) and not isinstance(own, str):
            return own
    return None


def _factory(env_id: str, **kwargs):
    """A function that makes one environment of the id (picklable, for worker processes), with
    `kwargs` (`render_mode`) where given."""
    own = _own_factory(env_id)
    name = env_id[len(GYMNASIUM_PREFIX) :]
    if own is not None:
        return functools.partial(own, **kwargs) if kwargs else own
    return functools.partial(gymnasium.make, name, **kwargs)


def _made(env_id: str):
    try:
        env = _factory(env_id)()
    except (gymnasium.error.Error, ImportError, ModuleNotFoundError) as error:
        fail(f"--env-id {env_id}: Gymnasium cannot make it ({type(error).__name__}: {error})")
    if not isinstance(env, gymnasium.Env):
        fail(
            f"--env-id {env_id} makes a {type(env).__name__}, not a gymnasium.Env (reset, step, "
            "action_space, observation_space)"
        )
    return env


def _action_space(space, env_id: str) -> gymnasium.Space:
    if isinstance(space, gymnasium.spaces.Discrete) and int(space.start) == 0:
        return gymnasium.spaces.Discrete(int(space.n), dtype=np.int32)
    if isinstance(space, gymnasium.spaces.Box) and len(space.shape) == 1:
        return gymnasium.spaces.Box(
            space.low.astype(np.float32), space.high.astype(np.float32), space.shape, np.float32
        )
    fail(
        f"--env-id {env_id} acts in {space}; the scripts take Discrete(n) from 0 or a Box of "
        "reals (a vector)"
    )


def _observation_space(space, env_id: str) -> gymnasium.Space:
    if not isinstance(space, gymnasium.spaces.Box) or len(space.shape) not in (1, 3):
        fail(
            f"--env-id {env_id} observes {space}; the scripts take a Box of a vector or of an "
            "image (height, width, channels): flatten a Dict or Tuple space with Gymnasium's "
            "FlattenObservation wrapper in your factory"
        )
    dtype = np.uint8 if space.dtype == np.uint8 else np.float32
    shape = tuple(space.shape)
    if len(shape) == 3:
        shape = (shape[2], shape[0], shape[1])
    low, high = (0, 255) if dtype == np.uint8 else (-np.inf, np.inf)
    return gymnasium.spaces.Box(
        np.full(shape, low, dtype), np.full(shape, high, dtype), shape, dtype
    )


@functools.cache
def spaces(env_id: str) -> tuple[gymnasium.Space, gymnasium.Space]:
    """(observation space, action space) as `GymnasiumVectorEnv` gives them; one line and exit 2 for
    an id Gymnasium cannot make or spaces the scripts cannot take."""
    env = _made(env_id)
    try:
        taken = (
            _observation_space(env.observation_space, env_id),
            _action_space(env.action_space, env_id),
        )
    finally:
        env.close()
    if _own_factory(env_id) is not None:
        # A researcher's own class then meets Gymnasium's checker (its seeding, the types its reset
        # and step return); what it finds, or an error of the class's own, is one line.
        env = _made(env_id)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                check_env(env, skip_render_check=True)
        except Exception as error:
            fail(
                f"--env-id {env_id} fails Gymnasium's environment checker: "
                f"{type(error).__name__}: {error}"
            )
        finally:
            env.close()
    return taken


def environment_versions(env_id: str) -> dict[str, str]:
    """The versions of the packages that make the environment, for spec.json: the installed
    distributions of the modules of its class and its base classes (MuJoCo's too for Gymnasium's
    MuJoCo tasks); a module that no installed distribution holds (a class on PYTHONPATH) as "not
    installed"."""
    env = _made(env_id)
    try:
        classes = type(env.unwrapped).__mro__
    finally:
        env.close()
    tops = dict.fromkeys(c.__module__.split(".")[0] for c in classes)
    distributions = importlib.metadata.packages_distributions()
    versions = {}
    for top in tops:
        if top in sys.stdlib_module_names or top == "builtins":
            continue
        names = distributions.get(top)
        if not names:
            versions[top] = "not installed"
        for name in names or ():
            versions[name] = importlib.metadata.version(name)
    if any(c.__module__.startswith("gymnasium.envs.mujoco") for c in classes):
        versions["mujoco"] = importlib.metadata.version("mujoco")
    return versions


@functools.cache
def episode_cap(env_id: str) -> int | None:
    """The environment's time limit (its spec's `max_episode_steps`: a registered id's, or one your
    factory makes with `gymnasium.make`), or None where it has none."""
    env = _made(env_id)
    try:
        return env.spec.max_episode_steps if env.spec is not None else None
    finally:
        env.close()


REPLAYED_REWARDS = "cleanba_replayed_rewards"
REPLAYED_END = "cleanba_replayed_end"


class _BroughtBack(gymnasium.Wrapper):
    """An environment that its first reset (the one with the run's seed) brings to where a record
    left it: `resets` resets more, then its current episode's `actions` replayed. That reset's info
    holds the replayed rewards (`REPLAYED_REWARDS`) and whether the last replayed step ended the
    episode (`REPLAYED_END`); if it did, the next step is a reset step, as the vector environment's
    autoreset would have made it."""

    def __init__(self, env, resets: int, actions: np.ndarray):
        super().__init__(env)
        self._resets = resets
        self._actions = actions
        self._brought_back = False
        self._reset_next = False

    def reset(self, *, seed=None, options=None):
        obs, info = self.env.reset(seed=seed, options=options)
        if self._brought_back:
            return obs, info
        self._brought_back = True
        for _ in range(self._resets):
            obs, info = self.env.reset()
        rewards = []
        ended = False
        for action in self._actions:
            obs, reward, terminated, truncated, info = self.env.step(action)
            rewards.append(reward)
            ended = terminated or truncated
        self._reset_next = ended
        # A tuple: the vector environment gathers it in an array of objects (an array it would
        # take for one of a shape that every environment shares).
        return obs, {**info, REPLAYED_REWARDS: tuple(rewards), REPLAYED_END: ended}

    def step(self, action):
        if self._reset_next:
            self._reset_next = False
            obs, info = self.env.reset()
            return obs, 0.0, False, False, info
        return self.env.step(action)


def _brought_back(factory, resets: int, actions: np.ndarray):
    return _BroughtBack(factory(), resets, actions)


VECTORIZATION_MODES = ("sync", "async")


@dataclasses.dataclass
class Film:
    """The film of an evaluation's first episode (`filming`): where its mp4 goes, and its frames
    (time, height, width, 3) once the episode has ended."""

    path: str
    frames: np.ndarray | None = None
    fps: int = 30


FILMING: contextvars.ContextVar = contextvars.ContextVar("filming", default=None)
"""The `Film` that a `GymnasiumVectorEnv` made in this thread's context films, or None"""


@contextlib.contextmanager
def filming(film: Film | None):
    """Within it, a `GymnasiumVectorEnv` made in this thread (a script's `evaluate`) films its
    first environment's first episode into `film` (None: none)."""
    token = FILMING.set(film)
    try:
        yield film
    finally:
        FILMING.reset(token)


def check_filmable(env_id: str):
    """--capture-video: the environment renders `rgb_array` frames here (classic control needs
    pygame, MuJoCo an OpenGL context), and moviepy writes them (one line and exit 2 otherwise)."""
    try:
        import moviepy  # noqa: F401
    except ImportError:
        fail(
            "--capture-video writes its films with moviepy, which is not installed: install the "
            "video extra (`uv sync --extra video`, or `pip install 'cleanba[video]'`)"
        )
    try:
        env = _factory(env_id, render_mode="rgb_array")()
    except TypeError as error:
        fail(
            f"--capture-video: --env-id {env_id} cannot be made with render_mode='rgb_array' "
            f"({error}); give your class Gymnasium's `render_mode` argument"
        )
    try:
        modes = env.metadata.get("render_modes", [])
        if "rgb_array" not in modes:
            fail(
                f"--capture-video: --env-id {env_id} renders {modes or 'nothing'}, not rgb_array "
                "frames"
            )
        env.reset(seed=0)
        try:
            frame = np.asarray(env.render())
        except Exception as error:
            fail(
                f"--capture-video: --env-id {env_id} cannot render a frame here "
                f"({type(error).__name__}: {error})"
            )
        if frame.ndim != 3 or frame.shape[2] != 3:
            fail(
                f"--capture-video: --env-id {env_id} renders frames of shape {frame.shape}, not "
                "(height, width, 3)"
            )
    finally:
        env.close()


class _Filmed(gymnasium.Wrapper):
    """An environment made with render_mode="rgb_array" whose first episode's frames (after its
    reset and each step) go to `film`, written as an mp4 when the episode ends."""

    def __init__(self, env, film: Film):
        super().__init__(env)
        self._film = film
        self._frames = None

    def reset(self, *, seed=None, options=None):
        result = self.env.reset(seed=seed, options=options)
        if self._film.frames is None:
            self._frames = [self.env.render()]
        return result

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self._frames is not None:
            self._frames.append(self.env.render())
            if terminated or truncated:
                self._film.frames = np.stack(self._frames)
                self._film.fps = int(self.env.metadata.get("render_fps") or 30)
                self._frames = None
                _write_film(self._film)
        return obs, reward, terminated, truncated, info


def _write_film(film: Film):
    from moviepy import ImageSequenceClip

    os.makedirs(os.path.dirname(film.path) or ".", exist_ok=True)
    clip = ImageSequenceClip(list(film.frames), fps=film.fps)
    clip.write_videofile(film.path, logger=None)


def _filmed(factory, film: Film):
    return _Filmed(factory(), film)


def _boundary_obs(obs, space: gymnasium.Space):
    """The environments' observations as the scripts take them: images channels first, a stack of
    frames (envs, frames, height, width, channels) as its frames' channels one after another."""
    obs = np.asarray(obs)
    if obs.ndim == 4:
        obs = np.transpose(obs, (0, 3, 1, 2))
    if obs.ndim == 5:
        obs = np.transpose(obs, (0, 1, 4, 2, 3)).reshape(len(obs), *space.shape)
    return np.ascontiguousarray(obs, space.dtype)


def _stacked(factory, frame_stack: int):
    return gymnasium.wrappers.FrameStackObservation(factory(), frame_stack)


def stacked_space(space: gymnasium.Space, frame_stack: int) -> gymnasium.Space:
    """The observation space of `frame_stack` stacked images of `space` (channels first)."""
    if frame_stack == 1:
        return space
    shape = (space.shape[0] * frame_stack, *space.shape[1:])
    return gymnasium.spaces.Box(
        np.full(shape, space.low.flat[0], space.dtype),
        np.full(shape, space.high.flat[0], space.dtype),
        shape,
        space.dtype,
    )


def _in_worker(factory, run_pid: int):
    """The environment of a worker process, which ignores the stop signals: they reach every
    process of the terminal's process group (Ctrl-C) or of the SLURM job step (preemption), and the
    run's process alone decides what a stop does, then ends its workers (`end_workers`). (Gymnasium
    makes one environment in the run's process too, to read its spaces.)"""
    if os.getpid() != run_pid:
        for signum in signals.WATCHED_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
    return factory()


def _vector_env(factories: list, mode: str):
    """Gymnasium's vector environment of `factories` in `mode`, its autoreset envpool's reset
    step."""
    if mode == "sync":
        return gymnasium.vector.SyncVectorEnv(
            factories, autoreset_mode=gymnasium.vector.AutoresetMode.NEXT_STEP
        )
    # forkserver: a worker never inherits the threads (JAX's, the actors') of the process that
    # starts it, whose locks a forked child could find held.
    return gymnasium.vector.AsyncVectorEnv(
        [functools.partial(_in_worker, factory, os.getpid()) for factory in factories],
        autoreset_mode=gymnasium.vector.AutoresetMode.NEXT_STEP,
        context="forkserver",
    )


WITH_WORKERS = weakref.WeakSet()
"""the `GymnasiumVectorEnv`s in async mode"""
ENDING_LOCK = threading.Lock()
"""held while a `GymnasiumVectorEnv` takes its vector environment to end its workers"""


def end_workers():
    """Kills the worker processes of every async `GymnasiumVectorEnv` before the process ends:
    they ignore the stop signals, and a worker that outlived its parent would print the broken pipe
    it finds. The vector environments are then let go of, so that their queues' semaphores are
    removed (not left to multiprocessing's resource tracker, which warns of them)."""
    for envs in list(WITH_WORKERS):
        envs.end_workers()


signals.BEFORE_ENDING.append(end_workers)
# Before multiprocessing's own exit function (registered earlier, so run later), which would
# terminate the workers with a signal they ignore and wait for them.
atexit.register(end_workers)


class GymnasiumVectorEnv:
    """`num_envs` environments of a `gymnasium:` id with envpool's interface (`reset`, `step`,
    `send`/`recv`, `action_space`, `observation_space`, `close`), environment i reset with seed
    `seed + i`, stepped in this process (`mode` "sync") or in worker processes ("async"). With
    `frame_stack` > 1 an image observation is the last `frame_stack` images (Gymnasium's
    `FrameStackObservation`, the first image repeated before it), their channels one after
    another."""

    def __init__(
        self, env_id: str, seed: int, num_envs: int, mode: str = "sync", frame_stack: int = 1
    ):
        observation_space, self.action_space = spaces(env_id)
        self.observation_space = stacked_space(observation_space, frame_stack)
        self.factory = _factory(env_id)
        filmed_factory = _factory(env_id, render_mode="rgb_array")
        if frame_stack > 1:
            self.factory = functools.partial(_stacked, self.factory, frame_stack)
            filmed_factory = functools.partial(_stacked, filmed_factory, frame_stack)
        factories = [self.factory] * num_envs
        film = FILMING.get()
        if film is not None:
            # The filmed environment steps in this process, which hands its frames on.
            factories[0] = functools.partial(_filmed, filmed_factory, film)
            mode = "sync"
        self.mode = mode
        self.envs = _vector_env(factories, mode)
        if mode == "async":
            WITH_WORKERS.add(self)
        self.num_envs = num_envs
        self.seed = seed
        self.env_ids = np.arange(num_envs, dtype=np.int32)
        self._sent = None

    def restore(self, resets: np.ndarray, episode_actions: list[np.ndarray]):
        """Makes the environments anew and brings environment i to where a record left it: reset
        with seed `seed + i`, then `resets[i]` times more, then `episode_actions[i]` replayed.
        Returns (observations, ended: the environments whose next step is a reset step, and per
        environment the replayed rewards)."""
        self.envs.close()
        self.envs = _vector_env(
            [
                functools.partial(_brought_back, self.factory, int(count), actions)
                for count, actions in zip(resets, episode_actions)
            ],
            self.mode,
        )
        obs, info = self.envs.reset(seed=self.seed)
        ended = np.asarray(info[REPLAYED_END], bool)
        rewards = [np.asarray(replayed, np.float32) for replayed in info[REPLAYED_REWARDS]]
        return _boundary_obs(obs, self.observation_space), ended, rewards

    def reset(self):
        obs, _ = self.envs.reset(seed=self.seed)
        return _boundary_obs(obs, self.observation_space), {"env_id": self.env_ids.copy()}

    def _taken(self, stepped):
        obs, rewards, terminations, truncations, _ = stepped
        return (
            _boundary_obs(obs, self.observation_space),
            np.asarray(rewards, np.float32),
            np.asarray(terminations, bool),
            np.asarray(truncations, bool),
            {"env_id": self.env_ids.copy()},
        )

    def _given(self, actions):
        return np.asarray(actions).astype(self.envs.single_action_space.dtype)

    def step(self, actions):
        return self._taken(self.envs.step(self._given(actions)))

    def send(self, actions):
        """Starts a step: the worker processes step while the caller goes on (async); in this
        process the step is taken at `recv` (sync)."""
        if self.mode == "async":
            self.envs.step_async(self._given(actions))
        else:
            self._sent = actions

    def recv(self):
        if self.mode == "async":
            return self._taken(self.envs.step_wait())
        return self.step(self._sent)

    def close(self):
        self.envs.close()

    def __del__(self):
        # Gymnasium's own deletion would end the workers with SIGTERM, which they ignore.
        if getattr(self, "mode", None) == "async":
            self.end_workers()

    def end_workers(self):
        """Kills the workers and lets go of the vector environment (`end_workers`), once, whichever
        thread asks first. An actor thread waiting for them gets an error and ends within
        WORKERS_GONE_SECONDS; the process is ending."""
        with ENDING_LOCK:
            envs = getattr(self, "envs", None)
            self.envs = None
        if envs is None:
            return
        for process in envs.processes:
            process.kill()
        for process in envs.processes:
            process.join()
        # Closed already: its deletion would otherwise close it again, waiting for the step in
        # flight.
        envs.closed = True
        gone = weakref.ref(envs)
        del envs
        deadline = time.monotonic() + WORKERS_GONE_SECONDS
        while gone() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
