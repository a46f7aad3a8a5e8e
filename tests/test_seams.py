"""The seams a test suite crosses without looking: the fields of every outgoing request, a setting's path to where
it acts on each backend, a check in both directions, and a schedule's timing counted in calls, not seconds. Every
test here runs in the fast subset (no model weights): a recording fake on 127.0.0.1 for the simulator endpoint,
the tested model's endpoint and the vLLM server; recorders bound to the real library's signatures elsewhere.
The ranks' side of the seams is tests/test_ranks.py."""
import asyncio
import hashlib
import importlib.util
import inspect
import json
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO
from fake_openai import FakeOpenAIServer
from test_official_prompts import REPO as OFFICIAL_REPO

import common
import guards
import eval_general
import eval_sentient
import generation
import vllm_backends
import rollout
import simulator
import train_grpo
import train_ppo



def simulated_user(body: dict) -> str:
    """A fake simulator endpoint's answer: an analysis when asked for one (our prompts ask for a CHANGE line),
    else the user's message."""
    return "They listened.\nCHANGE: +3" if "CHANGE" in body["messages"][-1]["content"] else "Thanks, that helps."

TRAINERS = {"grpo": lambda argv: train_grpo.parse_arguments(argv)[:2],
            "ppo": lambda argv: train_ppo.parse_arguments(argv)[1:3]}
FAST_RETRY = {"status": 500, "retry_after": 0.01}  # the SDK waits Retry-After (10 ms) instead of its back-off


def flags(**values) -> list[str]:
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


def eval_arguments(argv):
    return guards.parse_arguments(eval_sentient.TrlParser((eval_sentient.EvalArguments,
                                                            simulator.SimulatorArguments)), argv)


def general_arguments(argv):
    return guards.parse_arguments(eval_general.TrlParser(eval_general.GeneralEvalArguments), argv)[0]


# --------------------------------------------------------------------------------------------
# The simulator endpoint: what each request carries, from the trainers' flags
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_the_simulator_endpoints_requests_carry_exactly_the_flags_values(trainer):
    with FakeOpenAIServer(models=("served-user",), respond=simulated_user) as server:
        dialogue_args, simulator_args = TRAINERS[trainer](flags(
            backend="llm", base_url=server.base_url, simulator_model="served-user", simulator_temperature=0.3,
            simulator_max_tokens=77, simulator_timeout=9, simulator_max_retries=1))
        chat = rollout.make_chat(simulator_args)
        user = rollout.new_simulator(simulator.load_profiles(dialogue_args.profiles)[0], chat, dialogue_args,
                                     simulator_args)

        async def play():
            await chat.check()
            await user.open()
            await user.respond("That sounds hard; what happened?")
        asyncio.run(play())
    assert len(server.requests) == 3 and server.listings == 1  # the opening, a turn's analysis and message; one listing
    for body in server.requests:
        assert set(body) == {"model", "messages", "temperature", "max_tokens"}  # no seed: the user samples freely
        assert (body["model"], body["temperature"], body["max_tokens"]) == ("served-user", 0.3, 77)
        assert body["messages"] and all(set(m) == {"role", "content"} for m in body["messages"])
    assert "That sounds hard; what happened?" in json.dumps(server.requests[1]["messages"])
    assert user.emotion == dialogue_args.start_emotion + 3
    assert chat.client.timeout == 9 and chat.client.max_retries == 1


@pytest.mark.parametrize("retries", [0, 2])
def test_the_simulator_endpoint_is_tried_once_more_than_simulator_max_retries(retries):
    """--simulator_max_retries counted in requests the server received (a 500 each time)."""
    with FakeOpenAIServer(default=FAST_RETRY) as server:
        _, simulator_args = TRAINERS["grpo"](flags(backend="llm", base_url=server.base_url, simulator_model="sim-model",
                                                   simulator_max_retries=retries))
        chat = rollout.make_chat(simulator_args)
        with pytest.raises(common.EndpointError, match="failed after retries"):
            asyncio.run(chat.complete([{"role": "user", "content": "hi"}]))
    assert len(server.requests) == retries + 1


