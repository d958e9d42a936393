"""`hpctrain data prepare` throughput: tokens/s with --workers 1 and 2 on a >= 50 MB corpus.

    python bench/data_prepare.py [--mb 50] [--dir DIR] [--vocab 8192] [--runs 1] [--check]

The corpus is built from text on this machine (Python sources and documentation under /usr/lib and
/usr/share/doc, cut into documents of about 4 KB) as JSON lines and as Parquet. A byte-level BPE
tokenizer is trained on its first 4 MB (`hpctrain data tokenizer-train`'s function). Each form is then
prepared with 1 and 2 workers, interleaved, best of `--runs`; the outputs are compared byte for byte.
"CPUs busy" (CPU seconds / wall seconds) shows whether the workers ran in parallel at all. Goal (issue 14): 2 workers
>= 1.6x one. On a shared machine the ratio depends on what else runs: the figures are printed as
measured. `--check` exits 1 when the goal is missed or the outputs differ.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hpctrain.data.prepare import prepare  # noqa: E402
from hpctrain.data.tokenizer import train_bpe  # noqa: E402

GOAL = 1.6
ROOTS = ("/usr/lib/python3", "/usr/share/doc", "/usr/share/common-licenses")
SUFFIXES = (".py", ".txt", ".md", ".rst", ".html")
DOC_CHARS = 4096


def _texts() -> Iterator[str]:
    for root in ROOTS:
        for folder, dirs, names in sorted(os.walk(root)):
            dirs.sort()
            for name in sorted(names):
                path = os.path.join(folder, name)
                if name.endswith(SUFFIXES) or "/common-licenses/" in path:
                    try:
                        with open(path, encoding="utf-8") as handle:
                            yield handle.read()
                    except (OSError, UnicodeDecodeError):
                        continue


def build_corpus(folder: str, megabytes: float) -> tuple[str, str, str, int]:
    """(jsonl, parquet, sample text file, bytes of text), repeating the machine's text if it is short."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    want = int(megabytes * 1e6)
    docs: list[str] = []
    size = 0
    while size < want:
        before = size
        for text in _texts():
            for start in range(0, len(text), DOC_CHARS):
                doc = text[start:start + DOC_CHARS]
                if doc.strip():
                    docs.append(doc)
                    size += len(doc.encode("utf-8"))
            if size >= want:
                break
        if size == before:
            raise SystemExit("no text found under " + ", ".join(ROOTS))
    jsonl, parquet, sample = (os.path.join(folder, n) for n in ("corpus.jsonl", "corpus.parquet", "sample.txt"))
    with open(jsonl, "w", encoding="utf-8") as handle:
        for doc in docs:
            handle.write(json.dumps({"text": doc}) + "\n")
    pq.write_table(pa.table({"text": docs}), parquet, row_group_size=2048)
    with open(sample, "w", encoding="utf-8") as handle:
        handle.write("".join(docs[: 4_000_000 // DOC_CHARS]))
    return jsonl, parquet, sample, size


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0, help="corpus size in MB of UTF-8 text (default 50)")
    parser.add_argument("--dir", help="work folder (default: a temporary one, removed)")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary (default 8192)")
    parser.add_argument("--runs", type=int, default=1, help="best of N runs per setting (default 1)")
    parser.add_argument("--check", action="store_true", help="exit 1 when the goal is missed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        start = time.perf_counter()
        jsonl, parquet, sample, size = build_corpus(folder, args.mb)
        tok = os.path.join(folder, "tokenizer.json")
        train_bpe([sample], tok, args.vocab)
        print(f"corpus: {size / 1e6:.1f} MB of text, JSON lines {os.path.getsize(jsonl) / 1e6:.1f} MB, "
              f"Parquet {os.path.getsize(parquet) / 1e6:.1f} MB; tokenizer vocab {args.vocab} "
              f"({time.perf_counter() - start:.0f} s to build); cpus {os.cpu_count()}, "
              f"load average {os.getloadavg()[0]:.1f}")
        ok = True
        for form, path in (("jsonl", jsonl), ("parquet", parquet)):
            rates: dict[int, float] = {1: 0.0, 2: 0.0}
            outputs: dict[int, bytes] = {}
            for _ in range(args.runs):
                for workers in (1, 2):  # interleaved: a load change on the shared machine hits both alike
                    out = os.path.join(folder, f"{form}-w{workers}.bin")
                    cpu_before = _cpu_s()
                    done = prepare([path], out, tokenizer=tok, workers=workers)
                    cpu = _cpu_s() - cpu_before
                    rate = done.tokens / done.seconds
                    rates[workers] = max(rates[workers], rate)
                    with open(out, "rb") as handle:
                        outputs[workers] = handle.read()
                    print(f"{form:8s} workers={workers}: {done.tokens:,} tokens in {done.seconds:.1f} s, "
                          f"{rate:,.0f} tokens/s, {cpu / done.seconds:.2f} CPUs busy, "
                          f"load average {os.getloadavg()[0]:.1f}", flush=True)
            speedup = rates[2] / rates[1]
            same = outputs[1] == outputs[2]
            ok &= same and speedup >= GOAL
            print(f"{form:8s} best of {args.runs}: speed-up 2 vs 1 workers {speedup:.2f}x (goal >= {GOAL}x); "
                  f"outputs identical: {same}", flush=True)
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
