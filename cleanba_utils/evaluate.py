"""Plays episodes with a model saved by a Cleanba script (`--save-model`).

python -m cleanba_utils.evaluate runs/<run_name>/<exp_name>.cleanba_model --episodes 10
python -m cleanba_utils.evaluate <entity>/<env_id>-<exp_name>-seed<seed> --episodes 10

The model is a path when that path exists: a model file, or a folder that holds one (a run folder, a
downloaded repository). Otherwise `entity/name` is a Hugging Face Hub repository id, which
huggingface_hub downloads (`--upload-model` made it: cleanba_utils.hub).

The file names the script that wrote it; that script's own network and environments play the
episodes, so evaluation always matches training. The contract every script in `cleanba/` keeps:
- `Args`, its tyro dataclass, which `run_files.args_from_dict` rebuilds from the saved arguments;
- `evaluate(params, args, num_episodes, seed) -> list[float]` plays one episode in each of
  `num_episodes` fresh environments (its `make_env`, seeded `seed + i`) with its `Network`, and
  returns the unclipped returns;
- `Run.finish` (cleanba_utils.run) saves the model with the script's file name, which names the
  module here."""

import argparse
import errno
import importlib
import json
import os
import sys

import flax.serialization
import msgpack
import numpy as np

from cleanba_utils import hub
from cleanba_utils.run_files import args_from_dict


def model_file(source: str) -> str:
    """The model file that `source` names: an existing file, the model file of an existing folder,
    or else that of the Hub repository `source` (`entity/name`), downloaded. Raises OSError, whose
    message says why there is none."""
    if os.path.isfile(source):
        return source
    if os.path.isdir(source):
        return hub.model_in_folder(source)
    if not hub.is_repository_id(source):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), source)
    try:
        folder = hub.download(source)
    except OSError as error:
        raise OSError(
            f"no such file or folder here, nor a Hugging Face Hub repository to download ({error})"
        ) from error
    return hub.model_in_folder(folder)


def load_model(path: str):
    """Returns (script module, its Args, params) of a saved model."""
    with open(path, "rb") as f:
        saved = flax.serialization.msgpack_restore(f.read())
    script = importlib.import_module(f"cleanba.{saved['script']}")
    return script, args_from_dict(script.Args, saved["args"]), saved["params"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "model",
        help="a .cleanba_model file, a folder that holds one, or a Hugging Face Hub repository id "
        "(entity/name) when no such path exists",
    )
    parser.add_argument("--episodes", type=int, default=10, help="number of episodes to play")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="environment seed (default: the run's seed + 1,000,000)",
    )
    parser.add_argument("--json", action="store_true", help="print the returns as JSON")
    options = parser.parse_args(argv)
    if options.episodes <= 0:
        parser.exit(2, f"error: --episodes must be positive, got {options.episodes}\n")
    try:
        path = model_file(options.model)
        script, args, params = load_model(path)
    except OSError as e:
        parser.exit(2, f"error: cannot read {options.model}: {e.strerror or e}\n")
    except (ValueError, KeyError, TypeError, ImportError, msgpack.UnpackException):
        parser.exit(
            2, f"error: {options.model} is not a model saved by a Cleanba script (--save-model)\n"
        )
    seed = args.seed + 1_000_000 if options.seed is None else options.seed
    returns = script.evaluate(params, args, options.episodes, seed)
    if options.json:
        print(json.dumps({"env_id": args.env_id, "returns": returns}))
    else:
        mean_return = np.mean(returns)
        print(
            f"{args.env_id}: mean return {mean_return:.2f} over {len(returns)} episodes: {returns}"
        )


if __name__ == "__main__":
    sys.exit(main())
