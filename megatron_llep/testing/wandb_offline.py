"""Read the history of an offline wandb run back from its ``run-<id>.wandb`` file.

wandb 0.31 cannot query offline runs through its API, so tests (and users checking a run before
syncing it) parse the file: LevelDB log format (a 7-byte ``:W&B`` header, 32 KiB blocks, records
with a 7-byte header: crc u32, length u16, type u8 — 1 full, 2 first, 3 middle, 4 last), each
payload a ``wandb_internal_pb2.Record``. This depends on wandb's internal format; wandb is pinned
to 0.31.x in setup.py.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Any

_HEADER = 7
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    pos, chunks = _HEADER, []
    while pos + 7 <= len(data):
        block_left = _BLOCK - pos % _BLOCK
        if block_left < 7:  # block trailer padding
            pos += block_left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        body = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
            continue
        if kind == _FULL:
            yield body
        elif kind == _FIRST:
            chunks = [body]
        elif kind == _MIDDLE:
            chunks.append(body)
        elif kind == _LAST:
            chunks.append(body)
            yield b"".join(chunks)
            chunks = []


def run_file(run_dir: str) -> str:
    """The ``.wandb`` file of a run directory (``.../offline-run-*``), or of the latest run under
    a wandb base directory."""
    for pattern in ("run-*.wandb", "wandb/latest-run/run-*.wandb", "latest-run/run-*.wandb"):
        found = sorted(glob.glob(os.path.join(run_dir, pattern)))
        if found:
            return found[-1]
    raise FileNotFoundError(f"no run-*.wandb file under {run_dir}")


def read_history(path: str) -> list[dict[str, Any]]:
    """Every logged history row (``run.log``) as a dict of key -> decoded JSON value."""
    from wandb.proto import wandb_internal_pb2

    if os.path.isdir(path):
        path = run_file(path)
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a wandb run file")
    rows = []
    for payload in _payloads(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows
