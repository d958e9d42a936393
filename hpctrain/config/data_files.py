"""The job's token files checked against their sidecars (`<file>.json`, written by `hpctrain data
prepare`), on the login node before `submit` submits anything and in the runtime before any process
group starts. Pure Python: reads JSON and file sizes only, so every stage may call it.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Optional

from hpctrain.config import limits as L
from hpctrain.errors import ConfigError

if TYPE_CHECKING:
    from hpctrain.config.job import Job
    from hpctrain.config.training import TrainConfig

SYNTHETIC = "synthetic"
ITEMSIZE = {"uint16": 2, "uint32": 4}
# The sidecar's numbers and their bounds (the schema's: model.vocab is 2..MAX_VOCAB); others are not read.
SIDECAR_NUMBERS = {"vocab": (2, L.MAX_VOCAB), "eos_id": (0, L.MAX_VOCAB - 1), "tokens": (0, 1 << 62),
                   "documents": (0, 1 << 62)}
PREPARE = "`hpctrain data prepare INPUTS -o FILE`"


def sidecar_path(token_file: str) -> str:
    """Where `hpctrain data prepare` writes the description of a token file."""
    return token_file + ".json"


def read_sidecar(token_file: str, field: str = "train.data") -> Optional[dict[str, Any]]:
    """The sidecar's contents, None when there is none; an unreadable one is a ConfigError."""
    side = sidecar_path(token_file)
    if not os.path.exists(side):
        return None
    from hpctrain.userfiles import read_regular_file

    try:  # bounded, regular files only: a sidecar is a few hundred bytes (a FIFO there would block)
        body = json.loads(read_regular_file(side, 1 << 20, field).decode("utf-8"))
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, RecursionError) as exc:
        reason = "nested too deep" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise ConfigError(f"{field}: the description {side} is unreadable ({reason}); re-run {PREPARE}") from None
    for key, (low, high) in SIDECAR_NUMBERS.items():
        value = body.get(key)
        if value is None:
            continue
        whole = isinstance(value, int) and not isinstance(value, bool)
        if not whole or not low <= value <= high:
            raise ConfigError(f"{field}: the description {side} has {key} {value!r:.60}; expected a whole number "
                              f"from {low} to {high}; re-run {PREPARE}")
    return body


def eval_file(train: TrainConfig) -> Optional[str]:
    """The validation token file: train.eval_data, else the one `--val-fraction` wrote beside train.data."""
    if train.eval_data:
        return str(train.eval_data)
    if train.data == SYNTHETIC:
        return None
    side = read_sidecar(train.data)
    if side and isinstance(side.get("validation"), str):
        return os.path.join(os.path.dirname(train.data), side["validation"])
    return None


def _too_short(path: str, field: str, dtype: str, seq_len: Optional[int]) -> list[str]:
    """The runtime's TokenFile refusal, on the login node and before any process group starts: a file of
    fewer than seq_len + 1 tokens (an empty one) holds no training window."""
    tokens = os.path.getsize(path) // ITEMSIZE[dtype]
    if seq_len is None or tokens >= seq_len + 1:
        return []
    return [f"{field}: {path} holds {tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}; prepare more text or "
            "lower model.seq_len"]


def _file_problems(path: str, field: str, train: TrainConfig, vocab: Optional[int],
                   seq_len: Optional[int] = None) -> tuple[list[str], Optional[dict]]:
    if not os.path.isfile(path):
        return [f"{field}: no such file (got {path!r}); make it with {PREPARE}, or use 'synthetic'"], None
    side = read_sidecar(path, field)
    if side is None:
        guess = train.data_dtype if train.data_dtype in ITEMSIZE else "uint16" if (vocab or 0) <= 2**16 else "uint32"
        return _too_short(path, field, guess, seq_len), None
    out = []
    dtype = side.get("dtype")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        return [f"{field}: {sidecar_path(path)} names dtype {dtype!r:.60}, not uint16/uint32; re-run {PREPARE}"], side
    if train.data_dtype not in ("auto", dtype):
        out.append(f"train.data_dtype: got {train.data_dtype} but {path} holds {dtype} (its sidecar says so); "
                   "set train.data_dtype: auto")
    size = os.path.getsize(path)
    tokens = side.get("tokens")
    if isinstance(tokens, int) and size != tokens * ITEMSIZE[dtype]:
        out.append(f"{field}: {path} has {size} bytes but its sidecar says {tokens} {dtype} tokens; the file "
                   f"changed since it was prepared: re-run {PREPARE}")
    side_vocab = side.get("vocab")
    if vocab is not None and isinstance(side_vocab, int) and side_vocab > vocab:
        out.append(f"model.vocab: got {vocab} but {path} was tokenized with a vocabulary of {side_vocab} "
                   f"({side.get('tokenizer', '?')}); set model.vocab >= {side_vocab}")
    return out or _too_short(path, field, dtype, seq_len), side


def data_problems(job: Job) -> list[str]:
    """One line per problem with train.data / train.eval_data; [] when fine (or synthetic)."""
    train = job.train
    if job.model is None:
        return []  # an entrypoint's own program reads its own data
    vocab = job.model.vocab
    problems: list[str] = []
    train_side = None
    if train.data != SYNTHETIC:
        found, train_side = _file_problems(train.data, "train.data", train, vocab, job.model.seq_len)
        problems += found
    elif train.eval_every and not train.eval_data:
        problems.append("train.eval_every: validation needs a token file; set train.eval_data (or train.data to "
                        "a file prepared with --val-fraction), or train.eval_every: 0")
    if problems:
        return problems
    evaluation = eval_file(train)
    if train.eval_every and evaluation is None:
        return [f"train.eval_every: got {train.eval_every} but there is no validation file; set train.eval_data "
                f"or prepare train.data with --val-fraction"]
    if evaluation is not None and (train.eval_every or train.eval_data):
        found, eval_side = _file_problems(evaluation, "train.eval_data", train, vocab, job.model.seq_len)
        problems += found
        hashes = [s.get("tokenizer_sha256") for s in (train_side, eval_side) if s]
        if not found and len(hashes) == 2 and hashes[0] != hashes[1]:
            problems.append(f"train.eval_data: {evaluation} and {train.data} were made with different tokenizers; "
                            "prepare both with the same --tokenizer")
    return problems


def check_data(job: Job) -> None:
    """Raise one ConfigError listing every data problem."""
    problems = data_problems(job)
    if problems:
        raise ConfigError(problems)