def test_an_answer_cut_at_max_tokens_fails_a_simulator_call_but_is_a_tested_models_answer():
    """Both ways: the simulated user's answer cut at max_tokens is never a message (its Response: may be cut off);
    the tested model's answer cut at its budget is its answer, as a local model's is."""
    cut = {"text": "Analysis: they", "finish_reason": "length"}
    with FakeOpenAIServer(models=("sim-model", "served"), default=cut) as server:
        _, simulator_args = TRAINERS["grpo"](flags(backend="llm", base_url=server.base_url, simulator_model="sim-model"))
        with pytest.raises(common.EndpointError, match="finish_reason length"):
            asyncio.run(rollout.make_chat(simulator_args).complete([{"role": "user", "content": "hi"}]))
        backend = eval_general.make_backend(general_arguments(flags(model="served", model_base_url=server.base_url)))
        assert backend([[{"role": "user", "content": "2+2?"}]], 5, seed=0) == ["Analysis: they"]


# --------------------------------------------------------------------------------------------
# The tested model's endpoint: the Sentient benchmark and the general evaluation
# --------------------------------------------------------------------------------------------

def test_the_sentient_benchmarks_requests_carry_its_sampling_flags_and_a_seed_per_scenario(tmp_path):
    """Every turn of a scenario is one request with the model, temperature, top_p, the think and reply budgets
    together, and the scenario's seed (--seed plus its place); the model is listed once, at start-up."""
    with FakeOpenAIServer(models=("served",), default="<think>Let me see.</think>That sounds heavy.") as server:
        args, simulator_args = eval_arguments(flags(model="served", model_base_url=server.base_url, temperature=0.4,
                                                    top_p=0.8, seed=5, think=True, max_think_tokens=10,
                                                    max_reply_tokens=20, model_timeout=7, model_max_retries=2))
        profiles = simulator.load_profiles(args.profiles, require_first_talk=True)[:3]
        asyncio.run(eval_sentient.play_endpoint(args, simulator_args, None, profiles, {profiles[1].id},
                                                tmp_path / "out.jsonl", lambda rows: None))
    seeds, openings = {}, {p.first_talk for p in profiles}
    for body in server.requests:
        assert set(body) == {"model", "messages", "temperature", "top_p", "max_tokens", "seed"}
        assert (body["model"], body["temperature"], body["top_p"], body["max_tokens"]) == ("served", 0.4, 0.8, 30)
        opening = next(m["content"] for m in body["messages"] if m["content"] in openings)
        seeds.setdefault(opening, set()).add(body["seed"])
        assert "Let me see" not in json.dumps(body["messages"])  # its own thought never goes back to it
    assert seeds == {profiles[0].first_talk: {5}, profiles[2].first_talk: {7}}  # the second was done
    assert server.listings == 1


@pytest.mark.parametrize("retries", [0, 2])
def test_the_tested_model_is_tried_once_more_than_model_max_retries(retries, tmp_path):
    for evaluation in ("sentient", "general"):
        with FakeOpenAIServer(models=("served",), script=[FAST_RETRY] * 3) as server:
            argv = flags(model="served", model_base_url=server.base_url, model_max_retries=retries)
            with pytest.raises(common.EndpointError, match="failed after retries"):
                if evaluation == "sentient":
                    args, simulator_args = eval_arguments(argv)
                    profiles = simulator.load_profiles(args.profiles, require_first_talk=True)[:1]
                    asyncio.run(eval_sentient.play_endpoint(args, simulator_args, None, profiles, set(),
                                                            tmp_path / "out.jsonl", lambda rows: None))
                else:
                    eval_general.make_backend(general_arguments(argv))([[{"role": "user", "content": "2+2?"}]], 5, 0)
        assert len(server.requests) == retries + 1, evaluation


