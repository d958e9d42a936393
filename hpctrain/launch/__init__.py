"""Launch: one Executor interface (executor.py) with backends local/, slurm/ (through submitit), ray/ and
volcano/; submit / sweep / status / cancel / resume / logs through it, without backend names."""
