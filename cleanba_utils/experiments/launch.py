"""Launch an experiment: every sweep setting x game x seed of one training command.

Runs locally with a pool of worker processes, or as one SLURM job array (one array task per run):

    python -m cleanba_utils.experiments.launch --env-ids Breakout-v5 Pong-v5 \\
        --command "python cleanba/cleanba_ppo.py --track" --num-seeds 3 --workers 2
    python -m cleanba_utils.experiments.launch --env-ids Breakout-v5 \\
        --command "python cleanba/cleanba_ppo.py" --experiment lr_sweep \\
        --sweep "--learning-rate=2.5e-4,1e-3" --sweep "--num-minibatches=4,8" \\
        --slurm-template-path cleanba.slurm_template --workers 16

or from a spec file, with Optuna's TPE search and pruning (`--search tpe`; see spec.py and
search.py beside this file):

    python -m cleanba_utils.experiments.launch --spec benchmark/specs/ppo_cartpole_search.toml

Every run gets `--env-id`, `--seed`, `--group <experiment>/<setting index>` and a deterministic
`--run-name`, so a rerun or a requeued SLURM task writes to the same `runs/<run name>` folder. See
cleanba_utils/experiments/LAUNCHER.md for the device layouts of the paper.
"""

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from cleanba_utils import accelerators
from cleanba_utils.errors import fail
from cleanba_utils.experiments import cli, search, slurm, spec
from cleanba_utils.experiments.sweeps import (
    LAUNCHER_FLAGS,
    grid_settings,
    parse_sweep,
    random_settings,
    trial_runs,
)

PRUNERS = ("median", "successive_halving", "none")
DEFAULTS = {
    "num_seeds": 1,
    "start_seed": 1,
    "workers": 1,
    "search": "grid",
    "sweep_seed": 0,
    "metric": "final_return",
    "pruner": "median",
    "startup_trials": 5,
}
MEMORY_FRACTION = "XLA_CLIENT_MEM_FRACTION"
"""The share of each GPU's memory a JAX process reserves when it starts (JAX's default: 0.75). JAX
also reads the older name, and refuses to start when both are set."""
MEMORY_FRACTION_NAMES = (MEMORY_FRACTION, "XLA_PYTHON_CLIENT_MEM_FRACTION")
# The options a spec can set (see spec.py).
SPEC_OPTIONS = {
    *spec.TOP.values(),
    *spec.TABLES["search"].values(),
    *spec.TABLES["resources"].values(),
}