@pytest.mark.parametrize("temperature", [0.0, 0.6])
def test_the_general_evaluations_requests_carry_its_sampling_flags(temperature):
    """A batch is a request per item: the budget the task gives, temperature and top_p from the flags, and a seed
    of the batch's seed plus the item's place when sampling (none when greedy); the model is listed once."""
    with FakeOpenAIServer(models=("served",), default="4") as server:
        backend = eval_general.make_backend(general_arguments(flags(
            model="served", model_base_url=server.base_url, temperature=temperature, top_p=0.8, model_timeout=7)))
        conversations = [[{"role": "user", "content": f"{n}+{n}?"}] for n in range(3)]
        assert backend(conversations, 33, seed=11) == ["4"] * 3
        assert backend(conversations[:1], 12, seed=20) == ["4"]
    expected = [{"model": "served", "messages": conversation, "temperature": temperature, "top_p": 0.8,
                 "max_tokens": budget, **({"seed": seed} if temperature else {})}
                for conversation, budget, seed in [(conversations[0], 33, 11), (conversations[1], 33, 12),
                                                   (conversations[2], 33, 13), (conversations[0], 12, 20)]]
    key = lambda body: (body["max_tokens"], json.dumps(body["messages"]))  # noqa: E731 (sent concurrently)
    assert sorted(server.requests, key=key) == sorted(expected, key=key)
    assert server.listings == 1 and backend.client.client.timeout == 7


def test_the_general_evaluation_seeds_each_batch_by_its_first_items_place(tmp_path, monkeypatch):
    """run_task: a batch's seed is --seed plus the place of its first item, whether or not earlier items are done;
    the task's budget unless --max_new_tokens is given."""
    asked = []

    def backend(conversations, max_new_tokens, seed):
        asked.append((len(conversations), max_new_tokens, seed))
        return ["\\boxed{4}"] * len(conversations)

    items = [{"id": f"m{n}", "messages": [{"role": "user", "content": "2+2?"}], "answer": "4", "subject": "a",
              "level": 1} for n in range(5)]
    bar = SimpleNamespace(update=lambda count: None, close=lambda: None)
    for max_new_tokens, budget in (([], eval_general.TASK_MAX_NEW_TOKENS["math500"]), (["--max_new_tokens", "9"], 9)):
        asked.clear()
        args = general_arguments(["--seed", "100", "--batch_size", "2", *max_new_tokens])
        rows = eval_general.run_task("math500", items, {"m0", "m1", "m2"}, args, backend, tmp_path / budget.__str__(),
                                     lambda **kwargs: bar)
        assert asked == [(1, budget, 102), (1, budget, 104)]
        assert [row["id"] for row in rows] == ["m3", "m4"] and rows[0]["made_by"]["max_new_tokens"] == budget


# --------------------------------------------------------------------------------------------
# The vLLM server: a request per turn (--rollout async), and TRL's client (lockstep, PPO)
# --------------------------------------------------------------------------------------------

@pytest.fixture
def vllm_server(tmp_path):
    """The fake `trl vllm-serve` (tests/fake_vllm/server.py) in this process; yields its state, which records
    every request."""
    spec = importlib.util.spec_from_file_location("fake_vllm_server", REPO / "tests" / "fake_vllm" / "server.py")
    server_module = importlib.util.module_from_spec(spec)
    saved_path, saved_vllm = list(sys.path), {k: v for k, v in sys.modules.items() if k.split(".")[0] == "vllm"}
    spec.loader.exec_module(server_module)  # puts the fake vllm package on sys.path: undone below
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    state = server_module.State(tmp_path, tmp_path / "server.log")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), server_module.make_handler(state))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        sys.path[:] = saved_path
        for name in [k for k in sys.modules if k.split(".")[0] == "vllm"]:
            del sys.modules[name]
        sys.modules.update(saved_vllm)


def completions(state) -> list[dict]:
    return [body for method, path, body in state.requests if path == "/v1/completions"]


def listings(state) -> int:
    return sum(path == "/v1/models" for _, path, _ in state.requests)


SAMPLING = {"temperature": 0.6, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1}


