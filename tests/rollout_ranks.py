"""One rollout per schedule and vLLM mode on several CPU ranks (gloo), against the fake vllm (tests/fake_vllm):

    python -m torch.distributed.run --nproc_per_node 2 tests/rollout_ranks.py OUT_DIR MODEL SERVER_URL SIMULATOR_URL

TRL's real VLLMGeneration, greedy, in server mode (lockstep: TRL's generate, a collective; async: a request of
our own for each turn) and in colocate mode with tensor parallelism 1 (lockstep, then async: TurnBatcher); and
transformers' generate on each rank's own model, greedy (lockstep, then async).
Rank 0 plays 3 dialogues and rank 1 plays 2, and an LLM simulated user answers after random latencies, so the
ranks make different calls at different times. Each rank writes what its dialogues hold, by schedule, to
OUT_DIR/rank<N>.json."""
import json
import os
import sys
from datetime import timedelta
from types import SimpleNamespace

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_vllm")]
import run  # noqa: E402,F401  (the fake's patches: TRL's CUDA-only rendezvous)
from accelerate import Accelerator, InitProcessGroupKwargs  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402
from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402

import chat_client  # noqa: E402
import generation  # noqa: E402
import rollout  # noqa: E402
import simulator  # noqa: E402
import vllm_backends  # noqa: E402

out_dir, model_dir, server_url, simulator_url = sys.argv[1:5]
accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=120))])
rank = accelerator.process_index
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)
vllm = {mode: VLLMGeneration(model=model, accelerator=accelerator, processing_class=tokenizer, mode=mode,
                             server_base_url=server_url if mode == "server" else None, temperature=0.0,
                             max_completion_length=16, logprobs=0)
        for mode in ("server", "colocate")}
simulator_args = simulator.SimulatorArguments(backend="llm", base_url=simulator_url, simulator_model="sim-model",
                                            change_bound=25)  # large changes: dialogues end at different turns
profiles = simulator.load_profiles(simulator.DEFAULT_PROFILES)[rank * 3:rank * 3 + (3 if rank == 0 else 2)]
results = {}
greedy = GenerationConfig(do_sample=False, eos_token_id=sorted(generation.end_of_turn_ids(tokenizer)),
                          pad_token_id=tokenizer.pad_token_id)
for mode in ("server", "colocate", "transformers"):
    for schedule in ("lockstep", "async"):
        dialogue_args = rollout.DialogueArguments(think=True, max_turns=4, max_think_tokens=8, max_reply_tokens=12,
                                                  max_dialogue_tokens=600, rollout=schedule)
        runner = rollout.DialogueRunner(tokenizer, dialogue_args, simulator_args,
                                        chat_client.ChatClient(simulator_url, "sim-model", max_retries=0))
        trainer = SimpleNamespace(vllm_generation=vllm.get(mode), accelerator=accelerator, args=SimpleNamespace(seed=0),
                                  state=SimpleNamespace(global_step=0))
        if mode == "transformers":  # each rank its own copy (DDP): generate is no collective
            generate = generation.TransformersGenerator(model, tokenizer, greedy)
        elif mode == "server" and schedule == "async":
            generate = vllm_backends.VLLMServerTurns.of_trainer(trainer)
        else:
            generate = vllm_backends.VLLMGenerator(trainer)
        dialogues = runner.run([(p, "I had a rough week.") for p in profiles], generate)
        runner.close()
        results[f"{mode}-{schedule}"] = [
            {"completion_ids": d.completion_ids, "env_mask": d.env_mask, "logprobs": d.logprobs,
             "emotions": d.emotions, "end_reason": d.end_reason, "turns": len(d.reply_texts)} for d in dialogues]
        accelerator.wait_for_everyone()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as out:
    json.dump(results, out)
