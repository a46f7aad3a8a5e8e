"""A fake of the server `trl vllm-serve` starts (vLLM 0.31 `vllm serve` + dev/RL endpoints), for CPU tests.

    python tests/fake_vllm/server.py --port 8000 --model TINY_MODEL_DIR --log server.log   # prints "ready"

Endpoints as TRL 1.16's VLLMClient uses them. /v1/completions follows vLLM 0.31: `prompt: []` parses as
zero prompts and answers `choices: []`; a request in which any prompt is longer than max_model_len - max_tokens
(--max_model_len, default the model's max_position_embeddings, as `vllm serve --max-model-len`) is refused with
HTTP 400 (vllm/_fakegen.py: check_completion_request). Weight updates are checked against the model's checkpoint names
and shapes; on /finish_weight_update, each round is judged with vLLM's layerwise-reload rule (0.31 and 0.33 alike)
(vllm/model_executor/model_loader/reload/layerwise.py): a fused layer (qkv_proj <- q,k,v; gate_up_proj <-
gate,up) that received some but not all of its shards in a round is materialized with torch.empty_strided
and copied back whole, i.e. its other shards become uninitialized memory."""
import argparse
import json
import os
import random
import re
import sys
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the fake vllm package beside this file
from vllm import _fakegen  # noqa: E402
from vllm._fakegen import VLLMValidationError, check_completion_request, sample  # noqa: E402

FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def fused_key(name):
    m = re.match(r"(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", name)
    return (m.group(1) + "." + FUSED[m.group(2)], m.group(2) + "." + m.group(3)) if m else None


class State:
    def __init__(self, model_dir, log_path, max_model_len=None):
        from safetensors import safe_open
        self.expected = {}
        for f in Path(model_dir).glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                for k in st.keys():
                    self.expected[k] = list(st.get_slice(k).get_shape())
        self.members = defaultdict(set)
        for name in self.expected:
            fk = fused_key(name)
            if fk:
                self.members[fk[0]].add(fk[1])
        self.cfg = json.loads((Path(model_dir) / "config.json").read_text())
        self.max_model_len = max_model_len or self.cfg.get("max_position_embeddings", 2048)
        self.log_path = log_path
        self.lock = threading.Lock()
        self.round = None
        self.stats = defaultdict(int)
        self.corrupt = set()
        self.latency, self.delays, self.update_seconds = 0.0, random.Random(0), 0.0
        self.requests = []  # (method, path, body) of every request, for a test running the server in-process

    def log(self, event, **fields):
        with self.lock, open(self.log_path, "a") as out:
            out.write(json.dumps({"event": event, **fields}) + "\n")


