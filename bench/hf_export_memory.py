"""Peak memory of `hpctrain export`'s streaming path against the size of the model it exports.

    PYTHONPATH=. python3 bench/hf_export_memory.py [--layers 8 --hidden 1024 --shard-mb 64]

Writes a DCP checkpoint of a random model (as the runtime lays it out: {"model": {...}}), then, in a
fresh process, exports it with `export_checkpoint` and prints the model's bytes, the export's peak
resident memory above the process's baseline after imports, and the time. Streaming means the peak
stays near one output shard plus one tensor, not the model.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

CHILD = """
import sys, time
from types import SimpleNamespace
import torch
import torch.distributed.checkpoint, safetensors.torch
from hpctrain.export.hf import export_checkpoint
def status(key):
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(key + ':'))
open('/proc/self/clear_refs', 'w').write('5')  # reset the peak (VmHWM) to the current RSS
base = status('VmRSS')
model = SimpleNamespace(**{k: int(v) if v.isdigit() else v for k, v in (a.split('=') for a in sys.argv[4:])})
model.tie_embeddings = False; model.norm_eps = 1e-5; model.rope_theta = 10000.0; model.rope_scaling = None
model.init_from = None
started = time.perf_counter()
result = export_checkpoint(sys.argv[1], model, sys.argv[2], max_shard_bytes=int(sys.argv[3]))
peak = status('VmHWM')
print(result.total_bytes, (peak - base) * 1024, time.perf_counter() - started, len(result.files))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-mb", type=int, default=64)
    args = parser.parse_args()
    import torch
    import torch.distributed.checkpoint as dcp

    from hpctrain.export.hf import model_param_names
    from hpctrain.runtime.model.transformer import ModelArgs, build_model

    shape = dict(layers=args.layers, hidden=args.hidden, heads=args.hidden // 64, kv_heads=args.hidden // 128,
                 ffn_hidden=args.hidden * 8 // 3 // 64 * 64, vocab=args.vocab, seq_len=128)
    meta = build_model(ModelArgs(**shape))
    names = model_param_names(ModelArgs(**shape))
    params = dict(meta.named_parameters())
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "step-1")
        state = {"model": {n: torch.randn(tuple(params[n].shape)) for n in names}}
        dcp.save(state, checkpoint_id=ckpt)
        del state
        started = time.perf_counter()
        argv = [sys.executable, "-c", CHILD, ckpt, os.path.join(tmp, "out"), str(args.shard_mb * 10**6)]
        argv += [f"{k}={v}" for k, v in shape.items()] + ["activation=swiglu"]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()
        total, peak, seconds, files = int(out[0]), int(out[1]), float(out[2]), int(out[3])
        print(f"model {total / 1e6:.0f} MB in {files} files (shard limit {args.shard_mb} MB): export peak RSS "
              f"+{peak / 1e6:.0f} MB over the imports, {seconds:.1f} s ({time.perf_counter() - started:.1f} s "
              "with start-up)")


if __name__ == "__main__":
    main()
