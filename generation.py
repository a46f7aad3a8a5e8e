"""Generating the policy's turns: its system prompt, the think-then-say format, and the sampling backends
(token-id contexts in, sampled ids and their logprobs out). rollout.py plays dialogues with these; the
evaluations sample the tested model with them.

Think-then-say: the policy writes `<think>...</think>`, then its reply; only the text after the last
`</think>` reaches the simulated user (`split_think`).

Backends: `TransformersGenerator` (model.generate, CPU or GPU; by default it reuses the key-value cache of
its previous call, `PrefixCache`, and `--prefix_cache false` turns that off). It takes a batch of contexts a
call. The vLLM backends are in vllm_backends.py, imported only when asked for.
"""
import copy
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
    packaged SmolLM2 closes a thought in about 8% of turns; shown it in three exchanges, in 33% at 16 thinking
    tokens (54% at 24; docs/results.md), which leaves RL a format it can learn to keep."""
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


def load_tokenizer(args):
    """(folder, tokenizer) of the tested local model: the folder from loadable_model. The tokenizer comes
    first, so the dialogue runner and the simulator's endpoint are checked before the weights load."""
    from transformers import AutoTokenizer

    import guards  # the evaluations' model checks; training never loads a model this way

    folder = guards.loadable_model(args.model)
    return folder, AutoTokenizer.from_pretrained(folder)


def load_generator(args, folder: str, tokenizer):
    """`generate` for the tested local model (load_tokenizer's folder and tokenizer): an in-process vLLM
    engine with --use_vllm (the transformers model is never loaded then: the engine wants its share of
    the GPU), else transformers, on the GPU if there is one. Both sample from torch's RNG state, which
    the callers seed per batch."""
    from transformers import AutoModelForCausalLM

    if args.use_vllm:
        import vllm_backends

        return vllm_backends.VLLMEngineGenerator(folder, args.temperature, args.top_p, args.seed)
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


@contextmanager
def trainer_generator(trainer, prefix_cache: bool = True, rollout: str = "async"):
    """The generator to use inside a TRL trainer: vLLM if enabled (with --rollout async in server mode, a
    request for each turn), else the unwrapped model."""
    if getattr(trainer.args, "use_vllm", False):
        import vllm_backends

        if rollout == "async" and trainer.vllm_generation.mode == "server":
            # Rank 0 pushes the weights before the rollout; TRL's own generate waits for it in its gather, and
            # requests of our own must wait too, or they would sample from half-updated weights.
            trainer.accelerator.wait_for_everyone()
            yield vllm_backends.VLLMServerTurns.of_trainer(trainer)
        else:
            yield vllm_backends.VLLMGenerator(trainer)
        return
    from trl.models.utils import unwrap_model_for_generation

    # As TRL's GRPOTrainer calls it: gradient checkpointing, off while generating, comes back with the run's
    # own kwargs (use_reentrant...), not transformers' defaults.
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                     gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                                     generation_kwargs=getattr(trainer, "generation_kwargs", None),
                                     gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs) as model:
        yield TransformersGenerator(model, trainer.processing_class, trainer.generation_config, prefix_cache)
