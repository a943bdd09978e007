"""The LLEP runtime's process-wide state and the step boundaries it watches, in one place.

State: the kept-copy ledger of each EP group (:func:`ledger_for`), the communicator of each EP
group's weight copies (:func:`weight_exchange_group`), the per-layer statistics (:data:`STATS`), and
where the step stands: inside Megatron DDP's ``no_sync`` or :func:`accumulating_gradients`, and
whether the backward running now is the step's last.

When the kept copies' gradients go back (the step's gradient reduction must see them):

* under Megatron DDP, behind the backward: the step's last backward (known when the earlier ones
  ran under ``no_sync``) posts only the first phase, and the return runs behind the backward of the
  layers below (:class:`~megatron_llep.runtime.kept_weights.GradientReturn`, one phase per LLEP
  layer's backward); when the last backward is not known (Megatron-LM without
  ``--overlap-grad-reduce`` sets no ``no_sync_func``, or a step of one micro-batch) the copies serve
  every micro-batch and return at ``finish_grad_sync``. With overlapped grad reduce the expert
  buckets start reducing in one fixed order once their gradients are home
  (:class:`~megatron_llep.runtime.kept_weights.DeferredGradReady`);
* in loops without Megatron DDP, in the layer's backward when gradient sync is on (outside
  ``no_sync``) and no other forward of the layer awaits its backward, and when
  :func:`accumulating_gradients` ends;
* otherwise before Megatron DDP's ``start_grad_sync`` (``config.grad_sync_func`` of pipeline
  stages) or ``finish_grad_sync`` (``finalize_model_grads``), watched through
  :func:`megatron_llep.compat.mcore.hook_ddp_gradient_sync`, or at :func:`finish_borrowed_gradients`.

Copies are dropped after that return and whenever the weights may change: a torch optimizer's step
(a global pre-hook, which refuses to step while gradients are still away), a state-dict load, a
switch between training and evaluation, a placement change (:func:`drop_kept_experts`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from megatron_llep.compat import mcore
from megatron_llep.runtime.kept_weights import DeferredGradReady, KeptLedger
from megatron_llep.runtime.statistics import LLEPStatsTracker

STATS = LLEPStatsTracker()
"""Every LLEP layer's step statistics in this process, for loggers to drain."""


