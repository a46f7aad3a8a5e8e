"""GRPO's vLLM paths rehearsed on CPU: TRL's real VLLMGeneration and VLLMClient on 2 gloo ranks, against the fake
vllm of tests/fake_vllm (its `LLM` for colocate mode, its `trl vllm-serve` for server mode); and its path without
vLLM, the trainer's own model, down to DeepSpeed ZeRO-3 on 2 CPU ranks."""
import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import SlowUser, serving, two_ranks
from fake_openai import FakeOpenAIServer

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FAKE = TESTS / "fake_vllm"


@pytest.fixture
def fake_server(tiny_model_dir, tmp_path):
    """The fake `trl vllm-serve`, max_model_len the model's; yields (base URL, port, its request log)."""
    log = tmp_path / "server.log"
    with serving(tiny_model_dir, log) as url:
        yield url, int(url.rsplit(":", 1)[1]), log


def server_events(log: Path, event: str) -> list[dict]:
    return [row for row in map(json.loads, log.read_text().splitlines()) if row["event"] == event]


def test_the_fake_server_refuses_a_prompt_longer_than_max_model_len_minus_max_tokens_as_vllm_does(tiny_model_dir,
                                                                                                    tmp_path):
    """vLLM 0.31's /v1/completions checks each prompt against max_model_len - max_tokens (its renderer's
    TokenizeParams._token_len_check) and answers HTTP 400; a prompt that fits exactly is served."""
    import requests

    def status(prompts, max_tokens):
        response = requests.post(f"{url}/v1/completions", json={"model": "fake-policy", "prompt": prompts,
                                                                "max_tokens": max_tokens, "return_token_ids": True})
        return response.status_code

    with serving(tiny_model_dir, tmp_path / "server.log", max_model_len=40) as url:
        assert status([[7] * 30], 10) == 200  # 30 + 10 = max_model_len: the boundary vLLM accepts
        assert status([[7] * 31], 10) == 400
        assert status([[7] * 5, [7] * 31], 10) == 400  # any prompt of the request
        assert status([[7] * 5], 41) == 400  # max_tokens alone past max_model_len
    refused = server_events(tmp_path / "server.log", "completions_refused")
    assert [(row["longest_prompt"], row["max_tokens"]) for row in refused] == [(31, 10), (31, 10), (5, 41)]


def case_results(finished: subprocess.CompletedProcess, out_dir: Path) -> list[dict]:
    assert finished.returncode == 0, finished.stderr[-3000:]
    return [json.loads(line) for rank in (0, 1) for line in (out_dir / f"rank{rank}.jsonl").open()]


def assert_every_rank_got_its_own_completions(results: list[dict]) -> None:
    assert len(results) == 14  # 7 cases x 2 ranks
    for result in results:
        assert "raised" not in result, result
        assert result["completions"] == result["contexts"], result
        assert set(result["verdicts"]) <= {"own"} and result["logprobs_aligned"], result


def test_server_mode_gives_each_rank_its_own_completions_with_its_own_budget(tiny_model_dir, tmp_path):
    """The ranks hold different numbers of contexts with different budgets (tests/vllm_ranks.py), the server
    runs at max_model_len 64 and a 50-token context has a budget of 10 beside others of 30: each budget gets its
    own request, which no rank's 50-token context makes overshoot, and each rank its own completions."""
    log = tmp_path / "server.log"
    with serving(tiny_model_dir, log, max_model_len=64) as url:
        assert_every_rank_got_its_own_completions(case_results(
            two_ranks(TESTS / "vllm_ranks.py", tmp_path, "server", 1, tiny_model_dir, url), tmp_path))
    assert not server_events(log, "completions_refused")
    completions = server_events(log, "completions")
    # one request per distinct budget of a call, in increasing order; none for the call in which every
    # dialogue had ended
    assert [call["max_tokens"] for call in completions] == [30, 30, 30, 30, 3, 30, 10, 12, 30]
    assert [call["n_prompts"] for call in completions] == [4, 4, 4, 4, 4, 4, 2, 2, 4]  # 2 a rank, dummies padding


def test_colocate_mode_with_tensor_parallelism_gives_each_rank_its_own_completions(tiny_model_dir, tmp_path):
    assert_every_rank_got_its_own_completions(case_results(
        two_ranks(TESTS / "vllm_ranks.py", tmp_path, "colocate", 2, tiny_model_dir), tmp_path))


def generate_calls(log: Path) -> list[dict]:
    return [row for row in map(json.loads, log.read_text().splitlines()) if row["event"] == "generate_call"]


