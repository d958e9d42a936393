"""The tokenizer a run's data was prepared with, for `hpctrain export` of a model trained from scratch.

`hpctrain data prepare` records the tokenizer (its tokenizer.json path and sha256, or `bytes`) and the
end-of-document id in the token file's sidecar (`<train.data>.json`). An export without them would ship
weights nobody can feed: so the folder gets that tokenizer.json, a tokenizer_config.json that
transformers' AutoTokenizer reads (PreTrainedTokenizerFast, the EOS token named), and `eos_token_id`
in config.json and generation_config.json. A tokenizer file that is gone or changed since the data was
prepared is not copied (a notice says so): its ids might not be the ones the model learnt.

Pure Python (JSON and file reads), no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from hpctrain.config.data_files import SYNTHETIC, read_sidecar

TOKENIZER_FILE = "tokenizer.json"
BYTES = "bytes"  # the byte-level vocabulary of `data prepare --tokenizer bytes`: no file to ship


@dataclass
class DataTokenizer:
    """The EOS id of the data, and the tokenizer files to write next to the weights (name -> bytes)."""

    eos_id: int
    files: dict[str, bytes] = field(default_factory=dict)


def data_tokenizer(train_data: Optional[str], seq_len: Optional[int] = None) -> Optional[DataTokenizer]:
    """What the sidecar of train.data says about its tokenizer; None for synthetic data or no sidecar."""
    if not train_data or train_data == SYNTHETIC:
        return None
    side = read_sidecar(train_data)
    if side is None or not isinstance(side.get("eos_id"), int):
        return None
    found = DataTokenizer(int(side["eos_id"]))
    name = side.get("tokenizer")
    if not isinstance(name, str) or name == BYTES:
        return found
    try:
        with open(name, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        _notice(f"{name}: cannot be read ({exc.strerror or exc}); the export has no tokenizer files")
        return found
    if hashlib.sha256(raw).hexdigest() != side.get("tokenizer_sha256"):
        _notice(f"{name}: changed since {train_data} was prepared (its sha256 differs from the sidecar's); "
                "the export has no tokenizer files")
        return found
    eos = _token_of(raw, found.eos_id)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if eos is not None:
        config["eos_token"] = eos
    if seq_len:
        config["model_max_length"] = int(seq_len)
    found.files = {TOKENIZER_FILE: raw, "tokenizer_config.json": _json_bytes(config)}
    if eos is not None:
        found.files["special_tokens_map.json"] = _json_bytes({"eos_token": eos})
    return found


def _token_of(tokenizer_json: bytes, token_id: int) -> Optional[str]:
    """The text of token_id in a tokenizer.json (its added tokens first, then the model's vocabulary)."""
    try:
        data = json.loads(tokenizer_json.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    for added in data.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("id") == token_id and isinstance(added.get("content"), str):
            return str(added["content"])
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        for text, number in vocab.items():
            if number == token_id:
                return str(text)
    return None


def _json_bytes(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _notice(text: str) -> None:
    print(f"notice: {text}", file=sys.stderr, flush=True)
