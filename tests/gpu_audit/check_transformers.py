"""generation.TransformersGenerator under the transformers on PYTHONPATH (run_all.sh puts an unpacked
transformers there: the GPU set's, and 5.20.2): two calls, the second continuing the first's contexts (the prefix cache)."""
import os
import sys

OUT = os.environ["AUDIT_OUT"]  # the scratch folder run_all.sh made
REPO, TINY = os.path.join(OUT, "repo"), os.path.join(OUT, "tiny")
sys.path.insert(0, REPO)
import transformers  # noqa: E402
print("transformers", transformers.__version__, transformers.__file__)
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402
import generation  # noqa: E402
tok = AutoTokenizer.from_pretrained(TINY)
model = AutoModelForCausalLM.from_pretrained(TINY).eval()
gen = generation.TransformersGenerator(model, tok, GenerationConfig(
    do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
try:
    out, _ = gen([[1, 2, 3, 4], [5, 6, 7]], [5, 5])
    print("first call OK", out)
    out, _ = gen([[1, 2, 3, 4] + out[0] + [9, 9], [5, 6, 7] + out[1]], [5, 5])
    print("second call OK", out)
except Exception:
    import traceback
    traceback.print_exc(limit=3)
