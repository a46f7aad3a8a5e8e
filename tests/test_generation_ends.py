"""Where a policy turn ends, in every transformers generator: at each end token of the model's generation config
(Qwen2.5-Instruct lists <|im_end|> and <|endoftext|>), as vLLM, TRL's GRPO and ChatSegments end it, not only at
the tokenizer's own end token."""
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import generation

SECOND_END = 0  # <|endoftext|> in the SmolLM2 tokenizer; its own end token is 2, <|im_end|>
BUDGET = 8


@pytest.fixture(scope="module")
def two_end_tokens_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model, its generation config listing two end tokens as Qwen2.5-Instruct's does."""
    folder = tmp_path_factory.mktemp("two-end-tokens")
    shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = [2, SECOND_END]
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


class SecondEndTokenHead(torch.nn.Module):
    """An output head whose every prediction is the second end token."""

    def __init__(self, vocabulary_size: int):
        super().__init__()
        self.vocabulary_size = vocabulary_size

    def forward(self, hidden):
        logits = hidden.new_zeros(*hidden.shape[:-1], self.vocabulary_size)
        logits[..., SECOND_END] = 100.0
        return logits


def emits_second_end_token(model):
    model.lm_head = SecondEndTokenHead(model.config.vocab_size)
    return model


def first_turn(generate, tokenizer) -> list[int]:
    context = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    torch.manual_seed(0)
    sampled, _ = generate([context], [BUDGET])
    return sampled[0]


def test_the_evaluations_generator_ends_a_turn_at_every_end_token_of_the_generation_config(two_end_tokens_dir):
    tokenizer = AutoTokenizer.from_pretrained(two_end_tokens_dir)
    generate = generation.load_generator(SimpleNamespace(use_vllm=False, temperature=0.7, top_p=1.0, seed=0),
                                         str(two_end_tokens_dir), tokenizer)
    emits_second_end_token(generate.model)
    assert first_turn(generate, tokenizer) == [SECOND_END]


def test_a_generator_configured_with_the_tokenizers_end_token_alone_still_ends_where_vllm_would(two_end_tokens_dir):
    """Whatever config it is given, a generator over a tokenizer cuts at every end-of-turn id of that tokenizer's
    model (generation.end_of_turn_ids), so a training rollout and an evaluation end turns where vLLM does."""
    tokenizer = AutoTokenizer.from_pretrained(two_end_tokens_dir)
    model = emits_second_end_token(AutoModelForCausalLM.from_pretrained(two_end_tokens_dir))
    generate = generation.TransformersGenerator(model, tokenizer, GenerationConfig(
        do_sample=True, top_k=0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    assert generate.eos_ids == {2, SECOND_END}
    assert first_turn(generate, tokenizer) == [SECOND_END]


def test_the_ppo_rollout_ends_a_turn_at_every_end_token_of_the_generation_config(two_end_tokens_dir):
    import rollout
    import train_ppo

    tokenizer = AutoTokenizer.from_pretrained(two_end_tokens_dir)
    policy = emits_second_end_token(AutoModelForCausalLM.from_pretrained(two_end_tokens_dir))
    generate = train_ppo.policy_generator(None, policy, tokenizer, train_ppo.PPOArguments(), rollout.DialogueArguments(), 0)
    assert sorted(generate.generation_config.eos_token_id) == [SECOND_END, 2]
    assert first_turn(generate, tokenizer) == [SECOND_END]


@pytest.mark.parametrize("world_size, zero3, fsdp, lockstep", [
    (1, True, False, False), (2, True, False, True), (2, False, True, True), (2, False, False, False),
    (3, True, False, True), (None, True, True, False),  # None: no process group
])
def test_generation_steps_in_lockstep_only_with_sharded_weights_over_several_processes(monkeypatch, world_size,
                                                                                       zero3, fsdp, lockstep):
    import torch
    import transformers.integrations.deepspeed as deepspeed
    import transformers.integrations.fsdp as fsdp_module

    import generation

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: world_size is not None)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: world_size)
    monkeypatch.setattr(deepspeed, "is_deepspeed_zero3_enabled", lambda: zero3)
    monkeypatch.setattr(fsdp_module, "is_fsdp_managed_module", lambda model: fsdp)
    assert generation.generates_in_lockstep(object()) is lockstep
