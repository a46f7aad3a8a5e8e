"""Generating the policy's turns: its system prompt, the think-then-say format, and the sampling backends
(token-id contexts in, sampled ids and their logprobs out). rollout.py plays dialogues with these; the
evaluations sample the tested model with them.

Think-then-say: the policy writes `<think>...</think>`, then its reply; only the text after the last
`</think>` reaches the simulated user (`split_think`).

Backends: `TransformersGenerator` (model.generate, CPU or GPU; by default it reuses the key-value cache of
its previous call, `PrefixCache`, and `--prefix_cache false` turns that off); inside TRL training with
`use_vllm`, `VLLMGenerator` over `trainer.vllm_generation`; elsewhere (train_ppo.py), `VLLMServerGenerator`
over `trl vllm-serve`; for evaluation, `VLLMEngineGenerator` (an in-process engine). These take a batch of
contexts a call. With `--rollout async` on a vLLM server, `VLLMServerTurns` takes one turn a request instead.
The vLLM ones are rehearsed on CPU against a fake vLLM (tests/fake_vllm); none has run on a GPU.
"""
import asyncio
import collections
import copy
import hashlib
import json
from contextlib import contextmanager

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation.utils import GenerateDecoderOnlyOutput

import common

# transformers 5.24 renamed generate's `past_key_values` (argument and output field) to `cache`; the GPU set
# (requirements-gpu.txt) has 5.17, which vLLM 0.31 requires. Both are tested.
GENERATE_CACHE_NAME = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


# --------------------------------------------------------------------------------------------
# Prompt and format: the system prompt, think parsing, the tokens that end a turn
# --------------------------------------------------------------------------------------------

def policy_system_prompt(language: str, think: bool, name: str = "policy", official_prompts=None) -> str:
    """Ours from prompts/ (stripped), or the released code's as it is (`official.OfficialPrompts`)."""
    if official_prompts is not None:
        return official_prompts.policy_prompt(think)
    path = common.PROMPTS_DIR / language / (f"{name}_think.txt" if think else f"{name}.txt")
    return path.read_text(encoding="utf-8").strip()


def policy_messages(language: str, think: bool, name: str = "policy", official_prompts=None) -> list[dict]:
    """The policy's messages before the user's opening: the system prompt, then the worked exchanges of
    prompts/<language>/<name>[_think].examples.jsonl where that file exists (one {"user", "assistant"} object a
    line; the released code's prompts have none). The think prompts have three: told the format in words, the
    packaged SmolLM2 closes a thought in about 8% of turns; shown it in three exchanges, in about half
    (docs/results.md), which leaves RL a format it can learn to keep."""
    messages = [{"role": "system", "content": policy_system_prompt(language, think, name, official_prompts)}]
    path = common.PROMPTS_DIR / language / f"{name}{'_think' if think else ''}.examples.jsonl"
    if official_prompts is None and path.exists():
        for _, where, example in common.json_lines(path, "policy examples"):
            if not (isinstance(example, dict) and all(isinstance(example.get(key), str) for key in ("user", "assistant"))):
                raise common.InputError(f"{where}: an example is an object with the texts \"user\" and \"assistant\"")
            messages += [{"role": "user", "content": example["user"]},
                         {"role": "assistant", "content": example["assistant"]}]
    return messages


def split_think(text: str, think: bool) -> tuple[str, str, bool]:
    """(think_text, reply_text, format_ok) for one raw policy turn. Only reply_text may reach the
    simulator: with an unclosed <think> the whole turn is thought and the reply is empty."""
    if not think:
        return "", text.strip(), True
    closed = text.rfind(THINK_CLOSE)
    if closed < 0:
        if THINK_OPEN in text:
            return text.split(THINK_OPEN, 1)[1].strip(), "", False
        return "", text.strip(), False
    thought, reply = text[:closed], text[closed + len(THINK_CLOSE):].strip()
    well_formed = (thought.lstrip().startswith(THINK_OPEN) and thought.count(THINK_OPEN) == 1
                   and text.count(THINK_CLOSE) == 1 and THINK_OPEN not in reply and bool(reply))
    return thought.replace(THINK_OPEN, "", 1).strip(), reply, well_formed


