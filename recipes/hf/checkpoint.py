"""Hugging Face checkpoint directories: a lazy, counting reader and a sharded writer (safetensors).

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or
``model-0000k-of-0000n.safetensors`` shards listed by ``model.safetensors.index.json``.

:class:`HFCheckpoint` opens shards lazily with ``safetensors.safe_open`` and reads one tensor, or
a run of leading-dim rows of one tensor (:meth:`HFCheckpoint.get_rows`: a rank reads only its own
experts of a fused ``[E, ...]`` tensor), counting the bytes it returns. At most ``max_open`` shard
handles stay open (least recently used first out), so the mapped pages of shards a rank is done
with are released. :class:`HFCheckpointWriter` writes bf16 (by default) shards of bounded size, the
index and ``config.json``, as ``save_pretrained`` lays them out.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Optional, Sequence, Union

import torch

from megatron_llep.writable import StagedFile, StagedOutputs

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint directory that is missing, incomplete or malformed."""


def _safe_open(path: str):
    """``safe_open`` of one shard; a damaged or truncated file is an :class:`HFCheckpointError` naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as err:
        raise HFCheckpointError(f"{path}: not a readable safetensors file, damaged or truncated ({err}); "
                                "download or copy it again") from None


class HFCheckpoint:
    """Read-only view of a Hugging Face safetensors checkpoint directory.

    ``config`` is the parsed ``config.json``; ``bytes_read`` counts the bytes of every tensor
    returned so far; ``names_read`` the names read (fully or in part).
    """

    def __init__(self, directory: str, max_open: int = 2) -> None:
        self.directory = directory
        if not os.path.isdir(directory):
            raise HFCheckpointError(f"{directory}: not a directory (expected a Hugging Face checkpoint with config.json "
                                    f"and *.safetensors)")
        config_path = os.path.join(directory, CONFIG_FILE)
        if not os.path.isfile(config_path):
            raise HFCheckpointError(f"{config_path}: missing (every Hugging Face checkpoint directory has one)")
        try:
            with open(config_path) as f:
                self.config: dict = json.load(f)
        except json.JSONDecodeError as err:
            raise HFCheckpointError(f"{config_path}: not valid JSON ({err})") from None
        index_path = os.path.join(directory, INDEX_FILE)
        single_path = os.path.join(directory, SINGLE_FILE)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise HFCheckpointError(f"{index_path}: not a safetensors index ({err!r})") from None
            self._shard_of: dict[str, str] = dict(weight_map)
            for shard in sorted(set(self._shard_of.values())):
                if not os.path.isfile(os.path.join(directory, shard)):
                    raise HFCheckpointError(f"{os.path.join(directory, shard)}: listed in {INDEX_FILE} but missing")
        elif os.path.isfile(single_path):
            with _safe_open(single_path) as handle:
                self._shard_of = {name: SINGLE_FILE for name in handle.keys()}
        else:
            raise HFCheckpointError(f"{directory}: neither {INDEX_FILE} nor {SINGLE_FILE} (expected Hugging Face "
                                    f"safetensors weights)")
        self.max_open = max(1, max_open)
        self._handles: OrderedDict[str, object] = OrderedDict()
        self._verified: set[str] = set()  # shards whose tensors were checked against the index
        self._header_names: dict[str, set[str]] = {}  # shard -> the names its header lists, where asked
        self.bytes_read = 0
        self.names_read: set[str] = set()

    # -- names and metadata -------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._shard_of)

    def has(self, name: str) -> bool:
        return name in self._shard_of

    def shard_of(self, name: str) -> str:
        return self._shard_of[self._check(name)]

    def shards(self) -> list[str]:
        return sorted(set(self._shard_of.values()))

    def weight_map(self) -> dict[str, str]:
        """Tensor name -> shard file (a single-file checkpoint: every name -> ``model.safetensors``)."""
        return dict(self._shard_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._read(name, lambda h: h.get_slice(name).get_shape()))

    def _check(self, name: str) -> str:
        if name not in self._shard_of:
            raise HFCheckpointError(f"{self.directory}: no tensor {name!r} in the checkpoint")
        return name

    def _handle(self, name: str):
        shard = self._shard_of[self._check(name)]
        handle = self._handles.pop(shard, None)
        if handle is None:
            path = os.path.join(self.directory, shard)
            handle = _safe_open(path)
            if shard not in self._verified:
                self._verify(shard, path, handle)
            while len(self._handles) >= self.max_open:
                _, old = self._handles.popitem(last=False)
                _close(old)
        self._handles[shard] = handle
        return handle

    def _verify(self, shard: str, path: str, handle) -> None:
        """The index's tensors of ``shard`` are all in it, and none of the tensors it holds is also in
        the shard the index places it in (which copy a reader gets would depend on the index: one
        error naming the file and the tensor instead)."""
        try:
            present = set(handle.keys())
        except Exception as err:  # noqa: BLE001 - safetensors' errors
            _close(handle)
            raise HFCheckpointError(f"{path}: not a readable safetensors file, damaged or truncated ({err}); "
                                    "download or copy it again") from None
        twice = sorted(n for n in present if self._shard_of.get(n, shard) != shard
                       and n in self._names_in(self._shard_of[n]))
        if twice:
            _close(handle)
            other = self._shard_of[twice[0]]
            more = f" (and {len(twice) - 1} more tensor(s) of other shards)" if len(twice) > 1 else ""
            raise HFCheckpointError(f"{path}: holds {twice[0]!r}, which {INDEX_FILE} places in {other}: a tensor stored "
                                    f"in two shards{more}; keep one copy (a shard from another checkpoint? download or "
                                    "copy them again)")
        absent = sorted(n for n, s in self._shard_of.items() if s == shard and n not in present)
        if absent:
            _close(handle)
            more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
            raise HFCheckpointError(f"{path}: lacks {len(absent)} tensor(s) that {INDEX_FILE} places in it: "
                                    f"{', '.join(absent[:3])}{more} (an index or shard from another copy? download "
                                    "or copy them again)")
        self._verified.add(shard)

    def _names_in(self, shard: str) -> set[str]:
        """The tensor names ``shard``'s header lists (read once; an unreadable shard: none here, its
        own verification names it)."""
        if shard not in self._header_names:
            try:
                with _safe_open(os.path.join(self.directory, shard)) as handle:
                    self._header_names[shard] = set(handle.keys())
            except HFCheckpointError:
                self._header_names[shard] = set()
        return self._header_names[shard]

    def _read(self, name: str, read):
        """``read(handle)`` of ``name``'s shard; a safetensors error names the file."""
        from safetensors import SafetensorError

        handle = self._handle(name)
        try:
            return read(handle)
        except SafetensorError as err:
            path = os.path.join(self.directory, self._shard_of[name])
            raise HFCheckpointError(f"{path}: cannot read tensor {name!r} ({err}); the file is damaged or not the "
                                    "one the index describes: download or copy it again") from None

    # -- reading ------------------------------------------------------------------------------
    def get(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (in its stored dtype)."""
        tensor = self._read(name, lambda h: h.get_tensor(name))
        self._count(name, tensor)
        return tensor

    def get_rows(self, name: str, index: Union[int, slice, Sequence[int]]) -> torch.Tensor:
        """Rows of ``name`` along its leading dimension, reading only those bytes: an int (the
        row without its leading dim), a slice, or a sequence of row ids (read run by run)."""
        sliced = self._read(name, lambda h: h.get_slice(name))
        rows = sliced.get_shape()[0]
        if isinstance(index, int):
            if not -rows <= index < rows:
                raise HFCheckpointError(f"{name}: row {index} out of range (leading dim {rows})")
            index = index % rows
            tensor = sliced[index:index + 1][0]
        elif isinstance(index, slice):
            tensor = sliced[index]
        else:
            ids = [int(i) for i in index]
            if any(not 0 <= i < rows for i in ids):
                raise HFCheckpointError(f"{name}: rows {ids} out of range (leading dim {rows})")
            parts, start = [], 0
            while start < len(ids):  # contiguous runs
                stop = start + 1
                while stop < len(ids) and ids[stop] == ids[stop - 1] + 1:
                    stop += 1
                parts.append(sliced[ids[start]:ids[stop - 1] + 1])
                start = stop
            tensor = torch.cat(parts) if len(parts) != 1 else parts[0]
        self._count(name, tensor)
        return tensor

    def _count(self, name: str, tensor: torch.Tensor) -> None:
        self.bytes_read += tensor.numel() * tensor.element_size()
        self.names_read.add(name)

    def release(self) -> None:
        """Close the open shard handles (unmapping the pages read so far); the next read reopens
        its shard. The import calls this after every layer, so a rank's resident file pages stay
        bounded by about one layer's worth of what it reads."""
        while self._handles:
            _close(self._handles.popitem()[1])

    close = release

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close(handle) -> None:
    exit_ = getattr(handle, "__exit__", None)
    if exit_ is not None:
        try:
            exit_(None, None, None)
        except Exception:  # noqa: BLE001 - already closed
            pass


EXTRA_SHARD = "model-not-in-source.safetensors"


def remove_hf_checkpoint_files(directory: str, shards: Sequence[str]) -> None:
    """Remove what :meth:`HFCheckpointWriter.close` wrote into ``directory`` (``shards``, the index
    and config.json); other files there stay."""
    for name in (*shards, INDEX_FILE, CONFIG_FILE):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            os.remove(path)


class HFCheckpointWriter:
    """Write tensors as ``model-0000k-of-0000n.safetensors`` shards of at most ``max_shard_bytes``
    (a single tensor larger than that gets a shard of its own), ``model.safetensors.index.json``
    and ``config.json``. Tensors are cast to ``dtype`` (bf16 by default; ``None`` keeps theirs).
    Call :meth:`add` in the order the shards should hold them and :meth:`close` at the end.

    With ``layout`` (a source checkpoint's :meth:`HFCheckpoint.weight_map`) every tensor goes into
    the shard file the source names instead, so the index equals the source's (a single-file source
    gives a single ``model.safetensors``, no index). A shard is held only until all its tensors
    have arrived, then written; tensors the source lacks go to ``model-not-in-source.safetensors``,
    and :attr:`notes` says so (and names source tensors that never arrived)."""

    def __init__(self, directory: str, config: Optional[dict] = None, dtype: Optional[torch.dtype] = torch.bfloat16,
                 max_shard_bytes: int = 5 * 2**30, layout: Optional[dict[str, str]] = None) -> None:
        self.directory = directory
        self.config = config
        self.dtype = dtype
        self.max_shard_bytes = max_shard_bytes
        self.layout = dict(layout) if layout is not None else None
        os.makedirs(directory, exist_ok=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[StagedFile, str, list[str]]] = []  # (staged file, layout's shard file or "", names)
        self._missing: dict[str, set[str]] = {}  # layout: shard file -> names not yet added
        for name, shard in (self.layout or {}).items():
            self._missing.setdefault(shard, set()).add(name)
        self._held: dict[str, dict[str, torch.Tensor]] = {}  # layout: shard file -> tensors added so far
        self._names: set[str] = set()
        self._outputs = StagedOutputs("--out")  # every file renamed into place by close(), none before
        self.notes: list[str] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor, dtype: Optional[torch.dtype] = None) -> None:
        """Queue ``tensor`` as ``name``, cast to ``dtype`` (default: the writer's); float8 tensors
        (quantized weights) and integer ones are written as they are."""
        if name in self._names:
            raise HFCheckpointError(f"{name}: written twice")
        self._names.add(name)
        tensor = tensor.detach().to("cpu")
        dtype = dtype or self.dtype
        if dtype is not None and tensor.is_floating_point() and tensor.element_size() > 1:  # float8: quantized, kept
            tensor = tensor.to(dtype)
        tensor = tensor.contiguous()
        size = tensor.numel() * tensor.element_size()
        self.total_bytes += size
        if self.layout is not None:
            shard = self.layout.get(name, EXTRA_SHARD)
            self._held.setdefault(shard, {})[name] = tensor
            missing = self._missing.get(shard)
            if missing is not None:
                missing.discard(name)
                if not missing:  # complete: write it now, so at most the shards in progress stay in memory
                    self._write(shard, self._held.pop(shard))
            return
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += size

    def _write(self, shard: str, tensors: dict[str, torch.Tensor]) -> None:
        """One shard, staged (its final name may come only at :meth:`close`); an :class:`OutputError`
        (a full disk) discards every staged file."""
        from safetensors.torch import save_file

        name = shard or f"model-{len(self._written) + 1:05d}.safetensors"
        try:
            staged = self._outputs.stage(os.path.join(self.directory, name),
                                         needed=sum(t.numel() * t.element_size() for t in tensors.values()))
            save_file(tensors, staged.temporary, metadata={"format": "pt"})
        except Exception as err:  # safetensors reports a full disk as its own SafetensorError
            failure = self._outputs.abandon(err)
            if failure is None:
                raise
            raise failure from None
        self._written.append((staged, shard, list(tensors)))

    def discard(self) -> None:
        """An export that failed: every file written so far removed, what ``directory`` held left as it was."""
        self._outputs.discard()

    def _flush(self) -> None:
        if self._pending:
            self._write("", self._pending)
            self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard(s), name the shards, write the index and config.json; returns the
        shard file names."""
        if self.layout is None:
            self._flush()
            count = len(self._written)
            files = [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
        else:
            absent = sorted(n for names in self._missing.values() for n in names)
            if absent:
                more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
                self.notes.append(f"{len(absent)} tensor(s) of the source not exported (their shards are written "
                                  f"without them): {', '.join(absent[:3])}{more}")
            extra = sorted(self._held.get(EXTRA_SHARD, {}))
            if extra:
                more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
                self.notes.append(f"{len(extra)} tensor(s) not in the source checkpoint, written to {EXTRA_SHARD}: "
                                  f"{', '.join(extra[:3])}{more}")
            for shard in sorted(self._held):
                self._write(shard, self._held.pop(shard))
            files = [shard for _, shard, _ in self._written]
        weight_map: dict[str, str] = {}
        for file, (staged, _, names) in zip(files, self._written):
            staged.final = os.path.join(self.directory, file)
            weight_map.update({n: file for n in names})
        with self._outputs:  # the shards, index and config.json renamed into place together
            if files != [SINGLE_FILE]:
                index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
                with self._outputs.open(os.path.join(self.directory, INDEX_FILE)) as f:
                    json.dump(index, f, indent=2)
            if self.config is not None:
                with self._outputs.open(os.path.join(self.directory, CONFIG_FILE)) as f:
                    json.dump(self.config, f, indent=2, sort_keys=True)
        return files
