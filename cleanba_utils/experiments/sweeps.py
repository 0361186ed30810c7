"""The settings of an experiment: `--sweep "--flag=v1,v2"` (or a range) parsed, the whole grid of
settings or random draws from it, and the runs of one setting (one per game and seed)."""

import itertools
import math
import random
import re

from cleanba_utils.env_ids import name_part

# Flags the launcher sets on every run; a command or sweep that also set them would clash silently.
LAUNCHER_FLAGS = ("--env-id", "--seed", "--group", "--run-name", "--resume")
DISTRIBUTIONS = {
    "uniform": lambda rng, low, high: rng.uniform(low, high),
    "loguniform": lambda rng, low, high: math.exp(rng.uniform(math.log(low), math.log(high))),
    "int": lambda rng, low, high: rng.randint(int(low), int(high)),
}


def parse_sweep(text):
    """`--flag=a,b` -> (flag, ["a", "b"]); `--flag=loguniform(1e-4,1e-3)` -> (flag, ("loguniform",
    1e-4, 1e-3))."""
    flag, _, values = text.partition("=")
    if not re.fullmatch(r"--[A-Za-z][\w-]*", flag) or not values:
        raise ValueError(f'bad --sweep {text!r}; write it as --sweep "--flag=value1,value2"')
    if flag in LAUNCHER_FLAGS:
        raise ValueError(
            f"--sweep {flag} is set by the launcher per run; sweep the flags of the training "
            "script only"
        )
    distribution = re.fullmatch(r"(\w+)\((.*)\)", values)
    if distribution is None:
        if "" in [value.strip() for value in values.split(",")]:
            raise ValueError(
                f"--sweep {text!r} has an empty value; separate the values with single commas"
            )
        return flag, values.split(",")
    name, bounds = distribution.groups()
    try:
        low, high = (float(bound) for bound in bounds.split(","))
    except ValueError:
        low = math.nan
        high = math.nan
    integers = name != "int" or (low.is_integer() and high.is_integer())
    if (
        name not in DISTRIBUTIONS
        or not low < high
        or (name == "loguniform" and low <= 0)
        or not integers
    ):
        raise ValueError(
            f"bad range in --sweep {text!r}; use uniform(LOW,HIGH), loguniform(LOW,HIGH) or "
            "int(LOW,HIGH) with LOW < HIGH (and LOW > 0 for loguniform, integers for int)"
        )
    return flag, (name, low, high)


def grid_settings(sweeps):
    """All settings of the grid, each a list of (flag, value) pairs; no sweep is one empty
    setting."""
    flags = [flag for flag, _ in sweeps]
    return [
        list(zip(flags, values)) for values in itertools.product(*[values for _, values in sweeps])
    ]


def random_settings(sweeps, budget, seed):
    """`budget` settings drawn with `seed`: distinct grid points, or independent draws when a flag
    has a range."""
    rng = random.Random(seed)
    if all(isinstance(values, list) for _, values in sweeps):
        grid = grid_settings(sweeps)
        if budget > len(grid):
            raise ValueError(
                f"--budget {budget} is larger than the grid of {len(grid)} settings; lower --budget"
            )
        return rng.sample(grid, budget)

    def draw(values):
        if isinstance(values, list):
            return rng.choice(values)
        name, low, high = values
        value = DISTRIBUTIONS[name](rng, low, high)
        return str(value) if name == "int" else f"{value:.4g}"

    return [[(flag, draw(values)) for flag, values in sweeps] for _ in range(budget)]


def trial_runs(command, env_ids, seeds, index, setting, experiment, resume):
    """One (run name, argv) per game x seed of the setting numbered `index`."""
    setting_args = [token for flag, value in setting for token in [flag, *value.split()]]
    runs = []
    for env_id, seed in itertools.product(env_ids, seeds):
        run_name = f"{name_part(env_id)}__{experiment}__{index}__{seed}"
        launcher_args = [
            "--env-id",
            env_id,
            "--seed",
            str(seed),
            "--group",
            f"{experiment}/{index}",
            "--run-name",
            run_name,
        ]
        if resume:
            launcher_args.append("--resume")
        runs.append((run_name, command + setting_args + launcher_args))
    return runs
