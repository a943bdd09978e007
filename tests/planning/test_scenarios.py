"""The "f into h experts" routing scenarios."""

import numpy as np
import pytest

from megatron_llep.planning.scenarios import imbalanced_topk

pytestmark = pytest.mark.release_independent  # .ci/run tests it on one Megatron-Core release


@pytest.mark.parametrize("f, h, k", [(0.95, 1, 4), (0.8, 4, 4), (0.5, 16, 8), (0.3, 2, 1)])
def test_hot_fraction_and_distinct_choices(f, h, k):
    ids = imbalanced_topk(20000, 64, k, f, h, seed=3)
    assert ids.shape == (20000, k)
    assert all(len(set(row)) == k for row in ids[:2000].tolist())
    hot_tokens = np.isin(ids, np.arange(h)).any(axis=1).mean()
    assert hot_tokens == pytest.approx(f, abs=0.02)
    # hot tokens take min(h, K) hot experts, uniformly
    loads = np.bincount(ids.ravel(), minlength=64)
    hot_loads = loads[:h]
    assert hot_loads.sum() == pytest.approx(20000 * f * min(h, k), rel=0.03)
    assert hot_loads.min() > 0.8 * hot_loads.mean()


def test_balanced_is_uniform():
    loads = np.bincount(imbalanced_topk(64000, 32, 4, 0.0, 0, seed=1).ravel(), minlength=32)
    assert loads.max() / loads.mean() < 1.05


def test_bad_scenarios():
    with pytest.raises(ValueError):
        imbalanced_topk(10, 8, 9, 0.5, 1)
    with pytest.raises(ValueError):
        imbalanced_topk(10, 8, 2, 1.5, 1)
    with pytest.raises(ValueError):
        imbalanced_topk(10, 4, 2, 0.5, 1, hot_experts=[7])
