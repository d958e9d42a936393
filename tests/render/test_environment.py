"""The Jinja2 environment's rules: StrictUndefined, one quoting filter, nothing printed raw; templates
are scanned so that every `{{ ... }}` goes through `q` (or is one of the typed, pre-checked lines);
user template folders override the shipped templates and obey the same rules.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from hpctrain.config import job_from_dict
from hpctrain.errors import RenderError
from hpctrain.render import render_recipe, render_script
from hpctrain.render.environment import render_template, shipped_dirs
from hpctrain.render.quoting import sbatch_escape, sbatch_line, shell_quote, slurm_job_name

from .hostile import BASE_JOB, HOSTILE, sbatch_safe
from .sbatch_parser import split_directive

# Names bound to typed, pre-checked values (quoting.py): #SBATCH arguments, comment lines, setup lines.
TYPED_NAMES = {"line"}
EXPRESSION = re.compile(r"{{-?(.*?)-?}}", re.S)


def _templates() -> list[Path]:
    return sorted(p for d in shipped_dirs() for p in d.glob("*.j2"))


def test_every_shipped_expression_is_quoted_or_typed() -> None:
    assert {p.name for p in _templates()} >= {"job.sbatch.j2", "recipe.def.j2"}
    for path in _templates():
        for expr in EXPRESSION.findall(path.read_text()):
            expr = expr.strip()
            assert expr.endswith("| q") or expr in TYPED_NAMES, f"{path.name}: {{{{ {expr} }}}} is not quoted"


def test_no_interpolation_inside_double_quotes_or_heredocs() -> None:
    """q's single quotes would be literal inside "..." and in an unquoted heredoc: keep them out of both."""
    for path in _templates():
        text = path.read_text()
        for number, line in enumerate(text.splitlines(), 1):
            for match in re.finditer(r"{{", line):
                before = line[:match.start()].replace('\\"', "")
                assert before.count('"') % 2 == 0, f"{path.name}:{number}: {{{{ inside double quotes"
        for heredoc in re.findall(r"<<-?\s*(['\"]?)\w+\1", text):
            assert heredoc, f"{path.name}: an unquoted heredoc expands $ and ` in what it carries"


@pytest.mark.parametrize("value", HOSTILE)
def test_q_is_read_back_by_the_shell_as_one_word(value: str) -> None:
    assert shlex.split(shell_quote(value)) == [value]


def test_q_refuses_what_it_cannot_quote() -> None:
    assert shell_quote(7) == "7" and shell_quote(shell_quote("a b")) == "'a b'"
    for bad in (None, True, 1.5, ["a"]):
        with pytest.raises(RenderError, match="the q filter quotes strings and integers only"):
            shell_quote(bad)


