"""Megatron indexed datasets (``.bin``/``.idx``) from a text or JSONL file with a local tokenizer, written
with Megatron-Core's own ``IndexedDatasetBuilder`` (recipes/make_indexed_dataset.py, recipes/corpus.py)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import numpy as np

from megatron_llep.writable import StagedOutputs
from recipes.runtime import sft_data
from recipes.runtime.cpu_warnings import quiet_known_cpu_warnings

DEFAULT_JSON_KEY = "text"


class InputError(ValueError):
    """A record or file that cannot become a document (the message names the file and line)."""


def _record_text(row: dict, key: Optional[str], where: str) -> str:
    """A JSONL record's document: ``row[key]``; without a key (``--json-key`` not given), ``row["text"]``,
    else prompt + response, else the messages' contents."""
    if key is not None:
        if key not in row:
            raise InputError(f"{where}: no {key!r} field, which --json-key names; give the field that holds the "
                             f"documents' text (this record has {', '.join(map(repr, row)) or 'no fields'})")
        text = row[key]
    elif DEFAULT_JSON_KEY in row:
        text = row[DEFAULT_JSON_KEY]
    elif "prompt" in row and "response" in row:
        text = f"{row['prompt']}\n{row['response']}"
    elif isinstance(row.get("messages"), list):
        text = "\n".join(m.get("content", "") if isinstance(m, dict) else m for m in row["messages"])
    else:
        raise InputError(f"{where}: no {DEFAULT_JSON_KEY!r} field (nor prompt/response or messages); choose the field "
                         "with --json-key")
    if not isinstance(text, str):
        raise InputError(f"{where}: the document text must be a string, got {type(text).__name__}")
    return text


def read_documents(path: str, json_key: Optional[str] = None) -> Iterator[str]:
    """Documents of a ``.jsonl`` file (one per record; ``json_key``: see :func:`_record_text`) or of a
    text file (blank-line-separated)."""
    if path.endswith(".jsonl"):  # the fine-tuning data's reader: file:line errors, UTF-8 BOM
        for where, row in sft_data.jsonl_objects(path, "input file"):
            yield _record_text(row, json_key, where)
        return
    try:
        with open(path, encoding="utf-8") as f:
            yield from (doc.strip() for doc in f.read().split("\n\n") if doc.strip())
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def build_indexed_dataset(input_path: str, output_prefix: str, tokenizer_path: str = sft_data.DEFAULT_TOKENIZER,
                          json_key: Optional[str] = None, outputs: Optional[StagedOutputs] = None,
                          ) -> tuple[str, int, int]:
    """Write ``<output_prefix>_text_document.{bin,idx}``; returns the prefix to train on, the number
    of documents and of tokens. Both files are written whole or not at all (a previous pair stays
    as it was after any failure): staged into ``outputs`` (committed by its owner) or committed here."""
    quiet_known_cpu_warnings()
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    from recipes.runtime.pretrain_checks import open_indexed_dataset

    if os.path.isdir(output_prefix) or output_prefix.endswith(os.sep):
        raise InputError(f"--output-prefix {output_prefix} is a directory; give a file-name prefix inside it "
                         f"(e.g. {os.path.join(output_prefix, 'corpus')})")
    tokenizer = sft_data.load_tokenizer(tokenizer_path)
    prefix = f"{output_prefix}_text_document"
    documents = tokens = 0
    with contextlib.nullcontext(outputs) if outputs is not None else StagedOutputs("--output-prefix") as staging:
        bin_file = staging.stage(get_bin_path(prefix))
        builder = IndexedDatasetBuilder(bin_file.temporary, dtype=DType.optimal_dtype(tokenizer.vocab_size))
        for text in read_documents(input_path, json_key):
            ids = np.asarray([*tokenizer.encode(text), tokenizer.eos_id], dtype=np.int64)
            builder.add_document(ids, [ids.size])
            documents += 1
            tokens += ids.size
        builder.data_file.flush()  # a full disk is met while the .bin is the file being written, and named so
        builder.finalize(staging.stage(get_idx_path(prefix)).temporary)
        if documents == 0:
            raise InputError(f"{input_path}: no documents")
        # read back what reached the disk: a full disk can truncate a write without an error
        needed = f"is the disk full? It needs about {tokens * np.dtype(builder.dtype).itemsize:,} bytes"
        try:
            written = open_indexed_dataset(bin_file.temporary[:-len(".bin")])
        except ValueError as err:
            raise InputError(f"{bin_file.final}: the written dataset is incomplete ({err}); {needed}") from None
        if len(written) != documents or int(written.sequence_lengths.sum()) != tokens or \
                os.path.getsize(bin_file.temporary) != tokens * written.index.dtype_size:
            raise InputError(f"{bin_file.final}: the written dataset is incomplete "
                             f"({os.path.getsize(bin_file.temporary)} bytes); {needed}")
    return prefix, documents, tokens


def megatron_tokenizer_flags(tokenizer_path: str) -> str:
    """The Megatron-LM tokenizer flags that read ids written with this tokenizer."""
    tokenizer = sft_data.load_tokenizer(tokenizer_path)
    if isinstance(tokenizer, sft_data.ByteTokenizer):
        if tokenizer.eos_id != tokenizer.vocab_size - 1:
            return f"--tokenizer-type NullTokenizer --vocab-size {tokenizer.vocab_size} --null-tokenizer-eod-id {tokenizer.eos_id}"
        return f"--tokenizer-type NullTokenizer --vocab-size {tokenizer.vocab_size}"
    directory = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(os.path.abspath(tokenizer_path))
    return f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {directory}"
