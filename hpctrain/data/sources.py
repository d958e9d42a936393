"""Where `hpctrain data prepare` finds documents: text, JSON lines (plain or gzip) and Parquet files,
given as files, directories (walked, sorted) or globs.

A document is one .txt file, one JSON line's `field`, or one Parquet row's `field` column. Large
documents are handed out in pieces (`Piece`) cut after a newline, so a single big text file still
spreads over the workers; the cut points depend only on the text, never on the worker count.
No torch, no tokenizer: this module only reads.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hpctrain.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
KNOWN = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
PIECE_CHARS = 1 << 20  # a text document longer than this is cut after a newline into pieces of about this size


@dataclass(frozen=True)
class Piece:
    """Text of document `doc` (numbered over all inputs, from 0); `last` ends the document."""

    doc: int
    text: str | bytes  # bytes: a text file read for the byte tokenizer, exactly as stored
    last: bool


def _kind(path: str) -> str:
    lower = path.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return "text"


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Files in the order given; a directory gives its known-kind files (recursive, sorted); a glob its
    matches (sorted). Each problem names the input and the fix."""
    files: list[str] = []
    problems: list[str] = []
    for spec in inputs:
        if os.path.isdir(spec):
            found = sorted(os.path.join(root, name) for root, _, names in os.walk(spec) for name in names
                           if name.lower().endswith(KNOWN))
            if not found:
                problems.append(f"{spec}: a folder with no {', '.join(KNOWN)} files; give the files themselves")
            files.extend(found)
        elif os.path.isfile(spec):
            files.append(spec)
        elif glob.has_magic(spec):
            found = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not found:
                problems.append(f"{spec}: the pattern matches no file; check the path")
            files.extend(found)
        elif os.path.exists(spec):
            problems.append(f"{spec}: not a regular file; give text, .jsonl[.gz] or .parquet files")
        else:
            problems.append(f"{spec}: no such file; give text, .jsonl[.gz] or .parquet files, folders or globs")
    if problems:
        raise ConfigError(problems)
    return files


def _text_pieces(text: str | bytes) -> Iterator[tuple[str | bytes, bool]]:
    start = 0
    newline = b"\n" if isinstance(text, bytes) else "\n"
    while len(text) - start > PIECE_CHARS:
        cut = text.rfind(newline, start + PIECE_CHARS // 2, start + PIECE_CHARS)  # type: ignore[arg-type]
        cut = start + PIECE_CHARS if cut < 0 else cut + 1
        yield text[start:cut], False
        start = cut
    yield text[start:], True


def _lines(path: str) -> Iterator[str]:
    """The lines of a .jsonl[.gz]; a truncated or damaged gzip stream is one ConfigError, not EOFError."""
    opener = gzip.open if path.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as handle:
            yield from handle
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        reason = "it ends early" if isinstance(exc, EOFError) else str(exc)[:100]
        raise ConfigError(f"{path}: not a readable gzip file ({reason}: truncated or damaged); re-download or "
                          "re-compress it") from None


def _jsonl_texts(path: str, field: str) -> Iterator[str]:
    for number, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            raise ConfigError(f"{path}:{number}: not a JSON line; fix the line or remove it") from None
        value = record.get(field) if isinstance(record, dict) else None
        if isinstance(record, dict) and field in record and not isinstance(value, str):
            raise ConfigError(f"{path}:{number}: field {field!r} is {type(value).__name__} {value!r:.60}, not "
                              "text; make it a string or choose another field with --field")
        if not isinstance(value, str):
            raise ConfigError(f"{path}:{number}: no text field {field!r} (keys: "
                              f"{', '.join(sorted(record)) if isinstance(record, dict) else '-'}); "
                              "choose the field with --field")
        yield value


def _parquet_texts(path: str, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: reading Parquet needs pyarrow; pip install 'hpctrain[data]'") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise ConfigError(f"{path}: not a readable Parquet file ({type(exc).__name__}); check the file") from None
    if field not in table.schema_arrow.names:
        raise ConfigError(f"{path}: no column {field!r} (columns: {', '.join(table.schema_arrow.names)}); "
                          "choose the column with --field")
    for batch in table.iter_batches(columns=[field], batch_size=4096):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield str(value)


def documents(path: str, field: str, raw: bool = False) -> Iterator[str | bytes]:
    """The documents of one file, in file order; `raw`: a text file as its bytes (nothing decoded)."""
    kind = _kind(path)
    if kind == "jsonl":
        yield from _jsonl_texts(path, field)
    elif kind == "parquet":
        yield from _parquet_texts(path, field)
    else:
        with open(path, "rb") as handle:
            data = handle.read()
        yield data if raw else data.decode("utf-8", errors="replace")


def pieces(files: Sequence[str], field: str, raw: bool = False) -> Iterator[Piece]:
    """Every document of every file, numbered in input order, cut into pieces."""
    doc = 0
    for path in files:
        for text in documents(path, field, raw):
            for part, last in _text_pieces(text):
                yield Piece(doc, part, last)
            doc += 1