def parse_command_line(argv):
    parser = argparse.ArgumentParser(
        prog="python -m cleanba_utils.experiments.launch",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
    )
    add = parser.add_argument
    add(
        "--spec",
        metavar="PATH",
        help="an experiment spec file (TOML; see cleanba_utils/experiments/spec.py); "
        "options add to it",
    )
    add("--env-ids", nargs="+", metavar="ENV_ID", help="games, e.g. Breakout-v5 Pong-v5")
    add("--command", metavar="CMD", help='e.g. "python cleanba/cleanba_ppo.py --track"')
    add(
        "--num-seeds",
        type=cli.positive_int,
        metavar="N",
        help="seeds per game and setting (default 1)",
    )
    add("--start-seed", type=int, metavar="SEED", help="first of the consecutive seeds (default 1)")
    add(
        "--workers",
        type=cli.positive_int,
        metavar="N",
        help="runs (SLURM: array tasks) at a time (default 1)",
    )
    add("--experiment", metavar="NAME", help="experiment name (default: the script name)")
    add(
        "--log-dir",
        metavar="DIR",
        help="for logs and the sbatch script (default: runs/_launcher/<experiment>)",
    )
    add(
        "--sweep",
        action="append",
        default=[],
        metavar='"--FLAG=V1,V2"',
        help="values of one script flag "
        "(spaces split a value into several arguments); repeat for a grid; "
        "with --search random or tpe also uniform(LOW,HIGH), loguniform(LOW,HIGH) or int(LOW,HIGH)",
    )
    add(
        "--search",
        choices=["grid", "random", "tpe"],
        help="the whole grid (default), --budget random settings, or --budget settings from "
        "Optuna's TPE with pruning",
    )
    add(
        "--budget",
        type=cli.positive_int,
        metavar="K",
        help="number of settings drawn by --search random or tpe",
    )
    add("--sweep-seed", type=int, metavar="SEED", help="seed of --search random or tpe (default 0)")
    add("--metric", choices=list(spec.METRICS), help="tpe: what to maximize (default final_return)")
    add(
        "--pruner", choices=list(PRUNERS), help="tpe: how to stop bad trials early (default median)"
    )
    add(
        "--report-every",
        type=cli.positive_int,
        metavar="STEPS",
        help="tpe: agent steps between pruning checks",
    )
    add(
        "--startup-trials",
        type=cli.positive_int,
        metavar="N",
        help="tpe: trials before modelling and pruning (5)",
    )
    add("--search-worker", action="store_true", help=argparse.SUPPRESS)
    add(
        "--resume",
        action="store_true",
        help="continue each run from its checkpoint (SLURM runs always do)",
    )
    add("--dry-run", action="store_true", help="print the commands (or the sbatch script) and exit")
    add(
        "--slurm-template-path",
        metavar="PATH",
        help="e.g. cleanba.slurm_template: submit a SLURM job array",
    )
    add(
        "--slurm-gpus-per-task",
        type=cli.non_negative_int,
        metavar="N",
        help="GPUs per process (default 1; 0: request none, on a cluster of CPU nodes)",
    )
    add(
        "--slurm-ntasks",
        type=cli.positive_int,
        metavar="N",
        help="processes per run (jax.distributed; default 1)",
    )
    add("--slurm-nodes", type=cli.positive_int, metavar="N", help="nodes per run (default 1)")
    add(
        "--slurm-total-cpus",
        type=cli.positive_int,
        metavar="N",
        help="CPUs per run, split over its tasks (default 8)",
    )
    add(
        "--slurm-time",
        metavar="TIME",
        help="each task's time limit, in SLURM's formats (MINUTES, HOURS:MINUTES:SECONDS, "
        "DAYS-HOURS, ...; default: the partition's); near it the task saves a checkpoint and is "
        "requeued to continue",
    )
    add(
        "--slurm-signal-lead",
        type=cli.positive_int,
        metavar="SECONDS",
        help="how long before the time limit SLURM signals the task to save and requeue (default "
        "120): long enough for one update and one checkpoint",
    )
    add("--slurm-job-name", metavar="NAME", help="SLURM job name (default: the experiment name)")
    add(
        "--slurm-partition", metavar="NAME", help="SLURM partition (default: the cluster's default)"
    )
    add(
        "--slurm-wait",
        action="store_true",
        help="after submitting, wait until every task of the array has ended (requeued ones "
        "included), then print the summary and exit 1 if any failed",
    )
    cli.one_line_errors(parser, "launch")
    # argparse takes a value that starts with "--" for an unknown option, so glue each --sweep to
    # its value.
    tokens = iter(argv)
    return parser.parse_args(
        [f"--sweep={next(tokens, '')}" if token == "--sweep" else token for token in tokens]
    )


def default_experiment(command):
    """`python cleanba/cleanba_ppo.py` and `python -m cleanba.cleanba_ppo` -> cleanba_ppo."""
    for previous, token in zip(["", *command], command):
        if previous == "-m":
            return token.rpartition(".")[2]
        if token.endswith(".py"):
            return os.path.basename(token)[: -len(".py")]
    return "experiment"


def resolve(args):
    """The options of the spec (if any) and the command line merged, with defaults filled in, and
    the spec's analysis tables; a ValueError says what is wrong with them."""
    sweeps = [parse_sweep(text) for text in args.sweep]
    given = {
        dest: value
        for dest, value in vars(args).items()
        if dest in SPEC_OPTIONS and value is not None
    }
    given["sweep"] = sweeps
    options, analysis = spec.load(args.spec) if args.spec else ({}, {})
    merged = DEFAULTS | spec.merge(options, given)
    for dest, example in [
        ("command", '"python cleanba/cleanba_ppo.py"'),
        ("env_ids", "Breakout-v5 Pong-v5"),
    ]:
        if merged.get(dest) is None:
            raise ValueError(
                f"{spec.option_name(dest)} is missing; give it (e.g. {example}) or a --spec that "
                "sets it"
            )
    return argparse.Namespace(**{**vars(args), **merged}), analysis


