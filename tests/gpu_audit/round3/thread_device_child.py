"""Run by thread_device.py: train_grpo.main(<argv>) with the fake vllm of tests/fake_vllm importable, its
`LLM.generate` (what TRL's colocate mode calls: VLLMGeneration.generate -> self.llm.generate) wrapped to print
the thread each call runs in, and TRL's weight sync wrapped likewise. One line per call on stdout, `[thread] ...`.

    python thread_device_child.py PROJECT_DIR train_grpo.py-flags...
"""
import json
import os
import sys
import threading

PROJECT = sys.argv[1]
sys.path[:0] = [os.path.join(PROJECT, "tests", "fake_vllm"), PROJECT]
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import vllm  # noqa: E402  (the fake)
from trl.generation import vllm_generation  # noqa: E402

import train_grpo  # noqa: E402


def reporting(what, function):
    def call(*args, **kwargs):
        print("\n[thread] " + json.dumps({"call": what, "thread": threading.current_thread().name,
                                          "main": threading.current_thread() is threading.main_thread(),
                                          "device": torch.cuda.current_device()}), flush=True)
        return function(*args, **kwargs)
    return call


# Adapted in the project (the fix selects the rank's device in the generating thread): CUDA's per-thread current
# device as a recorded seam, the main thread selecting device 1 as accelerate does on rank 1; each call reports
# the device its thread has selected.
import torch  # noqa: E402

selected = threading.local()
torch.cuda.is_initialized = lambda: True
torch.cuda.current_device = lambda: getattr(selected, "index", 0)
torch.cuda.set_device = lambda index: setattr(selected, "index", index)
torch.cuda.set_device(1)
vllm.LLM.generate = reporting("LLM.generate", vllm.LLM.generate)
vllm_generation.VLLMGeneration.sync_weights = reporting("sync_weights", vllm_generation.VLLMGeneration.sync_weights)
train_grpo.main(sys.argv[2:])
