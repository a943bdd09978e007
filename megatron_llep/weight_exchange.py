"""Borrowed expert weights: native -> helper in forward, their gradients helper -> native in backward.

Forward: :meth:`ExpertWeightExchange.start` posts the P2P sends/receives on a communicator of their
own (:func:`weight_exchange_group`) before the token all-to-all, one batch per wave
(:func:`megatron_llep.planner.copy_waves`: each helper's first copy, its second, then 2, 4 ...); the
native experts run while they travel; :meth:`finish_wave` then waits for one wave and hands out its
weights through an autograd function, so the helper computes a wave's experts while the later
waves are still on the wire.

Backward: each borrowed weight's gradient goes back to the native rank, which adds it to the
native expert's gradient — into ``main_grad`` directly under Megatron DDP (its hooks may already
be ignoring ``param.grad`` for fused wgrad), otherwise into ``param.grad`` through autograd. The
wave nodes (:meth:`finish_wave`, chained, so they run last wave first on every rank) post each
wave's transfers as soon as its borrowed experts' backward is done; the node on the experts' input
(:meth:`attach`) waits for them after the native experts' backward. So the transfers overlap the
backward, and every node runs, on every participating rank, strictly between the combine and the
dispatch all-to-all backward of the same layer: the gradient return can never deadlock against
them. Every rank posts its waves in one global order (ascending in forward, descending in
backward) and both sides of a (native, helper) pair list their copies alike, so the P2P batches
match under NCCL as under gloo. The lent experts' parameters are inputs of the input node, so
Megatron DDP's gradient hooks on them fire only after the returned gradients are added.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_llep.experts import ExpertAdapter
from megatron_llep.planner import RankPlan


_WEIGHT_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def weight_exchange_group(ep_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A communicator over the same ranks as ``ep_group``, one per EP group and process. Created
    by the group's members only (``use_local_synchronization``), when their first LLEP layer is
    built: every member builds the same layers, so they all get here together.

    Its first operation is an all-reduce of all members: a batched P2P that is a communicator's
    first operation must include all its ranks (``torch.distributed.batch_isend_irecv``; under NCCL
    the lazy communicator set-up would hang), and a step's weight copies involve only some."""
    ranks = tuple(dist.get_process_group_ranks(ep_group))
    if ranks not in _WEIGHT_GROUPS:
        group = dist.new_group(list(ranks), use_local_synchronization=True)
        on_gpu = "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        _WEIGHT_GROUPS[ranks] = group
    return _WEIGHT_GROUPS[ranks]


