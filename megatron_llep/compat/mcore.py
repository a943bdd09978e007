"""The one place where the Megatron-Core releases megatron-llep supports (0.16 to 0.19) differ.

Library code imports Megatron names that moved or vanished, and asks version-dependent
questions, only through this module; everything else uses one code path for every release.
What differs (docs/compat.md has the full table):

* legacy ``GroupedMLP`` (and ``moe/grouped_gemm_util``) exist only before 0.17;
* an MoE layer spec is a ``ModuleSpec(MoELayer, submodules=...)`` before 0.18 and a
  ``functools.partial(MoELayer, submodules=...)`` from 0.18 on;
* with ``moe_shared_expert_overlap``, the alltoall dispatcher runs the shared expert's fc2 in
  ``combine_postprocess`` before 0.18 and in ``token_combine`` (right after the combine
  all-to-all) from 0.18 on;
* ``cuda_graph_scope`` (``CudaGraphScope``) became ``cuda_graph_modules`` (``CudaGraphModule``)
  in 0.18.
* ``dist_checkpointing`` writes a rank's shards from forked processes in 0.16 and from threads
  in 0.19; both return the results through a Manager process (see
  :func:`collect_checkpoint_writes_in_process`). A failed shard write reaches the coordinator's
  exception as text in 0.16 and as its type alone in 0.19 (see :func:`recorded_checkpoint_write_errors`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional

import megatron.core
import torch
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.tensor_parallel import all_to_all as _all_to_all
from megatron.core.transformer.moe import experts as _experts
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from packaging.version import Version

MCORE_VERSION = Version(megatron.core.__version__)
"""The installed Megatron-Core release."""

TESTED_RANGE = (Version("0.16"), Version("0.20"))
"""Releases the test suite runs against: ``TESTED_RANGE[0] <= version < TESTED_RANGE[1]``."""

if not TESTED_RANGE[0] <= MCORE_VERSION < TESTED_RANGE[1]:
    warnings.warn(
        f"megatron-llep is tested with megatron-core >={TESTED_RANGE[0]},<{TESTED_RANGE[1]}; "
        f"megatron-core {MCORE_VERSION} is installed (see docs/compat.md)",
        stacklevel=2,
    )

SequentialMLP = _experts.SequentialMLP
TEGroupedMLP = _experts.TEGroupedMLP
GroupedMLP: Optional[type] = getattr(_experts, "GroupedMLP", None)
"""Megatron's legacy grouped-GEMM experts; ``None`` from 0.17 on (removed there)."""

SHARED_EXPERT_FC2_IN_TOKEN_COMBINE = MCORE_VERSION >= Version("0.18")
"""Whether the alltoall dispatcher's ``token_combine`` runs the overlapped shared expert's fc2."""


def grouped_gemm_util() -> Any:
    """Megatron's ``moe.grouped_gemm_util`` module, or ``None`` where legacy GroupedMLP is gone."""
    if GroupedMLP is None:
        return None
    from megatron.core.transformer.moe import grouped_gemm_util as module

    return module


def moe_module_spec(num_experts: int, use_te: bool = False, legacy_grouped_gemm: bool = False) -> Any:
    """Megatron's MoE layer spec: ``SequentialMLP`` experts; ``use_te`` asks for Transformer
    Engine's ``TEGroupedMLP``, ``legacy_grouped_gemm`` for legacy ``GroupedMLP``."""
    if legacy_grouped_gemm and GroupedMLP is None:
        raise ValueError(
            f"legacy GroupedMLP was removed in Megatron-Core 0.17 (installed: {MCORE_VERSION}); "
            "use SequentialMLP or Transformer Engine's TEGroupedMLP"
        )
    return get_moe_module_spec(use_te=use_te, num_experts=num_experts, moe_grouped_gemm=use_te or legacy_grouped_gemm)


