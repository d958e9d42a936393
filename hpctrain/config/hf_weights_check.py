"""`model.init_from`'s safetensors files checked on the login node, without torch or the safetensors package.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (tensor name -> dtype,
shape, [begin, end) byte offsets into the data that follows), then the data. Each file's header is read
here, bounded, and checked against the file's size and against the shape config.json gives, and a sharded
index's `weight_map` may name only files inside the folder. So a truncated download, a damaged header
(a length of 2^62) or an index naming `../../etc/passwd` is one line at `validate` and `submit`, exit 2,
before anything is submitted, instead of a traceback on every rank (which Slurm would requeue as a crash).

Tensors missing from the files are not looked for here: the ranks name the first one they miss (exit 2).
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import TYPE_CHECKING, Any

from hpctrain.config.hf_config import INDEX_FILE, WEIGHTS_FILE

if TYPE_CHECKING:
    from hpctrain.config.model import ModelConfig

# The safetensors library refuses headers over 100 MB (safetensors/src/tensor.rs, MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000
MAX_INDEX_BYTES = 64 << 20
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
            "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
FIX = "re-download or re-save the folder (save_pretrained)"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class WeightsProblem(Exception):
    """One line: what is wrong with one file."""


def _open_regular(path: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise WeightsProblem(f"cannot read {path!r:.200} ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise WeightsProblem(f"{path!r:.200} is not a regular file")
    return fd


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """(the header's tensors, the data's byte length) of one safetensors file; WeightsProblem when damaged."""
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise WeightsProblem(f"{os.path.basename(path)} is truncated ({size} bytes, no header)")
        length = int.from_bytes(head, "little")
        if length > MAX_HEADER_BYTES:
            raise WeightsProblem(f"{os.path.basename(path)} has a header length of {length} bytes (at most "
                                 f"{MAX_HEADER_BYTES}): the file is damaged")
        if 8 + length > size:
            raise WeightsProblem(f"{os.path.basename(path)} is truncated (its header needs {8 + length} bytes, "
                                 f"the file has {size})")
        raw = os.pread(fd, length, 8)
    except OSError as exc:
        raise WeightsProblem(f"cannot read {path!r:.200} ({exc.strerror})") from None
    finally:
        os.close(fd)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise WeightsProblem(f"{os.path.basename(path)}'s header is not JSON: the file is damaged") from None
    if not isinstance(header, dict):
        raise WeightsProblem(f"{os.path.basename(path)}'s header is not a JSON object: the file is damaged")
    return header, size - 8 - length


def _tensors(path: str) -> dict[str, list[int]]:
    """Tensor name -> shape, every entry checked against the dtype table and the file's size."""
    header, data_bytes = read_header(path)
    name = os.path.basename(path)
    shapes: dict[str, list[int]] = {}
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        label = f"{name}: tensor {tensor!r:.120}"
        if not isinstance(entry, dict):
            raise WeightsProblem(f"{label} has no dtype/shape/data_offsets entry: the file is damaged")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise WeightsProblem(f"{label} has dtype {dtype!r:.40}; readable: {', '.join(ITEMSIZE)}")
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise WeightsProblem(f"{label} has shape {shape!r:.80}, not a list of sizes: the file is damaged")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise WeightsProblem(f"{label} has data_offsets {offsets!r:.80}: the file is damaged")
        begin, end = offsets
        numel = 1
        for dim in shape:
            numel *= dim
        if not 0 <= begin <= end or end - begin != numel * ITEMSIZE[dtype]:
            raise WeightsProblem(f"{label} ({dtype} {shape}) does not fit its data_offsets {offsets}: the file "
                                 "is damaged")
        if end > data_bytes:
            raise WeightsProblem(f"{name} is truncated ({tensor!r:.120} ends at byte {end} of the data, the file "
                                 f"holds {data_bytes})")
        shapes[tensor] = shape
    return shapes


def inside(folder: str, tensor: object, file: str) -> str:
    """folder/file for an index entry; WeightsProblem when `file` leaves the folder (absolute, `..`)."""
    norm = os.path.normpath(file)
    if os.path.isabs(file) or norm == ".." or norm.startswith(".." + os.sep) or "\0" in file:
        raise WeightsProblem(f"{INDEX_FILE} maps {tensor!r:.120} to {file!r:.120}, outside the folder; an "
                             "index names files inside its own folder")
    return os.path.join(folder, norm)


