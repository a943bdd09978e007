"""Borrowed expert weights: native -> helper in forward, their gradients helper -> native in backward.

Forward: :meth:`ExpertWeightExchange.start` posts the P2P sends/receives on a communicator of their
own (:func:`weight_exchange_group`) before the token all-to-all; the native experts run while they
travel; :meth:`finish` then waits and hands out the received weights through an autograd function.

Backward: the same function sends each borrowed weight's gradient back to the native rank, which
adds it to the native expert's gradient — into ``main_grad`` directly under Megatron DDP (its
hooks may already be ignoring ``param.grad`` for fused wgrad), otherwise into ``param.grad``
through autograd. The function also passes the native experts' output (the "anchor") through, so
its backward runs, on every participating rank, strictly between the combine and the dispatch
all-to-all backward of the same layer: the gradient return can never deadlock against them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_llep.experts import ExpertAdapter


_WEIGHT_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def weight_exchange_group(ep_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A communicator over the same ranks as ``ep_group``, one per EP group and process. Created
    by the group's members only (``use_local_synchronization``), when their first LLEP layer is
    built: every member builds the same layers, so they all get here together."""
    ranks = tuple(dist.get_process_group_ranks(ep_group))
    if ranks not in _WEIGHT_GROUPS:
        _WEIGHT_GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _WEIGHT_GROUPS[ranks]


class ExpertWeightExchange:
    """The weight transfers of one rank for one layer step."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        adapter: ExpertAdapter,
        first_local_expert: int,
        weights_to_send: list[tuple[int, int]],
        weights_to_receive: list[tuple[int, int]],
        device: torch.device,
    ) -> None:
        self.group = group
        self.adapter = adapter
        self.first_local_expert = first_local_expert
        self.sends = list(weights_to_send)
        self.receives = list(weights_to_receive)
        self.sent_experts = sorted({expert for expert, _ in self.sends})
        specs = adapter.tensor_specs()
        self.specs = specs
        self.received = {
            expert: [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
            for expert, _ in self.receives
        }
        self._pending: list = []
        self._posted = False

    @property
    def active(self) -> bool:
        return bool(self.sends or self.receives)

    def _peer(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def _native_tensors(self, expert: int) -> list[torch.Tensor]:
        return self.adapter.expert_tensors(expert - self.first_local_expert)

    def start(self) -> None:
        """Post the weight sends and receives without waiting (call before the token all-to-all).
        Once per step: a recomputed forward reuses the weights already received."""
        if self._posted:
            return
        self._posted = True
        ops = []
        for expert, helper in self.sends:
            for tensor in self._native_tensors(expert):
                ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), self._peer(helper), self.group))
        for expert, native in self.receives:
            for buffer in self.received[expert]:
                ops.append(dist.P2POp(dist.irecv, buffer, self._peer(native), self.group))
        self._pending = dist.batch_isend_irecv(ops) if ops else []

    def finish(self, anchor: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Wait for the weights; returns the anchor (pass it on) and the borrowed experts' tensors
        in ``receives`` order, connected to autograd for the gradient return.

        The anchor is the native experts' output: its gradient arrives right after the combine
        all-to-all's backward, and the native experts' backward (then the dispatch all-to-all's)
        waits for this function's, so every participating rank returns gradients between the
        layer's two all-to-all backwards: the P2P exchange cannot cross them."""
        inputs = [t for expert in self.sent_experts for t in self._native_tensors(expert)]
        # Tie the outputs to a native parameter so that every rank's borrowed weights require grad
        # exactly when its expert parameters do (a rank that only receives has no other input).
        tie = self._native_tensors(self.first_local_expert)[0]
        outputs = _BorrowExperts.apply(anchor, tie, self, *inputs)
        anchor_out, flat = outputs[0], outputs[1:]
        per_expert = len(self.specs)
        borrowed = [list(flat[i * per_expert : (i + 1) * per_expert]) for i in range(len(self.receives))]
        return anchor_out, borrowed

    def wait(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending = []

    def return_gradients(self, grads: list[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
        """Backward P2P. ``grads`` follow ``receives``; returns the summed gradient for each tensor
        of ``sent_experts`` (``None`` where it went straight into Megatron DDP's ``main_grad``)."""
        per_expert = len(self.specs)
        ops = []
        for i, (expert, native) in enumerate(self.receives):
            for j, buffer in enumerate(self.received[expert]):
                grad = grads[i * per_expert + j]
                grad = torch.zeros_like(buffer) if grad is None else grad.contiguous()
                ops.append(dist.P2POp(dist.isend, grad, self._peer(native), self.group))
        incoming: dict[int, list[list[torch.Tensor]]] = {expert: [] for expert in self.sent_experts}
        for expert, helper in self.sends:
            buffers = [torch.empty_like(t) for t in self._native_tensors(expert)]
            incoming[expert].append(buffers)
            for buffer in buffers:
                ops.append(dist.P2POp(dist.irecv, buffer, self._peer(helper), self.group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

        result: list[Optional[torch.Tensor]] = []
        for expert in self.sent_experts:
            main_grads = self.adapter.main_grads(expert - self.first_local_expert)
            for j in range(per_expert):
                parts = [helper[j] for helper in incoming[expert]]
                if main_grads[j] is not None:
                    # one add per helper, in main_grad's dtype (fp32 under DDP), as stock EP adds the
                    # native GEMM's gradient: no bf16 sum of partial gradients first
                    for part in parts:
                        main_grads[j].add_(part)
                    result.append(None)
                else:
                    total = parts[0].float()
                    for part in parts[1:]:
                        total = total + part.float()
                    result.append(total.to(parts[0].dtype))
        return result


class _BorrowExperts(torch.autograd.Function):
    """Identity on the anchor; outputs the received weights; backward returns their gradients."""

    @staticmethod
    def forward(ctx, anchor, tie, exchange: ExpertWeightExchange, *sent):
        exchange.wait()
        ctx.exchange = exchange
        received = [t for expert, _ in exchange.receives for t in exchange.received[expert]]
        return (anchor.view_as(anchor), *received)

    @staticmethod
    def backward(ctx, grad_anchor, *grad_received):
        returned = ctx.exchange.return_gradients(list(grad_received))
        return (grad_anchor, None, None, *returned)