def moe_submodules(spec: Any) -> Any:
    """The ``MoESubmodules`` of an MoE layer spec (either spec form)."""
    if isinstance(spec, ModuleSpec):
        return spec.submodules
    if isinstance(spec, functools.partial):
        return spec.keywords["submodules"]
    raise TypeError(f"not an MoE layer spec: {spec!r}")


def moe_layer_class(node: Any) -> Optional[type]:
    """The ``MoELayer`` subclass a spec node builds, or ``None`` if it builds no MoE layer."""
    target = node.module if isinstance(node, ModuleSpec) else node.func if isinstance(node, functools.partial) else None
    if isinstance(target, type) and issubclass(target, MoELayer):
        return target
    return None


def replace_moe_layers(spec: Any, rewrite: Callable[[type, dict], Optional[tuple[type, dict]]]) -> Any:
    """Rewrite every MoE layer node of a (layer or block) spec tree, in place; returns the tree.

    ``rewrite(layer_class, params)`` returns the new class and constructor keywords, or ``None`` to
    keep the node. Descends through ModuleSpecs, partials, lists, tuples and dataclasses.
    """
    if isinstance(spec, ModuleSpec):
        cls = moe_layer_class(spec)
        result = rewrite(cls, dict(spec.params)) if cls is not None else None
        if result is not None:
            spec.module, spec.params = result[0], result[1]
        spec.submodules = replace_moe_layers(spec.submodules, rewrite)
        return spec
    if isinstance(spec, functools.partial):
        cls = moe_layer_class(spec)
        if cls is None:
            return spec
        keywords = dict(spec.keywords)
        submodules = replace_moe_layers(keywords.pop("submodules", None), rewrite)
        new_cls, params = rewrite(cls, keywords) or (cls, keywords)
        return functools.partial(new_cls, *spec.args, submodules=submodules, **params)
    if isinstance(spec, (list, tuple)):
        return type(spec)(replace_moe_layers(item, rewrite) for item in spec)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            setattr(spec, field.name, replace_moe_layers(getattr(spec, field.name), rewrite))
        return spec
    return spec


def cuda_graph_modules(config: Any) -> list[str]:
    """Names of the per-layer CUDA-graph capture regions (``[]`` is Megatron's whole-layer capture)."""
    modules = getattr(config, "cuda_graph_modules", None)
    if modules is None:
        modules = getattr(config, "cuda_graph_scope", None)
    if modules is None or modules == "full":
        return []
    if not isinstance(modules, (list, tuple)):
        modules = [modules]
    return [getattr(m, "name", m) for m in modules]


def all_to_all(group: Any, tokens: Any, output_splits: list, input_splits: list, use_nccl_stream: bool = False) -> Any:
    """Megatron's autograd all-to-all; ``use_nccl_stream`` (0.18+, set with the shared-expert
    overlap) runs it on NCCL's stream as the base dispatcher does."""
    if use_nccl_stream:
        return _all_to_all(group, tokens, output_splits, input_splits, use_nccl_stream=True)
    return _all_to_all(group, tokens, output_splits, input_splits)


def shared_experts_wait_current_stream(shared_experts: Any) -> None:
    """Order the overlapped shared expert's stream after the current one (0.18+; before, the
    shared expert synchronised inside its own steps)."""
    wait = getattr(shared_experts, "wait_current_stream", None)
    if wait is not None:
        wait()


