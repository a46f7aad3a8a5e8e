"""Deterministic fake sampler shared by the fake offline engine and the fake HTTP server.

The sampled stream depends on the prompt token ids only (never on max_tokens), so a caller can
recompute what the engine sampled for a given context and check that it got *its own* completion.

Prompt lengths are checked as vLLM 0.31 checks them, which differs between its two entry points:
- the engine (`LLM.generate`, TRL's colocate mode) refuses a prompt of max_model_len tokens or more
  (vllm/v1/engine/input_processor.py, `_validate_prompt_len`) and otherwise stops a completion when
  prompt + completion reach max_model_len (vllm/v1/core/sched/utils.py, FINISHED_LENGTH_CAPPED): `sample`;
- the server's /v1/completions (`trl vllm-serve` runs `vllm serve`) refuses, with HTTP 400, a request whose
  max_tokens exceeds max_model_len or in which any prompt is longer than max_model_len - max_tokens
  (vllm/renderers/params.py, `TokenizeParams.__post_init__` and `_token_len_check`): `check_completion_request`.
Both raise `VLLMValidationError`, which vllm.exceptions defines (it is no ValueError)."""
import json
import os
import random
import time
import zlib

THINK_CLOSE = [9617, 17400, 46]  # "</think>" in the SmolLM2 tokenizer
EOS = 2  # <|im_end|>


_RNG = random.Random(os.getpid())


class VLLMError(Exception):
    """vllm.exceptions.VLLMError (0.31), defined here so that this sampler also loads on its own."""


class VLLMClientError(VLLMError):
    """Caused by the request: the server answers 4xx."""


class VLLMValidationError(VLLMClientError):
    def __init__(self, message, *, parameter=None, value=None):
        super().__init__(message)
        self.parameter, self.value = parameter, value


def tag(prompt_ids):
    """The first sampled token identifies the context it was sampled for (the rest is random)."""
    return 300 + zlib.crc32(json.dumps(list(prompt_ids)).encode()) % 5000


def stream(prompt_ids, with_stop, rng=None):
    rng = rng or _RNG
    n = rng.randint(4, 40)
    toks = [tag(prompt_ids)] + [rng.randint(6000, 20000) for _ in range(n - 1)]
    if with_stop and rng.random() < 0.6:
        p = rng.randint(1, n)
        toks = toks[:p] + THINK_CLOSE  # the stop string completes: generation stops after it
    else:
        toks = toks + [EOS]
    lps = [-round(rng.random() * 3, 4) - 0.001 for _ in toks]
    return toks, lps


def check_completion_request(prompts, max_tokens, max_model_len):
    """Raises VLLMValidationError where vLLM 0.31's /v1/completions answers HTTP 400 for lengths."""
    if max_tokens > max_model_len:
        raise VLLMValidationError(f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
                                  "Please request fewer output tokens.", parameter="max_tokens", value=max_tokens)
    for prompt_ids in prompts:
        if len(prompt_ids) > max_model_len - max_tokens:
            raise VLLMValidationError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested {max_tokens} "
                f"output tokens and your prompt contains {len(prompt_ids)} input tokens, for a total of "
                f"{len(prompt_ids) + max_tokens} tokens. Please reduce the length of the input prompt or the number "
                "of requested output tokens.", parameter="input_tokens", value=len(prompt_ids))


def sample(prompt_ids, max_tokens, stop, max_model_len, seed=None, temperature=1.0):
    """The engine's completion of one prompt: refused as vLLM's engine refuses it, else cut at max_tokens or
    where prompt + completion reach max_model_len. Greedy (temperature 0) or seeded, it is a function of the
    prompt (and the seed) alone, whatever was sampled before; greedy ignores the seed, as vLLM does."""
    if temperature == 0:
        seed = 0
    if not prompt_ids:
        raise VLLMValidationError("The decoder prompt cannot be empty")
    if len(prompt_ids) > max_model_len:
        raise VLLMValidationError(f"The decoder prompt (length {len(prompt_ids)}) is longer than the maximum model "
                                  f"length of {max_model_len}.")
    if len(prompt_ids) == max_model_len:
        raise VLLMValidationError(f"The decoder prompt (length {len(prompt_ids)}) plus the number of requested output "
                                  f"tokens (at least 1) is longer than the maximum model length of {max_model_len}.")
    rng = random.Random(seed * 100003 + tag(prompt_ids)) if seed is not None else None  # seeded: reproducible
    toks, lps = stream(prompt_ids, bool(stop), rng)
    limit = min(max_tokens, max_model_len - len(prompt_ids))
    finish = "stop" if len(toks) <= limit else "length"
    return toks[:limit], lps[:limit], finish


def log(event, **fields):
    path = os.environ.get("FAKE_VLLM_LOG")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"t": time.time(), "pid": os.getpid(), "rank": os.environ.get("RANK"),
                                  "event": event, **fields}) + "\n")
