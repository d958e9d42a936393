"""Package discovery for setuptools; all metadata is in pyproject.toml.

Every package under hpctrain/ is found (a hand-made list once left hpctrain.rundir out of the wheel), and the
three data folders at the top of the repository are mapped into the package (pyproject.toml's package-dir).
"""

from setuptools import find_packages, setup

DATA_PACKAGES = ["hpctrain.sbatch_templates", "hpctrain.singularity", "hpctrain.examples"]

setup(packages=find_packages(include=["hpctrain", "hpctrain.*"]) + DATA_PACKAGES)