class ExpertWeightExchange:
    """The weight transfers of one rank for one layer step."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        adapter: ExpertAdapter,
        first_local_expert: int,
        rank_plan: RankPlan,
        device: torch.device,
    ) -> None:
        self.group = group
        self.adapter = adapter
        self.first_local_expert = first_local_expert
        self.sends = list(rank_plan.weights_to_send)
        self.receives = list(rank_plan.weights_to_receive)
        # this rank's waves, ascending: the order every rank posts (and its layer computes) them in
        self.waves = sorted(set(rank_plan.send_waves) | set(rank_plan.receive_waves))
        # per wave: its (expert, helper) sends, and the positions in ``receives`` (slot order) of its receives
        self.wave_sends = {w: [pair for pair, sw in zip(self.sends, rank_plan.send_waves) if sw == w]
                           for w in self.waves}
        self.wave_receives = {w: [i for i, rw in enumerate(rank_plan.receive_waves) if rw == w]
                              for w in self.waves}
        self.sent_experts = sorted({expert for expert, _ in self.sends})
        specs = adapter.tensor_specs()
        self.specs = specs
        self.device = device
        self.received = {
            expert: [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
            for expert, _ in self.receives
        }
        self._pending: dict[int, list] = {}
        self._posted = False
        # backward: pending transfers, gradients being sent (kept alive), received gradients per lent expert
        self._gradient_works: list = []
        self._gradients_out: list[torch.Tensor] = []
        self._gradients_in: dict[int, list[list[torch.Tensor]]] = {}
        self._gradient_waves_posted = 0

    @property
    def active(self) -> bool:
        return bool(self.sends or self.receives)

    def _peer(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def _native_tensors(self, expert: int) -> list[torch.Tensor]:
        return self.adapter.expert_tensors(expert - self.first_local_expert)

    def start(self) -> None:
        """Post the weight sends and receives without waiting, one batch per wave (call before the
        token all-to-all). Once per step: a recomputed forward reuses the weights already received."""
        if self._posted:
            return
        self._posted = True
        for wave in self.waves:
            ops = []
            for expert, helper in self.wave_sends[wave]:
                for tensor in self._native_tensors(expert):
                    ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), self._peer(helper), self.group))
            for i in self.wave_receives[wave]:
                expert, native = self.receives[i]
                for buffer in self.received[expert]:
                    ops.append(dist.P2POp(dist.irecv, buffer, self._peer(native), self.group))
            self._pending[wave] = dist.batch_isend_irecv(ops)

    def attach(self, expert_input: torch.Tensor) -> torch.Tensor:
        """Pass the experts' input (native and borrowed slots) through the gradient-return node.

        Its backward runs once every expert on this rank, native and borrowed, has produced its
        input gradient, and before the dispatch all-to-all's backward (which needs that gradient):
        the returned gradients arrive while this rank's native experts run their backward, and the
        P2P exchange can never cross the layer's all-to-all backwards."""
        inputs = [t for expert in self.sent_experts for t in self._native_tensors(expert)]
        return _ReturnBorrowedGradients.apply(expert_input, self, *inputs)

    def finish_wave(self, wave: int, native_output: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Wait for one wave of weights (call for each of :attr:`waves` in order, after the native
        experts ran, chaining ``native_output`` through); returns it (pass it on) and the wave's
        borrowed experts' tensors in slot order, connected to autograd.

        In backward each wave's node runs as soon as its borrowed experts' weight gradients exist
        (last wave first): it posts their return without waiting, and :meth:`attach`'s node
        completes it."""
        # Tie the outputs to a native parameter so that every rank's borrowed weights require grad
        # exactly when its expert parameters do (a rank that only receives has no other input).
        tie = self._native_tensors(self.first_local_expert)[0]
        outputs = _BorrowWave.apply(native_output, tie, self, wave)
        anchor_out, flat = outputs[0], outputs[1:]
        per_expert = len(self.specs)
        borrowed = [list(flat[i * per_expert : (i + 1) * per_expert]) for i in range(len(flat) // per_expert)]
        return anchor_out, borrowed

    def release_received(self) -> None:
        """Drop this exchange's references to the received weights (after their last use: the end
        of the step's backward, or of a forward that no backward or recompute follows). Autograd
        keeps what it saved for the borrowed GEMMs' backward; the rest is freed now rather than
        when the layer's next step replaces this exchange."""
        self.received = {}

    def wait(self, wave: int) -> None:
        for work in self._pending.pop(wave, []):
            work.wait()

    def post_gradients(self, wave: int, grads: list[Optional[torch.Tensor]]) -> None:
        """Backward, first half: post the gradients of the wave's borrowed weights (``grads`` in
        slot order) to their native ranks, and the receives of the gradients of the experts this
        rank lent in that wave."""
        per_expert = len(self.specs)
        ops = []
        for k, i in enumerate(self.wave_receives[wave]):
            expert, native = self.receives[i]
            for j, (shape, dtype) in enumerate(self.specs):
                grad = grads[k * per_expert + j]
                grad = torch.zeros(shape, dtype=dtype, device=self.device) if grad is None else grad.contiguous()
                self._gradients_out.append(grad)
                ops.append(dist.P2POp(dist.isend, grad, self._peer(native), self.group))
        for expert, helper in self.wave_sends[wave]:
            buffers = [torch.empty_like(t) for t in self._native_tensors(expert)]
            self._gradients_in.setdefault(expert, []).append(buffers)
            for buffer in buffers:
                ops.append(dist.P2POp(dist.irecv, buffer, self._peer(helper), self.group))
        self._gradient_works.extend(dist.batch_isend_irecv(ops))
        self._gradient_waves_posted += 1

    def return_gradients(self) -> list[Optional[torch.Tensor]]:
        """Backward, second half: wait for the posted gradient transfers; returns the summed
        gradient for each tensor of ``sent_experts`` (``None`` where it went straight into Megatron
        DDP's ``main_grad``)."""
        if self._gradient_waves_posted != len(self.waves):
            raise RuntimeError(
                "LLEP weight exchange: the borrowed-weight gradients were never posted (the backward of "
                "the native experts' output did not run before that of the experts' input)"
            )
        for work in self._gradient_works:
            work.wait()
        incoming = self._gradients_in
        self._gradient_works, self._gradients_out, self._gradients_in = [], [], {}
        self._gradient_waves_posted = 0
        self.release_received()  # the step's backward is done with the borrowed weights
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


class _BorrowWave(torch.autograd.Function):
    """Identity on the native output; outputs one wave's received weights; backward posts their
    gradients."""

    @staticmethod
    def forward(ctx, native_output, tie, exchange: ExpertWeightExchange, wave: int):
        exchange.wait(wave)
        ctx.exchange, ctx.wave = exchange, wave
        received = [t for i in exchange.wave_receives[wave] for t in exchange.received[exchange.receives[i][0]]]
        return (native_output.view_as(native_output), *received)

    @staticmethod
    def backward(ctx, grad_native_output, *grad_received):
        ctx.exchange.post_gradients(ctx.wave, list(grad_received))
        return grad_native_output, None, None, None


class _ReturnBorrowedGradients(torch.autograd.Function):
    """Identity on the experts' input; backward completes the gradient return to the lent experts."""

    @staticmethod
    def forward(ctx, expert_input, exchange: ExpertWeightExchange, *lent):
        ctx.exchange = exchange
        return expert_input.view_as(expert_input)

    @staticmethod
    def backward(ctx, grad_expert_input):
        return (grad_expert_input, None, *ctx.exchange.return_gradients())
