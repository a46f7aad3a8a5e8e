"""GRPO's vLLM paths rehearsed on CPU: TRL's real VLLMGeneration and VLLMClient on 2 gloo ranks, against the fake
vllm of tests/fake_vllm (its `LLM` for colocate mode, its `trl vllm-serve` for server mode)."""
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FAKE = TESTS / "fake_vllm"


@pytest.fixture
def fake_server(tiny_model_dir, tmp_path):
    """The fake `trl vllm-serve` on 127.0.0.1; yields (base URL, port, its request log)."""
    port, log = free_port(), tmp_path / "server.log"
    server = subprocess.Popen([sys.executable, str(FAKE / "server.py"), "--port", str(port), "--model",
                               str(tiny_model_dir), "--log", str(log)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        yield f"http://127.0.0.1:{port}", port, log
    finally:
        server.kill()
        server.wait()


def two_ranks(*arguments, env=None, timeout=400) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), *map(str, arguments)]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", **(env or {})})


def case_results(finished: subprocess.CompletedProcess, out_dir: Path) -> list[dict]:
    assert finished.returncode == 0, finished.stderr[-3000:]
    return [json.loads(line) for rank in (0, 1) for line in (out_dir / f"rank{rank}.jsonl").open()]


def assert_every_rank_got_its_own_completions(results: list[dict]) -> None:
    assert len(results) == 12  # 6 cases x 2 ranks
    for result in results:
        assert "raised" not in result, result
        assert result["completions"] == result["contexts"], result
        assert set(result["verdicts"]) <= {"own"} and result["logprobs_aligned"], result


def test_server_mode_gives_each_rank_its_own_completions_when_ranks_hold_different_numbers(fake_server,
                                                                                           tiny_model_dir, tmp_path):
    url, _, log = fake_server
    assert_every_rank_got_its_own_completions(case_results(
        two_ranks(TESTS / "vllm_ranks.py", tmp_path, "server", 1, tiny_model_dir, url), tmp_path))
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    completions = [call for call in calls if call["event"] == "completions"]
    assert len(completions) == 5  # the call in which every dialogue had ended never reached the server
    assert all(call["n_prompts"] > 0 for call in completions)


def test_colocate_mode_with_tensor_parallelism_gives_each_rank_its_own_completions(tiny_model_dir, tmp_path):
    assert_every_rank_got_its_own_completions(case_results(
        two_ranks(TESTS / "vllm_ranks.py", tmp_path, "colocate", 2, tiny_model_dir), tmp_path))


def generate_calls(log: Path) -> list[dict]:
    return [row for row in map(json.loads, log.read_text().splitlines()) if row["event"] == "generate_call"]


def grpo_command(tiny_model_dir, output_dir, *flags):
    return [FAKE / "run.py", "train_grpo.py", "--model_name_or_path", tiny_model_dir, "--output_dir", output_dir,
            "--num_generations", "2", "--per_device_train_batch_size", "4", "--use_vllm", "--use_cpu", "true", *flags]


