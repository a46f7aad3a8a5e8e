#!/bin/bash
# CPU reproducers of the round-3 GPU-path audit (see README.md). From the project's root, with its venv's python:
#     bash tests/gpu_audit/round3/run_all.sh          # about 3 minutes on 2 busy cores
# (or give this file's full path). Prints each reproducer's findings, then one line per bug, `BUG n: REPRODUCED
# (...)` or `BUG n: not reproduced (...)`, and one line for the mechanism of risk R1 (`SHOWN` / `not shown`).
# Exits 0 whatever it finds.
# Environment (all optional):
#   PROJECT_DIR  the project's root (default: the current directory); only read
#   AUDIT_OUT    scratch folder (default: a new folder from mktemp -d): the tiny model, the runs and their logs
#                (<run>.log), each script's output (<script>.out) and errors (<script>.err)
#   PYTHON       interpreter with the project's requirements (default: .venv/bin/python of the project if it
#                exists, else python on PATH)
set -u
AUDIT_HOME=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
BUGS="1 2"
not_run() { echo "$1" >&2; for n in $BUGS; do echo "BUG $n: not reproduced (not run: $1)"; done
            echo "RISK R1 mechanism: not shown (not run: $1)"; exit 0; }
PROJECT_DIR=$(cd "${PROJECT_DIR:-.}" && pwd -P) || not_run "no folder ${PROJECT_DIR:-.}"
for f in train_grpo.py generation.py rollout.py tests/fake_vllm/run.py tests/fake_vllm/server.py docs/gpu.md \
         recipes/slurm_multinode.sh; do
  [ -e "$PROJECT_DIR/$f" ] || not_run "$PROJECT_DIR has no $f: run this from the project's root or set PROJECT_DIR"
done
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$PROJECT_DIR/.venv/bin/python" ]; then PYTHON=$PROJECT_DIR/.venv/bin/python; else PYTHON=python; fi
fi
"$PYTHON" -c 'import torch, transformers, trl, accelerate, peft, openai, yaml' > /dev/null 2>&1 \
  || not_run "'$PYTHON' lacks the project's requirements: set PYTHON, or PATH to the venv"
AUDIT_OUT=${AUDIT_OUT:-$(mktemp -d -t gpu-audit-r3.XXXXXX)} || not_run "mktemp failed"
mkdir -p "$AUDIT_OUT" && AUDIT_OUT=$(cd "$AUDIT_OUT" && pwd -P) || not_run "cannot make $AUDIT_OUT"
case "$AUDIT_OUT/" in
  "$PROJECT_DIR/"*) not_run "AUDIT_OUT ($AUDIT_OUT) must lie outside the project";;
esac
export AUDIT_OUT PROJECT_DIR PYTHONDONTWRITEBYTECODE=1
touch "$AUDIT_OUT/.started"
echo "project: $PROJECT_DIR ($(git -C "$PROJECT_DIR" log -1 --format=%h 2>/dev/null || echo 'not a git checkout'))"
echo "scratch folder: $AUDIT_OUT"
versions="import importlib.metadata as m
print(', '.join(p + ' ' + m.version(p) for p in ('torch', 'transformers', 'trl', 'accelerate', 'peft', 'openai')))"
echo "python: $PYTHON ($("$PYTHON" -c "$versions" 2>&1 | tail -1))"

declare -A RESULT
run() {  # run SCRIPT: its findings (stdout) shown and kept in $AUDIT_OUT/SCRIPT.out, its stderr in SCRIPT.err
  local name=$1 started=$SECONDS
  echo; echo "=== $name.py"
  (cd "$PROJECT_DIR" && timeout -k 10 500 nice -n 10 "$PYTHON" "$AUDIT_HOME/$name.py") \
    > "$AUDIT_OUT/$name.out" 2> "$AUDIT_OUT/$name.err"
  local code=$?
  grep -v -E '^RESULT: |^\[[0-9-]+ [0-9:,]+\] \[' "$AUDIT_OUT/$name.out" | cut -c1-300
  RESULT[$name]=$(grep -m1 '^RESULT: ' "$AUDIT_OUT/$name.out" | sed 's/^RESULT: //')
  local failed="not reproduced"; [ "$name" = thread_device ] && failed="not shown"
  [ -n "${RESULT[$name]}" ] || RESULT[$name]="$failed (the script failed, exit $code: see $AUDIT_OUT/$name.err)"
  echo "-> ${RESULT[$name]} [$((SECONDS - started)) s]"
}
for name in grpo_lora_drift server_ranks thread_device; do run "$name"; done

changed=$(find "$PROJECT_DIR" -path "$PROJECT_DIR/.venv" -prune -o -path "$PROJECT_DIR/.git" -prune -o \
  -newer "$AUDIT_OUT/.started" -print 2>/dev/null | head -3)
[ -z "$changed" ] || echo "warning: files in the project changed during the run (by someone?): $changed"

echo
echo "BUG 1: ${RESULT[grpo_lora_drift]}"
echo "BUG 2: ${RESULT[server_ranks]}"
echo "RISK R1 mechanism: ${RESULT[thread_device]}"
exit 0
