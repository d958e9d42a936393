"""`hpctrain data prepare`: text files -> a flat token file for `train.data`.

The tokenizer is byte-level: every byte of the UTF-8 (or any) text is one token, vocabulary 256,
nothing to download. Files are concatenated in the order given, separated by one newline when a
file does not end with one. The output is uint16 (the smallest type the runtime memory-maps) and a
description `<output>.json` next to it (dtype, vocab, token count, sources) that the runtime reads
to pick the element type. Pure Python and numpy: this runs on a login node and never imports torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hpctrain.errors import ConfigError

BYTE_VOCAB = 256
DTYPE = np.uint16
CHUNK_BYTES = 1 << 24


@dataclass(frozen=True)
class Prepared:
    """What was written."""

    output: str
    tokens: int
    files: int
    dtype: str
    vocab: int


def _check_inputs(paths: Sequence[str], output: str) -> None:
    problems = []
    for path in paths:
        if not os.path.exists(path):
            problems.append(f"{path}: no such file; give text files to tokenize")
        elif not os.path.isfile(path):
            problems.append(f"{path}: not a regular file; give text files (a shell glob such as dir/*.txt)")
        elif os.path.abspath(path) == os.path.abspath(output):
            problems.append(f"{path}: is also the output file; choose another -o")
    out_dir = os.path.dirname(os.path.abspath(output))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        problems.append(f"-o {output}: {out_dir} is not a folder; choose another -o")
    if problems:
        raise ConfigError(problems)
    os.makedirs(out_dir, exist_ok=True)  # like `mkdir -p`: nothing is written before the inputs are checked


def prepare(paths: Sequence[str], output: str) -> Prepared:
    """Tokenize `paths` byte-level into `output` (uint16) and write `output`.json. Atomic: the files
    appear complete or not at all."""
    if not paths:
        raise ConfigError("data prepare: no input files; give one or more text files")
    _check_inputs(paths, output)
    tmp = output + ".tmp"
    total = 0
    with open(tmp, "wb") as out:
        for i, path in enumerate(paths):
            last = b"\n"
            with open(path, "rb") as src:
                while chunk := src.read(CHUNK_BYTES):
                    np.frombuffer(chunk, dtype=np.uint8).astype(DTYPE).tofile(out)
                    total += len(chunk)
                    last = chunk[-1:]
            if last != b"\n" and i < len(paths) - 1:
                np.array([ord("\n")], dtype=DTYPE).tofile(out)
                total += 1
        out.flush()
        os.fsync(out.fileno())
    if total < 2:
        os.unlink(tmp)
        raise ConfigError(f"data prepare: the inputs hold {total} bytes; a token file needs at least 2 tokens")
    description = {"dtype": np.dtype(DTYPE).name, "vocab": BYTE_VOCAB, "tokens": total,
                   "tokenizer": "bytes", "sources": [os.path.abspath(p) for p in paths]}
    with open(output + ".json.tmp", "w", encoding="utf-8") as handle:
        json.dump(description, handle, indent=1)
        handle.write("\n")
    os.replace(tmp, output)
    os.replace(output + ".json.tmp", output + ".json")
    return Prepared(output, total, len(paths), np.dtype(DTYPE).name, BYTE_VOCAB)


def decode(tokens: np.ndarray) -> str:
    """Byte tokens back to text (for looking at samples)."""
    return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")