def plan(args):
    """(experiment, command, seeds, runs) for the resolved arguments; `runs` is None for a tpe
    search, which draws its settings as it goes. A ValueError says what is wrong with the
    arguments."""
    command = shlex.split(args.command)
    if not command:
        raise ValueError(
            '--command is empty; give the training command, e.g. "python cleanba/cleanba_ppo.py"'
        )
    clashes = [token.split("=")[0] for token in command if token.split("=")[0] in LAUNCHER_FLAGS]
    if clashes:
        raise ValueError(
            f"--command sets {', '.join(clashes)}, which the launcher sets per run; remove it"
        )
    experiment = args.experiment or default_experiment(command)
    if not re.fullmatch(r"[\w.-]+", experiment):
        raise ValueError(
            f"--experiment {experiment!r} is not a folder name; use letters, digits, '_', '-' "
            "and '.'"
        )
    if args.start_seed < 0:
        raise ValueError(f"--start-seed must be >= 0, got {args.start_seed}")
    sweeps = args.sweep
    if len({flag for flag, _ in sweeps}) < len(sweeps):
        raise ValueError(
            "a flag appears in more than one --sweep; give all its values in one "
            '--sweep "--flag=v1,v2"'
        )
    if (args.search in ("random", "tpe")) != (args.budget is not None):
        raise ValueError(f"--search {args.search} and --budget K go together; give both or neither")
    seeds = range(args.start_seed, args.start_seed + args.num_seeds)
    if args.search == "tpe":
        if not sweeps:
            raise ValueError("--search tpe needs a search space: --sweep or a spec's [space]")
        if args.pruner != "none" and args.report_every is None:
            raise ValueError(
                "--pruner needs --report-every STEPS, the agent steps between intermediate results"
            )
        return experiment, command, seeds, None
    tpe_only = [name for name in ("report_every",) if getattr(args, name) is not None]
    if tpe_only:
        raise ValueError(f"{spec.option_name(tpe_only[0])} is for --search tpe only")
    if args.search == "random":
        settings = random_settings(sweeps, args.budget, args.sweep_seed)
    elif all(isinstance(values, list) for _, values in sweeps):
        settings = grid_settings(sweeps)
    else:
        raise ValueError(
            "ranges like loguniform(LOW,HIGH) need --search random or tpe with --budget K"
        )
    # A requeued SLURM task must continue its run; a first start finds no checkpoint and starts
    # fresh.
    resume = args.resume or args.slurm_template_path is not None
    runs = [
        trial_runs(
            command=command,
            env_ids=args.env_ids,
            seeds=seeds,
            index=index,
            setting=setting,
            experiment=experiment,
            resume=resume,
        )
        for index, setting in enumerate(settings)
    ]
    return experiment, command, seeds, list(zip(settings, runs))


def stop(processes):
    """Ask runs to save a checkpoint and exit (SIGTERM); kill what is left after the grace time or a
    second Ctrl-C."""
    for process in processes:
        search.signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + search.TRIAL_STOP_GRACE_SECONDS
    try:
        for process in processes:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        for process in processes:
            search.signal_group(process, signal.SIGKILL)
            process.wait()


def gpu_count() -> int:
    """The NVIDIA GPUs of this machine, as `nvidia-smi -L` lists them (0 without nvidia-smi)."""
    return len(accelerators.nvidia_gpus())


def share_gpus(workers: int, environ) -> str | None:
    """Every local run sees every GPU of the machine, and each JAX process reserves 75 % of the
    memory of each GPU it sees when it starts, so a second run at the same time finds too little
    left. With several runs at a time and a GPU, each run gets 90 % of a GPU's memory split
    between the runs, rounded down to a hundredth, in `environ[MEMORY_FRACTION]`, unless
    `environ` already sets a fraction under either name. Returns the line that says what it set, or
    None."""
    if workers < 2 or any(name in environ for name in MEMORY_FRACTION_NAMES):
        return None
    gpus = gpu_count()
    if not gpus:
        return None
    fraction = f"{max(90 // workers, 1) / 100:.2f}"
    environ[MEMORY_FRACTION] = fraction
    return (
        f"{workers} runs at a time share each of the {gpus} GPU(s): {MEMORY_FRACTION}={fraction} "
        "for each (set it to choose another share)"
    )


