#!/usr/bin/env bash
# Cleanba IMPALA (Sync) on the 57 Atari games x 3 seeds, base setting: 1 GPU, 10 CPUs (layout a0-l0-d1).
# Actors wait for the newest parameters: policy lag 0.
# Run inside the project environment, e.g. `uv run benchmark/impala_sync_base.sh`.
#   WORKERS=N          runs at a time (default 1; locally every run uses GPU 0)
#   SLURM=1            submit a SLURM job array, 1 GPU and 10 CPUs per run, instead of running locally
#   TRACK=--track      log to Weights & Biases
#   DRY_RUN=--dry-run  print the commands (or the sbatch script) without running anything
#   RESUME=--resume    locally: continue the runs of an interrupted launch from their checkpoints
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
mapfile -t GAMES < <(tail -n +2 cleanba_utils/atari57_random_human.csv | cut -d, -f1)
SLURM_ARGS=()
if [[ -n "${SLURM:-}" ]]; then
    SLURM_ARGS=(--slurm-template-path cleanba.slurm_template --slurm-gpus-per-task 1 --slurm-total-cpus 10)
fi

python -m cleanba_utils.benchmark --env-ids "${GAMES[@]}" --num-seeds 3 \
    --experiment impala_sync_base --workers "${WORKERS:-1}" "${SLURM_ARGS[@]}" ${DRY_RUN:-} ${RESUME:-} \
    --command "python cleanba/cleanba_impala.py --exp-name impala_sync_base --no-concurrency \
        --actor-device-ids 0 --learner-device-ids 0 --num-actor-threads 2 --local-num-envs 60 \
        --envpool-num-threads 5 ${TRACK:-}"