def test_a_turns_request_to_the_vllm_server_carries_its_budget_stop_sampling_and_seed(vllm_server):
    turns = vllm_backends.VLLMServerTurns(vllm_server.url, SAMPLING, seed=3, step=4, rank=1)

    async def play():
        try:
            return await asyncio.gather(turns.sample([5, 6, 7], 4, "</think>", (2, 1, "think")),
                                        turns.sample([8, 9], 6, None, (0, 1, "reply")),
                                        turns.sample([8, 9, 10], 5, None, (1, 2, "reply")))
        finally:
            await turns.aclose()
    sampled = asyncio.run(play())
    assert listings(vllm_server) == 1  # however many turns start at once
    bodies = sorted(completions(vllm_server), key=lambda body: len(body["prompt"]) * 10 + body["max_tokens"])
    common_fields = {"model": "fake-policy", "return_token_ids": True, "return_tokens_as_token_ids": True,
                     "include_stop_str_in_output": True, "logprobs": 0, **SAMPLING}
    assert bodies == [
        {**common_fields, "prompt": [8, 9], "max_tokens": 6, "stop": None, "seed": turns.request_seed((0, 1, "reply"))},
        {**common_fields, "prompt": [5, 6, 7], "max_tokens": 4, "stop": ["</think>"],
         "seed": turns.request_seed((2, 1, "think"))},
        {**common_fields, "prompt": [8, 9, 10], "max_tokens": 5, "stop": None,
         "seed": turns.request_seed((1, 2, "reply"))}]
    for (ids, logprobs), budget in zip(sampled, (4, 6, 5)):
        assert 1 <= len(ids) <= budget and len(logprobs) == len(ids)


def test_a_turns_seed_depends_on_each_of_run_seed_step_rank_dialogue_turn_and_phase():
    """Not on the order the requests are sent in; changing any one of the six parts gives another seed, every
    seed one vLLM takes (below 2**31); the value is sha256 of the six as JSON (a resumed run's seeds are the
    uninterrupted run's, whatever Python's hash seed)."""
    base = (3, 4, 1, 2, 1, "think")

    def seed_of(parts):
        return vllm_backends.VLLMServerTurns("http://127.0.0.1:9", SAMPLING, *parts[:3]).request_seed(parts[3:])

    seeds = {seed_of(base)}
    for place, other in enumerate((4, 5, 0, 7, 2, "reply")):
        seeds.add(seed_of(base[:place] + (other,) + base[place + 1:]))
    assert len(seeds) == 7 and all(0 <= seed < 2**31 for seed in seeds)
    digest = hashlib.sha256(json.dumps(list(base)).encode()).digest()
    assert seed_of(base) == int.from_bytes(digest[:4], "big") // 2


@pytest.mark.parametrize("rank", [0, 1])
def test_a_trainers_turns_take_its_server_sampling_step_and_own_rank(rank):
    generation_settings = SimpleNamespace(server_base_url=None, server_host="10.0.0.5", server_port=8123,
                                          temperature=0.6, top_p=0.9, top_k=7, min_p=0.05, repetition_penalty=1.1,
                                          generation_kwargs={"presence_penalty": 0.5})
    trainer = SimpleNamespace(vllm_generation=generation_settings, args=SimpleNamespace(seed=3),
                              state=SimpleNamespace(global_step=4), accelerator=SimpleNamespace(process_index=rank))
    turns = vllm_backends.VLLMServerTurns.of_trainer(trainer)
    assert str(turns.client.base_url) == "http://10.0.0.5:8123/v1/"
    assert turns.sampling == {**SAMPLING, "presence_penalty": 0.5}
    expected = vllm_backends.VLLMServerTurns("http://127.0.0.1:9", SAMPLING, seed=3, step=4, rank=rank)
    assert turns.request_seed((2, 1, "reply")) == expected.request_seed((2, 1, "reply"))
    generation_settings.server_base_url = "http://example:9000"
    assert str(vllm_backends.VLLMServerTurns.of_trainer(trainer).client.base_url) == "http://example:9000/v1/"


class RecordingVLLMClient:
    """TRL's VLLMClient.generate at the edge: the arguments bound to its real signature (an unknown or misspelled
    one fails as TRL would), each prompt's completion a function of it, one logprob list per token."""

    def __init__(self):
        from trl.generation.vllm_client import VLLMClient

        self.signature, self.calls = inspect.signature(VLLMClient.generate), []

    def generate(self, **kwargs):
        bound = self.signature.bind(self, **kwargs)
        bound.apply_defaults()
        self.calls.append({k: v for k, v in bound.arguments.items() if k != "self"})
        ids = [[prompt[-1] + 1] * (kwargs["max_tokens"] + 2) for prompt in kwargs["prompts"]]  # longer than asked
        return {"completion_ids": ids, "logprobs": [[[-0.5]] * len(row) for row in ids]}


