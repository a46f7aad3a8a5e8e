"""The evaluations' local models: what training writes is tested through transformers and through
--use_vllm, here against a fake vLLM 0.31.0 (tests/fake_vllm, which logs what the engine was given). The
engine gets a full model folder with its tokenizer, no transformers model is loaded beside it, and every
request carries its own seed and top_p, so a resumed run samples what the uninterrupted one did."""
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import REPO, SlowUser

import common
import guards
import eval_general
import eval_sentient
import simulator
from eval_general import GeneralEvalArguments
from eval_sentient import EvalArguments

FAKE_VLLM = REPO / "tests" / "fake_vllm"


@pytest.fixture
def vllm_log(monkeypatch, tmp_path):
    """The fake vllm importable for this test only; returns a reader of its log's events of one kind."""
    log = tmp_path / "vllm.log"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.syspath_prepend(str(FAKE_VLLM))
    yield lambda event: [entry for entry in map(json.loads, log.read_text().splitlines()) if entry["event"] == event]
    for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
        del sys.modules[name]  # later tests run without vLLM, as on a machine that has none


@pytest.fixture
def merge_cache(monkeypatch, tmp_path):
    """Merged adapters go to this test's own cache, not the repository's."""
    monkeypatch.setenv("RLVER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "merged"


def no_transformers_model(*args, **kwargs):
    raise AssertionError("a transformers model was loaded")


def save_adapter(tiny_model_dir, folder):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=4, init_lora_weights=False))
    model.save_pretrained(folder)


@pytest.fixture(scope="session")
def grpo_folder(tiny_model_dir, tmp_path_factory):
    """A LoRA adapter and its tokenizer, as train_grpo.py (TRL's save_model) writes them."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("grpo-run")
    save_adapter(tiny_model_dir, folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def ppo_folder(tiny_model_dir, tmp_path_factory):
    """A LoRA adapter alone, as train_ppo.py writes it (policy.save_pretrained, no tokenizer)."""
    folder = tmp_path_factory.mktemp("ppo-run")
    save_adapter(tiny_model_dir, folder)
    return folder


def run_sentient(model, output, **options):
    options = dict(limit=2, batch_size=2, max_reply_tokens=6, bootstrap_samples=100) | options
    return eval_sentient.evaluate(EvalArguments(model=str(model), output=str(output), **options),
                                  simulator.SimulatorArguments())  # the rule user


def run_general(model, output_dir, **options):
    options = dict(tasks="humaneval", limit=2, max_new_tokens=8, batch_size=1) | options
    return eval_general.evaluate(GeneralEvalArguments(model=str(model), output_dir=str(output_dir), **options))


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------------------------------
# What reaches the engine
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("evaluation", ["sentient", "general"])
def test_with_use_vllm_no_transformers_model_is_loaded(evaluation, tiny_model_dir, vllm_log, monkeypatch, tmp_path):
    """The engine takes 90% of the GPU when it starts: a transformers copy of the model there first
    would leave it too little."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_transformers_model)
    if evaluation == "sentient":
        assert run_sentient(tiny_model_dir, tmp_path / "r.jsonl", use_vllm=True)["n"] == 2
    else:
        assert run_general(tiny_model_dir, tmp_path / "out", use_vllm=True)["humaneval"]["items"] == 2
    (engine,) = vllm_log("LLM_init")
    assert engine["model"] == str(tiny_model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("evaluation", ["sentient", "general"])
@pytest.mark.parametrize("use_vllm", [False, True], ids=["transformers", "vllm"])
@pytest.mark.parametrize("trained", ["grpo_folder", "ppo_folder"])
def test_a_training_output_folder_is_evaluated(trained, use_vllm, evaluation, request, vllm_log, merge_cache,
                                               tmp_path):
    """GRPO's LoRA folder (with tokenizer) and PPO's (without): merged onto the base once, into a cache
    folder with a tokenizer, which is what both backends load."""
    folder = request.getfixturevalue(trained)
    if evaluation == "sentient":
        assert run_sentient(folder, tmp_path / "r.jsonl", use_vllm=use_vllm)["n"] == 2
    else:
        assert run_general(folder, tmp_path / "out", use_vllm=use_vllm)["humaneval"]["items"] == 2
    (merged,) = merge_cache.iterdir()
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {f.name for f in merged.iterdir()}
    if use_vllm:
        (engine,) = vllm_log("LLM_init")
        assert engine["model"] == str(merged)


def test_the_packaged_model_s_short_name_reaches_vllm_as_its_converted_folder(packaged_model, vllm_log, tmp_path):
    assert run_sentient(common.PACKAGED_MODEL, tmp_path / "r.jsonl", use_vllm=True, limit=1)["n"] == 1
    (engine,) = vllm_log("LLM_init")
    assert engine["model"] == packaged_model


# --------------------------------------------------------------------------------------------
# Turning --model into a loadable folder
# --------------------------------------------------------------------------------------------

def test_an_adapter_is_merged_once_and_again_after_retraining(ppo_folder, merge_cache, monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = shutil.copytree(ppo_folder, tmp_path / "run")
    first = guards.loadable_model(str(folder))
    with monkeypatch.context() as patch:
        patch.setattr(AutoModelForCausalLM, "from_pretrained", no_transformers_model)
        assert guards.loadable_model(str(folder) + "/") == first  # from the cache
    weights = folder / "adapter_model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # saved again
    assert guards.loadable_model(str(folder)) != first
    assert sorted(f.name for f in merge_cache.iterdir()) == sorted(  # complete folders only, no .partial left
        [os.path.basename(first), os.path.basename(guards.loadable_model(str(folder)))])


def test_a_folder_without_a_tokenizer_of_its_own_or_its_base_s_is_refused_naming_what_is_missing(
        ppo_folder, tiny_model_dir, merge_cache, tmp_path):
    model_only = tmp_path / "ppo-full"
    model_only.mkdir()
    for name in ("config.json", "model.safetensors"):  # train_ppo.py with use_peft false
        shutil.copy(tiny_model_dir / name, model_only)
    with pytest.raises(common.InputError, match=r"ppo-full holds a model but no tokenizer "
                       r"\(tokenizer_config.json\).*no adapter_config.json"):
        guards.loadable_model(str(model_only))
    adapter = shutil.copytree(ppo_folder, tmp_path / "ppo-adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": str(model_only)}))
    with pytest.raises(common.InputError, match=r"ppo-adapter holds no tokenizer \(tokenizer_config.json\), "
                       r"nor does its base model '.*ppo-full'"):
        guards.loadable_model(str(adapter))
    (tmp_path / "empty").mkdir()
    with pytest.raises(common.InputError, match=r"neither a model \(config.json\) nor a PEFT adapter"):
        guards.loadable_model(str(tmp_path / "empty"))