def grpo_command(tiny_model_dir, output_dir, *flags):
    return [FAKE / "run.py", "train_grpo.py", "--model_name_or_path", tiny_model_dir, "--output_dir", output_dir,
            "--num_generations", "2", "--per_device_train_batch_size", "4", "--use_vllm", "--use_cpu", "true", *flags]


def test_grpo_in_server_mode_lockstep_trains_on_two_ranks_whose_dialogues_end_at_different_turns(tiny_model_dir,
                                                                                                 tmp_path):
    log = tmp_path / "client.log"
    # The user is a scripted endpoint whose changes (up to +-25 a turn from 30, conftest.SlowUser) depend on the
    # dialogue, and the dialogue budget of 200 tokens is reached first by the longer openings: dialogues end at
    # different turns on each rank, and all of them before the 6th turn. The server's max_model_len is the
    # dialogue budget, so a request overshooting it is refused. Both fakes' fixed seeds make the run reproducible.
    with serving(tiny_model_dir, tmp_path / "server.log", max_model_len=200) as url, \
            FakeOpenAIServer(respond=SlowUser(seed=0, most=0)) as user:
        finished = two_ranks(*grpo_command(tiny_model_dir, tmp_path / "run", "--max_steps", "2", "--max_turns", "6",
                                           "--max_reply_tokens", "24", "--max_dialogue_tokens", "200", "--vllm_mode",
                                           "server", "--vllm_server_base_url", url, "--rollout", "lockstep",
                                           "--backend", "llm", "--simulator_model", "sim-model", "--base_url",
                                           user.base_url),
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


def test_grpo_in_server_mode_async_sends_each_turn_after_the_weights_are_pushed(tiny_model_dir, tmp_path):
    """--rollout async (the default) on 2 ranks: each rank sends its dialogues' turns as requests of their own,
    only once rank 0 has pushed the weights (the fake server takes a second a push, and refuses a completion
    asked for meanwhile), each with its own completion and seed."""
    log = tmp_path / "client.log"
    with serving(tiny_model_dir, tmp_path / "server.log", max_model_len=240, update_seconds=1.0) as url:
        finished = two_ranks(*grpo_command(tiny_model_dir, tmp_path / "run", "--max_steps", "2", "--max_turns", "4",
                                           "--max_reply_tokens", "24", "--max_dialogue_tokens", "240", "--vllm_mode",
                                           "server", "--vllm_server_base_url", url),
                             env={"FAKE_VLLM_LOG": str(log)})
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert not server_events(tmp_path / "server.log", "completions_during_weight_update")
    requests = [row for row in map(json.loads, log.read_text().splitlines()) if row["event"] == "turn_request"]
    assert {row["rank"] for row in requests} == {"0", "1"} and not generate_calls(log)
    assert all(row["verdict"] == "own" and row["logprobs_ok"] for row in requests)
    assert len({row["seed"] for row in requests}) == len(requests)
    assert {row["n_prompts"] for row in server_events(tmp_path / "server.log", "completions")} == {1}


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


# --------------------------------------------------------------------------------------------
# Without vLLM: the trainer's own model generates (generation.trainer_generator)
# --------------------------------------------------------------------------------------------

def grpo_trainer(model, accelerator, tokenizer, **args):
    """What trainer_generator reads of TRL's GRPOTrainer."""
    from transformers import GenerationConfig

    sampling = GenerationConfig(do_sample=True, top_k=0, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)
    return SimpleNamespace(model_wrapped=model, accelerator=accelerator, processing_class=tokenizer,
                           generation_config=sampling,
                           args=SimpleNamespace(**{"use_vllm": False, "ds3_gather_for_generation": True,
                                                   "gradient_checkpointing_kwargs": None, **args}))


def test_gradient_checkpointing_comes_back_after_a_rollout_with_the_runs_own_kwargs(tiny_model_dir):
    """TRL turns checkpointing off while generating and back on after; GRPOTrainer passes the run's
    gradient_checkpointing_kwargs, else transformers' defaults (use_reentrant=False) would replace them."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import generation

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    kwargs = {"use_reentrant": True}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    trainer = grpo_trainer(model, Accelerator(cpu=True), tokenizer, gradient_checkpointing_kwargs=kwargs)
    with generation.trainer_generator(trainer) as generate:
        assert not model.model.layers[0].gradient_checkpointing  # off while generating
        generate([[1, 2, 3]], [2])
    layer = model.model.layers[0]
    assert layer.gradient_checkpointing and layer._gradient_checkpointing_func.keywords == kwargs


ZERO3_ROLLOUT = '''"""generation.trainer_generator under DeepSpeed ZeRO-3 on 2 CPU ranks (gloo), weights gathered
for generation, then not: rank 0 holds 2 contexts in each of 3 calls, rank 1 only in the first (its dialogues then
ended). Each rank saves the lengths it sampled in each call and its model's forward passes to argv[2].rank<N>."""
import json
import sys
from datetime import timedelta
from types import SimpleNamespace

import deepspeed.comm.torch
import torch
from accelerate import Accelerator, InitProcessGroupKwargs
from accelerate.state import PartialState
from accelerate.utils import DeepSpeedPlugin
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.integrations import HfDeepSpeedConfig

import generation

find_backend = PartialState._prepare_backend


def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
    found, distributed_type = find_backend(self, cpu, sagemaker_dp, backend)
    return found or "gloo", distributed_type  # accelerate finds no backend without a GPU


PartialState._prepare_backend = prepare_backend
deepspeed.comm.torch.build_shm_op = lambda: None  # CPU-only, compiled at first use (tests/test_ppo_gpu_paths.py)
model_dir, output = sys.argv[1], sys.argv[2]
config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "zero_allow_untested_optimizer": True}
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
                          kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=40))])
