import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from ._fakegen import log, sample

_REAL_ENGINE_ARGS = {line for line in (Path(__file__).parents[1] / "engine_args.txt").read_text().splitlines()
                     if line and not line.startswith("#")}


def TokensPrompt(**kwargs):  # a TypedDict in vLLM: calling it makes a dict
    assert set(kwargs) <= {"prompt_token_ids", "prompt", "token_type_ids", "multi_modal_data", "cache_salt"}, kwargs
    return dict(kwargs)


@dataclass
class Logprob:
    logprob: float
    rank: int = 1
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list
    outputs: list = field(default_factory=list)
    finished: bool = True


class _FakeModel:
    def __init__(self, model_dir):
        from safetensors import safe_open
        self.expected = {}
        for f in Path(model_dir).glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                for k in st.keys():
                    self.expected[k] = list(st.get_slice(k).get_shape())
        self.loaded = 0

    def load_weights(self, weights):
        for name, tensor in weights:
            if name not in self.expected:
                log("load_weights_unknown_name", name=name)
                raise KeyError(f"fake vLLM: no parameter named {name!r} in the model")
            if list(tensor.shape) != self.expected[name]:
                raise ValueError(f"fake vLLM: {name} shape {list(tensor.shape)} != {self.expected[name]}")
            self.loaded += 1
        return {n for n, _ in weights}


class LLM:
    def __init__(self, model, **kwargs):
        unknown = set(kwargs) - _REAL_ENGINE_ARGS
        if unknown:
            raise TypeError(f"LLM/EngineArgs got unexpected keyword(s) {sorted(unknown)}")
        if not (Path(model) / "config.json").is_file():
            # vLLM needs a full model folder (config.json); a PEFT adapter folder is not loadable as a model
            raise ValueError(f"fake vLLM: {model} has no config.json (a LoRA adapter folder cannot be served this way)")
        cfg = json.loads((Path(model) / "config.json").read_text())
        self.max_model_len = kwargs.get("max_model_len") or cfg.get("max_position_embeddings", 2048)
        self.kwargs = kwargs
        self._model = _FakeModel(model)
        runner = SimpleNamespace(model=self._model)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)),
                                          model_config=SimpleNamespace(max_model_len=self.max_model_len))
        self.calls = 0
        log("LLM_init", model=str(model), kwargs={k: str(v) for k, v in kwargs.items()})

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, **kw):
        from .sampling_params import SamplingParams
        if isinstance(prompts, dict) or (len(prompts) > 0 and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"The lengths of prompts ({len(prompts)}) and params ({len(params)}) must be the same.")
        self.calls += 1
        outs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            ids = p["prompt_token_ids"] if isinstance(p, dict) else p
            toks, lps, finish = sample(ids, sp.max_tokens, sp.stop, self.max_model_len, sp.seed, sp.temperature)
            lp = [{t: Logprob(l)} for t, l in zip(toks, lps)] if sp.logprobs is not None else None
            outs.append(RequestOutput(str(i), None, list(ids), [CompletionOutput(0, "", toks, None, lp, finish)]))
        log("LLM_generate", n_prompts=len(prompts), max_tokens=[sp.max_tokens for sp in params][:1],
            stop=params[0].stop if params else None, seeds=[sp.seed for sp in params], top_p=[sp.top_p for sp in params],
            temperature=[sp.temperature for sp in params])
        return outs

    def reset_prefix_cache(self):
        log("LLM_reset_prefix_cache")

    def sleep(self, level=1):
        log("LLM_sleep", level=level)

    def wake_up(self, tags=None):
        log("LLM_wake_up", tags=tags)
