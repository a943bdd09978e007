"""Run Megatron-LM's own training loop (``megatron.training.pretrain``) on CPU with gloo — tests and
CPU demos only.

On top of :mod:`megatron_llep.testing.cpu_gloo` (Megatron-Core on CPU), Megatron-LM's loop needs:

* ``initialize_megatron`` asserts CUDA unless called with ``allow_no_cuda=True`` (``pretrain`` never
  passes it);
* it builds the model-parallel groups and seeds the model-parallel RNG only when
  ``torch.cuda.device_count() > 0``, and then calls ``torch.cuda.set_device``: it sees one pretend
  device while it runs;
* flags: the local (non Transformer Engine) layer spec and attention, no persistent layer norm, the
  gloo backend, none of the fusions that need CUDA extensions (:data:`CPU_FLAGS`);
* its data loaders draw their workers' base seed from the CPU generator each time they are iterated
  (when the iterators are built, after a resumed run restored the checkpoint's RNG state; and when
  a cyclic one starts over). On GPUs that leaves dropout's CUDA generator alone; on CPU the CUDA
  generator *is* the CPU one, so a resumed run would draw every dropout mask from a shifted
  state: :func:`_loader_with_own_generator` gives each loader a generator of its own.

Megatron's RNG tracker warns "CPU RNG state changed within GPU RNG context" after every dropout
under its fork; on CPU the "GPU" generator *is* the CPU one (``cpu_gloo`` maps it there), so the
warning is expected and is filtered out.

Like ``cpu_gloo``, :func:`enable` installs nothing when CUDA is available, so it is inert on GPUs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable, Iterator, Sequence

import torch

from megatron_llep.testing import cpu_gloo

CPU_FLAGS: tuple[tuple[str, ...], ...] = (
    ("--distributed-backend", "gloo"),
    ("--spec", "local"),
    ("--attention-backend", "local"),
    ("--no-persist-layer-norm",),
    ("--no-gradient-accumulation-fusion",),  # a CUDA extension of APEX or Transformer Engine
    ("--no-rope-fusion",),  # Transformer Engine's
)
"""Megatron-LM flags a CPU run needs (flag, then its value if it takes one)."""

_ENABLED = False


def cpu_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` plus the :data:`CPU_FLAGS` it lacks. Raises ``ValueError`` naming a flag given with
    a value CPU runs cannot use."""
    argv = list(argv)
    for flag, *value in CPU_FLAGS:
        if flag not in argv:
            argv += [flag, *value]
            continue
        given = argv[argv.index(flag) + 1: argv.index(flag) + 1 + len(value)]
        if given != value:
            raise ValueError(f"{flag} {' '.join(given)} cannot run on CPU: use {flag} {' '.join(value)} (or leave it out)")
    return argv


class _CpuRngForkNote(logging.Filter):
    """Drops the RNG tracker's warning that cannot apply when its CUDA generator is the CPU one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "CPU RNG state changed within GPU RNG context"


@contextlib.contextmanager
def _one_pretend_cuda_device() -> Iterator[None]:
    """``torch.cuda.device_count() == 1`` and a no-op ``set_device`` while Megatron-LM sets up."""
    saved = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count = lambda: 1  # type: ignore[assignment]
    torch.cuda.set_device = lambda device: None  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = saved


def _loader_with_own_generator(build_pretraining_data_loader: Callable) -> Callable:
    """Megatron-LM's ``build_pretraining_data_loader`` whose torch ``DataLoader`` draws from a
    generator of its own, not from the one dropout uses on CPU."""

    @functools.wraps(build_pretraining_data_loader)
    def build(*args, **kwargs):
        loader = build_pretraining_data_loader(*args, **kwargs)
        if isinstance(loader, torch.utils.data.DataLoader):  # not an external one
            loader.generator = torch.Generator()
        return loader

    return build


def enable() -> bool:
    """Install the patches once per process (after :func:`cpu_gloo.enable`). Returns False, and
    patches nothing, under CUDA."""
    global _ENABLED
    if _ENABLED:
        return True
    if not cpu_gloo.enable():
        return False
    from megatron.training import initialize, training

    initialize_megatron = initialize.initialize_megatron

    @functools.wraps(initialize_megatron)
    def initialize_megatron_on_cpu(*args, **kwargs):
        with _one_pretend_cuda_device():
            return initialize_megatron(*args, **dict(kwargs, allow_no_cuda=True))

    training.initialize_megatron = initialize_megatron_on_cpu
    training.build_pretraining_data_loader = _loader_with_own_generator(training.build_pretraining_data_loader)
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_CpuRngForkNote())
    _ENABLED = True
    return True
