"""The rendezvous port of a Slurm job: one formula, mirrored by the batch script (job.sbatch.j2).

Every rank derives the same port from the job id and the attempt without talking; consecutive
attempts get different ports, so a requeued job does not meet its predecessor's sockets in
TIME_WAIT. The range stays below Linux's ephemeral ports (net.ipv4.ip_local_port_range, default
32768-60999), where the kernel hands out client ports that could already hold ours.
tests/rundir/test_ports.py runs the template's shell arithmetic and checks it equals this function.
"""

from __future__ import annotations

import random
import socket

PORT_BASE = 20000
PORT_SPAN = 12000  # ports PORT_BASE .. PORT_BASE + PORT_SPAN - 1 = 20000..31999
ATTEMPTS_APART = 16  # attempts of one job that get distinct ports before they wrap


def master_port(job_id: str | int, attempt: int = 0) -> int:
    """PORT_BASE + (16 * job id + attempt mod 16) mod PORT_SPAN; digits of an array id (123_4) only."""
    digits = "".join(ch for ch in str(job_id) if ch.isdigit()) or "0"
    return PORT_BASE + (int(digits) * ATTEMPTS_APART + attempt % ATTEMPTS_APART) % PORT_SPAN


# The same formula in the batch script's shell arithmetic (job.sbatch.j2 renders this text).
SHELL_FORMULA = (f"$(({PORT_BASE} + (SLURM_JOB_ID * {ATTEMPTS_APART} + ATTEMPT % {ATTEMPTS_APART}) "
                 f"% {PORT_SPAN}))")


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A port in the formula's range (below the ephemeral ports) that `host` can bind now, for a launcher
    that picks rank 0's rendezvous port itself (local processes, Ray).

    bind(port 0) would answer with an ephemeral port, which the kernel may hand to any client socket
    (the ranks' own gloo/NCCL connections among them) between this probe and rank 0's bind: CI saw
    rank 0 fail with EADDRINUSE so. A port below that range is taken only by an explicit bind.
    """
    chooser = random.SystemRandom()
    for _ in range(tries):
        port = PORT_BASE + chooser.randrange(PORT_SPAN)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port in {PORT_BASE}..{PORT_BASE + PORT_SPAN - 1} on {host or 'any address'} "
                  f"after {tries} tries")
