#!/bin/bash
# Multi-node training under Slurm: one task a node, each running `accelerate launch` for its node's GPUs, the
# first node of the allocation hosting the rendezvous (docs/gpu.md, "Several nodes"). The paper's scale,
# 4 nodes x 8 GPUs, from the repository folder with the GPU virtualenv active:
#
#   sbatch --nodes 4 recipes/slurm_multinode.sh train_grpo.py --config recipes/grpo_qwen2.5-7b.yaml \
#       --base_url http://SIMULATOR_HOST:8001/v1
#   sbatch --nodes 4 recipes/slurm_multinode.sh train_ppo.py --config recipes/ppo_qwen2.5-7b.yaml \
#       --base_url http://SIMULATOR_HOST:8001/v1
#
# Arguments: the training script, then its own arguments. The accelerate config is the recipes' one
# (train_ppo.py: accelerate_configs/zero2.yaml, train_grpo.py: zero3.yaml), or $ACCELERATE_CONFIG.
# Environment: GPUS_PER_NODE (default: Slurm's count, else 8), MAIN_PROCESS_PORT (default 29500).
#
# Every node must reach the simulator, and in GRPO's vLLM server mode (--rollout async, the default) the server:
# `localhost` in --base_url (or in the recipe's base_url, which then needs a --base_url flag) or in the vLLM
# server's address (TRL's default host 0.0.0.0 too) names each node itself, and is refused here. The repository, the virtualenv, the model
# (or the hub cache, $HF_HOME), the profiles file and --output_dir must be at the same path on every node, and
# output_dir on a filesystem they all share: the scripts check it at start-up.
# Written for a GPU cluster and rehearsed on CPU with stand-ins for srun, scontrol and accelerate
# (tests/test_multinode.py); it has not run under a real Slurm.
#SBATCH --job-name=rlver
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=%x-%j.log
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: sbatch --nodes N $0 train_grpo.py|train_ppo.py [its arguments]" >&2
    exit 2
fi
case "$(basename "$1")" in
    train_ppo.py) default_config=accelerate_configs/zero2.yaml ;;
    train_grpo.py) default_config=accelerate_configs/zero3.yaml ;;
    *) default_config="" ;;
esac
export ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-$default_config}
if [[ -z $ACCELERATE_CONFIG ]]; then
    echo "error: no accelerate config for $1; set ACCELERATE_CONFIG" >&2
    exit 2
fi

# A setting as the flags give it (--name value or --name=value), else as the --config file does.
config=""
previous=""
for argument in "$@"; do
    [[ $previous == --config ]] && config=$argument
    [[ $argument == --config=* ]] && config=${argument#--config=}
    previous=$argument
done
setting() {
    local name=$1 value="" previous="" argument
    shift
    for argument in "$@"; do
        [[ $previous == --$name ]] && value=$argument
        [[ $argument == --$name=* ]] && value=${argument#--"$name"=}
        previous=$argument
    done
    if [[ -z $value && -n $config && -f $config ]]; then
        value=$(sed -n "s/^$name:[[:space:]]*\([^[:space:]#]*\).*/\1/p" "$config")
    fi
    echo "$value"
}
names_this_node() { [[ $1 =~ ^(https?://)?(localhost|127\.[0-9.]+|0\.0\.0\.0|\[::1\]|::1)([:/]|$) ]]; }

base_url=$(setting base_url "$@")
if names_this_node "$base_url"; then
    echo "error: the simulator's base_url $base_url names each node itself; pass --base_url with a host every" \
         "node reaches, e.g. http://$(hostname):8001/v1 for a server on this node" >&2
    exit 2
fi
# GRPO's vLLM server: with --rollout async (the default) every rank sends its turns there. TRL's default host is
# 0.0.0.0, which names each node itself.
if [[ $(setting vllm_mode "$@") == server && $(setting rollout "$@") != lockstep ]]; then
    vllm_server=$(setting vllm_server_base_url "$@")
    vllm_host=$(setting vllm_server_host "$@")
    [[ -z $vllm_server ]] && vllm_server=${vllm_host:-0.0.0.0}
    if names_this_node "$vllm_server"; then
        echo "error: the vLLM server at $vllm_server names each node itself, and with --rollout async every rank" \
             "sends its turns there; pass --vllm_server_host with a host every node reaches, e.g. $(hostname)" \
             "for a server on this node (or --rollout lockstep: only the main process talks to it then)" >&2
        exit 2
    fi
fi

: "${SLURM_JOB_NODELIST:?not in a Slurm allocation: submit this script with sbatch}"
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
MAIN_PROCESS_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MAIN_PROCESS_PORT=${MAIN_PROCESS_PORT:-29500}
export GPUS_PER_NODE MAIN_PROCESS_IP MAIN_PROCESS_PORT
echo "$SLURM_NNODES nodes x $GPUS_PER_NODE processes, rendezvous at $MAIN_PROCESS_IP:$MAIN_PROCESS_PORT"

# Single quotes: each task reads its own SLURM_NODEID. --num_processes is the total over all machines.
# --kill-on-bad-exit: a node that fails stops the others instead of leaving them waiting at a collective.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c 'exec accelerate launch --config_file "$ACCELERATE_CONFIG" \
    --num_machines "$SLURM_NNODES" --machine_rank "$SLURM_NODEID" \
    --num_processes "$((SLURM_NNODES * GPUS_PER_NODE))" \
    --main_process_ip "$MAIN_PROCESS_IP" --main_process_port "$MAIN_PROCESS_PORT" "$@"' launch "$@"
