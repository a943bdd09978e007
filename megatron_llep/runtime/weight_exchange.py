"""Borrowed expert weights: native -> helper in forward, their gradients helper -> native in backward.

Forward: :meth:`ExpertWeightExchange.start` posts the P2P sends/receives on a communicator of their
own (:func:`megatron_llep.runtime.state.weight_exchange_group`) before the token all-to-all, one batch per wave
(:func:`megatron_llep.planning.plan.copy_waves`: each helper's first copy, its second, then 2, 4 ...); the
native experts run while they travel; :meth:`finish_wave` then waits for one wave and hands out its
weights through an autograd function, so the helper computes a wave's experts while the later
waves are still on the wire.

Backward: each borrowed weight's gradient goes back to the native rank, which adds it to the
native expert's gradient — into ``main_grad`` directly under Megatron DDP (its hooks may already
be ignoring ``param.grad`` for fused wgrad), otherwise into ``param.grad`` through autograd. The
wave nodes (:meth:`finish_wave`, chained, so they run last wave first on every rank) post each
wave's transfers as soon as its borrowed experts' backward is done; the node on the experts' input
(:meth:`LLEPTokenDispatcher.attach_gradient_return`, through :meth:`return_gradients`) waits for
them after the native experts' backward. So the transfers overlap the
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

from megatron_llep.planning.plan import RankPlan
from megatron_llep.runtime.experts import ExpertAdapter
from megatron_llep.runtime.kept_weights import KeptExperts


def _alive(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` belongs to the process group now running (a process may destroy it and start
    another, e.g. to run again)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


class ExpertWeightExchange:
    """The weight transfers of one rank for one layer step (one micro-batch's forward and
    backward): copies this rank sends (as native rank, or as the keeper that relays one inside
    its node), copies it receives, the kept copies it computes with, and the per-micro-batch
    gradient return of the copies that are not kept (:mod:`megatron_llep.runtime.kept_weights` returns
    the kept ones once per step)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        adapter: ExpertAdapter,
        first_local_expert: int,
        rank_plan: RankPlan,
        device: torch.device,
        kept: Optional[KeptExperts] = None,
        kept_pairs: frozenset = frozenset(),
    ) -> None:
        self.group = group
        self.adapter = adapter
        self.first_local_expert = first_local_expert
        self.rank = rank_plan.rank
        self.kept = kept if kept is not None else KeptExperts()
        self.sends = list(rank_plan.weights_to_send)
        self.receives = list(rank_plan.weights_to_receive)
        self.held = list(getattr(rank_plan, "held_experts", []))
        # a kept copy's gradient stays on its helper until the step's return; the others come back now
        self.send_kept = [(expert, helper) in kept_pairs for expert, helper in self.sends]
        self.receive_kept = [(expert, self.rank) in kept_pairs for expert, _ in self.receives]
        # this rank's waves, ascending: the order every rank posts (and its layer computes) them in
        self.waves = sorted(set(rank_plan.send_waves) | set(rank_plan.receive_waves))
        # per wave: positions in ``sends`` and in ``receives`` (slot order)
        self.wave_sends = {w: [i for i, sw in enumerate(rank_plan.send_waves) if sw == w] for w in self.waves}
        self.wave_receives = {w: [i for i, rw in enumerate(rank_plan.receive_waves) if rw == w]
                              for w in self.waves}
        receive_wave = dict(zip((e for e, _ in self.receives), rank_plan.receive_waves))
        # a wave that relays a copy received in an earlier wave of this step is posted once that arrived
        self.wave_needs = {w: max([receive_wave.get(self.sends[i][0], -1) for i in self.wave_sends[w]], default=-1)
                           for w in self.waves}
        self.sent_experts = sorted({expert for expert, _ in self.sends if self._is_native(expert)})
        self.specs = adapter.tensor_specs()
        self.device = device
        self.received: dict[int, list[torch.Tensor]] = {}
        for (expert, _), keep in zip(self.receives, self.receive_kept):
            buffers = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.specs]
            self.received[expert] = buffers
            if keep:
                self.kept.weights[expert] = buffers  # valid once its wave is waited for
        self._pending: dict[int, list] = {}
        self._posted_waves: set[int] = set()
        self._posted = False
        # backward: pending transfers, gradients being sent (kept alive), received gradients per lent expert
        self._gradient_works: list = []
        self._gradients_out: list[torch.Tensor] = []
        self._gradients_in: dict[int, list[list[torch.Tensor]]] = {}
        self._late_receives: list[tuple[int, int]] = []  # (expert, helper) whose gradient receive waits
        self._gradient_waves_posted = 0

    @property
    def active(self) -> bool:
        return bool(self.sends or self.receives or self.held)

    def _is_native(self, expert: int) -> bool:
        return 0 <= expert - self.first_local_expert < self.adapter.num_local_experts

    def _peer(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def _source_tensors(self, expert: int) -> list[torch.Tensor]:
        """What a copy of ``expert`` is sent from: the native weights, or this rank's kept copy."""
        if self._is_native(expert):
            return [t.detach().contiguous() for t in self.adapter.expert_tensors(expert - self.first_local_expert)]
        return self.kept.weights[expert]

    def start(self) -> None:
        """Post the weight sends and receives without waiting, one batch per wave, in ascending
        waves, up to the first wave that relays a copy still on its way here (call before the token
        all-to-all). Once per step: a recomputed forward reuses the weights already received."""
        if self._posted:
            return
        self._posted = True
        self._post_ready()

    def _post_ready(self) -> None:
        for wave in self.waves:
            if wave in self._posted_waves:
                continue
            needs = self.wave_needs[wave]
            if needs >= 0 and needs in self._pending:  # its relayed copy has not been waited for yet
                return
            self._posted_waves.add(wave)
            ops = []
            for i in self.wave_sends[wave]:
                expert, helper = self.sends[i]
                for tensor in self._source_tensors(expert):
                    ops.append(dist.P2POp(dist.isend, tensor, self._peer(helper), self.group))
            for i in self.wave_receives[wave]:
                expert, source = self.receives[i]
                for buffer in self.received[expert]:
                    ops.append(dist.P2POp(dist.irecv, buffer, self._peer(source), self.group))
            self._pending[wave] = dist.batch_isend_irecv(ops)

    def finish_wave(self, wave: int, native_output: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Wait for one wave of weights (call for each of :attr:`waves` in order, after the native
        experts and the held ones ran, chaining ``native_output`` through); returns it (pass it on)
        and the wave's borrowed experts' tensors in slot order, connected to autograd.

        In backward each wave's node runs as soon as its borrowed experts' weight gradients exist
        (last wave first): it posts the return of the copies that are not kept without waiting,
        adds the kept ones to their accumulators, and :meth:`attach`'s node completes it."""
        return self._borrow(wave, native_output)

    def finish_held(self, native_output: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """The kept copies this step computes with (slots right after the native ones)."""
        return self._borrow(HELD_WAVE, native_output)

    def _borrow(self, wave: int, native_output: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        # Tie the outputs to a native parameter so that every rank's borrowed weights require grad
        # exactly when its expert parameters do (a rank that only receives has no other input).
        tie = self.adapter.expert_tensors(0)[0]
        outputs = _BorrowWave.apply(native_output, tie, self, wave)
        anchor_out, flat = outputs[0], outputs[1:]
        per_expert = len(self.specs)
        borrowed = [list(flat[i * per_expert : (i + 1) * per_expert]) for i in range(len(flat) // per_expert)]
        return anchor_out, borrowed

    def wave_tensors(self, wave: int) -> list[torch.Tensor]:
        if wave == HELD_WAVE:
            return [t for expert in self.held for t in self.kept.weights[expert]]
        self.wait(wave)
        return [t for i in self.wave_receives[wave] for t in self.received[self.receives[i][0]]]

    def release_received(self) -> None:
        """Drop this exchange's references to the received weights (after their last use: the end
        of the step's backward, or of a forward that no backward or recompute follows). Autograd
        keeps what it saved for the borrowed GEMMs' backward, the kept copies stay in
        :class:`KeptExperts`; the rest is freed now rather than when the next step replaces this
        exchange."""
        self.received = {}

    def wait(self, wave: int) -> None:
        for work in self._pending.pop(wave, []):
            work.wait()
        self._post_ready()  # a relay forwards what just arrived

    def post_gradients(self, wave: int, grads: list[Optional[torch.Tensor]]) -> None:
        """Backward, first half: the gradients of the wave's borrowed weights (``grads`` in slot
        order): a kept copy's into its accumulator, the others posted to the rank they came from;
        and the receives of the gradients of the copies this rank sent in that wave and that are
        not kept (on a rank that only lends in this layer, in :meth:`return_gradients`)."""
        per_expert = len(self.specs)
        if wave == HELD_WAVE:
            for k, expert in enumerate(self.held):
                self.kept.accumulate(expert, grads[k * per_expert : (k + 1) * per_expert])
            self._gradient_waves_posted += 1
            return
        ops = []
        for k, i in enumerate(self.wave_receives[wave]):
            expert, source = self.receives[i]
            mine = grads[k * per_expert : (k + 1) * per_expert]
            if self.receive_kept[i]:
                self.kept.accumulate(expert, mine)
                continue
            for j, (shape, dtype) in enumerate(self.specs):
                grad = mine[j]
                grad = torch.zeros(shape, dtype=dtype, device=self.device) if grad is None else grad.contiguous()
                self._gradients_out.append(grad)
                ops.append(dist.P2POp(dist.isend, grad, self._peer(source), self.group))
        for i in self.wave_sends[wave]:
            if self.send_kept[i]:
                continue
            if not self.receives:  # a lender only: its receives wait until its native experts' backward is done
                self._late_receives.append(self.sends[i])
                continue
            ops += self._gradient_receives(*self.sends[i])
        if ops:
            self._gradient_works.extend(dist.batch_isend_irecv(ops))
        self._gradient_waves_posted += 1

    def _gradient_receives(self, expert: int, helper: int) -> list:
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self.specs]
        self._gradients_in.setdefault(expert, []).append(buffers)
        return [dist.P2POp(dist.irecv, buffer, self._peer(helper), self.group) for buffer in buffers]

    @property
    def _backward_waves(self) -> int:
        return len(self.waves) + (1 if self.held else 0)

    def return_gradients(self) -> list[Optional[torch.Tensor]]:
        """Backward, second half: wait for the posted gradient transfers; returns the summed
        gradient for each tensor of ``sent_experts`` (``None`` where it went straight into Megatron
        DDP's ``main_grad``). Gradients of copies this rank relayed from its kept copy go into that
        copy's accumulator."""
        if self._gradient_waves_posted != self._backward_waves:
            raise RuntimeError(
                "LLEP weight exchange: the borrowed-weight gradients were never posted (the backward of "
                "the native experts' output did not run before that of the experts' input)"
            )
        if self._late_receives:
            # Posted only now, after this rank's native experts' backward, so that their buffers are
            # not alive through it (the hot rank's peak). Only a rank that sends no gradients in
            # this layer defers: no send of its own can wait behind these receives (NCCL runs a
            # rank's transfers in order), and per pair they keep the order of the helpers' sends.
            ops = [op for expert, helper in self._late_receives for op in self._gradient_receives(expert, helper)]
            self._gradient_works.extend(dist.batch_isend_irecv(ops))
            self._late_receives = []
        for work in self._gradient_works:
            work.wait()
        incoming = self._gradients_in
        self._gradient_works, self._gradients_out, self._gradients_in = [], [], {}
        self._gradient_waves_posted = 0
        self.release_received()  # the step's backward is done with the borrowed weights
        for expert, parts in incoming.items():
            if not self._is_native(expert):
                for part in parts:
                    self.kept.accumulate(expert, part)
        per_expert = len(self.specs)
        result: list[Optional[torch.Tensor]] = []
        for expert in self.sent_experts:
            main_grads = self.adapter.main_grads(expert - self.first_local_expert)
            parts_per_helper = incoming.get(expert, [])
            for j in range(per_expert):
                parts = [helper[j] for helper in parts_per_helper]
                if main_grads[j] is not None:
                    # one add per helper, in main_grad's dtype (fp32 under DDP), as stock EP adds the
                    # native GEMM's gradient: no bf16 sum of partial gradients first
                    for part in parts:
                        main_grads[j].add_(part)
                    result.append(None)
                elif not parts:
                    result.append(None)  # every copy of it is kept: its gradient returns with the step's
                else:
                    total = parts[0].float()
                    for part in parts[1:]:
                        total = total + part.float()
                    result.append(total.to(parts[0].dtype))
        return result


HELD_WAVE = -1  # the pseudo-wave of the kept copies a step computes with (no transfer)


class _BorrowWave(torch.autograd.Function):
    """Identity on the native output; outputs one wave's received weights; backward posts their
    gradients."""

    @staticmethod
    def forward(ctx, native_output, tie, exchange: ExpertWeightExchange, wave: int):
        ctx.exchange, ctx.wave = exchange, wave
        return (native_output.view_as(native_output), *exchange.wave_tensors(wave))

    @staticmethod
    def backward(ctx, grad_native_output, *grad_received):
        ctx.exchange.post_gradients(ctx.wave, list(grad_received))
        return grad_native_output, None, None, None
