"""`hpctrain data prepare` with a real BPE tokenizer, JSON lines, gzip, Parquet, folders and globs;
`hpctrain data tokenizer-train`. Real files and the real `tokenizers` / `pyarrow` packages."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa  # the `data` extra, also in `test`: CI installs it (never skipped)
import pyarrow.parquet as pq
import pytest
import tokenizers

from hpctrain.cli import main
from hpctrain.errors import ConfigError
from hpctrain.data import prepare as data_prepare, sources as data_sources
from hpctrain.data.prepare import is_validation, prepare, validation_path
from hpctrain.data.tokenizer import train_bpe

from ._entry import REPO, text_files



def _paragraphs() -> list[str]:
    out = []
    for path in text_files():
        with open(path, encoding="utf-8", errors="replace") as handle:
            out += [p.strip() for p in handle.read().split("\n\n") if p.strip()]
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, str]:
    """The same documents as JSON lines, gzip'd JSON lines and Parquet, plus a tokenizer trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    docs = _paragraphs()[:600]
    assert len(docs) >= 200
    half = len(docs) // 2
    with open(root / "a.jsonl", "w", encoding="utf-8") as handle:
        for i, doc in enumerate(docs[:half]):
            handle.write(json.dumps({"id": i, "text": doc}) + "\n")
    with gzip.open(root / "b.jsonl.gz", "wt", encoding="utf-8") as handle:
        for doc in docs[half:]:
            handle.write(json.dumps({"text": doc}) + "\n")
    pq.write_table(pa.table({"body": docs}), root / "all.parquet", row_group_size=50)
    (root / "docs.txt").write_text("\n\n".join(docs), encoding="utf-8")
    tok = str(root / "tokenizer.json")
    train_bpe([str(root / "docs.txt")], tok, vocab_size=600)
    return {"root": str(root), "tok": tok, "docs": json.dumps(docs)}


