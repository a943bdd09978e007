"""Checkpoint save/resume with Megatron's ``dist_checkpointing`` (model, distributed optimizer,
LR scheduler, RNG, data position), laid out as Megatron-LM does::

    <save>/iter_0000004/...                                one dist_checkpointing directory per save
    <save>/iter_0000004/checkpoint_manifest.json           its files' sizes and SHA-256, written last
    <save>/latest_checkpointed_iteration.txt               the newest complete one

A save is written to ``iter_XXXXXXX.tmp``; after every rank finished, the ranks hash their own
shards, rank 0 writes the manifest, renames the directory and only then replaces the "latest"
file atomically, so a run killed mid-save leaves the previous checkpoint intact. Loading checks
the manifest and falls back to the newest complete checkpoint, one line per skipped one (a
truncated, corrupted or missing file, a garbage or dangling "latest" file). Resuming restores
everything a step depends on: with the same world size the continued run is bitwise the run that
never stopped.

Checksums: neither dist_checkpointing nor torch.distributed.checkpoint records any (0.16-0.19,
torch 2.13), so the manifest is ours: hashlib's SHA-256, streamed, each rank hashing the shards
it wrote (about 1-2 GB/s per rank; ``verify="size"`` checks sizes only).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_llep.compat import mcore
from megatron_llep.placement import (ExpertPlacement, read_checkpoint_placement, same_expert_order,
                                     write_checkpoint_placement)
from megatron_llep.writable import fsync_directory, readable_bytes, write_text
from recipes.runtime import parent_death, watchdog

LATEST_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "checkpoint_manifest.json"
MANIFEST_FORMAT = "megatron-llep checkpoint manifest 1"
_NO_MANIFEST = f"no {MANIFEST_FILE} (a save that did not finish, or not written by recipes/runtime/checkpointing.py)"
# torch.distributed.checkpoint's global metadata, written last by its coordinator: a manifest-less
# checkpoint from before manifests existed is accepted only with it
LEGACY_COMPLETE_MARK = ".metadata"
COMMON_FILE = "common.pt"  # Megatron-Core up to 0.16 keeps a checkpoint's common state here, later in the shards
_ITERATION_DIR = re.compile(r"iter_(\d+)")
_STAGING_DIR = re.compile(r"iter_\d+\.tmp")
_RANK_SHARD = re.compile(r"__(\d+)_\d+\.distcp$")  # torch_dist shard files: [prefix]__<writing rank>_<i>.distcp
# Megatron-LM's default: distributed-optimizer state saved by every rank in parallel, reshardable
# across data-parallel sizes
SHARDING_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or from an incompatible run."""


class CheckpointSaveError(RuntimeError):
    """A save that failed on some rank (one line: why, the space it needs and has, what to do)."""


@dataclass
class TrainingProgress:
    """What the loop needs besides parameters and optimizer state to continue exactly."""

    iteration: int = 0
    consumed_samples: int = 0


def _iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _create_empty_adam_state(optimizer) -> None:
    """Give a fresh optimizer Adam's state entries (zero moments, step 0) without stepping it.

    Megatron-Core 0.16's DistributedOptimizer reads ``state["step"]`` of every parameter when
    building the sharded state dict to load into; without TE/Apex the torch Adam it wraps has no
    state before its first step. The loaded checkpoint overwrites these entries.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _restore_adam_steps(optimizer, loaded_state: Any) -> None:
    """Set every parameter's Adam step counter from the checkpoint, each its own tensor.

    Without TE/Apex, Megatron-Core 0.16's DistributedOptimizer keeps the step in the saved param
    groups but its load_state_dict leaves the counters of an already-initialised state untouched
    (and would share ONE tensor between all parameters, which torch Adam increments once per
    parameter). Bias correction after a resume depends on it.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [loaded_state[i] for i in range(len(chained))] if len(chained) > 1 else [loaded_state]
    for inner_optimizer, state in zip(chained, states):
        steps = {g["step"] for g in state["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            continue  # TE/Apex optimizers keep the step in their param groups themselves
        step = float(steps.pop())
        for param_state in inner_optimizer.optimizer.state.values():
            param_state["step"] = torch.tensor(step)


def _sharded_state(model, optimizer, is_loading: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    if is_loading:
        _create_empty_adam_state(optimizer)
    model_state = model.module.sharded_state_dict(metadata=SHARDING_METADATA)
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=SHARDING_METADATA),
        # every rank's RNG (expert-parallel ranks differ), one shard per global rank
        "rng_state": ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0),
    }