def end_of_turn_ids(tokenizer) -> set[int]:
    """Every id that ends a policy turn: the tokenizer's end token and the end tokens of the model's
    generation config, which vLLM stops at too (Qwen2.5 ends turns with <|im_end|> or <|endoftext|>)."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} | set(_as_list(getattr(tokenizer, "eos_token_ids", None)))
    try:
        ids |= set(_as_list(GenerationConfig.from_pretrained(tokenizer.name_or_path).eos_token_id))
    except OSError:  # no generation_config.json: the tokenizer's end token is all there is
        pass
    ids.discard(None)
    return ids


def _as_list(value):
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [value]


# --------------------------------------------------------------------------------------------
# Generation backends: contexts of token ids in, sampled ids (and their logprobs) out
# --------------------------------------------------------------------------------------------

def thread_devices() -> tuple:
    """This thread's device choices: CUDA's current device (None while CUDA is not in use) and torch's default
    device. Both are per thread."""
    return (torch.cuda.current_device() if torch.cuda.is_initialized() else None, torch.get_default_device())


def select_devices(devices: tuple) -> None:
    """Make `thread_devices()`'s choices this thread's."""
    cuda, default = devices
    if cuda is not None:
        torch.cuda.set_device(cuda)
    torch.set_default_device(None if default == torch.device("cpu") else default)


def on_callers_devices(generate):
    """`generate`, to be called from other threads, on the devices the calling thread has selected now.
    accelerate selects each rank's GPU in its main thread only, and a new thread starts on GPU 0: vLLM's
    engine steps in the thread that calls it (its Triton kernels and its output copy go by the thread's
    current device), so on ranks 1-7 a worker thread's call would run against GPU 0."""
    devices = thread_devices()

    def on_devices(*args, **kwargs):
        select_devices(devices)  # every call: the executor's threads vary
        return generate(*args, **kwargs)

    return on_devices


class TransformersGenerator:
    """Batched sampling with `model.generate` over left-padded contexts. A generator serves one set of
    weights: make a new one after every update (the training scripts make one per rollout).

    With `prefix_cache` (on by default; off: every call prefills its contexts afresh) the key-value cache
    of each call is kept for the next: a multi-turn rollout calls the generator once per phase and turn,
    and each new context extends one the previous call saw (PrefixCache).

    Under DeepSpeed ZeRO-3 or FSDP on several processes, model.generate runs in lockstep across the ranks
    (transformers' `synced_gpus`): each step the ranks agree whether all have finished, and without gathered
    weights every forward pass gathers the shards from every rank. So every rank must call generate the same
    number of times: a rank with no context left (its dialogues ended) still generates, one new token for a
    one-token dummy context, and then keeps stepping with the others until they finish."""

    def __init__(self, model, tokenizer, generation_config, prefix_cache: bool = True):
        self.model, self.tokenizer, self.generation_config = model, tokenizer, generation_config
        # A turn ends where vLLM and ChatSegments end it, whatever end tokens the given config lists.
        self.eos_ids = end_of_turn_ids(tokenizer) | set(_as_list(generation_config.eos_token_id))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.prefix_cache = PrefixCache() if prefix_cache else None
        self.in_lockstep = generates_in_lockstep(model)
        self.lockstep_reason = ("DeepSpeed ZeRO-3 or FSDP on several processes generates in step across them "
                                "(transformers' synced_gpus)") if self.in_lockstep else None

    @torch.no_grad()
    def __call__(self, contexts: list[list[int]], max_new_tokens: list[int], stop: str | None = None):
        if not contexts:
            if self.in_lockstep:
                self._step_with_the_other_ranks()
            return [], None
        device = next(self.model.parameters()).device
        reused = self.prefix_cache.reuse(contexts, self.pad_id) if self.prefix_cache else None
        cache, input_ids, attention_mask = reused or (None, *left_padded(contexts, self.pad_id))
        config = copy.deepcopy(self.generation_config)
        config.max_new_tokens = max(max_new_tokens)
        config.eos_token_id = sorted(self.eos_ids)
        config.stop_strings = [stop] if stop else None
        config.return_dict_in_generate = True  # with the cache, for the next call
        output = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                     generation_config=config, tokenizer=self.tokenizer, synced_gpus=self.in_lockstep,
                                     **{GENERATE_CACHE_NAME: cache})
        sampled = []
        for row, limit in zip(output.sequences[:, input_ids.shape[1]:].tolist(), max_new_tokens):
            row = row[:limit]
            ends = [i for i, token in enumerate(row) if token in self.eos_ids]
            sampled.append(row[:ends[0] + 1] if ends else row)  # up to and including the first end token
        if self.prefix_cache:
            self.prefix_cache.remember(output, attention_mask.to(device), contexts, sampled)
        return sampled, None

    def _step_with_the_other_ranks(self) -> None:
        """A generate call of a rank with no context, in lockstep with the ranks that have some; dropped."""
        config = copy.deepcopy(self.generation_config)
        config.max_new_tokens, config.min_new_tokens, config.stop_strings = 1, None, None
        dummy = torch.tensor([[self.pad_id]], device=next(self.model.parameters()).device)
        self.model.generate(input_ids=dummy, attention_mask=torch.ones_like(dummy), generation_config=config,
                            synced_gpus=True)