# --------------------------------------------------------------------------------------------
# Seeds and top_p
# --------------------------------------------------------------------------------------------

def test_a_resumed_sentient_run_samples_what_the_whole_run_did(tiny_model_dir, vllm_log, tmp_path):
    """Two scenarios in two batches: the rerun after the first batch plays the second as the whole run
    did, because each request's seed comes from its batch's seed, not from the engine's history."""
    options = dict(batch_size=1, top_p=0.9, seed=3, use_vllm=True)
    whole = tmp_path / "whole.jsonl"
    run_sentient(tiny_model_dir, whole, **options)
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_text(whole.read_text().splitlines()[0] + "\n")  # killed after its first batch
    run_sentient(tiny_model_dir, resumed, **options)
    assert rows(resumed) == rows(whole)
    other_seed = tmp_path / "other.jsonl"
    run_sentient(tiny_model_dir, other_seed, **options | {"seed": 4})
    assert rows(other_seed) != rows(whole)
    calls = vllm_log("LLM_generate")
    assert all(top_p == 0.9 for call in calls for top_p in call["top_p"])
    assert all(isinstance(seed, int) for call in calls for seed in call["seeds"])


def test_a_resumed_general_run_samples_what_the_whole_run_did(tiny_model_dir, vllm_log, tmp_path):
    options = dict(temperature=0.7, top_p=0.8, seed=5, use_vllm=True)
    run_general(tiny_model_dir, tmp_path / "whole", **options)
    whole = rows(tmp_path / "whole" / "humaneval.jsonl")
    (tmp_path / "resumed").mkdir()
    (tmp_path / "resumed" / "humaneval.jsonl").write_text(json.dumps(whole[0]) + "\n")
    run_general(tiny_model_dir, tmp_path / "resumed", **options)
    assert rows(tmp_path / "resumed" / "humaneval.jsonl") == whole
    assert {top_p for call in vllm_log("LLM_generate") for top_p in call["top_p"]} == {0.8}
    assert {t for call in vllm_log("LLM_generate") for t in call["temperature"]} == {0.7}


