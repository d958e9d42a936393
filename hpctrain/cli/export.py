"""CLI command `hpctrain export RUN [--step N] -o DIR`: a run's checkpoint as a Hugging Face folder.

Imports only argparse at top level; the run, the checkpoint and the output folder are checked without
torch (a wrong argument answers at once, exit 2), and torch loads only to read the checkpoint
(hpctrain/export/hf.py does the work).
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    export = subparsers.add_parser(
        "export", help="write a run's checkpoint as a Hugging Face Llama folder",
        description="Convert a complete checkpoint of RUN (any layout) into a Hugging Face folder that "
                    "transformers' LlamaForCausalLM and inference servers load: config.json, "
                    "generation_config.json, safetensors weights (sharded with an index above --max-shard-size) "
                    "and the tokenizer files: model.init_from's, else the one train.data was prepared with "
                    "(with its EOS id). Runs on the CPU, "
                    "reading one tensor at a time.")
    export.add_argument("run", metavar="RUN", help="a run directory, or a run name in --runs-dir")
    export.add_argument("-o", "--output", required=True, metavar="DIR", help="the folder to write (new or empty)")
    export.add_argument("--step", type=int, metavar="N", help="the checkpoint step (default: the newest complete one)")
    export.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="largest safetensors file, e.g. 5GB (default), 500MB, or bytes")
    export.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="weight dtype in the folder (default float32: the checkpoint's master weights, lossless)")
    export.add_argument("--runs-dir", default="runs", help="where to look for RUN by name (default: runs)")
    export.add_argument("--lora-format", choices=("merged", "peft"),
                        help="a LoRA run (train.lora): merged = the adapters folded into the weights (default), "
                             "peft = a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    export.set_defaults(handler=run_export)


def checkpoint_folder(run_dir: str) -> tuple[str, Any]:
    """(the run's checkpoint folder, its `model:` section); ConfigError (exit 2) without a resolved job."""
    import yaml

    from hpctrain.config.model import ModelConfig
    from hpctrain.errors import ConfigError
    from hpctrain.rundir.layout import CHECKPOINTS_DIR, RESOLVED_FILE

    resolved = os.path.join(run_dir, RESOLVED_FILE)
    try:
        with open(resolved, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
        model = ModelConfig.model_validate(data["model"])  # init_from problems are only recorded: not needed here
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError) as exc:
        raise ConfigError(f"RUN: {run_dir} has no readable {RESOLVED_FILE} ({type(exc).__name__}); it is not a "
                          "run directory that started") from None
    return ((data.get("checkpoint") or {}).get("dir")) or os.path.join(run_dir, CHECKPOINTS_DIR), model


def find_checkpoint(run_dir: str, step: int | None) -> tuple[str, Any]:
    """(checkpoint folder, the run's `model:` section) for `hpctrain export`; ConfigError (exit 2) if
    the run has no resolved job or no such intact checkpoint.

    Intact as the ranks check it before they load one (rundir/checkpoints.py's verify_checkpoint: the
    sha256 of every file against the manifest): without --step a damaged newest checkpoint is passed
    over for the newest intact one, with a one-line notice; a damaged --step is refused."""
    import sys

    from hpctrain.errors import ConfigError
    from hpctrain.rundir.checkpoints import scan, verify_checkpoint

    folder, model = checkpoint_folder(run_dir)
    found = scan(folder)
    steps = [s for s, _ in found.complete]
    if not found.complete:
        raise ConfigError(f"RUN: no complete checkpoint in {folder}; nothing to export")
    if step is not None:
        path = dict(found.complete).get(step)
        if path is None:
            raise ConfigError(f"--step: got {step}; {folder} has complete checkpoints at steps "
                              f"{', '.join(map(str, steps))}")
        problems = verify_checkpoint(path)
        if problems:
            raise ConfigError(f"--step: got {step}; {path} is damaged ({problems[0]}): restore it, or export "
                              f"another step ({', '.join(str(s) for s in steps if s != step) or 'none left'})")
        return path, model
    damaged: list[str] = []
    for _, path in reversed(found.complete):
        problems = verify_checkpoint(path)
        if not problems:
            if damaged:
                print(f"hpctrain export: skipping damaged checkpoint {'; '.join(damaged)}; exporting "
                      f"{os.path.basename(path)}, the newest intact one", file=sys.stderr)
            return path, model
        damaged.append(f"{os.path.basename(path)} ({problems[0]})")
    raise ConfigError(f"RUN: none of the {len(damaged)} complete checkpoint(s) in {folder} is intact "
                      f"({damaged[0]}); nothing to export: restore the files")


def lora_settings(run_dir: str) -> tuple[dict[str, Any] | None, int, bool]:
    """(train.lora as a dict, or None; train.seed; whether the ranks had GPUs) of a run's resolved job."""
    import yaml

    from hpctrain.config.lora import LoraConfig
    from hpctrain.config.training import TrainConfig
    from hpctrain.rundir.layout import RESOLVED_FILE

    with open(os.path.join(run_dir, RESOLVED_FILE), encoding="utf-8") as handle:
        data = yaml.safe_load(handle) or {}
    train = data.get("train") or {}
    seed = int(train.get("seed", TrainConfig.model_fields["seed"].default))
    on_gpu = ((data.get("cluster") or {}).get("gpu") or "cpu") != "cpu"
    if not train.get("lora"):
        return None, seed, on_gpu
    return LoraConfig.model_validate(train["lora"]).model_dump(), seed, on_gpu


def check_output(out: str, run_dir: str) -> None:
    """ConfigError (exit 2, one line) for an output folder the export could not write, or would lose:
    inside the run's checkpoint folder (checkpoint.dir or RUN/checkpoints), whose step folders are rotated
    away and scanned as checkpoints at every start."""
    from hpctrain.errors import ConfigError
    from hpctrain.rundir.checkpoints import writable_problem
    from hpctrain.rundir.layout import CHECKPOINTS_DIR

    if os.path.islink(out):
        target = os.readlink(out)
        what = "which does not exist" if not os.path.exists(out) else "and export replaces the name, not its target"
        raise ConfigError(f"-o {out}: is a symbolic link to {target}, {what}; give the folder's own path")
    real = os.path.realpath(out)
    for folder in (checkpoint_folder(run_dir)[0], os.path.join(run_dir, CHECKPOINTS_DIR)):
        checkpoints = os.path.realpath(folder)
        if real == checkpoints or real.startswith(checkpoints.rstrip(os.sep) + os.sep):
            raise ConfigError(f"-o {out}: is inside the run's checkpoint folder {folder}, whose step folders are "
                              "rotated away (checkpoint.keep_last) and read as checkpoints at every start; "
                              "export to a folder outside it")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"-o {out}: exists and is not an empty folder; choose a new folder")
    problem = writable_problem(out)
    if problem:
        raise ConfigError(f"-o {out}: cannot write there: {problem}; choose a folder you can write to")