def _say(message: str) -> None:
    """A checkpoint problem worth one line, printed once (rank 0)."""
    if dist.get_rank() == 0:
        print(f"[checkpoint] {message}", file=sys.stderr, flush=True)


def _set_parent_death_signal(parent_pid: int) -> None:
    """Make this (just forked) process receive SIGKILL when its parent dies (Linux prctl)."""
    parent_death.arm(signal.SIGKILL, parent_pid)


_forks_die_with_parent = False
_fork_parent_pid = 0


def _after_fork_in_child() -> None:
    if _forks_die_with_parent:
        _set_parent_death_signal(_fork_parent_pid)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def writers_die_with_this_process() -> Iterator[None]:
    """Inside the block, processes forked by this one (dist_checkpointing's shard writers in
    Megatron-Core 0.16) die with it: a rank killed mid-save (kill -9, OOM killer) leaves no writer
    behind. Linux ties the signal to the forking *thread*: use it where forks come from a thread
    that lives as long as the process (a synchronous save forks from the calling thread)."""
    global _forks_die_with_parent, _fork_parent_pid
    _forks_die_with_parent, _fork_parent_pid = True, os.getpid()
    try:
        yield
    finally:
        _forks_die_with_parent = False


def _checkpoint_files(directory: str) -> list[str]:
    """Every file of a checkpoint directory but the manifest: sorted relative paths."""
    files = []
    for parent, _, names in os.walk(directory):
        files += [os.path.relpath(os.path.join(parent, name), directory) for name in names]
    return sorted(f for f in files if f != MANIFEST_FILE)


def _checking_rank(relative_path: str, world: int) -> int:
    """Who hashes a file: the rank that wrote a torch_dist shard (it is in that rank's page cache
    right after a save, and the work is spread over all ranks), rank 0 the common files."""
    match = _RANK_SHARD.search(os.path.basename(relative_path))
    return int(match.group(1)) % world if match else 0


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(directory: str, verify: str = "sha256") -> None:
    """Record every file of a finished save in ``directory/checkpoint_manifest.json``: its size and
    (``verify="sha256"``) SHA-256. Each rank hashes the shards it wrote; rank 0 writes the manifest,
    last. Collective: call after every rank finished writing."""
    rank, world = dist.get_rank(), dist.get_world_size()
    listing = [_checkpoint_files(directory) if rank == 0 else None]
    dist.broadcast_object_list(listing, src=0)
    mine = {}
    for name in listing[0]:
        if _checking_rank(name, world) == rank:
            path = os.path.join(directory, name)
            mine[name] = {"size": os.path.getsize(path), **({"sha256": _sha256(path)} if verify == "sha256" else {})}
    parts = [None] * world if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if rank == 0:
        files = dict(sorted((name, entry) for part in parts for name, entry in part.items()))
        write_text(os.path.join(directory, MANIFEST_FILE),
                          json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1))


def _read_manifest(directory: str) -> dict | str:
    """The manifest's file table, or why there is none."""
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.isdir(directory):
        return "the directory is missing"
    if not os.path.isfile(path):
        return _NO_MANIFEST
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return f"{MANIFEST_FILE} is unreadable ({err})"
    files = manifest.get("files") if isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT else None
    if not isinstance(files, dict) or not all(isinstance(e, dict) and isinstance(e.get("size"), int)
                                              for e in files.values()):
        return f"{MANIFEST_FILE} is not a {MANIFEST_FORMAT}"
    return files


