"""hpctrain: from a transformer and a Slurm cluster to a well-laid-out, preemption-proof training job."""

__version__ = "0.1.0"
