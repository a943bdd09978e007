"""Fine-tune a Megatron-Core GPT MoE model with LLEP (or plain EP) and report throughput.

CPU default (tiny model, gloo, 2 processes)::

    python -m torch.distributed.run --nproc_per_node 2 recipes/finetune.py

On CPU the gloo backend and megatron_llep.compat.cpu_gloo are used automatically.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_llep.config import LLEPConfig  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny", choices=["tiny"], help="model recipe")
    parser.add_argument("--train-iters", type=int, default=6)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--expert-model-parallel-size", type=int, default=None, help="default: world size")
    llep = parser.add_argument_group("LLEP")
    llep.add_argument("--no-llep", dest="llep", action="store_false", help="run plain expert parallelism")
    llep.add_argument("--llep-alpha", type=float, default=1.0)
    llep.add_argument("--llep-min-chunk-tokens", type=int, default=16, help="m (1024 on GPUs)")
    llep.add_argument("--llep-imbalance-threshold", type=float, default=1.3, help="lambda")
    llep.add_argument("--llep-cost-aware", action="store_true", help="veto spills the cost model predicts unprofitable")
    parser.add_argument(
        "--force-routing",
        default=None,
        metavar="F:H",
        help="demo/benchmark only: force a fraction F of tokens into H hot experts (Megatron router replay)",
    )
    args = parser.parse_args(argv)
    if args.train_iters <= 0 or args.micro_batch_size <= 0 or args.seq_length <= 0:
        parser.error("--train-iters, --micro-batch-size and --seq-length must be positive")
    if args.force_routing is not None:
        try:
            fraction, hot = args.force_routing.split(":")
            args.force_routing = (float(fraction), int(hot))
        except ValueError:
            parser.error(f"--force-routing expects F:H (e.g. 0.9:1), got {args.force_routing!r}")
    return args


def init_distributed() -> tuple[int, int, torch.device]:
    """Process group from torchrun's environment: NCCL on GPUs, gloo (+ CPU compat layer) on CPU."""
    if "RANK" not in os.environ:
        raise SystemExit("run me under torchrun, e.g. python -m torch.distributed.run --nproc_per_node 2 recipes/finetune.py")
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank)
    from megatron_llep.compat import cpu_gloo

    cpu_gloo.enable()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def build_model(args: argparse.Namespace, ep_size: int):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_llep.layer import with_llep
    from recipes.models import tiny_moe

    config = tiny_moe(ep_size)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False, normalization="RMSNorm")
    if args.llep:
        spec = with_llep(
            spec,
            LLEPConfig(
                alpha=args.llep_alpha,
                min_chunk_tokens=args.llep_min_chunk_tokens,
                imbalance_threshold=args.llep_imbalance_threshold,
                cost_aware=args.llep_cost_aware,
            ),
        )
    model = GPTModel(config, spec, vocab_size=args.vocab_size, max_sequence_length=args.seq_length)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True)
    model = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, use_distributed_optimizer=True, clip_grad=1.0), [model]
    )
    return model, optimizer, config


def _moe_layers(model) -> list:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _llep_summary(layers) -> str:
    stats = [getattr(layer.token_dispatcher, "last_stats", None) for layer in layers]
    stats = [s for s in stats if s is not None]
    if not stats:
        return "plain EP"
    active = sum(s.mode == "llep" for s in stats)
    before = max(s.max_mean_before for s in stats)
    after = max(s.max_mean_after for s in stats)
    spilled = sum(s.spilled_tokens for s in stats)
    copies = sum(s.weight_transfers for s in stats)
    weight_kb = sum(s.weight_bytes for s in stats) / 1024
    plan_ms = sum(s.plan_time_s for s in stats) * 1e3
    return (
        f"LLEP {active}/{len(stats)} layers spilled, max/mean {before:.2f} -> {after:.2f}, "
        f"{spilled} tokens spilled, {copies} weight copies ({weight_kb:.0f} KiB), plan {plan_ms:.2f} ms"
    )


def train(args: argparse.Namespace) -> list[float]:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_llep.scenarios import force_routing, imbalanced_topk

    rank, world, device = init_distributed()
    ep = args.expert_model_parallel_size or world
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    model, optimizer, config = build_model(args, ep)
    layers = _moe_layers(model)
    tokens_per_step = args.micro_batch_size * args.seq_length * world
    if rank == 0:
        mode = "LLEP" if args.llep else "plain EP"
        print(f"[finetune] recipe={args.recipe} world={world} EP={ep} {mode} on {device.type}; "
              f"{len(layers)} MoE layers x {config.num_moe_experts} experts, top-{config.moe_router_topk}", flush=True)
        if args.force_routing:
            print(f"[finetune] forcing routing: {args.force_routing[0]:.0%} of tokens into {args.force_routing[1]} hot expert(s)", flush=True)

    losses = []
    for step in range(1, args.train_iters + 1):
        gen = torch.Generator().manual_seed(args.seed + 7919 * step + rank)
        tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=gen)
        inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        position_ids = torch.arange(args.seq_length, device=device).unsqueeze(0).expand_as(inputs)
        if args.force_routing:
            fraction, hot = args.force_routing
            for i, layer in enumerate(layers):
                ids = imbalanced_topk(inputs.numel(), config.num_moe_experts, config.moe_router_topk, fraction, hot,
                                      seed=args.seed + 1000 * step + 10 * rank + i)
                force_routing(layer.router, ids)
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(inputs, position_ids, None, labels=labels).float().mean()
        loss.backward()
        model.finish_grad_sync()
        optimizer.step()
        loss_value = loss.detach().clone()
        dist.all_reduce(loss_value)
        elapsed = time.perf_counter() - start
        losses.append(float(loss_value) / world)
        if rank == 0:
            print(f"[finetune] step {step}/{args.train_iters} | loss {losses[-1]:.4f} | "
                  f"{tokens_per_step / elapsed:,.0f} tokens/s ({tokens_per_step / elapsed / world:,.0f}/rank) | "
                  f"step {elapsed:.3f} s | {_llep_summary(layers)}", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return losses


def main(argv: Optional[Sequence[str]] = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
