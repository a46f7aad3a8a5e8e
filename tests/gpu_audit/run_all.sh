#!/bin/bash
# CPU reproducer of the failures once found in the project's GPU-only code paths, run with the fake vllm 0.31.0 and
# the fake `trl vllm-serve` of tests/fake_vllm (see README.md). From the project's root:
#     bash tests/gpu_audit/run_all.sh          # 3-8 minutes on 2 cores
# Environment (all optional):
#   PROJECT_DIR  the project's root (default: the current directory); only read
#   AUDIT_OUT    scratch folder for the copy of the project (repo/), the tiny model, runs/, logs/, client.log,
#                server.log (default: a new folder from mktemp -d)
#   PYTHON       interpreter (default: the project's .venv/bin/python, else python3)
#   AUDIT_PORT   port of the fake vllm-serve (default: a free one)
set -u
AUDIT_HOME=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
PROJECT_DIR=$(cd "${PROJECT_DIR:-.}" && pwd -P) || exit 2
for f in common.py rule_user.py generation.py rollout.py simulator.py train_grpo.py train_ppo.py eval_sentient.py eval_general.py recipes accelerate_configs; do
  [ -e "$PROJECT_DIR/$f" ] || { echo "$PROJECT_DIR has no $f: run this from the project's root or set PROJECT_DIR" >&2; exit 2; }
done
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$PROJECT_DIR/.venv/bin/python" ]; then PYTHON=$PROJECT_DIR/.venv/bin/python; else PYTHON=python3; fi
fi
if [ -z "${AUDIT_OUT:-}" ]; then AUDIT_OUT=$(mktemp -d -t gpu-audit.XXXXXX) || exit 2; fi
AUDIT_OUT=$("$PYTHON" -c 'import os, sys; print(os.path.realpath(sys.argv[1]))' "$AUDIT_OUT") || exit 2
case "$AUDIT_OUT/" in  # checked before anything is created there
  "$PROJECT_DIR/"*|"$AUDIT_HOME/"*) echo "AUDIT_OUT ($AUDIT_OUT) must lie outside the project" >&2; exit 2;;
