#!/usr/bin/env bash
# Launch recipes/finetune.py (or another entry point: LLEP_ENTRY) with torchrun on this node (one process per
# GPU, or 2 on CPU).
set -euo pipefail

usage="usage: $(basename "$0") [-h] [recipes/finetune.py args...]
  env: NPROC_PER_NODE (GPU count, or 2 on CPU)  NNODES (1)  NODE_RANK (0)
       MASTER_ADDR (localhost)  MASTER_PORT (29500)  PYTHON (python)
       DISTRIBUTED_CONFIG: a distributed_config.env to source first (its values override the environment)
       LLEP_ENTRY: finetune (default, recipes/finetune.py), pretrain_gpt (recipes/pretrain_gpt.py:
                   Megatron-LM's loop and flags, docs/pretrain.md), evaluate, generate or cap_pipeline
                   (recipes/<name>.py, docs/inference.md)
  finetune.py's own options: python recipes/finetune.py -h"
if [[ ${1:-} == -h || ${1:-} == --help ]]; then echo "$usage"; exit 0; fi

cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -n ${DISTRIBUTED_CONFIG:-} ]]; then
    [[ -f $DISTRIBUTED_CONFIG ]] || { echo "$0: DISTRIBUTED_CONFIG=$DISTRIBUTED_CONFIG is not a file" >&2; exit 2; }
    # shellcheck source=/dev/null
    source "$DISTRIBUTED_CONFIG"
fi
source launch/env.sh
entry=recipes/${LLEP_ENTRY:-finetune}.py
[[ ${LLEP_ENTRY:-finetune} == @(finetune|pretrain_gpt|evaluate|generate|cap_pipeline) ]] || {
    echo "$0: LLEP_ENTRY must be finetune, pretrain_gpt, evaluate, generate or cap_pipeline, got '$LLEP_ENTRY'" >&2
    exit 2; }

if (( LLEP_GPUS > 0 )); then : "${NPROC_PER_NODE:=$LLEP_GPUS}"; else : "${NPROC_PER_NODE:=2}"; fi
: "${NNODES:=1}" "${NODE_RANK:=0}" "${MASTER_ADDR:=localhost}" "${MASTER_PORT:=29500}"
for name in NPROC_PER_NODE NNODES NODE_RANK MASTER_PORT; do
    [[ ${!name} =~ ^[0-9]+$ ]] || { echo "$0: $name=${!name} is not a non-negative integer" >&2; exit 2; }
done
if (( NPROC_PER_NODE < 1 || NNODES < 1 || NODE_RANK >= NNODES )); then
    echo "$0: need NPROC_PER_NODE >= 1, NNODES >= 1 and NODE_RANK < NNODES" \
         "(got $NPROC_PER_NODE, $NNODES, $NODE_RANK)" >&2
    exit 2
fi

# launch/torchrun.py: torchrun itself, ending in one line (no traceback) on Ctrl-C/SIGTERM or a failed worker
exec "${PYTHON:-python}" launch/torchrun.py --nproc_per_node "$NPROC_PER_NODE" --nnodes "$NNODES" \
    --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$entry" "$@"
