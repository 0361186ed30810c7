"""Experiment spec files: one TOML file describes one experiment of
`python -m cleanba_utils.experiments.launch`.

    experiment = "ppo_cartpole_search"  # optional; default: the file name without .toml
    command = "python cleanba/cleanba_ppo.py --total-timesteps 100000"  # script and fixed flags
    env_ids = ["CartPole-v1"]  # or "atari57": the 57 games of atari57_random_human.csv
    num_seeds = 2              # sessions per trial and environment
    start_seed = 1

    [space]                    # the script flags searched; none: one trial
    "--learning-rate" = {loguniform = [1e-4, 3e-3]}
    "--clip-coef" = [0.1, 0.2, 0.3]     # grid values, or choices for random and tpe
    "--update-epochs" = {int = [2, 8]}  # also {uniform = [LOW, HIGH]}

    [search]
    method = "tpe"             # grid | random | tpe (Optuna's TPE with pruning)
    budget = 8                 # trials drawn by random and tpe
    seed = 0
    metric = "final_return"    # final_return | auc; higher is better
    pruner = "median"          # tpe: none | median | successive_halving
    report_every = 20000       # tpe: agent steps between the intermediate results
    startup_trials = 2         # tpe: trials before the sampler models and the pruner prunes

    [resources]
    workers = 2                # runs at a time (locally) or array tasks at a time (SLURM)
    slurm_template = "cleanba.slurm_template"  # optional: submit to SLURM, with
    # slurm_gpus_per_task, slurm_ntasks, slurm_nodes, slurm_total_cpus, slurm_time ("2-00:00:00"),
    # slurm_signal_lead (seconds), slurm_job_name, slurm_partition

    [thresholds]               # optional, for the analysis: steps to reach these returns
    "CartPole-v1" = 475.0
    [random_scores]            # optional, for the analysis: the return of random play
    "CartPole-v1" = 22.0

Merging with the launcher's command-line options: every key has one option (`command` is
`--command`, `[space]` is `--sweep`, `search.seed` is `--sweep-seed`, `resources.slurm_template` is
`--slurm-template-path`, the others their own name). An option fills what the spec leaves out; an
option that the spec also sets is a clash (one `--sweep` flag in both too), an error. `--experiment`
may rename a spec's experiment: the name says where the results go, not what runs. `--dry-run`,
`--resume` and `--log-dir` say how to launch, not what, and are never in a spec.

Every launch keeps its experiment folder, `runs/_experiments/<experiment>/`: `spec.toml`, the spec
that gives exactly this launch (the command line's options merged in), and `experiment.json`, with
the git commit and the resolved trials (flags, run names, states, metric values). `--spec
runs/_experiments/<experiment>/spec.toml` continues the experiment where it stopped; the same file
elsewhere (for example in a fresh clone, with its experiment.json beside it) reruns the recorded
trials with the same flags.
"""

import json
import subprocess
import tomllib
from pathlib import Path

import tomli_w

from cleanba_utils.experiments.sweeps import DISTRIBUTIONS
from cleanba_utils.run_files import write_json_atomically

# Top-level keys and tables, each key with the launcher option (argparse dest) that it sets.
TOP = {
    "experiment": "experiment",
    "command": "command",
    "env_ids": "env_ids",
    "num_seeds": "num_seeds",
    "start_seed": "start_seed",
}
TABLES = {
    "search": {
        "method": "search",
        "budget": "budget",
        "seed": "sweep_seed",
        "metric": "metric",
        "pruner": "pruner",
        "report_every": "report_every",
        "startup_trials": "startup_trials",
    },
    "resources": {
        "workers": "workers",
        "slurm_template": "slurm_template_path",
        "slurm_gpus_per_task": "slurm_gpus_per_task",
        "slurm_ntasks": "slurm_ntasks",
        "slurm_nodes": "slurm_nodes",
        "slurm_total_cpus": "slurm_total_cpus",
        "slurm_time": "slurm_time",
        "slurm_signal_lead": "slurm_signal_lead",
        "slurm_job_name": "slurm_job_name",
        "slurm_partition": "slurm_partition",
    },
}
TYPES = {
    "command": str,
    "experiment": str,
    "metric": str,
    "pruner": str,
    "search": str,
    "slurm_job_name": str,
    "slurm_partition": str,
    "slurm_template_path": str,
    "slurm_time": str,
    "sweep_seed": int,
    "start_seed": int,
}
POSITIVE = {
    "num_seeds",
    "budget",
    "report_every",
    "startup_trials",
    "workers",
    "slurm_gpus_per_task",
    "slurm_ntasks",
    "slurm_nodes",
    "slurm_total_cpus",
    "slurm_signal_lead",
}
# What an experiment's `metric` may be; the analysis defines them (analyze.py).
METRICS = ("final_return", "auc")


