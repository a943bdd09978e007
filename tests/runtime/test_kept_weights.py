"""Borrowed experts kept for the optimizer step, in every kind of training loop: a tiny GPTModel
trained with several micro-batches per step (routing different in each, so one hot expert is borrowed
by different helpers within a step). Against plain EP from equal weights, the gradients themselves are
compared just before each optimizer step (``main_grad`` under Megatron DDP, ``.grad`` otherwise), with
and without activation recompute, in Megatron's schedules (DDP with and without the distributed
optimizer and overlapped grad reduce, pipeline parallelism) and in loops without Megatron DDP (any
backward order, one backward of summed losses, ``accumulating_gradients()``, torch's DDP). Planning
runs once per forward, recompute included. Negative controls: copies kept past the optimizer step,
one returned gradient scaled by 1.001, a recompute that plans again, a return lost behind the
backward, buckets reduced before the helpers' gradients arrived."""

import pytest

import megatron_llep
from megatron_llep.config import LLEPConfig, LLEPConfigError
from megatron_llep.testing.distributed import run_distributed
from step_worker import StepCase, evaluation_keeps_copies, mixed_expert_buckets, train_both

PLAIN = dict(microbatches=3)  # loops without Megatron DDP
TWO_RANKS = [
    StepCase("sync-grad-reduce", ep=2, overlap_grad_reduce=False),
    StepCase("sync-grad-reduce-no-no-sync", ep=2, overlap_grad_reduce=False, no_sync=False),
    StepCase("overlap-grad-reduce", ep=2),
    StepCase("plain-optimizer", ep=2, distributed_optimizer=False),
    StepCase("nothing-kept", ep=2, max_kept_weight_bytes=0),
    StepCase("auto-bound", ep=2, max_kept_weight_bytes="auto"),
    StepCase("overlap-grad-reduce-full-recompute", ep=2, recompute="full"),
    StepCase("sync-grad-reduce-moe-recompute", ep=2, overlap_grad_reduce=False, recompute="moe"),
    StepCase("no-no-sync-full-recompute", ep=2, overlap_grad_reduce=False, no_sync=False, recompute="full"),
    StepCase("each", ep=2, loop="each", **PLAIN),
    StepCase("each-full-recompute", ep=2, loop="each", recompute="full", **PLAIN),
    StepCase("reverse-moe-recompute", ep=2, loop="reverse", recompute="moe", **PLAIN),
    StepCase("reverse-full-recompute", ep=2, loop="reverse", recompute="full", **PLAIN),
    StepCase("sum-full-recompute", ep=2, loop="sum", recompute="full", **PLAIN),
    StepCase("accumulate-moe-recompute", ep=2, loop="accumulate", recompute="moe", **PLAIN),
    StepCase("accumulate-last-outside-full-recompute", ep=2, loop="accumulate-last-outside", recompute="full", **PLAIN),
    StepCase("torch-ddp-full-recompute", ep=2, loop="torch-ddp", recompute="full", **PLAIN),
    StepCase("dropped-forward-finished", ep=2, loop="dropped-forward", finish=True, steps=1, **PLAIN),
    # a forward whose backward never runs: the optimizer step refuses, before any weight changes
    StepCase("dropped-forward", ep=2, loop="dropped-forward", steps=1, broken="unfinished", **PLAIN),
    # negative controls
    StepCase("stale-copies", ep=2, broken="stale"),
    StepCase("lost-behind-backward", ep=2, overlap_grad_reduce=False, broken="lost-behind"),
    StepCase("scaled-return", ep=2, broken="scaled-return"),
    StepCase("full-recompute-replans", ep=2, recompute="full", broken="replan"),
    StepCase("reverse-stale-copies", ep=2, loop="reverse", broken="stale", **PLAIN),
    StepCase("reverse-scaled-return", ep=2, loop="reverse", broken="scaled-return", **PLAIN),
    StepCase("reverse-moe-recompute-replans", ep=2, loop="reverse", recompute="moe", broken="replan", **PLAIN),
]
# 2 nodes of 2 ranks: copies for the other node cross once and are relayed inside it; 4 nodes of one
# rank without overlapped grad reduce: the hierarchical return runs behind the layers below; with a bound
# of one kept expert per rank (3072 bytes each) most copies serve one micro-batch; pipeline
# parallelism with Megatron-LM's align_grad_reduce (stages start their reduce after the last backward),
# with the 1F1B schedule (also under full recompute) and the interleaved one (2 model chunks per rank);
# 2 data-parallel replicas of EP = 2 with overlapped grad reduce, one of them routing evenly: the native
# experts' buckets of the other wait for returns behind the backward, and both replicas' reduces still
# come in the same order
FOUR_RANKS = [
    StepCase("two-nodes-relay", ep=4, ranks_per_node=2),
    StepCase("four-nodes-behind-backward", ep=4, ranks_per_node=1, overlap_grad_reduce=False),
    StepCase("two-nodes-bounded", ep=4, ranks_per_node=2, max_kept_weight_bytes=4000),
    StepCase("pp2-ep2-grad-sync-func", ep=2, pp=2, grad_sync_func=True),
    StepCase("pp2-ep2-full-recompute", ep=2, pp=2, recompute="full"),
    StepCase("pp2-interleaved-ep2", ep=2, pp=2, vpp=2, grad_sync_func=True),
    StepCase("ep2-dp2-one-replica-balanced", ep=2, balanced_replica=True),
    StepCase("ep2-dp2-undeferred", ep=2, broken="undeferred"),
]


