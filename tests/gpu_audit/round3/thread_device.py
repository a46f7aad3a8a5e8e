"""Risk R1's mechanism (the failure itself needs several GPUs): with --rollout async (the default) and a batched
generator (transformers, or TRL's colocated vLLM engine with tensor parallelism 1 and no sleep mode: the GRPO
recipes), rollout.TurnBatcher calls the generator through asyncio.to_thread, i.e. in a worker thread of the event
loop's executor, never in the thread where accelerate selected the rank's GPU (accelerate/state.py:843-845,
torch.cuda.set_device). CUDA's current device is per host thread, so on rank r > 0 that worker thread runs with
device 0 selected; vLLM's engine step relies on the current device and stream (vllm/v1/worker/
gpu_model_runner.py:309, and its own helper threads select the device first: vllm/v1/worker/gpu/ubatch_utils.py:
473-474). CUDA cannot be shown on CPU; what can:

(a) the real DialogueRunner (rule user, 2 dialogues) with a stand-in generator recording the thread it runs in and
    the torch default device it sees, after the main thread set the default device to `meta` (torch keeps that
    per thread too: torch/__init__.py `_GLOBAL_DEVICE_CONTEXT = threading.local()`), async against lockstep;
(b) train_grpo.py as the GRPO recipes run it (vLLM colocated, tensor parallelism 1, no sleep mode; the fake vllm of
    tests/fake_vllm), one step on one process: the thread of each `LLM.generate` call (TRL's colocate path) and of
    TRL's weight sync."""
import json
import re
import sys
import threading

import audit
import torch
from transformers import AutoTokenizer

import rollout
import simulator

model_dir = audit.tiny_model()
tokenizer = AutoTokenizer.from_pretrained(model_dir)
seen = []


def generate(contexts, max_new_tokens, stop=None):
    """One short reply per context; records where it ran."""
    seen.append((threading.current_thread() is threading.main_thread(), threading.current_thread().name,
                 str(torch.empty(0).device)))
    return [tokenizer.encode("I hear you.", add_special_tokens=False) + [tokenizer.eos_token_id] for _ in contexts], None


profile = simulator.load_profiles(simulator.DEFAULT_PROFILES)[0]
found = {}
for schedule in ("async", "lockstep"):
    seen.clear()
    runner = rollout.DialogueRunner(tokenizer, rollout.DialogueArguments(max_turns=2, rollout=schedule))
    opening = runner.openings([profile])[profile.id]
    torch.set_default_device("meta")  # the main thread's device choice, as accelerate's torch.cuda.set_device(r)
    try:
        runner.run([(profile, opening)] * 2, generate)
    finally:
        torch.set_default_device(None)
        runner.close()
    found[schedule] = list(seen)
    print(f"(a) --rollout {schedule}: {len(seen)} generate calls; in the main thread: {[main for main, _, _ in seen]}; "
          f"threads {sorted({name for _, name, _ in seen})}; default device seen there: "
          f"{sorted({device for _, _, device in seen})} (the main thread set meta)")
async_off_main = [call for call in found["async"] if not call[0]]
shown_a = bool(async_off_main) and all(call[2] != "meta" for call in async_off_main) \
    and all(call[0] and call[2] == "meta" for call in found["lockstep"])

output = audit.fresh_folder("thread-device")
code, said = audit.run([sys.executable, audit.HERE / "thread_device_child.py", audit.PROJECT,
                        "--model_name_or_path", model_dir, "--output_dir", output, "--use_vllm", "--vllm_mode",
                        "colocate", "--use_cpu", "true", "--max_steps", "1", "--max_turns", "2", "--num_generations", "2",
                        "--per_device_train_batch_size", "4", "--max_reply_tokens", "16", "--report_to", "none"],
                       400, "thread_device.log")
calls = [json.loads(found) for found in re.findall(r"\[thread\] (\{[^\n]*\})", said)]
generates = [call for call in calls if call["call"] == "LLM.generate"]
syncs = [call for call in calls if call["call"] == "sync_weights"]
print(f"(b) train_grpo.py, vLLM colocated (TP 1, no sleep), exit {code}: {len(generates)} LLM.generate calls, in "
      f"threads {sorted({call['thread'] for call in generates})} (main thread: "
      f"{sorted({call['main'] for call in generates})}), on devices {sorted({call['device'] for call in generates})} "
      f"(the main thread selected 1); TRL's weight sync in {sorted({c['thread'] for c in syncs})}")
if code != 0:
    print("\n".join(said.splitlines()[-12:]))
# Adapted in the project: shown when a call off the main thread runs on another device than the one selected there.
shown_b = code == 0 and bool(generates) and any(not call["main"] and call["device"] != 1 for call in generates)
audit.result(shown_a and shown_b,
             f"(a) async: {len(async_off_main)} of {len(found['async'])} generate calls ran outside the main thread and "
             f"did not see its device choice, lockstep: all in the main thread; (b) the recipe path ran "
             f"{len(generates)} vLLM engine calls outside the main thread on another device than the rank's",
             words=("SHOWN", "not shown"))
