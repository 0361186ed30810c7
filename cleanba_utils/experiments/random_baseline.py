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
"""

import argparse
import json
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np

from cleanba_utils.experiments import cli
from cleanba_utils.run_files import write_json_atomically

BATCH_EPISODES = 100  # SLM Lab plays 100 episodes
MAX_EPISODES = 3000
RELATIVE_SE = 0.02
CACHE_NAME = "random_baselines.json"


class RandomBaseline(NamedTuple):
    mean: float
    std: float  # of the episodes' returns (n - 1 in the denominator); NaN if not measured here
    standard_error: float  # std / sqrt(episodes); NaN if not measured here
    episodes: int  # 0 if not measured here
    source: str


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


def random_baseline(env_id: str, spec: dict, cache_dir: Path | None, play=play_random):
    """R_rand of `env_id` and where it came from (see the module's text); `cache_dir` None: no
    cache."""
    given = spec.get("random_scores") or {}
    if env_id in given:
        return RandomBaseline(float(given[env_id]), np.nan, np.nan, 0, "spec random_scores")
    from cleanba_utils.experiments.hns import reference_scores

    if env_id in reference_scores():
        score = reference_scores()[env_id][0]
        return RandomBaseline(score, np.nan, np.nan, 0, "published Atari random score")
    path = None if cache_dir is None else Path(cache_dir) / CACHE_NAME
    cached = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    key = cache_key(env_id)
    if key in cached:
        record = cached[key]
        return RandomBaseline(
            mean=record["mean"],
            std=record["std"],
            standard_error=record["standard_error"],
            episodes=record["episodes"],
            source=f"{record['source']}; read from {path}",
        )
    try:
        measured = measure(env_id, play)
    except Exception as error:  # envpool's errors for an unknown id are of several types
        source = f"none: envpool cannot play {env_id} ({type(error).__name__}); 0, as in SLM Lab"
        return RandomBaseline(0.0, np.nan, np.nan, 0, source)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomically(path, cached | {key: measured._asdict()})
    return measured


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m cleanba_utils.experiments.random_baseline",
        description="Measure the mean return of uniformly random play with envpool.",
    )
    parser.add_argument("env_ids", nargs="+", help="envpool environment ids")
    parser.add_argument(
        "--cache-dir", type=Path, help=f"keep the results in DIR/{CACHE_NAME} (default: none)"
    )
    cli.one_line_errors(parser, "random_baseline")
    args = parser.parse_args(argv)
    for env_id in args.env_ids:
        baseline = random_baseline(env_id, {}, args.cache_dir)
        print(
            f"{env_id}: {baseline.mean:.4g} +- {baseline.standard_error:.2g} (standard error), "
            f"std {baseline.std:.4g}; {baseline.source}"
        )


if __name__ == "__main__":
    main()
