"""The Jinja2 environment: StrictUndefined, one shell-quoting filter (`q`), and a `finalize` that
refuses to print anything that did not come through it (or through the typed lines of quoting.py).

Templates are looked up first in the user's template folder (when one is given), then in the shipped
sbatch_templates/ and singularity/ folders, so a user can replace the whole script or one partial.
User templates get the same rules: they cannot print an unquoted string either. And since a
template folder is an input like job.yaml, the environment is Jinja2's immutable sandbox: a template
can lay out the values it is given, but cannot reach Python internals (`x.__init__.__globals__`),
call unsafe methods or mutate what it gets; an attempt is a RenderError and runs nothing.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hpctrain.errors import RenderError

if TYPE_CHECKING:
    from hpctrain.config import Job

TEMPLATE_DIR_ENV = "HPCTRAIN_TEMPLATE_DIR"
SCRIPT_TEMPLATE = "job.sbatch.j2"
RECIPE_TEMPLATE = "recipe.def.j2"


def shipped_dirs() -> list[Path]:
    from hpctrain.resources import data_dir

    return [data_dir("sbatch_templates"), data_dir("singularity")]


def template_dir_for(job: Job, override: Optional[str] = None) -> Optional[str]:
    """The user's template folder: the argument, else job.yaml's template_dir, else $HPCTRAIN_TEMPLATE_DIR."""
    chosen = override or getattr(job, "template_dir", None) or os.environ.get(TEMPLATE_DIR_ENV) or None
    if chosen is not None and not Path(chosen).is_dir():
        raise RenderError(f"template_dir: not a folder (got {chosen!r:.200}); give a folder holding "
                          f"{SCRIPT_TEMPLATE} and/or {RECIPE_TEMPLATE} or partials to override")
    return chosen


def _bytecode_cache() -> Any:
    """Compiled templates cached under ~/.cache/hpctrain (keyed by source checksum): `render` answers faster.

    None when the folder cannot be created (read-only home): templates are then compiled each time.
    """
    import jinja2
    import sys

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    # "sandbox" in the name: Jinja keys its cache by source only, and code compiled for a plain
    # environment calls functions without the sandbox's checks; never load it into this one.
    folder = base / "hpctrain" / f"jinja2-{jinja2.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-sandbox"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return jinja2.FileSystemBytecodeCache(str(folder)) if os.access(folder, os.W_OK) else None


MAX_TEMPLATE_BYTES = 1 << 20  # the shipped script template is ~10 KiB; a user's is an input like job.yaml


def _bounded_loader(search: list[str]) -> Any:
    """FileSystemLoader that refuses a template over MAX_TEMPLATE_BYTES (Jinja reads a file whole).

    Jinja's loader already skips anything that is not a regular file (a FIFO, /dev/zero), so only the
    size needs a check here.
    """
    import jinja2

    class BoundedLoader(jinja2.FileSystemLoader):
        def get_source(self, environment: Any, template: str) -> Any:
            from jinja2.loaders import split_template_path

            for folder in self.searchpath:  # the file Jinja will pick, measured before it is read
                path = os.path.join(folder, *split_template_path(template))
                if os.path.isfile(path):
                    if os.path.getsize(path) > MAX_TEMPLATE_BYTES:
                        raise RenderError(f"{path}: template larger than {MAX_TEMPLATE_BYTES} bytes; a job "
                                          "template is a page of text")
                    break
            return super().get_source(environment, template)

    return BoundedLoader(search)


@functools.lru_cache(maxsize=8)
def environment(user_dir: Optional[str] = None) -> Any:
    """The environment for one user template folder (None: shipped templates only)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from hpctrain.render.quoting import finalize, shell_quote

    search = ([user_dir] if user_dir else []) + [str(d) for d in shipped_dirs()]
    env = ImmutableSandboxedEnvironment(
        loader=_bounded_loader(search),
        undefined=jinja2.StrictUndefined,
        finalize=finalize,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        bytecode_cache=_bytecode_cache(),
    )
    env.filters["q"] = shell_quote
    # Jinja's default globals (cycler, joiner, namespace, lipsum, dict, range) are not needed by any
    # template; fewer objects within reach, fewer ways out of the sandbox.
    env.globals.clear()
    return env


def _template_location(exc: BaseException) -> str:
    """'file.j2:LINE' of the innermost template frame of a render error, or ''."""
    where, tb = "", exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name.endswith(".j2"):
            where = f"{Path(name).name}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def render_template(name: str, context: dict[str, Any], user_dir: Optional[str] = None) -> str:
    """Render template `name`; template mistakes become RenderError naming the template and line."""
    import jinja2

    try:
        return str(environment(user_dir).get_template(name).render(**context))
    except RenderError as exc:
        where = _template_location(exc)
        raise RenderError([f"{where}: {line}" if where else line for line in exc.problems]) from None
    except jinja2.exceptions.SecurityError as exc:
        where = _template_location(exc) or name
        raise RenderError(f"{where}: the template reaches outside the values it is given ({exc}); templates "
                          "may only lay out the context (see the shipped job.sbatch.j2)") from None
    except jinja2.TemplateError as exc:
        where = _template_location(exc) or getattr(exc, "filename", None) or name
        raise RenderError(f"{where}: {type(exc).__name__}: {exc}") from None