esac
mkdir -p "$AUDIT_OUT" || exit 2
REPO=$AUDIT_OUT/repo TINY=$AUDIT_OUT/tiny RUNS=$AUDIT_OUT/runs LOGS=$AUDIT_OUT/logs
free_port() { "$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
PORT=${AUDIT_PORT:-$(free_port)}
export AUDIT_HOME AUDIT_OUT PROJECT_DIR
export TRL_EXPERIMENTAL_SILENCE=1 PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=1 FAKE_VLLM_LOG=$AUDIT_OUT/client.log
export FAKE_URL=http://127.0.0.1:$PORT
echo "scratch folder: $AUDIT_OUT"
echo "project: $PROJECT_DIR"
echo "python: $PYTHON ($("$PYTHON" -c "import importlib.metadata as m; print(', '.join(p + ' ' + m.version(p) for p in ('torch', 'transformers', 'trl', 'accelerate', 'peft')))" 2>&1 | tail -1))"
mkdir -p "$RUNS" "$LOGS"
cd "$AUDIT_OUT" || exit 2

# A fresh copy of the project: the scripts run there, so nothing is written into the project itself.
rm -rf "$REPO" && mkdir -p "$REPO"
(cd "$PROJECT_DIR" && tar --exclude=./.git --exclude='./.venv*' --exclude=./cache --exclude=./runs --exclude=__pycache__ \
  --exclude=.pytest_cache -cf - .) | tar -xf - -C "$REPO" || { echo "could not copy the project to $REPO" >&2; exit 1; }
if [ ! -f "$TINY/config.json" ]; then
  nice -n 10 "$PYTHON" "$AUDIT_HOME/make_tiny.py" > "$LOGS/make_tiny.out" 2>&1 \
    || { echo "could not build the tiny model:" >&2; tail -5 "$LOGS/make_tiny.out" >&2; exit 1; }
fi

FAKE=$REPO/tests/fake_vllm  # the copy's fake vllm, fake server and runner
export FAKE
nice -n 10 "$PYTHON" "$FAKE/server.py" --port "$PORT" --model "$TINY" --log "$AUDIT_OUT/server.log" > "$LOGS/server.out" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null' EXIT
for _ in $(seq 120); do grep -q '^ready' "$LOGS/server.out" 2>/dev/null && break; sleep 0.5; done
grep -q '^ready' "$LOGS/server.out" || { echo "the fake vllm-serve did not start:" >&2; tail -5 "$LOGS/server.out" >&2; exit 1; }

run2() { nice -n 10 timeout 170 "$PYTHON" -m torch.distributed.run --nproc_per_node 2 --master_port "$(free_port)" "$@"; }
section() { echo; echo "=== $*"; }
H=$AUDIT_HOME

section "1. generation.VLLMGenerator -> real TRL VLLMGeneration (server mode) + VLLMClient, 2 ranks / 1 rank"
run2 "$H/check_ranks.py" 2>&1 | grep -E "^case" | sort
nice -n 10 timeout 100 "$PYTHON" "$H/check_ranks.py" 2>&1 | grep -E "^case"

section "2. same, colocate mode (fake vllm.LLM): tensor_parallel_size=1 (the recipes) and 2"
for TP in 1 2; do echo "-- TP=$TP"; MODE=colocate TP=$TP run2 "$H/check_ranks.py" 2>&1 | grep -E "^case [123]" | sort; done

section "3. train_grpo.py --use_vllm --vllm_mode server, 2 ranks, end to end (crashes when ranks disagree or all dialogues ended)"
for S in 1 2; do rm -f client.log; rm -rf "$RUNS/grpo-server"
  run2 "$FAKE/run.py" train_grpo.py --model_name_or_path "$TINY" --output_dir "$RUNS/grpo-server" --max_steps 3 --max_turns 6 \
    --max_reply_tokens 24 --max_dialogue_tokens 400 --num_generations 2 --per_device_train_batch_size 4 --seed $S --use_vllm \
    --vllm_mode server --vllm_server_base_url "$FAKE_URL" --use_cpu true > "$LOGS/grpo_server_s$S.out" 2>&1
  echo "seed $S rc=$?: $(grep -E '^\[rank[01]\]: [A-Za-z]*Error' "$LOGS/grpo_server_s$S.out" | cut -c1-90 | head -2 | tr '\n' ' ')"
  grep -hE "(rollout|generation).py\", line" "$LOGS/grpo_server_s$S.out" | tail -1
  "$PYTHON" -c "
import json
for l in open('client.log'):
    r = json.loads(l)
    if r['event'] == 'generate_call' and (r['n_contexts'] != 4 or 'own' not in r['verdicts']): print('   rank', r['rank'], 'contexts', r['n_contexts'], '-> completions', r['n_sampled'], r['verdicts'])"
done

section "4. train_grpo.py --use_vllm colocate, 2 ranks, --think (works); then with --vllm_enable_sleep_mode (1 rank)"
rm -f client.log; rm -rf "$RUNS/grpo-colo"
run2 "$FAKE/run.py" train_grpo.py --model_name_or_path "$TINY" --output_dir "$RUNS/grpo-colo" --max_steps 2 --max_turns 5 --think \
  --max_think_tokens 12 --max_reply_tokens 16 --max_dialogue_tokens 400 --num_generations 2 --per_device_train_batch_size 4 \
  --use_vllm --vllm_mode colocate --use_cpu true > "$LOGS/grpo_colo.out" 2>&1; echo "colocate rc=$?"
"$PYTHON" -c "
import json, collections
c = collections.Counter()
for l in open('client.log'):
    r = json.loads(l)
    if r['event'] == 'generate_call': c[('rank', r['rank'], 'contexts', r['n_contexts'], 'stop', r['stop'], 'all own', all(v == 'own' for v in r['verdicts']), 'logprobs aligned', r['logprobs_ok'])] += 1
for k, v in sorted(c.items(), key=str): print('  ', k, 'x', v)"
grep -o "sampling/importance_sampling_ratio/mean': '[^']*'" "$LOGS/grpo_colo.out" | head -2
rm -f client.log; rm -rf "$RUNS/grpo-sleep"
nice -n 10 timeout 170 "$PYTHON" "$FAKE/run.py" train_grpo.py --model_name_or_path "$TINY" --output_dir "$RUNS/grpo-sleep" --max_steps 1 --max_turns 4 --think \
  --max_think_tokens 12 --max_reply_tokens 16 --max_dialogue_tokens 600 --num_generations 2 --per_device_train_batch_size 4 \
  --use_vllm --vllm_mode colocate --vllm_enable_sleep_mode > "$LOGS/grpo_sleep.out" 2>&1; echo "sleep mode rc=$?"
"$PYTHON" -c "
import json, collections
c = collections.Counter(json.loads(l)['event'] + str(json.loads(l).get('tags', '')) for l in open('client.log'))
print('   one training step:', c['generate_call'], 'generate calls,', c[\"LLM_wake_up['weights']\"], 'weight wake-ups (each a full sync_weights)')"

section "5. train_ppo.py --use_vllm against the fake vllm-serve (push_weights + generation)"
rm -f client.log server.log; rm -rf "$RUNS/ppo-server"
nice -n 10 timeout 170 "$PYTHON" "$FAKE/run.py" train_ppo.py --model_name_or_path "$TINY" --output_dir "$RUNS/ppo-server" --max_steps 2 --max_turns 3 \
  --think --max_think_tokens 10 --max_reply_tokens 16 --max_dialogue_tokens 400 --dialogues_per_profile 4 --minibatch_size 4 \
  --use_vllm --vllm_server_host 127.0.0.1 --vllm_server_port "$PORT" > "$LOGS/ppo_server.out" 2>&1; echo "ppo rc=$?"
"$PYTHON" -c "
import json
rows = [json.loads(l) for l in open('server.log')]
fin = [r for r in rows if r['event'] == 'finish_weight_update']
print('   weight-update sessions (start..finish) for 2 pushes of a 20-tensor model:', len(fin))
print('   names rejected:', [r for r in rows if r['event'] == 'update_weights_rejected'])
print('   fused layers left partially loaded after the last push (the layerwise-reload rule of vLLM):', fin[-1]['corrupted_fused_layers'])
c = [json.loads(l) for l in open('client.log') if json.loads(l)['event'] == 'generate_call']
print('   generate calls:', len(c), 'all own:', all(v == 'own' for r in c for v in r['verdicts']), 'logprobs aligned:', all(r['logprobs_ok'] for r in c))"

section "6. eval_sentient.py / eval_general.py --use_vllm (fake vllm.LLM)"
rm -f client.log; rm -rf "$RUNS/eval"
for M in "$TINY" "$RUNS/grpo-colo"; do
  N=$(basename "$M")
  nice -n 10 timeout 120 "$PYTHON" "$FAKE/run.py" eval_sentient.py --model "$M" --use_vllm --think --limit 3 --output "$RUNS/eval/$N.jsonl" > "$LOGS/eval_$N.out" 2>&1
  echo "eval_sentient --model ${M#"$AUDIT_OUT"/} rc=$? $(grep -E '^ *score|^[A-Za-z]*Error' "$LOGS/eval_$N.out" | head -1)"; done
nice -n 10 timeout 120 "$PYTHON" "$FAKE/run.py" eval_general.py --model "$TINY" --use_vllm --tasks humaneval --limit 2 --output_dir "$RUNS/eval/general" > "$LOGS/evalg.out" 2>&1
echo "eval_general rc=$? $(grep -E 'pass@1|^[A-Za-z]*Error' "$LOGS/evalg.out" | head -1)"

section "7. transformers of the GPU set (requirements-gpu.txt) and 5.20.2 (the newest vllm 0.33 allows): generation.TransformersGenerator"
GPU_TF=$(sed -n 's/^transformers==\([0-9.]*\).*/\1/p' "$PROJECT_DIR/requirements-gpu.txt")
for V in $GPU_TF 5.20.2; do
  TF=$AUDIT_OUT/tf-$V
  if [ ! -d "$TF/transformers" ]; then  # transformers < 5.20 also needs huggingface_hub < 2 and httpx beside it
    rm -rf "$TF" "$TF.partial" "$AUDIT_OUT/dl-$V" && mkdir -p "$AUDIT_OUT/dl-$V"
    "$PYTHON" -m pip download -q --no-deps -d "$AUDIT_OUT/dl-$V" "transformers==$V" "huggingface_hub<2" httpx httpcore > "$LOGS/pip_download_$V.out" 2>&1 \
      && for W in "$AUDIT_OUT/dl-$V"/*.whl; do "$PYTHON" -m zipfile -e "$W" "$TF.partial"; done >> "$LOGS/pip_download_$V.out" 2>&1 \
      && mv "$TF.partial" "$TF"
  fi
  if [ -d "$TF/transformers" ]; then
    PYTHONPATH=$TF nice -n 10 timeout 100 "$PYTHON" "$H/check_transformers.py" 2>&1 | grep -E "^transformers|OK|Error"
  else
    echo "skipped: pip download --no-deps transformers==$V failed (see $LOGS/pip_download_$V.out)"
  fi
done

section "8. recipes and configs"
nice -n 10 timeout 100 "$PYTHON" "$H/check_recipes.py" 2>&1 | grep -v -i warn
if "$PYTHON" -c "import deepspeed" 2>/dev/null; then
  echo "-- real ZeRO-2 on 2 CPU processes (train_ppo.py under accelerate_configs/zero2.yaml, tests/test_ppo_gpu_paths.py):"
  (cd "$REPO" && nice -n 10 timeout 400 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_ppo_gpu_paths.py -k zero2 2>&1 | tail -1)
else
  echo "-- real ZeRO-2 rehearsal skipped: deepspeed is not installed in this environment"
fi