def option_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_type(where: str, dest: str, value):
    if dest in POSITIVE:
        if type(value) is not int or value < 1:
            raise ValueError(f"{where} must be a positive integer, got {value!r}")
    elif type(value) is not TYPES[dest]:
        raise ValueError(f"{where} must be a {TYPES[dest].__name__}, got {value!r}")


def space_entry(flag: str, entry):
    """A `[space]` entry as the launcher's sweep: (flag, ["v1", "v2"]) or (flag, (range name, low,
    high))."""
    where = f"[space] {flag!r}"
    if isinstance(entry, list):
        if not entry or not all(
            isinstance(value, str | int | float) and value != "" for value in entry
        ):
            raise ValueError(f"{where} needs a non-empty list of values (numbers or strings)")
        return flag, [str(value) for value in entry]
    if isinstance(entry, dict) and len(entry) == 1 and next(iter(entry)) in DISTRIBUTIONS:
        name, bounds = next(iter(entry.items()))
        numbers = (
            isinstance(bounds, list)
            and len(bounds) == 2
            and all(type(b) in (int, float) for b in bounds)
        )
        if numbers and bounds[0] < bounds[1] and (name != "loguniform" or bounds[0] > 0):
            if name != "int" or all(type(b) is int for b in bounds):
                return flag, (name, float(bounds[0]), float(bounds[1]))
    raise ValueError(
        f"{where} must be a list of values or one range: {{uniform = [LOW, HIGH]}}, "
        "{loguniform = [LOW, HIGH]} (LOW > 0) or {int = [LOW, HIGH]} (integers), with LOW < HIGH"
    )


def env_ids_of(value) -> list[str]:
    # Imported here: hns's plotting and statistics libraries take seconds to import, which every
    # launch would pay.
    from cleanba_utils.experiments.hns import reference_scores

    if value == "atari57":
        return list(reference_scores())
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(env_id, str) and env_id for env_id in value)
    ):
        raise ValueError(
            f'env_ids must be a non-empty list of environment ids or "atari57", got {value!r}'
        )
    return value


def load(path: Path) -> tuple[dict, dict]:
    """(launcher options, analysis tables) of the spec at `path`; a ValueError says what is wrong
    with it."""
    try:
        document = tomllib.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"cannot read the spec {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path} is not valid TOML: {error}") from None
    options = {}
    analysis = {}
    for key, value in document.items():
        if key in TOP:
            dest = TOP[key]
            if dest == "env_ids":
                options[dest] = env_ids_of(value)
            else:
                check_type(key, dest, value)
                options[dest] = value
        elif key == "space":
            if not isinstance(value, dict) or not value:
                raise ValueError(
                    "[space] is empty; give at least one flag, or leave the table out for one trial"
                )
            options["sweep"] = [space_entry(flag, entry) for flag, entry in value.items()]
        elif key in TABLES and isinstance(value, dict):
            for name, item in value.items():
                if name not in TABLES[key]:
                    raise ValueError(
                        f"unknown key {name!r} in [{key}]; known: {', '.join(TABLES[key])}"
                    )
                check_type(f"{key}.{name}", TABLES[key][name], item)
                options[TABLES[key][name]] = item
        elif key in ("thresholds", "random_scores") and isinstance(value, dict):
            if not all(type(score) in (int, float) for score in value.values()):
                raise ValueError(f"[{key}] maps environment ids to numbers")
            analysis[key] = {env_id: float(score) for env_id, score in value.items()}
        else:
            known = [
                *TOP,
                *(f"[{table}]" for table in (*TABLES, "space", "thresholds", "random_scores")),
            ]
            raise ValueError(f"unknown key {key!r} in {path}; known: {', '.join(known)}")
    options.setdefault("experiment", Path(path).stem)
    return options, analysis


