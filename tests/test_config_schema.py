"""The schema: JSON Schema export, examples, presets, overrides, round trips."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from hpctrain.cli import main
from hpctrain.config import PRESETS, dump_job, job_from_dict, json_schema, load_job
from hpctrain.errors import ConfigError
from hpctrain.config.model import default_ffn_hidden
from hpctrain.resources import data_dir

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(data_dir("examples").glob("*.yaml"))


def test_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"quickstart.yaml", "gpt3-175b.yaml", "llama3-8b-sweep.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(path)]) == 0
    assert "valid" in capsys.readouterr().out


def test_schema_is_valid_json_schema_and_examples_conform() -> None:
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    for path in EXAMPLES:
        jsonschema.Draft202012Validator(schema).validate(yaml.safe_load(path.read_text()))


def test_schema_rejects_what_the_loader_rejects() -> None:
    validator = jsonschema.Draft202012Validator(json_schema())
    base = yaml.safe_load((data_dir("examples") / "quickstart.yaml").read_text())
    for section, key, value in [("parallel", "tp", 0), ("parallel", "zero", 5), ("train", "precision", "bf8"),
                                ("cluster", "nodes", "two"), ("parallel", "tpp", 1)]:
        bad = json.loads(json.dumps(base))
        bad[section][key] = value
        assert list(validator.iter_errors(bad)), (section, key, value)


def test_committed_schema_file_is_current() -> None:
    committed = json.loads((REPO / "job.schema.json").read_text())
    assert committed == json_schema(), "regenerate with: hpctrain schema -o job.schema.json"


def test_schema_command_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "hpctrain job"
    props = schema["properties"]
    for section in ("name", "model", "train", "parallel", "cluster", "slurm", "container", "checkpoint", "nccl",
                    "monitor", "sweep"):
        assert section in props


def test_every_field_has_a_description() -> None:
    schema = json_schema()
    missing = []
    for name, definition in schema["$defs"].items():
        for field, spec in definition.get("properties", {}).items():
            if "description" not in spec:
                missing.append(f"{name}.{field}")
    assert missing == []


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_load_with_overrides(preset: str) -> None:
    job = job_from_dict({"name": "p", "model": {"preset": preset, "seq_len": 512}})
    assert job.model.seq_len == 512
    assert job.model.layers == PRESETS[preset]["layers"]
    assert job.model.hidden % job.model.heads == 0


def test_defaults_filled() -> None:
    job = job_from_dict({"name": "p", "model": {"layers": 2, "hidden": 96, "heads": 6, "vocab": 100,
                                                  "seq_len": 8, "activation": "gelu"}})
    assert job.model.kv_heads == 6 and job.model.ffn_hidden == 384
    assert default_ffn_hidden(4096, "swiglu") == 11008  # Llama 2 7B's figure
    assert job.checkpoint.async_ is False and job.restart.signal == "USR2"


def test_overrides_are_yaml_scalars(tmp_path: Path) -> None:
    path = data_dir("examples") / "quickstart.yaml"
    job = load_job(str(path), ["train.micro_batch=4", "parallel.zero=auto", "slurm.exclusive=false",
                               "train.optimizer.lr=1e-3", "name=hello world"])
    assert job.train.micro_batch == 4 and job.parallel.zero == "auto" and job.slurm.exclusive is False
    assert job.train.optimizer.lr == pytest.approx(1e-3) and job.name == "hello world"


def test_dump_round_trips(tmp_path: Path) -> None:
    for path in EXAMPLES:
        job = load_job(str(path))
        out = tmp_path / "r.yaml"
        out.write_text(dump_job(job))
        assert load_job(str(out)) == job


def test_validate_does_not_import_torch(tmp_path: Path) -> None:
    code = ("import sys; from hpctrain.cli import main; rc = main(['validate', %r]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)" % str(EXAMPLES[0]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


VALIDATE_MODULES_PROBE = """
import os, sys
from hpctrain.cli import main
rc = main(['validate', sys.argv[1]])
print(sorted(m for m in ('importlib.metadata', 'email', 'pydantic.plugin._loader', 'difflib', 'json',
                         'hpctrain.config.hf_weights_check', 'hpctrain.render.recipe', 'secrets', 'hmac', 'shutil')
             if m in sys.modules))
print(os.environ.get('PYDANTIC_DISABLE_PLUGINS'))
from pydantic import BaseModel
class Later(BaseModel):  # a model built after hpctrain's asks the real plugin finder, as without hpctrain
    x: int = 1
