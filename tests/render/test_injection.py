"""Injection: a hostile string in every free-text field at once, the rendered script executed for real.

For each string (tests/render/hostile.py) the script runs under bash with stub srun, scontrol,
singularity, nsys, nvidia-smi, py-spy, sleep, pgrep and python3 on PATH. It must run nothing the user
did not write (only the setup line's `user-setup`, never `pwned`), and every value must arrive
byte-for-byte: in argv (binds, image, run directory), in the runtime's environment (NCCL values), on
stdout (the name) and, read back the way sbatch reads them, on the #SBATCH lines.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpctrain.config import job_from_dict
from hpctrain.errors import RenderError
from hpctrain.render import render_recipe, render_script
from hpctrain.render.context import NVIDIA_SMI_FIELDS
from hpctrain.render.quoting import slurm_job_name
from .hostile import HOSTILE, hostile_job, hostile_run_dir, sbatch_safe
from .sbatch_parser import option_values
from .stubs import make_stub_dir, run_script


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_stub_dir(tmp_path_factory.mktemp("stubs"))


def test_there_are_enough_hostile_strings() -> None:
    assert len(HOSTILE) >= 25 and len(set(HOSTILE)) == len(HOSTILE)


def _render(value: str, root: Path) -> tuple[str, str]:
    run_dir = hostile_run_dir(root, value)
    Path(run_dir).mkdir(parents=True)
    job = job_from_dict(hostile_job(value, cover=str(root)))
    return render_script(job, run_dir=run_dir), run_dir


def _expected_rank_command(value: str, run_dir: str, cover: str) -> list[str]:
    binds = [f"--bind={value}"] if "," not in value else []
    return ["exec", "--nv", *binds, f"--bind={cover}", "--", value + ".sif",
            "nsys", "profile", "--trace=cuda,nvtx,osrt", "--capture-range=cudaProfilerApi",
            "--capture-range-end=stop", "--force-overwrite=true",
            f"--output={run_dir.replace('%', '%%')}/nsys-rank-%q{{SLURM_PROCID}}",
            "python3", "-m", "hpctrain.runtime", f"--job={run_dir}/job.resolved.yaml", f"--run-dir={run_dir}"]


@pytest.mark.parametrize("value", HOSTILE, ids=[f"h{i:02d}" for i in range(len(HOSTILE))])
def test_hostile_value_runs_nothing_and_arrives_intact(value: str, tmp_path: Path, bin_dir: Path) -> None:
    script, run_dir = _render(value, tmp_path)
    run = run_script(script, bin_dir=bin_dir, work=tmp_path, env={"STUB_WAIT_FOR": "py-spy nvidia-smi"})
    assert run.returncode == 0, run.stderr.decode(errors="replace")[-2000:]
    # Nothing ran that the user did not write: exactly these programs, once each (srun: 3 steps; scontrol:
    # the host names, then the first one's NodeAddr).
    assert not (run.log / "PWNED").exists() and "pwned" not in run.programs
    assert run.programs == sorted(["user-setup", "scontrol", "scontrol", "srun", "srun", "srun", "nvidia-smi",
                                   "sleep", "pgrep", "py-spy", "singularity", "nsys", "python3"])
    assert run.argv_of("user-setup") == [["arg one"]]
    assert run.argv_of("scontrol") == [["show", "hostnames", "node[1-2]"], ["-o", "show", "node", "node1"]]
    # argv carries every value byte-for-byte.
    assert run.argv_of("singularity") == [_expected_rank_command(value, run_dir, str(tmp_path))]
    assert run.argv_of("python3") == [_expected_rank_command(value, run_dir, str(tmp_path))[-4:]]
    assert run.argv_of("nvidia-smi") == [[f"--query-gpu={NVIDIA_SMI_FIELDS}", "--format=csv", "-l", "5"]]
    assert run.argv_of("py-spy") == [["dump", "--pid", "12345"]]
    [ranks] = [argv for argv in run.argv_of("srun") if "--kill-on-bad-exit=1" in argv]
    rank_log = f"{run_dir.replace('%', '%%')}/logs/task-%t.attempt-0.log"  # srun's pattern keeps a % as %%
    assert f"--output={rank_log}" in ranks and f"--error={rank_log}" in ranks
    assert (Path(run_dir) / "logs").is_dir()
    assert run.argv_of("sleep") == [[str(3600 - 60)]]
    assert list(Path(run_dir).glob("nvidia-smi-*.csv")) and list(Path(run_dir).glob("py-spy-*.txt"))
    # The environment the ranks see.
    env = run.runtime_env
    for name in ("NCCL_HPCT_TEST_ENV", "NCCL_ALGO", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"):
        assert env[name] == value, name
    assert env["HPCTRAIN_REQUEUE_MARKER"] == f"{run_dir}/requeue-requested"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{run_dir}/nccl-flight-recorder-rank-"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["OMP_NUM_THREADS"] == "8"
    # The name, printed by the script.
    assert f"hpctrain: job {value}, attempt 0, nodes node[1-2]\n".encode() in run.stdout
    # The #SBATCH lines, read as sbatch reads them.
    options = option_values(script)
    assert options["--job-name"] == slurm_job_name(value)
    assert options["--output"] == run_dir.replace("%", "%%") + "/slurm-%j.out"
    if sbatch_safe(value):
        assert options["--comment"] == value


def test_hostile_scripts_pass_shellcheck(tmp_path: Path) -> None:
    """All hostile renders at once through `bash -n` and shellcheck (every check, style included)."""
    paths = []
    for i, value in enumerate(HOSTILE):
        script, _ = _render(value, tmp_path / f"h{i:02d}")
        path = tmp_path / f"h{i:02d}.sbatch"
        path.write_text(script)
        paths.append(str(path))
        syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
        assert syntax.returncode == 0, syntax.stderr
    # shellcheck takes ~0.1 s a file: one process per CPU, each on a share of the files.
    shares = max(1, min(len(paths), os.cpu_count() or 1))
    checks = [subprocess.Popen(["shellcheck", "--severity=style", *paths[i::shares]], stdout=subprocess.PIPE,
                               text=True) for i in range(shares)]
    for check in checks:
        out, _ = check.communicate(timeout=120)
        assert check.returncode == 0, out[-4000:]


@pytest.mark.parametrize("value", [v for v in HOSTILE if not sbatch_safe(v)])
def test_sbatch_fields_refuse_control_characters(value: str) -> None:
    """A newline cannot be carried on a #SBATCH line: refused with the field named, never written."""
    job = hostile_job("ok", cover="/data")
    job["slurm"]["extra"] = {"comment": value}
    with pytest.raises(RenderError, match=r"slurm\.extra\.comment: a #SBATCH line cannot carry control"):
        render_script(job_from_dict(job), run_dir="/runs/x")
    with pytest.raises(RenderError, match=r"run directory: a #SBATCH line cannot carry control"):
        render_script(job_from_dict(hostile_job("ok", cover="/")), run_dir="/runs/" + value)


