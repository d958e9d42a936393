"""Shared test set-up: the real local Slurm cluster fixture (tests/slurm_fixture.py) for every test module.

Use it by naming the `slurm_cluster` fixture; do not re-declare pytest_plugins in test modules.
"""

pytest_plugins = ["slurm_fixture"]
