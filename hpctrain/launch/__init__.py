"""Launch: submitit executors (Slurm, local), submit / sweep / status / cancel / resume, run directories."""