def test_binds_refuse_commas() -> None:
    job = hostile_job("a,b", cover="/data")
    job["container"]["binds"] = ["/a,/b"]
    with pytest.raises(RenderError, match=r"container\.binds: singularity splits --bind values on ','"):
        render_script(job_from_dict(job), run_dir="/data/run")


@pytest.mark.parametrize("field", ["partition", "account", "qos", "constraint", "mem"])
def test_identifier_fields_refuse_hostile_values(field: str) -> None:
    """Partition, account, qos, constraint and mem are identifiers: a hostile value is refused, named."""
    for value in HOSTILE[:12]:
        job = hostile_job("ok", cover="/data")
        job["slurm"][field] = value
        with pytest.raises(RenderError, match=rf"slurm\.{field}: not a valid --{field} value"):
            render_script(job_from_dict(job), run_dir="/data/run")


def test_hostile_pip_packages_reach_pip_intact(tmp_path: Path, bin_dir: Path) -> None:
    """The recipe's %post runs under sh with a stub python3: each pip value is one argument, unchanged."""
    packages = [value for value in HOSTILE if sbatch_safe(value)]
    job = hostile_job("ok", cover="/data")
    job["container"]["recipe"]["pip"] = packages
    recipe = render_recipe(job_from_dict(job))
    post = recipe.split("\n%post\n", 1)[1].split("\n%", 1)[0]
    (tmp_path / "post.sh").write_text(post)
    result = subprocess.run(["sh", "-n", str(tmp_path / "post.sh")], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    run = run_script(post, bin_dir=bin_dir, work=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.argv_of("python3") == [["-m", "pip", "install", "--no-cache-dir", "--", "/opt/hpctrain-src", *packages]]
    assert "pwned" not in run.programs


@pytest.mark.parametrize("value", [v for v in HOSTILE if not sbatch_safe(v)])
def test_recipe_refuses_values_spanning_lines(value: str) -> None:
    """A newline in a pip requirement could open a recipe section of its own (%runscript ...): refused."""
    job = hostile_job("ok", cover="/data")
    job["container"]["recipe"]["pip"] = [f"{value}\n%runscript\npwned"]
    with pytest.raises(RenderError, match=r"container\.recipe\.pip: a recipe line cannot carry control"):
        render_recipe(job_from_dict(job))


def test_sbatch_directives_in_values_are_never_read(tmp_path: Path) -> None:
    """A value that spells an #SBATCH line sits below the first command, where sbatch stops reading."""
    value = "x\n#SBATCH --uid=0\n#SBATCH --wrap=pwned"
    script, _ = _render(value, tmp_path)
    assert "\n#SBATCH --uid=0" in script
    options = option_values(script)
    assert "--uid" not in options and "--wrap" not in options
