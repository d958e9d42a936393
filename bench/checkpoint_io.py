"""Checkpoint save/load throughput (GB/s) against raw `dd` of the same size on the same disk.

    python bench/checkpoint_io.py [--gib 1.0] [--dir DIR] [--runs 2] [--device cpu|cuda] [--check]
    OMP_NUM_THREADS=1 python bench/checkpoint_io.py --ranks 2 [--reps 7] [--check]

With `--ranks 2`: the whole save at 2 ranks beside a bare `dcp.save` of the same state
(bench/checkpoint_ranks.py; goal <= 1.15x, issue 12). Otherwise, one process:

The state is a model of `--gib` GiB of fp32 parameters (64 MiB tensors) saved and loaded by the
runtime's own `Checkpointer` (DCP into step-N.partial/, RNG files, metadata, fsync, rename), in one
process. Side by side, on the same folder:

  dd write   dd if=/dev/zero of=FILE bs=64M count=N conv=fsync (data on disk, like DCP's fsync)
  save       Checkpointer.save (sync): training stands still for it (DCP writes and fsyncs the data)
  finalize   Checkpointer.wait() right after: the rest of that save (sha256, metadata, rename,
             prune), which runs in a thread while training goes on
  dd read    dd if=FILE of=/dev/null bs=64M, page cache dropped first (posix_fadvise DONTNEED)
  load       Checkpointer.load, page cache of the checkpoint dropped first
  verify     the sha256 check of every file before a resume (one rank does all of it here)
  async      Checkpointer with checkpoint.async (DCP async_save, thread mode): how long save() blocks
             the training loop, and when the checkpoint is complete

Best of `--runs` runs each. Goal (issue 7): save >= 50 % of dd's write throughput. `--check` exits 1
when the goal is missed. GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SAVE_GOAL = 0.5  # of dd's write throughput
TENSOR_BYTES = 64 * 2**20


def drop_page_cache(path: Path) -> None:
    """Evict a file (or every file under a folder) from the page cache; its data is already on disk."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def dd_write(path: Path, count: int) -> float:
    return timed(lambda: subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}",
                                         "conv=fsync"], check=True, capture_output=True))


def dd_read(path: Path) -> float:
    drop_page_cache(path)
    return timed(lambda: subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M"], check=True,
                                        capture_output=True))


def build_state(gib: float, device: str) -> tuple[Any, Any, int]:
    import torch

    count = max(1, round(gib * 2**30 / TENSOR_BYTES))
    params = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(TENSOR_BYTES // 4, device=device)) for _ in range(count)])
    model = torch.nn.Module()
    model.params = params
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no per-parameter state: the model is the state
    return model, optimizer, count


def checkpointer(folder: Path, model: Any, optimizer: Any, async_: bool) -> Any:
    from hpctrain.runtime.checkpoint.checkpointer import Checkpointer

    job = SimpleNamespace(checkpoint=SimpleNamespace(dir=str(folder), every_steps=1, keep_last=1, async_=async_))
    return Checkpointer(job, str(folder), [model], [optimizer])


def verify(folder: Path) -> None:
    """What the ranks do before loading (all of it on one rank here): hash every file, compare."""
    from hpctrain.rundir.checkpoints import read_metadata, verify_files

    files = read_metadata(str(folder))["files"]
    problems = verify_files(str(folder), files, files)
    if problems:
        raise RuntimeError(problems)


def run(work: Path, gib: float, runs: int, device: str) -> dict[str, float]:
    import torch

    model, optimizer, count = build_state(gib, device)
    size = count * TENSOR_BYTES
    dd_file = work / "dd.bin"
    best: dict[str, float] = {}

    def keep(name: str, seconds: float) -> None:
        best[name] = min(best.get(name, float("inf")), seconds)

    sync = checkpointer(work / "sync", model, optimizer, async_=False)
    for step in range(1, runs + 1):
        keep("dd write", dd_write(dd_file, count))
        keep("dd read", dd_read(dd_file))
        dd_file.unlink()
        keep("save", timed(lambda: sync.save(step, {"bench": True})))
        keep("finalize", timed(sync.wait))
        folder = work / "sync" / f"step-{step}"
        drop_page_cache(folder)
        keep("load", timed(lambda: sync.load(str(folder))))
        drop_page_cache(folder)
        keep("verify", timed(lambda: verify(folder)))
    async_ = checkpointer(work / "async", model, optimizer, async_=True)
    for step in range(1, runs + 1):
        start = time.perf_counter()
        async_.save(step, {"bench": True})
        blocking = time.perf_counter() - start
        async_.wait()
        keep("async blocking", blocking)
        keep("async complete", time.perf_counter() - start)
    if device == "cuda":
        torch.cuda.synchronize()
    return {"bytes": float(size), **best}


def report(result: dict[str, float], work: Path, device: str) -> bool:
    size = result["bytes"]

    def gbps(name: str) -> float:
        return size / result[name] / 1e9

    save_share = gbps("save") / gbps("dd write")
    print(f"checkpoint I/O: {size / 2**30:.2f} GiB ({size / 1e9:.2f} GB) of fp32 parameters on {device}, "
          f"folder {work}")
    print(f"{'':22} {'seconds':>8} {'GB/s':>7} {'vs dd':>7}")
    print(f"{'dd write (fsync)':22} {result['dd write']:8.3f} {gbps('dd write'):7.2f}")
    print(f"{'save (sync, DCP)':22} {result['save']:8.3f} {gbps('save'):7.2f} {save_share:6.0%}  goal >= "
          f"{SAVE_GOAL:.0%}: {'ok' if save_share >= SAVE_GOAL else 'MISSED'}")
    print(f"{'finalize (in a thread)':22} {result['finalize']:8.3f}   (sha256, metadata, rename, prune; "
          "training goes on meanwhile)")
    print(f"{'dd read (cold cache)':22} {result['dd read']:8.3f} {gbps('dd read'):7.2f}")
    print(f"{'load (cold cache)':22} {result['load']:8.3f} {gbps('load'):7.2f} {gbps('load') / gbps('dd read'):6.0%}")
    print(f"{'verify (cold cache)':22} {result['verify']:8.3f} {gbps('verify'):7.2f}   (sha256 of every file, "
          "before a resume; spread over the ranks)")
    print(f"{'async save: blocking':22} {result['async blocking']:8.3f}   (training stands still; "
          f"{result['async blocking'] / result['save']:.0%} of a sync save)")
    print(f"{'async save: complete':22} {result['async complete']:8.3f} {size / result['async complete'] / 1e9:7.2f}")
    return save_share >= SAVE_GOAL


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the state in GiB (default 1)")
    parser.add_argument("--dir", default=None, help="folder on the disk to measure (default: the system temp folder)")
    parser.add_argument("--runs", type=int, default=2, help="runs of each measurement; the best is shown")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state lives")
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=1,
                        help="2: the whole save at 2 ranks against a bare dcp.save (bench/checkpoint_ranks.py)")
    parser.add_argument("--reps", type=int, default=7, help="with --ranks 2: alternating repetitions of each")
    parser.add_argument("--check", action="store_true", help="exit 1 when the goal is missed")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(tempfile.mkdtemp(prefix="hpct-ckpt-io-", dir=args.dir))
    try:
        if args.ranks == 2:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import checkpoint_ranks

            ok = checkpoint_ranks.report(checkpoint_ranks.run(work, args.reps))
        else:
            ok = report(run(work, args.gib, args.runs, args.device), work, args.device)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
