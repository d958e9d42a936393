"""A plain PyTorch DDP training script run by hpctrain (`entrypoint:` in job.yaml): a tiny regression model.

It reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so it runs under
`torchrun` as it is, and uses the optional `hpctrain.job` API for three things: where checkpoints go
(HPCTRAIN_CHECKPOINT_DIR), when to stop (the requeue signal), and metrics.jsonl (status, doctor, report).
The rule: exit 0 after the signal = saved, requeue me; exit 0 at the last step = finished.

    python train.py --steps 50 --lr 0.05        # or: torchrun --nproc-per-node 2 train.py ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpctrain import job


def latest_checkpoint(folder: Path) -> Path | None:
    found = sorted(folder.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return found[-1] if found else None


def save(folder: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Rank 0 writes step-N.pt atomically (a temporary, then a rename): a kill never leaves half a file."""
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".step-{step}.pt.tmp"
        torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, tmp)
        os.replace(tmp, folder / f"step-{step}.pt")
    dist.barrier()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of sleep per step (demos, tests)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1).to(device),
                                                      device_ids=[local_rank] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    folder = job.checkpoint_dir()
    start = 0
    found = latest_checkpoint(folder)
    if found is not None:
        state = torch.load(found, map_location=device, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
        if rank == 0:
            print(f"resumed from {found} (attempt {job.attempt()})", flush=True)
    true_w = torch.linspace(-1, 1, 16, device=device)

    for step in range(start, args.steps):
        gen = torch.Generator(device="cpu").manual_seed(step * world + rank)  # each rank its own batch
        x = torch.randn(32, 16, generator=gen).to(device)
        y = x @ true_w + 0.01 * torch.randn(32, generator=gen).to(device)
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        job.log(step, loss=mean.item() / world, lr=args.lr)
        if args.step_delay:
            time.sleep(args.step_delay)
        stop = torch.tensor([1.0 if job.should_stop() else 0.0], device=device)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # one rank's signal stops every rank at this step
        if stop.item():
            save(folder, step, model.module, opt)
            if rank == 0:
                print(f"stopped at step {step}: saved, asking for a requeue", flush=True)
            dist.destroy_process_group()
            return 0  # exit 0 after the signal: saved, requeue me
        if (step + 1) % args.save_every == 0:
            save(folder, step, model.module, opt)
    if rank == 0:
        print(f"finished {args.steps} steps", flush=True)
    # every rank past its last collective before any tears the group down: rank 0 hosts the rendezvous store, and a
    # gloo group destroyed while a peer still talks to it can abort the process ("terminate called without an active
    # exception", exit 134, seen once in CI under load)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