def collect_checkpoint_writes_in_process() -> None:
    """Let ``dist_checkpointing.save`` (synchronous) hand its write results back in-process.

    Megatron-Core 0.16-0.19 collect them through a ``multiprocessing.Manager`` queue made on a
    rank's first save (``filesystem_async._results_queue``): a spawned server process that
    re-imports the main script (~330 MB) and outlives a rank killed with SIGKILL. A synchronous
    save runs the writer function in the calling process, so a plain queue is enough; asynchronous
    saves need Megatron's own (their writer is another process). Idempotent; call before the first save."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


def finish_param_sync(module: Any) -> None:
    """Wait for Megatron DDP's overlapped parameter all-gather (distributed optimizer with
    ``overlap_param_gather``) of ``module``'s parameters, as DDP's own forward pre-hooks do when the
    module runs. LLEP sends expert weights in ``token_dispatch``, before the experts module runs, so
    it must finish the sync first. Runs only DDP's hooks (found by name); idempotent."""
    for submodule in module.modules():
        for hook in list(submodule._forward_pre_hooks.values()):
            if "_make_forward_pre_hook" in getattr(hook, "__qualname__", ""):
                hook(submodule, ())


def hook_ddp_gradient_sync(no_sync_depth: Callable[[int], None], before_sync: Callable[[torch.nn.Module], None],
                           built: Callable[[torch.nn.Module], None]) -> None:
    """Watch Megatron DDP's gradient-sync points, once per process: ``no_sync_depth(+1 / -1)`` on
    entering and leaving ``no_sync`` (Megatron's schedules enter it for all but the step's last
    backward, through ``config.no_sync_func``), and ``before_sync(ddp_module)`` before
    ``start_grad_sync`` (``config.grad_sync_func`` of pipeline stages) and ``finish_grad_sync``
    (``finalize_model_grads``, hand-written loops), i.e. before any reduction that is not started
    by DDP's own backward hooks; ``built(ddp_module)`` once a DDP module is constructed (its
    ``ddp_config`` says whether grad reduce overlaps the backward). Patched on the class so that
    every way a loop reaches them is seen, whoever built the model and whenever ``config``'s
    functions were set."""
    from megatron.core.distributed import DistributedDataParallel

    if getattr(DistributedDataParallel, "_llep_sync_hooks", False):
        return
    init, no_sync, start, finish = (DistributedDataParallel.__init__, DistributedDataParallel.no_sync,
                                    DistributedDataParallel.start_grad_sync, DistributedDataParallel.finish_grad_sync)

    @functools.wraps(init)
    def built_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built(self)

    @contextlib.contextmanager
    def counted_no_sync(self):
        with no_sync(self):
            no_sync_depth(1)
            try:
                yield
            finally:
                no_sync_depth(-1)

    @functools.wraps(start)
    def start_grad_sync(self, *args, **kwargs):
        before_sync(self)
        return start(self, *args, **kwargs)

    @functools.wraps(finish)
    def finish_grad_sync(self, *args, **kwargs):
        before_sync(self)
        return finish(self, *args, **kwargs)

    counted_no_sync.__doc__ = no_sync.__doc__
    DistributedDataParallel.__init__ = built_init
    DistributedDataParallel.no_sync = counted_no_sync
    DistributedDataParallel.start_grad_sync = start_grad_sync
    DistributedDataParallel.finish_grad_sync = finish_grad_sync
    DistributedDataParallel._llep_sync_hooks = True


def intercept_grad_ready(ddp_module: torch.nn.Module, params: Iterable[torch.nn.Parameter],
                         intercept: Callable[[Callable[[], None], torch.nn.Parameter, bool], None]) -> set:
    """Route Megatron DDP's ``register_grad_ready`` (with overlapped grad reduce, a parameter's
    gradient is final for the step; its bucket group starts reducing once all of the group's are)
    of the bucket groups that hold any of ``params`` through ``intercept(register, param,
    last_microbatch)``, which calls ``register()`` now or later; returns every parameter of those
    groups. Same attributes in 0.16 to 0.19 (``param_to_bucket_group``, ``register_grad_ready``,
    ``is_last_microbatch``, ``params``)."""
    groups = {id(group): group for group in (ddp_module.param_to_bucket_group.get(p) for p in params) if group is not None}
    for group in groups.values():
        register = group.register_grad_ready

        def routed(param, *args, _group=group, _register=register, **kwargs):
            intercept(functools.partial(_register, param, *args, **kwargs), param, _group.is_last_microbatch)

        group.register_grad_ready = routed
    return {param for group in groups.values() for param in group.params}


