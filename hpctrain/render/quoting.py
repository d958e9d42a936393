"""The only ways a value may reach a rendered file, each a `str` subclass the environment accepts.

Templates lay out text; every value they interpolate must be one of these (the environment's
`finalize` rejects anything else, so a template, shipped or the user's, cannot print a raw string):

- `ShellWord`      produced by the `q` filter (`shell_quote`): one shell word, single-quoted when needed.
                   This is the one shell-quoting filter; every string in a shell position goes through it.
- `SbatchLine`     the argument of one `#SBATCH` line, built and validated in Python (`sbatch_line`).
                   sbatch parses these lines itself (not the shell), with its own quoting rules.
- `CommentText`    the text of a `# ...` comment written by hpctrain (one line, printable).
- `ShellByDesign`  one of the user's `slurm.setup` lines: shell by design, run as written.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from hpctrain.errors import RenderError


class ShellWord(str):
    """A string that is exactly one shell word (the output of `shell_quote`)."""


class SbatchLine(str):
    """The text after `#SBATCH ` on one line, safe for sbatch's own parser."""


class CommentText(str):
    """One line of hpctrain-written comment text (no newline, no control characters)."""


class ShellByDesign(str):
    """A `slurm.setup` line: shell code the user wrote, rendered verbatim."""


ACCEPTED = (ShellWord, SbatchLine, CommentText, ShellByDesign)


def shell_quote(value: Any) -> ShellWord:
    """The `q` filter: a str or int as one shell word that the shell reads back byte-for-byte."""
    if isinstance(value, ShellWord):
        return value
    from jinja2 import Undefined

    if isinstance(value, Undefined):
        str(value)  # StrictUndefined raises UndefinedError, naming the variable
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RenderError(f"the q filter quotes strings and integers only (got {type(value).__name__} {value!r:.80})")
    return ShellWord(shlex.quote(str(value)))


def finalize(value: Any) -> Any:
    """The environment's `finalize`: what every `{{ ... }}` prints must be one of the ACCEPTED types."""
    if isinstance(value, ACCEPTED):
        return value
    raise RenderError(f"a template prints {type(value).__name__} {value!r:.80} without the shell-quoting "
                      "filter; write {{ value | q }} (only q, sbatch_lines, comments and setup_lines may be printed)")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def comment(text: str) -> CommentText:
    """hpctrain's own comment text; a newline here would turn the rest of the comment into code."""
    if _CONTROL.search(text):
        raise RenderError(f"comment text must be one printable line (got {text!r:.80})")
    return CommentText(text)


def comment_lines(text: str, width: int = 100) -> list[CommentText]:
    """`text` wrapped into comment lines of at most `width` characters."""
    import textwrap

    return [comment(line) for line in textwrap.wrap(text, width, break_on_hyphens=False)]


# Characters sbatch's #SBATCH parser (src/sbatch/opt.c, _get_argument) passes through unchanged. It
# splits arguments on whitespace (even a backslash-escaped one), groups with '...' or "...", drops the
# backslash of any other `\x` (inside quotes too) and ends the line at an unquoted #. A value with any
# other character is therefore written as "..." with \ and " escaped (checked on Slurm 22.05).
_SBATCH_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.,:=/@%+-")
# Some sbatch versions treat an #SBATCH line containing these words as a heterogeneous-job separator,
# so a value never spells them out on the raw line: "het\job" reads back as "hetjob".
_HETJOB_WORDS = re.compile(r"hetjob|packjob", re.IGNORECASE)


def sbatch_escape(value: str, field: str) -> str:
    """`value` written so sbatch's #SBATCH parser yields it byte-for-byte, or RenderError."""
    bad = _CONTROL.search(value)
    if bad:
        raise RenderError(f"{field}: a #SBATCH line cannot carry control characters such as newlines or tabs "
                          f"(got {value!r:.80}, {bad.group()!r} at offset {bad.start()}); remove them")
    breaks = {m.end() - 3 for m in _HETJOB_WORDS.finditer(value)}
    if not breaks and all(ch in _SBATCH_PLAIN for ch in value):
        return value
    body = "".join("\\" + ch if ch in '"\\' or i in breaks else ch for i, ch in enumerate(value))
    return f'"{body}"'


def sbatch_line(option: str, value: str | int | None = None, *, field: str = "") -> SbatchLine:
    """`--option` or `--option=value` for one #SBATCH line; the value escaped for sbatch's parser."""
    if not re.fullmatch(r"[a-z][a-z0-9-]*", option) or _HETJOB_WORDS.search(option):
        raise RenderError(f"{field or option}: not a usable sbatch option name (got {option!r:.80}); "
                          "use the long name without dashes, e.g. mail-type")
    if value is None:
        return SbatchLine(f"--{option}")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RenderError(f"{field or option}: expected a string or an integer (got {value!r:.80})")
    return SbatchLine(f"--{option}={sbatch_escape(str(value), field or option)}")


_JOB_NAME_DROP = re.compile(r"[^A-Za-z0-9._+-]")
JOB_NAME_MAX = 128


def slurm_job_name(name: str) -> str:
    """The Slurm job name: `name` with anything but [A-Za-z0-9._+-] replaced by '_', at most 128 characters.

    The exact name stays in job.resolved.yaml; Slurm's copy is a label that squeue, sacct -P and
    output patterns can carry without breaking their own parsers ('|', spaces, newlines).
    """
    safe = _HETJOB_WORDS.sub(lambda m: m.group()[:-3] + "_" + m.group()[-3:], _JOB_NAME_DROP.sub("_", name))
    return safe[:JOB_NAME_MAX]
