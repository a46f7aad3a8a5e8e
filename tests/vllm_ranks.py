"""vllm_backends.VLLMGenerator over TRL's real VLLMGeneration on several CPU ranks (gloo), with the fake vllm:

    python -m torch.distributed.run --nproc_per_node 2 tests/vllm_ranks.py OUT_DIR MODE TP MODEL [SERVER_URL]

MODE is server (against tests/fake_vllm/server.py) or colocate (the fake vllm.LLM, tensor_parallel_size TP).
Each case gives every rank its own contexts, each with its own length and token budget, as dialogues that end at
different turns do. Contexts are unique per rank and the fake's first sampled token names its context, so each rank
checks it got its own completion at its own length; each rank writes one JSON line per case to
OUT_DIR/rank<N>.jsonl (a file each: the ranks' printed lines could interleave)."""
import json
import os
import sys
from datetime import timedelta
from types import SimpleNamespace

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_vllm")]
import run  # noqa: E402,F401  (the fake's patches: TRL's CUDA-only rendezvous)
from accelerate import Accelerator, InitProcessGroupKwargs  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402


import vllm_backends  # noqa: E402
from vllm._fakegen import EOS, tag  # noqa: E402

SHORT, LONG = 4, 50  # context lengths; the server test runs the fake at max_model_len 64
CASES = [  # per rank, one (context length, budget) per context
    ([(SHORT, 30)] * 2, [(SHORT, 30)] * 2),  # equal counts: the control
    ([(SHORT, 30)] * 2, [(SHORT, 30)]),  # a dialogue of rank 1 has ended
    ([(SHORT, 30)], [(SHORT, 30)] * 2),  # a dialogue of rank 0 has ended
    ([], [(SHORT, 30)] * 2),  # every dialogue of rank 0 has ended
    ([(SHORT, 3)] * 2, [(SHORT, 30)] * 2),  # rank 0's dialogues are near their token budget
    ([], []),  # every dialogue has ended before max_turns
    # A long dialogue near its end with a small budget beside short ones with large budgets, budgets differing
    # within and across ranks: 50 + 30 tokens would pass max_model_len 64, so each needs its own request.
    ([(LONG, 10), (SHORT, 30)], [(SHORT, 12), (SHORT, 30), (SHORT, 30)]),
]

out_dir, mode, tensor_parallel_size, model_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=60))])
rank = accelerator.process_index
tokenizer = AutoTokenizer.from_pretrained(model_dir)
trl_generation = VLLMGeneration(model=AutoModelForCausalLM.from_pretrained(model_dir), accelerator=accelerator,
                                processing_class=tokenizer, mode=mode, tensor_parallel_size=tensor_parallel_size,
                                server_base_url=sys.argv[5] if mode == "server" else None, max_completion_length=16,
                                logprobs=0)
generate = vllm_backends.VLLMGenerator(SimpleNamespace(vllm_generation=trl_generation))
for case, per_rank in enumerate(CASES):
    shapes = per_rank[rank]
    contexts = [[1] * (length - 1) + [1000 + 100 * rank + 10 * case + i] for i, (length, _) in enumerate(shapes)]
    budgets = [budget for _, budget in shapes]
    result = {"case": case, "rank": rank, "contexts": len(contexts)}
    try:
        sampled, logprobs = generate(contexts, budgets)
    except Exception as error:  # noqa: BLE001  (reported, then the test fails on it)
        result["raised"] = f"{type(error).__name__}: {error}"
    else:
        result["completions"] = len(sampled)
        result["verdicts"] = ["other's" if ids[:1] != [tag(context)] else
                              "cut" if len(ids) < budget and ids[-1] != EOS else
                              "over budget" if len(ids) > budget else "own"
                              for context, budget, ids in zip(contexts, budgets, sampled)]
        result["logprobs_aligned"] = logprobs is None or [len(lp) for lp in logprobs] == [len(ids) for ids in sampled]
    with open(os.path.join(out_dir, f"rank{rank}.jsonl"), "a") as out:
        out.write(json.dumps(result) + "\n")
    accelerator.wait_for_everyone()