def _file_problem(directory: str, name: str, entry: dict, verify: str) -> Optional[str]:
    path = os.path.join(directory, name)
    try:
        size = os.path.getsize(path)
        if size != entry["size"]:
            return f"{name} has {size} bytes, the manifest says {entry['size']} (truncated or overwritten)"
        if verify == "sha256" and "sha256" in entry and _sha256(path) != entry["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest (corrupted)"
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as err:
        return f"{name} is unreadable ({err.strerror})"
    return None


def read_common_state(directory: str) -> dict[str, Any]:
    """The common (not sharded) state of the checkpoint ``directory``: the iteration, this project's
    ``run_info``, Megatron-LM's ``args``. :class:`CheckpointError` (one line) where this megatron-core
    cannot read it, naming what can: Megatron-Core 0.17+ keeps it inside the shards (no common.pt),
    which 0.16 cannot read."""
    if mcore.MCORE_VERSION < mcore.Version("0.17") and not os.path.isfile(os.path.join(directory, COMMON_FILE)) \
            and os.path.isfile(os.path.join(directory, "metadata.json")):
        installed = f"megatron-core {mcore.MCORE_VERSION}"
        if os.path.isfile(os.path.join(directory, MANIFEST_FILE)):
            raise CheckpointError(f"{directory} was saved by megatron-core >= 0.17 (its common state is inside the "
                                  f"shards, no {COMMON_FILE}), which {installed} cannot read: install megatron-core "
                                  ">= 0.17 (docs/compat.md)")
        raise CheckpointError(f"{directory} is a Megatron-LM checkpoint (recipes/pretrain_gpt.py; no {MANIFEST_FILE}, "
                              f"its common state inside the shards): --pretrained reads it, with megatron-core >= 0.17; "
                              f"{installed} cannot (docs/compat.md shows how to install 0.17+)")
    try:
        return dist_checkpointing.load_common_state_dict(directory)
    except Exception as err:  # noqa: BLE001 - a damaged common state surfaces as torch/pickle/DCP errors
        raise CheckpointError(f"{directory}: its common state cannot be read ({type(err).__name__}: "
                              f"{_one_line(err)})") from None


def read_run_state(directory: str) -> dict[str, Any]:
    """:func:`read_common_state` of a checkpoint this project wrote (recipes/finetune.py, ``python -m
    recipes.hf import``), which records its ``run_info``; :class:`CheckpointError` naming the flag that
    reads any other (a Megatron-LM checkpoint: ``--pretrained``)."""
    common = read_common_state(directory)
    if "run_info" in common:
        return common
    if "args" in common:
        raise CheckpointError(f"{directory} is a Megatron-LM checkpoint (recipes/pretrain_gpt.py): --pretrained reads "
                              "it; --load reads checkpoints of recipes/finetune.py and python -m recipes.hf import")
    raise CheckpointError(f"{directory} records no run_info (not written by recipes/finetune.py or python -m "
                          "recipes.hf import)")


def verify_checkpoint(directory: str, verify: str = "sha256") -> Optional[str]:
    """Why ``directory`` is not a complete checkpoint, or ``None`` if it is: its manifest missing or
    unreadable, or a listed file missing, of another size or (``verify="sha256"``) content. Every
    rank checks its share of the files; all return the same answer. Collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest = [_read_manifest(directory) if rank == 0 else None]
    dist.broadcast_object_list(manifest, src=0)
    if isinstance(manifest[0], str):
        if manifest[0] == _NO_MANIFEST and os.path.isfile(os.path.join(directory, LEGACY_COMPLETE_MARK)):
            # written before checkpoints carried a manifest (saves are staged in .tmp and renamed
            # only after it now, so an iter_* directory without one is older): keep it loadable, if it
            # is one of this project's (a Megatron-LM checkpoint of 0.17+, with its common state in the
            # shards, has none either: named, not skipped)
            if not os.path.isfile(os.path.join(directory, COMMON_FILE)):
                read_run_state(directory)
            _say(f"{directory} has no {MANIFEST_FILE} (saved before checkpoints were verified): loading it unverified")
            return None
        return manifest[0]
    problem = None
    for name, entry in manifest[0].items():
        if _checking_rank(name, world) == rank:
            problem = _file_problem(directory, name, entry, verify)
            if problem:
                break
    problems = [None] * world
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


def _tracked_iteration(root: str) -> tuple[Optional[int], Optional[str]]:
    """The iteration ``latest_checkpointed_iteration.txt`` names (None if absent or garbage), and
    its text when that is not an iteration number."""
    try:
        with open(os.path.join(root, LATEST_FILE), "rb") as f:
            raw = f.read(64)
    except FileNotFoundError:
        return None, None
    except OSError as err:
        return None, f"unreadable ({err.strerror})"
    text = raw.decode("utf-8", "replace").strip()
    return (int(text), None) if text.isdigit() else (None, f"holds {text!r}, not an iteration number")


def _iterations_on_disk(root: str) -> list[int]:
    """Iterations of the ``iter_*`` directories under ``root`` (staging ``.tmp`` ones excluded), newest first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = (_ITERATION_DIR.fullmatch(n) for n in names)
    return sorted((int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0)))), reverse=True)


