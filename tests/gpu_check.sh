#!/bin/bash
# The check to run the day a GPU machine is lent (docs/gpu.md, "The third audit"): one command, under 10 minutes
# on one GPU, from the project's root with the GPU set installed:
#
#     bash tests/gpu_check.sh [FOLDER]        # FOLDER: where the runs and logs go (default: $OUT, else a new one)
#
# 1. tests/test_gpu.py (PPO, GRPO and an evaluation on the GPU; vLLM colocated where it is installed).
# 2. One GRPO step of the demo, --rollout async and then --rollout lockstep, the same seed (vLLM colocated where
#    it is installed, else transformers), and their first-step metrics side by side. Under transformers with the
#    rule user the two schedules make the same generate calls, so the metrics should agree up to the GPU's own
#    non-determinism; vLLM is batch-invariant only with VLLM_BATCH_INVARIANT=1, so there they may part.
# 3. With 2 GPUs or more: the async GRPO step on 2 processes, whose worker threads must generate on their own
#    rank's GPU (generation.on_callers_devices); each rank's device is printed.
# Prints a summary at the end; exits 1 if a part failed.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
FOLDER=${1:-${OUT:-$(mktemp -d -t gpu-check.XXXXXX)}}
mkdir -p "$FOLDER" || exit 2
PYTHON=${PYTHON:-python}
echo "folder: $FOLDER"
"$PYTHON" - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs: {torch.cuda.device_count()}",
      *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
EOF
failed=()
VLLM=()
if "$PYTHON" -c "import vllm" 2>/dev/null; then
    VLLM=(--use_vllm --vllm_mode colocate --vllm_gpu_memory_utilization 0.25)
fi
STEP=(--max_steps 1 --max_turns 2 --seed 42 --save_strategy no --report_to none "${VLLM[@]}")

echo "=== 1. tests/test_gpu.py"
timeout 360 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_gpu.py > "$FOLDER/test_gpu.log" 2>&1 \
    || failed+=("tests/test_gpu.py")
tail -3 "$FOLDER/test_gpu.log"

echo "=== 2. one GRPO step, async and lockstep (${VLLM[*]:-transformers})"
for schedule in async lockstep; do
    timeout 150 "$PYTHON" train_grpo.py --output_dir "$FOLDER/grpo-$schedule" --rollout "$schedule" "${STEP[@]}" \
        > "$FOLDER/grpo-$schedule.log" 2>&1 || failed+=("GRPO step, --rollout $schedule")
done
"$PYTHON" - "$FOLDER" <<'EOF'
import json
import sys
from pathlib import Path

runs = {}
for schedule in ("async", "lockstep"):
    state = Path(sys.argv[1]) / f"grpo-{schedule}" / "trainer_state.json"
    runs[schedule] = json.loads(state.read_text())["log_history"][0] if state.is_file() else {}
keys = ["emotion/final_mean", "reward", "loss", "length/reply_tokens_per_turn", "step_time"]
print(f"{'metric':32} {'async':>12} {'lockstep':>12}")
for key in keys:
    print(f"{key:32} " + " ".join(f"{runs[s].get(key, float('nan')):12.4f}" for s in ("async", "lockstep")))
EOF

if [ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    echo "=== 3. the async GRPO step on 2 GPUs"
    timeout 200 "$PYTHON" -m torch.distributed.run --nproc_per_node 2 tests/gpu_thread_devices.py \
        --output_dir "$FOLDER/grpo-2gpu" "${STEP[@]}" > "$FOLDER/grpo-2gpu.log" 2>&1 || failed+=("GRPO on 2 GPUs")
    grep '^\[device\]' "$FOLDER/grpo-2gpu.log" | sort | uniq -c
    if grep '^\[device\]' "$FOLDER/grpo-2gpu.log" | awk '$3 != $5' | grep -q .; then
        failed+=("a generate call on another rank's GPU")
    fi
else
    echo "=== 3. skipped: one GPU"
fi

echo "=== summary"
if [ ${#failed[@]} -eq 0 ]; then echo "all parts passed; logs in $FOLDER"; exit 0; fi
printf 'failed: %s\n' "${failed[@]}"
echo "logs in $FOLDER"
exit 1