def generates_in_lockstep(model) -> bool:
    """Whether model.generate steps in lockstep with the other ranks: transformers' default for `synced_gpus`
    (DeepSpeed ZeRO-3 or an FSDP model, on more than one process)."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    several = torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1
    return several and (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model))


def left_padded(contexts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of contexts padded on the left to the longest (0 = padding)."""
    width = max(len(context) for context in contexts)
    input_ids = torch.tensor([[pad_id] * (width - len(c)) + c for c in contexts])
    attention_mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
    return input_ids, attention_mask


class PrefixCache:
    """The key and value cache of a generator's previous call, reused by the next: each new row continues
    the old row sharing its longest prefix, so only the new tokens are prefilled. The old row's other
    columns (padding, tokens cut off or sampled after its end) stay in the cache as masked-out holes;
    position ids come from the attention mask, so every kept token keeps its position. The sampling
    distribution is that of a fresh prefill (a test compares greedy runs)."""

    def __init__(self):
        self.cached = None  # (cache, input ids fed, their attention mask, cached real tokens of each row)

    def remember(self, output, attention_mask, contexts, sampled) -> None:
        """Keep the call's cache for the next call if it is a plain one (full attention, no sliding window)."""
        cache = getattr(output, GENERATE_CACHE_NAME)
        if not isinstance(cache, DynamicCache) or any(type(layer) is not DynamicLayer for layer in cache.layers):
            self.cached = None
            return
        fed = output.sequences[:, :cache.get_seq_length()]  # the last sampled token was never fed
        width, generated = attention_mask.shape[1], fed.shape[1] - attention_mask.shape[1]
        mask = torch.zeros_like(fed)
        mask[:, :width] = attention_mask
        tokens = []
        for row, (context, ids) in enumerate(zip(contexts, sampled)):
            kept = ids[:generated]
            mask[row, width:width + len(kept)] = 1
            tokens.append(context + kept)
        self.cached = (cache, fed, mask, tokens)

    def reuse(self, contexts, pad_id: int):
        """(cache, input ids, attention mask) continuing the previous call's cache, or None when too
        little of the new contexts (under half their tokens) is already cached."""
        if self.cached is None:
            return None
        cache, fed, mask, tokens = self.cached
        self.cached = None  # the cache is extended in place by the next generate call: use it once
        matches = []
        for context in contexts:  # the old row sharing the longest prefix, leaving >= 1 token to feed
            shared = [_common_prefix(context, old) for old in tokens]
            best = max(range(len(tokens)), key=shared.__getitem__)
            matches.append((best, min(shared[best], len(context) - 1)))
        if sum(n for _, n in matches) * 2 < sum(len(c) for c in contexts):
            return None
        rows = torch.tensor([best for best, _ in matches])
        cache.batch_select_indices(rows.to(fed.device))
        fed, mask = fed[rows].clone(), mask[rows].clone()
        for row, (best, n) in enumerate(matches):
            columns = mask[row].nonzero().flatten()
            mask[row, columns[n:]] = 0  # cached columns past the shared prefix become holes
        new_ids, new_mask = left_padded([context[n:] for context, (_, n) in zip(contexts, matches)], pad_id)
        return cache, torch.cat([fed, new_ids.to(fed.device)], dim=1), torch.cat([mask, new_mask.to(fed.device)], dim=1)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if a[:middle] == b[:middle] else (low, middle)
    return low