def in_checkpointed_forward() -> bool:
    """Whether Megatron's activation checkpointing (``tensor_parallel.checkpoint``: full recompute
    and the selective "moe" module) is running a forward now, whose recompute in backward follows."""
    from megatron.core.tensor_parallel.random import is_checkpointing

    return is_checkpointing()


def moe_layer_number(layer: torch.nn.Module) -> Optional[int]:
    """An MoE layer's number in the whole model, the same on every release: decoder layers
    ``1..num_layers``, then the multi-token-prediction layers ``num_layers + 1, ...``. 0.17+ number
    an MTP block's inner layer from 1 and flag it ``is_mtp_layer`` (their router adds
    ``num_layers`` for its logs); 0.16 numbers it globally. Placements, traces and LLEP statistics
    are keyed by this number, so they carry over between releases."""
    number = layer.layer_number
    if number is not None and getattr(layer, "is_mtp_layer", False):
        number = number + layer.config.num_layers
    return number


@contextlib.contextmanager
def recorded_checkpoint_write_errors(errors: list[BaseException]) -> Iterator[None]:
    """Inside the block, this rank's write errors in ``dist_checkpointing.save`` (a full disk) land
    in ``errors``, so that every rank gets through the save's collectives to its caller's
    agreement on whether the save failed, knowing why:

    * a shard write: Megatron-Core makes every rank raise after the save's last collective, but
      with the error's text on the coordinator only (0.16) or nowhere (0.19 keeps its type):
      recorded where it happens (0.19's writer threads; 0.16's forked writers' result, read back
      in this process);
    * an ``OSError`` in a write one rank does alone before a collective the others already wait in
      (the coordinator's ``.metadata``, rank 0's ``metadata.json``, 0.16's ``common.pt``): recorded
      instead of raised, and the save goes on.

    The writer's own error log lines are dropped: each is about an error recorded here, which the
    caller reports in its one line.
    """
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import common, filesystem_async

    writer = filesystem_async.FileSystemWriterAsync
    write_shards, retrieve = writer.write_preloaded_data, writer.retrieve_write_results

    @functools.wraps(write_shards)
    def write_shards_recorded(*args: Any, **kwargs: Any) -> Any:
        output = write_shards(*args, **kwargs)
        if output is not None and isinstance(output[1], BaseException):
            errors.append(output[1])
        return output

    @functools.wraps(retrieve)
    def retrieve_recorded(self: Any) -> Any:
        results = retrieve(self)
        if isinstance(results, tuple) and not errors:  # (exception, traceback): 0.16's forked writer failed
            errors.append(results[0].__cause__ or results[0])
        return results

    def deferred(write: Callable) -> Callable:
        @functools.wraps(write)
        def write_or_record(*args: Any, **kwargs: Any) -> Any:
            try:
                return write(*args, **kwargs)
            except OSError as err:
                errors.append(err)
                return None

        return write_or_record

    patches = [(writer, "write_preloaded_data", staticmethod(write_shards_recorded)),
               (writer, "retrieve_write_results", retrieve_recorded), (writer, "finish", deferred(writer.finish)),
               (serialization, "save_config", deferred(serialization.save_config))]
    if hasattr(common, "TorchCommonSaveStrategy"):  # 0.16: common.pt, written before the shards
        patches.append((common.TorchCommonSaveStrategy, "save_common",
                        deferred(common.TorchCommonSaveStrategy.save_common)))
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    writer_log = logging.getLogger(filesystem_async.__name__)
    quiet = _BelowError()
    writer_log.addFilter(quiet)
    try:
        yield
    finally:
        writer_log.removeFilter(quiet)
        for owner, name, original in originals:
            setattr(owner, name, original)


class _BelowError(logging.Filter):
    """Lets a logger's records below ERROR through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR
