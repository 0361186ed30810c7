"""The Atari actor's ceiling and the time breakdown of PPO and IMPALA on one GPU machine: envpool
alone, the learner alone, and the scripts' whole runs, one measurement at a time.

On the GPU machine (Python 3.12 without uv; the packages its image lacks unpacked from
.gpu/site.tgz, which ../shared/gpu/prepare.sh makes with .gpu/orig), from the repository root:

    mkdir -p /tmp/site && tar xzf .gpu/site.tgz -C /tmp/site
    PYTHONPATH=$PWD:/tmp/site python3 benchmark/speed_gpu.py --out $OUT/speed_gpu \
        --original-dir .gpu/orig --budget 540

On a CPU machine, a tiny network and tiny sizes (what tests/test_speed_gpu.py runs):

    uv run python benchmark/speed_gpu.py --small --out /tmp/speed_gpu

Sections (--sections, any subset, in this order), all on Breakout-v5 with the scripts' defaults
(--small: a tiny network and 4 environments per actor thread):
- envpool: the ceiling of the actor. `cleanba_utils.envs.make_env` as the PPO script's actor
  threads call it (same task, environments per thread and seeds), random actions, no network and
  no learner: one Python thread per actor thread, all at once, for --env-seconds after a warm-up
  of a fifth of that; environment steps per second over every thread. Variants: (a) one envpool
  instance per thread, synchronous `step`, with the worker threads the scripts give an instance
  (the process's CPUs shared among the instances: 8 on 16 CPUs and 2 actor threads); (b) the same
  with one worker thread per CPU (16); (c) two instances of half the environments per thread,
  stepped alternately (receive from one, send its actions, then the other; every receive holds all
  of an instance's environments) with the worker threads of (a) and of (b) per instance.
- learner: each script's learner update at its default sizes in a process of its own, built as its
  `train` builds it (`init_state`, `make_update` on the learner devices) and fed a synthetic
  rollout of the actors' shapes and types, put on the learner device as the actors put it; two
  warm-up updates, then updates for --learner-seconds (3 at least), each waited for. Once without
  deterministic GPU operations (the script's --nondeterministic-gpu-ops where it takes it) and once
  with `--xla_gpu_deterministic_ops=true` appended to XLA_FLAGS (XLA reads them when its backend
  starts, hence a process each; on a CPU both are the same). Seconds per update (the median), and
  the FLOP rate: the FLOPs of an update from XLA's cost analysis of the compiled programs (the
  rollout's preparation, plus one microbatch step times the steps of the update: the analysis of
  the update's own rolled loop counts its body once), counted in the first process of each script
  (the same arithmetic either way), over the seconds per update, and as shares of NVIDIA's dense
  peaks for the device (`PEAKS`); beside it the count of the same programs as JAX lowers them,
  before XLA's passes (`update_flops`).
- runs: `cleanba/cleanba_ppo.py` and `cleanba/cleanba_impala.py` at their defaults, --env-id
  Breakout-v5, --log-frequency 1, only --total-timesteps shortened (--ppo-timesteps,
  --impala-timesteps), without deterministic GPU operations and with them: where the script takes
  --nondeterministic-gpu-ops, that option and its default (the option is refused, so the run not
  made, off a GPU); otherwise XLA_FLAGS as they are and with `--xla_gpu_deterministic_ops=true`
  appended. With --original-dir (the original cleanba's PPO and IMPALA ported to today's stack, as
  ../shared/gpu/prepare.sh makes .gpu/orig) those at their defaults; with --before-dir (an older
  copy of this project) its scripts at theirs, with that copy first on PYTHONPATH. In this order:
  for each script ours without deterministic operations and the original's, then ours with them,
  then (on a GPU) ours with them and the CPU's values of the options whose default is the
  platform's (`CPU_DEFAULTS`: one envpool instance per actor thread, PPO's 4 microbatches), then the
  older copy's. Each run in a temporary folder of its own, one at a time, for
  --run-timeout seconds at most: steady SPS from its TensorBoard events (charts/learning_rate,
  from its 2nd point to its last: steps over event wall time), its exit code and last line of
  stderr, and the medians after the first update of the learner's and the rollout's seconds per
  update where the run logs them (stats/learn_time: ours; stats/rollout_time).

Writes OUT/speed_gpu.csv (one row per measurement, rewritten after each), OUT/speed_gpu.md (the
tables and ratios printed at the end: ours over the original, over the older copy, over the best
envpool variant) and OUT/logs/ (the last 40 lines of each process's output). This process never
starts a JAX backend (a process of its own asks which one JAX has). --budget starts nothing once
that many seconds have passed and cuts each process's timeout to the time left, so that the tables
are written before an outer time limit.
"""

import argparse
import contextlib
import csv
import dataclasses
import functools
import importlib
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import envpool
import jax
import numpy as np
from csv_columns import RUN_COLUMNS
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cleanba_utils import kept_lag
from cleanba_utils.devices import replicate
from cleanba_utils.envs import envpool_num_threads, has_image_observations, make_env
from cleanba_utils.microbatches import microbatch_update, rolls

