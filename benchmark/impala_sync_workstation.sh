#!/usr/bin/env bash
# Cleanba IMPALA (Sync) on the 57 Atari games x 3 seeds, workstation setting: 8 GPUs, 46 CPUs (layout a0-l1,2,3-d2):
# two processes (SLURM tasks) of 4 GPUs each, actor on GPU 0 and learner on GPUs 1 2 3 of each,
# joined by jax.distributed. Actors wait for the newest parameters: policy lag 0.
# Needs SLURM (it starts the two processes); one run takes a whole 8-GPU machine.
# Run inside the project environment, e.g. `uv run benchmark/impala_sync_workstation.sh`.
#   WORKERS=N          runs at a time, i.e. 8-GPU machines in use (default 1)
#   TRACK=--track      log to Weights & Biases
#   DRY_RUN=--dry-run  print the sbatch script without submitting it
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
mapfile -t GAMES < <(tail -n +2 cleanba_utils/atari57_random_human.csv | cut -d, -f1)

python -m cleanba_utils.benchmark --env-ids "${GAMES[@]}" --num-seeds 3 \
    --experiment impala_sync_workstation --workers "${WORKERS:-1}" ${DRY_RUN:-} \
    --slurm-template-path cleanba.slurm_template --slurm-ntasks 2 --slurm-gpus-per-task 4 --slurm-total-cpus 46 \
    --command "python cleanba/cleanba_impala.py --exp-name impala_sync_workstation --no-concurrency --distributed \
        --actor-device-ids 0 --learner-device-ids 1 2 3 --num-actor-threads 2 --local-num-envs 60 \
        --envpool-num-threads 11 ${TRACK:-}"