class VLLMGenerator:
    """Sampling through TRL's vLLM backend (`use_vllm=True`, colocate or server mode); TRL syncs the
    weights before the rollout is called. Rehearsed on CPU with a fake vLLM (tests/fake_vllm).

    Each context is sampled with its own budget: TRL sends one `max_completion_length` for all the prompts
    of a call (`max_tokens` of the server request, or of the one SamplingParams in colocate mode), and vLLM's
    server refuses, with HTTP 400, a request in which any prompt is longer than max_model_len - max_tokens,
    while a long context near the end of its dialogue has a small budget (rollout.py: min(budget, room left)).
    So TRL is called once per distinct budget, with the contexts that have it.

    TRL's server mode gathers every rank's prompts on rank 0, samples them all with rank 0's settings
    and hands each rank back the slice `rank * len(own prompts)`: correct only when every rank sends
    the same number of prompts. Colocate mode with tensor parallelism slices the same way within its
    group. Our dialogues end at different turns, so the ranks first agree on the union of their budgets
    and, for each budget, on the largest number of contexts a rank has with it; every rank then makes
    the same calls, one per budget in increasing order, and a rank with fewer contexts of that budget
    pads with one-token dummy prompts whose completions it drops. When no rank has a context left, no
    rank calls vLLM (it would answer an empty request with no choices). The agreement is a collective:
    every rank calls this the same number of times, which the rollout's fixed loop of max_turns (and
    phases) guarantees."""

    def __init__(self, trainer):
        self.generation = trainer.vllm_generation
        self.dummy_prompt = [self.generation.processing_class.eos_token_id]
        self.lockstep_reason = vllm_lockstep_reason(self.generation)

    def __call__(self, contexts: list[list[int]], max_new_tokens: list[int], stop: str | None = None):
        from accelerate.utils import gather_object

        if self.lockstep_reason is None:  # colocate, tensor parallelism 1: nothing to agree on with the others
            counts = [collections.Counter(max_new_tokens)]
        else:
            counts = gather_object([collections.Counter(max_new_tokens)])  # per rank: contexts per budget
        sampled, sampled_logprobs = [None] * len(contexts), [None] * len(contexts)
        for budget in sorted(set().union(*counts)):
            rows = [row for row, limit in enumerate(max_new_tokens) if limit == budget]
            count = max(rank_counts[budget] for rank_counts in counts)
            completions = self._generate([contexts[row] for row in rows], count, budget, stop)
            for row, (ids, token_logprobs) in zip(rows, completions):
                sampled[row], sampled_logprobs[row] = ids, token_logprobs
        return sampled, sampled_logprobs

    def _generate(self, contexts: list[list[int]], count: int, budget: int, stop: str | None) -> list[tuple]:
        """(ids, logprobs) of each context, from one TRL call that every rank makes with `count` prompts."""
        padded = contexts + [self.dummy_prompt] * (count - len(contexts))
        # Both are read from these attributes at call time; the rollout cuts at `stop` afterwards anyway.
        self.generation.max_completion_length = budget
        base_kwargs = self.generation.generation_kwargs or {}
        if stop:
            self.generation.generation_kwargs = {**base_kwargs, "stop": [stop], "include_stop_str_in_output": True}
        try:
            _, completion_ids, logprobs, _ = self.generation.generate(prompts=padded, images=None, num_generations=1)
        finally:
            self.generation.generation_kwargs = base_kwargs
        if len(completion_ids) != count:
            raise RuntimeError(f"vLLM returned {len(completion_ids)} completions for {count} prompts")
        return [(list(ids)[:budget], [lp[0] for lp in token_logprobs][:budget])  # the sampled token's logprob
                for ids, token_logprobs in zip(completion_ids[:len(contexts)], logprobs[:len(contexts)])]


def vllm_lockstep_reason(vllm_generation) -> str | None:
    """Why TRL's vLLM generate must be called by every rank in step (a collective), or None when it need not:
    colocate mode with tensor parallelism 1 and no sleep mode (--rollout async batches its calls then)."""
    if vllm_generation.mode == "server":
        return "TRL's server-mode generate gathers every rank's prompts (async sends requests of its own instead)"
    if vllm_generation.tensor_parallel_size > 1:
        return f"vLLM's tensor parallelism {vllm_generation.tensor_parallel_size} makes generate a collective"
    if vllm_generation.enable_sleep_mode:
        return "vLLM's sleep mode pushes the weights again at every generate call"
    return None


