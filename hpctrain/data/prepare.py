"""`hpctrain data prepare`: documents -> a flat token file for `train.data`, plus its sidecar.

Inputs (sources.py) are read in order and cut into chunks of about CHUNK_CHARS characters; the
chunks are encoded by `workers` processes and written back *in chunk order*, so the output is the
same byte for byte for any worker count. After every document comes the tokenizer's end-of-text id
(the byte tokenizer keeps today's behaviour: a newline between documents that do not end with one).
With `val_fraction`, a document goes to the validation file when a hash of its number falls below
the fraction: the split depends on the document's place in the inputs only.

The element type is uint16 when the vocabulary fits, else uint32. `<output>.json` (the sidecar)
records the tokenizer (path, sha256, vocab, EOS id), dtype, document and token counts and sources;
the runtime checks it against the job (hpctrain/config/data_files.py). Never imports torch.
"""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from hpctrain.data.sources import Piece, expand_inputs, pieces
from hpctrain.data.tokenizer import BYTES, Encoder, TokenizerInfo, describe
from hpctrain.errors import ConfigError

CHUNK_CHARS = 1 << 20
SIDECAR_FORMAT = "hpctrain-tokens/1"
_ENCODER: Optional[Encoder] = None  # one per worker process


@dataclass
class Prepared:
    """What was written (train file; the validation file's counts when one was asked for)."""

    output: str
    tokens: int
    files: int
    dtype: str
    vocab: int
    documents: int = 0
    val_output: Optional[str] = None
    val_tokens: int = 0
    val_documents: int = 0
    seconds: float = 0.0
    tokenizer: str = BYTES
    workers: int = 1


MAX_DEFAULT_WORKERS = 8  # past this, the single writer and the reader bound the rate, not the tokenizer


def default_workers() -> int:
    """Tokenizer processes when --workers is not given: the CPU cores this process may run on (its
    affinity mask, which a Slurm allocation or taskset narrows; os.cpu_count where there is none), at most
    MAX_DEFAULT_WORKERS. One worker on a 2-core machine left half of it idle (0.69M vs 1.08M tokens/s)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity masks on this platform (macOS)
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_WORKERS))


def validation_path(output: str) -> str:
    """tokens.bin -> tokens.val.bin (beside it)."""
    stem, ext = os.path.splitext(output)
    return f"{stem}.val{ext or '.bin'}"


def is_validation(doc: int, fraction: float) -> bool:
    """The split: a stable hash of the document number, compared with the fraction."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(doc.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < fraction


def _init_worker(info: TokenizerInfo) -> None:
    global _ENCODER
    _ENCODER = Encoder(info)


def _encode_chunk(chunk: list[Piece], fraction: float, dtype: str) -> tuple[bytes, bytes, int, int, bool, bool]:
    """(train tokens, val tokens, train docs, val docs, train ends with an added separator, val ditto)."""
    assert _ENCODER is not None
    info = _ENCODER.info
    ids = _ENCODER.encode([p.text for p in chunk])
    out: dict[bool, list[int]] = {False: [], True: []}
    docs = {False: 0, True: 0}
    added = {False: False, True: False}
    for piece, tokens in zip(chunk, ids):
        val = is_validation(piece.doc, fraction)
        out[val].extend(tokens)
        if piece.last:
            docs[val] += 1
            # bytes: a newline only where the document lacks one (today's format); else always EOS.
            text = piece.text
            ends = text.endswith(b"\n") if isinstance(text, bytes) else text.endswith("\n")
            need = info.name != BYTES or not ends
            if need:
                out[val].append(info.eos_id)
            added[val] = need
        elif tokens:
            added[val] = False
    as_bytes = {k: np.asarray(v, dtype=dtype).tobytes() for k, v in out.items()}
    return as_bytes[False], as_bytes[True], docs[False], docs[True], added[False], added[True]


def _chunks(stream: Iterator[Piece]) -> Iterator[list[Piece]]:
    chunk: list[Piece] = []
    size = 0
    for piece in stream:
        chunk.append(piece)
        size += len(piece.text)
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


@dataclass
class _Sink:
    """One output file being written (atomically: a .tmp renamed at the end)."""

    path: str
    itemsize: int
    handle: Any = None
    tokens: int = 0
    documents: int = 0
    trailing_sep: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def open(self) -> None:
        self.handle = open(self.path + ".tmp", "wb")

    def write(self, data: bytes, docs: int, ends_with_sep: bool) -> None:
        if data:
            self.handle.write(data)
            self.tokens += len(data) // self.itemsize
            self.trailing_sep = ends_with_sep
        self.documents += docs

    def close(self, drop_trailing_separator: bool) -> None:
        if drop_trailing_separator and self.trailing_sep:  # bytes: separators go *between* documents
            self.tokens -= 1
            self.handle.truncate(self.tokens * self.itemsize)
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()