def _files(folder: str) -> list[str]:
    """The safetensors files the folder's weights are in; WeightsProblem for an index naming others."""
    index = os.path.join(folder, INDEX_FILE)
    if not os.path.isfile(index):
        return [os.path.join(folder, WEIGHTS_FILE)]
    fd = _open_regular(index)
    try:
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(MAX_INDEX_BYTES + 1)
    except OSError as exc:
        raise WeightsProblem(f"cannot read {index!r:.200} ({exc.strerror})") from None
    if len(raw) > MAX_INDEX_BYTES:
        raise WeightsProblem(f"{INDEX_FILE} is larger than {MAX_INDEX_BYTES} bytes")
    try:
        weight_map = json.loads(raw.decode("utf-8")).get("weight_map")
    except (ValueError, RecursionError, AttributeError):
        raise WeightsProblem(f"{INDEX_FILE} is not a JSON object: the file is damaged") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsProblem(f"{INDEX_FILE} has no weight_map (tensor name -> file)")
    files: list[str] = []
    for tensor, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise WeightsProblem(f"{INDEX_FILE} maps {tensor!r:.120} to {file!r:.80}, not a file name")
        path = inside(folder, tensor, file)
        if path not in files:
            files.append(path)
    return files


def expected_shapes(m: ModelConfig) -> dict[str, list[int]]:
    """The shapes config.json's model has for the tensor-name suffixes every Llama-family file uses."""
    assert m.hidden and m.heads and m.kv_heads and m.vocab
    hd = m.head_dim or m.hidden // m.heads
    out = {"self_attn.q_proj.weight": [m.heads * hd, m.hidden], "self_attn.k_proj.weight": [m.kv_heads * hd, m.hidden],
           "self_attn.v_proj.weight": [m.kv_heads * hd, m.hidden], "self_attn.o_proj.weight": [m.hidden, m.heads * hd],
           "input_layernorm.weight": [m.hidden], "post_attention_layernorm.weight": [m.hidden],
           "self_attn.q_norm.weight": [hd], "self_attn.k_norm.weight": [hd]}
    if m.moe is None and m.ffn_hidden:
        out.update({"mlp.gate_proj.weight": [m.ffn_hidden, m.hidden], "mlp.up_proj.weight": [m.ffn_hidden, m.hidden],
                    "mlp.down_proj.weight": [m.hidden, m.ffn_hidden]})
    return out


def weights_problems(m: ModelConfig | None) -> list[str]:
    """One line per damaged or disagreeing safetensors file of model.init_from; [] when fine or unset (or
    when the job has no model: an entrypoint job)."""
    if m is None or m.init_from is None or m.init_problems or m.missing_fields():
        return []  # nothing to read, or config.json's own problems are already reported
    folder = os.path.expanduser(str(m.init_from))
    fix = f"; {FIX}"
    try:
        files = _files(folder)
        shapes: dict[str, list[int]] = {}
        for path in files:
            shapes.update(_tensors(path))
    except WeightsProblem as exc:
        return [f"model.init_from: {exc} (in {folder!r:.200}){fix}"]
    assert m.layers and m.vocab and m.hidden
    top = {"model.embed_tokens.weight": [m.vocab, m.hidden], "lm_head.weight": [m.vocab, m.hidden],
           "model.norm.weight": [m.hidden]}
    per_layer = expected_shapes(m)
    for tensor, shape in shapes.items():
        want = top.get(tensor)
        match = _LAYER.match(tensor)
        if match:
            if int(match.group(1)) >= m.layers:
                return [f"model.init_from: {tensor} is past config.json's num_hidden_layers={m.layers} (in "
                        f"{folder!r:.200}); the weights belong to another model{fix}"]
            want = per_layer.get(match.group(2))
        if want is not None and shape != want:
            return [f"model.init_from: {tensor} has shape {shape} but config.json's model needs {want} (in "
                    f"{folder!r:.200}); the weights belong to another model{fix}"]
    return []


def check_weights(m: ModelConfig | None) -> None:
    """Raise one ConfigError naming the first damaged or disagreeing file."""
    from hpctrain.errors import ConfigError

    found = weights_problems(m)
    if found:
        raise ConfigError(found)