@pytest.mark.parametrize("stop", [None, "</think>"])
def test_ppos_vllm_server_generator_asks_once_per_budget_with_its_temperature_and_stop(stop):
    generator = vllm_backends.VLLMServerGenerator.__new__(vllm_backends.VLLMServerGenerator)
    generator.client, generator.temperature = RecordingVLLMClient(), 0.65
    sampled, logprobs = generator([[1, 2], [3], [4, 5, 6]], [5, 3, 5], stop=stop)
    calls = generator.client.calls
    assert [(c["prompts"], c["max_tokens"]) for c in calls] == [([[3]], 3), ([[1, 2], [4, 5, 6]], 5)]
    for call in calls:
        assert (call["n"], call["temperature"], call["logprobs"]) == (1, 0.65, 0)
        assert call["generation_kwargs"] == ({"stop": [stop], "include_stop_str_in_output": True} if stop else None)
    assert sampled == [[3] * 5, [4] * 3, [7] * 5] and [len(row) for row in logprobs] == [5, 3, 5]
    turns = generator.__class__.turns(SimpleNamespace(host="10.0.0.5", port=8123, temperature=0.65), 3, 4, 1)
    assert turns.sampling["temperature"] == 0.65 and str(turns.client.base_url) == "http://10.0.0.5:8123/v1/"


def test_the_evaluations_vllm_engine_samples_each_row_with_its_budget_stop_and_a_seed_of_its_own(monkeypatch):
    sys.path.insert(0, str(REPO / "tests" / "fake_vllm"))
    try:
        import vllm  # the fake: SamplingParams accepts only vLLM 0.31's fields
    finally:
        sys.path.pop(0)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    seen = []

    class Engine:
        def generate(self, prompts, params, use_tqdm=True):
            seen.append((prompts, params))
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[p["prompt_token_ids"][-1]] * 2)])
                    for p in prompts]

    generator = vllm_backends.VLLMEngineGenerator.__new__(vllm_backends.VLLMEngineGenerator)
    generator.llm, generator.temperature, generator.top_p = Engine(), 0.4, 0.8
    import torch

    torch.manual_seed(7)
    assert generator([[1], [2, 3]], [4, 9], stop="</think>")[0] == [[1, 1], [3, 3]]
    torch.manual_seed(7)
    generator([[1], [2, 3]], [4, 9])
    (prompts, first), (_, again) = seen
    assert prompts == [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2, 3]}]
    assert [(p.temperature, p.top_p, p.max_tokens, p.stop, p.include_stop_str_in_output) for p in first] == [
        (0.4, 0.8, 4, ["</think>"], True), (0.4, 0.8, 9, ["</think>"], True)]
    assert [p.stop for p in again] == [None, None]
    assert first[0].seed != first[1].seed and [p.seed for p in first] == [p.seed for p in again]


# --------------------------------------------------------------------------------------------
# The evaluations' flags on each backend
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("evaluation", ["sentient", "general"])
def test_an_evaluations_sampling_flags_reach_the_vllm_engine_and_transformers(evaluation, monkeypatch, tokenizer):
    argv = flags(temperature=0.4, top_p=0.8, seed=5)
    args = eval_arguments(argv)[0] if evaluation == "sentient" else general_arguments(argv)
    made = []
    monkeypatch.setattr(vllm_backends, "VLLMEngineGenerator", lambda *given: made.append(given))
    generation.load_generator(eval_arguments([*argv, "--use_vllm"])[0] if evaluation == "sentient"
                              else general_arguments([*argv, "--use_vllm"]), "model-folder", tokenizer)
    assert made == [("model-folder", 0.4, 0.8, 5)]
    import transformers

    weights = SimpleNamespace(eval=lambda: "policy")  # no weights load: the generator's settings are what is read
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda folder: weights)
    config = generation.load_generator(args, "model-folder", tokenizer).generation_config
    assert (config.do_sample, config.temperature, config.top_p, config.top_k) == (True, 0.4, 0.8, 0)
    assert set(config.eos_token_id) == generation.end_of_turn_ids(tokenizer)
    greedy = generation.sampling_config(tokenizer, 0.0, 0.8)
    assert greedy.do_sample is False


