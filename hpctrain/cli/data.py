"""CLI commands of the runtime's data side: `hpctrain data prepare` and `hpctrain data tokenizer-train`.
Imports only argparse at top level; numpy and the tokenizer load when the command runs (and torch
never does)."""

from __future__ import annotations

import argparse


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {value}; use 1 or more")
    return value


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    data = subparsers.add_parser("data", help="prepare training data",
                                 description="Turn text into the flat token files that train.data reads.")
    actions = data.add_subparsers(dest="data_command", metavar="ACTION")
    prepare = actions.add_parser(
        "prepare", help="tokenize text, JSON lines or Parquet into a flat token file",
        description="Tokenize INPUTS (.txt, .jsonl, .jsonl.gz, .parquet files, folders of them, or globs) into "
                    "OUTPUT (uint16, or uint32 for vocabularies over 65536) with the tokenizer's end-of-text id "
                    "after every document, plus OUTPUT.json describing it. Set train.data: OUTPUT and a "
                    "model.vocab of at least the tokenizer's vocabulary to train on it.")
    prepare.add_argument("files", nargs="+", metavar="INPUT", help="files, folders or globs to tokenize")
    prepare.add_argument("-o", "--output", required=True, metavar="OUTPUT", help="token file to write, e.g. tokens.bin")
    prepare.add_argument("--tokenizer", default="bytes", metavar="TOKENIZER",
                         help="a local Hugging Face tokenizer.json, or 'bytes' (one token per byte, vocab 256; default)")
    _add_field(prepare)
    prepare.add_argument("--workers", type=_positive, default=None, metavar="N",
                         help="tokenizer processes (the output is the same for any N; default: the CPU cores "
                              "this process may use, at most 8)")
    prepare.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                         help="put this fraction of the documents in OUTPUT's .val file (e.g. tokens.val.bin)")
    prepare.add_argument("--eos", metavar="TOKEN", help="the end-of-document token (default: the tokenizer's "
                         "<|endoftext|>, </s>, <eos> or similar)")
    prepare.set_defaults(handler=run_prepare)
    train = actions.add_parser(
        "tokenizer-train", help="train a byte-level BPE tokenizer on local text",
        description="Train a byte-level BPE tokenizer (GPT-2 style, <|endoftext|> = id 0) on INPUTS and write "
                    "it as a Hugging Face tokenizer.json for `hpctrain data prepare --tokenizer`.")
    train.add_argument("files", nargs="+", metavar="INPUT", help="files, folders or globs of text to learn from")
    train.add_argument("-o", "--output", required=True, metavar="TOKENIZER_JSON", help="tokenizer file to write")
    train.add_argument("--vocab-size", type=_positive, default=8192, metavar="N",
                       help="vocabulary size including the 256 bytes and <|endoftext|> (default 8192)")
    _add_field(train)
    train.set_defaults(handler=run_tokenizer_train)
    data.set_defaults(handler=lambda args: _usage(data))


def _add_field(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--field", default="text", help="the text field of JSON lines / column of Parquet (default: text)")


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _require_numpy(command: str) -> None:
    """The token files are numpy arrays: without the data (or runtime) extra, say which install brings it."""
    import importlib.util

    from hpctrain.errors import ConfigError

    if importlib.util.find_spec("numpy") is None:
        raise ConfigError(f"hpctrain data {command}: needs numpy, which is not installed; pip install 'hpctrain[data]'")


def run_prepare(args: argparse.Namespace) -> int:
    _require_numpy("prepare")
    from hpctrain.data.prepare import prepare

    done = prepare(args.files, args.output, tokenizer=args.tokenizer, field_name=args.field, workers=args.workers,
                   val_fraction=args.val_fraction, eos=args.eos, progress=True)
    kind = "byte-level vocab" if done.tokenizer == "bytes" else "vocab"
    rate = (done.tokens + done.val_tokens) / max(done.seconds, 1e-9)
    print(f"{done.output}: {done.tokens} tokens ({done.dtype}, {kind} {done.vocab}) from {done.documents} "
          f"document(s) in {done.files} file(s), {rate:,.0f} tokens/s with {done.workers} worker(s); "
          f"description in {done.output}.json")
    if done.val_output:
        print(f"{done.val_output}: {done.val_tokens} validation tokens from {done.val_documents} document(s)")
    return 0


def run_tokenizer_train(args: argparse.Namespace) -> int:
    from hpctrain.data.tokenizer import train_bpe

    info = train_bpe(args.files, args.output, args.vocab_size, field_name=args.field)
    print(f"{args.output}: byte-level BPE, vocab {info.vocab}, end-of-text {info.eos!r} = id {info.eos_id}")
    return 0
