"""The random baseline R_rand of SLM Lab's metrics: the mean return of a policy that draws every
action uniformly from the action space, measured by playing it.

    python -m cleanba_utils.experiments.random_baseline CartPole-v1 HalfCheetah-v4

Where it comes from, first match:
1. the spec's `[random_scores]`, if it names the environment;
2. the published random score of the 57 Atari games (atari57_random_human.csv);
3. the cache, `random_baselines.json` in the experiment folder, keyed by environment id and
   envpool version;
4. a measurement: envpool's environment with its default options (gymnasium API), played in
   batches of BATCH_EPISODES episodes, one episode per environment instance (so that short
   episodes are not over-counted), environment i of batch k seeded with k * BATCH_EPISODES + i and
   the actions drawn from a numpy generator seeded with k; batches are added until the standard
   error of the mean is under RELATIVE_SE of its magnitude, or MAX_EPISODES episodes were played.
   The result is written to the cache.
If envpool cannot make the environment, R_rand is 0, as SLM Lab takes it when it has no baseline,
and the source says so.

SLM Lab's own baseline is 100 episodes of a random policy, each in its environment as gym makes it.
`under_script` measures it that way for any task, Atari included, in the environments of a
training script (its `make_env`, with its flags): one episode in each of SCRIPT_EPISODES
environments, environment i seeded with i, an action per environment drawn uniformly at every step
from a numpy generator seeded with 0, returns counted as the script's evaluation counts them
(unclipped; whole games where the script defines `episode_over`, as GALA's A2C does). It is cached
as the other measurements are, keyed by environment, command, episodes and envpool version, and
keeps the published Atari random score beside it.

    python -m cleanba_utils.experiments.random_baseline Breakout-v5 \\
        --command "python cleanba/cleanba_ppo.py" [--episodes 100]
"""

import argparse
import importlib.util
import json
import math
import shlex
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np

from cleanba_utils.evaluation_episodes import ended, play_episodes
from cleanba_utils.experiments import cli
from cleanba_utils.run_files import write_json_atomically

BATCH_EPISODES = 100  # SLM Lab plays 100 episodes
MAX_EPISODES = 3000
RELATIVE_SE = 0.02
CACHE_NAME = "random_baselines.json"
SCRIPT_EPISODES = 100  # SLM Lab's random baseline: 100 episodes of a random policy


class RandomBaseline(NamedTuple):
    mean: float
    std: float  # of the episodes' returns (n - 1 in the denominator); NaN if not measured here
    standard_error: float  # std / sqrt(episodes); NaN if not measured here
    episodes: int  # 0 if not measured here
    source: str
    published_score: float = math.nan  # the published Atari random score; NaN for other tasks


class TrainingScript(NamedTuple):
    """A training command's script file and the flags it passes to it."""

    path: Path
    flags: list[str]


def random_actions(space, num_envs: int, rng: np.random.Generator) -> np.ndarray:
    """One uniformly drawn action per environment: Discrete(n) or a bounded Box."""
    if hasattr(space, "n"):
        return rng.integers(int(space.n), size=num_envs)
    if hasattr(space, "low") and np.isfinite(space.low).all() and np.isfinite(space.high).all():
        return rng.uniform(space.low, space.high, size=(num_envs, *space.shape)).astype(space.dtype)
    raise ValueError(f"no uniform draw from the action space {space}")


def play_random(env_id: str, num_episodes: int, seed: int, action_seed: int) -> np.ndarray:
    """The returns of one random-play episode in each of `num_episodes` environments."""
    import envpool

    rng = np.random.default_rng(action_seed)
    returns = np.zeros(num_episodes)
    finished = np.zeros(num_episodes, dtype=bool)
    with warnings.catch_warnings():  # gymnasium's on the float64 bounds of envpool's spaces
        warnings.simplefilter("ignore", UserWarning)
        envs = envpool.make(env_id, env_type="gymnasium", num_envs=num_episodes, seed=seed)
        envs.reset()
        space = envs.action_space
        while not finished.all():
            actions = random_actions(space, num_episodes, rng)
            _, reward, terminated, truncated, _ = envs.step(actions)
            returns += np.where(finished, 0.0, reward)
            finished |= terminated | truncated
    envs.close()
    return returns


