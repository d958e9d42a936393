"""CLI commands of the runtime's data side: `hpctrain data prepare`. Imports only argparse at top
level; numpy and the tokenizer load when the command runs (and torch never does)."""

from __future__ import annotations

import argparse


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    data = subparsers.add_parser("data", help="prepare training data",
                                 description="Turn text into the flat token files that train.data reads.")
    actions = data.add_subparsers(dest="data_command", metavar="ACTION")
    prepare = actions.add_parser(
        "prepare", help="tokenize text files (byte-level, vocab 256) into a flat token file",
        description="Concatenate TEXT_FILES, one token per byte (vocabulary 256, no download), into "
                    "OUTPUT as uint16, plus OUTPUT.json describing it. Set train.data: OUTPUT and a "
                    "model.vocab of at least 256 to train on it.")
    prepare.add_argument("files", nargs="+", metavar="TEXT_FILE", help="text files to turn into tokens")
    prepare.add_argument("-o", "--output", required=True, metavar="OUTPUT", help="token file to write, e.g. tokens.bin")
    prepare.set_defaults(handler=run_prepare)
    data.set_defaults(handler=lambda args: _usage(data))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def run_prepare(args: argparse.Namespace) -> int:
    from hpctrain.runtime.data_prepare import prepare

    done = prepare(args.files, args.output)
    print(f"{done.output}: {done.tokens} tokens ({done.dtype}, byte-level vocab {done.vocab}) "
          f"from {done.files} file(s); description in {done.output}.json")
    return 0
