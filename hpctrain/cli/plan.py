"""CLI commands of the planner: `hpctrain plan` and `hpctrain topo`. Imports only argparse at top level."""

from __future__ import annotations

import argparse

from hpctrain.cli.options import add_set_option


def add_plan_parser(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    plan = subparsers.add_parser(
        "plan", help="predict memory and step time, and pick the best TP/PP/DP layout",
        description="Search every layout the job allows (the `auto` values of parallel.*, train.micro_batch and "
                    "train.activation_checkpointing), print the best ones with their memory breakdown, and say why "
                    "the others were rejected. GPUs: v100-32gb, a100-40gb, a100-80gb, h100-80gb, h200-141gb, l40s; "
                    "nodes: dgx-a100, dgx-h100, hgx-h200, pcie-l40s, dgx1-v100; fabrics: ib-hdr200, ib-ndr400, "
                    "roce, ethernet.")
    plan.add_argument("job", metavar="JOB.yaml", help="the job file to plan")
    plan.add_argument("--top", type=int, default=5, metavar="N", help="layouts to show (default 5)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON (plan.json's format)")
    plan.add_argument("--expert-load", metavar="RUN_DIR", default=None,
                      help="a MoE job: price each layout's busiest expert-parallel rank with the load a run of this "
                           "model measured (its metrics.jsonl's expert_load_ep<N>, the newest 50 lines) instead of "
                           "the stated default")
    plan.add_argument("--workers", type=int, default=0, metavar="N",
                      help="processes a large search may use (default 0: one per CPU this process may run on; "
                           "1: one process). The result is the same")
    add_set_option(plan)
    plan.set_defaults(handler=run_plan, exit_now=True)  # it only prints: cli/main.py ends it at once


def add_topo_parser(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    topo = subparsers.add_parser(
        "topo", help="show the NVLink islands / leaf switches found in topology files",
        description="Each FILE is the saved output of `nvidia-smi topo -m` or a Slurm topology.conf "
                    "(recognised by its content).")
    topo.add_argument("files", nargs="+", metavar="FILE", help="`nvidia-smi topo -m` output and/or a Slurm topology.conf")
    topo.add_argument("--json", action="store_true", help="print JSON")
    topo.set_defaults(handler=run_topo)


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Both commands, for hpctrain.cli.COMMAND_MODULES."""
    add_plan_parser(subparsers)
    add_topo_parser(subparsers)


def run_plan(args: argparse.Namespace) -> int:
    import json

    from hpctrain.config import load_job
    from hpctrain.config.plugins_off import collector_paused
    from hpctrain.errors import ConfigError
    from hpctrain.plan.planner import plan_job
    from hpctrain.plan.report import render_text

    if args.top < 1:
        raise ConfigError(f"--top: must be >= 1 (got {args.top})")
    if args.workers < 0:
        raise ConfigError(f"--workers: must be >= 0, 0 for one per CPU (got {args.workers})")
    job = load_job(args.job, args.overrides)
    if job.model is None:  # an entrypoint without a model: its degrees are the fixed ones, nothing to search
        from hpctrain.config.entrypoint import layout_without_model

        p = layout_without_model(job).parallel
        print(json.dumps({"planned": False, "tp": p.tp, "pp": p.pp, "dp": p.dp}) if args.json else
              f"no model: nothing to plan; the entrypoint runs with tp={p.tp} pp={p.pp} dp={p.dp} "
              "(give model: to have the layout advised)")
        return 0
    measured = None
    if args.expert_load is not None:
        from pathlib import Path

        from hpctrain.plan.expert_load import KEY, read_expert_load
        from hpctrain.rundir.metrics import METRICS_FILE, records_backwards

        run = Path(args.expert_load)
        measured = read_expert_load(args.expert_load, job, run / METRICS_FILE, records_backwards(run, KEY))
    if args.workers:
        workers = args.workers
    else:
        from hpctrain.plan.split_search import search_workers

        workers = search_workers()
    # The collector stays off to the end: once the search has made its ~10^5 objects (no cycles among them), the
    # report's allocations would set off a full collection that walks them all (~50 ms of the 32K MoE case).
    with collector_paused():
        result = plan_job(job, measured, workers)
        if args.json:
            print(json.dumps(result.to_json(args.top), indent=2))
        else:
            print(render_text(result, args.top))
    # Held by args to the end: a command line's process ends at once (exit_now), without freeing the search's
    # objects one by one (~20 ms of the 32K MoE case).
    args.plan_result = result
    return 0


def run_topo(args: argparse.Namespace) -> int:
    import json

    from hpctrain.errors import ConfigError
    from hpctrain.plan.topology import TopologyParseError, parse_nvidia_smi_topo, parse_slurm_topology, read_topology_file

    problems, found = [], []
    for path in args.files:
        try:
            text = read_topology_file(path, path)
            if "GPU0" in text:
                gpus = parse_nvidia_smi_topo(text)
                found.append({"file": path, "kind": "nvidia-smi", **gpus.to_json()})
            else:
                tree = parse_slurm_topology(text)
                found.append({"file": path, "kind": "slurm-topology", **tree.to_json()})
        except ConfigError as exc:
            problems += exc.problems
        except TopologyParseError as exc:
            problems.append(f"{path}: {exc}")
    if problems:
        raise ConfigError(problems)
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    for item in found:
        print(_describe(item))
    return 0


def _describe(item: dict) -> str:
    if item["kind"] == "nvidia-smi":
        islands = ", ".join("[" + " ".join(str(g) for g in island) + "]" for island in item["islands"])
        return (f"{item['file']}: {len(item['gpus'])} GPUs, NVLink islands {islands} (TP up to "
                f"{item['island_size']} per group); NICs: {', '.join(item['nics']) or 'none listed'}")
    leaves = item["leaves"]
    lines = [f"{item['file']}: {len(leaves)} leaf switches, up to {item['max_leaf_nodes']} nodes under one leaf"]
    for name, nodes in leaves.items():
        lines.append(f"  {name}: {len(nodes)} nodes ({nodes[0]} .. {nodes[-1]})" if nodes else f"  {name}: no nodes")
    return "\n".join(lines)
