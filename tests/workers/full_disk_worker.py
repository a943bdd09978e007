"""Rank-side code of tests/entry_points/test_checkpoint_recovery.py's full-disk tests, started by torchrun:
recipes/finetune.py with one write of one save failing as on a full disk (half written, then
``OSError(ENOSPC)``).

Usage: ``full_disk_worker.py WHAT RANK ITERATION FINETUNE_ARGS...``. WHAT is ``shard`` (RANK's
shard file of the save of ITERATION) or ``metadata`` (its ``metadata.json``, written by rank 0
alone before a barrier the other ranks wait in).
"""

from __future__ import annotations

import errno
import io
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


class FullDiskFile(io.FileIO):
    """A file on a disk that fills up: the first write stores half its bytes, then fails."""

    def write(self, data) -> int:
        data = bytes(data)
        super().write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def main(what: str, rank: int, iteration: int, argv: list[str]) -> None:
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    staging = f"iter_{iteration:07d}.tmp"
    if int(os.environ["RANK"]) == rank and what == "shard":
        def open_shard(path, mode="r", *args, **kwargs):
            return FullDiskFile(path, "wb") if staging in str(path) and "w" in mode else open(path, mode, *args, **kwargs)

        filesystem_async.open = open_shard  # the name its writer opens shard files with
    elif int(os.environ["RANK"]) == rank and what == "metadata":
        save_config = serialization.save_config

        def save_config_on_a_full_disk(config, checkpoint_dir):
            if staging not in str(checkpoint_dir):
                return save_config(config, checkpoint_dir)
            with FullDiskFile(os.path.join(checkpoint_dir, "metadata.json"), "wb") as f:
                f.write(b'{"sharded_backend": "torch_dist"}')

        serialization.save_config = save_config_on_a_full_disk
    from recipes import finetune

    finetune.main(argv)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