def test_the_sentient_benchmarks_budgets_and_schedule_reach_its_dialogues():
    args, _ = eval_arguments(flags(think=True, max_think_tokens=11, max_reply_tokens=22, max_dialogue_tokens=999,
                                   batch_size=3, rollout="lockstep"))
    dialogues = eval_sentient.benchmark_dialogues(args)
    assert (dialogues.think, dialogues.max_think_tokens, dialogues.max_reply_tokens, dialogues.max_dialogue_tokens,
            dialogues.simulator_concurrency, dialogues.rollout) == (True, 11, 22, 999, 3, "lockstep")
    assert (dialogues.start_emotion, dialogues.max_turns) == (simulator.BENCHMARK_START_EMOTION,
                                                              simulator.BENCHMARK_MAX_TURNS)


# --------------------------------------------------------------------------------------------
# Checks both ways
# --------------------------------------------------------------------------------------------

def test_the_backend_decides_whether_a_runner_takes_a_chat(tokenizer):
    """Both ways: a chat with --backend rule is refused, as is no chat with an LLM backend; each right pairing runs."""
    rule = simulator.SimulatorArguments()
    llm = simulator.SimulatorArguments(backend="llm", simulator_model="m", base_url="http://127.0.0.1:9/v1")
    chat = rollout.make_chat(llm)
    for simulator_args, given in ((rule, chat), (llm, None)):
        with pytest.raises(ValueError):
            rollout.DialogueRunner(tokenizer, rollout.DialogueArguments(), simulator_args, given)
    for simulator_args, given in ((rule, None), (llm, chat)):
        rollout.DialogueRunner(tokenizer, rollout.DialogueArguments(), simulator_args, given).close()


@pytest.mark.parametrize("word", ["true", "True", "latest", "LATEST"])
def test_resume_from_checkpoint_true_or_latest_is_the_newest_whole_checkpoint(word, tmp_path):
    for step in (2, 10, 9):  # by step, not by name: checkpoint-9 is older than checkpoint-10
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    from preflight import resume_checkpoint

    found = resume_checkpoint(SimpleNamespace(resume_from_checkpoint=word, output_dir=str(tmp_path)))
    assert Path(found) == tmp_path / "checkpoint-10"
    named = resume_checkpoint(SimpleNamespace(resume_from_checkpoint=str(tmp_path / "checkpoint-9"),
                                              output_dir=str(tmp_path)))
    assert Path(named) == tmp_path / "checkpoint-9"


# --------------------------------------------------------------------------------------------
# Timing knobs, by what they change
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("wait, expected", [(0.0, [[0], [1], [2]]), (0.45, [[0, 1], [2]]), (5.0, [[0, 1, 2]])])
def test_batch_wait_decides_how_many_waiting_turns_share_a_call(wait, expected):
    """Three of four dialogues ask for a turn 0.3 s apart; the fourth never does and finishes at 1.3 s (its user
    is slow). A call is made once every unfinished dialogue waits or `wait` after the first began waiting: with no
    wait each call holds one; with 0.45 s, the first two (at 0.45 s), then the third (at 1.05 s); with 5 s, all
    three once the fourth has finished. Margins of 150 ms: a loaded machine's scheduling does not decide it."""
    calls = []

    def generate(contexts, budgets, stop=None):
        calls.append([context[0] for context in contexts])
        return [[9] for _ in contexts], None

    async def play():
        batcher = rollout.TurnBatcher(generate, dialogues=4, wait=wait)

        async def dialogue(index):
            await asyncio.sleep(0.3 * index)
            await batcher.sample([index], 1, None, (index, 0, "reply"))
            batcher.finished()

        async def slow_dialogue():
            await asyncio.sleep(1.3)
            batcher.finished()
        await asyncio.gather(batcher.serve(), *(dialogue(i) for i in range(3)), slow_dialogue())
    asyncio.run(play())
    assert calls == expected


