"""Borrowed experts kept for the optimizer step, and the one return of their gradients.

Weights do not change between the micro-batches of a step, so a helper keeps the experts it
received (:class:`KeptExperts`, one per LLEP layer and rank) and later micro-batches compute them
without a new copy. Their gradients accumulate on the helper in fp32 and go back to the native
rank once (:meth:`KeptLedger.flush_layer`): straight back from the native rank's node, and with
``relay_within_node`` from other nodes as a hierarchical sum in stripes, inside each node, across
the helper nodes, then into the native rank's node
(:func:`megatron_llep.planning.gradient_return.gradient_return_phases`).

Every EP rank records the same plans, so each holds the same :class:`KeptLedger` (which rank
keeps which expert of which layer, the bytes each rank spends, which layers have gradients to
return) and posts matching transfers without asking anyone.

When the gradients go back, and the step boundaries that decide it: :mod:`megatron_llep.runtime.state`.
Under evaluation the copies stay across forwards until one of those, as long as each plan uses
them (a copy the next plan neither computes with nor relays from is dropped then). A rank that drops on its own
bumps its epoch; the next plan's count all-gather carries the epochs and every rank drops too.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from megatron_llep.compat.torch_api import all_gather_single
from megatron_llep.config import KEEP_AUTO
from megatron_llep.planning.gradient_return import gradient_return_phases, stripe_bounds
from megatron_llep.runtime.experts import ExpertAdapter


SPARE_FRACTION = 4
"""``"auto"`` keeps copies in at most 1 / SPARE_FRACTION of the memory a GPU can spare: the rest is
left to the activations of the step, which grow after the first plan reads the memory."""


def spare_bytes(device: torch.device) -> int:
    """What a GPU rank may spend on kept copies under ``"auto"`` (``LLEPConfig.max_kept_weight_bytes``),
    read at its first training plan: a quarter of the driver's free memory plus what torch's
    allocator holds unused. (The other half of ``"auto"``, one copy per rank and LLEP layer, is what
    a step's balance needs when every layer is skewed: :meth:`KeptLedger.room`.)"""
    free, _ = torch.cuda.mem_get_info(device)
    return (free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)) // SPARE_FRACTION


class KeptExperts:
    """The borrowed experts one rank keeps for one LLEP layer: their weights and fp32 gradient
    accumulators (allocated on the first gradient)."""

    def __init__(self) -> None:
        self.weights: dict[int, list[torch.Tensor]] = {}
        self.gradients: dict[int, torch.Tensor] = {}

    def accumulate(self, expert: int, grads: list[Optional[torch.Tensor]]) -> None:
        if expert not in self.weights:
            raise RuntimeError(f"LLEP: a gradient arrived for expert {expert}, which this rank does not keep")
        for total, grad in zip(self.gradient(expert), grads):
            if grad is not None:
                total.add_(grad)

    def flat_gradient(self, expert: int) -> torch.Tensor:
        """The accumulated gradient as one flat fp32 tensor (zeros if no backward used the copy):
        its parts are what the return sends (:func:`megatron_llep.planning.gradient_return.gradient_return_phases`)."""
        if expert not in self.gradients:
            weights = self.weights[expert]
            self.gradients[expert] = torch.zeros(sum(w.numel() for w in weights), dtype=torch.float32,
                                                 device=weights[0].device)
        return self.gradients[expert]

    def gradient(self, expert: int) -> list[torch.Tensor]:
        """The accumulated gradient, one view of :meth:`flat_gradient` per weight tensor."""
        return _views(self.flat_gradient(expert), [w.shape for w in self.weights[expert]])

    def clear(self) -> None:
        self.weights, self.gradients = {}, {}


