"""CAP step 4, choosing the spectrum point by profiling: the pure mapping of a profile position to
every layer's step (spectra of different lengths), the report, and ``profile_spectrum`` on a real
two-layer Megatron MoE model at EP = 2 over gloo with a fake clock (the choice must follow the
rank-agreed median times, identically on both ranks, and the model must end bit-identical)."""

from unittest import mock

import numpy as np
import pytest

from megatron_llep.placement.cap import CAPResult, SpectrumPoint
from megatron_llep.placement.profile import ProfileReport, placement_at, profile_positions, spectrum_step
from megatron_llep.placement.trace import LayerTrace, RoutingTrace
from megatron_llep.testing.distributed import run_distributed

NUM_EXPERTS, EP = 8, 2


def _results(lengths: dict[int, int], seed: int = 0) -> dict[int, CAPResult]:
    """Hand-made spectra of the given lengths; every point a distinct balanced expert -> GPU map."""
    rng = np.random.default_rng(seed)
    results = {}
    for number, length in lengths.items():
        points, seen = [], set()
        while len(points) < length:
            device = rng.permutation(NUM_EXPERTS) // (NUM_EXPERTS // EP)
            if tuple(device) in seen:
                continue
            seen.add(tuple(device))
            points.append(SpectrumPoint(len(points), device, 10.0 - len(points), 2.0 - 0.1 * len(points)))
        results[number] = CAPResult(points, 0, "lambda=1")
    return results


def test_placement_at_maps_one_position_onto_spectra_of_different_lengths():
    results = _results({1: 1, 2: 3, 3: 5, 4: 8})
    expected = {0.0: [0, 0, 0, 0], 0.25: [0, 1, 1, 2], 0.5: [0, 1, 2, 4], 0.75: [0, 2, 3, 5], 1.0: [0, 2, 4, 7]}
    for position, steps in expected.items():
        placement = placement_at(results, position, EP)
        assert placement.num_experts == NUM_EXPERTS and placement.ep_size == EP
        for number, step in zip((1, 2, 3, 4), steps):
            point = results[number].spectrum[step]
            assert np.array_equal(placement.slot_to_expert(number), point.slot_to_expert(EP))
            assert np.array_equal(placement.device_of_expert(number), point.device_of_expert)
            assert placement.metadata["layers"][str(number)]["spectrum_step"] == step
    assert spectrum_step(8, 0.5) == 4  # 3.5: halves round up
    with pytest.raises(ValueError, match="within"):
        placement_at(results, 1.5, EP)