def measure(env_id: str, play=play_random) -> RandomBaseline:
    """Random play in batches until the standard error is small enough (see the module's text);
    `play(env_id, num_episodes, seed, action_seed)` returns the episodes' returns."""
    import envpool

    returns = np.array([])
    precise = False
    while not precise and len(returns) < MAX_EPISODES:
        batch = len(returns) // BATCH_EPISODES
        played = play(env_id, BATCH_EPISODES, seed=batch * BATCH_EPISODES, action_seed=batch)
        returns = np.concatenate([returns, played])
        standard_error = float(returns.std(ddof=1) / np.sqrt(len(returns)))
        precise = standard_error < RELATIVE_SE * abs(returns.mean())
    target = f"{RELATIVE_SE:.0%} of the mean"
    stop = f"under {target}" if precise else f"{target} or more at the cap of {MAX_EPISODES}"
    source = (
        f"random play, {len(returns)} episodes, envpool {envpool.__version__}, standard error "
        f"{stop}"
    )
    return RandomBaseline(
        mean=float(returns.mean()),
        std=float(returns.std(ddof=1)),
        standard_error=standard_error,
        episodes=len(returns),
        source=source,
    )


def cache_key(env_id: str) -> str:
    import envpool

    return f"{env_id} envpool {envpool.__version__}"


def read_cache(cache_dir: Path | None, key: str) -> RandomBaseline | None:
    """The baseline cached under `key` in cache_dir/CACHE_NAME, its source saying so; None if there
    is none (`cache_dir` None: no cache). A null number is NaN."""
    if cache_dir is None or not (path := Path(cache_dir) / CACHE_NAME).is_file():
        return None
    record = json.loads(path.read_text()).get(key)
    if record is None:
        return None

    def number(name):
        return math.nan if record.get(name) is None else record[name]

    return RandomBaseline(
        mean=record["mean"],
        std=number("std"),
        standard_error=number("standard_error"),
        episodes=record["episodes"],
        source=f"{record['source']}; read from {path}",
        published_score=number("published_score"),
    )