def _check(result: dict, world: int) -> None:
    case = result["case"]
    name = case["name"]
    assert result["llep_losses"] == pytest.approx(result["plain_losses"], rel=1e-6, abs=1e-6), name
    assert result["grad_rel_diff"] < 1e-5, f"{name}: gradients differ by {result['grad_rel_diff']:.3g}"
    # the gradients are the measure; parameters after Adam are checked where the optimizer clips (Megatron's):
    # torch's Adam turns rounding in near-zero gradient entries into parameter moves of about 1e-5
    if case["loop"] == "megatron":
        assert result["param_rel_diff"] < 1e-5, f"{name}: parameters differ by {result['param_rel_diff']:.3g}"
    assert result["extra_plans"] == 0, f"{name}: {result['extra_plans']} plans beyond one per forward"
    assert not result["errors"], (name, result["errors"])
    if case["max_kept_weight_bytes"] != 0 and case["loop"] == "megatron":
        # each MoE layer of each rank returns its kept gradients once per step (2 per model chunk and stage),
        # except on the replica that routes evenly (half the ranks), which keeps nothing
        keeping = world // 2 if case["balanced_replica"] else world
        assert result["returns"] == keeping * case["steps"] * 2 * case["vpp"], (name, result["returns"])


def _by_name(per_rank: list) -> dict:
    return {r["case"]["name"]: r for r in per_rank[0]}


def _worst(per_rank: list, name: str, key: str) -> float:
    return max(r[key] for rank_results in per_rank for r in rank_results if r["case"]["name"] == name)


def test_kept_copies_train_like_plain_ep_on_two_ranks():
    per_rank = run_distributed(train_both, 2, TWO_RANKS, timeout_s=900)
    for rank_results in per_rank:
        for result in rank_results:
            if result["case"]["broken"] == "":
                _check(result, 2)
    results = _by_name(per_rank)
    # kept copies serve the later micro-batches of the step: fewer copies than one per micro-batch
    kept = results["overlap-grad-reduce"]
    assert 0 < kept["copies"] < results["nothing-kept"]["copies"] and kept["held"] > 0
    # with and without overlapped grad reduce the second layer's return ends behind the first layer's
    # backward, under activation recompute too; without no_sync (Megatron-LM's way without
    # --overlap-grad-reduce) the step's last backward is not known: the copies serve every micro-batch
    # and return at finish_grad_sync
    for name in ("sync-grad-reduce", "overlap-grad-reduce", "overlap-grad-reduce-full-recompute",
                 "sync-grad-reduce-moe-recompute"):
        assert results[name]["behind"] > 0, name
    unknown_last = results["sync-grad-reduce-no-no-sync"]
    assert unknown_last["behind"] == 0 and unknown_last["copies"] == results["sync-grad-reduce"]["copies"]
    assert results["nothing-kept"]["held"] == 0
    # the default bound ("auto", on a CPU): at most one kept copy per LLEP layer and rank, where the unbounded
    # run keeps more; copies are still kept (and returned once per layer and step: _check)
    auto = results["auto-bound"]
    assert 0 < auto["most_kept_bytes"] <= auto["llep_layers"] * auto["kept_copy_bytes"]
    assert results["overlap-grad-reduce"]["most_kept_bytes"] > auto["llep_layers"] * auto["kept_copy_bytes"]
    # without Megatron DDP copies are kept across micro-batches whose backwards are still to come
    for name in ("reverse-moe-recompute", "sum-full-recompute", "accumulate-moe-recompute"):
        assert results[name]["held"] > 0, name
    # negative controls, each seen in the gradients before the optimizer step
    for name in ("stale-copies", "lost-behind-backward", "reverse-stale-copies"):
        assert _worst(per_rank, name, "grad_rel_diff") > 1e-3, f"{name} went unnoticed"
    for name in ("scaled-return", "reverse-scaled-return"):  # 1.001 on one returned gradient
        assert _worst(per_rank, name, "grad_rel_diff") > 2e-5, f"{name} went unnoticed"
    for name in ("full-recompute-replans", "reverse-moe-recompute-replans"):
        assert results[name]["extra_plans"] > 0, f"{name} went unnoticed"
    # gradients left incomplete by a forward that never ran its backward are refused in one line that
    # names what to call (a function megatron_llep exports), and finish_borrowed_gradients completes them
    dropped = results["dropped-forward"]
    assert _worst(per_rank, "dropped-forward", "grad_rel_diff") > 1e-3
    assert len(dropped["errors"]) == 1 and "\n" not in dropped["errors"][0], dropped["errors"]
    assert "call megatron_llep.finish_borrowed_gradients(model) on every rank" in dropped["errors"][0]
    assert callable(megatron_llep.finish_borrowed_gradients)


