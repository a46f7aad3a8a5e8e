"""A copy that runs alone, as docs/copying.md tells a teacher to make one: the files the trainers load on start
(benchmarks/core_lines.py) but the guards (guards.py, preflight.py), whose statements are deleted by the documented
rule (benchmarks/teaching_copy.py), with prompts/ and profiles/, and none of the backends' files (vLLM, the LLM users,
their chat client, the released prompts). It trains a GRPO step and a PPO step on the tiny model: the method needs
nothing of the layer, the default path imports no backend, and the documented lists of files are the ones the scripts
load."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

_spec = importlib.util.spec_from_file_location("teaching_copy", REPO / "benchmarks" / "teaching_copy.py")
teaching_copy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(teaching_copy)


def documented_files(heading: str) -> set[str]:
    """The files docs/copying.md lists under `heading` in its section "The files"."""
    text = (REPO / "docs" / "copying.md").read_text()
    section = text.split("## The files", 1)[1].split("\n## ", 1)[0]
    line = next(line for line in section.splitlines() if line.startswith(f"- {heading}"))
    return set(re.findall(r"`(\w+\.py)`", line))


def test_the_documented_files_are_what_the_trainers_load_on_start():
    loaded = {name for script in ("train_grpo.py", "train_ppo.py")
              for name in teaching_copy.core_lines.reached(script, lazy=False)}
    assert documented_files("the method") == set(teaching_copy.method_files())
    assert documented_files("the guards") == {"guards.py", "preflight.py"}
    assert documented_files("the method") | documented_files("the guards") == loaded


def test_the_rule_drops_the_layers_statements_items_and_the_blocks_it_empties():
    source = '''import guards
import torch


def check(x):
    guards.check_options(x)


class A:
    def __post_init__(self):
        """Kept: a docstring."""
        guards.check_options(self, a=guards.POSITIVE)

    def step(self):
        # the guard's comment goes with it
        guards.check_run_folder_kept(
            "out")
        with open("f") as f, guards.StopRequest(show=True) as stop:
            f.read()
        with guards.own_output("p"):
            write("p")  # its comment stays
            if stop:
                guards.note_interruption()
        return 1


if __name__ == "__main__":
    guards.start_script("x")
if __name__ == "__main__":
    with guards.one_line_exits("--resume"):
        main()
'''
    assert teaching_copy.without_layer(source) == '''import torch


class A:
    def __post_init__(self):
        """Kept: a docstring."""

    def step(self):
        with open("f") as f:
            f.read()
        write("p")  # its comment stays
        return 1


if __name__ == "__main__":
    main()
'''
    with pytest.raises(ValueError, match="only a part"):
        teaching_copy.without_layer("import guards\nif x:\n    guards.check()\nelse:\n    y()\n")


@pytest.mark.slow
def test_a_copy_without_the_guards_trains_a_grpo_step_and_a_ppo_step(tiny_model_dir, tmp_path):
    copy = tmp_path / "copy"
    counts = teaching_copy.make_copy(copy)
    assert set(counts) == documented_files("the method")
    for name in counts:
        assert not re.search(r"^(import|from) (guards|preflight)\b", (copy / name).read_text(), re.M)  # at the top
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
    assert sorted(path.name for path in copy.glob("*.py")) == sorted(counts)  # nothing written beside
