"""Run by tests/gpu_check.sh on 2 GPUs or more: train_grpo.main(<argv>) with each batched generate call (the ones
--rollout async makes in worker threads) printing the rank, its thread and the CUDA device that thread has
selected, as `[device] rank R LOCAL_RANK-device D main|worker`; the device must be the rank's own.

    python -m torch.distributed.run --nproc_per_node 2 tests/gpu_thread_devices.py train_grpo.py-flags...
"""
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

import generation  # noqa: E402

import vllm_backends  # noqa: E402
import train_grpo  # noqa: E402


def reporting(call):
    def on_device(self, *args, **kwargs):
        thread = "main" if threading.current_thread() is threading.main_thread() else "worker"
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else "cpu"
        print(f"[device] rank {os.environ.get('LOCAL_RANK')} device {device} {thread}", flush=True)
        return call(self, *args, **kwargs)
    return on_device


for backend in (generation.TransformersGenerator, vllm_backends.VLLMGenerator):
    backend.__call__ = reporting(backend.__call__)
train_grpo.main(sys.argv[1:])
