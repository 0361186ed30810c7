"""The experiment layer: launching runs (launch, sweeps, slurm, spec, search), reading what they
logged (events) and reporting on them (analyze, hns, figures). The training scripts never import
it."""
