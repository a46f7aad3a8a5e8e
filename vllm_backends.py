"""The policy's vLLM backends, imported only when asked for (`--use_vllm`, the evaluations' engine, PPO's
server): contexts of token ids in, sampled ids and their logprobs out, as generation.TransformersGenerator.

- `VLLMGenerator`: inside TRL training with `use_vllm`, over `trainer.vllm_generation` (colocate or server).
- `VLLMServerTurns`: with `--rollout async` on a vLLM server, each turn a request of its own.
- `VLLMServerGenerator`: train_ppo.py's generator over `trl vllm-serve`.
- `VLLMEngineGenerator`: the evaluations' in-process engine.
- `merge_lora_out_of_place`: TRL's weight sync of a LoRA model, without the drift of an in-place merge.

They are rehearsed on CPU against a fake vLLM (tests/fake_vllm); none has run on a GPU.
"""
import asyncio
import collections
import hashlib
import json

import torch

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
        trls, args = trainer.vllm_generation, trainer.args
        base_url = server_url(trls.server_base_url, trls.server_host, trls.server_port)
        sampling = {"temperature": trls.temperature, "top_p": trls.top_p, "top_k": trls.top_k,
                    "min_p": trls.min_p or 0.0, "repetition_penalty": trls.repetition_penalty,
                    **(trls.generation_kwargs or {})}
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


def merge_lora_out_of_place(vllm_generation) -> None:
    """Make TRL's weight sync to vLLM merge a LoRA adapter out of place. TRL merges it into the base weights
    in place and unmerges it after each sync, which in bf16 does not give the frozen base back exactly: it
    would drift a little at every step (vllm_parameters). Under DeepSpeed ZeRO-3 TRL merges
    gathered copies that DeepSpeed then discards, and under FSDP it walks the shards its own way: left to TRL."""
    if vllm_generation._dist.is_zero3 or vllm_generation._dist.is_fsdp:
        return
    model, vllm_name = vllm_generation.model, vllm_generation._fix_param_name_to_vllm
    vllm_generation._iter_named_params = lambda: (
        (vllm_name(name), merged_weight(parameter, layer))
        for name, parameter, layer in vllm_parameters(model))