def test_grpo_in_server_mode_trains_on_two_ranks_whose_dialogues_end_at_different_turns(fake_server, tiny_model_dir,
                                                                                        tmp_path):
    url, _, _ = fake_server
    log = tmp_path / "client.log"
    # The fake's replies (up to 24 random tokens, garbled to the rule user: -10 a turn from 30, so gone by the
    # 3rd turn) against a 240-token dialogue budget that the longer openings reach first: dialogues end at
    # different turns on each rank, and all of them before the 6th turn. The fake server's fixed seed makes
    # the run reproducible.
    finished = two_ranks(*grpo_command(tiny_model_dir, tmp_path / "run", "--max_steps", "2", "--max_turns", "6",
                                       "--max_reply_tokens", "24", "--max_dialogue_tokens", "240", "--vllm_mode",
                                       "server", "--vllm_server_base_url", url),
                         env={"FAKE_VLLM_LOG": str(log)})
    assert finished.returncode == 0, finished.stderr[-3000:]
    calls = generate_calls(log)
    assert calls and all(set(call["verdicts"]) <= {"own"} and call["logprobs_ok"] is not False for call in calls)
    counts = collections.defaultdict(dict)  # (rank, call index) -> contexts; both ranks make the same calls
    for rank in ("0", "1"):
        for index, call in enumerate(c for c in calls if c.get("rank") == rank):
            counts[index][rank] = call["n_contexts"]
    assert all(len(pair) == 2 for pair in counts.values()), "the ranks made different numbers of generate calls"
    assert any(pair["0"] != pair["1"] for pair in counts.values()), "no call had ranks with different counts"
    assert any(pair["0"] == pair["1"] == 0 for pair in counts.values()), "no call came after every dialogue ended"
    rows = [json.loads(line) for rank in (0, 1) for line in (tmp_path / "run" / f"transcripts.rank{rank}.jsonl").open()]
    assert len(rows) == 2 * 2 * 4  # steps x ranks x dialogues


def test_grpo_colocate_think_run_samples_each_dialogues_own_completions(tiny_model_dir, tmp_path):
    log = tmp_path / "client.log"
    finished = two_ranks(*grpo_command(tiny_model_dir, tmp_path / "run", "--max_steps", "1", "--max_turns", "4",
                                       "--think", "--max_think_tokens", "12", "--max_reply_tokens", "16",
                                       "--max_dialogue_tokens", "400", "--vllm_mode", "colocate"),
                         env={"FAKE_VLLM_LOG": str(log)})
    assert finished.returncode == 0, finished.stderr[-3000:]
    calls = generate_calls(log)
    assert {call["stop"] for call in calls} == {"</think>", None}
    assert all(set(call["verdicts"]) <= {"own"} and call["logprobs_ok"] is not False for call in calls)


def test_turn_credit_on_two_ranks_compares_each_turn_with_its_whole_group_across_ranks(tiny_model_dir, tmp_path):
    """One profile of 4 dialogues a step, 2 on each rank: each turn's term must come from the group's 4
    changes, gathered across the ranks, not from a rank's own 2 (the logged mean term tells them apart)."""
    import zlib

    from fake_openai import FakeOpenAIServer

    import train_grpo

    def respond(body):  # a change that depends on the reply, so the group's changes differ
        return f"Fine.\nCHANGE: {['+5', '-5', '+10', '0'][zlib.crc32(json.dumps(body['messages']).encode()) % 4]}"

    output_dir = tmp_path / "run"
    with FakeOpenAIServer(respond=respond) as simulator_server:
        finished = two_ranks(FAKE / "run.py", "train_grpo.py", "--model_name_or_path", tiny_model_dir,
                             "--output_dir", output_dir, "--num_generations", "4", "--per_device_train_batch_size", "2",
                             "--use_vllm", "--use_cpu", "true", "--vllm_mode", "colocate", "--max_steps", "1",
                             "--max_turns", "2", "--max_reply_tokens", "8", "--turn_credit", "--backend", "llm",
                             "--simulator_model", "sim-model", "--base_url", simulator_server.base_url,
                             env={"FAKE_VLLM_LOG": str(tmp_path / "client.log")})
    assert finished.returncode == 0, finished.stderr[-3000:]
    rows = [json.loads(line) for rank in (0, 1) for line in (output_dir / f"transcripts.rank{rank}.jsonl").open()]
    changes = [[m["change"] for m in row["history"] if m["role"] == "user" and "change" in m] for row in rows]
    terms = train_grpo.turn_terms(changes, [False] * 4, 4, "turn", "std", 10)
    expected = sum(0.5 * abs(term) for row_terms in terms for term in row_terms) / sum(map(len, terms))
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    [logged] = [entry["turn_credit/mean_abs_term"] for entry in history if "turn_credit/mean_abs_term" in entry]
    assert expected > 0 and logged == pytest.approx(expected, rel=1e-4)