class KeptLedger:
    """Which EP rank keeps which borrowed expert of which LLEP layer (the same on every rank of
    the EP group), with each rank's bytes spent on kept experts over all layers."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ep_size = group.size()
        self.rank = group.rank()
        self.held: dict[Any, np.ndarray] = {}  # layer (its dispatcher) -> bool [N, P]
        self.pending: set = set()  # layers whose kept experts took part in a backward-bound forward
        self.returning: dict[Any, GradientReturn] = {}  # layers whose return is under way
        self.used = np.zeros(self.ep_size, np.int64)
        self.auto_bounds: Optional[np.ndarray] = None  # every GPU rank's spare bytes, gathered at the first plan
        self.epoch = 0
        self._layers: list[weakref.ref] = []  # in construction order

    def register(self, layer: Any) -> None:
        self._layers.append(weakref.ref(layer))

    def layer_list(self) -> list:
        return [layer for layer in (ref() for ref in self._layers) if layer is not None]

    def held_for(self, layer: Any) -> Optional[np.ndarray]:
        held = self.held.get(layer)
        return held if held is not None and held.any() else None

    def room(self, layer: Any, copy_bytes: int, bound: Union[int, str, None], device: torch.device) -> Optional[np.ndarray]:
        """How many more copies of ``copy_bytes`` each rank may keep for ``layer`` under ``bound``
        (``LLEPConfig.max_kept_weight_bytes``; None: no bound). ``"auto"``: one copy per rank and
        LLEP layer, and on a GPU within the bytes the rank can spare (:func:`spare_bytes`)."""
        if bound is None:
            return None
        if bound != KEEP_AUTO:
            return np.maximum(bound - self.used, 0) // max(copy_bytes, 1)
        held = self.held.get(layer)
        room = np.maximum(1 - (held.sum(axis=0) if held is not None else np.zeros(self.ep_size, np.int64)), 0)
        spare = self.spare_bytes(device)
        return room if spare is None else np.minimum(room, np.maximum(spare - self.used, 0) // max(copy_bytes, 1))

    def spare_bytes(self, device: torch.device) -> Optional[np.ndarray]:
        """Every rank's :func:`spare_bytes` (None on CPU ranks), all-gathered at the first plan that
        asks (every EP rank asks at the same plan, and then prices every rank's room alike)."""
        if device.type != "cuda":
            return None
        if self.auto_bounds is None:
            gathered = torch.zeros(self.ep_size, dtype=torch.long, device=device)
            all_gather_single(gathered, torch.tensor([spare_bytes(device)], dtype=torch.long, device=device),
                              group=self.group)
            self.auto_bounds = gathered.cpu().numpy()
        return self.auto_bounds

    def record(self, layer: Any, plan, copy_bytes: int, drop_unused: bool = False) -> None:
        """Add ``plan``'s kept copies (``LLEPPlan.transfer_kept``) to the ledger. ``drop_unused``
        (evaluation, where copies outlive the step) first drops the layer's copies this plan
        neither computes with nor relays from, so the copies kept stay those of one plan."""
        held = self.held.get(layer)
        if drop_unused and held is not None:
            used = np.zeros_like(held)
            used[plan.chunk_expert, plan.chunk_dst] = True
            used[plan.transfer_expert, plan.transfer_source] = True
            for expert, rank in zip(*np.nonzero(held & ~used)):
                self.used[rank] -= copy_bytes
                if rank == self.rank:
                    layer.kept.weights.pop(int(expert), None)
                    layer.kept.gradients.pop(int(expert), None)
            held &= used
        kept = getattr(plan, "transfer_kept", None)
        if kept is None or not np.any(kept):
            return
        if held is None:
            held = self.held[layer] = np.zeros((plan.num_experts, self.ep_size), bool)
        experts, helpers = plan.transfer_expert[kept], plan.transfer_helper[kept]
        held[experts, helpers] = True
        np.add.at(self.used, helpers, copy_bytes)

    def mark_pending(self, layer: Any) -> None:
        if self.held_for(layer) is not None:
            self.pending.add(layer)

    def forget_layer(self, layer: Any, copy_bytes: int) -> None:
        held = self.held.pop(layer, None)
        if held is not None:
            self.used -= held.sum(axis=0) * copy_bytes
        self.pending.discard(layer)
        layer.kept.clear()

    def drop_all(self, reason: str) -> None:
        """Drop every kept copy of every layer (weights may have changed); refuses while kept
        gradients are still away from their native ranks."""
        if self.pending:
            names = ", ".join(str(getattr(layer, "layer_number", "?")) for layer in self.pending)
            raise RuntimeError(
                f"LLEP: {reason} while gradients of borrowed experts (MoE layers {names}) have not been returned to "
                "their native ranks (a forward of those layers has not run its backward, or the step's backwards "
                "ran under no_sync); call megatron_llep.finish_borrowed_gradients(model) on every rank after the "
                "step's last backward, or run the step through Megatron's schedule with "
                "config.finalize_model_grads_func set")
        for layer in list(self.held):
            self.forget_layer(layer, layer.kept_copy_bytes)
        for layer in self.layer_list():
            layer.kept.clear()
        self.used[:] = 0

    def invalidate(self, reason: str) -> None:
        """The expert weights may change: drop every kept copy (see :meth:`drop_all`) and bump this
        rank's epoch, which the next plan's all-gather compares across the EP group."""
        if self.held or self.pending:
            self.drop_all(reason)
            self.epoch += 1

    # ------------------------------------------------------------------ gradient return
    def start_return(self, layer: Any, adapter: ExpertAdapter, first_local_expert: int,
                     ranks_per_node: Optional[int], relay: bool) -> Optional["GradientReturn"]:
        """Post the first phase of the return of ``layer``'s kept experts' gradients (see
        :class:`GradientReturn`); ``None`` when the layer keeps nothing."""
        held = self.held.get(layer)
        if held is None:
            self.pending.discard(layer)
            return None
        returning = GradientReturn(self, layer, held, adapter, first_local_expert, ranks_per_node, relay)
        self.returning[layer] = returning
        returning.advance()
        return returning

    def flush_layer(self, layer: Any, adapter: ExpertAdapter, first_local_expert: int,
                    ranks_per_node: Optional[int], relay: bool) -> dict[int, list[torch.Tensor]]:
        """Return the kept experts' gradients of ``layer`` to their native ranks now (finishing a
        return already under way) and drop the copies. Returns, on a native rank, the fp32 sums
        per lent local expert (added into ``main_grad`` by the caller or returned through autograd)."""
        returning = self.returning.get(layer) or self.start_return(layer, adapter, first_local_expert,
                                                                     ranks_per_node, relay)
        return returning.finish() if returning is not None else {}

    def progress_returns(self) -> list[tuple[Any, dict[int, list[torch.Tensor]]]]:
        """Move every return under way on by one phase (every EP rank calls this at the same
        points: the backward of each LLEP layer); returns ``(layer, sums)`` of those that ended."""
        ended = []
        for layer, returning in list(self.returning.items()):
            if returning.advance():
                ended.append((layer, returning.finish()))
        return ended


class GradientReturn:
    """One layer's return of its kept experts' gradients, phase by phase
    (:func:`megatron_llep.planning.gradient_return.gradient_return_phases`): each :meth:`advance` waits for the
    phase posted last, adds what arrived, and posts the next, so the phases can run behind the
    backward of the layers below; :meth:`finish` runs the rest. A rank sums into its helpers'
    accumulators, into one fp32 gradient per lent expert on the native rank, and elsewhere into
    its stripe of the expert (the part it sums for its node)."""

    def __init__(self, ledger: KeptLedger, layer: Any, held: np.ndarray, adapter: ExpertAdapter,
                 first_local_expert: int, ranks_per_node: Optional[int], relay: bool) -> None:
        self.ledger, self.layer, self.first_local_expert = ledger, layer, first_local_expert
        self.local = adapter.num_local_experts
        self.shapes = [shape for shape, _ in adapter.tensor_specs()]
        self.numel = sum(math.prod(shape) for shape in self.shapes)
        per_node = min(ranks_per_node or ledger.ep_size, ledger.ep_size)
        self.stripe = stripe_bounds(0, self.numel, per_node)[ledger.rank % per_node:][:2]
        self.device = _device(adapter)
        # phases without transfers are the same on every rank: skipped alike
        self.phases = [phase for phase in gradient_return_phases(held, self.local, self.numel, per_node, relay) if phase]
        self.posted = 0  # phases posted so far
        self.works: list = []
        self.into: list[tuple[int, int, int, torch.Tensor]] = []
        self.sums: dict[int, tuple[int, torch.Tensor]] = {}  # expert -> (first element, the part this rank adds into)

    def _part(self, expert: int, lo: int, hi: int) -> torch.Tensor:
        kept = self.layer.kept
        if expert in kept.weights:
            return kept.flat_gradient(expert)[lo:hi]
        if expert not in self.sums:
            native = expert // self.local == self.ledger.rank
            first, last = (0, self.numel) if native else self.stripe
            self.sums[expert] = (first, torch.zeros(last - first, dtype=torch.float32, device=self.device))
        first, total = self.sums[expert]
        return total[lo - first:hi - first]

    def advance(self) -> bool:
        """Wait for the phase posted last, add what it brought, post the next (one phase per call
        on every rank, with or without transfers of its own, so that all ranks post their
        transfers between the same pairs in the same order); True once the last has arrived."""
        for work in self.works:
            work.wait()
        for expert, lo, hi, buffer in self.into:
            if expert not in self.sums and expert not in self.layer.kept.weights and (lo, hi) == (0, self.numel):
                self.sums[expert] = (0, buffer)  # the first whole gradient is the sum: no zero-filled one beside it
            else:
                self._part(expert, lo, hi).add_(buffer)
        self.works, self.into = [], []
        if self.posted == len(self.phases):
            return True
        group, rank, ops = self.ledger.group, self.ledger.rank, []
        for expert, source, target, lo, hi in self.phases[self.posted]:
            if source == rank:
                ops.append(dist.P2POp(dist.isend, self._part(expert, lo, hi), dist.get_global_rank(group, target), group))
            elif target == rank:
                buffer = torch.empty(hi - lo, dtype=torch.float32, device=self.device)
                self.into.append((expert, lo, hi, buffer))
                ops.append(dist.P2POp(dist.irecv, buffer, dist.get_global_rank(group, source), group))
        self.posted += 1
        if ops:
            self.works = dist.batch_isend_irecv(ops)
        return False

    def finish(self) -> dict[int, list[torch.Tensor]]:
        """Run the phases left, drop the layer's copies; the fp32 sums per lent local expert on a
        native rank."""
        while not self.advance():
            pass
        self.ledger.returning.pop(self.layer, None)
        self.ledger.forget_layer(self.layer, self.layer.kept_copy_bytes)
        return {expert - self.first_local_expert: _views(total, self.shapes)
                for expert, (_, total) in self.sums.items() if expert // self.local == self.ledger.rank}


def _views(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    return [piece.view(shape) for piece, shape in zip(flat.split([math.prod(s) for s in shapes]), shapes)]


def _device(adapter: ExpertAdapter) -> torch.device:
    return adapter.expert_tensors(0)[0].device


def add_returned_gradients(adapter: ExpertAdapter, returned: dict[int, list[torch.Tensor]]) -> list:
    """Add flushed fp32 sums into Megatron DDP's ``main_grad`` of the lent experts; those without
    a ``main_grad`` (no DDP) are returned as ``(local expert, grads)`` for ``param.grad``."""
    rest = []
    for local_expert, sums in sorted(returned.items()):
        main_grads = adapter.main_grads(local_expert)
        if all(g is not None for g in main_grads):
            for main_grad, total in zip(main_grads, sums):
                main_grad.add_(total)
        else:
            rest.append((local_expert, sums))
    return rest


def add_returned_outside_autograd(adapter: ExpertAdapter, returned: dict[int, list[torch.Tensor]]) -> None:
    """Add flushed fp32 sums into ``main_grad``, or into ``param.grad`` where there is none: for a
    return that ends where no autograd node of the lent experts can carry them."""
    for local_expert, sums in add_returned_gradients(adapter, returned):
        add_to_param_grads(adapter, local_expert, sums)


def add_to_param_grads(adapter: ExpertAdapter, local_expert: int, sums: list[torch.Tensor]) -> None:
    """Add returned fp32 sums into a lent expert's ``param.grad`` (no DDP ``main_grad``), outside
    autograd: where no autograd node of this micro-batch can carry them."""
    for param, total in zip(adapter.expert_tensors(local_expert), sums):
        part = total.to(param.dtype)
        param.grad = part if param.grad is None else param.grad + part


class DeferredGradReady:
    """The order in which one Megatron DDP module's expert buckets start reducing, kept the same on
    every data-parallel rank while LLEP changes the backward.

    With overlapped grad reduce, each parameter's backward hook calls ``register_grad_ready`` and a
    bucket group starts its reduce once all of its parameters did. Data-parallel ranks must start
    them in the same order (their collectives pair up in order), but LLEP's backward differs
    between them with their routing: lent experts' hooks wait for the gradient-return node, and a
    native expert's gradient is final only once its helpers' kept gradients arrived, which,
    returned behind the backward, is after its hook. So in the step's last backward every call of
    the module's expert bucket groups waits here and goes through in one fixed order: layer by
    layer from the top, each layer's experts' tensors in order, a layer once it is complete (the
    backward reached an LLEP layer below it) and its kept gradients are home (:meth:`release`,
    at each LLEP layer's backward and before DDP's own sync)."""

    def __init__(self, layers: list) -> None:
        self.layers = list(reversed(layers))  # the module's LLEP dispatchers, in backward order
        self.position: dict[torch.nn.Parameter, tuple[int, int]] = {}
        for depth, layer in enumerate(self.layers):
            tensors = [t for local in range(layer.num_local_experts) for t in layer.adapter.expert_tensors(local)]
            self.position.update({tensor: (depth, index) for index, tensor in enumerate(tensors)})
        self.waiting: list[dict[int, Any]] = [{} for _ in self.layers]
        self.released = 0  # layers (from the top) released in this step

    def intercept(self, register, param: torch.nn.Parameter, last_microbatch: bool) -> None:
        if not last_microbatch:
            register()  # DDP only counts the last micro-batch's calls
            return
        depth, index = self.position[param]
        self.waiting[depth][index] = register

    def release(self, below: Any = None) -> None:
        """Let the waiting calls of the layers above LLEP layer ``below`` (None: of every layer)
        through, in order, up to the first layer whose kept gradients are still away."""
        stop = self.layers.index(below) if below is not None else len(self.layers)
        while self.released < stop and not _gradients_away(self.layers[self.released]):
            waiting = self.waiting[self.released]
            for index in sorted(waiting):
                waiting.pop(index)()
            self.released += 1

    def end_step(self) -> None:
        """Before DDP's gradient sync, with every return finished: the rest, and a new step."""
        self.release()
        if self.released < len(self.layers) or any(self.waiting):
            raise RuntimeError("LLEP: a native expert's gradient is still away at Megatron DDP's gradient sync "
                               "(kept_weights.DeferredGradReady); please report this as a bug")
        self.released = 0


def _gradients_away(dispatcher: Any) -> bool:
    """Whether kept gradients of the layer have still to reach their native ranks."""
    return dispatcher in dispatcher.ledger.pending or dispatcher in dispatcher.ledger.returning