def make_handler(state: State):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            path = self.path.split("?")[0]
            state.requests.append(("GET", path, None))
            if path == "/health":
                return self.reply(200, {})
            if path == "/v1/models":
                return self.reply(200, {"data": [{"id": "fake-policy"}]})
            if path == "/server_info":
                return self.reply(200, {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs",
                                                                         "max_model_len": state.max_model_len},
                                                        "weight_transfer_config": {"backend": "nccl"}}})
            if path == "/get_world_size":
                return self.reply(200, {"world_size": 1})
            return self.reply(404, {"detail": "Not Found"})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            path = self.path.split("?")[0]
            state.requests.append(("POST", path, body))
            if path == "/v1/completions":
                return self.completions(body)
            if path == "/init_weight_transfer_engine":
                state.log("init_weight_transfer_engine", init_info=body.get("init_info"))
                return self.reply(200, {"message": "Weight transfer initialized"})
            if path == "/start_weight_update":
                with state.lock:
                    state.round = []
                    state.stats["rounds"] += 1
                return self.reply(200, {"message": "Weight update started"})
            if path == "/update_weights":
                time.sleep(state.update_seconds)  # a real model's weights take a while: requests meanwhile are caught
                info = body["update_info"]
                bad = [n for n in info["names"] if n not in state.expected]
                wrong_shape = [n for n, s in zip(info["names"], info["shapes"]) if n in state.expected and s != state.expected[n]]
                with state.lock:
                    if state.round is None:
                        return self.reply(500, {"error": "update_weights outside start/finish"})
                    state.round += info["names"]
                    state.stats["tensors"] += len(info["names"])
                    state.stats["dtypes:" + ",".join(sorted(set(info["dtype_names"])))] += 1
                if bad or wrong_shape:
                    state.log("update_weights_rejected", unknown=bad[:5], wrong_shape=wrong_shape[:5])
                    return self.reply(500, {"error": f"unknown parameter names {bad[:3]} / wrong shapes {wrong_shape[:3]}"})
                return self.reply(200, {"message": "Weights updated"})
            if path == "/finish_weight_update":
                with state.lock:
                    got = defaultdict(set)
                    for n in state.round or []:
                        fk = fused_key(n)
                        if fk:
                            got[fk[0]].add(fk[1])
                    for layer, shards in got.items():
                        if shards != state.members[layer]:
                            state.corrupt.add(layer)  # partial round: the other shards become empty_strided memory
                        else:
                            state.corrupt.discard(layer)  # a complete round rewrites the whole layer
                    untouched = len([n for n in state.expected if n not in set(state.round or [])])
                    state.stats["layer_restores_with_warning"] += untouched
                    state.round = None
                state.log("finish_weight_update", corrupted_fused_layers=sorted(state.corrupt), stats=dict(state.stats))
                return self.reply(200, {"message": "Weight update finished"})
            if path == "/reset_prefix_cache":
                state.log("reset_prefix_cache")
                return self.reply(200, {"success": True})
            return self.reply(404, {"detail": "Not Found"})

        def completions(self, body):
            if state.latency:
                time.sleep(state.delays.uniform(0, state.latency))  # requests finish out of the order they came in
            if state.round is not None:  # weights half pushed: what it would sample comes from no policy
                state.log("completions_during_weight_update", n_prompts=len(body.get("prompt") or []))
                return self.reply(500, {"error": "generation during a weight update"})
            prompt = body.get("prompt")
            if prompt is None or prompt == "":
                return self.reply(400, {"error": "Either prompt or prompt_embeds must be provided and non-empty."})
            prompts = [] if prompt == [] else ([prompt] if isinstance(prompt[0], int) else prompt)
            n = body.get("n", 1)
            stop = body.get("stop") or []
            max_tokens = body.get("max_tokens", 16)
            choices = []
            try:
                check_completion_request(prompts, max_tokens, state.max_model_len)
                for p in prompts:
                    for _ in range(n):
                        toks, lps, finish = sample(p, max_tokens, stop, state.max_model_len, body.get("seed"),
                                                 body.get("temperature", 1.0))
                        lp = None
                        if body.get("logprobs") is not None:
                            lp = {"tokens": [f"token_id:{t}" for t in toks], "token_logprobs": lps,
                                  "top_logprobs": [{f"token_id:{t}": l} for t, l in zip(toks, lps)],
                                  "text_offset": list(range(len(toks)))}
                        choices.append({"index": len(choices), "text": "", "token_ids": toks, "prompt_token_ids": p,
                                        "logprobs": lp, "finish_reason": finish})
            except VLLMValidationError as error:
                state.log("completions_refused", n_prompts=len(prompts), max_tokens=max_tokens,
                          longest_prompt=max(map(len, prompts), default=0), error=str(error))
                return self.reply(400, {"error": {"message": str(error), "type": "BadRequestError",
                                                  "param": error.parameter, "code": 400}})
            state.log("completions", n_prompts=len(prompts), max_tokens=max_tokens, stop=stop, seed=body.get("seed"),
                      extra=sorted(k for k in body if k not in ("model", "prompt")))
            return self.reply(200, {"id": "cmpl-fake", "object": "text_completion", "model": "fake-policy",
                                    "choices": choices, "usage": {}})

    return Handler


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max_model_len", type=int, default=None)
    ap.add_argument("--latency", type=float, default=0.0, help="each completion waits uniform(0, this) seconds")
    ap.add_argument("--update_seconds", type=float, default=0.0, help="each /update_weights call takes this long")
    a = ap.parse_args()
    # A fixed stream: only rank 0 talks to the server, so a run's requests come in one order and the run is
    # reproducible; a test that needs dialogues ending at different turns then passes or fails every time.
    _fakegen._RNG.seed(a.seed)
    st = State(a.model, a.log, a.max_model_len)
    st.latency, st.update_seconds = a.latency, a.update_seconds
    server = ThreadingHTTPServer(("127.0.0.1", a.port), make_handler(st))
    print("ready", flush=True)
    server.serve_forever()
