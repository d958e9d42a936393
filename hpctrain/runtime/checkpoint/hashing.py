"""sha256 of each checkpoint file computed while DCP writes it, not by reading it back afterwards.

The manifest in `metadata.json` lists the size and sha256 of every file (rundir/checkpoints.py).
Hashing the files after `dcp.save` read every byte a second time, on the critical path of the
save, while training stood still (issue 12: the save measured 1.3-2x a bare `dcp.save`).
`HashingWriter` is DCP's own `FileSystemWriter` whose streams feed each written buffer to sha256
on its way to the file, so the digest is ready when the file is closed, from bytes still in cache.

Only a file written strictly sequentially from its start is recorded (the bytes hashed must equal
the file's size when it is closed; DCP's torch.save format writes this way). Anything else (a seek,
a format that patches headers) is left unrecorded and hashed from disk as before: the manifest
is always the sha256 of what is on disk.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from hpctrain.rundir.checkpoints import hash_files


_BLOCK_BYTES = 4 << 20  # torch.save writes many small records: hash them in blocks


class _HashingStream:
    """A binary file whose writes also go to sha256, in a thread of its own (hashlib releases the
    GIL), in 4 MiB blocks: the digest is computed while DCP goes on writing and fsyncs."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.hashed_bytes = 0
        self.sequential = True
        self._digest = hashlib.sha256()
        self._block = bytearray()
        self._blocks: queue.SimpleQueue[bytearray | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._hash_blocks, daemon=True)
        self._thread.start()

    def _hash_blocks(self) -> None:
        while (block := self._blocks.get()) is not None:
            self._digest.update(block)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._block += view  # a copy: the caller may reuse its buffer once write returns
        self.hashed_bytes += view.nbytes
        if len(self._block) >= _BLOCK_BYTES:
            self._blocks.put(self._block)  # handed over whole: the thread owns it now
            self._block = bytearray()
        return int(self.raw.write(view))

    def hexdigest(self) -> str:
        """The sha256 of everything written (call once, after the last write)."""
        self._blocks.put(self._block)
        self._blocks.put(None)
        self._thread.join()
        return self._digest.hexdigest()

    def seek(self, *args: Any) -> int:
        self.sequential = False
        return int(self.raw.seek(*args))

    def truncate(self, *args: Any) -> int:
        self.sequential = False
        return int(self.raw.truncate(*args))

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class _HashingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.recorded: dict[str, dict[str, Any]] = {}  # absolute path -> {"bytes", "sha256"}
        self._lock = threading.Lock()  # DCP may write with several threads

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            hashing = _HashingStream(raw)
            yield hashing
        size = os.path.getsize(path)  # closed now (DCP may close it itself): everything is written
        digest = hashing.hexdigest()
        if hashing.sequential and size == hashing.hashed_bytes:
            with self._lock:
                self.recorded[os.path.abspath(path)] = {"bytes": size, "sha256": digest}


class HashingWriter(FileSystemWriter):
    """`FileSystemWriter` (fsync on, one file per rank) that records the sha256 of what it writes."""

    fs: _HashingFileSystem

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.fs = _HashingFileSystem()

    def manifest(self, folder: str, names: list[str]) -> dict[str, dict[str, Any]]:
        """{name: {"bytes", "sha256"}} for `names` under folder: from what this writer recorded,
        the rest (files other ranks or other code wrote, DCP's renamed .metadata) read from disk."""
        recorded = self.fs.recorded
        out: dict[str, dict[str, Any]] = {}
        rest = []
        for name in names:
            entry = recorded.get(os.path.abspath(os.path.join(folder, name)))
            if entry is not None and os.path.getsize(os.path.join(folder, name)) == entry["bytes"]:
                out[name] = dict(entry)
            else:
                rest.append(name)
        out.update(hash_files(folder, rest))
        return out
