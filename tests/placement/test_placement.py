"""CAP algorithms against independent references: metrics vs loops over pairs and tokens, the
greedy's capacity and permutation, cluster recovery, the spectrum, selection, pruning vs a
per-token loop, the EPLB baseline, traces and placement files."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_llep.placement.cap import (
    comm_optimal_placement,
    plan_cap,
    plan_trace,
    select_by_lambda,
    select_by_profiling,
    slots_from_devices,
    tradeoff_spectrum,
)
from megatron_llep.placement.metrics import Topology, coactivation, comm_cost, devices_per_token, load_imbalance
from megatron_llep.placement.placement import ExpertPlacement, check_permutation, check_routing_groups
from megatron_llep.runtime.pruning import prune_devices
from megatron_llep.integrations.routing_traces import _Reservoir
from megatron_llep.placement.replication import eplb_placement, route_with_replicas
from megatron_llep.placement.trace import RoutingTrace, clustered_topk, merge_traces, planted_clusters, synthetic_trace

pytestmark = pytest.mark.release_independent  # .ci/run tests it on one Megatron-Core release

SETTINGS = settings(max_examples=25, deadline=None)


def _random_ids(draw_seed: int, tokens: int, experts: int, topk: int) -> np.ndarray:
    rng = np.random.default_rng(draw_seed)
    return np.argsort(rng.random((tokens, experts)), axis=1)[:, :topk]


def _distance(a: int, b: int, gpus_per_node: int, c: float) -> float:
    if a == b:
        return 0.0
    return 1.0 if a // gpus_per_node == b // gpus_per_node else c


small_case = st.tuples(st.integers(0, 10**6), st.integers(1, 30), st.sampled_from([(4, 2), (6, 3), (8, 2), (8, 4)]),
                       st.integers(1, 3))


@SETTINGS
@given(small_case)
def test_metrics_match_loops_over_pairs_and_tokens(case):
    seed, tokens, (experts, ep), topk = case
    topk = min(topk, experts)
    ids = _random_ids(seed, tokens, experts, topk)
    ids[0, -1] = -1 if topk > 1 else ids[0, -1]  # a dropped assignment
    rng = np.random.default_rng(seed + 1)
    device = rng.permutation(np.arange(experts) // (experts // ep))
    gpus_per_node = 2 if ep % 2 == 0 else ep
    topo = Topology(ep, gpus_per_node, 4.0)

    p = coactivation(ids, experts)
    chosen = [set(r[r >= 0].tolist()) for r in ids]
    for i, j in itertools.product(range(experts), repeat=2):
        both = sum(1 for s in chosen if i in s and j in s)
        either = sum(1 for s in chosen if i in s or j in s)
        expected = 0.0 if i == j or either == 0 else both / either
        assert p[i, j] == pytest.approx(expected)

    cost = sum(p[i, j] * _distance(device[i], device[j], gpus_per_node, 4.0)
               for i in range(experts) for j in range(i + 1, experts))
    assert comm_cost(p, device, topo) == pytest.approx(cost)
    assert devices_per_token(ids, device).tolist() == [len({device[e] for e in s}) for s in chosen]
    loads = np.zeros(ep)
    for s in chosen:
        for e in s:
            loads[device[e]] += 1
    expert_loads = np.bincount(ids[ids >= 0], minlength=experts)
    assert load_imbalance(expert_loads, device, ep) == pytest.approx(loads.max() / loads.mean())


layouts = st.sampled_from([(8, 2, None), (8, 4, 2), (12, 3, None), (16, 4, 2), (24, 6, 3), (32, 8, 4)])


@SETTINGS
@given(layouts, st.integers(0, 10**6), st.floats(0.0, 1.0), st.integers(1, 4))
def test_cap_respects_capacity_and_every_spectrum_point_is_a_placement(layout, seed, q, topk):
    experts, ep, gpn = layout
    ids = clustered_topk(200, planted_clusters(experts, ep, seed), min(topk, experts // ep), q, 1.0, seed)
    topo = Topology(ep, gpn)
    result = plan_cap(coactivation(ids, experts), np.bincount(ids.ravel(), minlength=experts), topo)
    for point in result.spectrum:
        assert np.bincount(point.device_of_expert, minlength=ep).tolist() == [experts // ep] * ep
        perm = check_permutation(point.slot_to_expert(ep), experts)
        assert (np.argsort(perm) // (experts // ep) == point.device_of_expert).all()


@pytest.mark.parametrize("experts, ep, gpn, topk", [(32, 4, None, 4), (64, 8, 4, 4), (128, 8, 4, 8), (96, 12, 4, 2)])
def test_greedy_recovers_planted_clusters_and_beats_sequential(experts, ep, gpn, topk):
    for seed in range(3):
        trace, clusters = synthetic_trace(4000, experts, topk, ep, 0.85, 0.5, seed=seed)
        ids = trace.layer(1).expert_ids
        p, topo = coactivation(ids, experts), Topology(ep, gpn)
        device = comm_optimal_placement(p, topo)
        for c in range(ep):
            assert np.unique(device[clusters[1] == c]).size == 1, f"seed {seed}: cluster {c} split"
        sequential = np.arange(experts) // (experts // ep)
        assert comm_cost(p, device, topo) <= comm_cost(p, sequential, topo)
        assert devices_per_token(ids, device).mean() < devices_per_token(ids, sequential).mean()


def test_greedy_never_loses_to_sequential_without_structure():
    for seed in range(5):
        ids = _random_ids(seed, 500, 16, 3)
        p, topo = coactivation(ids, 16), Topology(4, 2)
        assert comm_cost(p, comm_optimal_placement(p, topo), topo) <= comm_cost(p, np.arange(16) // 4, topo) + 1e-9


def test_greedy_is_optimal_on_a_tiny_case_by_enumeration():
    for seed in range(5):
        ids = clustered_topk(300, planted_clusters(6, 3, seed), 2, 0.6, 0.5, seed)
        p, topo = coactivation(ids, 6), Topology(3)
        best = min(comm_cost(p, np.array(perm) // 2, topo) for perm in itertools.permutations(range(6)))
        assert comm_cost(p, comm_optimal_placement(p, topo), topo) == pytest.approx(best)


def test_spectrum_starts_comm_optimal_and_lowers_imbalance():
    trace, _ = synthetic_trace(6000, 64, 4, 8, 0.8, 1.2, seed=4)
    layer = trace.layer(1)
    p, topo = coactivation(layer.expert_ids, 64), Topology(8, 4)
    start = comm_optimal_placement(p, topo)
    points = tradeoff_spectrum(p, layer.expert_counts, topo, start)
    assert (points[0].device_of_expert == start).all() and points[0].step == 0
    assert points[0].comm_cost == pytest.approx(comm_cost(p, start, topo))
    b = np.array([pt.imbalance for pt in points])
    assert len(points) > 3 and (np.diff(b) <= 1e-12).all() and b[-1] < b[0]
    assert points[-1].comm_cost > points[0].comm_cost  # balance is paid for in communication
    assert len(tradeoff_spectrum(p, layer.expert_counts, topo, start, max_steps=2)) <= 3


def test_lambda_selection_matches_the_normalised_objective_and_profiling_picks_the_cheapest():
    trace, _ = synthetic_trace(6000, 64, 4, 8, 0.8, 1.2, seed=5)
    layer = trace.layer(1)
    p, topo = coactivation(layer.expert_ids, 64), Topology(8, 4)
    result = plan_cap(p, layer.expert_counts, topo, lam=0.5)
    points = result.spectrum
    c = np.array([pt.comm_cost for pt in points])
    b = np.array([pt.imbalance for pt in points])
    c_seq = sum(p[i, j] * _distance(i // 8, j // 8, 4, 5.0) for i in range(64) for j in range(i + 1, 64))
    assert result.chosen == int(np.argmin(0.5 * c / c_seq + 0.5 * b))
    for lam in (0.0, 0.3, 1.0):
        assert select_by_lambda(points, lam, c_seq) == int(np.argmin(lam * c / c_seq + (1 - lam) * b))
    assert select_by_lambda(points, 1.0, c_seq) == int(np.argmin(c))
    assert select_by_lambda(points, 0.0, c_seq) == int(np.argmin(b))

    def step_time(point):  # deterministic stand-in for a measured step: compute of the max GPU + traffic
        return 10.0 * point.imbalance + 0.01 * point.comm_cost

    chosen, scores = select_by_profiling(points, step_time)
    assert chosen == int(np.argmin([step_time(pt) for pt in points])) and len(scores) == len(points)
    chosen, scores = select_by_profiling(points, step_time, max_evaluations=3)
    assert set(scores) >= {0, len(points) - 1} and len(scores) == 3 and chosen in scores
    with pytest.raises(ValueError, match="lambda"):
        select_by_lambda(points, 1.5, c_seq)


def _prune_reference(ids, probs, device, cost, p):
    """Per-token loop: visit devices in descending a_d / c_d, stop once the kept mass reaches 1 - p."""
    masks = []
    for row_ids, row_probs in zip(ids.tolist(), probs.tolist()):
        mass = {}
        for e, a in zip(row_ids, row_probs):
            mass[device[e]] = mass.get(device[e], 0.0) + a
        total = sum(mass.values())
        ranked = sorted(mass, key=lambda d: (-(mass[d] / cost[d]) if cost[d] > 0 else -np.inf, -mass[d], d))
        kept, acc = set(), 0.0
        for d in ranked:
            if p > 0 and kept and acc >= (1 - p) * total:
                break
            kept.add(d)
            acc += mass[d]
        masks.append(kept)
    return masks


@SETTINGS
@given(st.integers(0, 10**6), st.sampled_from([0.0, 0.05, 0.2, 0.5, 0.9]))
def test_pruning_keeps_mass_and_matches_a_per_token_loop(seed, p):
    rng = np.random.default_rng(seed)
    ids = _random_ids(seed, 20, 16, 4)
    probs = rng.dirichlet(np.ones(4), 20)
    device = rng.permutation(np.arange(16) // 2)
    cost = rng.choice([0.0, 1.0, 5.0], 8)
    out = prune_devices(torch.as_tensor(ids), torch.as_tensor(probs), torch.as_tensor(device), torch.as_tensor(cost), p)
    reference = _prune_reference(ids, probs, device, cost, p)
    for t in range(20):
        assert set(np.flatnonzero(out.device_mask[t].numpy()).tolist()) == reference[t]
        kept = probs[t][out.expert_mask[t].numpy()].sum()
        assert kept >= (1 - p) * probs[t].sum() - 1e-12
        assert out.probs[t].sum().item() == pytest.approx(probs[t].sum())
    if p == 0.0:
        assert out.expert_mask.all() and torch.equal(out.probs, torch.as_tensor(probs))


def test_pruning_with_p_zero_keeps_zero_score_experts_and_checks_input():
    ids = torch.tensor([[0, 3]])
    probs = torch.tensor([[1.0, 0.0]])
    out = prune_devices(ids, probs, torch.tensor([0, 0, 1, 1]), torch.tensor([0.0, 1.0]), 0.0)
    assert out.device_mask.tolist() == [[True, True]] and out.expert_mask.all()
    assert prune_devices(ids, probs, torch.tensor([0, 0, 1, 1]), torch.tensor([0.0, 1.0]), 0.5).device_mask.tolist() == [[True, False]]
    with pytest.raises(ValueError, match="within"):
        prune_devices(ids, probs, torch.tensor([0, 0, 1, 1]), torch.tensor([0.0, 1.0]), 1.0)


def test_eplb_replicates_hot_experts_and_balances_load():
    ids = clustered_topk(4000, planted_clusters(32, 4, 0), 4, 0.0, 1.5, 0)
    loads = np.bincount(ids.ravel(), minlength=32)
    eplb = eplb_placement(loads, 4, redundant_per_device=2)
    hosts = np.concatenate(eplb.replicas)
    assert np.bincount(hosts, minlength=4).tolist() == [10] * 4  # every slot used once
    assert all(np.unique(h).size == h.size for h in eplb.replicas)  # no device holds a copy twice
    assert eplb.replicas[int(np.argmax(loads))].size > 1
    served, device_load = route_with_replicas(ids, eplb)
    assert all(served[t, k] in eplb.replicas[ids[t, k]] for t in range(50) for k in range(4))
    assert (np.bincount(served.ravel(), minlength=4) == device_load).all() and device_load.sum() == ids.size
    for t in range(50):  # a replicated pick reuses a device the token already visits whenever it can
        for k in range(4):
            hosts = eplb.replicas[ids[t, k]]
            visited = {served[t, j] for j in range(4) if j < k or eplb.replicas[ids[t, j]].size == 1}
            if hosts.size > 1 and visited & set(hosts.tolist()):
                assert served[t, k] in visited
    sequential = np.arange(32) // 8
    assert device_load.max() / device_load.mean() < load_imbalance(loads, sequential, 4)
    no_copies = eplb_placement(loads, 4, redundant_per_device=0)
    device = np.array([h[0] for h in no_copies.replicas])
    served, _ = route_with_replicas(ids, no_copies)
    assert (served == device[ids]).all()


@pytest.mark.parametrize("experts, ep, groups", [(16, 4, 8), (16, 4, 4), (16, 8, 2), (32, 8, 4)])
def test_routing_groups_constrain_every_point(experts, ep, groups):
    trace, _ = synthetic_trace(2000, experts, 2, ep, 0.8, 1.0, seed=1)
    placement, results = plan_trace(trace, Topology(ep, 2), routing_groups=groups)
    assert placement.routing_groups == groups
    for point in results[1].spectrum:
        check_routing_groups(point.slot_to_expert(ep), groups)


def test_routing_groups_that_tile_no_gpu_are_rejected():
    with pytest.raises(ValueError, match="no group-preserving placement"):
        plan_cap(np.zeros((12, 12)), np.ones(12), Topology(4), routing_groups=3)  # groups of 4, GPUs of 3


def test_placement_validation_inverse_and_file_round_trip(tmp_path):
    with pytest.raises(ValueError, match=r"duplicated \[1\], missing \[2\]"):
        ExpertPlacement(4, 2, {1: [0, 1, 1, 3]})
    with pytest.raises(ValueError, match="3 entries but the layer has 4 experts"):
        ExpertPlacement(4, 2, {1: [0, 1, 2]})
    with pytest.raises(ValueError, match="not divisible by the expert-parallel size 3"):
        ExpertPlacement(4, 3, {1: [0, 1, 2, 3]})
    with pytest.raises(ValueError, match="mix routing groups"):
        ExpertPlacement(4, 2, {1: [0, 2, 1, 3]}, routing_groups=2)
    placement = ExpertPlacement(8, 2, {1: [5, 0, 7, 2, 1, 6, 3, 4], 3: list(range(8))}, metadata={"note": "x"})
    assert placement.device_of_expert(1).tolist() == [0, 1, 0, 1, 1, 0, 1, 0]
    inverse = placement.inverse()
    assert inverse.slot_to_expert(1)[placement.slot_to_expert(1)].tolist() == list(range(8))
    path = str(tmp_path / "p.json")
    placement.save(path)
    loaded = ExpertPlacement.load(path)
    assert loaded.metadata == {"note": "x"} and sorted(loaded.layers) == [1, 3]
    assert all((loaded.slot_to_expert(n) == placement.slot_to_expert(n)).all() for n in (1, 3))
    (tmp_path / "bad.json").write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="not an expert placement"):
        ExpertPlacement.load(str(tmp_path / "bad.json"))
    payload = placement.to_json()
    for layers, message in (({"1": [5.0, 0, 7, 2, 1, 6, 3, 4]}, "layer 1: expert ids must be a list of integers"),
                            ({"1": [5.5, 0, 7, 2, 1, 6, 3, 4]}, "layer 1: expert ids must be a list of integers"),
                            ({"1": [True, 0, 7, 2, 5, 6, 3, 4]}, "layer 1: expert ids must be a list of integers"),
                            ({"1.5": list(range(8))}, "layer '1.5' is not a layer number"),
                            ({"x": list(range(8))}, "layer 'x' is not a layer number"),
                            ([list(range(8))], "'layers' must map MoE layer numbers")):
        with pytest.raises(ValueError, match=message):
            ExpertPlacement.from_json(dict(payload, layers=layers), "p.json")
    with pytest.raises(KeyError, match="no MoE layer 2"):
        placement.slot_to_expert(2)
    with pytest.raises(ValueError, match="every GPU must hold exactly 2"):
        slots_from_devices(np.array([0, 0, 0, 1]), 2)


def test_trace_file_round_trip_merge_and_bad_files(tmp_path):
    trace, _ = synthetic_trace(100, 16, 2, 4, 0.9, layers=(2, 5), seed=3)
    path = str(tmp_path / "t.npz")
    trace.save(path)
    loaded = RoutingTrace.load(path)
    assert sorted(loaded.layers) == [2, 5] and loaded.num_experts == 16 and loaded.topk == 2
    assert (loaded.layer(5).expert_ids == trace.layer(5).expert_ids).all()
    merged = merge_traces([loaded, loaded])
    assert merged.layer(2).tokens_seen == 200 and (merged.layer(2).expert_counts == 2 * trace.layer(2).expert_counts).all()
    other, _ = synthetic_trace(100, 32, 2, 4, 0.9, seed=3)
    with pytest.raises(ValueError, match="different shapes: 16 experts top-2 vs 32 experts top-2"):
        merge_traces([trace, other])
    (tmp_path / "junk.npz").write_text("not a zip")
    with pytest.raises(ValueError, match="not a routing trace file"):
        RoutingTrace.load(str(tmp_path / "junk.npz"))
    np.savez(str(tmp_path / "plain.npz"), x=np.zeros(3))
    with pytest.raises(ValueError, match="no 'metadata'"):
        RoutingTrace.load(str(tmp_path / "plain.npz"))
    with pytest.raises(ValueError, match="outside -1..15"):
        RoutingTrace.from_expert_ids(16, {1: np.array([[0, 16]])})
    fit, held_out = trace.split(0.25)
    assert fit.layer(2).num_sampled == 25 and held_out.layer(2).num_sampled == 75


def test_synthetic_generator_plants_clusters_and_skew():
    clusters = planted_clusters(32, 4, 0)
    assert np.bincount(clusters).tolist() == [8] * 4
    ids = clustered_topk(2000, clusters, 4, 1.0, 0.0, 0)
    assert all(np.unique(r).size == 4 for r in ids)
    assert (np.ptp(clusters[ids], axis=1) == 0).all()  # q = 1: all picks inside one cluster
    skewed = np.bincount(clustered_topk(2000, clusters, 4, 0.5, 1.5, 0).ravel(), minlength=32)
    assert skewed.max() / skewed.mean() > 2.0
    p = coactivation(clustered_topk(4000, clusters, 4, 0.0, 0.0, 1), 32)
    same = clusters[:, None] == clusters[None, :]
    np.fill_diagonal(same, False)
    assert p[same].mean() == pytest.approx(p[~same & ~np.eye(32, dtype=bool)].mean(), rel=0.15)


def test_reservoir_is_bounded_exact_and_uniform():
    stream = np.arange(100, dtype=np.int16).reshape(100, 1)
    keep_all = _Reservoir(1, 100, None, np.random.default_rng(0))
    for start in range(0, 100, 7):
        keep_all.add(stream[start:start + 7])
    assert (keep_all.rows == stream).all() and keep_all.seen == 100
    inclusion = np.zeros(100)
    for trial in range(2000):
        reservoir = _Reservoir(1, 100, 10, np.random.default_rng(trial))
        for start in range(0, 100, 7):
            reservoir.add(stream[start:start + 7])
        assert reservoir.rows.shape == (10, 1) and np.unique(reservoir.rows).size == 10
        inclusion[reservoir.rows.ravel()] += 1
    assert (reservoir.counts == 1).all()
    assert np.abs(inclusion / 2000 - 0.1).max() < 0.035  # every position kept with probability cap / n
