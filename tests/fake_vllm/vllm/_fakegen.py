"""Deterministic fake sampler shared by the fake offline engine and the fake HTTP server.

The sampled stream depends on the prompt token ids only (never on max_tokens), so a caller can
recompute what the engine sampled for a given context and check that it got *its own* completion."""
import json
import os
import random
import time
import zlib

THINK_CLOSE = [9617, 17400, 46]  # "</think>" in the SmolLM2 tokenizer
EOS = 2  # <|im_end|>


_RNG = random.Random(os.getpid())


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


def sample(prompt_ids, max_tokens, stop, max_model_len, seed=None):
    if not prompt_ids:
        raise ValueError("The decoder prompt cannot be empty")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(f"The decoder prompt (length {len(prompt_ids)}) is longer than the maximum model length")
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