def server_url(base_url: str | None, host: str, port: int) -> str:
    """A vLLM server's address as TRL takes it: the base URL if given, else host and port."""
    return base_url or f"http://{host}:{port}"


class VLLMServerTurns:
    """Each dialogue's turn as a request of its own to a vLLM server's /v1/completions (`trl vllm-serve` runs
    stock `vllm serve`), for --rollout async: every rank sends its dialogues' turns as they become ready,
    and the server batches the requests of all ranks continuously. A request is TRL's VLLMClient.generate
    payload for one token-id prompt: the turn's own budget, its stop string, the trainer's sampling
    settings, and a seed of its own, drawn from (the run's seed, step, rank, dialogue, turn, phase) so that it
    does not depend on the order the requests are sent in. Transient failures are retried (the OpenAI client's
    retries, `max_retries`)."""

    def __init__(self, base_url: str, sampling: dict, seed: int, step: int, rank: int, max_retries: int = 3):
        import openai

        self.client = openai.AsyncOpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key="EMPTY",
                                         max_retries=max_retries, timeout=600)
        self.sampling, self.seed_parts, self.models = sampling, [seed, step, rank], None

    @classmethod
    def of_trainer(cls, trainer):
        """For a TRL trainer with `vllm_mode="server"`: its server and sampling settings, the step's seed."""
        generation, args = trainer.vllm_generation, trainer.args
        base_url = server_url(generation.server_base_url, generation.server_host, generation.server_port)
        sampling = {"temperature": generation.temperature, "top_p": generation.top_p, "top_k": generation.top_k,
                    "min_p": generation.min_p or 0.0, "repetition_penalty": generation.repetition_penalty,
                    **(generation.generation_kwargs or {})}
        return cls(base_url, sampling, seed=args.seed, step=trainer.state.global_step,
                   rank=trainer.accelerator.process_index)

    def request_seed(self, key: tuple) -> int:
        text = json.dumps([*self.seed_parts, *key])
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") >> 1  # vLLM takes a 32-bit seed

    async def sample(self, context: list[int], budget: int, stop: str | None, key: tuple):
        """(sampled ids, their logprobs) of one turn's phase; `key` is (dialogue id, turn, phase)."""
        if self.models is None:  # asked once, however many dialogues send their first turn at once
            self.models = asyncio.ensure_future(self.client.models.list())
        model = (await self.models).data[0].id
        extra = {name: value for name, value in self.sampling.items() if name not in ("temperature", "top_p")}
        completion = await self.client.completions.create(
            model=model, prompt=context, max_tokens=budget, temperature=self.sampling["temperature"],
            top_p=self.sampling["top_p"], seed=self.request_seed(key), logprobs=0, stop=[stop] if stop else None,
            extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True,
                        "include_stop_str_in_output": True, **extra})
        choice = completion.choices[0]
        ids = list(choice.model_extra["token_ids"])[:budget]
        return ids, list(choice.logprobs.token_logprobs)[:len(ids)]

    async def aclose(self) -> None:
        await self.client.close()


