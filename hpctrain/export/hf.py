"""`hpctrain export RUN [--step N] -o DIR`: a DCP checkpoint of any layout -> a Hugging Face Llama folder.

Runs on the login node's CPU without a process group. Streaming: `hf_tensors` reads one tensor at a
time from the checkpoint (a one-entry state dict through DCP, which reads only that tensor's bytes
from whatever shards the layout wrote), and `write_hf_folder` holds at most one output shard
(<= max_shard_bytes) plus that tensor in memory. So a model larger than the machine's memory exports.

The folder: config.json (transformers 4 spelling, read by 4 and 5; the init_from folder's other keys,
token ids etc., kept), generation_config.json, the init_from folder's tokenizer files when there was
one, else the tokenizer the data was prepared with and its EOS id (export/data_tokenizer.py), and
model.safetensors, or model-0000i-of-0000n.safetensors plus model.safetensors.index.json when
the weights exceed the shard size (transformers' conventions). Written to DIR.partial, then renamed.

Extending (LoRA's `--lora-format`): `export_checkpoint(..., tensors=...)` takes any iterator of
(hf_name, tensor) pairs; `hf_tensors` is the plain one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hpctrain.errors import ConfigError
from hpctrain.export.data_tokenizer import DataTokenizer
from hpctrain.runtime.checkpoint.safe_dcp import SafePlanner, SafeReader, UnsafeIndex, read_index
from hpctrain.runtime.model.hf_weights import hf_config_dict, need_safetensors, read_base_config, to_hf_name
from hpctrain.runtime.model.transformer import ModelArgs

if TYPE_CHECKING:
    from hpctrain.config.model import ModelConfig

DEFAULT_MAX_SHARD = "5GB"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Copied from init_from when present: what inference servers need next to the weights.
COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "tokenizer.model")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' (10^9, as transformers counts), '500MiB', '1000' (bytes) -> bytes."""
    match = _SIZE.match(str(text))
    value = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()]) if match else 0
    if value < 1:
        raise ConfigError(f"--max-shard-size: got {text!r}; write a size such as 5GB, 500MB or 1000000")
    return value


def model_param_names(model: ModelArgs) -> list[str]:
    """The runtime's full-model parameter names in transformers' file order (the tied head left out)."""
    if model.activation != "swiglu":
        raise ConfigError(f"model.activation: got {model.activation!r}; a Hugging Face Llama export needs swiglu")
    block = ("attention_norm.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
             "attention.wo.weight", "ffn_norm.weight", "feed_forward.w1.weight", "feed_forward.w3.weight",
             "feed_forward.w2.weight")
    names = ["tok_embeddings.weight"]
    names += [f"layers.{i}.{part}" for i in range(model.layers) for part in block]
    names.append("norm.weight")
    if not model.tie_embeddings:
        names.append("output.weight")
    return names


def hf_tensors(checkpoint: str, model: ModelConfig,
               dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) for every weight of `model` in the DCP checkpoint folder, each read by itself."""
    try:
        entries = read_index(checkpoint).state_dict_metadata
    except (UnsafeIndex, OSError) as exc:
        raise ConfigError(f"checkpoint {checkpoint}: {exc}") from None
    for name in model_param_names(ModelArgs.from_config(model)):
        meta = entries.get(f"model.{name}")
        if not isinstance(meta, TensorStorageMetadata):
            raise ConfigError(f"checkpoint {checkpoint}: has no tensor model.{name}; it was not written for this "
                              "job's model")
        state = {"model": {name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)}}
        load_without_process_group(state, checkpoint)
        yield to_hf_name(name), state["model"][name].to(dtype)


def load_without_process_group(state: dict[str, Any], checkpoint: str) -> None:
    """dcp.load in this one process, by design: torch's UserWarning that it "assumes the intent is to load
    in a single process" (raised even with no_dist=True) is the intent here, so it is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is .*single process", category=UserWarning)
        dcp.load(state, storage_reader=SafeReader(checkpoint), planner=SafePlanner(), no_dist=True)


