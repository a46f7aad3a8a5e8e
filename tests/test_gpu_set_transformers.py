"""The rollout's generator under the transformers of the GPU set (requirements-gpu.txt), not only the CPU set's.

vLLM pins an older transformers than requirements.txt does, and generate's cache argument changed name between
them. The GPU set's transformers is downloaded once (`pip download --no-deps`, into cache/) and laid over this
environment for a subprocess that reruns the generator's prefix-cache tests; skipped where the package index
cannot be reached."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import common

REPO = Path(__file__).resolve().parent.parent


def gpu_set_transformers() -> str:
    pins = re.findall(r"^transformers==(\S+)", (REPO / "requirements-gpu.txt").read_text(), flags=re.M)
    assert len(pins) == 1, "requirements-gpu.txt must pin transformers exactly once"
    return pins[0]


def overlay(version: str) -> Path:
    """A folder holding that transformers and what it needs beyond this environment (huggingface_hub < 2, httpx)."""
    folder = common.model_cache() / f"transformers-{version}"
    if (folder / "transformers").is_dir():
        return folder
    wheels = folder.with_name(folder.name + ".wheels")
    download = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                               f"transformers=={version}", "huggingface_hub<2", "httpx", "httpcore"],
                              capture_output=True, text=True, timeout=300)
    if download.returncode != 0:
        pytest.skip(f"could not download transformers {version}: {download.stderr.strip()[-300:]}")
    partial = folder.with_name(folder.name + ".partial")
    for wheel in wheels.glob("*.whl"):
        subprocess.run([sys.executable, "-m", "zipfile", "-e", str(wheel), str(partial)], check=True)
    partial.rename(folder)  # only a complete overlay appears under the final name
    return folder


# The tests rerun under the GPU set's transformers, in one pytest process (one start-up of torch and the model
# fixtures, not two): the generator's prefix cache, and the rule user's encoder and replayed blind dialogues.
RERUN = {"tests/test_rollout.py": ["cached_prefix", "prefix_cache_match"],
         "tests/test_act_reader.py": ["traced_encoder"],
         "tests/test_live_play.py": ["replays_as_its_player_saw", "recorded_emotions"]}


@pytest.fixture(scope="module")
def rerun(packaged_model) -> str:
    """The verbose output of RERUN's tests under the GPU set's transformers (checked to be that version)."""
    version = gpu_set_transformers()
    env = {**os.environ, "PYTHONPATH": str(overlay(version))}
    probe = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                           capture_output=True, text=True, env=env, cwd=REPO)
    assert probe.stdout.strip() == version, probe.stderr[-1000:]
    selection = " or ".join(name for names in RERUN.values() for name in names)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *RERUN, "-k", selection],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert tests.returncode == 0 and "7 passed" in tests.stdout, tests.stdout[-3000:]
    return tests.stdout


def passed(output: str, file: str, names: list[str]) -> int:
    return sum(line.startswith(file) and "PASSED" in line and any(name in line for name in names)
               for line in output.splitlines())


def test_the_generators_prefix_cache_works_on_the_gpu_sets_transformers(rerun):
    assert passed(rerun, "tests/test_rollout.py", RERUN["tests/test_rollout.py"]) == 2


def test_the_rule_user_reads_and_judges_the_same_on_the_gpu_sets_transformers(rerun):
    """The rule user's encoder is BertModel's modules driven by rule_user.token_states: under the GPU set's
    transformers the traced encoder must still give BertModel's own states bit for bit, and every measured blind
    dialogue must replay to the messages and emotions its player saw (so a run on a GPU machine with the rule
    backend is judged as the docs' figures were)."""
    assert passed(rerun, "tests/test_act_reader.py", RERUN["tests/test_act_reader.py"]) + passed(
        rerun, "tests/test_live_play.py", RERUN["tests/test_live_play.py"]) == 5
