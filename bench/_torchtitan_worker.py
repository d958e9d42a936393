"""One rank of torchtitan's Trainer on CPU with gloo, for bench/torchtitan_compare.py.

Run as `python bench/_torchtitan_worker.py TORCHTITAN_DIR SPEC.json` under the usual torch.distributed
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; LOCAL_RANK=0 at world size 1).
TORCHTITAN_DIR is a directory that holds the `torchtitan/` package (a git checkout's root, or an
unpacked wheel); it is put first on sys.path. Nothing of torchtitan is copied into hpctrain.

What this wrapper does around torchtitan (its code is not edited), and why:
- device "cpu": torchtitan.tools.utils picks `_get_available_device_type() or "cuda"` at import
  time; on a CPU-only machine that is "cuda". `torch._utils._get_available_device_type` is patched
  to return "cpu" before torchtitan is imported, so every module sees device_type "cpu",
  device_module torch.cpu, and init_process_group gets gloo (the default backend for "cpu").
- triton: torchtitan 0.3.0 imports triton at the top of three modules (TRITON_MODULES: the
  expert-parallel and fused kernels, never run by a dense Llama); where triton is not installed
  (torch's CPU wheel) those three modules are replaced by stubs in sys.modules.
- set_pg_timeouts (called after step 1 to shorten the collective timeouts): its barrier passes
  device_ids=["cpu"], which gloo rejects; replaced by a plain barrier (timeouts left as they are).
- FSDP's reduce-scatter: torchtitan sets every FSDP module's gradient divide factor to 1.0 (it
  scales by the global token count itself), which FSDP2 turns into ReduceOp.PREMUL_SUM(1.0), which
  gloo lacks; the wrapper also sets set_force_sum_reduction_for_comms(True), so the reduction is a
  plain SUM (the same sum, multiplied by 1.0).
- DeviceMemoryMonitor: torch.cpu has no memory_stats/get_device_properties; a stub reports zeros
  (memory is measured from outside as peak RSS instead). get_peak_flops is only used for MFU.
- the Trainer is built from a Trainer.Config made here (what `--module/--config` would load from
  a config_registry): the same Llama shape as hpctrain's side (fused QKV, SwiGLU, RMSNorm, RoPE
  theta 10000 without scaling, untied head), SDPA with is_causal (torchtitan's LM default is
  flex attention, which needs compile to be fast), plain CrossEntropyLoss, AdamW(lr, betas
  0.9/0.95, weight_decay 0.1), linear warm-up, fp32 (training.dtype and FSDP's
  mixed_precision_param float32), no activation checkpointing, no compile,
  comm.trace_buf_size 0, spmd_backend "partial_dtensor" (DTensor for TP, torchtitan's long-standing
  path; 0.3.0's default "spmd_types" stops at tp2 on CPU in fully_shard with "all parameters must
  be DTensors on the full SPMD mesh ... Got plain tensor"), dp = FSDP2
  (data_parallel_shard_degree), tp with sequence parallelism (its default).
- data: a synthetic token loader (uniform random ids, seq_len + 1 per sample, per dp rank), in
  place of the Hugging Face loader and tokenizer, which would need downloads.
- timing: Trainer.train_step is wrapped to record time.time() when it returns (where torchtitan
  logs the step), and CheckpointManager.save to record its duration; rank 0 writes them as JSON
  lines to SPEC["out"]. Trainer.train's 2 s sleep at its end is after every recorded step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch._utils

T0 = time.time()
torch._utils._get_available_device_type = lambda: "cpu"  # type: ignore[assignment]  # see the docstring


class _Stub:
    """Stands in for a torchtitan kernel module that needs triton; see the docstring."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self


TRITON_MODULES = ("torchtitan.distributed.minimal_async_ep.kernels", "torchtitan.overrides.fused_mla",
                  "torchtitan.overrides.fused_swiglu")


def _import_torchtitan() -> None:
    """Import the parts of torchtitan used here; where triton is absent, its three modules that
    import triton at the top (expert-parallel and fused kernels, never run here) are stubs."""
    import importlib.util
    import types

    if importlib.util.find_spec("triton") is None:
        for name in TRITON_MODULES:
            module = types.ModuleType(name)
            module.__getattr__ = _Stub().__getattr__  # type: ignore[method-assign]
            sys.modules[name] = module
    import torchtitan.models.llama3  # noqa: F401
    import torchtitan.trainer  # noqa: F401


def _patch_memory_monitor() -> None:
    from torchtitan.components import metrics

    class CpuMemoryMonitor:
        def __init__(self, device: str = "cpu") -> None:
            self.device = torch.device("cpu")
            self.device_name = "cpu"
            self.device_capacity_gib = 0.0

        def get_peak_stats(self) -> Any:
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self) -> None:
            pass

    metrics.DeviceMemoryMonitor = CpuMemoryMonitor  # type: ignore[misc, assignment]
    metrics.utils.get_peak_flops = lambda name: 1e12  # type: ignore[attr-defined]
    from torchtitan.distributed import utils as dist_utils

    from torchtitan.distributed import fsdp

    divide = fsdp.disable_fsdp_gradient_division

    def sum_reduction(model: Any) -> None:  # gloo has no PREMUL_SUM; see the docstring
        divide(model)
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = sum_reduction
    # its barrier passes device_ids=[torch.cpu.current_device()] = ["cpu"], which gloo rejects
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: torch.distributed.barrier()


