"""The routing traces shipped with the project: real top-K routing of the MoE model trained here.

Every figure that should rest on a model's real routing (synthetic routing
overstates skew) reads its traces through this module, so the file layout lives in one place::

    recipes/data/routing_traces/<model>_<domain>.npz     a RoutingTrace (megatron_llep.placement.trace)
    recipes/data/routing_traces/manifest.json            provenance: checkpoints, data, recording settings

``<model>`` is e.g. ``pretrained`` or ``finetuned``, ``<domain>`` e.g. ``code``, ``prose``,
``legal``; the model name has no underscore, so the first one separates the two.
"""

from __future__ import annotations

import json
import os

from megatron_llep.placement.trace import RoutingTrace

TRACE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "routing_traces")
MANIFEST_FILE = "manifest.json"


def trace_path(model: str, domain: str, directory: str = TRACE_DIR) -> str:
    """Where the trace of ``model`` on ``domain`` lives (whether or not it exists)."""
    return os.path.join(directory, f"{model}_{domain}.npz")


def available(directory: str = TRACE_DIR) -> list[tuple[str, str]]:
    """The ``(model, domain)`` pairs with a trace file in ``directory``, sorted; empty when the
    directory is missing (the traces are produced by a training run and may not be there yet)."""
    if not os.path.isdir(directory):
        return []
    pairs = []
    for name in os.listdir(directory):
        stem, ext = os.path.splitext(name)
        model, sep, domain = stem.partition("_")
        if ext == ".npz" and sep and model and domain:
            pairs.append((model, domain))
    return sorted(pairs)


def load(model: str, domain: str, directory: str = TRACE_DIR) -> RoutingTrace:
    """The trace of ``model`` on ``domain``; a missing file is a one-line ValueError naming the
    file and what is available, so a typo in a model or domain name says what to type instead."""
    path = trace_path(model, domain, directory)
    if not os.path.isfile(path):
        pairs = ", ".join(f"{m}/{d}" for m, d in available(directory)) or "none"
        raise ValueError(f"{path}: no routing trace for model {model!r} on domain {domain!r} (available: {pairs})")
    return RoutingTrace.load(path)


def manifest(directory: str = TRACE_DIR) -> dict:
    """The traces' provenance record (``manifest.json``, written with the traces), as parsed JSON;
    a missing or unreadable file is a one-line ValueError."""
    path = os.path.join(directory, MANIFEST_FILE)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no routing-trace manifest") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable JSON manifest ({err})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: the manifest must be a JSON object, got {type(record).__name__}")
    return record