def _run(chunks: Iterator[list[Piece]], info: TokenizerInfo, workers: int, fraction: float,
         dtype: str) -> Iterator[tuple[bytes, bytes, int, int, bool, bool]]:
    """Encode the chunks, yielding results in chunk order; at most 2 x workers chunks in flight."""
    if workers <= 1:
        _init_worker(info)
        for chunk in chunks:
            yield _encode_chunk(chunk, fraction, dtype)
        return
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(info,)) as pool:
        pending: collections.deque[Any] = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_chunk, (chunk, fraction, dtype)))
            while len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _Progress:
    """A one-line progress display on stderr, only when stderr is a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.start, self.last = enabled and sys.stderr.isatty(), time.monotonic(), 0.0

    def update(self, docs: int, tokens: int, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.5 and not final):
            return
        self.last = now
        rate = tokens / max(now - self.start, 1e-9)
        print(f"\r{docs:,} documents, {tokens:,} tokens, {rate:,.0f} tokens/s", end="\n" if final else "",
              file=sys.stderr, flush=True)


def _check_output(files: Sequence[str], output: str) -> None:
    problems = [f"{path}: is also the output file; choose another -o" for path in files
                if os.path.abspath(path) in (os.path.abspath(output), os.path.abspath(validation_path(output)))]
    out_dir = os.path.dirname(os.path.abspath(output))
    for path in (output, validation_path(output), output + ".json"):
        # the files are written beside and renamed over: a folder, FIFO or device there would be replaced
        if os.path.lexists(path) and not os.path.isfile(path):
            problems.append(f"-o {output}: {path} exists and is not a regular file; choose another -o")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        problems.append(f"-o {output}: {out_dir} is not a folder; choose another -o")
    if problems:
        raise ConfigError(problems)
    from hpctrain.userfiles import writing_output

    with writing_output("-o", output):
        os.makedirs(out_dir, exist_ok=True)  # like `mkdir -p`: nothing is written before the inputs are checked


def _sidecar(sink: _Sink, info: TokenizerInfo, dtype: str, files: Sequence[str], split: str,
             fraction: float, other: Optional[str]) -> dict[str, Any]:
    side: dict[str, Any] = {
        "format": SIDECAR_FORMAT, "split": split, "dtype": dtype, "vocab": info.vocab, "eos_id": info.eos_id,
        "tokenizer": info.name, "tokenizer_sha256": info.sha256, "documents": sink.documents,
        "tokens": sink.tokens, "val_fraction": fraction, "sources": [os.path.abspath(p) for p in files]}
    if other:
        side["validation" if split == "train" else "train"] = os.path.basename(other)
    return side


def _write_json(path: str, body: dict[str, Any]) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(body, handle, indent=1)
        handle.write("\n")
    os.replace(path + ".tmp", path)


def prepare(inputs: Sequence[str], output: str, tokenizer: str = BYTES, field_name: str = "text",
            workers: Optional[int] = None, val_fraction: float = 0.0, eos: Optional[str] = None,
            progress: bool = False) -> Prepared:
    """Tokenize `inputs` into `output` (+ `output`.json, + the validation pair) with `workers` processes
    (default: default_workers()). Atomic: the files appear complete or not at all."""
    if not inputs:
        raise ConfigError("data prepare: no inputs; give text, .jsonl[.gz] or .parquet files, folders or globs")
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ConfigError(f"--workers: got {workers}; use 1 or more processes")
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction: got {val_fraction}; use a fraction in [0, 1), e.g. 0.01")
    files = expand_inputs(inputs)
    _check_output(files, output)
    info = describe(tokenizer, eos)
    dtype = "uint16" if info.vocab <= 2**16 else "uint32"
    itemsize = np.dtype(dtype).itemsize
    val_out = validation_path(output) if val_fraction > 0 else None
    sinks = [_Sink(output, itemsize)] + ([_Sink(val_out, itemsize)] if val_out else [])
    from hpctrain.userfiles import writing_output

    with writing_output("-o", output):
        for sink in sinks:
            sink.open()
    shown = _Progress(progress)
    start = time.perf_counter()
    try:
        for train, val, t_docs, v_docs, t_sep, v_sep in _run(_chunks(pieces(files, field_name, raw=info.name == BYTES)), info, workers,
                                                              val_fraction, dtype):
            sinks[0].write(train, t_docs, t_sep)
            if val_out:
                sinks[1].write(val, v_docs, v_sep)
            shown.update(sum(s.documents for s in sinks), sum(s.tokens for s in sinks))
        for sink in sinks:
            sink.close(drop_trailing_separator=info.name == BYTES)
        shown.update(sum(s.documents for s in sinks), sum(s.tokens for s in sinks), final=True)
        for sink, name in zip(sinks, ("training", "validation")):
            if sink.tokens < 2:
                raise ConfigError(f"data prepare: the {name} split holds {sink.tokens} tokens; a token file needs "
                                  "at least 2 tokens" + ("; lower --val-fraction or add text" if val_out else ""))
    except BaseException:
        for sink in sinks:
            if sink.handle and not sink.handle.closed:
                sink.handle.close()
            if os.path.exists(sink.path + ".tmp"):
                os.unlink(sink.path + ".tmp")
        raise
    seconds = time.perf_counter() - start
    with writing_output("-o", output):
        for sink, split, other in zip(sinks, ("train", "validation"), (val_out, output)):
            os.replace(sink.path + ".tmp", sink.path)
            _write_json(sink.path + ".json", _sidecar(sink, info, dtype, files, split, val_fraction, other))
    done = Prepared(output, sinks[0].tokens, len(files), dtype, info.vocab, sinks[0].documents,
                    seconds=seconds, tokenizer=info.name, workers=workers)
    if val_out:
        done.val_output, done.val_tokens, done.val_documents = val_out, sinks[1].tokens, sinks[1].documents
    return done


def decode(tokens: np.ndarray) -> str:
    """Byte tokens back to text (for looking at samples)."""
    return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")
