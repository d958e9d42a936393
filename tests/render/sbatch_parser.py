"""How sbatch reads #SBATCH lines, ported from Slurm's src/sbatch/opt.c (_opt_batch_script and
_get_argument) to check what our escaped values read back as. Its behaviour was checked against
Slurm 22.05 (tests/render/test_slurm_directives.py runs the same strings through the real sbatch).
"""

from __future__ import annotations

_C_SPACE = " \t\n\v\f\r"  # isspace() in the C locale


def split_directive(text: str) -> list[str]:
    """The arguments of one #SBATCH line (the text after '#SBATCH')."""
    args, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in _C_SPACE:
            i += 1
        if i >= n or text[i] == "#":
            return args
        arg: list[str] = []
        quoted, quote, escape = False, "", False
        # As in C: the whitespace test comes before the escape test, so "\ " still ends the argument.
        while i < n and (quoted or text[i] not in _C_SPACE) and text[i] != "\n":
            ch = text[i]
            i += 1
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
                continue
            elif quoted:
                if ch == quote:
                    quoted = False
                    continue
            elif ch in "\"'":
                quoted, quote = True, ch
                continue
            elif ch == "#":  # an unescaped # outside quotes: the rest of the line is a comment
                args.append("".join(arg))
                return args
            arg.append(ch)
        args.append("".join(arg))


def sbatch_options(script: str) -> list[str]:
    """Every argument of every #SBATCH line, up to the first command (where sbatch stops reading)."""
    options: list[str] = []
    for line in script.split("\n")[1:]:
        stripped = line.strip()
        if line.startswith("#SBATCH"):
            options += split_directive(line[len("#SBATCH"):])
        elif stripped and not stripped.startswith("#"):
            break
    return options


def option_values(script: str) -> dict[str, str | None]:
    """{'--name': value or None for flags}; later lines win, as in sbatch."""
    values: dict[str, str | None] = {}
    for arg in sbatch_options(script):
        name, sep, value = arg.partition("=")
        values[name] = value if sep else None
    return values
