"""Borrowed expert weights: native -> helper in forward, their gradients helper -> native in backward.

Forward: :meth:`ExpertWeightExchange.start` posts the P2P sends/receives on a communicator of their
own (:func:`weight_exchange_group`) before the token all-to-all; the native experts run while they
travel; :meth:`finish` then waits and hands out the received weights through an autograd function.

Backward: each borrowed weight's gradient goes back to the native rank, which adds it to the
native expert's gradient — into ``main_grad`` directly under Megatron DDP (its hooks may already
be ignoring ``param.grad`` for fused wgrad), otherwise into ``param.grad`` through autograd. Two
autograd nodes do it: the one on the native experts' output (:meth:`ExpertWeightExchange.finish`)
posts the transfers as soon as the borrowed experts' backward is done, the one on the experts'
input (:meth:`ExpertWeightExchange.attach`) waits for them after the native experts' backward. So
the transfer overlaps the native backward, and both nodes run, on every participating rank,
strictly between the combine and the dispatch all-to-all backward of the same layer: the gradient
return can never deadlock against them. The lent experts' parameters are inputs of the second
node, so Megatron DDP's gradient hooks on them fire only after the returned gradients are added.
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
        # backward: (pending transfers, gradients being sent, received gradients per lent expert)
        self._gradient_transfer: Optional[tuple[list, list[torch.Tensor], dict[int, list[list[torch.Tensor]]]]] = None

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

    def attach(self, expert_input: torch.Tensor) -> torch.Tensor:
        """Pass the experts' input (native and borrowed slots) through the gradient-return node.

        Its backward runs once every expert on this rank, native and borrowed, has produced its
        input gradient, and before the dispatch all-to-all's backward (which needs that gradient):
        the returned gradients arrive while this rank's native experts run their backward, and the
        P2P exchange can never cross the layer's all-to-all backwards."""
        inputs = [t for expert in self.sent_experts for t in self._native_tensors(expert)]
        return _ReturnBorrowedGradients.apply(expert_input, self, *inputs)

    def finish(self, native_output: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Wait for the weights (after the native experts ran); returns ``native_output`` (pass it
        on) and the borrowed experts' tensors in ``receives`` order, connected to autograd.

        In backward the native output's gradient arrives right after the combine all-to-all's, so
        this node runs as soon as the borrowed experts' weight gradients exist: it posts their
        return without waiting, and :meth:`attach`'s node completes it."""
        # Tie the outputs to a native parameter so that every rank's borrowed weights require grad
        # exactly when its expert parameters do (a rank that only receives has no other input).
        tie = self._native_tensors(self.first_local_expert)[0]
        outputs = _BorrowExperts.apply(native_output, tie, self)
        anchor_out, flat = outputs[0], outputs[1:]
        per_expert = len(self.specs)
        borrowed = [list(flat[i * per_expert : (i + 1) * per_expert]) for i in range(len(self.receives))]
        return anchor_out, borrowed

    def wait(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending = []

    def post_gradients(self, grads: list[Optional[torch.Tensor]]) -> None:
        """Backward, first half: post the borrowed weights' gradients (``grads`` follow ``receives``)
        to their native ranks, and the receives of the gradients of the experts this rank lent."""
        per_expert = len(self.specs)
        ops = []
        outgoing = []  # kept alive until the sends complete
        for i, (expert, native) in enumerate(self.receives):
            for j, buffer in enumerate(self.received[expert]):
                grad = grads[i * per_expert + j]
                grad = torch.zeros_like(buffer) if grad is None else grad.contiguous()
                outgoing.append(grad)
                ops.append(dist.P2POp(dist.isend, grad, self._peer(native), self.group))
        incoming: dict[int, list[list[torch.Tensor]]] = {expert: [] for expert in self.sent_experts}
        for expert, helper in self.sends:
            buffers = [torch.empty_like(t) for t in self._native_tensors(expert)]
            incoming[expert].append(buffers)
            for buffer in buffers:
                ops.append(dist.P2POp(dist.irecv, buffer, self._peer(helper), self.group))
        self._gradient_transfer = (dist.batch_isend_irecv(ops) if ops else [], outgoing, incoming)

    def return_gradients(self) -> list[Optional[torch.Tensor]]:
        """Backward, second half: wait for the posted gradient transfers; returns the summed
        gradient for each tensor of ``sent_experts`` (``None`` where it went straight into Megatron
        DDP's ``main_grad``)."""
        if self._gradient_transfer is None:
            raise RuntimeError(
                "LLEP weight exchange: the borrowed-weight gradients were never posted (the backward of "
                "the native experts' output did not run before that of the experts' input)"
            )
        pending, _, incoming = self._gradient_transfer
        for work in pending:
            work.wait()
        self._gradient_transfer = None
        per_expert = len(self.specs)
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
    """Identity on the native output; outputs the received weights; backward posts their gradients."""

    @staticmethod
    def forward(ctx, native_output, tie, exchange: ExpertWeightExchange):
        exchange.wait()
        ctx.exchange = exchange
        received = [t for expert, _ in exchange.receives for t in exchange.received[expert]]
        return (native_output.view_as(native_output), *received)

    @staticmethod
    def backward(ctx, grad_native_output, *grad_received):
        ctx.exchange.post_gradients(list(grad_received))
        return grad_native_output, None, None


class _ReturnBorrowedGradients(torch.autograd.Function):
    """Identity on the experts' input; backward completes the gradient return to the lent experts."""

    @staticmethod
    def forward(ctx, expert_input, exchange: ExpertWeightExchange, *lent):
        ctx.exchange = exchange
        return expert_input.view_as(expert_input)

    @staticmethod
    def backward(ctx, grad_expert_input):
        return (grad_expert_input, None, *ctx.exchange.return_gradients())
