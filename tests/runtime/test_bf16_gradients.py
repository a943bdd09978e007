"""bf16 experts under Megatron DDP (fp32 main_grad): the gradients LLEP returns to a hot expert's
native rank are accumulated in fp32, one helper at a time, so LLEP's expert gradients are no
further from a float64 reference than stock EP's. At EP=4 the hot expert has three helpers: summing
their bf16 gradients before adding them to main_grad (the old way) measured 1.066x stock's error,
one add each in fp32 0.995x (2026-12-03)."""

from exactness_worker import bf16_main_grad_errors
from megatron_llep.testing.distributed import run_distributed


def test_llep_bf16_expert_grads_are_as_close_to_float64_as_stock():
    per_rank = run_distributed(bf16_main_grad_errors, 4, timeout_s=300)
    for rank, r in enumerate(per_rank):
        assert r["mode"] == "llep"
        assert 0 < r["stock"] < 1e-2, r
        assert r["llep"] <= r["stock"] * 1.03, f"rank {rank}: LLEP {r['llep']:.4g} vs stock {r['stock']:.4g}"
