"""The expert placement: per MoE layer, which original expert sits in each physical expert slot.

``slot_to_expert[s] = e``: physical slot ``s`` holds original expert ``e``; slot ``s`` lives on EP
rank ``s // M`` (``M = N / ep_size``), so a placed model is an ordinary Megatron model whose rank
``r`` owns slots ``rM .. (r+1)M-1``. Routers, LLEP and checkpoints see only physical slots.

File format (JSON, :meth:`ExpertPlacement.save`)::

    {"format": "megatron-llep-expert-placement", "version": 1, "num_experts": N, "ep_size": P,
     "experts_per_rank": M, "routing_groups": G, "layers": {"<layer number>": [slot_to_expert]},
     "metadata": {...}}

``routing_groups`` (default 1) records that every layer keeps each of Megatron's ``G`` routing
groups (contiguous blocks of ``N / G`` ids) on one contiguous block of slots, which group-limited
routing needs (see :func:`check_routing_groups`). ``metadata`` is free-form (how it was made, C, B).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

from megatron_llep.writable import write_text

PLACEMENT_FORMAT = "megatron-llep-expert-placement"
PLACEMENT_VERSION = 1


def check_permutation(slot_to_expert: np.ndarray, num_experts: int, what: str = "placement") -> np.ndarray:
    """``slot_to_expert`` as int64 if it is a permutation of ``0..num_experts-1``, else a ValueError
    that names the duplicated and missing ids."""
    perm = np.asarray(slot_to_expert)
    if perm.ndim != 1 or not (np.issubdtype(perm.dtype, np.integer) or perm.size == 0):
        raise ValueError(f"{what}: slot_to_expert must be a 1-d integer array, got shape {perm.shape} dtype {perm.dtype}")
    if perm.size != num_experts:
        raise ValueError(f"{what}: slot_to_expert has {perm.size} entries but the layer has {num_experts} experts")
    perm = perm.astype(np.int64)
    counts = np.bincount(perm[(perm >= 0) & (perm < num_experts)], minlength=num_experts)
    if (perm < 0).any() or (perm >= num_experts).any() or (counts != 1).any():
        out_of_range = sorted(set(perm[(perm < 0) | (perm >= num_experts)].tolist()))
        raise ValueError(
            f"{what}: slot_to_expert is not a permutation of 0..{num_experts - 1}: duplicated "
            f"{np.flatnonzero(counts > 1).tolist()}, missing {np.flatnonzero(counts == 0).tolist()}"
            + (f", out of range {out_of_range}" if out_of_range else "")
        )
    return perm


def check_routing_groups(slot_to_expert: np.ndarray, num_groups: int, what: str = "placement") -> None:
    """Group-limited routing (``moe_router_num_groups = G > 1``) scores contiguous blocks of
    ``N / G`` expert ids; it gives the same routing after a permutation only if every block of
    slots holds exactly one original group (whole groups may move, experts may move inside their
    group). Raises a ValueError naming the first block that mixes groups."""
    perm = np.asarray(slot_to_expert)
    if num_groups <= 1:
        return
    if perm.size % num_groups:
        raise ValueError(f"{what}: {perm.size} experts cannot form {num_groups} routing groups")
    group_size = perm.size // num_groups
    groups = (perm // group_size).reshape(num_groups, group_size)
    mixed = np.flatnonzero((groups != groups[:, :1]).any(axis=1))
    if mixed.size:
        block = int(mixed[0])
        raise ValueError(
            f"{what}: slots {block * group_size}..{(block + 1) * group_size - 1} mix routing groups "
            f"{sorted(set(groups[block].tolist()))}; with moe_router_num_groups={num_groups} a placement may only "
            "move whole routing groups and experts within their group (plan it with routing_groups="
            f"{num_groups})"
        )


def experts_per_rank(num_experts: int, ep_size: int) -> int:
    if ep_size <= 0 or num_experts <= 0:
        raise ValueError(f"num_experts ({num_experts}) and ep_size ({ep_size}) must be positive")
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {ep_size}")
    return num_experts // ep_size


@dataclass
class ExpertPlacement:
    """Per MoE layer (Megatron's global 1-based layer number) the permutation slot -> original
    expert, for an EP group of ``ep_size`` ranks."""

    num_experts: int
    ep_size: int
    layers: dict[int, np.ndarray]
    routing_groups: int = 1
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        experts_per_rank(self.num_experts, self.ep_size)
        if not self.layers:
            raise ValueError("a placement needs at least one layer")
        self.layers = {
            int(n): check_permutation(perm, self.num_experts, f"placement of layer {n}") for n, perm in self.layers.items()
        }
        for n, perm in self.layers.items():
            check_routing_groups(perm, self.routing_groups, f"placement of layer {n}")

    @classmethod
    def identity(cls, num_experts: int, ep_size: int, layers: Iterable[int]) -> "ExpertPlacement":
        return cls(num_experts, ep_size, {int(n): np.arange(num_experts) for n in layers})

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def slot_to_expert(self, layer: int) -> np.ndarray:
        if layer not in self.layers:
            raise KeyError(f"the placement has no MoE layer {layer}; it holds layers {sorted(self.layers)}")
        return self.layers[layer]

    def expert_to_slot(self, layer: int) -> np.ndarray:
        return np.argsort(self.slot_to_expert(layer))

    def device_of_expert(self, layer: int) -> np.ndarray:
        """EP rank serving each original expert."""
        return self.expert_to_slot(layer) // self.experts_per_rank

    def inverse(self) -> "ExpertPlacement":
        """The placement that, applied to a placed model, restores the original order."""
        return ExpertPlacement(self.num_experts, self.ep_size, {n: np.argsort(p) for n, p in self.layers.items()},
                               self.routing_groups, {"inverse_of": self.metadata})

    def to_json(self) -> dict:
        return {
            "format": PLACEMENT_FORMAT,
            "version": PLACEMENT_VERSION,
            "num_experts": self.num_experts,
            "ep_size": self.ep_size,
            "experts_per_rank": self.experts_per_rank,
            "routing_groups": self.routing_groups,
            "layers": {str(n): p.tolist() for n, p in sorted(self.layers.items())},
            "metadata": self.metadata,
        }

    def save(self, path: str, flag: Optional[str] = None) -> None:
        """Write the placement file whole, or leave what was at ``path`` (an :class:`OutputError`
        names the file, and ``flag`` if the command line chose it)."""
        text = json.dumps(self.to_json(), indent=1)
        text = re.sub(r"\[[-\d,\s]*\]", lambda m: json.dumps(json.loads(m.group(0))), text)  # one line per layer
        write_text(path, text + "\n", flag)

    @classmethod
    def from_json(cls, payload: dict, source: str = "placement") -> "ExpertPlacement":
        if not isinstance(payload, dict) or payload.get("format") != PLACEMENT_FORMAT:
            found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
            raise ValueError(f"{source}: not an expert placement (format {found!r}, expected {PLACEMENT_FORMAT!r})")
        if payload.get("version") != PLACEMENT_VERSION:
            raise ValueError(f"{source}: placement version {payload.get('version')} is not supported")
        num_experts, ep_size = int(payload["num_experts"]), int(payload["ep_size"])
        if "experts_per_rank" in payload and payload["experts_per_rank"] * ep_size != num_experts:
            raise ValueError(f"{source}: experts_per_rank={payload['experts_per_rank']} x ep_size={ep_size} != {num_experts}")
        if not isinstance(payload.get("layers"), dict):
            raise ValueError(f"{source}: 'layers' must map MoE layer numbers to expert-id lists")
        layers = {}
        for n, perm in payload["layers"].items():
            if not str(n).isdigit():
                raise ValueError(f"{source}: layer {n!r} is not a layer number (a non-negative integer)")
            if not isinstance(perm, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in perm):
                raise ValueError(f"{source}: layer {n}: expert ids must be a list of integers, got {perm!r:.80}")
            layers[int(n)] = np.asarray(perm, dtype=np.int64)
        return cls(num_experts, ep_size, layers, int(payload.get("routing_groups", 1)), dict(payload.get("metadata", {})))

    @classmethod
    def load(cls, path: str) -> "ExpertPlacement":
        try:
            with open(path) as f:
                payload = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not an expert placement file (invalid JSON: {err})") from err
        return cls.from_json(payload, path)


CHECKPOINT_PLACEMENT_FILE = "expert_placement.json"


def write_checkpoint_placement(checkpoint_dir: str, placement: ExpertPlacement) -> str:
    """Record next to a checkpoint that its experts are stored in ``placement``'s physical order."""
    path = os.path.join(checkpoint_dir, CHECKPOINT_PLACEMENT_FILE)
    placement.save(path)
    return path


def read_checkpoint_placement(checkpoint_dir: str) -> Optional[ExpertPlacement]:
    """The placement a checkpoint was saved in, or None for a checkpoint in original order."""
    path = os.path.join(checkpoint_dir, CHECKPOINT_PLACEMENT_FILE)
    return ExpertPlacement.load(path) if os.path.exists(path) else None


def same_expert_order(a: Optional[ExpertPlacement], b: Optional[ExpertPlacement]) -> bool:
    """Whether a model placed by ``a`` and one placed by ``b`` (None: original order) hold their
    experts in the same slots, i.e. a checkpoint of one loads into the other."""
    def layers(placement: Optional[ExpertPlacement]) -> Optional[dict]:
        return None if placement is None else placement.to_json()["layers"]

    return layers(a) == layers(b)