def is_checkpoint_directory(path: str) -> bool:
    """Whether ``path`` is one checkpoint (an ``iter_*`` directory), not a save root."""
    return not os.path.exists(os.path.join(path, LATEST_FILE)) and (
        _ITERATION_DIR.fullmatch(os.path.basename(os.path.normpath(path))) is not None
        or os.path.isfile(os.path.join(path, "metadata.json")))


def _candidates(root: str) -> tuple[list[int], list[str], Optional[str]]:
    """Checkpoints to try under a save root (newest first), notes on its "latest" file, and why
    there is nothing to try (``None``: nothing was ever saved there). The "latest" file decides
    (users roll back by editing it); when it is garbage, dangling or absent, every ``iter_*``
    directory is a candidate."""
    on_disk = _iterations_on_disk(root)
    tracked, garbage = _tracked_iteration(root)
    latest = os.path.join(root, LATEST_FILE)
    if tracked is not None and tracked in on_disk:
        return [i for i in on_disk if i <= tracked], [], None
    if garbage is not None:
        problem = f"{latest} {garbage}"
    elif tracked is not None:
        problem = f"{latest} names iteration {tracked}, but {_iteration_dir(root, tracked)} is missing"
    else:
        problem = None if not on_disk else f"{root} has iter_* directories but no {LATEST_FILE}"
    if not on_disk:
        return [], [], problem and f"{problem}, and there is no iter_* directory"
    return on_disk, [f"{problem}: using the newest complete iter_* directory instead"], None


