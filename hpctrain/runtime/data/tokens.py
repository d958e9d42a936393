"""Training data: a deterministic synthetic stream or a flat token file, sampled over dp.

Every source maps a *global sample index* to seq_len + 1 tokens (inputs and the labels shifted by
one). Step s uses the global samples [s*B, (s+1)*B) for the global batch B, and dp rank r takes the
slice [r*B/dp, (r+1)*B/dp) of them. The sampler's position is therefore one integer, the number of
samples consumed, independent of the layout: a checkpoint taken on dp=4 resumes on dp=2 with the
same global batches, and a resumed run sees exactly the samples an uninterrupted one would.

numpy only (the trainer turns batches into tensors), so the data can be inspected without torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hpctrain.config.data_files import sidecar_path
from hpctrain.errors import ConfigError

if TYPE_CHECKING:
    from hpctrain.config import Job

SYNTHETIC = "synthetic"
SUCCESSORS = 2  # the synthetic chain's branching: the best reachable loss is about ln(2) = 0.69


class TokenSource(Protocol):
    """Anything that gives sample i as seq_len + 1 tokens (int64)."""

    def sample(self, index: int) -> np.ndarray: ...

    def samples(self, first: int, count: int) -> np.ndarray: ...


class SyntheticTokens:
    """A seeded Markov chain over the vocabulary: each token has SUCCESSORS possible next tokens,
    chosen uniformly. A model can learn it (the loss falls from ln(vocab) towards ln(SUCCESSORS)),
    it needs no file, and sample i is a pure function of (seed, i)."""

    def __init__(self, vocab: int, seq_len: int, seed: int) -> None:
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        table_rng = np.random.default_rng([seed, 0x5EED])
        self.successors = table_rng.integers(0, vocab, size=(vocab, SUCCESSORS), dtype=np.int64)

    def samples(self, first: int, count: int) -> np.ndarray:
        out = np.empty((count, self.seq_len + 1), dtype=np.int64)
        choices = np.empty((count, self.seq_len), dtype=np.int64)
        for row in range(count):
            rng = np.random.default_rng([self.seed, first + row])
            out[row, 0] = rng.integers(0, self.vocab)
            choices[row] = rng.integers(0, SUCCESSORS, size=self.seq_len)
        for t in range(self.seq_len):  # vectorised over the batch, sequential in time
            out[:, t + 1] = self.successors[out[:, t], choices[:, t]]
        return out

    def sample(self, index: int) -> np.ndarray:
        return self.samples(index, 1)[0]


def resolve_dtype(token_file: str, data_dtype: str, vocab: int) -> np.dtype:
    """The element type: from job.train.data_dtype, else the prepare sidecar, else from the vocab."""
    if data_dtype != "auto":
        return np.dtype(data_dtype)
    side = sidecar_path(token_file)
    if os.path.exists(side):
        try:
            with open(side, encoding="utf-8") as handle:
                return np.dtype(json.load(handle)["dtype"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"train.data: the description {side} is unreadable ({exc}); "
                              "re-run `hpctrain data prepare` or set train.data_dtype") from None
    return np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)


class TokenFile:
    """A flat file of token ids (uint16 or uint32), cut into non-overlapping windows of seq_len + 1
    tokens (consecutive windows share their boundary token), visited in a seeded random order that
    is reshuffled every epoch."""

    def __init__(self, path: str, dtype: np.dtype, vocab: int, seq_len: int, seed: int,
                 field: str = "train.data") -> None:
        self.field = field  # the job field that named this file, for the messages
        if not os.path.isfile(path):
            raise ConfigError(f"{field}: no such file (got {path!r}); give a token file made by "
                              "`hpctrain data prepare TEXT_FILES... -o tokens.bin`, or 'synthetic'")
        size = os.path.getsize(path)
        if size % dtype.itemsize:
            raise ConfigError(f"{field}: {path} has {size} bytes, not a multiple of {dtype.itemsize} "
                              f"({dtype.name}); set train.data_dtype to the file's element type")
        n_tokens = size // dtype.itemsize
        self.windows = (n_tokens - 1) // seq_len if n_tokens > 1 else 0
        if self.windows < 1:
            raise ConfigError(f"{field}: {path} holds {n_tokens} tokens, fewer than seq_len + 1 = "
                              f"{seq_len + 1}; prepare more text or lower model.seq_len")
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        self.path, self.seq_len, self.seed, self.vocab = path, seq_len, seed, vocab
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)
        self._check_vocab()

    def _check_vocab(self) -> None:
        probe = np.asarray(self.tokens[: 1 << 20])
        if probe.size and int(probe.max()) >= self.vocab:
            raise ConfigError(f"{self.field}: {self.path} holds token id {int(probe.max())}, outside "
                              f"model.vocab={self.vocab}; use a larger vocab or the matching tokenizer")

    def _window(self, index: int) -> int:
        epoch, offset = divmod(index, self.windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._perm_epoch = epoch
        return int(self._perm[offset])

    def sample(self, index: int) -> np.ndarray:
        start = self._window(index) * self.seq_len
        return np.asarray(self.tokens[start: start + self.seq_len + 1], dtype=np.int64)

    def samples(self, first: int, count: int) -> np.ndarray:
        return np.stack([self.sample(first + i) for i in range(count)])


@dataclass
class ShardedSampler:
    """This dp rank's slices of consecutive global batches; `position` = samples consumed so far."""

    source: Any  # TokenSource
    global_batch: int
    dp_rank: int
    dp: int
    position: int = 0

    def __post_init__(self) -> None:
        if self.global_batch % self.dp:
            raise ConfigError(f"train.global_batch: got {self.global_batch}; must be divisible by "
                              f"parallel.dp={self.dp}")
        self.local_batch = self.global_batch // self.dp

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, labels), each [local_batch, seq_len] int64; advances by one global batch."""
        first = self.position + self.dp_rank * self.local_batch
        tokens = self.source.samples(first, self.local_batch)
        self.position += self.global_batch
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"samples_seen": self.position, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["samples_seen"])


def build_source(job: Job) -> Any:
    """The job's token source (synthetic or file), validated against the model."""
    vocab, seq_len = _vocab_and_seq_len(job)
    train = job.train
    if train.data == SYNTHETIC:
        return SyntheticTokens(vocab, seq_len, int(train.seed))
    dtype = resolve_dtype(train.data, train.data_dtype, vocab)
    return TokenFile(train.data, dtype, vocab, seq_len, int(train.seed))


def _vocab_and_seq_len(job: Job) -> tuple[int, int]:
    """model.vocab and model.seq_len of a loaded job (validation fills both: from the preset or init_from)."""
    vocab, seq_len = job.transformer.vocab, job.transformer.seq_len
    if vocab is None or seq_len is None:
        raise ConfigError("model.vocab, model.seq_len: unset; the runtime needs a resolved job")
    return vocab, seq_len


def build_sampler(job: Job, dp_rank: int, dp: int) -> ShardedSampler:
    return ShardedSampler(build_source(job), int(job.train.global_batch), dp_rank, dp)
