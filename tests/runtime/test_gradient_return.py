"""The once-per-step return of kept copies' gradients: the phases
(:func:`megatron_llep.planning.gradient_return.gradient_return_phases`) and the runtime that posts them
(:meth:`megatron_llep.runtime.kept_weights.KeptLedger.flush_layer`), against the plain sum of every
helper's gradient at each native rank, in float64."""

from types import SimpleNamespace

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from megatron_llep.planning import gradient_return_phases
from megatron_llep.testing.distributed import run_distributed


@st.composite
def ledgers(draw):
    per_node = draw(st.sampled_from([1, 2, 4]))
    ep = per_node * draw(st.integers(1, 4))
    local = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    held = rng.random((ep * local, ep)) < draw(st.floats(0.05, 0.9))
    held[np.arange(ep * local), np.arange(ep * local) // local] = False  # a native rank keeps no copy of its own
    return held, local, draw(st.integers(1, 40)), per_node, draw(st.booleans())


def simulate(phases, held: np.ndarray, local: int, numel: int, gradients: dict) -> dict:
    """What every rank holds after the phases, read literally: a transfer adds the source's
    elements, as they were when the phase started, into the target's."""
    state = {(e, p): gradients.get((e, p), np.zeros(numel)).copy() for e in range(held.shape[0]) for p in range(held.shape[1])}
    for phase in phases:
        before = {key: value.copy() for key, value in state.items()}
        for expert, source, target, lo, hi in phase:
            state[(expert, target)][lo:hi] += before[(expert, source)][lo:hi]
    return {e: state[(e, e // local)] for e in range(held.shape[0])}


@settings(max_examples=200, deadline=None)
@given(ledgers())
def test_every_native_rank_ends_with_the_sum_of_its_helpers(case):
    held, local, numel, per_node, relay = case
    rng = np.random.default_rng(0)
    gradients = {(e, p): rng.standard_normal(numel) for e, p in zip(*np.nonzero(held))}
    phases = gradient_return_phases(held, local, numel, per_node, relay)
    ended = simulate(phases, held, local, numel, gradients)
    for e in range(held.shape[0]):
        expected = sum((gradients[(e, p)] for p in np.flatnonzero(held[e])), np.zeros(numel))
        np.testing.assert_allclose(ended[e], expected, rtol=1e-12, atol=1e-12)
    for phase in phases:
        for expert, source, target, lo, hi in phase:
            assert source != target and 0 <= lo < hi <= numel
    node = np.arange(held.shape[1]) // per_node
    # Cross-node elements: a gradient per (expert, helper node) with relays (the reduce-scatter among m
    # helper nodes moves m - 1 of them, then one crosses into the native rank's node), one per copy without.
    crossing = sum(hi - lo for phase in phases for e, s, t, lo, hi in phase if node[s] != node[t])
    native_node = node[np.arange(held.shape[0]) // local]
    if relay:
        assert crossing == numel * len({(e, node[p]) for e, p in zip(*np.nonzero(held)) if node[p] != native_node[e]})
    else:
        assert crossing == numel * int(sum(node[p] != native_node[e] for e, p in zip(*np.nonzero(held))))


def test_with_relays_no_link_carries_a_whole_gradient_per_helper_node():
    """64 ranks in 8 nodes, one hot expert kept on every other rank: the native rank's link takes
    one gradient in all (eight stripes, one per rank of its node), not one per node."""
    ep, per_node, numel = 64, 8, 8000
    held = np.zeros((ep, ep), bool)
    held[0, 1:] = True
    for relay, most in ((True, numel * 15 // 8), (False, numel * (ep - 1))):
        into = np.zeros(ep)
        for phase in gradient_return_phases(held, 1, numel, per_node, relay):
            for _, _, target, lo, hi in phase:
                into[target] += hi - lo
        assert into[0] <= most
        if relay:
            assert into.max() <= 2 * numel  # every rank handles at most about two gradients' elements


def test_the_simulation_notices_a_broken_mapping():
    """Negative control: the same check fails when one transfer goes to the wrong rank."""
    ep, per_node, local, numel = 8, 2, 1, 16
    held = np.zeros((ep, ep), bool)
    held[0, 2:] = True
    rng = np.random.default_rng(1)
    gradients = {(0, p): rng.standard_normal(numel) for p in range(2, ep)}
    phases = gradient_return_phases(held, local, numel, per_node, True)
    expert, source, target, lo, hi = phases[2][0]
    phases[2][0] = (expert, source, (target + 1) % ep, lo, hi)
    ended = simulate(phases, held, local, numel, gradients)
    assert not np.allclose(ended[0], sum(gradients.values()))


# ---------------------------------------------------------------------------- runtime on gloo
SHAPES = [(6, 5), (7,)]  # one expert's tensors
NUMEL = 37


def _gradient(expert: int, keeper: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(int(1000 * expert + keeper)), dtype=torch.float64)


class _Layer:
    """What the ledger needs of an LLEP layer (hashable, like the dispatcher it stands for)."""

    def __init__(self) -> None:
        from megatron_llep.runtime.kept_weights import KeptExperts

        self.kept, self.kept_copy_bytes = KeptExperts(), 1


def _flush_worker(rank: int, world_size: int, cases: dict) -> dict:
    import torch.distributed as dist

    from megatron_llep.runtime import kept_weights
    from megatron_llep.runtime.kept_weights import KeptLedger

    tensors = [torch.zeros(shape) for shape in SHAPES]
    adapter = SimpleNamespace(num_local_experts=1, tensor_specs=lambda: [(t.shape, t.dtype) for t in tensors],
                              expert_tensors=lambda index: tensors)
    planned = kept_weights.gradient_return_phases
    results = {}
    for case, (held, per_node, relay, lost_phase) in cases.items():
        def phases(*args, **kwargs):
            phases = planned(*args, **kwargs)
            if lost_phase is not None:  # negative control: every rank leaves out the same transfer
                del phases[lost_phase][0]
            return phases
        kept_weights.gradient_return_phases = phases
        ledger = KeptLedger(dist.group.WORLD)
        layer = _Layer()
        ledger.held[layer] = held
        for expert in np.flatnonzero(held[:, rank]).tolist():
            layer.kept.weights[expert] = [torch.zeros(shape) for shape in SHAPES]
            layer.kept.flat_gradient(expert).copy_(_gradient(expert, rank))
        returned = ledger.flush_layer(layer, adapter, rank, per_node, relay)
        results[case] = {e: torch.cat([t.reshape(-1) for t in sums]) for e, sums in returned.items()}
        assert not layer.kept.weights and layer not in ledger.held
    return results


def _matches(result: dict, held: np.ndarray, rank: int) -> bool:
    """Whether native rank ``rank`` got the float64 sum of its helpers' gradients (within fp32
    rounding), and nothing else."""
    keepers = np.flatnonzero(held[rank])
    if not keepers.size:
        return not result
    expected = sum((_gradient(rank, k) for k in keepers), torch.zeros(NUMEL, dtype=torch.float64))
    return set(result) == {0} and torch.allclose(result[0].double(), expected, rtol=1e-6, atol=1e-6)


def test_flush_layer_returns_every_helpers_sum_in_each_layout():
    """Four gloo ranks (expert e native on rank e); 1, 2 and 4 nodes, with and without relays:
    every phase of the hierarchical sum is posted in one of them. Each native rank receives the
    sum of its helpers' gradients. Negative controls: the same run with one part of the
    reduce-scatter, or one part crossing into the native node, left out."""
    held = np.zeros((4, 4), bool)
    held[0, 1:] = True
    held[1, [0, 2, 3]] = True
    held[2, [1, 3]] = True
    held[3, [0]] = True
    cases = {"one node": (held, None, True, None), "no relays": (held, 2, False, None),
             "two nodes": (held, 2, True, None), "four nodes": (held, 1, True, None),
             "lost reduce-scatter part": (held, 1, True, 1), "lost crossing part": (held, 1, True, 2)}
    results = run_distributed(_flush_worker, 4, cases, timeout_s=300)
    for case, (held, _, _, lost_phase) in cases.items():
        matched = [_matches(result[case], held, rank) for rank, result in enumerate(results)]
        assert all(matched) if lost_phase is None else not all(matched), case
