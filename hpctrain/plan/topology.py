"""Topology parsers: `nvidia-smi topo -m` into NVLink islands, Slurm topology.conf into leaf switches.

Both are small pure functions over text, tested table-driven and against golden files
(tests/plan/data/topo/). Hostlist expressions are expanded by python-hostlist, not by hand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GPU = re.compile(r"^GPU(\d+)$")
_LINK = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC|N/A)$")

# Legend of `nvidia-smi topo -m`, from the fastest connection to the slowest.
LINK_KINDS = ("NV", "PIX", "PXB", "PHB", "NODE", "SYS")


# `nvidia-smi topo -m` of a node is a few KiB; the topology.conf of a 100,000-node cluster a few MiB.
# Read no more than this (a topology file of /dev/zero used to grow to 4 GB).
MAX_TOPOLOGY_BYTES = 16 << 20


class TopologyParseError(ValueError):
    """The text is not the output it should be; the message says where."""


def read_topology_file(path: str, label: str) -> str:
    """The text of a saved topology file: a regular file of at most MAX_TOPOLOGY_BYTES (ConfigError otherwise)."""
    from hpctrain.userfiles import read_regular_file

    return read_regular_file(path, MAX_TOPOLOGY_BYTES, label).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class GpuTopology:
    """One node's GPUs: pairwise link kinds, NVLink link counts and islands."""

    gpus: tuple[int, ...]
    links: dict[tuple[int, int], str]  # (a, b) -> "NV12", "PIX", ... for a != b
    islands: tuple[tuple[int, ...], ...]  # GPUs that all reach each other over NVLink
    nics: tuple[str, ...] = ()
    numa: dict[int, str] = field(default_factory=dict)

    @property
    def island_size(self) -> int:
        """The smallest island: TP must fit inside every island of every node."""
        return min(len(island) for island in self.islands)

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus": list(self.gpus),
            "islands": [list(island) for island in self.islands],
            "island_size": self.island_size,
            "nvlink_pairs": {f"{a}-{b}": kind for (a, b), kind in sorted(self.links.items())
                             if a < b and kind.startswith("NV")},
            "nics": list(self.nics),
            "numa": {str(gpu): node for gpu, node in sorted(self.numa.items())},
        }


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in _ANSI.sub("", line).rstrip("\n").split("\t")]


def parse_nvidia_smi_topo(text: str) -> GpuTopology:
    """Parse `nvidia-smi topo -m` (tab-separated matrix, any driver's column set)."""
    lines = [line for line in text.splitlines() if line.strip()]
    header_index = next((i for i, line in enumerate(lines) if _cells(line)[0] == "" and "GPU0" in _cells(line)), None)
    if header_index is None:
        raise TopologyParseError("no header row with GPU0 found; expected the output of `nvidia-smi topo -m`")
    header = _cells(lines[header_index])[1:]
    devices = [name for name in header if _GPU.match(name) or name.startswith(("NIC", "mlx", "ib", "eth"))]
    gpus: list[int] = []
    links: dict[tuple[int, int], str] = {}
    numa: dict[int, str] = {}
    numa_column = header.index("NUMA Affinity") if "NUMA Affinity" in header else None
    for line in lines[header_index + 1:]:
        cells = _cells(line)
        match = _GPU.match(cells[0])
        if not match:
            if cells[0].startswith("Legend"):
                break
            continue
        gpu = int(match.group(1))
        values = cells[1:]
        if len(values) < len(devices):
            raise TopologyParseError(f"row GPU{gpu}: {len(values)} cells, expected at least {len(devices)}")
        gpus.append(gpu)
        for name, value in zip(devices, values):
            peer = _GPU.match(name)
            if peer is None:
                continue
            if not _LINK.match(value):
                raise TopologyParseError(f"row GPU{gpu}, column {name}: unknown link {value!r}")
            if int(peer.group(1)) != gpu:
                links[(gpu, int(peer.group(1)))] = value
        if numa_column is not None and numa_column < len(values):
            numa[gpu] = values[numa_column]
    if not gpus:
        raise TopologyParseError("no GPU rows found")
    nics = tuple(_nic_names(text, [d for d in devices if not _GPU.match(d)]))
    return GpuTopology(tuple(gpus), links, nvlink_islands(gpus, links), nics, numa)