def run_local(runs, workers, log_dir):
    """Run at most `workers` runs at a time, each logging to <log_dir>/<run name>.log; returns {run
    name: exit code}."""
    os.makedirs(log_dir, exist_ok=True)
    pending = list(runs)
    running = {}
    exit_codes = {}
    try:
        while pending or running:
            while pending and len(running) < workers:
                run_name, argv = pending.pop(0)
                # Appending keeps the log of an earlier launch that this one resumes.
                with open(os.path.join(log_dir, f"{run_name}.log"), "a") as log:
                    log.write(shlex.join(argv) + "\n")
                    log.flush()
                    # A session of its own keeps Ctrl-C away from the run, so that stop() decides
                    # how it ends.
                    process = subprocess.Popen(
                        argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                running[process] = (run_name, time.monotonic())
            time.sleep(0.1)
            for process in [process for process in running if process.poll() is not None]:
                run_name, start = running.pop(process)
                exit_codes[run_name] = process.returncode
                progress = f"[{len(exit_codes)}/{len(runs)}] exit {process.returncode}"
                print(f"{progress} after {time.monotonic() - start:.0f}s: {run_name}", flush=True)
    except KeyboardInterrupt:
        print(f"interrupted: stopping {len(running)} running run(s)", file=sys.stderr, flush=True)
        stop(list(running))
        raise
    return exit_codes


def summary(exit_codes, log_paths):
    """The end of a launch: how many runs exited 0, and per failed run its exit code, the last line
    of its log (a script's one-line error) and the log's path (`log_paths`: run name -> path)."""
    failed = {run_name: code for run_name, code in exit_codes.items() if code != 0}
    lines = [
        f"{len(exit_codes)} runs: {len(exit_codes) - len(failed)} exited 0, {len(failed)} failed"
    ]
    for run_name, code in failed.items():
        path = log_paths[run_name]
        lines.append(f"  exit {code}: {run_name}: {last_line(path)} (log: {path})")
    return "\n".join(lines)


def last_line(path: str) -> str:
    """The run's last line in its log (not srun's report of the exit that follows it)."""
    try:
        with open(path, errors="replace") as log:
            lines = [line.strip() for line in log if line.strip()]
    except OSError:
        return "(no log)"
    lines = [line for line in lines if not line.startswith("srun: ")]
    return lines[-1] if lines else "(empty log)"


def grid_records(trials, exit_codes, metric):
    """experiment.json's trials of a grid or random launch; states and values once its runs
    ended."""
    records = []
    for number, (setting, runs) in enumerate(trials):
        codes = [exit_codes.get(run_name) for run_name, _ in runs]
        state = "waiting" if None in codes else "failed" if any(codes) else "complete"
        curves = (
            search.logged_curves(Path("runs"), [run_name for run_name, _ in runs])
            if state == "complete"
            else None
        )
        records.append(
            dict(
                number=number,
                params=dict(setting),
                state=state,
                value=None if curves is None else search.objective(curves, metric),
                runs=[
                    search.run_record(run_name, exit_codes.get(run_name)) for run_name, _ in runs
                ],
            )
        )
    return records


def search_placeholders(args, command, seeds):
    """--dry-run of a tpe search: each session's command, with the searched flags' spaces in place
    of values."""
    space = [
        token for flag, values in args.sweep for token in [flag, f"<{spec.space_text(values)}>"]
    ]
    runs = trial_runs(
        command=command + space,
        env_ids=args.env_ids,
        seeds=seeds,
        index="N",
        setting=[],
        experiment=args.experiment,
        resume=True,
    )
    lines = [f"# --search tpe: up to {args.budget} trials (N = 0, 1, ...) of these runs each"]
    return "\n".join(lines + [shlex.join(argv) for _, argv in runs])


def run_search(args, command, seeds, experiment_dir, log_dir, workers):
    """Run a worker of the experiment's tpe study here; returns the exit code."""
    # Array tasks of one SLURM search draw apart; a local search is one worker.
    study = search.open_study(
        experiment_dir,
        args.experiment,
        vars(args),
        args.sweep_seed + int(os.environ.get("SLURM_ARRAY_TASK_ID", 0)),
    )
    recorded = Path(args.spec).parent / "experiment.json" if args.spec else None
    if (
        not study.trials
        and recorded
        and recorded.is_file()
        and recorded.parent.resolve() != experiment_dir.resolve()
    ):
        kept = [
            trial
            for trial in json.loads(recorded.read_text())["trials"]
            if trial["state"] != "failed"
        ]
        search.replay(study, kept, args.sweep)
        print(f"rerunning the {len(kept)} trials recorded in {recorded}", flush=True)
    search.write_record(study, experiment_dir)
    search_plan = search.SearchPlan(
        sweeps=args.sweep, budget=args.budget, report_every=args.report_every, metric=args.metric
    )

    def runs_of(index, setting):
        return trial_runs(
            command=command,
            env_ids=args.env_ids,
            seeds=seeds,
            index=index,
            setting=setting,
            experiment=args.experiment,
            resume=True,
        )

    os.makedirs(log_dir, exist_ok=True)
    worker = search.Worker(
        study=study,
        plan=search_plan,
        runs_of=runs_of,
        experiment_dir=experiment_dir,
        log_dir=Path(log_dir),
        workers=workers,
    )
    worker.run()
    states = [trial.state for trial in study.trials]
    print(
        ", ".join(
            f"{states.count(state)} {search.state_name(state)}"
            for state in sorted(set(states), key=str)
        )
    )
    return 1 if search.TrialState.FAIL in states else 0


def main():
    args = parse_command_line(sys.argv[1:])
    try:
        args, analysis = resolve(args)
        experiment, command, seeds, trials = plan(args)
        args.experiment = experiment
        options = slurm.job_options(args)
        if args.search_worker:
            options = None
        log_dir = args.log_dir or os.path.join("runs", "_launcher", experiment)
        experiment_dir = Path("runs", "_experiments", experiment)
        text = spec.dumps(
            {dest: getattr(args, dest) for dest in [*SPEC_OPTIONS, "sweep"]}, analysis
        )
        if options is not None:
            if trials is None:
                if options["slurm_ntasks"] > 1:
                    raise ValueError(
                        "--search tpe starts one process per run under SLURM; give --slurm-ntasks 1"
                    )
                worker = [
                    "python",
                    "-m",
                    "cleanba_utils.experiments.launch",
                    "--spec",
                    str(experiment_dir.resolve() / "spec.toml"),
                ]
                runs = [(f"worker{i}", [*worker, "--search-worker"]) for i in range(args.workers)]
            else:
                runs = [run for _, setting_runs in trials for run in setting_runs]
                if options["slurm_ntasks"] > 1 and "--distributed" not in command:
                    raise ValueError(
                        f"--slurm-ntasks {options['slurm_ntasks']} starts that many processes "
                        "per run, which train as one run only with --distributed; add it to "
                        "--command"
                    )
            with open(args.slurm_template_path) as file:
                template = file.read()
            script = slurm.sbatch_script(
                template=template,
                runs=runs,
                workers=args.workers,
                log_dir=log_dir,
                job_name=args.slurm_job_name or experiment,
                partition=args.slurm_partition,
                options=options,
            )
        if not args.dry_run:
            spec.prepare_folder(
                experiment_dir,
                text,
                dict(experiment=experiment, method=args.search, metric=args.metric),
            )
    except ValueError as error:
        fail(str(error), prog="launch")

    if options is not None:
        if args.dry_run:
            print(script, end="")
            return
        if trials is not None:
            spec.write_trials(experiment_dir, grid_records(trials, {}, args.metric))
        job_id = slurm.submit(script, log_dir, experiment)
        if not args.slurm_wait:
            sys.exit(0)
        run_names = [run_name for run_name, _ in runs]
        exit_codes = slurm.wait_for_array(job_id, run_names, log_dir)
        if trials is not None:
            spec.write_trials(experiment_dir, grid_records(trials, exit_codes, args.metric))
        log_paths = {
            run_name: slurm.task_log(log_dir, args.slurm_job_name or experiment, job_id, task)
            for task, run_name in enumerate(run_names)
        }
        print(summary(exit_codes, log_paths))
        sys.exit(1 if any(exit_codes.values()) else 0)
    if args.dry_run:
        if trials is None:
            print(search_placeholders(args, command, seeds))
        else:
            print("\n".join(shlex.join(argv) for _, runs in trials for _, argv in runs))
        return
    # Ctrl-C, SIGTERM (e.g. from a job scheduler) and SLURM's USR1 near the time limit stop the runs
    # alike; a launcher started in the background inherits an ignored SIGINT, hence all are set
    # here.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.default_int_handler)
    # The runs inherit the launcher's environment.
    workers = 1 if args.search_worker else args.workers
    shared = share_gpus(workers, os.environ)
    if shared:
        print(shared, flush=True)
    if trials is None:
        try:
            exit_code = run_search(
                args=args,
                command=command,
                seeds=seeds,
                experiment_dir=experiment_dir,
                log_dir=log_dir,
                workers=workers,
            )
        except KeyboardInterrupt:
            sys.exit(130)
        sys.exit(exit_code)
    exit_codes = {}
    try:
        exit_codes = run_local([run for _, runs in trials for run in runs], workers, log_dir)
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        spec.write_trials(experiment_dir, grid_records(trials, exit_codes, args.metric))
    log_paths = {run_name: os.path.join(log_dir, f"{run_name}.log") for run_name in exit_codes}
    print(summary(exit_codes, log_paths))
    sys.exit(1 if any(exit_codes.values()) else 0)


if __name__ == "__main__":
    main()
