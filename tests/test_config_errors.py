"""Table-driven bad-input cases for `hpctrain validate`: exit 2, the field path or line, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.cli import main

GOOD = """\
name: ok
model:
  preset: tiny
train:
  global_batch: 8
  micro_batch: 2
parallel:
  tp: 1
  pp: 1
  dp: 2
cluster:
  executor: local
  nodes: 1
  gpus_per_node: 2
  gpu: cpu
"""

BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefg", "bcdefgh")
)

# (id, file text, extra --set overrides, substrings that must appear in the output)
CASES = [
    ("empty-file", "", [], ["t.yaml:1:", "empty"]),
    ("only-comment", "# nothing\n", [], ["t.yaml:1:", "empty"]),
    ("list-document", "- a\n- b\n", [], ["t.yaml:1:", "mapping"]),
    ("scalar-document", "hello\n", [], ["t.yaml:1:", "mapping"]),
    ("syntax-error", "name: x\n  model: {\n", [], ["t.yaml:2:", "YAML syntax error"]),
    ("unclosed-flow", "name: x\nmodel: {preset: tiny\n", [], ["t.yaml:", "YAML syntax error"]),
    ("tab-indent", "name: x\nmodel:\n\tpreset: tiny\n", [], ["t.yaml:3:", "YAML syntax error"]),
    ("duplicate-key", "name: a\nname: b\nmodel: {preset: tiny}\n", [], ["t.yaml:2:", "name", "duplicate key"]),
    ("duplicate-nested", GOOD.replace("  micro_batch: 2\n", "  micro_batch: 2\n  micro_batch: 4\n"), [],
     ["t.yaml:7:", "train.micro_batch", "duplicate"]),
    ("two-documents", "name: a\nmodel: {preset: tiny}\n---\nname: b\n", [], ["t.yaml:", "more than one"]),
    ("alias-bomb", BOMB, [], ["t.yaml:", "alias bomb"]),
    ("non-string-key", GOOD + "1: x\n", [], ["t.yaml:16:", "keys must be strings"]),
    ("binary-tag", GOOD.replace("name: ok", "name: !!binary aGVsbG8="), [], ["t.yaml:1:", "name", "tag"]),
    ("python-tag", GOOD.replace("name: ok", "name: !!python/object:os.system x"), [], ["t.yaml:1:", "tag"]),
    ("merge-key", "base: &b {x: 1}\nname: x\nmodel:\n  <<: *b\n", [], ["t.yaml:4:", "merge keys"]),
    ("missing-name", GOOD.replace("name: ok\n", ""), [], ["name", "is required"]),
    ("missing-model", "name: x\n", [], ["model", "is required"]),
    ("missing-shape", "name: x\nmodel:\n  hidden: 64\n", [], ["model.layers", "required when no preset"]),
    ("unknown-top-key", GOOD + "trian: {}\n", [], ["t.yaml:16:", "trian", "did you mean 'train'"]),
    ("unknown-nested-key", GOOD.replace("  micro_batch: 2", "  micro_bach: 2"), [],
     ["t.yaml:6:", "train.micro_bach", "did you mean 'micro_batch'"]),
    ("unknown-preset", GOOD.replace("preset: tiny", "preset: llama3-9b"), [],
     ["t.yaml:3:", "model.preset", "llama3-8b"]),
    ("bad-precision", GOOD, ["train.precision=bf8"], ["--set train.precision=bf8", "train.precision", "'bf16'"]),
    ("bad-activation", GOOD.replace("preset: tiny", "preset: tiny\n  activation: relu"), [],
     ["t.yaml:4:", "model.activation", "gelu"]),
    ("negative-layers", GOOD.replace("preset: tiny", "preset: tiny\n  layers: -2"), [],
     ["t.yaml:4:", "model.layers", "-2"]),
    ("zero-hidden", GOOD.replace("preset: tiny", "preset: tiny\n  hidden: 0"), [], ["model.hidden", "(got 0)"]),
    ("string-layers", GOOD.replace("preset: tiny", "preset: tiny\n  layers: four"), [],
     ["t.yaml:4:", "model.layers", "'four'"]),
    ("float-layers", GOOD.replace("preset: tiny", "preset: tiny\n  layers: 2.5"), [], ["model.layers", "2.5"]),
    ("bool-for-int", GOOD.replace("  micro_batch: 2", "  micro_batch: true"), [], ["t.yaml:6:", "train.micro_batch"]),
    ("micro-batch-zero", GOOD.replace("  micro_batch: 2", "  micro_batch: 0"), [], ["t.yaml:6:", "train.micro_batch"]),
    ("micro-batch-word", GOOD.replace("  micro_batch: 2", "  micro_batch: automatic"), [],
     ["t.yaml:6:", "'automatic'", "auto"]),
    ("heads-kv-heads", GOOD.replace("preset: tiny", "preset: tiny\n  kv_heads: 3"), [],
     ["t.yaml:4:", "model.kv_heads", "must divide"]),
    ("hidden-heads", GOOD.replace("preset: tiny", "preset: tiny\n  hidden: 66"), [], ["model.hidden", "divisible"]),
    ("tp-over-node", GOOD, ["parallel.tp=4", "parallel.dp=1", "cluster.gpus_per_node=2"],
     ["--set parallel.tp=4", "parallel.tp", "gpus_per_node"]),
    ("tp-not-dividing-heads", GOOD, ["parallel.tp=3", "cluster.gpus_per_node=8", "parallel.dp=auto"],
     ["parallel.tp", "must divide model.heads"]),
    ("degrees-vs-world", GOOD, ["parallel.dp=4"], ["parallel", "tp*pp*dp = 4", "2 GPUs"]),
    ("batch-not-divisible", GOOD, ["train.global_batch=7"], ["--set train.global_batch=7", "divisible"]),
    ("pp-over-layers", GOOD, ["parallel.pp=8", "parallel.dp=auto", "cluster.gpus_per_node=8"],
     ["parallel.pp", "model.layers=4"]),
    ("virtual-stages-schedule", GOOD, ["parallel.virtual_stages=2", "parallel.schedule=1f1b"],
     ["parallel.virtual_stages", "interleaved-1f1b"]),
    ("bad-schedule", GOOD, ["parallel.schedule=zigzag"], ["--set parallel.schedule=zigzag", "1f1b"]),
    ("ep-without-moe", GOOD, ["parallel.ep=2"], ["parallel.ep", "needs model.moe"]),
    ("ep-not-dividing-experts", GOOD, ["parallel.ep=2", "model.preset=mixtral-8x7b", "model.moe.experts=3",
                                       "model.moe.top_k=1"], ["parallel.ep", "must divide model.moe.experts=3"]),
    ("ep-not-dividing-dp", GOOD, ["parallel.ep=4", "model.preset=mixtral-8x7b"],
     ["parallel.ep", "must divide parallel.dp x parallel.tp = 2", "multiple of 4"]),
    ("moe-tp-without-sequence-parallel", GOOD, ["model.preset=mixtral-8x7b", "parallel.tp=2", "parallel.dp=1",
                                                "parallel.ep=2"],
     ["parallel.sequence_parallel", "parallel.tp=2", "set parallel.sequence_parallel: true"]),
    ("moe-ep-not-multiple-of-tp", GOOD, ["model.preset=mixtral-8x7b", "parallel.tp=2", "parallel.dp=1",
                                         "parallel.sequence_parallel=true"],
     ["parallel.ep", "multiple of parallel.tp=2", "set parallel.ep to a multiple of 2"]),
    ("cp-seq-len", GOOD, ["parallel.cp=2", "parallel.dp=1", "model.seq_len=30"],
     ["model.seq_len", "(got 30)", "multiple of 2 x parallel.cp = 4"]),
    ("cp-sp-seq-len", GOOD, ["parallel.cp=2", "parallel.dp=1", "parallel.tp=4", "parallel.sequence_parallel=true",
                             "model.seq_len=20", "cluster.gpus_per_node=8"],
     ["model.seq_len", "seq_len / cp = 10", "parallel.tp=4"]),
    ("cp-degrees-vs-world", GOOD, ["parallel.cp=2"], ["parallel", "tp*pp*dp*cp = 4", "2 GPUs", "cp=2"]),
    # cp with ep is allowed (ep borrows from dp x cp x tp); an ep that does not divide them is not.
    ("cp-with-ep-too-large", GOOD, ["parallel.ep=8", "parallel.cp=2", "parallel.dp=1", "model.preset=mixtral-8x7b"],
     ["parallel.ep", "(got 8)", "parallel.dp x parallel.cp x parallel.tp = 2", "use a divisor of 2"]),
    ("bad-zero", GOOD, ["parallel.zero=4"], ["parallel.zero", "(got 4)"]),
    ("seq-parallel-tp1", GOOD, ["parallel.sequence_parallel=true"], ["parallel.sequence_parallel", "tp > 1"]),
    ("compile-with-tp", GOOD, ["train.compile=true", "parallel.tp=2", "parallel.dp=1"],
     ["train.compile", "tensor parallel", "parallel.tp=2", "set train.compile: false"]),
    ("bad-executor", GOOD.replace("executor: local", "executor: kubernetes"), [],
     ["t.yaml:12:", "cluster.executor", "'kubernetes'"]),
    ("nodes-zero", GOOD.replace("nodes: 1", "nodes: 0"), [], ["t.yaml:13:", "cluster.nodes"]),
    ("bad-time", GOOD + "slurm:\n  time: 4 hours\n", [], ["t.yaml:17:", "slurm.time", "04:00:00"]),
    ("bad-time-minutes", GOOD + "slurm:\n  time: '01:99:00'\n", [], ["t.yaml:17:", "slurm.time"]),
    ("bad-signal", GOOD + "slurm:\n  signal: KILL\n", [], ["t.yaml:17:", "slurm.signal", "USR2"]),
    ("signal-seconds-low", GOOD + "slurm:\n  signal_seconds: 1\n", [], ["slurm.signal_seconds"]),
    ("setup-not-list", GOOD + "slurm:\n  setup: module load cuda\n", [], ["t.yaml:17:", "slurm.setup", "list"]),
    ("extra-bad-option", GOOD + "slurm:\n  extra:\n    --mail-type: END\n", [], ["slurm.extra", "option"]),
    ("nccl-bad-env-name", GOOD + "nccl:\n  env:\n    1BAD: x\n", [], ["nccl.env", "environment variable"]),
    ("nccl-bad-profile", GOOD + "nccl:\n  profile: infiniband\n", [], ["t.yaml:17:", "nccl.profile"]),
    ("container-not-sif", GOOD + "container:\n  image: /img/pytorch.tar\n", [], ["container.image", ".sif"]),
    ("checkpoint-every-zero", GOOD + "checkpoint:\n  every_steps: 0\n", [], ["t.yaml:17:", "checkpoint.every_steps"]),
    ("checkpoint-async-type", GOOD + "checkpoint:\n  async: sometimes\n", [], ["checkpoint.async"]),
    ("betas-length", GOOD, ["train.optimizer.betas=[0.9]"], ["train.optimizer.betas", "at least 2"]),
    ("betas-range", GOOD, ["train.optimizer.betas=[0.9, 1.5]"], ["train.optimizer.betas.1", "(got 1.5)"]),
    ("lr-negative", GOOD, ["train.optimizer.lr=-0.1"], ["train.optimizer.lr", "-0.1"]),
    ("warmup-over-steps", GOOD, ["train.steps=10", "train.lr_schedule.warmup_steps=20"],
     ["train.lr_schedule.warmup_steps", "below train.steps=10"]),
    ("set-unknown-key", GOOD, ["cluster.gpus_per_nod=3"], ["--set cluster.gpus_per_nod=3", "gpus_per_node"]),
    ("set-no-equals", GOOD, ["parallel.tp"], ["--set parallel.tp", "KEY=VALUE"]),
    ("set-into-scalar", GOOD, ["name.first=x"], ["--set name.first=x", "not a section"]),
    ("sweep-empty-grid", GOOD + "sweep:\n  grid: {}\n", [], ["sweep.grid"]),
    ("name-empty", GOOD.replace("name: ok", "name: ''"), [], ["t.yaml:1:", "name", "empty"]),
    ("name-nul", GOOD.replace("name: ok", 'name: "a\\0b"'), [], ["t.yaml:1:", "NUL"]),
    # Deeper than libyaml's own limit (1000 levels in PyYAML 6.0.4): our message must still be the one shown.
    ("deep-nesting", "name: " + "[" * 3000 + "]" * 3000 + "\n", [], ["t.yaml:1:", "nested more than 64 levels"]),
    ("deep-block-nesting", "".join(" " * i + "a:\n" for i in range(1100)), [],
     ["t.yaml:", "nested more than 64 levels"]),
    ("set-new-nested-key", GOOD, ["model.x.y=1"], ["--set model.x.y=1", "model.x", "unknown key"]),
    ("unknown-gpu", GOOD.replace("gpu: cpu", "gpu: a100-80g"), [], ["cluster.gpu", "a100-80gb"]),
    ("monitor-nsys-steps", GOOD + "monitor:\n  nsys_steps: [5, 2]\n", [], ["monitor.nsys_steps"]),
    ("lora-unknown-target", GOOD, ["train.lora.targets=[q_proj, wx]"],
     ["train.lora.targets", "'wx' is not a projection", "gate_proj"]),
    ("lora-rank-zero", GOOD, ["train.lora.rank=0"], ["train.lora.rank", "greater than or equal to 1"]),
    ("lora-dropout-one", GOOD, ["train.lora.dropout=1.0"], ["train.lora.dropout", "less than 1"]),
    ("lora-w3-gelu", GOOD.replace("preset: tiny", "preset: tiny\n  activation: gelu"), ["train.lora.targets=[w3]"],
     ["train.lora.targets", "swiglu"]),
]


def _run(tmp_path: Path, text: str, overrides: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = tmp_path / "t.yaml"
    path.write_text(text, encoding="utf-8")
    argv = ["validate", str(path)] + [f"--set={o}" for o in overrides]
    code = main(argv)
    out = capsys.readouterr()
    return code, (out.out + out.err).replace(str(path), "t.yaml")


def test_good_file_is_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(tmp_path, GOOD, [], capsys)
    assert code == 0, out
    assert "valid" in out


def test_there_are_at_least_forty_cases() -> None:
    assert len({case[0] for case in CASES}) >= 40


@pytest.mark.parametrize("case_id,text,overrides,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str], case_id: str, text: str,
                   overrides: list[str], expected: list[str]) -> None:
    code, out = _run(tmp_path, text, overrides, capsys)
    assert code == 2, out
    assert "Traceback" not in out
    for needle in expected:
        assert needle in out, f"{needle!r} not in {out!r}"
    for line in out.strip().splitlines():  # every line: LOCATION: path: message; fix
        assert line.startswith(("t.yaml:", "--set ")), line
        assert "; " in line, line


def test_huge_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(tmp_path, GOOD + "# " + "x" * (2 << 20) + "\n", [], capsys)
    assert code == 2 and "larger than" in out and "t.yaml:1:" in out


def test_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.yaml"
    path.write_bytes(GOOD.encode() + b"x: \xff\xfe\n")
    code = main(["validate", str(path)])
    out = capsys.readouterr().err
    assert code == 2 and ":16:" in out and "UTF-8" in out


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["validate", str(tmp_path / "nope.yaml")])
    assert code == 2 and "cannot read" in capsys.readouterr().err


def test_every_problem_is_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = GOOD.replace("preset: tiny", "preset: tiny\n  layers: x\n  hiden: 3").replace("nodes: 1", "nodes: -1")
    code, out = _run(tmp_path, text, [], capsys)
    assert code == 2
    assert [line.split(":")[1] for line in out.strip().splitlines()] == ["4", "5", "15"]


def test_valid_files_are_reported_beside_bad_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.yaml").write_text("name: x\n")
    (tmp_path / "good.yaml").write_text(GOOD)
    assert main(["validate", str(tmp_path / "bad.yaml"), str(tmp_path / "good.yaml")]) == 2
    out = capsys.readouterr()
    assert "good.yaml: valid" in out.out and "bad.yaml:" in out.err


def test_subprocess_exit_code_and_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(BOMB)
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "validate", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "alias bomb" in proc.stderr


def test_validate_reports_a_typo_and_the_layout_problems_together(tmp_path: Path, capsys) -> None:
    """A key typo no longer hides the cross-field (layout) problems: one `validate` lists both, by line."""
    path = tmp_path / "t.yaml"
    path.write_text(GOOD.replace("  micro_batch: 2\n", "  micro_batch: 2\n  stpes: 3\n").replace("tp: 1", "tp: 3"))
    assert main(["validate", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == f"{path}:7: train.stpes: unknown key (got 3); did you mean 'steps'?", lines
    assert f"{path}:9: parallel.tp: must divide model.heads=4 (got 3); use a divisor of heads" in lines[1:], lines
