"""Model-based search with early stopping: Optuna's TPE sampler picks each trial's flags, and its
pruner stops trials whose intermediate results fall behind.

A trial is one setting of the `[space]` flags, run as one session per environment and seed. Its
intermediate result at step s is the mean over its sessions of the running mean of the last 100
episodic returns logged by step s, read from the runs' own TensorBoard events every `report_every`
agent steps, once every session got there. A pruned trial's runs get SIGTERM, so they save a
checkpoint and could be resumed.

The study lives in `runs/_experiments/<experiment>/study.journal` (Optuna's journal storage: a file
with locks that work on shared filesystems), so any number of workers, local or SLURM array tasks,
share one study with no server. A worker runs up to `workers` runs at a time and asks the study for
a new trial when it has a free slot; it stops when the study holds `budget` trials (a few more when
workers ask at the same moment). A worker that is stopped (Ctrl-C, SIGTERM, SLURM's USR1) stops its
runs, which checkpoint, and hands their trials back: each is marked failed and enqueued again with
the same flags, and whichever worker takes it resumes the same runs from their checkpoints. A worker
that dies without warning leaves its trials running in the study; once their heartbeat is
STALE_SECONDS old, another worker hands them back the same way.
"""

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from cleanba_utils.experiments import spec
from cleanba_utils.experiments.events import GRID_POINTS, read_scalars, running_mean

LAST_N = 100
WORKER_POLL_SECONDS = 1.0
EVENTS_SECONDS = 5.0  # how often the runs' event files are read
HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 300.0  # a running trial whose worker was silent this long is handed back
# The time a stopped trial's run gets to save its checkpoint before it is killed.
TRIAL_STOP_GRACE_SECONDS = 60.0
optuna.logging.set_verbosity(optuna.logging.WARNING)


def open_study(experiment_dir: Path, name: str, method: dict, seed: int) -> optuna.Study:
    """The experiment's study, created on first use. `seed` differs per worker, so that workers draw
    apart."""
    startup = method["startup_trials"]
    pruners = {
        "none": optuna.pruners.NopPruner(),
        "median": optuna.pruners.MedianPruner(n_startup_trials=startup),
        "successive_halving": optuna.pruners.SuccessiveHalvingPruner(
            min_resource=method["report_every"]
        ),
    }
    return optuna.create_study(
        study_name=name,
        storage=JournalStorage(JournalFileBackend(str(experiment_dir / "study.journal"))),
        sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup),
        pruner=pruners[method["pruner"]],
        direction="maximize",
        load_if_exists=True,
    )


def suggest(trial: optuna.Trial, sweeps) -> list[tuple[str, str]]:
    """The trial's (flag, value) setting, drawn from the sweeps by the study's sampler."""
    setting = []
    for flag, values in sweeps:
        if isinstance(values, list):
            value = trial.suggest_categorical(flag, values)
        elif values[0] == "int":
            value = str(trial.suggest_int(flag, int(values[1]), int(values[2])))
        else:
            drawn = trial.suggest_float(flag, values[1], values[2], log=values[0] == "loguniform")
            value = f"{drawn:.6g}"
        setting.append((flag, value))
    return setting


def replay(study: optuna.Study, recorded_trials: list[dict], sweeps):
    """Enqueue the flags of an earlier experiment's trials, in their order, so a new study reruns
    them exactly."""
    kinds = dict(sweeps)
    for recorded in sorted(recorded_trials, key=lambda trial: trial["number"]):
        params = {}
        for flag, value in recorded["params"].items():
            kind = kinds[flag]
            params[flag] = (
                value
                if isinstance(kind, list)
                else int(value)
                if kind[0] == "int"
                else float(value)
            )
        study.enqueue_trial(params)


def value_at(curves, step: int) -> float:
    """Mean over sessions of the running mean of the last LAST_N returns logged by `step`."""
    at = [
        running_mean(c.values, LAST_N)[np.searchsorted(c.steps, step, side="right") - 1]
        for c in curves
    ]
    return float(np.mean(at))


def logged_curves(runs_dir: Path, run_names) -> dict | None:
    """{env_id: the episodic returns of each run}; None while a run has logged no episode."""
    by_env = {}
    for run_name in run_names:
        scalars = read_scalars(runs_dir / run_name)
        if not len(scalars.steps):
            return None
        by_env.setdefault(run_record(run_name, None)["env_id"], []).append(scalars)
    return by_env


def objective(curves_by_env: dict, metric: str) -> float:
    """The trial's metric as analyze.py defines it, averaged over its sessions, then
    environments."""
    # Imported here: analyze's plotting and statistics libraries take seconds to import, which every
    # launch (a dry run, a one-line error) would pay.
    from cleanba_utils.experiments import analyze

    per_env = []
    for curves in curves_by_env.values():
        if metric == "final_return":
            per_env.append(np.mean([analyze.final_return(c.values, LAST_N) for c in curves]))
        else:
            grid = np.linspace(0, max(c.steps[-1] for c in curves), GRID_POINTS)
            per_env.append(
                np.mean(
                    [analyze.auc(c.steps, running_mean(c.values, LAST_N), grid) for c in curves]
                )
            )
    return float(np.mean(per_env))


