"""The LLEP command-line flags: one set, defined here, for every entry point of recipes/ and for
Megatron-LM's plugin (:mod:`megatron_llep.integrations.megatron_lm`).

``--llep`` / ``--no-llep`` puts LLEPMoELayer in (the recipes default to it, Megatron-LM's plugin
does not); every other flag is ``--llep-<field>`` of :class:`~megatron_llep.config.LLEPConfig`, and
``--llep-placement`` a CAP placement file. The defaults that depend on the machine are decided here
once: ``m`` is 1024 tokens on a GPU and 16 on a CPU, and the cost model one H200 node's on a GPU and
this CPU's otherwise (``--llep-cost-model auto``).
"""

from __future__ import annotations

import argparse
from typing import Optional, Union

import torch

from megatron_llep.config import KEEP_AUTO, LLEPConfig, LLEPConfigError, RoutingPruning
from megatron_llep.planning.cost_model import CostModel

MIN_CHUNK_TOKENS = {True: 1024, False: 16}  # on a GPU, on a CPU
COST_MODELS = ("auto", "h200", "cpu")
GROUP_TITLE = "LLEP (megatron-llep)"
PLACEMENT_FLAG = "--llep-placement"


def flag(field: str) -> str:
    """The flag of an LLEPConfig field (``max_tokens_per_rank`` -> ``--llep-max-tokens-per-rank``)."""
    return "--llep-" + field.replace("_", "-")


def kept_weight_bytes(text: str) -> Union[int, str, None]:
    """``--llep-max-kept-weight-bytes``: a number of bytes, ``auto`` or ``none``."""
    if text == KEEP_AUTO:
        return KEEP_AUTO
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes, {KEEP_AUTO!r} or 'none', got {text!r}") from None


def add_llep_flags(parser: argparse.ArgumentParser, llep_default: bool) -> argparse.ArgumentParser:
    """Add the LLEP flags to ``parser`` (``llep_default``: whether LLEP is on without ``--llep``)."""
    defaults = LLEPConfig()
    group = parser.add_argument_group(GROUP_TITLE)
    group.add_argument("--llep", action=argparse.BooleanOptionalAction, default=llep_default,
                       help="every MoE layer an LLEPMoELayer (least-loaded expert parallelism); --no-llep: plain EP "
                            f"(default: {'on' if llep_default else 'off'})")
    group.add_argument(flag("alpha"), type=float, default=defaults.alpha,
                       help="rank capacity as a multiple of the mean rank load")
    group.add_argument(flag("min_chunk_tokens"), type=int, default=None, metavar="M",
                       help=f"smallest spill worth a GEMM (default {MIN_CHUNK_TOKENS[True]} on a GPU, "
                            f"{MIN_CHUNK_TOKENS[False]} on a CPU)")
    group.add_argument(flag("imbalance_threshold"), type=float, default=defaults.imbalance_threshold,
                       metavar="LAMBDA", help="plain EP while max/mean rank load is below it")
    group.add_argument(flag("ranks_per_node"), type=int, default=defaults.ranks_per_node,
                       help="EP ranks per node: helpers inside the node first, copies relayed across nodes "
                            "(default: all on one node)")
    group.add_argument(flag("cost_aware"), action=argparse.BooleanOptionalAction, default=defaults.cost_aware,
                       help="pick the plan with the lowest predicted layer time")
    group.add_argument(flag("cost_model"), choices=COST_MODELS, default="auto",
                       help="timing model of --llep-cost-aware (auto: one H200 node on a GPU, this CPU otherwise)")
    group.add_argument(flag("enabled"), action=argparse.BooleanOptionalAction, default=defaults.enabled,
                       help="--no-llep-enabled keeps LLEPMoELayer but runs plain EP (A/B runs)")
    group.add_argument(flag("record_stats"), action=argparse.BooleanOptionalAction, default=defaults.record_stats,
                       help="keep per-layer LLEP statistics for the logs and dashboards")
    group.add_argument(flag("max_tokens_per_rank"), type=int, default=defaults.max_tokens_per_rank, metavar="ROWS",
                       help="hard budget of token-expert rows each EP rank computes per MoE layer and micro-batch: "
                            "LLEP spills (even below lambda, in chunks under m) to keep every rank within it, and a "
                            "micro-batch routing more than EP x ROWS rows stops with an error naming the layer "
                            "(default: no budget)")
    group.add_argument(flag("max_kept_weight_bytes"), type=kept_weight_bytes, default=defaults.max_kept_weight_bytes,
                       metavar="BYTES",
                       help="bytes of borrowed experts (weights + fp32 gradient accumulator) each rank keeps for the "
                            "rest of the optimizer step, over all MoE layers: auto (default) keeps one copy per rank "
                            "and layer, on a GPU within a quarter of the memory it can spare; 0 keeps none; none "
                            "sets no bound")
    group.add_argument(flag("relay_within_node"), action=argparse.BooleanOptionalAction,
                       default=defaults.relay_within_node,
                       help="a borrowed expert's copy crosses to another node once and is forwarded inside it")
    group.add_argument(flag("node_aware_tokens"), action=argparse.BooleanOptionalAction,
                       default=defaults.node_aware_tokens,
                       help="across nodes, a spilled expert's tokens are matched to their computing ranks inside "
                            "each node first, and what crosses is spread over the node's ranks")
    group.add_argument(flag("repack_copies"), action=argparse.BooleanOptionalAction,
                       default=defaults.repack_copies,
                       help="refill each rank's spills largest expert into largest quota where that needs fewer "
                            "weight copies (loads unchanged)")
    group.add_argument(PLACEMENT_FLAG, default=None, metavar="PATH",
                       help="CAP expert placement (python -m megatron_llep.placement plan ...), applied before the "
                            "optimizer is built; checkpoints hold the experts in this placement's order")
    return parser