class VLLMServerGenerator:
    """Sampling from TRL's generation server (`trl vllm-serve`) outside a TRL trainer, as in
    train_ppo.py; `push_weights` sends the policy's current weights before each rollout.
    Written against TRL 1.16's VLLMClient; rehearsed on CPU with a fake vLLM (tests/fake_vllm)."""

    def __init__(self, host: str, port: int, temperature: float):
        from trl.generation.vllm_client import VLLMClient  # raises a clear ImportError without vLLM

        self.client = VLLMClient(host=host, server_port=port, connection_timeout=240)
        self.client.init_communicator()
        self.host, self.port, self.temperature = host, port, temperature

    def max_model_len(self) -> int:
        return self.client.get_server_info()["model_config"]["max_model_len"]

    def turns(self, seed: int, step: int, rank: int) -> VLLMServerTurns:
        """The same server and temperature, a request for each turn (--rollout async)."""
        sampling = {"temperature": self.temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
        return VLLMServerTurns(f"http://{self.host}:{self.port}", sampling, seed, step, rank)

    @torch.no_grad()
    def push_weights(self, model) -> None:
        """Every weight in ONE update session: vLLM rebuilds each layer touched in a session from what
        that session sent, so a fused layer (qkv_proj from q, k, v; gate_up_proj from gate, up) sent in
        parts over several sessions would keep uninitialised memory for the parts sent elsewhere. A PEFT
        model's weights are merged out of place as they stream (`vllm_parameters`)."""
        weights = list(vllm_parameters(model))
        metadata = [(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)) for name, tensor, _ in weights]
        self.client.update_named_params(metadata, ((name, merged_weight(parameter, layer))
                                                   for name, parameter, layer in weights))
        self.client.reset_prefix_cache()

    def __call__(self, contexts: list[list[int]], max_new_tokens: list[int], stop: str | None = None):
        """One request per distinct budget: a request has one max_tokens, and vLLM's server refuses (HTTP 400)
        a request in which any prompt is longer than max_model_len - max_tokens (VLLMGenerator's docstring)."""
        if not contexts:
            return [], None
        sampled, logprobs = [None] * len(contexts), [None] * len(contexts)
        for budget in sorted(set(max_new_tokens)):
            rows = [row for row, limit in enumerate(max_new_tokens) if limit == budget]
            output = self.client.generate(
                prompts=[contexts[row] for row in rows], n=1, temperature=self.temperature, max_tokens=budget,
                logprobs=0, generation_kwargs={"stop": [stop], "include_stop_str_in_output": True} if stop else None)
            for row, ids, token_logprobs in zip(rows, output["completion_ids"], output["logprobs"], strict=True):
                sampled[row] = list(ids)[:budget]
                logprobs[row] = [lp[0] for lp in token_logprobs][:budget]  # the sampled token's logprob
        return sampled, logprobs


def vllm_parameters(model):
    """(vLLM's name, parameter, its LoRA layer or None) for each weight a vLLM engine holds; push
    `merged_weight(parameter, layer)`. A PEFT model's weights go under the base model's names, its LoRA
    weights left out, each LoRA layer's base weight to be merged out of place (base + the adapter's delta in a
    new tensor, one layer at a time as they stream): merging in place and unmerging after, as peft does, does
    not give a bf16 base back exactly, and the frozen weights would drift a little with every push."""
    lora_layers = _lora_layers(model)  # None: not a PEFT model
    for name, parameter in model.named_parameters():
        if lora_layers is None:
            yield name, parameter, None
        elif "lora_" not in name and "original_module" not in name:  # original_module: under modules_to_save
            base_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            yield base_name.replace("modules_to_save.default.", ""), parameter, lora_layers.get(name)


def _lora_layers(model) -> dict | None:
    """{name of a base weight: its LoRA layer} of a PEFT model (adapters not merged into the base), else None."""
    if not hasattr(model, "peft_config"):
        return None
    from peft.tuners.lora import LoraLayer

    return {f"{name}.base_layer.weight": module for name, module in model.named_modules()
            if isinstance(module, LoraLayer) and not module.merged and not module.disable_adapters}


def merged_weight(weight: torch.Tensor, lora_layer) -> torch.Tensor:
    """The weight with its LoRA layer's active adapters added as peft's merge adds them, in a new tensor."""
    merged = weight.detach()
    for adapter in lora_layer.active_adapters if lora_layer is not None else []:
        if adapter not in lora_layer.lora_A:
            continue
        if adapter in lora_layer.lora_variant or lora_layer.lora_bias[adapter]:
            raise ValueError(f"adapter {adapter!r}: only plain LoRA weights can be pushed to vLLM "
                             "(no DoRA, no lora_bias)")
        merged = (merged + lora_layer.get_delta_weight(adapter)).to(weight.dtype)
    return merged