# --------------------------------------------------------------------------------------------
# What else a request carries: its key, and how many are in flight at once
# --------------------------------------------------------------------------------------------

def test_each_endpoint_gets_the_key_its_own_variable_names(monkeypatch):
    """--api_key_env for the simulator, --model_api_key_env for the tested model, each its own variable;
    OPENAI_API_KEY when neither is named."""
    monkeypatch.setenv("SIM_KEY", "simulator-secret")
    monkeypatch.setenv("MODEL_KEY", "model-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "default-secret")
    message = [{"role": "user", "content": "hi"}]
    with FakeOpenAIServer(models=("sim-model", "served"), default="Fine.") as server:
        for key_flags in (["--api_key_env", "SIM_KEY"], []):
            _, simulator_args = TRAINERS["ppo"](flags(backend="llm", base_url=server.base_url,
                                                      simulator_model="sim-model") + key_flags)
            asyncio.run(rollout.make_chat(simulator_args).complete(message))
        for key_flags in (["--model_api_key_env", "MODEL_KEY"], []):
            args = general_arguments(flags(model="served", model_base_url=server.base_url) + key_flags)
            eval_general.make_backend(args)([message], 5, seed=0)
    assert server.keys == ["Bearer simulator-secret", "Bearer default-secret", "Bearer model-secret",
                           "Bearer default-secret"]


@pytest.mark.parametrize("concurrency", [2, 5])
def test_at_most_simulator_concurrency_users_call_their_endpoint_at_once(concurrency, tokenizer):
    """Five dialogues whose users answer after 0.1 s: at most --simulator_concurrency requests in flight, their
    openings as their turns."""
    def generate(contexts, budgets, stop=None):
        reply = tokenizer("I hear you.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return [reply[:budget] for budget in budgets], None

    with FakeOpenAIServer(respond=lambda body: {"hang": 0.1, "text": simulated_user(body)}) as server:
        dialogue_args, simulator_args = TRAINERS["grpo"](flags(
            backend="llm", base_url=server.base_url, simulator_model="sim-model", max_turns=1,
            simulator_concurrency=concurrency))
        runner = rollout.DialogueRunner(tokenizer, dialogue_args, simulator_args, rollout.make_chat(simulator_args))
        profiles = simulator.load_profiles(dialogue_args.profiles)[:5]
        openings = runner.openings(profiles)
        runner.run([(profile, openings[profile.id]) for profile in profiles], generate)
        runner.close()
    assert server.most_at_once == concurrency


# --------------------------------------------------------------------------------------------
# More checks both ways
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world, local", [(1, 1), (4, 4), (4, 2)])
def test_an_address_naming_this_machine_is_refused_on_several_nodes_only(world, local, monkeypatch):
    from preflight import check_addresses_on_several_nodes

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    here = simulator.SimulatorArguments(backend="llm", simulator_model="m", base_url="http://localhost:8001/v1")
    there = simulator.SimulatorArguments(backend="llm", simulator_model="m", base_url="http://simhost:8001/v1")
    check_addresses_on_several_nodes(there, "http://vllmhost:8000")
    for simulator_args, server in ((here, None), (there, "http://127.0.0.1:8000")):
        if world > local:
            with pytest.raises(common.InputError, match="names each node itself|named as each node itself"):
                check_addresses_on_several_nodes(simulator_args, server)
        else:
            check_addresses_on_several_nodes(simulator_args, server)


def test_chinese_is_refused_by_the_rule_user_and_played_by_an_llm_user(make_profile):
    endpoint = dict(backend="llm", simulator_model="m", base_url="http://127.0.0.1:9/v1")
    with pytest.raises(simulator.SimulatorError, match="English cues only"):
        simulator.check_backend([make_profile()], simulator.SimulatorArguments(language="zh"))
    simulator.check_backend([make_profile()], simulator.SimulatorArguments(language="zh", **endpoint))
    simulator.check_backend([make_profile()], simulator.SimulatorArguments())


def test_rows_made_with_a_setting_this_run_lacks_or_adds_are_refused(tmp_path):
    """Both ways, and a setting one side lacks counts as differing: a served model's rows (served: true) are not a
    local model's of the same name."""
    made_by = {"model": "m", "seed": 1}
    guards.check_made_by(tmp_path / "rows.jsonl", [{"made_by": dict(made_by)}], made_by)
    for theirs, ours in ((made_by | {"served": True}, made_by), (made_by, made_by | {"served": True}),
                         (made_by, made_by | {"seed": 2})):
        with pytest.raises(common.InputError, match="served|seed"):
            guards.check_made_by(tmp_path / "rows.jsonl", [{"made_by": theirs}], ours)


@pytest.mark.parametrize("schedule", ["async", "lockstep"])
def test_ppos_rollout_pushes_the_weights_then_samples_the_step_with_its_seed(schedule):
    """With a vLLM server: the policy's weights pushed first, then (async) a request per turn seeded by the run's
    seed and this step, or (lockstep) the server itself."""
    done = []
    server = SimpleNamespace(push_weights=lambda policy: done.append(("push", policy)),
                             turns=lambda seed, step, rank: done.append(("turns", seed, step, rank)) or "turns")
    args = train_ppo.parse_arguments(flags(seed=11, rollout=schedule))
    generate = train_ppo.policy_generator(server, "policy", None, args[0], args[1], step=7)
    if schedule == "async":
        assert done == [("push", "policy"), ("turns", 11, 7, 0)] and generate == "turns"
    else:
        assert done == [("push", "policy")] and generate is server


def test_ppos_transformers_rollout_samples_at_its_temperature_with_the_prefix_cache_flag(tokenizer):
    for prefix_cache, temperature in ((["--prefix_cache", "false"], 0.65), ([], 0.9)):
        args = train_ppo.parse_arguments(flags(temperature=temperature) + prefix_cache)
        generate = train_ppo.policy_generator(None, "policy", tokenizer, args[0], args[1], step=0)  # never called
        config = generate.generation_config
        assert (config.do_sample, config.temperature, config.top_k, config.top_p) == (True, temperature, 0, 1.0)
        assert (generate.prefix_cache is None) == bool(prefix_cache)



@pytest.mark.parametrize("word, resumes", [("false", None), ("False", None), ("None", None), ("NONE", None),
                                           ("true", "true"), ("runs/x/checkpoint-3", "runs/x/checkpoint-3")])
def test_grpos_resume_flag_reads_false_and_none_in_any_case_as_a_new_run(word, resumes):
    training_args = train_grpo.parse_arguments(["--resume_from_checkpoint", word])[3]
    assert training_args.resume_from_checkpoint == resumes


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_a_simulator_temperature_of_zero_is_sent_as_zero(temperature):
    """0 is a value (greedy, reproducible users), not "unset": it reaches the request as given."""
    with FakeOpenAIServer(default="Fine.") as server:
        _, simulator_args = TRAINERS["grpo"](flags(backend="llm", base_url=server.base_url, simulator_model="sim-model",
                                                   simulator_temperature=temperature))
        asyncio.run(rollout.make_chat(simulator_args).complete([{"role": "user", "content": "hi"}]))
    assert server.requests[0]["temperature"] == temperature


def test_a_resumed_launch_keeps_the_runs_recorded_interruptions_and_takes_the_marker_over(tmp_path):
    """mark_run_folder on a resume: the interruptions the run recorded stay, the launch id is the new launch's."""
    folder = tmp_path / "run"
    guards.mark_run_folder(folder, "train_ppo.py", "m", {"seed": 1})  # the first launch (this process holds it)
    guards.note_output(folder / guards.RUN_MARKER)
    guards.note_interruption(folder, 2, folder / "checkpoint-3", "resume")
    launch = json.loads((folder / guards.RUN_MARKER).read_text())["launch"]
    guards.mark_run_folder(folder, "train_ppo.py", "m", {"seed": 1})
    made = json.loads((folder / guards.RUN_MARKER).read_text())
    assert made["interrupted"] == [{"after_step": 2, "checkpoint": str(folder / "checkpoint-3")}]
    assert made["launch"] != launch and (made["script"], made["model"], made["settings"]) == ("train_ppo.py", "m",
                                                                                                 {"seed": 1})
