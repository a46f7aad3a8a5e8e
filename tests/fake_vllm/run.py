"""Runs one of the project's scripts with the fake vllm importable, as a user would run it on GPUs:

    python tests/fake_vllm/run.py train_grpo.py --use_vllm ...          # or through torch.distributed.run

Only TRL's CUDA-only NCCL rendezvous (`VLLMClient.init_communicator`) is replaced; everything else is the real
TRL, accelerate and transformers. With $FAKE_VLLM_LOG set, every call of the rollout's vLLM generators is logged
as one JSON line (each request of VLLMServerTurns too): did each context get its own completion (the fake's first sampled token names the context),
cut at its budget or not, with as many logprobs as tokens?"""
import os
import runpy
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, REPO]
from trl.generation import vllm_client  # noqa: E402

import vllm_backends  # noqa: E402
from vllm._fakegen import EOS, THINK_CLOSE, log, tag  # noqa: E402


def init_communicator(self, device=0):
    """TRL 1.16's init_communicator without its CUDA device lines; the fake transfer consumes the tensors."""
    if self.get_server_info()["weight_transfer_config"] is None:
        raise RuntimeError("no weight-transfer engine")
    init_info = {"master_address": vllm_client.get_ip(), "master_port": self.group_port, "rank_offset": 1,
                 "world_size": self.get_world_size() + 1, "packed": True}
    self._post(f"{self.base_url}/init_weight_transfer_engine", json={"init_info": init_info})
    self.communicator = vllm_client.open_trainer_endpoint(init_info)


def checked(cls):
    original = cls.__call__

    def call(self, contexts, max_new_tokens, stop=None):
        sampled, logprobs = original(self, contexts, max_new_tokens, stop=stop)
        verdicts = []
        for context, limit, ids in zip(contexts, max_new_tokens, sampled, strict=True):
            if not ids:
                verdicts.append("EMPTY")
            elif ids[0] != tag(context):
                verdicts.append("NOT_OWN")
            elif len(ids) < limit and ids[-1] != EOS and ids[-len(THINK_CLOSE):] != THINK_CLOSE:
                verdicts.append(f"CUT_{len(ids)}/{limit}")
            else:
                verdicts.append("own")
        log("generate_call", cls=cls.__name__, n_contexts=len(contexts), n_sampled=len(sampled), stop=stop,
            verdicts=verdicts, contexts=[zlib.crc32(str(c).encode()) % 10000 for c in contexts],
            logprobs_ok=None if logprobs is None else all(len(lp) == len(s) for lp, s in zip(logprobs, sampled)))
        return sampled, logprobs

    cls.__call__ = call


def checked_turns(cls):
    """The same verdict for each request of VLLMServerTurns (--rollout async in server mode)."""
    original = cls.sample

    async def sample(self, context, budget, stop, key):
        ids, logprobs = await original(self, context, budget, stop, key)
        verdict = ("EMPTY" if not ids else "NOT_OWN" if ids[0] != tag(context) else
                   f"CUT_{len(ids)}/{budget}" if len(ids) < budget and ids[-1] != EOS
                   and ids[-len(THINK_CLOSE):] != THINK_CLOSE else "own")
        log("turn_request", dialogue=key[0], turn=key[1], phase=key[2], stop=stop, verdict=verdict,
            seed=self.request_seed(key), logprobs_ok=len(logprobs) == len(ids))
        return ids, logprobs

    cls.sample = sample


vllm_client.VLLMClient.init_communicator = init_communicator
checked_turns(vllm_backends.VLLMServerTurns)
for name in ("VLLMGenerator", "VLLMServerGenerator", "VLLMEngineGenerator"):
    checked(getattr(vllm_backends, name))

if __name__ == "__main__":
    script = os.path.join(REPO, sys.argv[1]) if not os.path.isabs(sys.argv[1]) else sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
