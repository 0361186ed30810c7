#!/usr/bin/env bash
# One of the paper's Atari-57 experiments: 57 games x 3 seeds of one script, variant and setting.
#   benchmark/atari57.sh ALGORITHM VARIANT SETTING    e.g. benchmark/atari57.sh ppo sync base
#   ALGORITHM  ppo | impala
#   VARIANT    sync (actors wait for the newest parameters: policy lag 0)
#              | async (actors collect the next rollout while the learner trains: policy lag 1)
#   SETTING    base (1 GPU, 10 CPUs, layout a0-l0-d1; local, or a SLURM job array with SLURM=1)
#              | workstation (8 GPUs, 46 CPUs, layout a0-l1,2,3-d2: two SLURM tasks of 4 GPUs each,
#                actor on GPU 0 and learner on GPUs 1 2 3 of each, joined by jax.distributed)
#              | cpu (the pipeline end to end on CPUs, not learning: 57 games x 1 seed of a tiny
#                network and budget as a SLURM job array of 1 CPU per run, each scored by one
#                evaluation episode played to its end, since some games end no training episode
#                within the budget; waits for every run, then writes the HNS aggregation and plots
#                to runs/_hns/<experiment>/)
# Run inside the project environment, e.g. `uv run benchmark/atari57.sh ppo sync base`.
#   WORKERS=N          runs at a time (default 1; locally every base run uses GPU 0)
#   SLURM=1            base: submit a SLURM job array, 1 GPU and 10 CPUs per run, instead of running locally
#   TRACK=--track      log to Weights & Biases
#   DRY_RUN=--dry-run  print the commands (or the sbatch script) without running anything
#   RESUME=--resume    base, locally: continue the runs of an interrupted launch from their checkpoints
set -euo pipefail
usage="usage: benchmark/atari57.sh ppo|impala sync|async base|workstation|cpu"
[[ $# -eq 3 ]] || { echo "$usage" >&2; exit 2; }
algorithm=$1 variant=$2 setting=$3
case "$algorithm" in ppo|impala) ;; *) echo "$usage" >&2; exit 2 ;; esac
case "$variant" in sync) concurrency=--no-concurrency; name=${algorithm}_sync ;;
                   async) concurrency=--concurrency; name=$algorithm ;;
                   *) echo "$usage" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."  # the repository root
mapfile -t GAMES < <(tail -n +2 cleanba_utils/experiments/atari57_random_human.csv | cut -d, -f1)
SEEDS=3
case "$setting" in
    base)
        LAUNCH=(${RESUME:-})
        DEVICES="--actor-device-ids 0 --learner-device-ids 0"
        SIZE="--num-actor-threads 2 --local-num-envs 60 --envpool-num-threads 5"
        if [[ -n "${SLURM:-}" ]]; then
            LAUNCH+=(--slurm-template-path cleanba.slurm_template --slurm-gpus-per-task 1 --slurm-total-cpus 10)
        fi ;;
    workstation)
        LAUNCH=(--slurm-template-path cleanba.slurm_template --slurm-ntasks 2 --slurm-gpus-per-task 4
                --slurm-total-cpus 46)
        DEVICES="--distributed --actor-device-ids 0 --learner-device-ids 1 2 3"
        SIZE="--num-actor-threads 2 --local-num-envs 60 --envpool-num-threads 11" ;;
    cpu)
        SEEDS=1
        LAUNCH=(--slurm-template-path cleanba.slurm_template --slurm-gpus-per-task 0 --slurm-total-cpus 1
                --slurm-wait)
        DEVICES="--actor-device-ids 0 --learner-device-ids 0"
        SIZE="--num-actor-threads 1 --local-num-envs 1 --num-minibatches 1 --channels 4 8 --hiddens 64
              --total-timesteps 2000 --eval-episodes 1" ;;
    *) echo "$usage" >&2; exit 2 ;;
esac
experiment=${name}_$setting

python -m cleanba_utils.experiments.launch --env-ids "${GAMES[@]}" --num-seeds $SEEDS \
    --experiment "$experiment" --workers "${WORKERS:-1}" "${LAUNCH[@]}" ${DRY_RUN:-} \
    --command "python cleanba/cleanba_$algorithm.py --exp-name $experiment $concurrency $DEVICES \
        $SIZE ${TRACK:-}"

if [[ $setting == cpu && -z "${DRY_RUN:-}" ]]; then
    # `hns collect` reads every run folder under --runs-dir: give it this experiment's runs alone.
    hns=runs/_hns/$experiment
    mkdir -p "$hns/runs"
    for game in "${GAMES[@]}"; do
        ln -sfn "$PWD/runs/${game}__${experiment}__0__1" "$hns/runs/"
    done
    python -m cleanba_utils.experiments.hns collect --runs-dir "$hns/runs" --metric eval \
        --scores-out "$hns/scores.csv" --curves-out "$hns/curves.csv"
    python -m cleanba_utils.experiments.hns aggregate --scores "$hns/scores.csv"
    python -m cleanba_utils.experiments.hns plot --scores "$hns/scores.csv" \
        --curves "$hns/curves.csv" --out-dir "$hns/plots"
fi