def test_output_is_identical_for_any_worker_count(corpus, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(data_prepare, "CHUNK_CHARS", 2000)  # many chunks, so the workers interleave
    inputs = [os.path.join(corpus["root"], "a.jsonl"), os.path.join(corpus["root"], "b.jsonl.gz")]
    outs = []
    for workers in (1, 3):
        out = str(tmp_path / f"w{workers}" / "tokens.bin")
        prepare(inputs, out, tokenizer=corpus["tok"], workers=workers, val_fraction=0.2)
        outs.append(out)
    for suffix in ("", ".json"):
        for a, b in ((outs[0], outs[1]), (validation_path(outs[0]), validation_path(outs[1]))):
            assert open(a + suffix, "rb").read() == open(b + suffix, "rb").read()


def test_sidecar_counts_match_a_direct_encode(corpus, tmp_path) -> None:
    docs = json.loads(corpus["docs"])
    tok = tokenizers.Tokenizer.from_file(corpus["tok"])
    eos = tok.token_to_id("<|endoftext|>")
    want = []
    for doc in docs:
        want += tok.encode(doc, add_special_tokens=False).ids + [eos]
    out = str(tmp_path / "tokens.bin")
    done = prepare([os.path.join(corpus["root"], "all.parquet")], out, tokenizer=corpus["tok"], field_name="body",
                   workers=2)
    side = json.loads(open(out + ".json").read())
    assert side["tokens"] == done.tokens == len(want)
    assert side["documents"] == len(docs)
    assert side["vocab"] == tok.get_vocab_size() == 600 and side["eos_id"] == eos == 0
    assert side["dtype"] == "uint16" and side["tokenizer"] == os.path.abspath(corpus["tok"])
    assert len(side["tokenizer_sha256"]) == 64
    assert np.fromfile(out, dtype=np.uint16).tolist() == want


def test_validation_split_is_by_document_and_complete(corpus, tmp_path) -> None:
    docs = json.loads(corpus["docs"])
    out = str(tmp_path / "t.bin")
    done = prepare([os.path.join(corpus["root"], "all.parquet")], out, tokenizer=corpus["tok"], field_name="body",
                   val_fraction=0.1)
    val_docs = [i for i in range(len(docs)) if is_validation(i, 0.1)]
    assert 0 < done.val_documents == len(val_docs) < len(docs) // 4
    assert done.documents + done.val_documents == len(docs)
    side = json.loads(open(out + ".json").read())
    assert side["validation"] == "t.val.bin" and side["split"] == "train"
    val_side = json.loads(open(validation_path(out) + ".json").read())
    assert val_side["split"] == "validation" and val_side["tokens"] == done.val_tokens
    tok = tokenizers.Tokenizer.from_file(corpus["tok"])
    first_val = tok.encode(docs[val_docs[0]], add_special_tokens=False).ids
    got = np.fromfile(validation_path(out), dtype=np.uint16)
    assert got[: len(first_val)].tolist() == first_val and got[len(first_val)] == 0


def test_folders_globs_and_big_text_pieces(corpus, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(data_sources, "PIECE_CHARS", 4096)  # the .txt document is cut into many pieces
    root = corpus["root"]
    by_glob = str(tmp_path / "glob.bin")
    prepare([os.path.join(root, "*.jsonl*")], by_glob, tokenizer=corpus["tok"])
    by_files = str(tmp_path / "files.bin")
    prepare([os.path.join(root, "a.jsonl"), os.path.join(root, "b.jsonl.gz")], by_files, tokenizer=corpus["tok"])
    assert open(by_glob, "rb").read() == open(by_files, "rb").read()
    sub = tmp_path / "folder"
    sub.mkdir()
    (sub / "x.txt").write_text(open(os.path.join(root, "docs.txt")).read())
    done = prepare([str(sub)], str(tmp_path / "dir.bin"), tokenizer=corpus["tok"], workers=2)
    tokens = np.fromfile(tmp_path / "dir.bin", dtype=np.uint16)
    assert done.documents == 1 and tokens[-1] == 0 and (tokens[:-1] != 0).all()  # one EOS, at the end


def test_prepare_errors_name_the_input(corpus, tmp_path) -> None:
    jsonl = os.path.join(corpus["root"], "a.jsonl")
    with pytest.raises(ConfigError, match=r"no text field 'body'.*--field"):
        prepare([jsonl], str(tmp_path / "t.bin"), tokenizer=corpus["tok"], field_name="body")
    with pytest.raises(ConfigError, match=r"no column 'text'.*--field"):
        prepare([os.path.join(corpus["root"], "all.parquet")], str(tmp_path / "t.bin"), tokenizer=corpus["tok"])
    with pytest.raises(ConfigError, match=r"--tokenizer .*nope.json: no such file"):
        prepare([jsonl], str(tmp_path / "t.bin"), tokenizer=str(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match=r"pattern matches no file"):
        prepare([str(tmp_path / "*.jsonl")], str(tmp_path / "t.bin"))
    with pytest.raises(ConfigError, match=r"--eos <nope>: not a token"):
        prepare([jsonl], str(tmp_path / "t.bin"), tokenizer=corpus["tok"], eos="<nope>")
    assert not any(n.startswith("t.") for n in os.listdir(tmp_path))


def test_cli_tokenizer_train_then_prepare_without_torch(corpus, tmp_path, capsys) -> None:
    tok = str(tmp_path / "tok.json")
    assert main(["data", "tokenizer-train", os.path.join(corpus["root"], "docs.txt"), "-o", tok,
                 "--vocab-size", "300"]) == 0
    assert "vocab 300, end-of-text '<|endoftext|>' = id 0" in capsys.readouterr().out
    assert main(["data", "tokenizer-train", os.path.join(corpus["root"], "docs.txt"), "-o", tok,
                 "--vocab-size", "100"]) == 2
    assert "--vocab-size: got 100" in capsys.readouterr().err
    code = ("import sys\nfrom hpctrain.cli import main\nrc = main(sys.argv[1:])\n"
            "assert 'torch' not in sys.modules, 'data prepare imported torch'\nsys.exit(rc)\n")
    out = str(tmp_path / "tokens.bin")
    proc = subprocess.run([sys.executable, "-c", code, "data", "prepare", os.path.join(corpus["root"], "a.jsonl"),
                           "-o", out, "--tokenizer", tok, "--workers", "2", "--val-fraction", "0.1"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "(uint16, vocab 300)" in proc.stdout and "validation tokens" in proc.stdout
    assert os.path.getsize(validation_path(out)) > 0


def test_cli_tokenizer_train_reads_the_field_it_is_told(corpus, tmp_path, capsys) -> None:
    """A corpus whose text is not in `text` (a Parquet column `body`, a JSON lines field `body`): the
    error names --field, and --field trains on that field, as in `data prepare`."""
    parquet = os.path.join(corpus["root"], "all.parquet")
    jsonl = tmp_path / "body.jsonl"
    jsonl.write_text("".join(json.dumps({"body": doc}) + "\n" for doc in json.loads(corpus["docs"])), encoding="utf-8")
    tok = str(tmp_path / "tok.json")
    assert main(["data", "tokenizer-train", parquet, "-o", tok, "--vocab-size", "300"]) == 2
    assert "choose the column with --field" in capsys.readouterr().err
    for source in (parquet, str(jsonl)):
        assert main(["data", "tokenizer-train", source, "-o", tok, "--vocab-size", "300", "--field", "body"]) == 0
        assert "vocab 300, end-of-text '<|endoftext|>' = id 0" in capsys.readouterr().out
        merged = tokenizers.Tokenizer.from_file(tok).encode("the planner").ids
        assert len(merged) < len("the planner")  # merges learnt from the field's text, not bytes only


def test_prepare_defaults_to_the_usable_cores(corpus, tmp_path) -> None:
    """Without --workers, `data prepare` runs one tokenizer process per CPU core it may use (its affinity
    mask, set here for real with taskset's system call), not one."""
    code = ("import os, sys\nos.sched_setaffinity(0, {min(os.sched_getaffinity(0))} if sys.argv[1] == 'one' "
            "else os.sched_getaffinity(0))\nfrom hpctrain.cli import main\nsys.exit(main(sys.argv[2:]))\n")
    cores = min(len(os.sched_getaffinity(0)), data_prepare.MAX_DEFAULT_WORKERS)
    for mask, expected in (("one", 1), ("all", cores)):
        out = str(tmp_path / f"{mask}.bin")
        proc = subprocess.run([sys.executable, "-c", code, mask, "data", "prepare",
                               os.path.join(corpus["root"], "a.jsonl"), "-o", out, "--tokenizer", corpus["tok"]],
                              capture_output=True, text=True, cwd=REPO, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert f"tokens/s with {expected} worker(s)" in proc.stdout, proc.stdout


def test_damaged_gzip_and_non_text_field_are_one_line(tmp_path, capsys) -> None:
    """Issue 30 Why 8/9: a truncated .jsonl.gz was an EOFError traceback (a garbled one BadGzipFile), and a
    number where the text should be said "no text field 'text' (keys: text)"."""
    whole = gzip.compress(b'{"text": "hello world"}\n' * 2000)
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "garbled.jsonl.gz").write_bytes(b"\x1f\x8b" + b"garbage" * 10)
    (tmp_path / "number.jsonl").write_text('{"text": "fine"}\n{"text": 5}\n')
    expected = {
        "cut.jsonl.gz": "cut.jsonl.gz: not a readable gzip file (it ends early: truncated or damaged); re-download "
                        "or re-compress it",
        "garbled.jsonl.gz": "garbled.jsonl.gz: not a readable gzip file (",
        "number.jsonl": "number.jsonl:2: field 'text' is int 5, not text; make it a string or choose another field "
                        "with --field",
    }
    for name, words in expected.items():
        code = main(["data", "prepare", str(tmp_path / name), "-o", str(tmp_path / "out" / "t.bin")])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and words in lines[0], (name, lines)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")