REPO = Path(__file__).resolve().parents[1]
INHERITED_ENVIRONMENT = dict(os.environ)
"""The environment this process started with, for its children: parsing a script's options appends
the deterministic flag to this process's XLA_FLAGS (`cleanba_utils.accelerators`)."""
ENV_ID = "Breakout-v5"
ALGORITHMS = ("ppo", "impala")
SECTIONS = ("envpool", "learner", "runs")
TIMESTEPS = {"ppo": 131_072, "impala": 204_800}
SMALL_SIZES = ["--local-num-envs", "4", "--num-steps", "8", "--num-minibatches", "2"]
SMALL_NETWORK = ["--channels", "4", "--hiddens", "32"]
SMALL = {
    "ppo": [
        *SMALL_SIZES,
        *SMALL_NETWORK,
        "--update-epochs",
        "2",
        "--gradient-accumulation-steps",
        "1",
    ],
    "impala": [*SMALL_SIZES, *SMALL_NETWORK],
}
"""--small: the options of each script (and of the original's, which has the same ones)."""
SMALL_UPDATES = 4
"""--small: the updates of each whole run (2 actor threads x 4 environments x 8 steps each)."""
CPU_DEFAULTS = {
    "ppo": ["--env-splits", "1", "--gradient-accumulation-steps", "4"],
    "impala": ["--env-splits", "1"],
}
"""The CPU's values of the options whose default depends on the platform (the scripts'
`PLATFORM_DEFAULTS`)."""
CPU_DEFAULTS_SOURCE = "ours with the CPU defaults"
DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops"
NONDETERMINISTIC_OPTION = "--nondeterministic-gpu-ops"
STEADY_TAG = "charts/learning_rate"
PEAKS = {
    "H100 SXM": (67e12, 495e12, 989e12),
    "H200": (67e12, 495e12, 989e12),
}
"""NVIDIA's published dense peaks, FLOP/s: FP32, TF32 and BF16 (tensor cores). The H200 has the
H100 SXM's compute."""
PRECISIONS = ("fp32", "tf32", "bf16")
LOG_LINES = 40
CSV_COLUMNS = [
    *RUN_COLUMNS,
    "section",
    "source",
    "deterministic_ops",
    "cpus",
    "actor_threads",
    "pools_per_thread",
    "envs_per_pool",
    "worker_threads_per_pool",
    "seconds_per_update",
    "updates_timed",
    "flops_per_update",
    "flops_per_update_lowered",
    "flop_rate",
    "device_kind",
    "peak",
    *[f"share_of_{precision}_peak" for precision in PRECISIONS],
    "xla_flags",
    "steady_points",
    "steady_seconds",
    "run_learn_s",
    "run_rollout_s",
    "exit_code",
    "timed_out",
    "last_stderr_line",
]


# === Options ===


def parse_options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--small", action="store_true", help="a tiny network and sizes (CPU)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--ppo-timesteps", type=int, help="the PPO runs' --total-timesteps")
    parser.add_argument("--impala-timesteps", type=int, help="the IMPALA runs' --total-timesteps")
    parser.add_argument(
        "--env-seconds", type=float, help="each envpool variant's timed window (10; --small: 1)"
    )
    parser.add_argument(
        "--learner-seconds", type=float, help="each learner's timed updates (5; --small: 1)"
    )
    parser.add_argument("--out", type=Path, default=Path("speed_gpu"))
    parser.add_argument("--original-dir", type=Path, help="the original's ported scripts")
    parser.add_argument("--before-dir", type=Path, help="an older copy of this project")
    parser.add_argument(
        "--run-timeout", type=float, default=150.0, help="seconds of each process at most"
    )
    parser.add_argument("--budget", type=float, help="start nothing after this many seconds")
    subcommands = parser.add_subparsers(dest="command")
    learner = subcommands.add_parser("learner", help="one learner measurement in this process")
    learner.add_argument("--script", choices=ALGORITHMS, required=True)
    learner.add_argument("--small", action="store_true")
    learner.add_argument(
        NONDETERMINISTIC_OPTION, action="store_true", help="give the script this option"
    )
    learner.add_argument("--learner-seconds", type=float, default=5.0)
    learner.add_argument("--count-flops", action="store_true")
    learner.add_argument("--result", type=Path, required=True)
    options = parser.parse_args(argv)
    if options.command is None:
        small = options.small
        if options.ppo_timesteps is None:
            options.ppo_timesteps = small_timesteps("ppo") if small else TIMESTEPS["ppo"]
        if options.impala_timesteps is None:
            options.impala_timesteps = small_timesteps("impala") if small else TIMESTEPS["impala"]
        if options.env_seconds is None:
            options.env_seconds = 1.0 if small else 10.0
        if options.learner_seconds is None:
            options.learner_seconds = 1.0 if small else 5.0
    return options


def script_args(algorithm: str, small: bool, extra: tuple = ()):
    """The script module and its parsed `Args`."""
    script = importlib.import_module(f"cleanba.cleanba_{algorithm}")
    return script, script.parse_args(
        ["--env-id", ENV_ID, *(SMALL[algorithm] if small else []), *extra]
    )


def small_timesteps(algorithm: str) -> int:
    _, args = script_args(algorithm, small=True)
    return SMALL_UPDATES * args.local_num_envs * args.num_actor_threads * args.num_steps


# === Rows, progress, output ===


