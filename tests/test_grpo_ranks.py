"""train_grpo.py on 2 gloo ranks on CPU (the fake vLLM in colocate mode, as in test_grpo_vllm.py): what the ranks
must agree on before the trainer starts."""
import itertools
import json
import threading

import pytest
from fake_openai import FakeOpenAIServer
from test_grpo_vllm import FAKE, two_ranks

import simulator

OPENING_REQUEST = "start the conversation"  # in prompts/*/opening.txt: the simulator asked for its first line


@pytest.mark.slow
def test_every_dialogue_of_a_group_spanning_both_ranks_opens_with_the_same_line(tiny_model_dir, tmp_path):
    """An LLM simulator samples each opening (temperature 0.7); this endpoint writes a fresh one per request. With
    2 dialogues a rank and 4 a profile, each group spans both ranks: its dialogues must still share one opening,
    asked for once per profile."""
    numbers, lock = itertools.count(1), threading.Lock()

    def respond(body):
        prompt = body["messages"][-1]["content"]
        if OPENING_REQUEST in prompt:
            with lock:
                return f"I had a rough week (opening #{next(numbers)})."
        return "Fine.\nCHANGE: +2" if "CHANGE" in prompt else "Okay. It still hurts, though."

    output_dir = tmp_path / "run"
    with FakeOpenAIServer(respond=respond) as server:
        finished = two_ranks(FAKE / "run.py", "train_grpo.py", "--model_name_or_path", tiny_model_dir,
                             "--output_dir", output_dir, "--num_generations", "4", "--per_device_train_batch_size", "2",
                             "--use_vllm", "--vllm_mode", "colocate", "--use_cpu", "true", "--max_steps", "1",
                             "--max_turns", "1", "--max_reply_tokens", "8", "--backend", "llm", "--simulator_model",
                             "sim-model", "--base_url", server.base_url)
        opening_requests = sum(OPENING_REQUEST in body["messages"][-1]["content"] for body in server.requests)
    assert finished.returncode == 0, finished.stderr[-3000:]
    output = finished.stdout + finished.stderr  # both ranks': the run's lines are the main process's alone
    assert output.count("GRPO: ") == 1 and output.count("step 1/1: mean final emotion") == 1
    openings = {}  # profile -> {rank: its dialogues' first user lines}
    for rank in (0, 1):
        for line in (output_dir / f"transcripts.rank{rank}.jsonl").read_text().splitlines():
            row = json.loads(line)
            first = next(message["content"] for message in row["history"] if message["role"] == "user")
            openings.setdefault(row["id"], {}).setdefault(rank, set()).add(first)
    assert [sorted(by_rank) for by_rank in openings.values()] == [[0, 1]]  # one profile, on both ranks
    [by_rank] = openings.values()
    assert len(by_rank[0] | by_rank[1]) == 1, by_rank
    assert opening_requests == len(simulator.load_profiles(simulator.DEFAULT_PROFILES))  # once each, not per rank