def find_checkpoint(path: str, verify: str = "sha256", allow_none: bool = False) -> Optional[str]:
    """The verified checkpoint directory ``--load path`` resumes from. Collective.

    ``path`` is a save root (its latest checkpoint; older ``iter_*`` directories are the fallback
    when that one fails :func:`verify_checkpoint`, each skipped one reported in a line) or one
    ``iter_*`` directory (no fallback). Raises :class:`CheckpointError` when nothing complete is
    there; returns ``None`` instead when ``path`` holds no checkpoint at all and ``allow_none``
    (the first run of a job that resumes from its own ``--save``)."""
    if is_checkpoint_directory(path):
        watchdog.progress(f"verifying {path}")
        problem = verify_checkpoint(path, verify)
        if problem:
            raise CheckpointError(f"{path} is not a complete checkpoint: {problem}")
        return path
    scan = [_candidates(path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(scan, src=0)
    candidates, notes, nothing_to_try = scan[0]
    if not candidates:
        if nothing_to_try:
            raise CheckpointError(f"no complete checkpoint under {path}: {nothing_to_try}")
        if allow_none:
            return None
        raise CheckpointError(f"no checkpoint at {path!r} (neither {LATEST_FILE} nor a dist_checkpointing directory)")
    for note in notes:
        _say(note)
    skipped = []
    for position, iteration in enumerate(candidates):
        directory = _iteration_dir(path, iteration)
        watchdog.progress(f"verifying {directory}")
        problem = verify_checkpoint(directory, verify)
        if problem is None:
            return directory
        skipped.append(f"{os.path.basename(directory)}: {problem}")
        if position + 1 < len(candidates):  # after the last one, the error says it all
            _say(f"skipping {directory}: {problem}; falling back to an older checkpoint")
    raise CheckpointError(f"no complete checkpoint under {path} ({'; '.join(skipped)}): move the damaged "
                          "checkpoints away or point --load at another directory")


def resolve_checkpoint(path: str, verify: str = "sha256") -> str:
    """The verified checkpoint directory for ``--load path`` (see :func:`find_checkpoint`). Collective."""
    return find_checkpoint(path, verify)


def save_checkpoint(
    root: str, model, optimizer, scheduler, progress: TrainingProgress, run_info: dict[str, Any],
    placement: Optional[ExpertPlacement] = None, verify: str = "sha256",
) -> str:
    """Save everything under ``root``; returns the checkpoint directory. Collective.

    A model placed with a CAP placement is saved in its physical expert order, with the placement
    recorded next to it (``expert_placement.json``; see :mod:`megatron_llep.integrations.placement` for
    restoring the original order). ``verify``: what the manifest records, ``"sha256"`` (sizes and
    checksums) or ``"size"``.

    A save that fails on any rank (a full disk) raises :class:`CheckpointSaveError` on every rank,
    once its partial files are removed (they would hold the space every retry needs): the ranks
    agree after each step, so none is left waiting in a collective the failed one never joins."""
    final = _iteration_dir(root, progress.iteration)
    staging = final + ".tmp"
    rank = dist.get_rank()
    watchdog.progress(f"saving {final}")
    state = _sharded_state(model, optimizer, is_loading=False)
    state.update(
        iteration=progress.iteration,
        consumed_samples=progress.consumed_samples,
        scheduler=scheduler.state_dict(),
        run_info=run_info,
        world_size=dist.get_world_size(),
    )

    recorded: list[BaseException] = []  # write errors, where they happened (mcore.recorded_checkpoint_write_errors)

    def stage() -> None:
        if rank == 0:
            os.makedirs(root, exist_ok=True)
            for name in os.listdir(root):  # failed or killed saves' (one run per --save: recipes/runtime/save_lock.py)
                if _STAGING_DIR.fullmatch(name):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            os.makedirs(staging)

    def write() -> None:
        mcore.collect_checkpoint_writes_in_process()
        with mcore.recorded_checkpoint_write_errors(recorded), writers_die_with_this_process():
            dist_checkpointing.save(state, staging)
        if rank == 0 and placement is not None:
            write_checkpoint_placement(staging, placement)

    def publish() -> None:
        if rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
            fsync_directory(root)
            write_text(os.path.join(root, LATEST_FILE), str(progress.iteration))

    sizes = [0] * dist.get_world_size()
    dist.all_gather_object(sizes, _bytes_to_write(state))
    for step in (stage, write, lambda: write_manifest(staging, verify), publish):
        failure = _agreed_failure(step, recorded)
        if failure:
            if rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
                if latest_iteration(root) != progress.iteration:
                    shutil.rmtree(final, ignore_errors=True)
            raise CheckpointSaveError(_save_failure_message(root, progress.iteration, staging, failure, sum(sizes)))
    return final


@contextlib.contextmanager
def agreed_saves() -> Iterator[None]:
    """Inside the block, each synchronous ``dist_checkpointing.save`` another loop makes (Megatron-LM's,
    into ``<save>/iter_XXXXXXX``) is agreed by every rank as :func:`save_checkpoint`'s are: a write that
    fails on any rank (a full disk) removes the partial directory (rank 0; not one the "latest" file
    names) and raises :class:`CheckpointSaveError` on every rank, before the loop records the save as
    its latest. Collective."""
    original = dist_checkpointing.save

    def save(state: dict, directory: str, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("async_sharded_save"):  # its writes happen later, in another process
            return original(state, directory, *args, **kwargs)
        recorded: list[BaseException] = []
        sizes = [0] * dist.get_world_size()
        dist.all_gather_object(sizes, _bytes_to_write(state))
        result = []

        def write() -> None:
            with mcore.recorded_checkpoint_write_errors(recorded):
                result.append(original(state, directory, *args, **kwargs))

        failure = _agreed_failure(write, recorded)
        if not failure:
            return result[0]
        root, name = os.path.split(os.path.normpath(str(directory)))
        match = _ITERATION_DIR.fullmatch(name)
        iteration = int(match.group(1)) if match else -1
        if dist.get_rank() == 0 and latest_iteration(root) != iteration:
            shutil.rmtree(directory, ignore_errors=True)
        raise CheckpointSaveError(_save_failure_message(root, iteration, str(directory), failure, sum(sizes)))

    dist_checkpointing.save = save
    try:
        yield
    finally:
        dist_checkpointing.save = original


def _agreed_failure(step: Callable[[], None], recorded: list[BaseException]) -> Optional[str]:
    """Run this rank's part of a save step; every rank gets the first rank's error that says most
    (one ``recorded`` where it happened, else one raised), ``None`` when all succeeded. Collective."""
    raised = None
    try:
        step()
    except (Exception, CheckpointException) as err:  # every rank must get to the agreement below
        raised = err
    errors = [*recorded[:1], *([raised] if raised else [])]
    mine = [f"rank {dist.get_rank()}: {_one_line(e)}" for e in errors]
    # an error with an errno (No space left on device) names the cause; another rank's may only see its effect
    # (torch's file writer: "unexpected pos", a write cut short)
    has_errno = any(_errno_of(e) is not None for e in errors)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (bool(recorded), has_errno, mine))
    found = sorted((not was_recorded, not with_errno, rank, lines[0])
                   for rank, (was_recorded, with_errno, lines) in enumerate(everyone) if lines)
    return found[0][3] if found else None


def _errno_of(err: BaseException) -> Optional[int]:
    """The errno of ``err`` or of an error it was raised from, None without one."""
    while err is not None:
        if isinstance(err, OSError) and err.errno is not None:
            return err.errno
        err = err.__cause__ or err.__context__
    return None


def _one_line(err: BaseException) -> str:
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if "unexpected pos" in line and "inline_container" in line:  # torch's zip writer after a short write
        line = f"a write was cut short, as on a full disk ({line})"
    return line


def _bytes_to_write(state: dict[str, Any]) -> int:
    """The bytes of the tensors this rank writes of ``state`` (the shards it holds the main copy of)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, is_main_replica

    def tensor_bytes(value: Any) -> int:
        if torch.is_tensor(value):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(tensor_bytes(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(tensor_bytes(v) for v in value)
        return 0

    return sum(tensor_bytes(v.data) for v in nested_values(state)
               if isinstance(v, ShardedBase) and is_main_replica(v.replica_id))


def _save_failure_message(root: str, iteration: int, staging: str, failure: str, tensor_bytes: int) -> str:
    """One line: what failed where, what was removed, the space a save needs (what the latest
    checkpoint takes, else this save's tensors) and the free space, what to do."""
    latest = latest_iteration(root)
    kept, needed = "nothing was saved before", tensor_bytes
    if latest is not None and os.path.isdir(_iteration_dir(root, latest)):
        kept = f"the latest checkpoint is still iteration {latest}"
        needed = sum(os.path.getsize(os.path.join(_iteration_dir(root, latest), name))
                     for name in _checkpoint_files(_iteration_dir(root, latest)))
    free = shutil.disk_usage(root).free if os.path.isdir(root) else 0
    return (f"saving iteration {iteration} to {root} failed ({failure}); removed its partial {staging}, {kept}; "
            f"a save needs about {readable_bytes(needed)}, {root} has {readable_bytes(free)} free: free space there "
            f"or give --save another directory, then resume with --load {root}")


def load_checkpoint(
    directory: str, model, optimizer, scheduler, run_info: dict[str, Any], strict_keys: tuple[str, ...],
    placement: Optional[ExpertPlacement] = None,
) -> TrainingProgress:
    """Restore the checkpoint ``directory`` (from :func:`find_checkpoint`, which verified it) into
    freshly built objects.

    ``strict_keys`` name the ``run_info`` entries that must match the saved run (model shape,
    sequence length, ...), and the model's expert placement must be the checkpoint's: resuming a
    different model fails with a message instead of loading mismatched tensors. Collective.
    """
    watchdog.progress(f"loading {directory}")
    saved_placement = read_checkpoint_placement(directory)
    if not same_expert_order(saved_placement, placement):
        raise CheckpointError(f"{directory} stores experts in {'a CAP placement' if saved_placement else 'original order'}"
                              f" but this run uses {'a different placement' if placement else 'none'} (--llep-placement)")
    common = read_run_state(directory)
    saved_info = common["run_info"]
    mismatched = {k: (saved_info.get(k), run_info.get(k)) for k in strict_keys if saved_info.get(k) != run_info.get(k)}
    if mismatched:
        details = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in mismatched.items())
        raise CheckpointError(f"{directory} was saved by an incompatible run ({details})")
    same_world = common.get("world_size") == dist.get_world_size()
    state = _sharded_state(model, optimizer, is_loading=True)
    if not same_world:  # RNG shards are per global rank; a resharded resume starts fresh RNG
        state.pop("rng_state")
    mismatch = tensor_mismatch(state, directory)
    if mismatch:
        raise CheckpointError(f"{directory} does not hold this run's model: {mismatch}")
    loaded = dist_checkpointing.load(state, directory)
    model.module.load_state_dict(loaded["model"])
    with torch.no_grad():  # fp32 main params are views of the (grad-requiring) model params
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(optimizer, loaded["optimizer"])
    scheduler.load_state_dict(common["scheduler"])
    if same_world:
        _set_rng_state(loaded["rng_state"])
    return TrainingProgress(iteration=int(common["iteration"]), consumed_samples=int(common["consumed_samples"]))


def tensor_mismatch(state: dict[str, Any], directory: str) -> Optional[str]:
    """How the model tensors of the sharded ``state`` (a ``{"model": ...}`` subtree is what is
    compared) differ from those the checkpoint ``directory`` holds, in a phrase naming the first
    tensor that differs in shape or is missing there (None: they match). Read from the checkpoint's
    metadata, before a load that would fail with dist_checkpointing's exception."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = dist_checkpointing.load_tensors_metadata(directory)
    for tensor in nested_values(state.get("model", state)):
        if not isinstance(tensor, ShardedTensor):
            continue
        if tensor.key not in saved:
            return f"the model built here has {tensor.key}, which {directory} lacks"
        if tuple(saved[tensor.key].global_shape) != tuple(tensor.global_shape):
            return (f"{tensor.key} has shape {tuple(saved[tensor.key].global_shape)} in {directory}, "
                    f"{tuple(tensor.global_shape)} in the model built here")
    return None


def load_model_weights(directory: str, model) -> None:
    """Only the model weights of the checkpoint ``directory`` (from :func:`find_checkpoint`) into
    ``model`` (DDP-wrapped or bare), for evaluation, generation and benchmarks: no optimizer, schedule
    or RNG, so the optimizer may be set up differently from the run that saved it, or be absent.
    The experts land in the order the checkpoint stores them (see :func:`load_checkpoint`). Collective."""
    watchdog.progress(f"loading the model weights of {directory}")
    module = getattr(model, "module", model)
    state = {"model": module.sharded_state_dict(metadata=SHARDING_METADATA)}
    mismatch = tensor_mismatch(state, directory)
    if mismatch:
        raise CheckpointError(f"{directory} does not hold the model rebuilt from what it records: {mismatch}")
    loaded = dist_checkpointing.load(state, directory)
    module.load_state_dict(loaded["model"])


def latest_iteration(root: str) -> Optional[int]:
    """The iteration ``root``'s "latest" file names (``None`` if it is absent or not a number)."""
    return _tracked_iteration(root)[0]