def write_cache(cache_dir: Path | None, key: str, baseline: RandomBaseline):
    """Adds `baseline` under `key` to cache_dir/CACHE_NAME, a NaN as null (JSON has no NaN)."""
    if cache_dir is None:
        return
    path = Path(cache_dir) / CACHE_NAME
    cached = json.loads(path.read_text()) if path.is_file() else {}
    record = {
        name: None if isinstance(value, float) and math.isnan(value) else value
        for name, value in baseline._asdict().items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(path, cached | {key: record})


def published_score(env_id: str) -> float:
    """The published random score of one of the 57 Atari games (atari57_random_human.csv); NaN for
    another task."""
    from cleanba_utils.experiments.hns import reference_scores

    scores = reference_scores()
    return scores[env_id][0] if env_id in scores else math.nan


def random_baseline(env_id: str, spec: dict, cache_dir: Path | None, play=play_random):
    """R_rand of `env_id` and where it came from (see the module's text); `cache_dir` None: no
    cache."""
    given = spec.get("random_scores") or {}
    if env_id in given:
        return RandomBaseline(float(given[env_id]), np.nan, np.nan, 0, "spec random_scores")
    published = published_score(env_id)
    if not math.isnan(published):
        return RandomBaseline(
            published, np.nan, np.nan, 0, "published Atari random score", published
        )
    key = cache_key(env_id)
    if (cached := read_cache(cache_dir, key)) is not None:
        return cached
    try:
        measured = measure(env_id, play)
    except Exception as error:  # envpool's errors for an unknown id are of several types
        source = f"none: envpool cannot play {env_id} ({type(error).__name__}); 0, as in SLM Lab"
        return RandomBaseline(0.0, np.nan, np.nan, 0, source)
    write_cache(cache_dir, key, measured)
    return measured


def training_script(command: str, launch_dir: Path) -> TrainingScript:
    """The script and flags of a training command as the launcher takes it, `python
    cleanba/cleanba_ppo.py FLAGS` or `python -m cleanba.cleanba_ppo FLAGS`; a relative path is
    taken from `launch_dir`, the folder the command runs in. A ValueError says what is wrong."""
    tokens = shlex.split(command)
    for index, (previous, token) in enumerate(zip(["", *tokens], tokens)):
        if previous == "-m":
            relative = Path(*token.split(".")).with_suffix(".py")
        elif token.endswith(".py"):
            relative = Path(token)
        else:
            continue
        path = relative if relative.is_absolute() else Path(launch_dir) / relative
        if not path.is_file():
            raise ValueError(f"the training command's script {path} is not a file")
        return TrainingScript(path, tokens[index + 1 :])
    raise ValueError(
        f"the training command {command!r} names no script; give one such as "
        '"python cleanba/cleanba_ppo.py"'
    )


def load_script(path: Path):
    """The training script at `path` as a module (its `main` does not run)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not all(hasattr(module, name) for name in ("parse_args", "make_env")):
        raise ValueError(f"{path} is not a training script: it has no parse_args and make_env")
    return module


def play_under_script(script: TrainingScript, env_id: str, num_episodes: int) -> np.ndarray:
    """The returns of one random-play episode in each of `num_episodes` environments of the script
    (see the module's text)."""
    module = load_script(script.path)
    args = module.parse_args([*script.flags, "--env-id", env_id])
    envs = module.make_env(args, 0, num_episodes)
    rng = np.random.default_rng(0)
    space = envs.action_space
    returns = play_episodes(
        envs,
        num_episodes,
        lambda obs, step: random_actions(space, num_episodes, rng),
        episode_over=getattr(module, "episode_over", ended),
    )
    return np.array(returns)


def under_script(
    env_id: str,
    script: TrainingScript,
    num_episodes: int,
    cache_dir: Path | None,
    play=play_under_script,
) -> RandomBaseline:
    """SLM Lab's random baseline of `env_id` measured in the environments of `script` (see the
    module's text); `play(script, env_id, num_episodes)` returns the episodes' returns."""
    import envpool

    command = shlex.join([script.path.name, *script.flags])
    key = f"{env_id} under {command}, {num_episodes} episodes, envpool {envpool.__version__}"
    if (cached := read_cache(cache_dir, key)) is not None:
        return cached
    returns = play(script, env_id, num_episodes)
    std = float(returns.std(ddof=1)) if num_episodes > 1 else math.nan
    measured = RandomBaseline(
        mean=float(returns.mean()),
        std=std,
        standard_error=std / math.sqrt(num_episodes),
        episodes=num_episodes,
        source=(
            f"random play, {num_episodes} episodes in {script.path.name}'s environments, envpool "
            f"{envpool.__version__}"
        ),
        published_score=published_score(env_id),
    )
    write_cache(cache_dir, key, measured)
    return measured


def baseline_line(env_id: str, baseline: RandomBaseline) -> str:
    """One line: the baseline, its spread, where it came from, and the published score beside a
    measured one."""
    line = (
        f"{env_id}: {baseline.mean:.4g} +- {baseline.standard_error:.2g} (standard error), "
        f"std {baseline.std:.4g}; {baseline.source}"
    )
    if baseline.episodes and not math.isnan(baseline.published_score):
        line += f"; published Atari random score {baseline.published_score:.4g}"
    return line


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m cleanba_utils.experiments.random_baseline",
        description="Measure the mean return of uniformly random play with envpool.",
    )
    parser.add_argument("env_ids", nargs="+", help="envpool environment ids")
    parser.add_argument(
        "--cache-dir", type=Path, help=f"keep the results in DIR/{CACHE_NAME} (default: none)"
    )
    parser.add_argument(
        "--command",
        help='a training command, e.g. "python cleanba/cleanba_ppo.py": play --episodes episodes '
        "in its script's environments, SLM Lab's baseline, for any task (Atari included)",
    )
    parser.add_argument(
        "--episodes",
        type=cli.positive_int,
        help=f"with --command: random-play episodes (default {SCRIPT_EPISODES}, SLM Lab's)",
    )
    cli.one_line_errors(parser, "random_baseline")
    args = parser.parse_args(argv)
    if args.episodes is not None and args.command is None:
        parser.error("--episodes needs --command")
    try:
        script = None if args.command is None else training_script(args.command, Path.cwd())
        for env_id in args.env_ids:
            if script is None:
                baseline = random_baseline(env_id, {}, args.cache_dir)
            else:
                episodes = args.episodes or SCRIPT_EPISODES
                baseline = under_script(env_id, script, episodes, args.cache_dir)
            print(baseline_line(env_id, baseline))
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
