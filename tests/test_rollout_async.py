"""--rollout async against lockstep: the same dialogues, token ids, masks and logprobs when the policy decodes
greedily (or with per-request seeds), whatever order the simulated users' and the policy server's random
latencies make the turns come in; and with the rule user (which answers at once) every generate call holds the
same dialogues as lockstep's, so a sampled CPU demo is unchanged. 2 ranks: tests/rollout_ranks.py."""
import json
from pathlib import Path

import pytest
import torch
from conftest import SlowUser, serving, two_ranks
from fake_openai import FakeOpenAIServer

import chat_client
import generation
import rollout
import simulator
import vllm_backends

TESTS = Path(__file__).resolve().parent


class Recorded:
    """A batched generate that records each call's number of contexts."""

    def __init__(self, generate):
        self.generate, self.calls = generate, []
        self.lockstep_reason = getattr(generate, "lockstep_reason", None)

    def __call__(self, contexts, max_new_tokens, stop=None):
        self.calls.append(len(contexts))
        return self.generate(contexts, max_new_tokens, stop=stop)


def greedy(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    config = GenerationConfig(do_sample=False, eos_token_id=sorted(generation.end_of_turn_ids(tokenizer)),
                              pad_token_id=tokenizer.pad_token_id)
    return model, tokenizer, config


def outcome(dialogues: list[rollout.Dialogue]) -> list[tuple]:
    """Everything a trainer reads from the dialogues, by dialogue."""
    return [(d.dialogue_id, d.prompt_ids, d.completion_ids, d.env_mask, d.logprobs, d.token_turns(), d.emotions,
             d.reply_texts, d.think_texts, d.end_reason, d.format_violations) for d in dialogues]


def play(tokenizer, generate, schedule: str, think: bool, user=None, profiles=4, repeats=2, **options):
    """A rollout of `profiles` profiles x `repeats` dialogues with this schedule; the dialogues."""
    dialogue_args = rollout.DialogueArguments(think=think, max_turns=4, max_think_tokens=8, max_reply_tokens=12,
                                              max_dialogue_tokens=600, rollout=schedule, **options)
    chosen = simulator.load_profiles(dialogue_args.profiles)[:profiles]
    if user is None:  # the rule user: answers at once
        runner = rollout.DialogueRunner(tokenizer, dialogue_args)
        return_dialogues = runner.run([(p, p.first_talk or "Hi.") for p in chosen for _ in range(repeats)], generate)
        runner.close()
        return return_dialogues
    with FakeOpenAIServer(respond=user) as server:
        chat = chat_client.ChatClient(server.base_url, "sim-model", max_retries=0)
        runner = rollout.DialogueRunner(tokenizer, dialogue_args, simulator.SimulatorArguments(
            backend="llm", base_url=server.base_url, simulator_model="sim-model"), chat)
        dialogues = runner.run([(p, "I had a rough week.") for p in chosen for _ in range(repeats)], generate)
        runner.close()
    return dialogues


@pytest.mark.parametrize("think", [False, True])
def test_async_plays_locksteps_dialogues_under_greedy_decoding_whatever_order_the_users_answer_in(tiny_model_dir,
                                                                                                  think):
    model, tokenizer, config = greedy(tiny_model_dir)
    lockstep = Recorded(generation.TransformersGenerator(model, tokenizer, config))
    expected = outcome(play(tokenizer, lockstep, "lockstep", think, SlowUser(seed=1)))
    asynchronous = Recorded(generation.TransformersGenerator(model, tokenizer, config))
    dialogues = play(tokenizer, asynchronous, "async", think, SlowUser(seed=2), batch_wait=0.005)
    assert outcome(dialogues) == expected
    # The dialogues did not advance together: more, smaller calls than lockstep's one per turn and phase.
    assert len(asynchronous.calls) > len(lockstep.calls) and sum(asynchronous.calls) == sum(lockstep.calls)
    assert len({d.end_reason for d in dialogues}) > 1 and len({len(d.reply_texts) for d in dialogues}) > 1


@pytest.mark.parametrize("think", [False, True])
def test_with_the_rule_user_async_makes_locksteps_calls_so_a_sampled_demo_is_unchanged(tiny_model_dir, think):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    sampling = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=sorted(generation.end_of_turn_ids(tokenizer)))
    results = {}
    for schedule in ("lockstep", "async"):
        torch.manual_seed(7)
        generate = Recorded(generation.TransformersGenerator(model, tokenizer, sampling))
        results[schedule] = (outcome(play(tokenizer, generate, schedule, think)), generate.calls)
    assert results["async"] == results["lockstep"]