def llep_config_from_flags(args: argparse.Namespace, on_gpu: Optional[bool] = None,
                           pruning: Optional[RoutingPruning] = None) -> LLEPConfig:
    """The LLEPConfig the flags describe (``on_gpu``: default, whether CUDA is available; ``pruning``:
    the inference entry points' routing pruning). ``ValueError`` naming the flag when one is out of
    range."""
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    cost_model = {"auto": "h200" if on_gpu else "cpu"}.get(args.llep_cost_model, args.llep_cost_model)
    min_chunk = args.llep_min_chunk_tokens
    try:
        return LLEPConfig(
            alpha=args.llep_alpha,
            min_chunk_tokens=min_chunk if min_chunk is not None else MIN_CHUNK_TOKENS[on_gpu],
            imbalance_threshold=args.llep_imbalance_threshold,
            ranks_per_node=args.llep_ranks_per_node,
            cost_aware=args.llep_cost_aware,
            cost_model=CostModel() if cost_model == "h200" else CostModel.cpu(),
            enabled=args.llep_enabled,
            record_stats=args.llep_record_stats,
            pruning=pruning,
            max_tokens_per_rank=args.llep_max_tokens_per_rank,
            max_kept_weight_bytes=args.llep_max_kept_weight_bytes,
            relay_within_node=args.llep_relay_within_node,
            node_aware_tokens=args.llep_node_aware_tokens,
            repack_copies=args.llep_repack_copies,
        )
    except LLEPConfigError as err:  # every knob has its flag
        raise ValueError(err.for_flag(flag(err.knob))) from None


def tuning_flags_given(parser: argparse.ArgumentParser, args: argparse.Namespace, prefix: str = "--llep-") -> list[str]:
    """The flags of ``parser`` named ``prefix...`` (or ``--no-`` + that) whose parsed value in ``args``
    is not their default, as the command line spells them: the knobs a run without LLEP would
    silently ignore (``--llep-placement`` is none: a placement applies with or without LLEP)."""
    given = []
    for action in parser._actions:
        names = [name for name in action.option_strings if name.startswith((prefix, "--no-" + prefix[2:]))
                 and name != PLACEMENT_FLAG]
        value = getattr(args, action.dest, action.default)
        if names and value != action.default:
            negated = [name for name in action.option_strings if name.startswith("--no-")]
            given.append(negated[0] if value is False and negated else action.option_strings[0])
    return given


def ignored_tuning_note(flags: list[str], off: str) -> Optional[str]:
    """The note for LLEP knobs given to a run without LLEP (``off``: how the command line turned it off),
    None without any: an A/B run may keep them, but not without saying they do nothing."""
    if not flags:
        return None
    one = len(flags) == 1
    return (f"{', '.join(flags)} tune{'s' if one else ''} LLEP, which {off}: {'it does' if one else 'they do'} "
            "nothing in this plain-EP run")
