# Environment conventions shared by torchrun.sh and slurm.sbatch. Sourced; sets only what is unset,
# so anything exported by the user or the cluster wins.

# GPUs this process may use: CUDA_VISIBLE_DEVICES (set by Slurm's GRES) narrows what nvidia-smi lists.
llep_gpu_count() {
    command -v nvidia-smi >/dev/null || { echo 0; return; }
    if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
        local ids
        IFS=, read -ra ids <<<"$CUDA_VISIBLE_DEVICES"
        echo "${#ids[@]}"
    else
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    fi
}

LLEP_GPUS=$(llep_gpu_count)
if (( LLEP_GPUS > 0 )); then
    # Megatron overlaps TP/EP communication with compute only if kernels launch in issue order
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    # free NCCL buffers by stream sync instead of recordStream, which holds memory longer
    export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
    # NVLink SHARP reserves extra memory per communicator; Megatron-Bridge's gpt-oss recipes turn it off
    export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
else
    # every rank would otherwise start one OpenMP thread per core and oversubscribe the CPU
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