def test_a_failing_generate_call_fails_the_rollout_and_leaves_no_task_behind(tiny_model_dir):
    _, tokenizer, _ = greedy(tiny_model_dir)

    def broken(contexts, max_new_tokens, stop=None):
        raise RuntimeError("CUDA out of memory")

    dialogue_args = rollout.DialogueArguments(max_turns=2)
    runner = rollout.DialogueRunner(tokenizer, dialogue_args)
    profile = simulator.load_profiles(dialogue_args.profiles)[0]
    with pytest.raises(RuntimeError, match="out of memory"):
        runner.run([(profile, "Hi.")] * 3, broken)
    import asyncio

    assert not asyncio.all_tasks(runner.loop)
    runner.close()


def test_a_collective_generator_is_played_in_lockstep_and_says_so(tiny_model_dir, capsys):
    model, tokenizer, config = greedy(tiny_model_dir)
    generate = Recorded(generation.TransformersGenerator(model, tokenizer, config))
    generate.lockstep_reason = "its calls are collectives"
    dialogues = play(tokenizer, generate, "async", False, profiles=2, repeats=1)
    assert len(generate.calls) == 4  # one a turn, with the dialogues still playing (ranks stay in step)
    assert all(dialogue.reply_texts for dialogue in dialogues)
    assert "--rollout async: lockstep instead, as its calls are collectives" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# A vLLM server: each turn its own request (async) against one request per call (lockstep)
# --------------------------------------------------------------------------------------------

@pytest.fixture
def vllm_client(monkeypatch):
    """TRL's VLLMClient, which checks that vLLM is installed (here it talks to the fake server only)."""
    from trl.generation import vllm_client

    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)


def batched_server_generator(url: str, temperature: float) -> vllm_backends.VLLMServerGenerator:
    """train_ppo.py's lockstep generator on the fake server, without its NCCL weight channel (not used here)."""
    from trl.generation.vllm_client import VLLMClient

    generate = vllm_backends.VLLMServerGenerator.__new__(vllm_backends.VLLMServerGenerator)
    generate.client = VLLMClient(base_url=url, connection_timeout=10)
    generate.host, generate.port = "127.0.0.1", int(url.rsplit(":", 1)[1])
    generate.temperature = temperature
    return generate


@pytest.mark.parametrize("think", [False, True])
def test_server_requests_of_their_own_play_locksteps_dialogues_and_logprobs_under_greedy(tiny_model_dir, tmp_path,
                                                                                         think, vllm_client):
    _, tokenizer, _ = greedy(tiny_model_dir)
    with serving(tiny_model_dir, tmp_path / "lockstep.log") as url:
        expected = outcome(play(tokenizer, batched_server_generator(url, 0.0), "lockstep", think, SlowUser(1)))
    with serving(tiny_model_dir, tmp_path / "async.log", latency=0.05) as url:
        turns = batched_server_generator(url, 0.0).turns(seed=5, step=0, rank=0)
        assert outcome(play(tokenizer, turns, "async", think, SlowUser(2))) == expected
    requests = [json.loads(line) for line in (tmp_path / "async.log").read_text().splitlines()]
    requests = [row for row in requests if row["event"] == "completions"]
    assert {row["n_prompts"] for row in requests} == {1}  # each turn its own request
    assert all((logprob is not None) == bool(sampled) for row in expected for logprob, sampled in zip(row[4], row[3]))


