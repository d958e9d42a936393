"""Text read from a run directory, made safe to print on a terminal: the one sanitiser.

Reasons, job ids, host names and file names in a run directory come from programs, logs and people;
a terminal escape among them (ESC [ ... , an OSC title sequence, a bidi override) would recolour,
retitle or reorder what `status`, `doctor`, `report` and `logs` print (issue 30, Why 10). Every
formatter of those commands passes its text through `printable` before it is printed: control
characters other than newline and tab become visible escapes (`\\x1b`), so the text stays readable and
nothing is interpreted. A log's own content, which `logs` copies as it is (like `cat`), is not touched.
"""

from __future__ import annotations

import re

# C0 controls but tab and newline, DEL, C1 controls, and the Unicode bidi controls (Trojan Source).
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: str) -> str:
    """`text` with every character a terminal would interpret (module doc) written as a visible escape."""
    return _UNSAFE.sub(_escape, text)