class Report:
    """The rows so far, written out after each one, and the deadline of --budget."""

    def __init__(self, out: Path, budget: float | None, context: dict):
        self.out = out
        self.rows: list[dict] = []
        self.context = context
        self.deadline = None if budget is None else time.time() + budget
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def time_left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.time()

    def add(self, row: dict, line: str):
        self.rows.append(row)
        print(line, flush=True)
        with open(self.out / "speed_gpu.csv", "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            writer.writerows(self.rows)
        (self.out / "speed_gpu.md").write_text(summary(self.rows, self.context))

    def measure(
        self, name: str, measurement: Callable[[], tuple[dict, str]], base_row: dict, skip=""
    ):
        """Runs one measurement unless `skip` says why not or the budget is spent; a failure is a
        row, not the end."""
        skip = skip or ("--budget spent" if self.time_left() <= 0 else "")
        if skip:
            self.add(
                {**base_row, "last_stderr_line": f"skipped: {skip}"}, f"{name}: skipped ({skip})"
            )
            return
        try:
            row, line = measurement()
        except Exception as error:
            message = f"{type(error).__name__}: {error}".splitlines()[0]
            self.add({**base_row, "last_stderr_line": message}, f"{name}: failed ({message})")
            return
        self.add({**base_row, **row}, f"{name}: {line}")


def base(section: str, script: str, mode: str, **fields) -> dict:
    return dict(section=section, script=script, mode=mode, env_id=ENV_ID, seed=1, **fields)


class Finished(NamedTuple):
    exit_code: int | None
    timed_out: bool
    wall_time_s: float
    last_stderr_line: str


def run_process(
    command: list[str], cwd: Path, env: dict, timeout: float, log_name: str, logs: Path
) -> Finished:
    """Runs `command` in its own session under `timeout` (SIGTERM, then SIGKILL 10 s later); keeps
    the last lines of its stdout and stderr in `logs`."""
    start = time.time()
    stdout_path = cwd / "stdout.txt"
    stderr_path = cwd / "stderr.txt"
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=stdout, stderr=stderr, start_new_session=True
        )
        timed_out = False
        try:
            process.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    wall = time.time() - start
    tails = {
        name: path.read_text(errors="replace").splitlines()[-LOG_LINES:]
        for name, path in [("stdout", stdout_path), ("stderr", stderr_path)]
    }
    for name, lines in tails.items():
        (logs / f"{log_name}.{name}.txt").write_text("\n".join(lines) + "\n")
    last = [line.strip() for line in tails["stderr"] if line.strip()][-1:]
    return Finished(
        exit_code=None if timed_out else process.returncode,
        timed_out=timed_out,
        wall_time_s=wall,
        last_stderr_line=last[0][:300] if last else "",
    )


def with_deterministic_ops(env: dict) -> dict:
    """`env` with XLA's deterministic GPU operations asked for after the XLA_FLAGS it has."""
    flag = f"{DETERMINISTIC_FLAG}=true"
    flags = env.get("XLA_FLAGS", "").strip()
    return {**env, "XLA_FLAGS": f"{flags} {flag}" if flags else flag}


def with_first_on_path(env: dict, folder: Path) -> dict:
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join([str(folder), *paths])}


def child_environment() -> dict:
    """What every child process gets: the environment this process started with, unbuffered
    output, and no Weights & Biases upload."""
    return {**INHERITED_ENVIRONMENT, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}


def takes_nondeterministic_option(script: Path) -> bool:
    """Whether the script, or the options its project's scripts share, declares
    --nondeterministic-gpu-ops (as its field or its flag)."""
    sources = [script, *sorted((script.parent.parent / "cleanba_utils").glob("*.py"))]
    pattern = re.compile(r"nondeterministic[_-]gpu[_-]ops")
    return any(pattern.search(path.read_text()) for path in sources if path.exists())


