"""Render: the sbatch script and the Singularity/Apptainer recipe from Jinja2 templates.

    render_script(job, *, array=None, run_dir) -> str      the sbatch script
    render_recipe(job) -> str                               the recipe (.def)
    write_rendered(job, out_dir, *, run_dir=None) -> dict   {"script", "recipe", "resolved"} paths

The templates live in sbatch_templates/ and singularity/ (shipped as package data) and can be
overridden from a user folder. Never imports torch.
"""

from hpctrain.render.rendering import (
    RECIPE_FILE,
    RESOLVED_FILE,
    SCRIPT_FILE,
    render_recipe,
    render_script,
    resolve,
    write_rendered,
)

__all__ = ["RECIPE_FILE", "RESOLVED_FILE", "SCRIPT_FILE", "render_recipe", "render_script", "resolve",
           "write_rendered"]
