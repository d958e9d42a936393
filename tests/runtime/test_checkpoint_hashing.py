"""sha256 computed while DCP writes (issue 12 item 9, the save's overhead): the manifest entries must
be exactly what hashing the files on disk gives, and anything not written front to back is read
back from disk instead of trusted."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

from hpctrain.rundir.checkpoints import data_files, hash_files
from hpctrain.runtime.checkpoint.hashing import HashingWriter


def test_manifest_from_the_writer_equals_hashing_the_files(tmp_path) -> None:
    folder = str(tmp_path / "ckpt")
    writer = HashingWriter(folder)
    # A 12 MiB tensor (several 4 MiB hash blocks) and many small ones (torch.save's small records).
    state = {"big": torch.randn(3 << 20), "small": [torch.randn(7) for _ in range(50)], "extra": {"step": 3}}
    dcp.save(state, storage_writer=writer)
    names = data_files(folder)
    recorded = {os.path.relpath(path, folder) for path in writer.fs.recorded}
    assert "__0_0.distcp" in recorded  # the shard was hashed on the way, not read back
    assert writer.manifest(folder, names) == hash_files(folder, names)


def test_a_file_written_out_of_order_is_hashed_from_disk(tmp_path) -> None:
    writer = HashingWriter(str(tmp_path))
    path = tmp_path / "patched.bin"
    with writer.fs.create_stream(str(path), "wb") as stream:
        stream.write(b"x" * 100)
        stream.seek(0)
        stream.write(b"y")  # a header patched afterwards: the running digest no longer matches the file
    assert str(path) not in writer.fs.recorded
    assert writer.manifest(str(tmp_path), ["patched.bin"]) == hash_files(str(tmp_path), ["patched.bin"])
