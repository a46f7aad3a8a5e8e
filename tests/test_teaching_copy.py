"""A copy that runs alone, as docs/copying.md tells a teacher to make one: the trainers and the files they load on
start (benchmarks/core_lines.py), with prompts/ and profiles/, and none of the backends' files (vLLM, the LLM users,
their chat client, the released prompts). It trains a GRPO step and a PPO step on the tiny model, so the default path
imports no backend, and the documented list of files is the one the scripts load."""
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

_spec = importlib.util.spec_from_file_location("core_lines", REPO / "benchmarks" / "core_lines.py")
core_lines = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(core_lines)


def documented_files() -> set[str]:
    """The files docs/copying.md lists for a copy of both trainers."""
    text = (REPO / "docs" / "copying.md").read_text()
    section = text.split("## The files", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(\w+\.py)`", section))


def test_the_documented_files_are_what_the_trainers_load_on_start():
    loaded = {name for script in ("train_grpo.py", "train_ppo.py") for name in core_lines.reached(script, lazy=False)}
    assert documented_files() == loaded


@pytest.mark.slow
def test_a_copy_of_the_documented_files_trains_a_grpo_step_and_a_ppo_step(tiny_model_dir, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in documented_files():
        shutil.copy(REPO / name, copy)
    for folder in ("prompts", "profiles"):
        shutil.copytree(REPO / folder, copy / folder)
    small = ["--model_name_or_path", str(tiny_model_dir), "--max_steps", "1", "--max_turns", "2",
             "--max_reply_tokens", "6", "--think", "--max_think_tokens", "4"]
    commands = {"train_grpo.py": ["--num_generations", "2", "--per_device_train_batch_size", "4"],
                "train_ppo.py": ["--profiles_per_step", "2", "--dialogues_per_profile", "2"]}
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # nothing of the repository's
    for script, flags in commands.items():
        out = tmp_path / script.removesuffix(".py")
        finished = subprocess.run([sys.executable, script, "--output_dir", str(out), *small, *flags], cwd=copy,
                                  capture_output=True, text=True, timeout=300, env=env)
        assert finished.returncode == 0, finished.stderr[-3000:]
        assert (out / "transcripts.jsonl").read_text().count("\n") == 4
    assert sorted(path.name for path in copy.glob("*.py")) == sorted(documented_files())  # nothing written beside
