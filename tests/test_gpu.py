"""What the CPU rehearsals can only fake, on a real CUDA GPU: tensors on the device, bf16, vLLM's own engine.

    python -m pytest -q tests/test_gpu.py        # on a GPU machine set up as docs/gpu.md "Set-up and running on GPUs" says

Skipped where CUDA is absent (every CPU machine, CI). The packaged SmolLM2-135M-Instruct is the policy, the rule
user the simulator, so nothing but the GPU is needed. With vLLM installed, GRPO generates with vLLM colocated in
the trainer and the evaluation with an in-process engine; without it, both use transformers."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
HAS_VLLM = importlib.util.find_spec("vllm") is not None

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run(*arguments: str) -> subprocess.CompletedProcess:
    finished = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, cwd=REPO, timeout=900)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-4000:]
    return finished


def test_two_ppo_steps_train_on_the_gpu_and_save_a_loadable_policy(packaged_model, tmp_path):
    run("train_ppo.py", "--output_dir", str(tmp_path), "--max_steps", "2", "--save_steps", "1", "--max_turns", "2",
        "--dialogues_per_profile", "4", "--minibatch_size", "4")
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [row["step"] for row in metrics] == [0, 1]
    assert all(row["ppo/value_loss"] == row["ppo/value_loss"] for row in metrics)  # not nan
    assert (tmp_path / "tokenizer_config.json").is_file() and (tmp_path / "checkpoint-2").is_dir()
    evaluation = run("eval_sentient.py", "--model", str(tmp_path), "--limit", "2", "--output",
                     str(tmp_path / "sentient.jsonl"))
    assert "score" in evaluation.stdout


def test_two_grpo_steps_train_on_the_gpu(packaged_model, tmp_path):
    vllm = ["--use_vllm", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.25"] if HAS_VLLM else []
    run("train_grpo.py", "--output_dir", str(tmp_path), "--max_steps", "2", "--max_turns", "2", *vllm)
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    rows = [json.loads(line) for line in (tmp_path / "transcripts.jsonl").open()]
    assert len(rows) == 2 * 8 and all(row["turns"] >= 1 for row in rows)


def test_a_two_scenario_sentient_evaluation_on_the_gpu(packaged_model, tmp_path):
    vllm = ["--use_vllm"] if HAS_VLLM else []
    finished = run("eval_sentient.py", "--limit", "2", "--output", str(tmp_path / "sentient.jsonl"), *vllm)
    rows = [json.loads(line) for line in (tmp_path / "sentient.jsonl").open()]
    assert len(rows) == 2 and all(0 <= row["emo_point"] <= 100 for row in rows)
    assert "score" in finished.stdout