from pydantic.plugin import _loader
print(type(_loader).__name__, _loader._plugins is not None)
sys.exit(rc)
"""


@pytest.mark.parametrize(("setting", "example"), [(None, "quickstart.yaml"), ("some_plugin", "quickstart.yaml"),
                                                   (None, "mixtral-8x7b.yaml")])
def test_validate_loads_no_plugin_finder_nor_error_helpers(setting: str | None, example: str) -> None:
    """What issue 23 item 8 took off validate's path stays off for a valid job: pydantic's plugin finder
    (importlib.metadata, email, ...; config/plugins_off.py), difflib and json; a lazy section's models (the MoE
    job's model.moe, config/lazy.py) are built the same way. PYDANTIC_DISABLE_PLUGINS is left as the user set it,
    and a model built afterwards gets pydantic's own finder."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
    if setting is not None:
        env["PYDANTIC_DISABLE_PLUGINS"] = setting
    proc = subprocess.run([sys.executable, "-c", VALIDATE_MODULES_PROBE, str(data_dir("examples") / example)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1:] == ["[]", str(setting), "module True"], proc.stdout


LAZY_SECTIONS = ("hpctrain.config.entrypoint", "hpctrain.config.kubernetes", "hpctrain.config.lora",
                 "hpctrain.config.moe")
LAZY_PROBE = """
import sys
from hpctrain.config import load_job
job = load_job(sys.argv[1])
print(sorted(m for m in %r if m in sys.modules))
""" % (LAZY_SECTIONS,)


@pytest.mark.parametrize(("example", "built"), [
    ("quickstart.yaml", []),
    ("llama3-8b-volcano.yaml", ["hpctrain.config.kubernetes"]),
])
def test_optional_sections_are_built_only_for_a_job_that_has_them(example: str, built: list[str]) -> None:
    """config/lazy.py: a job without kubernetes, entrypoint, model.moe or train.lora does not build their models."""
    proc = subprocess.run([sys.executable, "-c", LAZY_PROBE, str(data_dir("examples") / example)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str(built)], proc.stdout


@pytest.mark.parametrize(("text", "want"), [
    ("kubernetes: {namespace: Bad_NS, bogus: 1}\n",
     ["kubernetes.namespace", "kubernetes.bogus"]),
    ("model: {preset: tiny, moe: {experts: 0}}\n", ["model.moe.experts"]),
    ("train: {lora: {rank: 0}}\n", ["train.lora.rank"]),
    ("entrypoint: {script: 5}\n", ["entrypoint.script"]),
    ("kubernetes: 5\n", ["kubernetes"]),
])
def test_a_lazy_section_reports_its_errors_at_its_keys(tmp_path: Path, text: str, want: list[str]) -> None:
    """Errors inside a section built on first use keep the file line and the dotted path of each key."""
    path = tmp_path / "job.yaml"
    path.write_text("name: x\n" + text)
    with pytest.raises(ConfigError) as exc:
        load_job(str(path))
    located = [line.split(": ", 2)[1] for line in exc.value.problems]
    assert [p for p in located if p in want] == want, exc.value.problems
    assert all(line.startswith(f"{path}:2: ") for line in exc.value.problems if line.split(": ", 2)[1] in want)


def test_yaml_non_printable_pattern_is_compiled_from_its_complement() -> None:
    """config/yaml_source.py: PyYAML's reader gets a pattern that matches the characters its own matches, at the
    same places, over every code point; a job with a control character fails as before."""
    import re

    from hpctrain.config.yaml_source import _YAML_NON_PRINTABLE, NON_PRINTABLE

    every = "".join(map(chr, range(0x110000)))
    theirs = [m.start() for m in re.finditer(_YAML_NON_PRINTABLE, every)]
    assert theirs and [m.start() for m in re.finditer(NON_PRINTABLE, every)] == theirs
    code = "import hpctrain.config, yaml; print(yaml.reader.Reader.NON_PRINTABLE.pattern)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == NON_PRINTABLE, proc.stderr


def test_a_control_character_is_refused_with_pyyamls_words(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: x\x07\n")
    with pytest.raises(ConfigError) as exc:
        load_job(str(path))
    assert exc.value.problems == [f"{path}:1: (document): YAML error: unacceptable character #x0007: special "
                                  "characters are not allowed; fix the file"]


def test_secrets_is_loaded_on_first_use() -> None:
    """config/plugins_off.py: pydantic's `secrets` is a stand-in until used; then it and `import secrets` are real."""
    code = ("import sys, hpctrain.config, pydantic; print('secrets' in sys.modules); "
            "a, b = pydantic.SecretStr('a'), pydantic.SecretStr('b'); print(a == pydantic.SecretStr('a'), a == b); "
            "import secrets; print(len(secrets.token_hex(4)), type(sys.modules['secrets']).__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines() == ["False", "True False", "8 module"], proc.stderr


def test_version_and_help() -> None:
    out = subprocess.run([sys.executable, "-m", "hpctrain", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("hpctrain ")
    out = subprocess.run([sys.executable, "-m", "hpctrain", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "validate" in out.stdout and "schema" in out.stdout


def test_absolute_paths_resolve_against_the_submit_directory() -> None:
    from hpctrain.config.paths import absolute_paths

    job = job_from_dict({"name": "p", "model": {"preset": "tiny"}, "train": {"data": "data/t.bin"},
                         "checkpoint": {"dir": "../ck"}, "container": {"image": "/abs/i.sif"}})
    out = absolute_paths(job, "/home/u/proj")
    assert out.train.data == "/home/u/proj/data/t.bin" and out.checkpoint.dir == "/home/u/ck"
    assert out.container.image == "/abs/i.sif" and out.runs_dir == "/home/u/proj/runs"
    assert absolute_paths(job_from_dict({"name": "p", "model": {"preset": "tiny"}}), "/x").train.data == "synthetic"