def _user_dir(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize("body", ["{{ name }}", "{{ run_dir }}", "{{ 'literal' }}", "{{ nodes }}", "{{ name ~ '' }}"])
def test_printing_without_q_is_refused_with_the_template_line(body: str, tmp_path: Path) -> None:
    user = _user_dir(tmp_path, "job.sbatch.j2", "#!/bin/bash\n\necho " + body + "\n")
    with pytest.raises(RenderError, match=r"job\.sbatch\.j2:3: a template prints .* without the shell-quoting filter"):
        render_script(job_from_dict(BASE_JOB), run_dir="/runs/x", template_dir=user)


def test_undefined_names_are_errors(tmp_path: Path) -> None:
    user = _user_dir(tmp_path, "job.sbatch.j2", "echo {{ no_such_value | q }}\n")
    with pytest.raises(RenderError, match=r"UndefinedError: 'no_such_value' is undefined"):
        render_script(job_from_dict(BASE_JOB), run_dir="/runs/x", template_dir=user)


def test_user_partial_overrides_the_shipped_one(tmp_path: Path) -> None:
    user = _user_dir(tmp_path, "monitors.sh.j2", "# site monitors for {{ nodes | q }} nodes\n")
    script = render_script(job_from_dict(BASE_JOB), run_dir="/runs/x", template_dir=user)
    assert "# site monitors for 2 nodes\n" in script and "nvidia-smi" not in script
    assert "srun --kill-on-bad-exit=1" in script  # the rest is the shipped template


def test_user_template_dir_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    user = _user_dir(tmp_path, "recipe.def.j2", "Bootstrap: {{ bootstrap | q }}\nFrom: {{ source | q }}\n")
    monkeypatch.setenv("HPCTRAIN_TEMPLATE_DIR", user)
    assert render_recipe(job_from_dict(BASE_JOB)).startswith("Bootstrap: docker\nFrom: nvcr.io/nvidia/pytorch:")
    monkeypatch.setenv("HPCTRAIN_TEMPLATE_DIR", str(tmp_path / "missing"))
    with pytest.raises(RenderError, match="template_dir: not a folder"):
        render_recipe(job_from_dict(BASE_JOB))


def test_setup_lines_are_shell_by_design(tmp_path: Path) -> None:
    data = dict(BASE_JOB, slurm={"setup": ["module load cuda/12.4", 'export X="$(date)"']})
    script = render_script(job_from_dict(data), run_dir="/runs/x")
    assert "\nmodule load cuda/12.4\nexport X=\"$(date)\"\n" in script
    assert "shell by design" in script


# ---- #SBATCH values -------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [v for v in HOSTILE if sbatch_safe(v)])
def test_sbatch_escape_reads_back_byte_for_byte(value: str) -> None:
    line = sbatch_line("comment", value)
    assert split_directive(" " + line) == [f"--comment={value}"]
    assert "hetjob" not in line.lower() and "packjob" not in line.lower()


@pytest.mark.parametrize(("value", "written"), [
    ("batch", "batch"), ("gpu,debug", "gpu,debug"), ("50%", "50%"), ("a b", '"a b"'), ('a"b', '"a\\"b"'),
    ("a\\b", '"a\\\\b"'), ("#x", '"#x"'), ("HetJob", '"Het\\Job"'), ("é", '"é"'),
])
def test_sbatch_escape_table(value: str, written: str) -> None:
    assert sbatch_escape(value, "f") == written


@pytest.mark.parametrize(("name", "label"), [
    ("gpt3-175b", "gpt3-175b"), ("my run #2", "my_run__2"), ("a|b\nc", "a_b_c"), ("x hetjob", "x_het_job"),
    ("PackJob", "Pack_Job"), ("ünï", "_n_"), ("n" * 300, "n" * 128),
])
def test_slurm_job_name_is_a_safe_label(name: str, label: str) -> None:
    assert slurm_job_name(name) == label


def test_script_is_plain_bash_that_parses(tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(render_script(job_from_dict(BASE_JOB), run_dir="/runs/x"))
    assert subprocess.run(["bash", "-n", str(path)], check=False).returncode == 0


def test_render_template_wraps_template_syntax_errors(tmp_path: Path) -> None:
    user = _user_dir(tmp_path, "job.sbatch.j2", "{% if %}\n")
    with pytest.raises(RenderError, match="TemplateSyntaxError"):
        render_template("job.sbatch.j2", {}, user)


# ---- user templates are data: the sandbox (issue 18, finding 4a) ----------------------------------

# Each payload would create MARKER if it ran: through Jinja's own globals, through a value of the
# context, through str's class tree, or by mutating a context list.
SANDBOX_PAYLOADS = [
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') | q }}",
    "{{ lipsum.__globals__['os'].system('touch MARKER') | q }}",
    "{{ sbatch_lines[0].__class__.__init__.__globals__['os'].system('touch MARKER') | q }}",
    "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'Popen' %}"
    "{{ c(['touch', 'MARKER']).wait() | q }}{% endif %}{% endfor %}",
    "{{ setup_lines.append('touch MARKER') | q }}{{ setup_lines[0] }}",
]


@pytest.mark.parametrize("payload", SANDBOX_PAYLOADS, ids=range(len(SANDBOX_PAYLOADS)))
def test_user_template_cannot_run_code(payload: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.cli import main

    marker = tmp_path / "PWNED"
    (tmp_path / "tpl").mkdir()
    user = _user_dir(tmp_path / "tpl", "job.sbatch.j2", "#!/bin/bash\n" + payload.replace("MARKER", str(marker)) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text("name: t\nmodel: {preset: tiny}\nparallel: {tp: 1, pp: 1, dp: 2}\n"
                   "cluster: {nodes: 1, gpus_per_node: 2, gpu: cpu}\ntrain: {micro_batch: 1}\n")
    monkeypatch.chdir(tmp_path)
    code = main(["render", str(job), "--template-dir", user, "--stdout"])
    err = capsys.readouterr().err
    assert not marker.exists()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("job.sbatch.j2:2: ")
    # lipsum is no longer a global at all (undefined); every other payload reaches the sandbox's wall
    assert "reaches outside the values it is given" in err or "'lipsum' is undefined" in err, err


def test_user_template_size_is_bounded(tmp_path: Path) -> None:
    """Issue 18, finding 7 (every input bounded): a template is read whole, so its size is checked first."""
    with open(tmp_path / "job.sbatch.j2", "wb") as handle:
        handle.truncate(2 << 20)  # sparse: 2 MiB without writing them
    with pytest.raises(RenderError, match=r"job\.sbatch\.j2: template larger than 1048576 bytes"):
        render_script(job_from_dict(BASE_JOB), run_dir="/runs/x", template_dir=str(tmp_path))