_WEIGHT_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def weight_exchange_group(ep_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A communicator over the same ranks as ``ep_group``, one per EP group and process. Created
    by the group's members only (``use_local_synchronization``), when their first LLEP layer is
    built: every member builds the same layers, so they all get here together.

    Its first operation is an all-reduce of all members: a batched P2P that is a communicator's
    first operation must include all its ranks (``torch.distributed.batch_isend_irecv``; under NCCL
    the lazy communicator set-up would hang), and a step's weight copies involve only some."""
    ranks = tuple(dist.get_process_group_ranks(ep_group))
    if ranks not in _WEIGHT_GROUPS or not _alive(_WEIGHT_GROUPS[ranks]):  # one of a destroyed process group: anew
        group = dist.new_group(list(ranks), use_local_synchronization=True)
        on_gpu = "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        _WEIGHT_GROUPS[ranks] = group
    return _WEIGHT_GROUPS[ranks]


def _alive(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` belongs to the process group now running (a process may destroy it and start
    another, e.g. to run again)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


_LEDGERS: dict[tuple[int, ...], KeptLedger] = {}


def ledger_for(group: dist.ProcessGroup) -> KeptLedger:
    """The ledger of an EP group, one per process group (all its LLEP layers share the byte bound)."""
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _LEDGERS or _LEDGERS[ranks].group is not group:  # a new group of these ranks: a fresh ledger
        _LEDGERS[ranks] = KeptLedger(group)
        _install_optimizer_hook()
        mcore.hook_ddp_gradient_sync(_count_no_sync, _before_ddp_sync, _after_ddp_built)
    return _LEDGERS[ranks]


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


_ACCUMULATING_DEPTH = 0  # > 0 inside accumulating_gradients()


@contextlib.contextmanager
def accumulating_gradients() -> Iterator[None]:
    """Backwards inside keep the kept experts' gradients on their helpers, as under Megatron DDP's
    ``no_sync``: for loops that accumulate gradients over micro-batches without Megatron DDP. On
    leaving the (outermost) block, the layers none of whose forwards still awaits its backward
    return their kept gradients; the others do in that backward (it runs with sync on). So the
    gradients are complete after the block, and after the step's last backward when it runs
    outside the block (Megatron's way). Layers under Megatron DDP (where the Megatron-LM plugin
    uses this block as ``no_sync_func``) return at DDP's sync instead. Every EP rank must run the
    same block."""
    global _ACCUMULATING_DEPTH
    _count_no_sync(1)
    _ACCUMULATING_DEPTH += 1
    try:
        yield
    finally:
        _count_no_sync(-1)
        _ACCUMULATING_DEPTH -= 1
    if _ACCUMULATING_DEPTH == 0:
        _finish(_dispatchers(None), only_finished_layers=True)


def _dispatchers(modules: Optional[Iterable[Any]]) -> list:
    """The LLEP dispatchers of ``modules`` (``None``: of this process) in the order their layers were
    built, which every EP rank shares, so that they flush in the same order: every LLEP dispatcher
    registers with its EP group's ledger, and belongs to the module that holds its experts."""
    layers = [layer for ledger in _LEDGERS.values() for layer in ledger.layer_list()]
    if modules is None:
        return layers
    inside = {id(m) for module in modules if isinstance(module, torch.nn.Module) for m in module.modules()}
    return [layer for layer in layers if id(layer.adapter.experts) in inside]


def finish_borrowed_gradients(model: Any = None) -> None:
    """Return every kept borrowed expert's gradient of ``model`` (a module, a list of model chunks,
    or ``None`` for every LLEP layer of this process) to its native rank and drop the copies.

    Runs by itself before Megatron DDP's ``start_grad_sync`` and ``finish_grad_sync`` (so through
    ``config.grad_sync_func`` and ``finalize_model_grads``); a loop that accumulates gradients
    some other way calls it after the step's last backward, before reducing gradients. Every EP
    rank must call it."""
    chunks = model if model is None or isinstance(model, (list, tuple)) else [model]
    _finish(_dispatchers(chunks))


def _finish(dispatchers: list, only_finished_layers: bool = False) -> None:
    """Return the kept gradients of ``dispatchers`` and end their step (with
    ``only_finished_layers``, of those outside Megatron DDP no forward of which awaits its backward)."""
    for dispatcher in dispatchers:
        if only_finished_layers and (dispatcher.backwards_to_come or dispatcher.return_behind_backward):
            continue
        if dispatcher.ledger.held_for(dispatcher) is not None or dispatcher in dispatcher.ledger.pending:
            dispatcher.flush_kept_gradients()
        dispatcher.end_step()


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
    ddp_module._llep_dispatchers = dispatchers
    for dispatcher in dispatchers:
        dispatcher.return_behind_backward = True
        dispatcher.deferred_grad_ready = deferred


def _before_ddp_sync(ddp_module: torch.nn.Module) -> None:
    global _NO_SYNC_IN_STEP
    _NO_SYNC_IN_STEP = False
    _finish(getattr(ddp_module, "_llep_dispatchers", []))  # DDP modules built before any LLEP layer hold none
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
        for layer in ledger.layer_list():
            layer.end_step()


def drop_kept_experts(reason: str = "the expert weights changed") -> None:
    """Drop every kept borrowed expert on this rank (call on every rank when expert weights
    change outside an optimizer step, e.g. a placement change); the next plan's epoch check
    makes the other EP ranks drop theirs too."""
    for ledger in _LEDGERS.values():
        ledger.invalidate(reason)
