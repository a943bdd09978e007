"""What recipes/pretrain_gpt.py checks on Megatron-LM's parsed arguments before Megatron-LM starts,
so that a common mistake is one line naming the flag or file instead of an assertion traceback on
every rank (or a crash minutes later):

* :func:`precheck_args`, before Megatron-LM validates the arguments: the parallel layout against
  the number of processes, ``--num-experts`` against ``--expert-model-parallel-size``,
  ``--seq-length`` against ``--max-position-embeddings``, ``--save`` without ``--save-interval``
  (Megatron-LM 0.17-0.19 assert these on every rank, ``--save-interval`` without a message, and
  find an expert layout the processes cannot fill only once the process group is up);
* :func:`check_load`: a ``--load`` directory holding a checkpoint of recipes/finetune.py, which
  Megatron-LM's loop cannot read;
* :func:`check_save`: a ``--save`` directory that cannot be written, or whose disk has less free
  space than one checkpoint of the model needs; :func:`check_output_directories`: a
  ``--tensorboard-dir``, ``--wandb-save-dir`` or ``--data-cache-path`` that cannot be written;
* :func:`check_data`: every data prefix's ``.bin``/``.idx`` (present, the index consistent with
  the ``.bin``'s size) and its token ids against the tokenizer's vocabulary.

Each raises ``ValueError`` with a one-line message.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shutil
import struct
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
"""Megatron's indexed-dataset index: this header, version 1 (<Q), the token dtype code (<B), the
sequence and document counts (<Q each), then int32 sequence lengths, int64 sequence byte offsets
into the .bin, int64 document indices."""
_INDEX_HEAD = struct.Struct("<9sQBQQ")
SCAN_BUDGET_BYTES = 2**30
"""Token ids read to find the largest one, over all prefixes together: data up to this size is read
whole, larger data in evenly spaced windows."""
_SCAN_CHUNK_BYTES = 64 * 2**20
_SCAN_WINDOWS = 64


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:,.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:,.1f} MiB"


def _layout_problem(args: argparse.Namespace) -> Optional[str]:
    """The model-parallel sizes (dense, then expert) must divide the number of processes."""
    tp, pp, cp, ep = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                      args.context_parallel_size, args.expert_model_parallel_size)
    etp_flag = "--expert-tensor-parallel-size" if args.expert_tensor_parallel_size else \
        "--tensor-model-parallel-size (the expert tensor-parallel size by default)"
    for sizes in ([("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                   ("--context-parallel-size", cp)],
                  [("--expert-model-parallel-size", ep), (etp_flag, args.expert_tensor_parallel_size or tp),
                   ("--pipeline-model-parallel-size", pp)]):
        product = math.prod(size for _, size in sizes)
        if args.world_size % product:
            given = " x ".join(f"{flag} {size}" for flag, size in sizes if size > 1)
            return (f"{given} needs a multiple of {product} processes, but {args.world_size} were launched: "
                    f"launch a multiple of {product} processes or lower {'these sizes' if ' x ' in given else 'it'}")
    return None


def precheck_args(args: argparse.Namespace) -> None:
    """The flags Megatron-LM's validation refuses with a bare assertion, or that fail only once the
    process group is up, named; on the arguments as parsed, before Megatron-LM validates them."""
    ep, experts = args.expert_model_parallel_size, args.num_experts
    if ep > 1 and not experts:
        raise ValueError(f"--expert-model-parallel-size {ep} needs an MoE model: "
                         f"set --num-experts (a multiple of {ep})")
    if experts and experts % ep:
        raise ValueError(f"--num-experts {experts} is not a multiple of --expert-model-parallel-size {ep}: every "
                         f"expert-parallel rank holds as many experts as the others; use a multiple of {ep} experts "
                         f"or an --expert-model-parallel-size that divides {experts}")
    problem = _layout_problem(args)
    if problem:
        raise ValueError(problem)
    seq, positions = args.seq_length, args.max_position_embeddings
    if seq is not None and positions is not None and seq > positions:
        raise ValueError(f"--seq-length {seq} exceeds --max-position-embeddings {positions}, the longest sequence the "
                         f"model is built for: raise --max-position-embeddings to at least {seq} or lower --seq-length")
    if args.save and args.save_interval is None:
        raise ValueError(f"--save {args.save} needs --save-interval N, the iterations between checkpoints "
                         "(Megatron-LM also saves when training ends): e.g. --save-interval 1000")
    if args.save and args.save_interval <= 0:
        raise ValueError(f"--save-interval must be a positive number of iterations, got {args.save_interval}")


def finetune_checkpoint(path: str) -> Optional[str]:
    """The checkpoint of recipes/finetune.py at ``path`` (one checkpoint, or a save directory holding
    one in an ``iter_*`` directory), told by the manifest recipes/runtime/checkpointing.py writes; None if none."""
    from recipes.runtime.checkpointing import MANIFEST_FILE

    if not os.path.isdir(path):
        return None
    candidates = [path] + [os.path.join(path, name) for name in sorted(os.listdir(path)) if name.startswith("iter_")]
    return next((c for c in candidates if os.path.isfile(os.path.join(c, MANIFEST_FILE))), None)


def check_load(args: argparse.Namespace) -> None:
    """Megatron-LM's loop reads its own checkpoints only: one of recipes/finetune.py fails deep inside
    the load with a KeyError listing every tensor."""
    if not args.load:
        return
    found = finetune_checkpoint(args.load)
    if found:
        raise ValueError(f"--load {args.load}: {found} is a checkpoint of recipes/finetune.py, which Megatron-LM's "
                         f"loop cannot read: continue it with recipes/finetune.py --load {args.load}, or evaluate it "
                         f"with recipes/evaluate.py --load {args.load}")


def checkpoint_bytes(args: argparse.Namespace, vocab_size: int) -> tuple[int, int]:
    """The parameter count of the model the arguments describe (recipes/runtime/memory.py's count) and a lower
    bound on the size of one checkpoint of it: the weights in their training dtype, and unless
    ``--no-save-optim`` the optimizer state (Adam's two fp32 moments, SGD's one, plus fp32 master
    weights under bf16/fp16). Megatron-LM's files add metadata and padding on top."""
    from megatron.training.arguments import core_transformer_config_from_args

    from recipes.runtime.memory import stage_parameters

    model = SimpleNamespace(config=core_transformer_config_from_args(args), vocab_size=vocab_size,
                            position_embedding_type=args.position_embedding_type,
                            max_sequence_length=args.max_position_embeddings,
                            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    stage, = stage_parameters(model, tp=1, pp=1, ep=1)
    parameters = stage.dense + stage.expert
    weight = 2 if args.bf16 or args.fp16 else 4
    optimizer = 0 if args.no_save_optim else (4 if args.optimizer == "sgd" else 8) + (4 if weight < 4 else 0)
    return parameters, parameters * (weight + optimizer)


def save_directories(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Every ``(directory, flag)`` Megatron-LM's loop will save checkpoints into, from its parsed
    arguments: ``--save``, the non-persistent checkpoint directories, and ``--ckpt-convert-save``
    (a ``--load`` run that converts a checkpoint saves there, under ``--ckpt-convert-format``)."""
    found = [(args.save, "--save")]
    kind = getattr(args, "non_persistent_ckpt_type", None)
    if kind == "global":
        found.append((getattr(args, "non_persistent_global_ckpt_dir", None), "--non-persistent-global-ckpt-dir"))
    elif kind == "local":
        found.append((getattr(args, "non_persistent_local_ckpt_dir", None), "--non-persistent-local-ckpt-dir"))
    if getattr(args, "ckpt_convert_format", None) and getattr(args, "ckpt_convert_save", None):
        found.append((os.path.join(args.ckpt_convert_save, args.ckpt_convert_format), "--ckpt-convert-save"))
    return [(directory, flag) for directory, flag in found if directory]


def check_writable(directory: str, flag: str = "--save") -> None:
    """``--save``: a directory files can be created in (a real file is tried), or can be created."""
    from megatron_llep.writable import directory_problem

    problem = directory_problem(directory)
    if problem:
        raise ValueError(f"{flag} {directory}: {problem}; give a directory this run can write")


OUTPUT_DIRECTORY_FLAGS = ("tensorboard_dir", "wandb_save_dir", "data_cache_path")
"""Megatron-LM's flags of directories it writes into besides checkpoints (TensorBoard and wandb
runs, on the last rank; the dataset index cache)."""


def check_output_directories(args: argparse.Namespace) -> None:
    """Each of :data:`OUTPUT_DIRECTORY_FLAGS` given: a directory this run can write (a file, a
    read-only one, would fail on one rank deep inside Megatron-LM)."""
    for name in OUTPUT_DIRECTORY_FLAGS:
        if getattr(args, name, None):
            check_writable(getattr(args, name), f"--{name.replace('_', '-')}")


def check_save(args: argparse.Namespace, vocab_size: int) -> None:
    """A ``--save`` directory that cannot be written (read-only, immutable, a file) or whose disk
    cannot hold one checkpoint, found before the model is built rather than at the first save."""
    if not args.save:
        return
    from megatron_llep.writable import nearest_existing

    check_writable(args.save)
    free = shutil.disk_usage(nearest_existing(args.save)).free
    parameters, needed = checkpoint_bytes(args, vocab_size)
    if free < needed:
        what = "weights" if args.no_save_optim else "weights and optimizer state; --no-save-optim leaves the latter out"
        raise ValueError(f"--save {args.save}: {_size(free)} free on its disk, but one checkpoint of this model "
                         f"({parameters:,} parameters) needs at least {_size(needed)} ({what}): free space or give "
                         "--save a directory on a larger disk")


def data_prefixes(args: argparse.Namespace) -> list[str]:
    """Every prefix of ``--data-path`` and the per-split ``--*-data-path`` blends."""
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return [p for b in ([blend] if blend else []) + [b for b in (blend_per_split or []) if b] for p in b[0]]


def read_index(prefix: str) -> tuple[np.dtype, int]:
    """The token dtype of ``prefix``'s indexed dataset and the size its ``.bin`` must have, read from
    the ``.idx`` header and its last sequence; ``ValueError`` naming the file when the index is not a
    Megatron index or is cut short."""
    from megatron.core.datasets.indexed_dataset import DType

    idx = prefix + ".idx"
    with open(idx, "rb") as f:
        head = f.read(_INDEX_HEAD.size)
        if len(head) < _INDEX_HEAD.size or head[:len(INDEX_HEADER)] != INDEX_HEADER:
            raise ValueError(f"{idx} is not a Megatron indexed-dataset index (bad header): rebuild it with "
                             "recipes/make_indexed_dataset.py or Megatron-LM's tools/preprocess_data.py")
        _, version, code, sequences, documents = _INDEX_HEAD.unpack(head)
        try:
            dtype = np.dtype(DType.dtype_from_code(code))
        except ValueError:
            raise ValueError(f"{idx}: unknown token dtype code {code} (a corrupt index)") from None
        if version != 1:
            raise ValueError(f"{idx}: index version {version}, Megatron reads version 1 (a corrupt index)")
        needed = _INDEX_HEAD.size + sequences * (4 + 8) + documents * 8
        size = os.fstat(f.fileno()).st_size
        if size < needed:
            raise ValueError(f"{idx} has {size:,} bytes, but its header ({sequences:,} sequences, {documents:,} "
                             f"documents) needs {needed:,}: the index is truncated or corrupt; copy or build it again")
        if sequences == 0:
            return dtype, 0
        f.seek(_INDEX_HEAD.size + (sequences - 1) * 4)
        last_length, = struct.unpack("<i", f.read(4))
        f.seek(_INDEX_HEAD.size + sequences * 4 + (sequences - 1) * 8)
        last_offset, = struct.unpack("<q", f.read(8))
        f.seek(needed - 8)
        last_document, = struct.unpack("<q", f.read(8)) if documents else (-1,)  # the tables start with document 0
    if not 0 <= last_document <= sequences or last_length < 0 or last_offset < 0:
        raise ValueError(f"{idx}: inconsistent sequence/document tables (a corrupt index); copy or build it again")
    return dtype, last_offset + last_length * dtype.itemsize


def max_token_id(path: str, dtype: np.dtype, budget: int) -> tuple[int, bool]:
    """The largest token id in the ``.bin`` file ``path`` and whether every token was read: all of
    them when the file has at most ``budget`` bytes, else ``budget`` bytes in evenly spaced windows
    (the first and the last included). Read through a memory map, in chunks."""
    tokens = np.memmap(path, dtype=dtype, mode="r")
    whole = tokens.nbytes <= budget
    if whole:
        window = max(1, _SCAN_CHUNK_BYTES // dtype.itemsize)
        starts = range(0, tokens.size, window)
    else:
        window = max(1, budget // _SCAN_WINDOWS // dtype.itemsize)
        starts = np.linspace(0, tokens.size - window, _SCAN_WINDOWS).astype(np.int64)
    return max(int(tokens[start:start + window].max()) for start in starts), whole


def check_indexed_files(prefix: str) -> tuple[np.dtype, int]:
    """``prefix``'s token dtype and ``.bin`` size, once both files exist and the index matches the
    ``.bin`` (``ValueError`` naming the file otherwise)."""
    for suffix in (".bin", ".idx"):
        if not os.path.isfile(prefix + suffix):
            raise ValueError(f"data prefix {prefix}: {prefix + suffix} does not exist "
                             "(build one with recipes/make_indexed_dataset.py)")
    dtype, expected = read_index(prefix)
    size = os.path.getsize(prefix + ".bin")
    if size != expected:
        why = "truncated" if size < expected else "from another dataset than the index"
        raise ValueError(f"data prefix {prefix}: {prefix}.bin has {size:,} bytes, but {prefix}.idx indexes "
                         f"{expected:,}: the .bin is {why}; copy or build both files again")
    return dtype, size


@functools.cache
def _indexed_dataset_class() -> type:
    """Megatron's IndexedDataset, whose ``__del__`` does nothing for an index that failed to load
    (Megatron's would report the attributes it never set: "Exception ignored in ... __del__")."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    class LoadedIndexedDataset(IndexedDataset):
        def __del__(self) -> None:
            if "bin_reader" in self.__dict__ and "index" in self.__dict__:
                super().__del__()

    return LoadedIndexedDataset


def open_indexed_dataset(prefix: str):
    """Megatron's IndexedDataset of ``prefix`` once :func:`check_indexed_files` passed; ``ValueError``
    (one line naming the files) when they are missing, cut short or do not load."""
    check_indexed_files(prefix)
    try:
        return _indexed_dataset_class()(prefix)
    except Exception as err:  # noqa: BLE001 - a damaged index surfaces as struct/numpy/assert errors
        raise ValueError(f"{prefix}.bin/.idx: not a readable Megatron indexed dataset ({type(err).__name__}: "
                         f"{err}); copy or build both files again") from None


def check_data(prefixes: Sequence[str], vocab_size: int, vocabulary: str, say: Callable[[str], None]) -> None:
    """Each prefix's ``.bin``/``.idx``: present, the index whole and matching the ``.bin``'s size (a
    truncated copy or a write cut short), and no token id outside the vocabulary of ``vocab_size``
    ids (``vocabulary`` says where that number comes from), which would index past the embedding."""
    try:
        indexed = [(prefix, *check_indexed_files(prefix)) for prefix in prefixes]
        total = sum(size for *_, size in indexed)
        for prefix, dtype, size in indexed:
            if size == 0:
                continue
            largest, whole = max_token_id(prefix + ".bin", dtype, max(1, SCAN_BUDGET_BYTES * size // total))
            if not whole:
                say(f"{prefix}.bin has {_size(size)}: its token ids were checked in a sample")
            if largest >= vocab_size:
                raise ValueError(f"data prefix {prefix}: token id {largest} in {prefix}.bin is outside the vocabulary "
                                 f"of {vocab_size} ids ({vocabulary}): the data was tokenized with another tokenizer; "
                                 "train with that one, or a vocabulary that covers its ids")
    except OSError as err:
        raise ValueError(f"cannot read {err.filename} ({err.strerror})") from None
