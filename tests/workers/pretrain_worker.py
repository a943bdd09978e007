"""Rank-side code of tests/integrations/test_pretrain.py, started by torchrun: several runs of
recipes/pretrain_gpt.py's ``main`` (Megatron-LM's ``pretrain``) in one process, one after another,
with Megatron-LM's global state destroyed in between (as its in-process restart does), so the
libraries are imported once.

Usage: ``pretrain_worker.py OUT_DIR CASES.json``. The spec lists indexed datasets to build first
(``{"datasets": [[input, output_prefix], ...]}``, with recipes/make_indexed_dataset.py, on rank 0;
what was written goes to ``OUT_DIR/datasets.json``) and runs (``"runs": [{"name", "argv",
"broken"}]``; ``broken``: a key of :data:`BROKEN_MAPPINGS`, a negative control). On the last rank, every value Megatron-LM writes to its TensorBoard writer (its own
``lm loss``/``grad-norm`` and the plugin's LLEP statistics) is recorded in ``OUT_DIR/<name>.json``
as ``{key: {iteration: value}}``. A recording writer stands in for TensorBoard, which is not a
dependency; wandb is the real, offline one.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


class RecordingWriter:
    """The part of TensorBoard's SummaryWriter Megatron-LM uses, keeping every scalar."""

    def __init__(self) -> None:
        self.scalars: dict[str, dict[int, float]] = defaultdict(dict)

    def add_scalar(self, key: str, value, step: int) -> None:
        self.scalars[key][int(step)] = float(value)

    def add_text(self, *args, **kwargs) -> None:
        pass

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def _wrong_expert_sent():
    """Negative control: the native rank sends the weights of the expert next to the borrowed one."""
    from megatron_llep.testing.moe import send_a_neighbouring_expert  # after the CPU patches

    with send_a_neighbouring_expert():
        yield


@contextlib.contextmanager
def _router_rows_stay():
    """Negative control: --llep-placement moves the experts but not their router rows."""
    from megatron_llep.integrations import placement as apply

    original = apply.router_expert_tensors
    apply.router_expert_tensors = lambda router, num_experts: []
    try:
        yield
    finally:
        apply.router_expert_tensors = original


@contextlib.contextmanager
def _loader_on_the_dropout_generator():
    """Negative control: Megatron-LM's data loaders draw from the generator dropout uses on CPU."""
    from megatron.training import training

    from megatron_llep.testing import megatron_training_cpu

    megatron_training_cpu.enable()
    own_generator = training.build_pretraining_data_loader
    training.build_pretraining_data_loader = own_generator.__wrapped__
    try:
        yield
    finally:
        training.build_pretraining_data_loader = own_generator


BROKEN_MAPPINGS = {"wrong_expert_sent": _wrong_expert_sent, "router_rows_stay": _router_rows_stay,
                   "loader_on_the_dropout_generator": _loader_on_the_dropout_generator}


def main(out_dir: str, spec_path: str) -> None:
    from megatron_llep.compat import megatron_training

    reason = megatron_training.missing_reason()
    if reason is not None:  # e.g. megatron.training does not import: the test skips with this reason
        with open(os.path.join(out_dir, "skip.txt"), "w") as f:
            f.write(reason)
        return
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.training import global_vars
    from megatron.training.training import destroy_global_state

    from megatron_llep.runtime.state import STATS
    from recipes import pretrain_gpt
    from recipes.runtime.indexed_data import build_indexed_dataset

    writers: list[RecordingWriter] = []
    set_tensorboard_writer = global_vars._set_tensorboard_writer

    def recording_tensorboard_writer(args) -> None:
        set_tensorboard_writer(args)  # Megatron-LM's own checks (it warns: TensorBoard is not installed)
        if args.tensorboard_dir and args.rank == args.world_size - 1:
            global_vars._GLOBAL_TENSORBOARD_WRITER = RecordingWriter()
            writers.append(global_vars._GLOBAL_TENSORBOARD_WRITER)

    global_vars._set_tensorboard_writer = recording_tensorboard_writer
    with open(spec_path) as f:
        spec = json.load(f)
    if not torch.distributed.is_initialized():  # Megatron-LM would start it; the dataset build needs it first
        torch.distributed.init_process_group("gloo")
    if torch.distributed.get_rank() == 0:
        built = []
        for source, output_prefix in spec["datasets"]:
            prefix, documents, tokens = build_indexed_dataset(source, output_prefix)
            written = IndexedDataset(prefix)  # read back by Megatron's own reader
            built.append({"prefix": prefix, "documents": documents, "tokens": tokens, "sequences": len(written),
                          "first": written[0].tolist(), "last_ids": sorted({int(seq[-1]) for seq in written})})
        with open(os.path.join(out_dir, "datasets.json"), "w") as f:
            json.dump(built, f)
    torch.distributed.barrier()
    from megatron_llep.testing.kept_returns import counting_gradient_returns

    for run in spec["runs"]:
        STATS.drain()
        with (BROKEN_MAPPINGS[run["broken"]]() if run.get("broken") else contextlib.nullcontext(),
              counting_gradient_returns({}) as returns):
            pretrain_gpt.main(run["argv"])
        destroy_global_state()
        if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            with open(os.path.join(out_dir, f"{run['name']}.json"), "w") as f:
                json.dump(writers[-1].scalars, f)
            with open(os.path.join(out_dir, f"{run['name']}.returns.json"), "w") as f:
                json.dump(returns, f)
        torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