def test_positions_are_evenly_spread_with_both_ends_and_no_repeated_placement():
    assert profile_positions(_results({1: 4, 2: 7}), 5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    # layers of 1 and 2 points: only two distinct placements exist (0.25 repeats 0.0; 0.75, 1.0 repeat 0.5)
    short = profile_positions(_results({1: 1, 2: 2}), 5)
    assert short == [0.0, 0.5] and spectrum_step(2, 0.5) == spectrum_step(2, 1.0) == 1
    assert profile_positions(_results({1: 1}), 9) == [0.0]
    with pytest.raises(ValueError, match="both ends"):
        profile_positions(_results({1: 3}), 1)


def test_report_picks_the_fastest_ties_to_less_communication_and_tabulates():
    results = _results({1: 3, 2: 5})
    ids = np.array([[0, 1], [2, 7], [4, 5]])
    trace = RoutingTrace(NUM_EXPERTS, 2, {1: LayerTrace(ids, 3, np.bincount(ids.ravel(), minlength=NUM_EXPERTS))})
    times = [(0.0, [3.0, 9.0, 3.0]), (0.5, [2.0, 2.0, 2.0]), (1.0, [2.0, 1.0, 5.0])]
    report = ProfileReport.from_times(results, EP, times, tokens=1000, trace=trace)
    assert [row.seconds for row in report.rows] == [3.0, 2.0, 2.0]  # medians
    assert report.chosen == 1 and report.chosen_row.position == 0.5  # tie with 1.0: the earlier point
    assert report.chosen_row.steps == {1: 1, 2: 2} and report.chosen_row.tokens_per_second == 500.0
    assert report.chosen_row.comm_cost == np.mean([9.0, 8.0])
    device = results[1].spectrum[1].device_of_expert
    assert report.chosen_row.devices_per_token == np.mean([len({device[e] for e in row}) for row in ids])
    meta = report.placement.metadata
    assert meta["selection"] == "profile auto" and len(meta["profile"]) == 3
    assert meta["layers"]["2"]["spectrum_step"] == 2
    lines = report.table().splitlines()
    assert len(lines) == 4 and lines[2].lstrip().startswith("*") and "2000.000" in lines[2]


LENGTHS = {1: 4, 2: 7}  # positions 0, .25, .5, .75, 1 -> steps (0,0) (1,2) (2,3) (2,5) (3,6)
# fake seconds per forward by rank and position: rank 0 alone would pick 0.25, rank 1 alone 1.0;
# their maximum ties 0.5 and 0.75 (0.5 wins, less communication) once the median drops rank 1's
# outlier at 0.5 (a mean would pick 0.75)
SECONDS = [{0.0: 5.0, 0.25: 1.0, 0.5: 3.0, 0.75: 3.0, 1.0: 4.0}, {0.0: 5.0, 0.25: 6.0, 0.5: 3.0, 0.75: 3.0, 1.0: 2.0}]
OUTLIER = (1, 0.5, 2)  # rank, position, call (0 is the warm-up)


def _profile_rank(rank: int, world: int) -> dict:
    import torch

    from megatron_llep.integrations import placement as placement_apply
    from megatron_llep.integrations.placement import apply_placement, restore_original_order
    from megatron_llep.integrations.placement import profile_spectrum
    from megatron_llep.testing.moe import build_moe_layer, init_expert_parallel, moe_config

    init_expert_parallel(world)
    cfg = moe_config(NUM_EXPERTS, 16, 12, 2, EP)
    model = torch.nn.ModuleList([build_moe_layer(cfg, None, seed=s) for s in (1, 2)])
    model[1].set_layer_number(2)
    results = _results(LENGTHS)
    x = torch.randn(24, 1, 16, generator=torch.Generator().manual_seed(100 + rank))

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model[1](model[0](x)[0])[0]

    def snapshot() -> dict:
        return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}

    def identical(a: dict, b: dict) -> bool:
        return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    original, reference = snapshot(), forward()
    router = {n: model[n - 1].router.weight.detach().clone() for n in LENGTHS}
    candidates = {p: placement_at(results, p, EP) for p in SECONDS[0]}
    now, seen, errors = [0.0], [], []

    def run_forward() -> None:
        live = [p for p, pl in candidates.items()
                if all(torch.equal(model[n - 1].router.weight, router[n][torch.as_tensor(pl.slot_to_expert(n))])
                       for n in LENGTHS)]
        position = live[0] if len(live) == 1 else None
        call = seen.count(position)
        seen.append(position)
        errors.append(float((forward() - reference).abs().max() / reference.abs().max()))
        now[0] += SECONDS[rank][position] + (50.0 if (rank, position, call) == OUTLIER else 0.0)

    report = profile_spectrum(model, results, run_forward, candidates=5, warmup=1, repeats=3, clock=lambda: now[0])
    after_profiling = identical(snapshot(), original)
    apply_placement(model, report.placement)
    chosen_error = float((forward() - reference).abs().max() / reference.abs().max())
    restore_original_order(model, report.placement)
    after_round_trip = identical(snapshot(), original)

    with mock.patch.object(placement_apply, "restore_original_order", lambda model, placement: None):
        profile_spectrum(model, results, lambda: None, candidates=2, warmup=0, repeats=1)
    return {
        "chosen": report.chosen_row.position,
        "steps": report.chosen_row.steps,
        "seconds": [row.seconds for row in report.rows],
        "selection": report.placement.metadata["selection"],
        "applied": seen,
        "max_error_while_profiling": max(errors),
        "chosen_error": chosen_error,
        "bit_identical_after_profiling": after_profiling,
        "bit_identical_after_round_trip": after_round_trip,
        "unrestored_detected": not identical(snapshot(), original),
        "table": report.table(),
    }


def test_profile_spectrum_picks_the_rank_agreed_fastest_point_and_leaves_the_model_as_it_was():
    per_rank = run_distributed(_profile_rank, 2, timeout_s=300)
    for rank, r in enumerate(per_rank):
        assert r["chosen"] == 0.5 and r["steps"] == {1: 2, 2: 3}, f"rank {rank}:\n{r['table']}"
        assert r["seconds"] == [5.0, 6.0, 3.0, 3.0, 4.0] and r["selection"] == "profile auto"
        assert r["applied"] == [p for p in (0.0, 0.25, 0.5, 0.75, 1.0) for _ in range(4)]  # warm-up + 3 each
        assert r["max_error_while_profiling"] <= 1e-5 and r["chosen_error"] <= 1e-5
        assert r["bit_identical_after_profiling"] and r["bit_identical_after_round_trip"]
        assert r["unrestored_detected"], f"rank {rank}: skipping the restore went unnoticed"
