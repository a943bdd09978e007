"""Borrowed experts kept for the optimizer step, and the one return of their gradients.

Weights do not change between the micro-batches of a step, so a helper keeps the experts it
received (:class:`KeptExperts`, one per LLEP layer and rank) and later micro-batches compute them
without a new copy. Their gradients accumulate on the helper in fp32 and go back to the native
rank once (:meth:`KeptLedger.flush_layer`): straight back from the native rank's node, and with
``relay_within_node`` from other nodes as a hierarchical sum in stripes, inside each node, across
the helper nodes, then into the native rank's node
(:func:`megatron_llep.planner.gradient_return_phases`).

Every EP rank records the same plans, so each holds the same :class:`KeptLedger` (which rank
keeps which expert of which layer, the bytes each rank spends, which layers have gradients to
return) and posts matching transfers without asking anyone.

When the gradients go back (the step's gradient reduction must see them):

* under Megatron DDP, behind the backward: the step's last backward (known when the earlier ones
  ran under ``no_sync``) posts only the first phase, and the return runs behind the backward of the
  layers below (:class:`GradientReturn`, one phase per LLEP layer's backward); when the last backward
  is not known (Megatron-LM without ``--overlap-grad-reduce`` sets no ``no_sync_func``, or a step of
  one micro-batch) the copies serve every micro-batch and return at ``finish_grad_sync``. Without
  overlapped grad reduce nothing reads the gradients before ``finish_grad_sync``; with it the
  expert buckets start reducing in one fixed order once their gradients are home
  (:class:`DeferredGradReady`, which also keeps data-parallel ranks with different routing in step);
* in loops without Megatron DDP, in the layer's backward when gradient sync is on (outside
  ``no_sync``) and no other forward of the layer awaits its backward;
* otherwise before Megatron DDP's ``start_grad_sync`` (``config.grad_sync_func`` of pipeline
  stages whose reduce starts after the last backward) or ``finish_grad_sync``
  (``finalize_model_grads``): :func:`megatron_llep.compat.mcore.hook_ddp_gradient_sync` watches
  them; :func:`finish_borrowed_gradients` does the same for other loops.

Copies are dropped after that return, and whenever the weights may change: a torch optimizer's
step (a global pre-hook, which also refuses to step while gradients are still away), a state-dict
load, a switch between training and evaluation, a placement change (:func:`drop_kept_experts`).
Under evaluation the copies stay across forwards until one of those, as long as each plan uses
them (a copy the next plan neither computes with nor relays from is dropped then). A rank that drops on its own
bumps its epoch; the next plan's count all-gather carries the epochs and every rank drops too.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any, Iterable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from megatron_llep.compat import mcore
from megatron_llep.experts import ExpertAdapter
from megatron_llep.planner import gradient_return_phases, stripe_bounds


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
        its parts are what the return sends (:func:`megatron_llep.planner.gradient_return_phases`)."""
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
        self.epoch = 0
        self._layers: list[weakref.ref] = []  # in construction order

    def register(self, layer: Any) -> None:
        self._layers.append(weakref.ref(layer))

    def layer_list(self) -> list:
        return [layer for layer in (ref() for ref in self._layers) if layer is not None]

    def held_for(self, layer: Any) -> Optional[np.ndarray]:
        held = self.held.get(layer)
        return held if held is not None and held.any() else None

    def room(self, copy_bytes: int, bound: Optional[int]) -> Optional[np.ndarray]:
        """How many more copies of ``copy_bytes`` each rank may keep (None: no bound)."""
        if bound is None:
            return None
        return np.maximum(bound - self.used, 0) // max(copy_bytes, 1)

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
                "their native ranks; run the step through Megatron's schedule with config.finalize_model_grads_func "
                "set, or call megatron_llep.finish_borrowed_gradients(model) after the last backward of the step")
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
    (:func:`megatron_llep.planner.gradient_return_phases`): each :meth:`advance` waits for the
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


_LEDGERS: dict[tuple[int, ...], KeptLedger] = {}


def ledger_for(group: dist.ProcessGroup) -> KeptLedger:
    """The ledger of an EP group, one per process group (all its LLEP layers share the byte bound)."""
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _LEDGERS or _LEDGERS[ranks].group is not group:  # a new group of these ranks: a fresh ledger
        _LEDGERS[ranks] = KeptLedger(group)
        _install_optimizer_hook()
        mcore.hook_ddp_gradient_sync(_count_no_sync, _before_ddp_sync, _after_ddp_built)
    return _LEDGERS[ranks]


# ---------------------------------------------------------------------- step boundaries
_SYNC_OFF_DEPTH = 0  # > 0 inside Megatron DDP's no_sync


def gradient_sync_on() -> bool:
    """Whether the backward running now is one that reduces gradients (not inside Megatron DDP's
    ``no_sync``, which Megatron's schedules enter for all but a step's last backward)."""
    return _SYNC_OFF_DEPTH == 0


def _count_no_sync(change: int) -> None:
    global _SYNC_OFF_DEPTH, _NO_SYNC_IN_STEP
    _SYNC_OFF_DEPTH += change
    _NO_SYNC_IN_STEP |= change > 0