def test_per_request_seeds_make_sampled_server_dialogues_independent_of_arrival_order(tiny_model_dir, tmp_path,
                                                                                      vllm_client):
    _, tokenizer, _ = greedy(tiny_model_dir)
    played, seeds = [], []
    for latency_seed in (1, 2):
        log = tmp_path / f"server{latency_seed}.log"
        with serving(tiny_model_dir, log, latency=0.05, seed=latency_seed) as url:
            turns = batched_server_generator(url, 1.0).turns(seed=5, step=0, rank=0)
            played.append(outcome(play(tokenizer, turns, "async", True, SlowUser(latency_seed))))
        seeds.append(sorted(json.loads(line)["seed"] for line in log.read_text().splitlines()
                            if json.loads(line)["event"] == "completions"))
    assert played[0] == played[1] and seeds[0] == seeds[1]
    assert len(set(seeds[0])) == len(seeds[0])  # every request its own seed
    other_rank = vllm_backends.VLLMServerTurns("http://127.0.0.1:1", {}, seed=5, step=0, rank=1)
    this_rank = vllm_backends.VLLMServerTurns("http://127.0.0.1:1", {}, seed=5, step=0, rank=0)
    assert other_rank.request_seed((0, 0, "reply")) != this_rank.request_seed((0, 0, "reply"))
    next_step = vllm_backends.VLLMServerTurns("http://127.0.0.1:1", {}, seed=5, step=1, rank=0)
    assert next_step.request_seed((0, 0, "reply")) != this_rank.request_seed((0, 0, "reply"))


def test_on_two_ranks_every_schedule_and_vllm_mode_plays_the_same_dialogues(tiny_model_dir, tmp_path):
    """tests/rollout_ranks.py: TRL's VLLMGeneration in server and colocate mode, lockstep and async, ranks with
    3 and 2 dialogues whose users answer after random latencies; greedy, so all four must agree, rank by rank
    (the fake vLLM's greedy completions are a function of the prompt alone, so server and colocate agree too);
    and transformers' own generate, lockstep against async."""
    with serving(tiny_model_dir, tmp_path / "server.log", latency=0.01) as url, \
            FakeOpenAIServer(respond=SlowUser(seed=4, most=0.03)) as users:
        finished = two_ranks(TESTS / "rollout_ranks.py", tmp_path, tiny_model_dir, url, users.base_url)
    assert finished.returncode == 0, finished.stderr[-3000:]
    for rank, dialogues in ((0, 3), (1, 2)):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        expected = results["server-lockstep"]
        assert len(expected) == dialogues
        assert all(results[schedule] == expected for schedule in ("server-async", "colocate-lockstep", "colocate-async"))
        assert results["transformers-async"] == results["transformers-lockstep"]
    assert len({row["turns"] for rank in (0, 1)
                for row in json.loads((tmp_path / f"rank{rank}.json").read_text())["server-async"]}) > 1


def test_trls_vllm_generate_is_left_in_lockstep_exactly_where_it_is_a_collective():
    from types import SimpleNamespace

    def reason(mode, tensor_parallel_size=1, enable_sleep_mode=False):
        return vllm_backends.vllm_lockstep_reason(SimpleNamespace(mode=mode, tensor_parallel_size=tensor_parallel_size,
                                                               enable_sleep_mode=enable_sleep_mode))

    assert reason("colocate") is None
    assert "tensor parallelism 2" in reason("colocate", tensor_parallel_size=2)
    assert "sleep mode" in reason("colocate", enable_sleep_mode=True)
    assert "gathers every rank's prompts" in reason("server")


def test_async_generate_calls_run_in_worker_threads_on_the_devices_the_ranks_main_thread_selected(monkeypatch):
    """CUDA's current device is per thread and accelerate selects a rank's GPU in its main thread only; a
    worker thread that generates must select it again, or on ranks 1-7 it would run on GPU 0. CUDA itself is
    a recorded seam here (a per-thread current device), torch's default device the real per-thread setting."""
    import asyncio
    import threading

    selected = threading.local()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(selected, "index", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: setattr(selected, "index", index))
    seen = []

    def generate(contexts, max_new_tokens, stop=None):
        seen.append((threading.current_thread() is threading.main_thread(), torch.cuda.current_device(),
                     torch.empty(0).device.type))
        return [[7] for _ in contexts], None

    async def play(dialogues: int):
        batcher = rollout.TurnBatcher(generate, dialogues, wait=0.0)

        async def dialogue(dialogue_id):
            for turn in range(3):
                await batcher.sample([1, 2, 3], 4, None, (dialogue_id, turn, "reply"))
                await asyncio.sleep(0)
            batcher.finished()

        await rollout.run_all([batcher.serve()] + [dialogue(i) for i in range(dialogues)])

    torch.cuda.set_device(3)  # rank 3, as accelerate selects it
    torch.set_default_device("meta")
    try:
        asyncio.run(play(2))
    finally:
        torch.set_default_device(None)
    assert len(seen) >= 3 and not any(main for main, _, _ in seen)  # the calls ran in worker threads
    assert {(device, default) for _, device, default in seen} == {(3, "meta")}