def build_config(spec: dict[str, Any], dump_folder: str) -> Any:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.components.validate import Validator
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import CommConfig
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _LINEAR_INIT, _NORM_INIT, _depth_init,
                                          _output_linear_init, parallelize_llama)
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    m = spec["model"]
    dim, heads, vocab, seq = m["hidden"], m["heads"], m["vocab"], m["seq_len"]

    class NoTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Any = None, **kwargs: Any) -> None:
            super().__init__()

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            return []

        def decode(self, *args: Any, **kwargs: Any) -> str:
            return ""

        def get_vocab_size(self) -> int:
            return vocab

    class SyntheticLoader(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config: Any = None, *, dp_world_size: int, dp_rank: int, seq_len: int,
                     local_batch_size: int, **kwargs: Any) -> None:
            self.gen = torch.Generator().manual_seed(1234 + dp_rank)
            self.shape = (local_batch_size, seq_len + 1)

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            while True:
                tokens = torch.randint(0, vocab, self.shape, generator=self.gen)
                yield {"input": tokens[:, :-1]}, tokens[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {"seen": 0}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    layers = [Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        attention=make_gqa_config(dim=dim, n_heads=heads, n_kv_heads=m["kv_heads"], wqkv_param_init=_LINEAR_INIT,
                                  wo_param_init=_depth_init(i), inner_attention=ScaledDotProductAttention.Config(),
                                  fuse_qkv=True, rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=seq,
                                                                         theta=10000.0, scaling="none")),
        feed_forward=make_ffn_config(dim=dim, hidden_dim=m["ffn_hidden"], w1_param_init=_LINEAR_INIT,
                                     w2w3_param_init=_depth_init(i)),
    ) for i in range(m["layers"])]
    model = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=layers)
    model_spec = ModelSpec(name="llama3", flavor="bench", model=model, parallelize_fn=parallelize_llama,
                           pipelining_fn=None, post_optimizer_build_fn=None, state_dict_adapter=None)
    ck = spec["checkpoint_every"]
    return Trainer.Config(
        model_spec=model_spec,
        dump_folder=dump_folder,
        tokenizer=NoTokenizer.Config(),
        dataloader=SyntheticLoader.Config(),
        loss=CrossEntropyLoss.Config(global_vocab_size=vocab),
        optimizer=default_adamw(lr=1e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=None),
        training=TrainingConfig(local_batch_size=spec["local_batch"], seq_len=seq, steps=spec["steps"],
                                max_norm=1.0, dtype="float32", mixed_precision_param="float32",
                                disable_cuda_graphs=True),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(tensor_parallel_degree=spec["tp"], data_parallel_shard_degree=spec["dp"],
                                      spmd_backend=spec.get("spmd_backend", "partial_dtensor")),
        checkpoint=CheckpointManager.Config(enable=ck > 0, interval=max(ck, 1), last_save_model_only=True,
                                            keep_latest_k=2),
        activation_checkpoint=None,
        comm=CommConfig(trace_buf_size=0),
        validator=Validator.Config(enable=False),
    )


def main() -> None:
    titan_dir, spec_path = sys.argv[1], sys.argv[2]
    sys.path.insert(0, os.path.abspath(titan_dir))
    with open(spec_path) as handle:
        spec = json.load(handle)
    torch.set_num_threads(1)
    _import_torchtitan()
    _patch_memory_monitor()
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.trainer import Trainer

    init_logger()
    rank = int(os.environ.get("RANK", "0"))
    records: list[dict[str, Any]] = []
    saves: list[float] = []
    train_step, save = Trainer.train_step, CheckpointManager.save

    def timed_step(self: Any, data_iterator: Any) -> None:
        train_step(self, data_iterator)
        records.append({"step": self.step, "time": time.time()})

    def timed_save(self: Any, curr_step: int, last_step: bool = False) -> bool:
        start = time.perf_counter()
        saved = save(self, curr_step, last_step)
        if saved and not last_step:
            saves.append(time.perf_counter() - start)
        return saved

    Trainer.train_step = timed_step  # type: ignore[method-assign]
    CheckpointManager.save = timed_save  # type: ignore[method-assign]
    trainer = build_config(spec, spec["dump_folder"]).build()
    params = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
    try:
        trainer.train()
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if rank == 0:
        with open(spec["out"], "w") as handle:
            json.dump({"start": T0, "steps": records, "saves_s": saves, "local_params": params}, handle)


if __name__ == "__main__":
    main()