class VLLMEngineGenerator:
    """Sampling with an in-process vLLM engine, outside any trainer (the evaluations' --use_vllm), from a
    full model folder with its tokenizer. Rehearsed on CPU with a fake vLLM (tests/fake_vllm).

    Each request gets its own seed, drawn from torch's global RNG: the evaluations seed that per batch
    (as they do for transformers' sampling), so a row's seed follows from the batch's seed, the call's
    place in the batch (one call per turn and phase) and the row's position, and a resumed run samples
    what the uninterrupted one did. The engine's own seed alone would not do: its stream depends on
    every request served before."""

    def __init__(self, model: str, temperature: float, top_p: float, seed: int):
        try:
            from vllm import LLM
        except ImportError:
            raise SystemExit("--use_vllm needs vLLM on a GPU machine: pip install -r requirements-gpu.txt") from None
        self.llm = LLM(model=model, seed=seed)
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, contexts: list[list[int]], max_new_tokens: list[int], stop: str | None = None):
        from vllm import SamplingParams, TokensPrompt

        if not contexts:
            return [], None
        seeds = torch.randint(2**31 - 1, (len(contexts),)).tolist()
        params = [SamplingParams(temperature=self.temperature, top_p=self.top_p, seed=seed, max_tokens=limit,
                                 stop=[stop] if stop else None, include_stop_str_in_output=True)
                  for seed, limit in zip(seeds, max_new_tokens)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=c) for c in contexts], params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs], None


def load_tokenizer(args):
    """(folder, tokenizer) of the tested local model: the folder from loadable_model. The tokenizer comes
    first, so the dialogue runner and the simulator's endpoint are checked before the weights load."""
    from transformers import AutoTokenizer

    folder = common.loadable_model(args.model)
    return folder, AutoTokenizer.from_pretrained(folder)


def load_generator(args, folder: str, tokenizer):
    """`generate` for the tested local model (load_tokenizer's folder and tokenizer): an in-process vLLM
    engine with --use_vllm (the transformers model is never loaded then: the engine wants its share of
    the GPU), else transformers, on the GPU if there is one. Both sample from torch's RNG state, which
    the callers seed per batch."""
    from transformers import AutoModelForCausalLM

    if args.use_vllm:
        return VLLMEngineGenerator(folder, args.temperature, args.top_p, args.seed)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    if torch.cuda.is_available():
        model.to("cuda")
    return TransformersGenerator(model, tokenizer, sampling_config(tokenizer, args.temperature, args.top_p))


def sampling_config(tokenizer, temperature: float, top_p: float = 1.0):
    """transformers' GenerationConfig sampling at `temperature` and `top_p` (greedy at temperature 0), a turn
    ending at any end-of-turn token: the evaluations', PPO's rollout's and best_of_n's."""
    from transformers import GenerationConfig

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) \
        if temperature > 0 else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    return GenerationConfig(eos_token_id=sorted(end_of_turn_ids(tokenizer)), pad_token_id=pad_id, **sampling)


def trainer_max_model_len(trainer) -> int:
    """The max_model_len of a TRL trainer's vLLM: its colocated engine's, or its server's (asked by the main
    process, whose client TRL made, and sent to the others)."""
    from accelerate.utils import broadcast_object_list

    vllm_generation = trainer.vllm_generation
    if vllm_generation.mode == "colocate":
        return vllm_generation.llm.llm_engine.model_config.max_model_len
    length = [None]
    if trainer.accelerator.is_main_process:
        length = [vllm_generation.vllm_client.get_server_info()["model_config"]["max_model_len"]]
    return broadcast_object_list(length)[0]


@contextmanager
def trainer_generator(trainer, prefix_cache: bool = True, rollout: str = "async"):
    """The generator to use inside a TRL trainer: vLLM if enabled (with --rollout async in server mode, a
    request for each turn), else the unwrapped model."""
    if getattr(trainer.args, "use_vllm", False):
        if rollout == "async" and trainer.vllm_generation.mode == "server":
            # Rank 0 pushes the weights before the rollout; TRL's own generate waits for it in its gather, and
            # requests of our own must wait too, or they would sample from half-updated weights.
            trainer.accelerator.wait_for_everyone()
            yield VLLMServerTurns.of_trainer(trainer)
        else:
            yield VLLMGenerator(trainer)
        return
    from trl.models.utils import unwrap_model_for_generation

    # As TRL's GRPOTrainer calls it: gradient checkpointing, off while generating, comes back with the run's
    # own kwargs (use_reentrant...), not transformers' defaults.
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                     gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                                     generation_kwargs=getattr(trainer, "generation_kwargs", None),
                                     gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs) as model:
        yield TransformersGenerator(model, trainer.processing_class, trainer.generation_config, prefix_cache)