def _nic_names(text: str, columns: list[str]) -> list[str]:
    """NIC columns, renamed through the "NIC Legend" (NIC0: mlx5_0) when the driver prints one."""
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)", _ANSI.sub("", text), flags=re.MULTILINE))
    return [legend.get(name, name) for name in columns]


def nvlink_islands(gpus: list[int], links: dict[tuple[int, int], str]) -> tuple[tuple[int, ...], ...]:
    """Partition GPUs into islands whose members are all pairwise NVLink-connected.

    Connected NVLink components that are complete graphs (NVSwitch boxes, bridged pairs) are
    islands as they are; a partial mesh (DGX-1's hybrid cube mesh) is split greedily, lowest GPU
    first, into cliques (its two fully connected quads).
    """
    def nv(a: int, b: int) -> bool:
        return links.get((a, b), "").startswith("NV") and links.get((b, a), links[(a, b)]).startswith("NV")

    remaining = sorted(gpus)
    islands: list[tuple[int, ...]] = []
    while remaining:
        group = [remaining[0]]
        for gpu in remaining[1:]:
            if all(nv(gpu, member) for member in group):
                group.append(gpu)
        islands.append(tuple(group))
        remaining = [gpu for gpu in remaining if gpu not in group]
    return tuple(islands)


@dataclass(frozen=True)
class SwitchTree:
    """A Slurm tree topology: leaf switches with their nodes, and the switch hierarchy."""

    leaves: dict[str, tuple[str, ...]]  # leaf switch -> hostnames
    parents: dict[str, str]  # switch -> the switch above it

    @property
    def max_leaf_nodes(self) -> int:
        return max((len(nodes) for nodes in self.leaves.values()), default=0)

    def to_json(self) -> dict[str, Any]:
        return {"leaves": {name: list(nodes) for name, nodes in self.leaves.items()},
                "parents": dict(self.parents), "max_leaf_nodes": self.max_leaf_nodes}


# Names expanded from all hostlists of one file: 10x cluster.nodes' bound. python-hostlist caps one
# expression at 100,000 names, but a file of many lines would still add up to billions.
MAX_TOPOLOGY_NAMES = 1_000_000


def _expand(expression: str) -> list[str]:
    import hostlist  # python-hostlist: Slurm's own hostlist syntax, e.g. node[001-032,040]

    try:
        return list(hostlist.expand_hostlist(expression))
    except hostlist.BadHostlist as exc:
        raise TopologyParseError(f"bad hostlist {expression[:80]!r}: {exc}") from None


def parse_slurm_topology(text: str) -> SwitchTree:
    """Parse topology.conf (topology/tree: SwitchName=... Nodes=... | Switches=...; also the
    topology/block plugin's BlockName=... Nodes=..., whose blocks act as leaves)."""
    leaves: dict[str, tuple[str, ...]] = {}
    parents: dict[str, str] = {}
    names = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        if names > MAX_TOPOLOGY_NAMES:
            raise TopologyParseError(f"line {number}: the hostlists name more than {MAX_TOPOLOGY_NAMES} nodes and "
                                     "switches; is this the cluster's topology.conf?")
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields: dict[str, str] = {}
        for token in line.split():
            key, sep, value = token.partition("=")
            if not sep:
                raise TopologyParseError(f"line {number}: expected KEY=VALUE, got {token!r}")
            fields[key.lower()] = value
        name = fields.get("switchname") or fields.get("blockname")
        if name is None:
            if "blocksizes" in fields:
                continue
            raise TopologyParseError(f"line {number}: no SwitchName= or BlockName=")
        if "nodes" in fields:
            leaves[name] = tuple(_expand(fields["nodes"]))
            names += len(leaves[name])
        if "switches" in fields:
            children = _expand(fields["switches"])
            names += len(children)
            for child in children:
                parents[child] = name
        if "nodes" not in fields and "switches" not in fields:
            raise TopologyParseError(f"line {number}: switch {name!r} has neither Nodes= nor Switches=")
    if not leaves:
        raise TopologyParseError("no leaf switch (a SwitchName with Nodes=) found")
    return SwitchTree(leaves, parents)
