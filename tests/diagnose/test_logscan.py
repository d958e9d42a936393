"""The log patterns, table-driven: each message as PyTorch, NCCL, gloo, Slurm or the kernel prints it."""

from __future__ import annotations

import pytest

from hpctrain.diagnose.logscan import PATTERNS, flight_recorder_dumps, scan_logs
from hpctrain.diagnose.rundata import LogFile

CASES = [
    ("cuda_oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity"),
    ("cuda_oom", "RuntimeError: CUDA error: out of memory"),
    ("cuda_oom", "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    ("cpu_oom", "slurmstepd: error: Detected 1 oom_kill event in StepId=4182.0. Some of the step tasks have been "
                "OOM Killed."),
    ("cpu_oom", "srun: error: node2: task 1: Out Of Memory"),
    ("cpu_oom", "Out of memory: Killed process 1234 (python) total-vm:123kB"),
    ("cpu_oom", "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                "you tried to allocate 17179869184 bytes."),
    ("cpu_oom", "MemoryError: Unable to allocate 8.00 GiB for an array"),
    ("timeout", "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=8812, OpType=ALLREDUCE, "
                "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600021 milliseconds before timing out."),
    ("timeout", "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                "1800000ms for recv operation to complete"),
    ("timeout", "torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. "
                "1/2 clients joined."),
    ("desync", "RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running collective: "
               "CollectiveFingerPrint(SequenceNumber=23, OpType=ALLREDUCE)"),
    ("nccl_error", "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system "
                   "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5 ncclSystemError"),
    ("flight_recorder", "[rank0]: Dumping flight recorder traces to /scratch/run/fr/nccl_trace_rank_0"),
]
HEALTHY = [
    "step     10 | loss 4.9924 | lr 2.900e-04 | grad_norm 0.602 | 2,051 tok/s | 124.8 ms",
    "hpctrain: started attempt 0 on node1",
    "[W socket.cpp:697] [c10d] The client socket has failed to connect to [::ffff:127.0.0.1]:29500 (retrying)",
]


@pytest.mark.parametrize("kind,line", CASES)
def test_pattern_matches(kind, line):
    assert PATTERNS[kind].search(line)


@pytest.mark.parametrize("line", HEALTHY)
def test_healthy_lines_match_nothing(line):
    assert not [k for k, p in PATTERNS.items() if p.search(line)]


def test_cuda_oom_is_not_a_host_oom():
    assert not PATTERNS["cpu_oom"].search(CASES[0][1])


def test_scan_reports_rank_attempt_and_line(tmp_path):
    log = tmp_path / "rank-2.attempt-1.log"
    log.write_text("ok\n" + CASES[8][1] + "\n" + CASES[13][1] + "\n")
    matches = scan_logs([LogFile(2, 1, log)], PATTERNS)
    assert [(m.kind, m.rank, m.attempt, m.line_number) for m in matches] == [
        ("timeout", 2, 1, 2), ("flight_recorder", 2, 1, 3)]
    assert flight_recorder_dumps(tmp_path, matches) == ["/scratch/run/fr/nccl_trace_rank_0"]
