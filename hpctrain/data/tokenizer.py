"""Tokenizers for `hpctrain data`: byte-level (`bytes`, vocabulary 256, nothing to load) or a local
Hugging Face `tokenizer.json` (the `tokenizers` package; never a download: compute nodes have no hub).

`Encoder` is what a prepare worker holds: it turns a piece of text into token ids and knows the
document separator. `train_bpe` makes a byte-level BPE tokenizer from local text.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from hpctrain.data.sources import documents, expand_inputs
from hpctrain.errors import ConfigError

BYTES = "bytes"
BYTE_VOCAB = 256
NEWLINE = 10  # the byte tokenizer's document separator (today's `data prepare`: a newline between files)
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|eot_id|>")
DEFAULT_EOS = "<|endoftext|>"
EXTRA_HINT = "pip install 'hpctrain[data]'"

# Rust-side threads would make `--workers` meaningless (and the timing noisy): one thread per process.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass(frozen=True)
class TokenizerInfo:
    """What the sidecar records about the tokenizer."""

    name: str  # "bytes" or the absolute path of tokenizer.json
    sha256: str
    vocab: int
    eos_id: int
    eos: str


def _load_hf(path: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(f"--tokenizer {path}: needs the tokenizers package; {EXTRA_HINT}") from None
    if not os.path.isfile(path):
        raise ConfigError(f"--tokenizer {path}: no such file; give a local tokenizer.json "
                          "(`hpctrain data tokenizer-train` makes one) or 'bytes'")
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - the Rust side raises a plain Exception for any bad file
        raise ConfigError(f"--tokenizer {path}: not a Hugging Face tokenizer.json "
                          f"({str(exc).splitlines()[0][:120]})") from None


def describe(tokenizer: str, eos: Optional[str] = None) -> TokenizerInfo:
    """Load (and check) the tokenizer; find its end-of-document token."""
    if tokenizer == BYTES:
        return TokenizerInfo(BYTES, BYTES, BYTE_VOCAB, NEWLINE, "\n")
    tok = _load_hf(tokenizer)
    names = (eos,) if eos else EOS_CANDIDATES
    for name in names:
        eos_id = tok.token_to_id(name)
        if eos_id is not None:
            with open(tokenizer, "rb") as handle:
                digest = hashlib.sha256(handle.read()).hexdigest()
            return TokenizerInfo(os.path.abspath(tokenizer), digest, int(tok.get_vocab_size(with_added_tokens=True)),
                                 int(eos_id), name)
    if eos:
        raise ConfigError(f"--eos {eos}: not a token of {tokenizer}; give one of its special tokens")
    raise ConfigError(f"--tokenizer {tokenizer}: has none of the usual end-of-text tokens "
                      f"({', '.join(EOS_CANDIDATES)}); name its separator with --eos TOKEN")


class Encoder:
    """Text -> token ids, in one worker process."""

    def __init__(self, info: TokenizerInfo) -> None:
        self.info = info
        self._tok = None if info.name == BYTES else _load_hf(info.name)

    def encode(self, texts: Sequence[str | bytes]) -> list[list[int]]:
        if self._tok is None:  # bytes: text files arrive undecoded, JSON/Parquet text as str
            return [list(t if isinstance(t, bytes) else t.encode("utf-8")) for t in texts]
        return [enc.ids for enc in self._tok.encode_batch(
            [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts],
            add_special_tokens=False)]


def train_bpe(files: Sequence[str], output: str, vocab_size: int, min_frequency: int = 2,
              field_name: str = "text") -> TokenizerInfo:
    """A byte-level BPE tokenizer (GPT-2 style) trained on local text files, with <|endoftext|> as id 0.
    `field_name`: the text field of JSON lines / column of Parquet, as in `data prepare --field`."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ConfigError(f"data tokenizer-train: needs the tokenizers package; {EXTRA_HINT}") from None
    if vocab_size < BYTE_VOCAB + 1:
        raise ConfigError(f"--vocab-size: got {vocab_size}; byte-level BPE needs at least {BYTE_VOCAB + 1} "
                          "(256 bytes + the end-of-text token)")
    paths = expand_inputs(files)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[DEFAULT_EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def texts() -> Any:
        for path in paths:
            yield from documents(path, field_name)

    tok.train_from_iterator(texts(), trainer=trainer)
    out_dir = os.path.dirname(os.path.abspath(output))
    os.makedirs(out_dir, exist_ok=True)
    tok.save(output + ".tmp")
    os.replace(output + ".tmp", output)
    return describe(output)