def test_kept_copies_relayed_bounded_and_pipelined_on_four_ranks():
    per_rank = run_distributed(train_both, 4, FOUR_RANKS, timeout_s=900)
    for rank_results in per_rank:  # the last pipeline stage's ranks hold the losses
        for result in rank_results:
            if result["case"]["broken"] == "":
                _check(result, 4)
    results = _by_name(per_rank)
    assert results["two-nodes-relay"]["relayed"] > 0  # a copy came from a keeper in the helper's node
    assert results["four-nodes-behind-backward"]["behind"] > 0
    assert results["pp2-ep2-full-recompute"]["behind"] > 0
    assert results["ep2-dp2-one-replica-balanced"]["behind"] > 0
    assert _worst(per_rank, "ep2-dp2-undeferred", "grad_rel_diff") > 1e-3, \
        "buckets reduced before the helpers' gradients arrived went unnoticed"


def test_overlapped_grad_reduce_refuses_llep_experts_bucketed_with_others():
    for result in run_distributed(mixed_expert_buckets, 2, timeout_s=300):
        assert result[False] is None
        assert result[True] is not None and result[True].startswith("LLEP with overlapped grad reduce: ")
        assert result[True].endswith(" shares a gradient bucket with LLEP experts but is not in an LLEP layer; make "
                                     "every MoE layer an LLEP layer (megatron_llep.with_llep) or turn "
                                     "overlap_grad_reduce off"), result[True]


@pytest.mark.parametrize("value", [-1, 2.5, True, "1GB"])
def test_config_refuses_a_kept_bound_outside_its_domain(value):
    with pytest.raises(LLEPConfigError) as err:
        LLEPConfig(max_kept_weight_bytes=value)
    assert err.value.knob == "max_kept_weight_bytes"
    assert "must be an integer >= 0 (0: keep none), 'auto'" in err.value.for_flag("--llep-max-kept-weight-bytes")
    with pytest.raises(LLEPConfigError, match="relay_within_node must be True or False"):
        LLEPConfig(relay_within_node=1)


def test_evaluation_keeps_copies_until_the_weights_change():
    results = run_distributed(evaluation_keeps_copies, 2, timeout_s=300)
    for r in results:
        assert max(r["first"], r["second"], r["after_load"]) < 1e-5, r
    copies = [r["copies"] for r in results]
    assert sum(c[0] for c in copies) > 0 and sum(c[1] for c in copies) == 0, copies  # the second forward copies nothing
    assert max(r["after_load_stale"] for r in results) > 1e-2, results  # control: old copies after the load


def test_auto_bound_on_a_gpu_is_a_quarter_of_the_spare_memory(monkeypatch):
    """The GPU half of the "auto" rule (the memory readings faked: no GPU here): a quarter of the
    driver's free memory plus the allocator's unused cache."""
    import torch

    from megatron_llep.runtime.kept_weights import spare_bytes

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1000, 8000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 300)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 100)
    assert spare_bytes(torch.device("cuda", 0)) == (1000 + 300 - 100) // 4
