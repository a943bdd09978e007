"""Running borrowed experts with exactly the native experts' math.

A helper rank computes a borrowed expert by calling *its own* experts module (SequentialMLP,
TEGroupedMLP or, before Megatron-Core 0.17, legacy GroupedMLP) through ``torch.func.functional_call`` with the borrowed weights
substituted into expert slots. The code path (fused or unfused bias+activation, gpt-oss clamp and
GLU offset, probability weighting, fp8 padding) is therefore the native one by construction.

An :class:`ExpertAdapter` knows, per experts-module type, which tensors make up one expert, where
Megatron DDP keeps their gradient (``main_grad``), and how to substitute borrowed tensors.
"""

from __future__ import annotations

import contextlib
import re
from abc import ABC, abstractmethod
from typing import Iterator, Optional, Sequence

import torch

from megatron_llep.compat.mcore import GroupedMLP, SequentialMLP, TEGroupedMLP
from megatron_llep.planning.cost_model import ExpertShape

Tensors = list[torch.Tensor]


_FUSION_FLAGS = ("gradient_accumulation_fusion", "fuse_wgrad_accumulation")  # Megatron's, TE's linears


def _fusion_flag_holders(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """The submodules of ``module`` that carry a weight-gradient fusion flag, with the flag's name
    (found once: walking the module tree on every borrowed call costs host time)."""
    return [(sub, attr) for sub in module.modules() for attr in _FUSION_FLAGS if hasattr(sub, attr)]


@contextlib.contextmanager
def _unfused_weight_grads(holders: list[tuple[torch.nn.Module, str]]) -> Iterator[None]:
    """Borrowed weights have no ``main_grad`` buffer, so their GEMMs must return ordinary weight
    gradients: switch off gradient-accumulation fusion (Megatron and TE linears) for the call."""
    saved = [(sub, attr) for sub, attr in holders if getattr(sub, attr) is True]
    for sub, attr in saved:
        setattr(sub, attr, False)
    try:
        yield
    finally:
        for sub, attr in saved:
            setattr(sub, attr, True)


class ExpertAdapter(ABC):
    """Uniform access to one rank's experts module for the weight exchange and borrowed compute."""

    def __init__(self, experts: torch.nn.Module, num_local_experts: int) -> None:
        self.experts = experts
        self.num_local_experts = num_local_experts
        self._fusion_flags = _fusion_flag_holders(experts)

    @abstractmethod
    def expert_tensors(self, local_index: int) -> Tensors:
        """The tensors (parameters or views of them) of native expert ``local_index``, in a fixed order."""

    @abstractmethod
    def main_grads(self, local_index: int) -> list[Optional[torch.Tensor]]:
        """Megatron DDP gradient buffers matching :meth:`expert_tensors` (``None`` without DDP)."""

    @abstractmethod
    def substitute(self, borrowed: Sequence[Tensors]) -> dict[str, torch.Tensor]:
        """Parameter overrides that put up to ``num_local_experts`` borrowed experts in slots 0.."""

    def group_counts(self, counts: list[int]) -> torch.Tensor:
        """The experts module's ``tokens_per_expert`` for one call on ``len(counts)`` borrowed
        experts: padded with empty slots to ``num_local_experts`` (a grouped GEMM takes one count
        per slot)."""
        return torch.tensor(counts + [0] * (self.num_local_experts - len(counts)))

    def tensor_specs(self) -> list[tuple[torch.Size, torch.dtype]]:
        """Shapes and dtypes of one expert's tensors (the same for every expert of the layer)."""
        return [(t.shape, t.dtype) for t in self.expert_tensors(0)]

    def expert_shape(self, config) -> ExpertShape:
        """The expert's GEMM shape, for the cost model."""
        return ExpertShape(
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.moe_ffn_hidden_size,
            gated=config.gated_linear_unit,
            bias=config.add_bias_linear,
            dtype_bytes=self.expert_tensors(0)[0].element_size(),
        )

    def forward_native(self, hidden: torch.Tensor, tokens_per_slot: Sequence[int], probs: torch.Tensor) -> torch.Tensor:
        """The native experts on the first ``num_local_experts`` slots' rows (the leading rows)."""
        counts = [int(c) for c in tokens_per_slot[: self.num_local_experts]]
        rows = sum(counts)
        if rows != hidden.shape[0]:
            hidden, probs = hidden.narrow(0, 0, rows), probs.narrow(0, 0, rows)
        return self.experts(hidden, torch.tensor(counts), probs)[0]

    def forward_borrowed(
        self,
        hidden: torch.Tensor,
        tokens_per_slot: Sequence[int],
        probs: torch.Tensor,
        borrowed: Sequence[Tensors],
        first_slot: Optional[int] = None,
    ) -> list[torch.Tensor]:
        """The slots ``first_slot ..`` (default: right after the native ones) through the experts
        module with ``borrowed``'s weights substituted, ``num_local_experts`` experts per call."""
        local = self.num_local_experts
        first = local if first_slot is None else first_slot
        counts = [int(c) for c in tokens_per_slot]
        if first < local or first + len(borrowed) > len(counts):
            raise ValueError(f"{len(counts)} slot counts cannot hold {len(borrowed)} borrowed experts from slot "
                             f"{first} ({local} native slots)")
        before = sum(counts[:first])
        rows = sum(counts[first : first + len(borrowed)])
        part = hidden.narrow(0, before, rows)
        part_probs = probs.narrow(0, before, rows)
        return self.forward_borrowed_part(part, counts[first : first + len(borrowed)], part_probs, borrowed)

    def forward_borrowed_part(
        self, hidden: torch.Tensor, counts: Sequence[int], probs: torch.Tensor, borrowed: Sequence[Tensors]
    ) -> list[torch.Tensor]:
        """``borrowed``'s experts on ``hidden``, which holds exactly their rows (``counts``).

        The rows are cut into the calls' pieces by one ``split`` (one gradient buffer in backward,
        where a slice per call would allocate a zero-filled copy of the whole input each)."""
        local = self.num_local_experts
        counts = [int(c) for c in counts]
        groups = [counts[start : start + local] for start in range(0, len(borrowed), local)]
        sizes = [sum(group) for group in groups]
        if len(groups) == 1:
            pieces, piece_probs = [hidden], [probs]
        else:
            pieces, piece_probs = hidden.split(sizes), probs.split(sizes)
        outputs = []
        for start, group_counts, piece, piece_prob in zip(range(0, len(borrowed), local), groups, pieces, piece_probs):
            group = borrowed[start : start + local]
            with _unfused_weight_grads(self._fusion_flags):
                out, _ = torch.func.functional_call(
                    self.experts,
                    self.substitute(group),
                    (piece, self.group_counts(group_counts), piece_prob),
                    strict=False,
                    tie_weights=False,  # expert weights are never tied; skips a walk over every parameter
                )
            outputs.append(out)
        return outputs


class SequentialMLPAdapter(ExpertAdapter):
    """SequentialMLP: expert ``i`` is the MLP ``local_experts[i]``."""

    def __init__(self, experts: SequentialMLP, num_local_experts: int) -> None:
        super().__init__(experts, num_local_experts)
        self._names = [name for name, _ in experts.local_experts[0].named_parameters()]

    def _params(self, local_index: int) -> Tensors:
        params = dict(self.experts.local_experts[local_index].named_parameters())
        return [params[name] for name in self._names]

    def expert_tensors(self, local_index: int) -> Tensors:
        return self._params(local_index)

    def main_grads(self, local_index: int) -> list[Optional[torch.Tensor]]:
        return [getattr(p, "main_grad", None) for p in self._params(local_index)]

    def group_counts(self, counts: list[int]) -> torch.Tensor:
        """Unpadded: SequentialMLP runs one MLP per count it is given (its loop zips the experts
        with the count list), so empty padding slots would each still run their GEMMs."""
        return torch.tensor(counts)

    def substitute(self, borrowed: Sequence[Tensors]) -> dict[str, torch.Tensor]:
        return {
            f"local_experts.{slot}.{name}": tensor
            for slot, tensors in enumerate(borrowed)
            for name, tensor in zip(self._names, tensors)
        }


class TEGroupedMLPAdapter(ExpertAdapter):
    """TEGroupedMLP: expert ``i`` owns ``linear_fc1.weight{i}``, ``linear_fc1.bias{i}``, ... ."""

    _INDEXED = re.compile(r"^(?P<stem>.*\D)(?P<index>\d+)$")

    def __init__(self, experts: torch.nn.Module, num_local_experts: int) -> None:
        super().__init__(experts, num_local_experts)
        stems: list[str] = []
        for name, _ in experts.named_parameters():
            match = self._INDEXED.match(name)
            if match is None:
                raise ValueError(f"cannot map grouped expert parameter {name!r} to an expert index")
            if int(match["index"]) == 0:
                stems.append(match["stem"])
        self._stems = stems

    def _params(self, local_index: int) -> Tensors:
        params = dict(self.experts.named_parameters())
        return [params[f"{stem}{local_index}"] for stem in self._stems]

    def expert_tensors(self, local_index: int) -> Tensors:
        return self._params(local_index)

    def main_grads(self, local_index: int) -> list[Optional[torch.Tensor]]:
        return [getattr(p, "main_grad", None) for p in self._params(local_index)]

    def substitute(self, borrowed: Sequence[Tensors]) -> dict[str, torch.Tensor]:
        return {
            f"{stem}{slot}": tensor
            for slot, tensors in enumerate(borrowed)
            for stem, tensor in zip(self._stems, tensors)
        }


class GroupedMLPAdapter(ExpertAdapter):
    """Legacy GroupedMLP: experts are blocks of ``weight1`` ``[D, M*2H]`` and ``weight2`` ``[M*H, D]``
    (as GroupedMLP itself views them: ``weight1.view(M, D, -1)[i]``)."""

    def _views(self, weight1: torch.Tensor, weight2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.experts.config.hidden_size
        local = self.num_local_experts
        return weight1.view(local, hidden, -1), weight2.view(local, -1, hidden)

    def expert_tensors(self, local_index: int) -> Tensors:
        w1, w2 = self._views(self.experts.weight1, self.experts.weight2)
        return [w1[local_index], w2[local_index]]

    def main_grads(self, local_index: int) -> list[Optional[torch.Tensor]]:
        g1 = getattr(self.experts.weight1, "main_grad", None)
        g2 = getattr(self.experts.weight2, "main_grad", None)
        if g1 is None or g2 is None:
            return [None, None]
        v1, v2 = self._views(g1, g2)
        return [v1[local_index], v2[local_index]]

    def substitute(self, borrowed: Sequence[Tensors]) -> dict[str, torch.Tensor]:
        pad = self.num_local_experts - len(borrowed)
        w1 = [t[0] for t in borrowed] + [torch.zeros_like(borrowed[0][0])] * pad
        w2 = [t[1] for t in borrowed] + [torch.zeros_like(borrowed[0][1])] * pad
        return {
            "weight1": torch.stack(w1).view_as(self.experts.weight1),
            "weight2": torch.stack(w2).view_as(self.experts.weight2),
        }


def make_expert_adapter(experts: torch.nn.Module, num_local_experts: int) -> ExpertAdapter:
    """The adapter for a Megatron experts module; raises for module types LLEP cannot borrow from."""
    if isinstance(experts, SequentialMLP):
        return SequentialMLPAdapter(experts, num_local_experts)
    if isinstance(experts, TEGroupedMLP):
        return TEGroupedMLPAdapter(experts, num_local_experts)
    if GroupedMLP is not None and isinstance(experts, GroupedMLP):
        return GroupedMLPAdapter(experts, num_local_experts)
    raise TypeError(
        f"LLEP cannot run borrowed experts for {type(experts).__name__}; supported experts modules are "
        "SequentialMLP, TEGroupedMLP and (Megatron-Core < 0.17) legacy GroupedMLP"
    )
