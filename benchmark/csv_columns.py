"""The columns every benchmark CSV starts with: one row per run."""

RUN_COLUMNS = [
    "script",
    "mode",
    "env_id",
    "seed",
    "steps",
    "final_return",
    "eval_return",
    "sps",
    "wall_time_s",
]
