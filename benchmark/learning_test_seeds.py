"""Runs the learning tests' commands (tests/test_learning.py) on seeds 1-10 and prints what each
test checks, per seed, so that a threshold is chosen from ten runs rather than one.

    python benchmark/learning_test_seeds.py                       # every learning test, seeds 1-10
    python benchmark/learning_test_seeds.py ppo --seeds 1 2 3     # one test, three seeds
    python benchmark/learning_test_seeds.py ppo --broken ascent   # a broken learner must fail

`--set FLAG=VALUE ...` overrides flags of the test's command (`--set core=none num-steps=64`: each
`--flag value` replaced, or added). `--broken` runs the script with its
learner broken on purpose, to check that the test fails it: `frozen` multiplies every gradient by 0
(a learning rate of 0), `ascent` by -1 (the wrong sign), `shuffled` permutes the actions of the
loss's batch (with their behaviour log-probabilities) with a fixed permutation of all its samples,
so that every advantage (Ape-X: every n-step target) is credited to another sample's action. The
returns of every run are kept in --work-dir/<test>[_<broken>]/seed_<n>.json.
"""

import argparse
import functools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from test_learning import LEARNING_TESTS, learning_score, returns_in_step_order  # noqa: E402

# The loss function of each script, whose batch `--broken shuffled` misaligns.
LOSS = {
    "ppo": "ppo_loss",
    "impala": "impala_loss",
    "apex_dqn": "dqn_loss",
    "gala_a2c": "a2c_loss",
    "sac": "critic_loss",
    "apex_dpg": "critic_loss",
    "ppo_continuous": "ppo_loss",
}

BROKEN_PROGRAM = """
import sys

import jax
import jax.numpy as jnp
import numpy as np

import cleanba.{module} as script

MODE = {mode!r}
LOSS = {loss!r}


def scaled(transform, scale, gradient_index):
    def transformed(fun, *args, **kwargs):
        compute = transform(fun, *args, **kwargs)
        has_aux = kwargs.get("has_aux", False)

        def call(*call_args, **call_kwargs):
            out = compute(*call_args, **call_kwargs)
            scale_tree = lambda tree: jax.tree.map(lambda x: scale * x, tree)
            if gradient_index is None:
                return (scale_tree(out[0]), out[1]) if has_aux else scale_tree(out)
            return out[0], scale_tree(out[1])

        return call

    return transformed


# The same fixed permutation of all samples (every axis of the actions) of a batch.
def permute(x):
    order = np.random.default_rng(0).permutation(x.size)
    return jnp.take(x.reshape(-1), jnp.asarray(order)).reshape(x.shape)


# The loss of a batch whose actions (with their behaviour log-probabilities) belong to other
# samples: every advantage or target is credited to another sample's action.
def misaligned(*args, **kwargs):
    args = list(args)
    batch = kwargs["batch"] if "batch" in kwargs else args[2]
    fields = [name for name in ("actions", "logprobs") if name in batch._fields]
    batch = batch._replace(**{{name: permute(getattr(batch, name)) for name in fields}})
    if "batch" in kwargs:
        kwargs["batch"] = batch
    else:
        args[2] = batch
    return ORIGINAL(*args, **kwargs)


if MODE == "shuffled":
    ORIGINAL = getattr(script, LOSS)
    setattr(script, LOSS, misaligned)
else:
    scale = 0.0 if MODE == "frozen" else -1.0
    jax.value_and_grad = scaled(jax.value_and_grad, scale, gradient_index=1)
    jax.grad = scaled(jax.grad, scale, gradient_index=None)
script.main(sys.argv[1:])
"""


def with_overrides(args: list[str], overrides: list[str]) -> list[str]:
    """`args` with each `--flag value` pair of `overrides` replacing that flag's value (or
    added)."""
    args = list(args)
    for flag, value in zip(overrides[::2], overrides[1::2], strict=True):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


def flag_and_value(text: str) -> tuple[str, str]:
    """`core=none` as `("--core", "none")`."""
    flag, equals, value = text.partition("=")
    if not equals or not flag:
        raise argparse.ArgumentTypeError(f"{text!r}: give FLAG=VALUE, e.g. core=none")
    return f"--{flag.removeprefix('--')}", value


def run_seed(name: str, seed: int, overrides: list[str], work_dir: Path, broken: str | None):
    test = LEARNING_TESTS[name]
    run_name = f"seed_{seed}"
    args = with_overrides(test.args, ["--seed", str(seed), "--run-name", run_name, *overrides])
    cwd = work_dir / (f"{name}_{broken}" if broken else name)
    cwd.mkdir(parents=True, exist_ok=True)
    if broken:
        program = BROKEN_PROGRAM.format(
            module=test.script.removesuffix(".py"), mode=broken, loss=LOSS[name]
        )
        command = [sys.executable, "-c", program, *args]
    else:
        command = [sys.executable, str(REPO / "cleanba" / test.script), *args]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={test.devices}")
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed: {result.stderr[-2000:]}")
    returns = returns_in_step_order(cwd / "runs" / run_name)
    record = dict(
        test=name,
        seed=seed,
        overrides=overrides,
        broken=broken,
        returns=returns,
        score=learning_score(returns, test.episodes),
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
    parser.add_argument(
        "--set", nargs="+", default=[], dest="settings", metavar="FLAG=VALUE", type=flag_and_value
    )
    parser.add_argument("--broken", choices=["frozen", "ascent", "shuffled"])
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cleanba-learning-seeds"))
    options = parser.parse_args()
    options.overrides = [word for setting in options.settings for word in setting]
    for name in options.tests:
        run = functools.partial(
            run_seed,
            name,
            overrides=options.overrides,
            work_dir=options.work_dir,
            broken=options.broken,
        )
        with ThreadPoolExecutor(options.jobs) as pool:
            records = list(pool.map(run, options.seeds))
        scores = [record["score"] for record in records]
        broken = f" --broken {options.broken}" if options.broken else ""
        label = " ".join([name, *options.overrides]) + broken
        print(f"{label}: threshold {LEARNING_TESTS[name].threshold}", flush=True)
        for record in records:
            episodes = len(record["returns"])
            print(f"  seed {record['seed']}: {record['score']:.2f} ({episodes} episodes)")
        print(f"  worst {min(scores):.2f}, mean {np.mean(scores):.2f}, best {max(scores):.2f}")


if __name__ == "__main__":
    main()
