"""Diagnose: doctor findings and report plots from what the runtime and Slurm left in a run directory."""