def run_export(args: argparse.Namespace) -> int:
    from hpctrain.errors import ConfigError
    from hpctrain.rundir.layout import find_run

    run_dir = str(find_run(args.run, args.runs_dir))
    out = os.path.abspath(args.output)
    check_output(out, run_dir)
    checkpoint, model = find_checkpoint(run_dir, args.step)
    from hpctrain.export.hf import export_checkpoint, parse_size

    lora, seed, on_gpu = lora_settings(run_dir)
    if lora is None and args.lora_format is not None:
        raise ConfigError(f"--lora-format: got {args.lora_format}; {run_dir} did not train LoRA adapters (train.lora "
                          "is unset): leave the option out")
    limit = parse_size(args.max_shard_size)
    if lora is not None:
        from hpctrain.export.lora import export_lora

        result = export_lora(checkpoint, model, lora, seed, out, lora_format=args.lora_format or "merged",
                             max_shard_bytes=limit, dtype=args.dtype, run_on_gpu=on_gpu)
    else:
        from hpctrain.export.data_tokenizer import data_tokenizer

        tokenizer = data_tokenizer(_train_data(run_dir), model.seq_len)  # the tokenizer and EOS of the data
        result = export_checkpoint(checkpoint, model, out, max_shard_bytes=limit, dtype=args.dtype, tokenizer=tokenizer)
    print(f"exported {os.path.basename(checkpoint)} of {run_dir}: {result.tensors} tensors, "
          f"{result.total_bytes / 1e9:.3f} GB in {len([f for f in result.files if f.endswith('.safetensors')])} "
          f"safetensors file(s) -> {out}")
    return 0


def _train_data(run_dir: str) -> str | None:
    """train.data of a run's resolved job (None when it names none)."""
    import yaml

    from hpctrain.rundir.layout import RESOLVED_FILE

    with open(os.path.join(run_dir, RESOLVED_FILE), encoding="utf-8") as handle:
        data = yaml.safe_load(handle) or {}
    value = (data.get("train") or {}).get("data")
    return value if isinstance(value, str) else None
