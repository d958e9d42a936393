"""Every input has a size and a range (issue 18, findings 4b and 7): environment names that would change
what runs, numbers past any real job, alias bombs given through --set, infinite floats. Each case:
exit 2, one located line per problem, no traceback, and quickly (the unbounded versions hung).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hpctrain.cli import main
from hpctrain.config import json_schema

from test_config_errors import GOOD  # the same minimal valid job

# A 10-level alias bomb in flow style, small enough for one --set: 10**6 values once expanded.
SET_BOMB = "{" + ", ".join(["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 6)]) + "}"

# Names that change which programs or libraries run: the shell's, the loader's, Python's, and the
# plugin / search-path knobs of the communication libraries themselves.
EXECUTING_NAMES = ["PATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "BASH_ENV", "ENV", "PYTHONPATH", "PYTHONSTARTUP",
                   "IFS", "PS4", "SHELLOPTS", "PROMPT_COMMAND", "GCONV_PATH", "NCCL_NET_PLUGIN",
                   "NCCL_TUNER_PLUGIN", "NCCL_CONF_FILE", "CUDA_INJECTION64_PATH", "OMP_TOOL_LIBRARIES",
                   "UCX_MODULE_DIR", "FI_PROVIDER_PATH", "TORCH_NCCL_X_LIB"]
DATA_NAMES = ["NCCL_DEBUG", "NCCL_IB_GID_INDEX", "UCX_TLS", "FI_PROVIDER", "CUDA_DEVICE_MAX_CONNECTIONS",
              "TORCH_NCCL_BLOCKING_WAIT", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS", "NCCL_TOPO_FILE"]

# (id, extra YAML appended to GOOD, --set overrides, substrings expected in the output)
CASES: list[tuple[str, str, list[str], list[str]]] = [
    *[(f"env-{name}", f"nccl:\n  env:\n    {name}: x\n", [], [f"nccl.env.{name}", "slurm.setup"])
      for name in EXECUTING_NAMES],
    ("env-via-set", "", ["nccl.env.LD_PRELOAD=/tmp/x.so"], ["--set nccl.env.LD_PRELOAD", "slurm.setup"]),
    ("layers-2-70", "", [f"model.layers={2 ** 70}"], ["model.layers", str(2 ** 70)]),
    ("hidden-huge", "", ["model.hidden=1099511627776"], ["model.hidden"]),
    ("seq-len-huge", "", [f"model.seq_len={2 ** 40}"], ["model.seq_len"]),
    ("vocab-huge", "", [f"model.vocab={2 ** 40}"], ["model.vocab"]),
    ("tp-huge", "", [f"parallel.tp={2 ** 40}"], ["parallel.tp", "<= 64"]),
    ("pp-huge", "", [f"parallel.pp={2 ** 40}"], ["parallel.pp"]),
    ("micro-batch-huge", "", [f"train.micro_batch={2 ** 40}"], ["train.micro_batch"]),
    ("global-batch-huge", "", [f"train.global_batch={2 ** 60}"], ["train.global_batch"]),
    ("steps-huge", "", [f"train.steps={2 ** 62}"], ["train.steps"]),
    ("seed-huge", "", [f"train.seed={2 ** 70}"], ["train.seed"]),
    ("lr-inf", "", ["train.optimizer.lr=.inf"], ["train.optimizer.lr", "inf"]),
    ("eps-nan", "", ["train.optimizer.eps=.nan"], ["train.optimizer.eps"]),
    ("rope-inf", "", ["model.rope_theta=1e400"], ["model.rope_theta"]),
    ("time-huge", "slurm:\n  time: 99999999999\n", [], ["slurm.time", "366 days"]),
    ("time-days-huge", "slurm:\n  time: '999999-00:00:00'\n", [], ["slurm.time", "366 days"]),
    ("nsys-steps-huge", f"monitor:\n  nsys_steps: [1, {2 ** 70}]\n", [], ["monitor.nsys_steps.1"]),
    ("gpu-memory-inf", "", ["cluster.gpu_spec={memory_gib: .inf, peak_tflops: 10}"], ["cluster.gpu_spec.memory_gib"]),
    ("rank-order-huge", "", [f"placement.rank_order=[{2 ** 70}]"], ["placement.rank_order.0"]),
    ("stage-layers-shape", "", ["placement.stage_layers=[[0, 1, 2]]"], ["placement.stage_layers.0"]),
    ("setup-too-many", "slurm:\n  setup: [" + ", ".join(["x"] * 1001) + "]\n", [], ["slurm.setup"]),
    ("grid-too-many-keys", "sweep:\n  grid:\n" + "".join(f"    k{i}: [1]\n" for i in range(65)), [], ["sweep.grid"]),
    ("set-alias-bomb-grid", "", [f"sweep.grid={SET_BOMB}"], ["--set sweep.grid=", "sweep.grid.", "alias bomb"]),
    ("set-alias-bomb-name", "", [f"name={SET_BOMB}"], ["--set name=", "alias bomb"]),
    ("set-python-tag", "", ["name=!!python/object/apply:os.system [x]"], ["--set name=", "tag"]),
    ("set-too-deep", "", ["name=" + "[" * 200 + "]" * 200], ["--set name=", "nested"]),
]


def _run(tmp_path: Path, text: str, overrides: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = tmp_path / "t.yaml"
    path.write_text(text, encoding="utf-8")
    code = main(["validate", str(path)] + [f"--set={o}" for o in overrides])
    out = capsys.readouterr()
    return code, (out.out + out.err).replace(str(path), "t.yaml")


@pytest.mark.parametrize("case_id,extra,overrides,expected", CASES, ids=[c[0] for c in CASES])
def test_out_of_range_input_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], case_id: str,
                                       extra: str, overrides: list[str], expected: list[str]) -> None:
    start = time.monotonic()
    code, out = _run(tmp_path, GOOD + extra, overrides, capsys)
    assert time.monotonic() - start < 20, "an unbounded input must be refused before it is used"
    assert code == 2, out
    assert "Traceback" not in out
    for needle in expected:
        assert needle in out, f"{needle!r} not in {out!r}"
    for line in out.strip().splitlines():
        assert line.startswith(("t.yaml:", "--set ")) and "; " in line, line


@pytest.mark.parametrize("name", DATA_NAMES)
def test_communication_settings_are_accepted(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(tmp_path, GOOD + f"nccl:\n  env:\n    {name}: '1'\n", [], capsys)
    assert code == 0, out


def test_alias_bomb_through_set_leaves_no_run_directory(tmp_path: Path) -> None:
    """It used to pass validation, then hang render/sweep/submit at 1.7 GB after creating the run dir."""
    (tmp_path / "t.yaml").write_text(GOOD + f"runs_dir: {tmp_path / 'runs'}\n")
    for command in (["sweep", "--dry-run"], ["submit", "--dry-run"], ["render", "-o", str(tmp_path / "out")]):
        proc = subprocess.run([sys.executable, "-m", "hpctrain", command[0], str(tmp_path / "t.yaml"), *command[1:],
                               f"--set=sweep.grid={SET_BOMB}"], capture_output=True, text=True, timeout=60,
                              cwd=tmp_path)
        assert proc.returncode == 2 and "alias bomb" in proc.stderr and "Traceback" not in proc.stderr, command
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


def _unbounded(node: dict[str, Any], path: str, defs: dict[str, Any], out: list[str]) -> None:
    if "$ref" in node:
        _unbounded(defs[node["$ref"].split("/")[-1]], path, defs, out)
        return
    for sub in node.get("anyOf", []) + node.get("oneOf", []) + node.get("allOf", []):
        _unbounded(sub, path, defs, out)
    kind = node.get("type")
    if "enum" in node or "const" in node:
        return
    if kind in ("integer", "number") and "maximum" not in node and "exclusiveMaximum" not in node:
        out.append(f"{path}: {kind} without a maximum")
    elif kind == "string" and "maxLength" not in node:
        out.append(f"{path}: string without maxLength")
    elif kind == "array":
        if "maxItems" not in node:
            out.append(f"{path}: array without maxItems")
        if isinstance(node.get("items"), dict):
            _unbounded(node["items"], path + "[]", defs, out)
    elif kind == "object":
        for key, sub in node.get("properties", {}).items():
            _unbounded(sub, f"{path}.{key}".lstrip("."), defs, out)
        if isinstance(node.get("additionalProperties"), dict):
            _unbounded(node["additionalProperties"], path + ".*", defs, out)


def test_every_number_string_and_list_of_the_schema_is_bounded() -> None:
    """The class of finding 7: a field without an upper bound is a hang waiting for its value.

    sweep.grid's values are the one exception: each is validated as the field it sets (config/grid.py).
    """
    schema = json_schema()
    found: list[str] = []
    _unbounded(schema, "", schema.get("$defs", {}), found)
    assert found == [], found


# ---- validate refuses what render refuses (issue 18, finding 8) -----------------------------------

RENDER_REFUSED = [
    ("partition", "slurm:\n  partition: 'gpu;rm -rf /'\n", "slurm.partition"),
    ("mem", "slurm:\n  mem: lots\n", "slurm.mem"),
    ("reserved-option", "slurm:\n  extra:\n    nodes: 3\n", "slurm.extra.nodes"),
    ("export-option", "slurm:\n  extra:\n    export: LD_PRELOAD=/tmp/x.so\n", "slurm.extra.export"),
    ("newline-in-extra", "slurm:\n  extra:\n    comment: \"two\\nlines\"\n", "slurm.extra.comment"),
    ("comma-in-bind", "container:\n  image: /img/x.sif\n  binds: ['/data,x']\n", "container.binds"),
]


@pytest.mark.parametrize("case_id,extra,field", RENDER_REFUSED, ids=[c[0] for c in RENDER_REFUSED])
def test_validate_refuses_what_render_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str], case_id: str,
                                              extra: str, field: str) -> None:
    from hpctrain.config import load_job
    from hpctrain.errors import RenderError
    from hpctrain.render import render_script

    code, out = _run(tmp_path, GOOD.replace("executor: local", "executor: slurm") + extra, [], capsys)
    assert code == 2, out
    [line] = out.strip().splitlines()
    assert line.startswith("t.yaml:") and f": {field}: " in line, line
    with pytest.raises(RenderError) as refused:  # the same check, the same words, at render
        render_script(load_job(str(tmp_path / "t.yaml")), run_dir="/runs/x")
    assert line.split(": ", 1)[1] == str(refused.value)