@dataclass
class ExportResult:
    folder: str
    files: list[str]
    total_bytes: int
    tensors: int


def write_hf_folder(out: str, tensors: Iterator[tuple[str, torch.Tensor]], config: dict[str, Any],
                    max_shard_bytes: int, copy_from: str | None = None,
                    extra_files: dict[str, bytes] | None = None) -> ExportResult:
    """Write config.json, generation_config.json and the weights (sharded) to `out` (see the module doc).
    `extra_files` (name -> contents, the data's tokenizer) fill in what copy_from did not provide."""
    from safetensors.torch import save_file

    partial = out.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = total = count = 0

    def flush() -> None:
        nonlocal current, current_bytes
        if current:
            save_file(current, os.path.join(partial, f"shard-{len(shards):05d}.tmp"), metadata={"format": "pt"})
            shards.append(list(current))
            current, current_bytes = {}, 0

    for hf_name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if current and current_bytes + size > max_shard_bytes:
            flush()
        current[hf_name] = tensor.contiguous()
        current_bytes += size
        total += size
        count += 1
    flush()
    files = _name_shards(partial, shards, total)
    for name in COPIED_FILES:
        if copy_from and os.path.isfile(os.path.join(copy_from, name)):
            shutil.copy2(os.path.join(copy_from, name), os.path.join(partial, name))
    has_tokenizer = any(os.path.exists(os.path.join(partial, n)) for n in ("tokenizer.json", "tokenizer.model"))
    for name, contents in (extra_files or {}).items() if not has_tokenizer else ():
        with open(os.path.join(partial, name), "wb") as handle:
            handle.write(contents)
    if not os.path.exists(os.path.join(partial, "generation_config.json")):
        ids = ("bos_token_id", "eos_token_id", "pad_token_id")
        generation = {k: config[k] for k in ids if config.get(k) is not None}
        _write_json(os.path.join(partial, "generation_config.json"), {"_from_model_config": True, **generation})
    _write_json(os.path.join(partial, "config.json"), config)
    if os.path.isdir(out):
        os.rmdir(out)  # empty (checked by the caller): the rename below needs the name free
    os.replace(partial, out)
    return ExportResult(out, sorted(os.listdir(out)), total, count)


def _name_shards(folder: str, shards: list[list[str]], total: int) -> list[str]:
    """transformers' file names: one model.safetensors, or -0000i-of-0000n files with an index."""
    if len(shards) == 1:
        os.replace(os.path.join(folder, "shard-00000.tmp"), os.path.join(folder, "model.safetensors"))
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(folder, f"shard-{i:05d}.tmp"), os.path.join(folder, name))
        names.append(name)
        weight_map.update({t: name for t in tensors})
    _write_json(os.path.join(folder, "model.safetensors.index.json"),
                {"metadata": {"total_size": total}, "weight_map": weight_map})
    return names


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")


def export_checkpoint(checkpoint: str, model: ModelConfig, out: str, *, max_shard_bytes: int, dtype: str = "float32",
                      tensors: Iterator[tuple[str, torch.Tensor]] | None = None,
                      tokenizer: DataTokenizer | None = None) -> ExportResult:
    """Export one checkpoint folder of a job whose `model:` section is `model` (pydantic or alike).
    `tokenizer`: the one the training data was prepared with (its EOS id unless init_from's config
    names one; its files unless init_from has a tokenizer)."""
    need_safetensors("hpctrain export")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype: got {dtype!r}; valid: {', '.join(DTYPES)}")
    base = read_base_config(model.init_from)
    config = hf_config_dict(model, torch_dtype=dtype, base=base)
    if tokenizer is not None and config.get("eos_token_id") is None:
        config["eos_token_id"] = tokenizer.eos_id
    pairs = tensors if tensors is not None else hf_tensors(checkpoint, model, DTYPES[dtype])
    return write_hf_folder(out, pairs, config, max_shard_bytes, copy_from=model.init_from,
                           extra_files=tokenizer.files if tokenizer is not None else None)
