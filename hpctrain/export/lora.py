"""`hpctrain export --lora-format merged|peft` for a LoRA run (checkpoints hold the adapters only).

The frozen base comes from where the run took it: `model.init_from` (the Hugging Face folder, read
one tensor at a time) or, without it, the seed's initialisation (`model.full_init`, the same values
every start computes). Adapters are read from the checkpoint one tensor at a time.

- merged: a full Hugging Face folder (hf.py) whose targeted projections are
  W + (alpha / rank) B A, folded in fp32; it loads in transformers alone.
- peft: `adapter_config.json` + `adapter_model.safetensors` with PEFT's names
  (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`, checked against peft 0.21's
  `save_pretrained`) for `PeftModel.from_pretrained(base, DIR)`. base_model_name_or_path is the
  init_from folder; a run without one gets its seed's base exported beside the adapter, in DIR/base.
The runtime's projections are transformers' without any permutation (runtime/model/hf_weights.py), so A and B
keep their layout.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hpctrain.config.lora import HF_NAMES
from hpctrain.errors import ConfigError
from hpctrain.export.hf import DTYPES, ExportResult, export_checkpoint, load_without_process_group, model_param_names
from hpctrain.runtime.checkpoint.safe_dcp import UnsafeIndex, read_index
from hpctrain.runtime.model.hf_weights import HfShardReader, to_hf_name
from hpctrain.runtime.model.init import random_fill
from hpctrain.runtime.model.transformer import ModelArgs, build_model

if TYPE_CHECKING:
    from hpctrain.config.model import ModelConfig

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class CheckpointTensors:
    """One tensor at a time from a DCP checkpoint folder (its `model.` entries)."""

    def __init__(self, checkpoint: str) -> None:
        self.checkpoint = checkpoint
        try:
            self.entries = read_index(checkpoint).state_dict_metadata
        except (UnsafeIndex, OSError) as exc:
            raise ConfigError(f"checkpoint {checkpoint}: {exc}") from None

    def __call__(self, name: str) -> torch.Tensor:
        meta = self.entries.get(f"model.{name}")
        if not isinstance(meta, TensorStorageMetadata):
            raise ConfigError(f"checkpoint {self.checkpoint}: has no tensor model.{name}; it was not written by "
                              "this LoRA job")
        state = {"model": {name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)}}
        load_without_process_group(state, self.checkpoint)
        return state["model"][name].float()


def _projection(name: str, targets: list[str]) -> str | None:
    """`layers.3.attention.wq` for `layers.3.attention.wq.weight` when wq is a target, else None."""
    module, _, leaf = name.rpartition(".")
    return module if leaf == "weight" and module.rsplit(".", 1)[-1] in targets else None


def base_tensors(model: ModelConfig, seed: int, draw_device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(runtime name, fp32 tensor) of the frozen base, in transformers' file order; without init_from
    drawn as the runtime drew it (init.random_fill on the run's device type: CUDA and CPU draws differ)."""
    args = ModelArgs.from_config(model)
    shapes = {n: tuple(p.shape) for n, p in build_model(args).named_parameters()}
    fill = HfShardReader(model.init_from) if model.init_from else random_fill(seed, args.layers, draw_device)
    for name in model_param_names(args):  # the tied head is left out: no canonical-name mapping needed
        shape = shapes[name]
        yield name, fill(name, shape, tuple(slice(0, n) for n in shape)).float().cpu()


def merged_tensors(checkpoint: str, model: ModelConfig, lora: dict[str, Any], seed: int, dtype: torch.dtype,
                   draw_device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor): the base with every adapter folded in."""
    adapters = CheckpointTensors(checkpoint)
    scaling = float(lora["alpha"]) / int(lora["rank"])
    for name, weight in base_tensors(model, seed, draw_device):
        module = _projection(name, lora["targets"])
        if module is not None:
            weight = weight + scaling * (adapters(f"{module}.lora_B") @ adapters(f"{module}.lora_A"))
        yield to_hf_name(name), weight.to(dtype)


def peft_key(module: str, which: str) -> str:
    """PEFT's saved name of an adapter matrix: base_model.model. + transformers' module name."""
    return f"base_model.model.{to_hf_name(module + '.weight')[: -len('.weight')]}.lora_{which}.weight"


def write_peft_folder(checkpoint: str, model: ModelConfig, lora: dict[str, Any], seed: int, out: str,
                      max_shard_bytes: int, dtype: str, draw_device: str = "cpu") -> ExportResult:
    """adapter_config.json + adapter_model.safetensors (+ DIR/base without init_from); see the module doc."""
    from safetensors.torch import save_file

    adapters = CheckpointTensors(checkpoint)
    partial = out.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    tensors: dict[str, torch.Tensor] = {}
    for name in model_param_names(ModelArgs.from_config(model)):
        module = _projection(name, lora["targets"])
        if module is not None:
            for which in ("A", "B"):
                tensors[peft_key(module, which)] = adapters(f"{module}.lora_{which}").to(DTYPES[dtype]).contiguous()
    save_file(tensors, os.path.join(partial, ADAPTER_FILE), metadata={"format": "pt"})
    if model.init_from:
        base_path = os.path.abspath(model.init_from)
    else:
        base_path = os.path.join(os.path.abspath(out), "base")
        pairs = ((to_hf_name(n), t.to(DTYPES[dtype])) for n, t in base_tensors(model, seed, draw_device))
        export_checkpoint(checkpoint, model, os.path.join(partial, "base"), max_shard_bytes=max_shard_bytes,
                          dtype=dtype, tensors=pairs)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
              "r": int(lora["rank"]), "lora_alpha": float(lora["alpha"]), "lora_dropout": float(lora["dropout"]),
              "target_modules": sorted(HF_NAMES[t] for t in lora["targets"]), "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
              "use_dora": False, "modules_to_save": None}
    with open(os.path.join(partial, ADAPTER_CONFIG), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
        handle.write("\n")
    if os.path.isdir(out):
        os.rmdir(out)  # empty (checked by the caller)
    os.replace(partial, out)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return ExportResult(out, sorted(os.listdir(out)), total, len(tensors))


def export_lora(checkpoint: str, model: ModelConfig, lora: dict[str, Any], seed: int, out: str, *, lora_format: str,
                max_shard_bytes: int, dtype: str = "float32", run_on_gpu: bool = False) -> ExportResult:
    """Export a LoRA run's checkpoint as a merged Hugging Face folder or a PEFT adapter folder.
    `run_on_gpu`: the run's ranks had CUDA (cluster.gpu is not cpu), so a seed base is redrawn on CUDA."""
    draw_device = "cuda" if run_on_gpu and not model.init_from else "cpu"
    if draw_device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--lora-format: this run has no model.init_from, so its frozen base was drawn from the "
                          "seed on the GPU, and CUDA draws differ from CPU ones: run `hpctrain export` where a GPU "
                          "is visible, or fine-tune from model.init_from")
    targets = [t for t in lora["targets"] if t != "w3" or model.activation == "swiglu"]
    lora = {**lora, "targets": targets}
    if lora_format == "merged":
        pairs = merged_tensors(checkpoint, model, lora, seed, DTYPES[dtype], draw_device)
        return export_checkpoint(checkpoint, model, out, max_shard_bytes=max_shard_bytes, dtype=dtype, tensors=pairs)
    if lora_format == "peft":
        return write_peft_folder(checkpoint, model, lora, seed, out, max_shard_bytes, dtype, draw_device)
    raise ConfigError(f"--lora-format: got {lora_format!r}; valid: merged, peft")