def probe_backend() -> tuple[str, str]:
    """JAX's default backend and its first device's kind, in a process of their own (this process
    never starts a backend: it would hold the GPU's memory during the runs)."""
    code = "import jax; print(jax.default_backend(), jax.devices()[0].device_kind, sep='\\t')"
    probe = subprocess.run(
        [sys.executable, "-c", code],
        env={**child_environment(), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode:
        return "unknown", "unknown"
    backend, device_kind = probe.stdout.strip().splitlines()[-1].split("\t")
    return backend, device_kind


# === envpool alone ===


class Variant(NamedTuple):
    pools: int
    """envpool instances per actor thread, stepped alternately"""
    worker_threads: int
    """worker threads of each instance"""

    def name(self) -> str:
        kind = "synchronous step" if self.pools == 1 else f"{self.pools} pools alternately"
        threads = "worker thread" if self.worker_threads == 1 else "worker threads"
        return f"{kind}, {self.worker_threads} {threads} per pool"


def envpool_variants(args) -> list[Variant]:
    """(a) and (b), then (c) with the worker threads of each."""
    instances = args.num_actor_threads * len(args.actor_device_ids)
    cpus = len(os.sched_getaffinity(0))
    shared = envpool_num_threads(None, args.local_num_envs, instances)
    per_cpu = min(cpus, args.local_num_envs)
    half = args.local_num_envs // 2
    variants = [
        Variant(1, shared),
        Variant(1, per_cpu),
        Variant(2, min(shared, half)),
        Variant(2, min(per_cpu, half)),
    ]
    return list(dict.fromkeys(variants))


def play(args, thread: int, variant: Variant, warmup: float, window: dict, result: list):
    """One actor thread's environments, as the script's thread `thread` seeds them, stepped with
    random actions: until `warmup` seconds have passed, then, once every thread is ready, until the
    window's end; the environment steps in the window go to `result[thread]`."""
    envs_per_pool = args.local_num_envs // variant.pools
    first_seed = args.seed + thread * args.local_num_envs
    options = dataclasses.replace(args, envpool_num_threads=variant.worker_threads)
    pools = [
        make_env(options, first_seed + pool * envs_per_pool, envs_per_pool)
        for pool in range(variant.pools)
    ]
    rng = np.random.default_rng(thread)
    actions = rng.integers(0, pools[0].action_space.n, (64, envs_per_pool), dtype=np.int32)
    if variant.pools == 1:
        pools[0].reset()
        step = lambda i: pools[0].step(actions[i % len(actions)])
    else:
        for pool in pools:
            pool.async_reset()

        def step(i):
            for pool in pools:
                *_, info = pool.recv()
                pool.send(actions[i % len(actions)], info["env_id"])

    steps_per_call = variant.pools * envs_per_pool
    start = time.perf_counter()
    i = 0
    while time.perf_counter() - start < warmup:
        step(i)
        i += 1
    window["ready"].wait()
    steps = 0
    while time.perf_counter() < window["end"]:
        step(i)
        i += 1
        steps += steps_per_call
    result[thread] = (steps, time.perf_counter())
    if variant.pools > 1:
        for pool in pools:
            pool.recv()
    for pool in pools:
        pool.close()


def envpool_throughput(args, variant: Variant, seconds: float) -> tuple[dict, str]:
    """Every actor thread's environments at once, as `play` steps them."""
    threads = args.num_actor_threads * len(args.actor_device_ids)
    window = {}

    def open_window():
        window["start"] = time.perf_counter()
        window["end"] = window["start"] + seconds

    window["ready"] = threading.Barrier(threads, action=open_window, timeout=600)
    result = [None] * threads
    failures = []

    def thread_body(thread):
        try:
            play(
                args=args,
                thread=thread,
                variant=variant,
                warmup=seconds / 5,
                window=window,
                result=result,
            )
        except Exception as error:
            failures.append(error)
            window["ready"].abort()

    workers = [threading.Thread(target=thread_body, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if failures:
        raise failures[0]
    steps = sum(count for count, _ in result)
    elapsed = max(end for _, end in result) - window["start"]
    envs_per_pool = args.local_num_envs // variant.pools
    row = dict(
        script=f"envpool {envpool.__version__}",
        mode=variant.name(),
        steps=steps,
        sps=steps / elapsed,
        wall_time_s=elapsed,
        cpus=len(os.sched_getaffinity(0)),
        actor_threads=threads,
        pools_per_thread=variant.pools,
        envs_per_pool=envs_per_pool,
        worker_threads_per_pool=variant.worker_threads,
    )
    line = (
        f"{steps / elapsed:,.0f} steps/s ({threads} threads x {variant.pools} pool(s) x "
        f"{envs_per_pool} envs, {elapsed:.1f} s)"
    )
    return row, line


def envpool_section(report: Report, options):
    _, args = script_args("ppo", options.small)
    for variant in envpool_variants(args):
        report.measure(
            f"envpool, {variant.name()}",
            functools.partial(envpool_throughput, args, variant, options.env_seconds),
            base(section="envpool", script=f"envpool {envpool.__version__}", mode=variant.name()),
        )


# === The learner alone ===


def synthetic_rollouts(script, args, learner_devices: list) -> tuple:
    """One `Trajectories` per actor thread with the shapes and types the actors send (the
    observations, rewards and flags as the task's envpool gives them), reshaped to one slice of
    environments per learner device and put on the learner devices as the actors put them. The
    field the learner bootstraps from has one more step per environment: the value where the actor
    computes it (PPO), else the observation (IMPALA)."""
    probe = make_env(args, args.seed, 1)
    first_obs, _ = probe.reset()
    _, reward, terminated, truncated, _ = probe.step(np.zeros(1, dtype=np.int32))
    num_actions = probe.action_space.n
    probe.close()
    # The fields without a default (a recurrent core's first state is None without a core).
    fields = [
        f for f in script.Trajectories._fields if f not in script.Trajectories._field_defaults
    ]
    bootstrap = "values" if "values" in fields else "obs"
    n = args.local_num_envs
    steps = args.num_steps
    extra = lambda name: steps + (name == bootstrap)
    rng = np.random.default_rng(args.seed)
    sharding = NamedSharding(
        Mesh(np.array(learner_devices), ("devices",)), PartitionSpec("devices")
    )
    rollouts = []
    for thread in range(args.num_actor_threads * len(args.actor_device_ids)):
        done = rng.random((n, steps)) < 0.01
        columns = dict(
            obs=rng.integers(0, 256, (n, extra("obs"), *first_obs.shape[1:]), dtype=np.uint8),
            actions=rng.integers(0, num_actions, (n, steps), dtype=np.int32),
            logprobs=np.full((n, steps), -np.log(num_actions), dtype=np.float32),
            values=rng.standard_normal((n, extra("values"))).astype(np.float32),
            rewards=(rng.random((n, steps)) < 0.05).astype(reward.dtype),
            terminations=done.astype(terminated.dtype),
            truncations=np.zeros((n, steps), dtype=truncated.dtype),
            is_reset=np.concatenate([np.zeros((n, 1), dtype=bool), done[:, :-1]], axis=1),
            env_ids=np.arange(thread * n, (thread + 1) * n, dtype=np.int32),
        )
        data = script.Trajectories(**{name: columns[name] for name in fields})
        data = jax.tree.map(lambda v: v.reshape(len(learner_devices), -1, *v.shape[1:]), data)
        rollouts.append(jax.device_put(data, sharding))
    return tuple(rollouts)


def flops_of(program) -> float | None:
    """FLOPs of a lowered or compiled program by XLA's cost analysis (a dict, or a list of one dict
    per program in older jax), or None where it gives none."""
    analysis = program.cost_analysis()
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else None
    if not analysis or "flops" not in analysis:
        return None
    return float(analysis["flops"])


def update_flops(parts: dict, devices: list, state, rollouts) -> dict:
    """FLOPs of one update on a learner device: its preparation of the rollout, and one microbatch
    step times the steps of its schedule, each pmap'd as `microbatch_update` runs them unrolled. By
    XLA's cost analysis of the compiled programs ("compiled"), and of the programs as JAX lowers
    them, before XLA's passes ("lowered"; a GPU's compiled program calls libraries for its
    convolutions and matrix products, which its analysis may count otherwise)."""
    pmap = functools.partial(jax.pmap, axis_name="devices", devices=devices)
    num_indices = len(parts["schedule"][0])
    prepare = pmap(parts["prepare"], in_axes=(0, None))
    step = pmap(parts["microbatch_step"], in_axes=(0, 0, None, *[None] * num_indices))
    update = np.int32(1)
    lowered_prepare = prepare.lower(rollouts, update)
    prepared = prepare(rollouts, update)
    lowered_step = step.lower(state, prepared, update, *[np.int32(0)] * num_indices)
    programs = [lowered_prepare, lowered_step]
    total = lambda counts: (
        None if None in counts else counts[0] + len(parts["schedule"]) * counts[1]
    )
    return dict(
        compiled=total([flops_of(program.compile()) for program in programs]),
        lowered=total([flops_of(program) for program in programs]),
    )


def learner_main(options):
    """In this process: the script's learner update timed on a synthetic rollout; writes its
    result as JSON to --result."""
    extra = [NONDETERMINISTIC_OPTION] if options.nondeterministic_gpu_ops else []
    script, args = script_args(options.script, options.small, extra)
    xla_flags = os.environ.get("XLA_FLAGS", "")
    script.validate_layout(args)
    sizes = script.sizes_of(args, 1)
    learner_devices = [jax.local_devices()[i] for i in args.learner_device_ids]
    started = script.init_state(args, sizes)[1]
    # PPO and IMPALA give where the run starts (`kept_lag.Origin`), the others their learner state.
    state = started.learner if isinstance(started, kept_lag.Origin) else started
    rollouts = synthetic_rollouts(script, args, learner_devices)
    parts = {}

    def keep_parts(**kwargs):
        parts.update(kwargs)
        return microbatch_update(**kwargs)

    # The parts of the update, for its FLOPs: what `make_update` hands to `microbatch_update`.
    keeping = (
        mock.patch.object(script, "microbatch_update", keep_parts)
        if hasattr(script, "microbatch_update")
        else contextlib.nullcontext()
    )
    with keeping:
        update_fn = script.make_update(
            args,
            learner_devices,
            rolled=rolls(learner_devices[0].platform, has_image_observations(args.env_id)),
        )
    state = replicate(state, learner_devices)
    update = 0
    for _ in range(2):
        update += 1
        state, _ = update_fn(state, rollouts, np.int32(update))
        jax.block_until_ready(state)
    seconds = []
    start = time.perf_counter()
    while len(seconds) < 3 or time.perf_counter() - start < options.learner_seconds:
        update += 1
        tic = time.perf_counter()
        state, _ = update_fn(state, rollouts, np.int32(update))
        jax.block_until_ready(state)
        seconds.append(time.perf_counter() - tic)
    counted = options.count_flops and parts
    flops = update_flops(parts, learner_devices, state, rollouts) if counted else {}
    result = dict(
        device_kind=learner_devices[0].device_kind,
        xla_flags=xla_flags,
        steps_per_update=sizes.steps_per_update,
        seconds=seconds,
        flops_per_update=flops.get("compiled"),
        flops_per_update_lowered=flops.get("lowered"),
    )
    options.result.write_text(json.dumps(result))


def peak_of(device_kind: str) -> str | None:
    """The `PEAKS` entry of a device kind (e.g. 'NVIDIA H100 80GB HBM3', 'NVIDIA H200'); the PCIe
    and NVL boards and every other device have none here."""
    if re.search(r"PCIE|NVL", device_kind, re.IGNORECASE):
        return None
    if re.search(r"\bH200\b", device_kind):
        return "H200"
    if re.search(r"\bH100\b", device_kind):
        return "H100 SXM"
    return None


def learner_measurement(
    algorithm: str, deterministic: bool, options, report: Report, flops: dict
) -> tuple[dict, str]:
    """One learner process; `flops` keeps each script's count for its second process."""
    setting = "on" if deterministic else "off"
    with tempfile.TemporaryDirectory(prefix=f"speed_gpu_learner_{algorithm}_") as folder:
        result_path = Path(folder) / "result.json"
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "learner",
            "--script",
            algorithm,
            "--learner-seconds",
            str(options.learner_seconds),
            "--result",
            str(result_path),
            *(["--small"] if options.small else []),
            *([] if algorithm in flops else ["--count-flops"]),
        ]
        env = with_first_on_path(child_environment(), REPO)
        if deterministic:
            env = with_deterministic_ops(env)
        elif takes_nondeterministic_option(REPO / "cleanba" / f"cleanba_{algorithm}.py"):
            command.append(NONDETERMINISTIC_OPTION)
        finished = run_process(
            command,
            cwd=Path(folder),
            env=env,
            timeout=min(options.run_timeout, report.time_left()),
            log_name=f"learner_{algorithm}_deterministic_{setting}",
            logs=report.out / "logs",
        )
        if finished.exit_code != 0 or not result_path.exists():
            status = (
                f"timed out after {finished.wall_time_s:.0f} s"
                if finished.timed_out
                else f"exit {finished.exit_code}"
            )
            raise RuntimeError(f"{status}: {finished.last_stderr_line}")
        result = json.loads(result_path.read_text())
    flops.setdefault(algorithm, (result["flops_per_update"], result["flops_per_update_lowered"]))
    per_update = statistics.median(result["seconds"])
    flops_per_update, flops_per_update_lowered = flops[algorithm]
    rate = None if flops_per_update is None else flops_per_update / per_update
    peak = peak_of(result["device_kind"])
    shares = {
        f"share_of_{precision}_peak": rate / value if rate is not None and peak else None
        for precision, value in zip(PRECISIONS, PEAKS.get(peak, (None,) * 3))
    }
    row = dict(
        steps=result["steps_per_update"] * len(result["seconds"]),
        sps=result["steps_per_update"] / per_update,
        wall_time_s=finished.wall_time_s,
        seconds_per_update=per_update,
        updates_timed=len(result["seconds"]),
        flops_per_update=flops_per_update,
        flops_per_update_lowered=flops_per_update_lowered,
        flop_rate=rate,
        device_kind=result["device_kind"],
        peak=peak or "unknown peak",
        xla_flags=result["xla_flags"],
        exit_code=finished.exit_code,
        timed_out=finished.timed_out,
        **shares,
    )
    flop_text = "FLOPs not reported" if rate is None else f"{rate / 1e12:.3g} TFLOP/s"
    share_text = (
        ", ".join(f"{100 * shares[f'share_of_{p}_peak']:.1f} % of {p.upper()}" for p in PRECISIONS)
        if peak and rate is not None
        else "unknown peak"
    )
    lowered = significant(flops_per_update_lowered, 1e9) or "none"
    line = (
        f"{per_update:.4f} s per update ({len(result['seconds'])} timed), {flop_text} "
        f"({share_text}; {significant(flops_per_update, 1e9) or 'no'} GFLOP per update, "
        f"{lowered} as lowered; {result['device_kind']})"
    )
    return row, line


def learner_section(report: Report, options):
    flops = {}
    for algorithm in ALGORITHMS:
        for deterministic in (False, True):
            setting = "on" if deterministic else "off"
            report.measure(
                f"learner cleanba_{algorithm}, deterministic ops {setting}",
                functools.partial(
                    learner_measurement,
                    algorithm=algorithm,
                    deterministic=deterministic,
                    options=options,
                    report=report,
                    flops=flops,
                ),
                base(
                    section="learner",
                    script=f"cleanba_{algorithm}",
                    mode=f"learner alone, deterministic ops {setting}",
                    source="ours",
                    deterministic_ops=setting,
                ),
            )


# === Whole runs ===


class RunSpec(NamedTuple):
    source: str
    """ours, before (--before-dir) or original (--original-dir)"""
    algorithm: str
    deterministic_ops: str
    """on, off, or default (the script's own setting)"""
    script: Path
    options: list[str]
    env: dict
    skip: str = ""
    """why the run is not made, if it is not"""


def run_specs(options, backend: str) -> list[RunSpec]:
    """In the order they run (the comparisons that matter most first, should --budget run out):
    for each script ours without deterministic GPU operations and the original's, then ours with
    them, at the defaults and with the CPU's values of the platform's defaults (on a GPU only), then
    the older copy's. `backend` is JAX's: the scripts refuse --nondeterministic-gpu-ops
    elsewhere than on a GPU."""
    env = child_environment()
    ours_env = with_first_on_path(env, REPO)
    first, second, third = [], [], []
    for algorithm in ALGORITHMS:
        script = REPO / "cleanba" / f"cleanba_{algorithm}.py"
        ours = functools.partial(RunSpec, source="ours", algorithm=algorithm, script=script)
        if takes_nondeterministic_option(script):
            skip = "" if backend == "gpu" else f"{NONDETERMINISTIC_OPTION} acts only on a GPU"
            off = ours(
                deterministic_ops="off", options=[NONDETERMINISTIC_OPTION], env=ours_env, skip=skip
            )
            on = ours(deterministic_ops="on", options=[], env=ours_env)
        else:
            off = ours(deterministic_ops="off", options=[], env=ours_env)
            on = ours(deterministic_ops="on", options=[], env=with_deterministic_ops(ours_env))
        first.append(off)
        second.append(on)
        # The CPU's values of the options whose default is the platform's: what the GPU's own
        # defaults (two envpool instances per actor thread, PPO without gradient accumulation)
        # gain over them.
        second.append(
            ours(
                source=CPU_DEFAULTS_SOURCE,
                deterministic_ops="on",
                options=CPU_DEFAULTS[algorithm],
                env=ours_env,
                skip="" if backend == "gpu" else "the platform's defaults are these on a CPU",
            )
        )
        if options.original_dir:
            original = RunSpec(
                source="original",
                algorithm=algorithm,
                deterministic_ops="default",
                script=options.original_dir.resolve() / f"cleanba_{algorithm}.py",
                options=[],
                env=env,
            )
            first.append(original)
        if options.before_dir:
            folder = options.before_dir.resolve()
            before = RunSpec(
                source="before",
                algorithm=algorithm,
                deterministic_ops="default",
                script=folder / "cleanba" / f"cleanba_{algorithm}.py",
                options=[],
                env=with_first_on_path(env, folder),
            )
            third.append(before)
    return first + second + third


def steady_sps(runs_dir: Path) -> dict | None:
    """SPS from the run's TensorBoard events: of the event folders, the one with the most points of
    `STEADY_TAG`, from its 2nd point to its last; with our scripts' learner and rollout seconds per
    update (the medians after the first update) where they are logged."""
    best = None
    folders = sorted({path.parent for path in runs_dir.glob("**/events.out.tfevents*")})
    for folder in folders:
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        if STEADY_TAG not in events.Tags()["scalars"]:
            continue
        points = events.Scalars(STEADY_TAG)
        if best is None or len(points) > len(best[1]):
            best = (events, points)
    if best is None or len(best[1]) < 3:
        return None
    events, points = best
    first, last = points[1], points[-1]
    median_after_first = lambda tag: (
        statistics.median(e.value for e in events.Scalars(tag)[1:])
        if tag in events.Tags()["scalars"] and len(events.Scalars(tag)) > 1
        else None
    )
    return dict(
        sps=(last.step - first.step) / (last.wall_time - first.wall_time),
        steady_points=len(points),
        steady_seconds=last.wall_time - first.wall_time,
        run_learn_s=median_after_first("stats/learn_time"),
        run_rollout_s=median_after_first("stats/rollout_time"),
    )


def whole_run(spec: RunSpec, options, report: Report) -> tuple[dict, str]:
    if not spec.script.exists():
        raise FileNotFoundError(f"no script {spec.script}")
    timesteps = options.ppo_timesteps if spec.algorithm == "ppo" else options.impala_timesteps
    command = [
        sys.executable,
        str(spec.script),
        "--env-id",
        ENV_ID,
        "--total-timesteps",
        str(timesteps),
        "--log-frequency",
        "1",
        *(SMALL[spec.algorithm] if options.small else []),
        *spec.options,
    ]
    with tempfile.TemporaryDirectory(prefix=f"speed_gpu_{spec.source}_{spec.algorithm}_") as cwd:
        finished = run_process(
            command,
            cwd=Path(cwd),
            env=spec.env,
            timeout=min(options.run_timeout, report.time_left()),
            log_name=(
                f"run_{spec.source.replace(' ', '_')}_{spec.algorithm}"
                f"_deterministic_{spec.deterministic_ops}"
            ),
            logs=report.out / "logs",
        )
        steady = steady_sps(Path(cwd) / "runs") or {}
    row = dict(
        steps=timesteps,
        wall_time_s=finished.wall_time_s,
        xla_flags=spec.env.get("XLA_FLAGS", ""),
        exit_code=finished.exit_code,
        timed_out=finished.timed_out,
        last_stderr_line=finished.last_stderr_line,
        **steady,
    )
    status = "timed out" if finished.timed_out else f"exit {finished.exit_code}"
    sps = f"{steady['sps']:,.0f} SPS" if steady else "no steady SPS (fewer than 3 points)"
    stderr = f"; stderr: {finished.last_stderr_line}" if finished.exit_code != 0 else ""
    line = f"{sps}, {status}, {finished.wall_time_s:.0f} s{stderr}; `{shlex.join(command[1:])}`"
    return row, line


def runs_section(report: Report, options):
    for spec in run_specs(options, report.context["backend"]):
        name = f"cleanba_{spec.algorithm}"
        report.measure(
            f"run {spec.source} {name}, deterministic ops {spec.deterministic_ops}",
            functools.partial(whole_run, spec, options, report),
            skip=spec.skip,
            base_row=base(
                section="runs",
                script=name if spec.source == "ours" else f"{spec.source} {name}",
                mode=f"whole run, deterministic ops {spec.deterministic_ops}",
                source=spec.source,
                deterministic_ops=spec.deterministic_ops,
            ),
        )


# === Summary ===


def number(value, digits: int = 0) -> str:
    return "" if value is None or value == "" else f"{float(value):,.{digits}f}"


def significant(value, unit: float) -> str:
    """`value` in `unit`s to 3 significant digits (blank when missing)."""
    return "" if value is None or value == "" else f"{float(value) / unit:.3g}"


def summary(rows: list[dict], context: dict) -> str:
    """The markdown of the rows so far: the ceiling, the learner, the runs and the ratios."""
    lines = [
        f"Speed on this machine ({time.strftime('%Y-%m-%d')}): `{context['command']}`",
        "",
        f"JAX backend {context['backend']}, device {context['device_kind']}, peak: "
        f"{peak_of(context['device_kind']) or 'unknown peak'}; CPUs: {context['cpus']}; "
        f"jax {jax.__version__}, envpool {envpool.__version__}, Python {sys.version.split()[0]}.",
    ]
    section = lambda name: [row for row in rows if row["section"] == name]
    if section("envpool"):
        lines += [
            "",
            "| envpool alone (random actions) | threads x pools x envs | steps/s |",
            "|---|---|---|",
        ]
        for row in section("envpool"):
            layout = (
                f"{row.get('actor_threads', '')} x {row.get('pools_per_thread', '')} x "
                f"{row.get('envs_per_pool', '')}"
            )
            lines.append(f"| {row['mode']} | {layout} | {number(row.get('sps'))} |")
    if section("learner"):
        lines += [
            "",
            "| learner alone | deterministic ops | s per update | env steps/s | GFLOP per update "
            "(compiled / lowered) | TFLOP/s | share of FP32 / TF32 / BF16 peak |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in section("learner"):
            shares = " / ".join(
                f"{100 * row[f'share_of_{p}_peak']:.1f} %"
                for p in PRECISIONS
                if row.get(f"share_of_{p}_peak") is not None
            )
            flops = (
                f"{significant(row.get('flops_per_update'), 1e9)} / "
                f"{significant(row.get('flops_per_update_lowered'), 1e9)}"
            )
            lines.append(
                f"| {row['script']} | {row['deterministic_ops']} "
                f"| {number(row.get('seconds_per_update'), 4)} | {number(row.get('sps'))} "
                f"| {flops if row.get('seconds_per_update') else ''} "
                f"| {significant(row.get('flop_rate'), 1e12)} "
                f"| {shares or row.get('peak', '') or row.get('last_stderr_line', '')} |"
            )
    if section("runs"):
        lines += [
            "",
            "| whole run | deterministic ops | steady SPS | points | learn s / update "
            "| rollout s / update | exit | wall s | last stderr line (failed runs) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in section("runs"):
            exit_text = "timeout" if row.get("timed_out") else row.get("exit_code", "")
            failed = row.get("exit_code") != 0
            lines.append(
                f"| {row['script']} | {row['deterministic_ops']} | {number(row.get('sps'))} "
                f"| {row.get('steady_points', '')} | {number(row.get('run_learn_s'), 3)} "
                f"| {number(row.get('run_rollout_s'), 3)} | {exit_text} "
                f"| {number(row.get('wall_time_s'))} "
                f"| {row.get('last_stderr_line', '') if failed else ''} |"
            )
    lines += ratios(rows)
    return "\n".join(lines) + "\n"


def ratios(rows: list[dict]) -> list[str]:
    """Each of our runs' SPS over the original's and the older copy's of the same script, and over
    the best envpool variant."""
    runs = [row for row in rows if row["section"] == "runs" and row.get("sps")]
    bare = [row["sps"] for row in rows if row["section"] == "envpool" and row.get("sps")]
    reference = lambda source, script: next(
        (row["sps"] for row in runs if row["script"] == f"{source} {script}"), None
    )
    ratio = lambda sps, other: f"{sps / other:.3f}" if other else ""
    lines = [
        f"| {row['script']} | {row['deterministic_ops']} "
        f"| {ratio(row['sps'], reference('original', row['script']))} "
        f"| {ratio(row['sps'], reference('before', row['script']))} "
        f"| {ratio(row['sps'], max(bare, default=None))} |"
        for row in runs
        if row["source"] in ("ours", CPU_DEFAULTS_SOURCE)
    ]
    if not lines:
        return []
    return [
        "",
        "| ours | deterministic ops | / original | / before | / best envpool variant |",
        "|---|---|---|---|---|",
        *lines,
    ]


# === Main ===


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    options = parse_options(argv)
    if options.command == "learner":
        learner_main(options)
        return
    options.out.mkdir(parents=True, exist_ok=True)
    cpus = f"{len(os.sched_getaffinity(0))} usable by this process, {os.cpu_count()} online"
    backend, device_kind = probe_backend()
    context = dict(
        command=shlex.join(["python", "benchmark/speed_gpu.py", *argv]),
        cpus=cpus,
        backend=backend,
        device_kind=device_kind,
    )
    report = Report(options.out, options.budget, context)
    print(
        f"JAX backend {backend} ({device_kind}, peak {peak_of(device_kind) or 'unknown'}); "
        f"CPUs: {cpus}; sections: {' '.join(options.sections)}",
        flush=True,
    )
    sections = dict(envpool=envpool_section, learner=learner_section, runs=runs_section)
    for name in SECTIONS:
        if name in options.sections:
            sections[name](report, options)
    print("\n" + summary(report.rows, context), flush=True)


if __name__ == "__main__":
    main()