def test_the_engine_generator_gives_each_context_its_own_seed_and_the_options_their_places(tiny_model_dir,
                                                                                          vllm_log):
    """Seeds drawn from torch's RNG over vLLM's whole seed range (31 bits), one per context."""
    import torch

    import generation

    options = SimpleNamespace(use_vllm=True, temperature=0.7, top_p=0.8, seed=5)
    generate = generation.load_generator(options, str(tiny_model_dir), None)
    torch.manual_seed(0)
    completions, logprobs = generate([[1, 2, 3]] * 40, [4] * 39 + [2])
    assert len(completions) == 40 and logprobs is None and 1 <= len(completions[-1]) <= 2
    [init] = vllm_log("LLM_init")
    [call] = vllm_log("LLM_generate")
    assert init["kwargs"] == {"seed": "5"} and set(call["temperature"]) == {0.7} and set(call["top_p"]) == {0.8}
    assert len(set(call["seeds"])) == 40 and all(0 <= seed < 2**31 - 1 for seed in call["seeds"])
    assert max(call["seeds"]) > 2**30  # from the whole range


def test_the_sentient_command_line_passes_top_p_and_each_context_gets_its_own_completion(tiny_model_dir, tmp_path):
    """Through tests/fake_vllm/run.py, which checks every generate call of the engine generator."""
    log = tmp_path / "vllm.log"
    finished = subprocess.run(
        [sys.executable, str(FAKE_VLLM / "run.py"), "eval_sentient.py", "--model", str(tiny_model_dir), "--use_vllm",
         "--top_p", "0.95", "--limit", "2", "--max_reply_tokens", "6", "--bootstrap_samples", "100",
         "--output", str(tmp_path / "r.jsonl")],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "FAKE_VLLM_LOG": str(log)})
    assert finished.returncode == 0, finished.stderr
    events = [json.loads(line) for line in log.read_text().splitlines()]
    calls = [e for e in events if e["event"] == "generate_call"]
    assert calls and all(verdict == "own" for call in calls for verdict in call["verdicts"])
    assert {top_p for e in events if e["event"] == "LLM_generate" for top_p in e["top_p"]} == {0.95}


# --------------------------------------------------------------------------------------------
# The fake engine's lengths, as vLLM 0.31's
# --------------------------------------------------------------------------------------------

def test_the_fake_engine_refuses_a_prompt_filling_max_model_len_and_cuts_a_completion_at_it(tiny_model_dir, vllm_log):
    """vLLM 0.31's LLM.generate (the evaluations' --use_vllm, TRL's colocate mode) refuses a prompt of
    max_model_len tokens or more with its VLLMValidationError (no ValueError), and otherwise stops a
    completion where prompt + completion reach max_model_len, whatever max_tokens asked: unlike its
    server, it refuses no prompt for max_tokens (tests/fake_vllm/vllm/_fakegen.py)."""
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError

    llm = LLM(model=str(tiny_model_dir), max_model_len=40)
    [output] = llm.generate([{"prompt_token_ids": [7] * 38}], SamplingParams(max_tokens=30), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 2 and output.outputs[0].finish_reason == "length"
    with pytest.raises(VLLMValidationError, match="prompt"):
        llm.generate([{"prompt_token_ids": [7] * 40}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert not issubclass(VLLMValidationError, ValueError)


def test_sentient_rows_are_the_same_with_rollout_async_and_lockstep(tiny_model_dir, vllm_log, tmp_path):
    """Transformers with the rule user, who answers at once: async's generate calls hold lockstep's scenarios,
    so the same sampled rows. The vLLM engine with an LLM simulator answering in random order: the same rows
    under greedy decoding (tests/test_rollout_async.py has the other pairings)."""
    from fake_openai import FakeOpenAIServer

    outputs = {}
    for schedule in ("lockstep", "async"):
        outputs[schedule] = tmp_path / f"{schedule}.jsonl"
        run_sentient(tiny_model_dir, outputs[schedule], limit=3, batch_size=3, rollout=schedule)
    assert [row["history"] for row in rows(outputs["async"])] == [row["history"] for row in rows(outputs["lockstep"])]

    with FakeOpenAIServer(respond=SlowUser(seed=0, most=0.05)) as server:
        llm_user = simulator.SimulatorArguments(backend="llm", base_url=server.base_url, simulator_model="sim-model")
        for schedule in ("lockstep", "async"):
            outputs[schedule] = tmp_path / f"llm-{schedule}.jsonl"
            eval_sentient.evaluate(EvalArguments(model=str(tiny_model_dir), output=str(outputs[schedule]), limit=3,
                                                 batch_size=3, max_reply_tokens=6, bootstrap_samples=100,
                                                 temperature=0.0, use_vllm=True, rollout=schedule), llm_user)
    assert [row["history"] for row in rows(outputs["async"])] == [row["history"] for row in rows(outputs["lockstep"])]