# Whether no_sync was entered since the last gradient sync: a backward with sync on after it is then
# the step's last. (Megatron-LM sets no_sync_func only with overlapped grad reduce; without it every
# backward runs with sync on and which one is the last is not known.)
_NO_SYNC_IN_STEP = False


def last_backward_of_step() -> bool:
    """Whether the backward running now is known to be the step's last: gradient sync is on and
    earlier micro-batches of the step ran under ``no_sync``."""
    return gradient_sync_on() and _NO_SYNC_IN_STEP


@contextlib.contextmanager
def accumulating_gradients() -> Iterator[None]:
    """Backwards inside keep the kept experts' gradients on their helpers, as under Megatron DDP's
    ``no_sync``: for loops that accumulate gradients over micro-batches without Megatron DDP.
    Call :func:`finish_borrowed_gradients` on every rank after the step's last backward."""
    _count_no_sync(1)
    try:
        yield
    finally:
        _count_no_sync(-1)


def _dispatchers(modules: Optional[Iterable[Any]]) -> list:
    """The LLEP dispatchers of ``modules`` in module order (every EP rank builds the same layers in
    the same order, so they flush in the same order); ``None``: every LLEP layer of this process."""
    if modules is None:
        return [layer for ledger in _LEDGERS.values() for layer in ledger.layer_list()]
    from megatron_llep.layer import LLEPMoELayer  # the layer module imports this one

    return [m.token_dispatcher for module in modules if isinstance(module, torch.nn.Module)
            for m in module.modules() if isinstance(m, LLEPMoELayer)]


def finish_borrowed_gradients(model: Any = None) -> None:
    """Return every kept borrowed expert's gradient of ``model`` (a module, a list of model chunks,
    or ``None`` for every LLEP layer of this process) to its native rank and drop the copies.

    Runs by itself before Megatron DDP's ``start_grad_sync`` and ``finish_grad_sync`` (so through
    ``config.grad_sync_func`` and ``finalize_model_grads``); a loop that accumulates gradients
    some other way calls it after the step's last backward, before reducing gradients. Every EP
    rank must call it."""
    chunks = model if model is None or isinstance(model, (list, tuple)) else [model]
    for dispatcher in _dispatchers(chunks):
        if dispatcher.ledger.held_for(dispatcher) is not None or dispatcher in dispatcher.ledger.pending:
            dispatcher.flush_kept_gradients()


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


def _after_ddp_built(ddp_module: torch.nn.Module) -> None:
    """Under Megatron DDP the step's return of kept gradients runs behind the backward of the
    layers below (one phase per LLEP layer's backward) from the step's last backward when that is
    known (:func:`last_backward_of_step`), else at ``finish_grad_sync``. Without overlapped grad
    reduce nothing reads the experts' gradients before ``finish_grad_sync``; with it the expert
    buckets start reducing in a fixed order once their gradients are home (:class:`DeferredGradReady`)."""
    dispatchers = _dispatchers([ddp_module])
    deferred = None
    # at EP = 1 every expert is local: LLEP never changes the backward (and experts share the dense buckets)
    if ddp_module.ddp_config.overlap_grad_reduce and dispatchers and dispatchers[0].ledger.ep_size > 1:
        deferred = DeferredGradReady(dispatchers)
        grouped = mcore.intercept_grad_ready(ddp_module, deferred.position, deferred.intercept)
        others = [name for name, param in ddp_module.named_parameters() if param in grouped and param not in deferred.position]
        if others:
            raise ValueError(f"LLEP with overlapped grad reduce: {others[0]} shares a gradient bucket with LLEP experts "
                             "but is not in an LLEP layer; make every MoE layer an LLEP layer (megatron_llep.with_llep) "
                             "or turn overlap_grad_reduce off")
    ddp_module._llep_deferred_grad_ready = deferred
    for dispatcher in dispatchers:
        dispatcher.return_behind_backward = True
        dispatcher.deferred_grad_ready = deferred


def _before_ddp_sync(ddp_module: torch.nn.Module) -> None:
    global _NO_SYNC_IN_STEP
    _NO_SYNC_IN_STEP = False
    if any(ledger.held or ledger.pending for ledger in _LEDGERS.values()):
        finish_borrowed_gradients(ddp_module)
    deferred = getattr(ddp_module, "_llep_deferred_grad_ready", None)
    if deferred is not None:
        deferred.end_step()


_OPTIMIZER_HOOK = None


def _install_optimizer_hook() -> None:
    global _OPTIMIZER_HOOK
    if _OPTIMIZER_HOOK is None:
        _OPTIMIZER_HOOK = register_optimizer_step_pre_hook(_before_optimizer_step)


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    for ledger in _LEDGERS.values():
        ledger.invalidate("an optimizer step began")


def drop_kept_experts(reason: str = "the expert weights changed") -> None:
    """Drop every kept borrowed expert on this rank (call on every rank when expert weights
    change outside an optimizer step, e.g. a placement change); the next plan's epoch check
    makes the other EP ranks drop theirs too."""
    for ledger in _LEDGERS.values():
        ledger.invalidate(reason)
