"""vllm_backends.VLLMGenerator over the REAL TRL 1.16 VLLMGeneration in the mode MODE (default server; colocate uses the
fake vllm.LLM) with tensor_parallel_size TP (default 1), on 1 or 2 CPU ranks (gloo). Contexts are unique per rank;
the first sampled token is a function of the context (vllm._fakegen.tag), so each rank can check it got its own
completion."""
import os
import sys
from datetime import timedelta
from types import SimpleNamespace

OUT = os.environ["AUDIT_OUT"]  # the scratch folder run_all.sh made: repo/ (copy of the project), tiny/
REPO, TINY = os.path.join(OUT, "repo"), os.path.join(OUT, "tiny")
sys.path[:0] = [os.path.join(REPO, "tests", "fake_vllm"), REPO]
import run  # noqa: E402,F401  (the fake's patch of TRL's CUDA-only rendezvous)
from accelerate import Accelerator, InitProcessGroupKwargs  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402


import vllm_backends  # noqa: E402
from vllm._fakegen import EOS, tag  # noqa: E402

acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=30))])
rank = acc.process_index
model = AutoModelForCausalLM.from_pretrained(TINY)
tok = AutoTokenizer.from_pretrained(TINY)
gen = VLLMGeneration(model=model, accelerator=acc, processing_class=tok, mode=os.environ.get("MODE", "server"), tensor_parallel_size=int(os.environ.get("TP", "1")),
                     server_base_url=os.environ["FAKE_URL"], max_completion_length=16, logprobs=0)
generate = vllm_backends.VLLMGenerator(SimpleNamespace(vllm_generation=gen))


def run(case, n_contexts, budget):
    contexts = [[1, 2, 3, 1000 + 100 * rank + 10 * case + i] for i in range(n_contexts)]
    budgets = [budget] * n_contexts
    try:
        sampled, logprobs = generate(contexts, budgets)
    except Exception as error:  # noqa: BLE001
        print(f"case {case} rank {rank}: {n_contexts} contexts -> RAISED {type(error).__name__}: {error}", flush=True)
        return
    verdicts = []
    for context, limit, ids in zip(contexts, budgets, sampled):
        if ids[:1] != [tag(context)]:
            verdicts.append("NOT-ITS-OWN")
        elif len(ids) < limit and ids[-1] != EOS:
            verdicts.append(f"own-but-cut-at-{len(ids)}-of-budget-{limit}")
        else:
            verdicts.append("own")
    print(f"case {case} rank {rank}: {n_contexts} contexts (budget {budget}) -> {len(sampled)} completions: "
          f"{verdicts}", flush=True)


cases = [(0, {0: 2, 1: 2}, {0: 30, 1: 30}),   # equal counts: control
         (1, {0: 2, 1: 1}, {0: 30, 1: 30}),   # a dialogue of rank 1 ended earlier
         (2, {0: 1, 1: 2}, {0: 30, 1: 30}),   # a dialogue of rank 0 ended earlier
         (3, {0: 0, 1: 2}, {0: 30, 1: 30}),   # every dialogue of rank 0 has ended
         (4, {0: 2, 1: 2}, {0: 3, 1: 30})]    # rank 0's dialogues are near the token budget
if acc.num_processes == 1:
    cases = [(5, {0: 2}, {0: 30}), (6, {0: 0}, {0: 30})]   # single process: then every dialogue has ended
for case, counts, budgets in cases:
    run(case, counts[rank], budgets[rank])
    acc.wait_for_everyone()