zero3 = HfDeepSpeedConfig(config)  # as GRPOTrainer's arguments set it: transformers then generates in lockstep
rank = accelerator.process_index
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)
forwards = [0]
model.register_forward_hook(lambda *args: forwards.__setitem__(0, forwards[0] + 1))
engine, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
calls = []
for gather in (True, False):
    sampling = GenerationConfig(do_sample=True, top_k=0, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)
    trainer = SimpleNamespace(model_wrapped=engine, accelerator=accelerator, processing_class=tokenizer,
                              generation_config=sampling, args=SimpleNamespace(
                                  use_vllm=False, ds3_gather_for_generation=gather, gradient_checkpointing_kwargs=None))
    with generation.trainer_generator(trainer) as generate:
        for call in range(3):
            contexts = [[1, 2, 3, 100 + call], [4, 5, 100 + call]] if rank == 0 or call == 0 else []
            sampled, _ = generate(contexts, [6] * len(contexts))
            calls.append([len(ids) for ids in sampled])
accelerator.wait_for_everyone()
with open(f"{output}.rank{rank}", "w") as out:
    json.dump({"calls": calls, "forwards": forwards[0]}, out)
torch.distributed.destroy_process_group()  # gloo may abort (SIGABRT) an exit that leaves its group open
'''


def test_under_zero3_a_rank_whose_dialogues_ended_keeps_generating_in_step_with_the_others(tiny_model_dir, tmp_path):
    """Under ZeRO-3 transformers generates in lockstep (synced_gpus: the ranks agree each step whether all are
    done, and without gathered weights each forward pass gathers the shards): a rank that skipped generate
    once its dialogues ended would leave the others waiting forever. With weights gathered and without, both
    ranks make the same forward passes and rank 0 gets its completions."""
    (tmp_path / "rollout.py").write_text(ZERO3_ROLLOUT)
    finished = two_ranks(tmp_path / "rollout.py", tiny_model_dir, tmp_path / "out", timeout=240,
                         env={"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)})
    assert finished.returncode == 0, finished.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"out.rank{rank}").read_text()) for rank in (0, 1)]
    assert ranks[0]["forwards"] == ranks[1]["forwards"] > 0
    assert all(len(lengths) == 2 and all(0 < n <= 6 for n in lengths) for lengths in ranks[0]["calls"])
    assert ranks[1]["calls"][1:3] == ranks[1]["calls"][4:6] == [[], []]


def lora_policy(model_dir):
    """The tiny model in bf16 with a LoRA adapter whose lora_B is not zero (as after some training)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16),
                          LoraConfig(r=4, lora_alpha=8, init_lora_weights=False))


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_trls_lora_sync_to_vllm_sends_peft_merged_weights_and_leaves_the_bf16_base_bit_identical(tiny_model_dir,
                                                                                                zero_stage):
    """TRL's own sync merges the adapter in place and unmerges it after, which in bf16 moves the frozen base a
    little at every step. Outside ZeRO-3 train_grpo.py makes it merge out of place: 10 syncs leave every weight as
    it was and send, each time, peft's merge under vLLM's names. Under ZeRO-3 TRL's own way is kept (it merges
    gathered copies that DeepSpeed discards)."""
    import copy

    import torch
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    import vllm_backends

    policy = lora_policy(tiny_model_dir)
    sync = SimpleNamespace(model=policy, _dist=DistributedBackend(SimpleNamespace(state=SimpleNamespace(
        deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage) if zero_stage else None))))
    sync._fix_param_name_to_vllm = VLLMGeneration._fix_param_name_to_vllm.__get__(sync)
    sync._iter_named_params = VLLMGeneration._iter_named_params.__get__(sync)
    trls_own = sync._iter_named_params
    vllm_backends.merge_lora_out_of_place(sync)
    if zero_stage == 3:
        assert sync._iter_named_params == trls_own
        return
    before = {name: parameter.detach().clone() for name, parameter in policy.named_parameters()}
    merged = dict(copy.deepcopy(policy).merge_and_unload().named_parameters())
    sent = [dict(sync._iter_named_params()) for _ in range(10)]
    for name, parameter in policy.named_parameters():
        assert torch.equal(parameter, before[name]), name
    assert set(sent[0]) == set(merged)
    for name, weight in merged.items():
        assert sent[-1][name].dtype == torch.bfloat16 and torch.equal(sent[-1][name], weight), name
    # What the test guards against: TRL's in-place round trip, on the same weights, does move them.
    for _ in range(10):
        list(trls_own())
    assert any(not torch.equal(parameter, before[name]) for name, parameter in policy.named_parameters())


LORA_SYNC_RUN = """
import json, os, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from trl.generation import vllm_generation
import train_grpo

frozen = lambda model: {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
first, syncs, original = {}, [], vllm_generation.VLLMGeneration.sync_weights

def sync_weights(self):
    first or first.update(frozen(self.model))
    original(self)
    after = frozen(self.model)
    syncs.append(sum(int((first[n] != after[n]).sum()) for n in after))

vllm_generation.VLLMGeneration.sync_weights = sync_weights
train_grpo.main(sys.argv[3:])
print("SYNCS " + json.dumps(syncs))
"""


def test_grpo_with_lora_and_colocated_vllm_in_bf16_trains_on_an_unmoved_base(tiny_model_dir, tmp_path):
    """train_grpo.py as a user runs it (--use_peft true --dtype bfloat16, vLLM colocated), 3 steps: the frozen base
    weights are what the first sync found after every sync (with TRL's in-place merge, hundreds moved by the
    third)."""
    finished = subprocess.run(
        [sys.executable, "-c", LORA_SYNC_RUN, FAKE, REPO, "--model_name_or_path", tiny_model_dir, "--output_dir",
         tmp_path / "run", "--use_vllm", "--vllm_mode", "colocate", "--use_cpu", "true", "--use_peft", "true",
         "--dtype", "bfloat16", "--max_steps", "3", "--max_turns", "2", "--num_generations", "2",
         "--per_device_train_batch_size", "4", "--max_reply_tokens", "16", "--report_to", "none"],
        capture_output=True, text=True, cwd=REPO, timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"})
    assert finished.returncode == 0, finished.stderr[-3000:]
    syncs = json.loads(finished.stdout.split("SYNCS ")[-1])
    assert len(syncs) == 3 and syncs == [0, 0, 0]


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_a_vllm_shorter_than_the_dialogue_budget_is_refused_before_the_first_rollout(tiny_model_dir, tmp_path, mode):
    """A turn's request keeps context + budget within --max_dialogue_tokens, which vLLM serves only within its
    max_model_len: shorter, the run would fail the first time a dialogue grows past it. The length is vLLM's own
    (the colocated engine's, the server's /server_info), so also at 300 against 400 it is refused at start-up."""
    log = tmp_path / "client.log"
    with serving(tiny_model_dir, tmp_path / "server.log", max_model_len=300) as url:
        length = ["--vllm_server_base_url", url] if mode == "server" else ["--vllm_max_model_length", "300"]
        finished = subprocess.run(
            [sys.executable, *map(str, grpo_command(tiny_model_dir, tmp_path / "run", "--max_steps", "1",
                                                    "--vllm_mode", mode, "--max_dialogue_tokens", "400", *length))],
            cwd=REPO, capture_output=True, text=True, timeout=300,
            env={**os.environ, "FAKE_VLLM_LOG": str(log), "TRL_EXPERIMENTAL_SILENCE": "1"})
    assert finished.returncode != 0
    assert "vLLM's max_model_len is 300, below --max_dialogue_tokens 400" in finished.stderr, finished.stderr[-3000:]
    assert not log.exists() or not generate_calls(log)  # no rollout began