def merge(spec_options: dict, given: dict) -> dict:
    """The spec's options with the explicitly given command-line options added; one set in both is
    a ValueError."""
    merged = dict(spec_options)
    for dest, value in given.items():
        if dest == "sweep":
            in_spec = {flag for flag, _ in spec_options.get("sweep", [])}
            clashes = [flag for flag, _ in value if flag in in_spec]
            if clashes:
                raise ValueError(
                    f"--sweep {clashes[0]} is also in the spec's [space]; give it in one place"
                )
            merged["sweep"] = spec_options.get("sweep", []) + value
        elif dest in spec_options and dest != "experiment":
            raise ValueError(f"{option_name(dest)} is also set in the spec; give it in one place")
        else:
            merged[dest] = value
    return merged


def document(options: dict, analysis: dict) -> dict:
    """The spec file (as a TOML document) that gives exactly `options`: what the experiment folder
    keeps."""
    where = {dest: key for key, dest in TOP.items()}
    tables = {table: {dest: key for key, dest in keys.items()} for table, keys in TABLES.items()}
    result = {where[dest]: options[dest] for dest in where if options.get(dest) is not None}
    for table, keys in tables.items():
        values = {keys[dest]: options[dest] for dest in keys if options.get(dest) is not None}
        if values:
            result[table] = values
    return result | analysis


def bounds_of(values):
    name, low, high = values
    return (int(low), int(high)) if name == "int" else (low, high)


def dumps(options: dict, analysis: dict) -> str:
    """The spec as TOML text. The [space] table is written by hand: tomli_w writes a range, an
    inline table, as a table of its own after the lists, but the order of the flags decides how the
    sampler draws."""
    text = tomli_w.dumps(document(options, analysis))
    if options.get("sweep"):
        lines = ["", "[space]"]
        for flag, values in options["sweep"]:
            value = (
                json.dumps(values)
                if isinstance(values, list)
                else "{{{} = [{!r}, {!r}]}}".format(values[0], *bounds_of(values))
            )
            lines.append(f"{json.dumps(flag)} = {value}")
        text += "\n".join(lines) + "\n"
    return text


def space_text(values) -> str:
    """A sweep as the command line writes it: `a,b` or `loguniform(1e-4,3e-3)`."""
    if isinstance(values, list):
        return ",".join(values)
    low, high = bounds_of(values)
    return f"{values[0]}({low:g},{high:g})"


def git_revision() -> dict:
    """The commit that the working directory is at, and whether tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    changes = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return dict(git_sha=head.stdout.strip() or "unknown", git_dirty=bool(changes.stdout.strip()))


def prepare_folder(experiment_dir: Path, text: str, record: dict):
    """Write the experiment folder's spec.toml and experiment.json; a folder that exists must hold
    the same spec ([resources] aside, so that a continued experiment may run on other machines)."""
    spec_path = experiment_dir / "spec.toml"
    if spec_path.exists():
        before = tomllib.loads(spec_path.read_text())
        now = tomllib.loads(text)
        before.pop("resources", None)
        now.pop("resources", None)
        if before != now:
            raise ValueError(
                f"{experiment_dir} holds another spec for this experiment name; choose another "
                "--experiment name, or remove that folder"
            )
    experiment_dir.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(text)
    path = experiment_dir / "experiment.json"
    trials = json.loads(path.read_text()).get("trials", []) if path.exists() else []
    write_json_atomically(
        path, {**record, **git_revision(), "spec": tomllib.loads(text), "trials": trials}
    )


def write_trials(experiment_dir: Path, trials: list[dict]):
    path = experiment_dir / "experiment.json"
    write_json_atomically(path, {**json.loads(path.read_text()), "trials": trials})
