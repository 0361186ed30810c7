"""Runs the learning tests' commands (tests/test_learning.py) on seeds 1-10 and prints what each test
checks, per seed, so that a threshold is chosen from ten runs of this machine rather than one.

python benchmark/learning_test_seeds.py                      # every learning test, seeds 1-10
python benchmark/learning_test_seeds.py ppo --seeds 1 2 3    # one test, three seeds
python benchmark/learning_test_seeds.py ppo --set --learning-rate 0   # a broken learner must fail

`--set FLAG VALUE ...` overrides flags of the test's command (a learning rate of 0 is a learner that
does not learn). The returns of every run are kept in --work-dir/<test>/seed_<n>.json.
"""

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from test_learning import LEARNING_TESTS, learning_score  # noqa: E402

from cleanba_utils.experiments.events import read_scalars  # noqa: E402


def with_overrides(args: list[str], overrides: list[str]) -> list[str]:
    """`args` with each `--flag value` pair of `overrides` replacing the same flag's value (or
    appended)."""
    args = list(args)
    for flag, value in zip(overrides[::2], overrides[1::2], strict=True):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


def run_seed(name: str, seed: int, overrides: list[str], work_dir: Path) -> dict:
    test = LEARNING_TESTS[name]
    args = with_overrides(
        test.args, ["--seed", str(seed), "--run-name", f"seed_{seed}", *overrides]
    )
    cwd = work_dir / name
    cwd.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={test.devices}")
    result = subprocess.run(
        [sys.executable, str(REPO / "cleanba" / test.script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed: {result.stderr[-2000:]}")
    returns = read_scalars(cwd / "runs" / f"seed_{seed}").values.tolist()
    record = dict(
        test=name, seed=seed, overrides=overrides, returns=returns, score=learning_score(returns)
    )
    (cwd / f"seed_{seed}.json").write_text(json.dumps(record))
    return record


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "tests", nargs="*", default=list(LEARNING_TESTS), choices=list(LEARNING_TESTS)
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(1, 11)))
    parser.add_argument("--set", nargs="+", default=[], dest="overrides", metavar="FLAG_OR_VALUE")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cleanba-learning-seeds"))
    options = parser.parse_args()
    for name in options.tests:
        with ThreadPoolExecutor(options.jobs) as pool:
            records = list(
                pool.map(
                    lambda seed: run_seed(name, seed, options.overrides, options.work_dir),
                    options.seeds,
                )
            )
        scores = [record["score"] for record in records]
        threshold = LEARNING_TESTS[name].threshold
        print(f"{name} {' '.join(options.overrides)}: threshold {threshold}", flush=True)
        for record in records:
            print(
                f"  seed {record['seed']}: {record['score']:.1f} ({len(record['returns'])} episodes)",
                flush=True,
            )
        print(
            f"  worst {min(scores):.1f}, mean {np.mean(scores):.1f}, best {max(scores):.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
