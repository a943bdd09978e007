"""Counting the step's returns of kept borrowed experts' gradients in a test run (the distributed
test workers assert on them)."""

from __future__ import annotations

import contextlib
from typing import Iterator

from megatron_llep.runtime import kept_weights


@contextlib.contextmanager
def counting_gradient_returns(counts: dict) -> Iterator[dict]:
    """While active, add to ``counts["returns"]`` each return begun for a layer that keeps copies
    and to ``counts["behind"]`` each return moved on behind a later layer's backward."""
    ledger_class = kept_weights.KeptLedger
    start_return, progress_returns = ledger_class.start_return, ledger_class.progress_returns
    counts.setdefault("returns", 0)
    counts.setdefault("behind", 0)

    def counted_start(ledger, layer, *args):
        counts["returns"] += int(ledger.held_for(layer) is not None)
        return start_return(ledger, layer, *args)

    def counted_progress(ledger):
        counts["behind"] += len(ledger.returning)
        return progress_returns(ledger)

    ledger_class.start_return, ledger_class.progress_returns = counted_start, counted_progress
    try:
        yield counts
    finally:
        ledger_class.start_return, ledger_class.progress_returns = start_return, progress_returns