class SearchPlan(NamedTuple):
    """What a worker searches: the sweeps (flag, values or range), the number of trials, the agent
    steps between intermediate results (None: no pruning) and the metric."""

    sweeps: list
    budget: int
    report_every: int | None
    metric: str


@dataclass
class ActiveTrial:
    trial: optuna.Trial
    runs: list  # (run name, argv) of every session
    pending: list
    processes: dict = field(default_factory=dict)  # run name -> Popen
    exit_codes: dict = field(default_factory=dict)
    reported_step: int = 0
    stopping_since: float | None = None

    def run_dirs(self, runs_dir: Path):
        return [runs_dir / run_name for run_name, _ in self.runs]


def signal_group(process, signum):
    # Each run leads its own process group, so this also reaches the processes the run started.
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


class Worker:
    """Runs trials of one study, at most `workers` runs at a time, until the study holds `budget`
    trials."""

    def __init__(
        self,
        study: optuna.Study,
        plan: SearchPlan,
        runs_of,
        experiment_dir: Path,
        log_dir: Path,
        workers: int,
    ):
        """`runs_of(index, setting)` gives the (run name, argv) of every session of a setting."""
        self.study = study
        self.plan = plan
        self.runs_of = runs_of
        self.workers = workers
        self.experiment_dir = experiment_dir
        self.log_dir = log_dir
        self.runs_dir = experiment_dir.parent.parent
        self.active: list[ActiveTrial] = []
        self.heartbeat_at = 0.0
        self.events_at = 0.0
        self.reclaim_at = 0.0

    def running(self) -> int:
        return sum(len(active.processes) for active in self.active)

    def wants_trial(self) -> bool:
        trials = self.study.get_trials(deepcopy=False)
        waiting = any(trial.state == TrialState.WAITING for trial in trials)
        # A trial handed back was enqueued again (waiting, then run): the two count once.
        retried = {trial.user_attrs.get("retry_of") for trial in trials}
        return waiting or sum(trial.number not in retried for trial in trials) < self.plan.budget

    def start_trial(self):
        trial = self.study.ask()
        setting = suggest(trial, self.plan.sweeps)
        # A trial handed back by a stopped worker continues the same runs from their checkpoints.
        index = trial.user_attrs.get("runs_of", trial.number)
        runs = self.runs_of(index, setting)
        trial.set_user_attr("runs_of", index)
        trial.set_user_attr("flags", dict(setting))
        trial.set_user_attr("runs", [run_name for run_name, _ in runs])
        flags = shlex.join(token for pair in setting for token in pair)
        # The same flags and seeds give the same runs, so a setting that completed is not run again.
        done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        same = next(
            (earlier for earlier in done if earlier.user_attrs.get("flags") == dict(setting)), None
        )
        if same is not None:
            trial.set_user_attr("runs_of", same.user_attrs["runs_of"])
            trial.set_user_attr("runs", same.user_attrs["runs"])
            self.study.tell(trial, same.value)
            print(
                f"trial {trial.number}: {flags}: as trial {same.number}, {same.value:.4g}",
                flush=True,
            )
            return
        trial.set_user_attr("heartbeat", time.time())
        self.active.append(ActiveTrial(trial, runs, list(runs)))
        print(f"trial {trial.number}: {flags}", flush=True)

    def launch(self, active: ActiveTrial):
        run_name, argv = active.pending.pop(0)
        with open(self.log_dir / f"{run_name}.log", "a") as log:
            log.write(shlex.join(argv) + "\n")
            log.flush()
            process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        active.processes[run_name] = process

    def fill_slots(self):
        while self.running() < self.workers:
            waiting = [
                active for active in self.active if active.pending and active.stopping_since is None
            ]
            if waiting:
                self.launch(waiting[0])
            elif self.wants_trial():
                self.start_trial()
            else:
                return

    def stop_runs(self, active: ActiveTrial):
        active.pending.clear()
        active.stopping_since = time.monotonic()
        for process in active.processes.values():
            signal_group(process, signal.SIGTERM)

    def report(self, active: ActiveTrial):
        every = self.plan.report_every
        # Every step that all sessions' logs reached is reported, also after a session has ended:
        # what the pruner sees depends on the logged data, not on when this worker looked.
        if every is None or active.pending or any(active.exit_codes.values()):
            return
        curves = [read_scalars(run_dir) for run_dir in active.run_dirs(self.runs_dir)]
        if any(len(c.steps) == 0 for c in curves):
            return
        reached = min(int(c.steps[-1]) for c in curves)
        for step in range(active.reported_step + every, reached + 1, every):
            active.trial.report(value_at(curves, step), step)
            active.reported_step = step
            if active.trial.should_prune():
                print(f"trial {active.trial.number}: pruned at step {step}", flush=True)
                self.stop_runs(active)
                return

    def finish(self, active: ActiveTrial):
        self.active.remove(active)
        active.trial.set_user_attr("exit_codes", active.exit_codes)
        number = active.trial.number
        if active.stopping_since is not None:
            self.study.tell(active.trial, state=TrialState.PRUNED)
        elif any(active.exit_codes.values()):
            print(
                f"trial {number}: failed, exit codes {active.exit_codes} (logs in {self.log_dir})",
                flush=True,
            )
            self.study.tell(active.trial, state=TrialState.FAIL)
        elif (
            curves := logged_curves(self.runs_dir, [run_name for run_name, _ in active.runs])
        ) is None:
            print(f"trial {number}: failed, a run logged no episode", flush=True)
            self.study.tell(active.trial, state=TrialState.FAIL)
        else:
            value = objective(curves, self.plan.metric)
            print(f"trial {number}: {self.plan.metric} {value:.4g}", flush=True)
            self.study.tell(active.trial, value)
        write_record(self.study, self.experiment_dir)

    def poll(self):
        now = time.monotonic()
        for active in list(self.active):
            for run_name, process in list(active.processes.items()):
                if process.poll() is not None:
                    active.exit_codes[run_name] = process.returncode
                    del active.processes[run_name]
            if (
                active.stopping_since is not None
                and now - active.stopping_since > TRIAL_STOP_GRACE_SECONDS
            ):
                for process in active.processes.values():
                    signal_group(process, signal.SIGKILL)
            if not active.processes and not active.pending:
                if active.stopping_since is None:
                    self.report(active)
                self.finish(active)
        if now - self.events_at > EVENTS_SECONDS:
            self.events_at = now
            for active in self.active:
                if active.stopping_since is None:
                    self.report(active)
        if now - self.heartbeat_at > HEARTBEAT_SECONDS:
            self.heartbeat_at = now
            for active in self.active:
                active.trial.set_user_attr("heartbeat", time.time())
        if now - self.reclaim_at > STALE_SECONDS / 4:
            self.reclaim_at = now
            mine = {active.trial.number for active in self.active}
            for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                if (
                    trial.number not in mine
                    and time.time() - trial.user_attrs.get("heartbeat", 0) > STALE_SECONDS
                ):
                    hand_back(
                        self.study,
                        trial.number,
                        trial.params,
                        trial.user_attrs.get("runs_of", trial.number),
                    )

    def run(self):
        """Runs trials until the budget is reached; on KeyboardInterrupt, stops and hands back its
        trials."""
        try:
            self.fill_slots()
            while self.active:
                time.sleep(WORKER_POLL_SECONDS)
                self.poll()
                self.fill_slots()
        except KeyboardInterrupt:
            for active in self.active:
                self.stop_runs(active)
            for active in self.active:
                for process in active.processes.values():
                    try:
                        process.wait(timeout=TRIAL_STOP_GRACE_SECONDS)
                    except subprocess.TimeoutExpired:
                        signal_group(process, signal.SIGKILL)
                hand_back(
                    self.study,
                    active.trial.number,
                    active.trial.params,
                    active.trial.user_attrs["runs_of"],
                )
            write_record(self.study, self.experiment_dir)
            raise
        write_record(self.study, self.experiment_dir)


