"""Issue 11 item 6: one MASTER_PORT formula, below the kernel's ephemeral range; the batch script's
shell arithmetic is the same function (it is rendered, extracted and run in bash here)."""

from __future__ import annotations

import contextlib
import copy
import socket
import subprocess

import pytest

from hpctrain.config import job_from_dict
from hpctrain.render import render_script
from hpctrain.rundir import ports as ports_module
from hpctrain.rundir.ports import free_port, master_port
from hpctrain.runtime.distributed import detect_env, port_for_job

from tests.render.hostile import BASE_JOB

EPHEMERAL_LOW = 32768  # Linux net.ipv4.ip_local_port_range default: 32768-60999
SAMPLES = [(job_id, attempt) for job_id in (0, 1, 749, 4242, 99_999, 12_345_678, 2**31 - 1) for attempt in (0, 1, 15, 16, 40)]


def _template_ports() -> list[int]:
    data = copy.deepcopy(BASE_JOB)
    data["monitor"] = {}
    script = render_script(job_from_dict(data), run_dir="/runs/x")
    [line] = [line for line in script.splitlines() if line.startswith("MASTER_PORT=$((")]
    program = "".join(f"SLURM_JOB_ID={j}; ATTEMPT={a}; {line}; echo $MASTER_PORT;" for j, a in SAMPLES)
    out = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True, timeout=30)
    return [int(word) for word in out.stdout.split()]


def test_template_and_runtime_compute_the_same_port() -> None:
    expected = [master_port(j, a) for j, a in SAMPLES]
    assert _template_ports() == expected
    assert [port_for_job(str(j), a) for j, a in SAMPLES] == expected
    env = detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "3",
                      "SLURM_JOB_NODELIST": "n1"})
    assert env.master_port == master_port(4242, 3)


def test_ports_stay_below_the_ephemeral_range() -> None:
    ports = [master_port(j, a) for j in range(0, 2_000_000, 997) for a in range(20)]
    assert min(ports) >= 20000 and max(ports) < EPHEMERAL_LOW
    assert master_port(4242, 0) != master_port(4242, 1) != master_port(4243, 1)
    assert master_port("4242_7", 0) == master_port(42427, 0)  # array ids: their digits


def test_a_launcher_picks_a_bindable_port_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= port < EPHEMERAL_LOW for port in ports) and len(ports) > 1
    base = free_port()
    with contextlib.ExitStack() as stack:
        held = []
        for port in range(base - 3, base + 1):  # four consecutive ports; three held, the fourth free
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                pytest.skip(f"port {port} is in use by another process")
            held.append(sock)
        held.pop().close()
        monkeypatch.setattr(ports_module, "PORT_BASE", base - 3)
        monkeypatch.setattr(ports_module, "PORT_SPAN", 4)
        assert {free_port() for _ in range(20)} == {base}  # a port in use is never the answer
        with socket.socket() as last:
            last.bind(("127.0.0.1", base))
            with pytest.raises(OSError, match=rf"no free TCP port in {base - 3}..{base} on 127.0.0.1 after 64 tries"):
                free_port()
