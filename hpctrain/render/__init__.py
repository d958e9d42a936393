"""Render: the sbatch script and the Singularity/Apptainer recipe from Jinja2 templates."""