def hand_back(study: optuna.Study, number: int, params: dict, runs_of: int):
    """Mark a running trial failed and enqueue its flags again, to resume the same runs."""
    try:
        study.tell(number, state=TrialState.FAIL)
    except (ValueError, RuntimeError):
        return  # another worker finished or handed it back first
    study.enqueue_trial(params, user_attrs={"runs_of": runs_of, "retry_of": number})


def state_name(state: TrialState) -> str:
    return "failed" if state == TrialState.FAIL else state.name.lower()


def run_record(run_name: str, exit_code: int | None) -> dict:
    # Run names are ENV_ID__EXPERIMENT__TRIAL__SEED; environment ids hold no "__".
    parts = run_name.split("__")
    return dict(run_name=run_name, env_id=parts[0], seed=int(parts[-1]), exit_code=exit_code)


def trial_records(study: optuna.Study) -> list[dict]:
    records = []
    for trial in study.get_trials(deepcopy=False):
        runs = trial.user_attrs.get("runs", [])
        exit_codes = trial.user_attrs.get("exit_codes", {})
        records.append(
            dict(
                number=trial.number,
                params=trial.user_attrs.get("flags", {}),
                state=state_name(trial.state),
                value=trial.value,
                runs=[run_record(run_name, exit_codes.get(run_name)) for run_name in runs],
            )
        )
    return records


def write_record(study: optuna.Study, experiment_dir: Path):
    """Rewrite the trials in experiment.json from the study."""
    spec.write_trials(experiment_dir, trial_records(study))
