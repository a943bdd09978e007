"""Turn a small text or JSONL file into a Megatron indexed dataset (``.bin``/``.idx``) for
``recipes/pretrain_gpt.py``, with a local tokenizer (nothing is downloaded).

Megatron-LM's ``tools/preprocess_data.py`` does this at scale (it is not in the megatron-core wheel);
this script writes the same format with Megatron-Core's own ``IndexedDatasetBuilder``, one document
per JSONL record (or per blank-line-separated paragraph of a text file), each ended by the
tokenizer's end-of-document id, and names the output as preprocess_data.py does:
``<output-prefix>_text_document.{bin,idx}``::

    python recipes/make_indexed_dataset.py recipes/data/tiny_sft.jsonl --output-prefix data/tiny

The default tokenizer is the byte tokenizer of ``recipes/data/`` (ids 0-255 are UTF-8 bytes, 257 ends
a document): train on it with ``--tokenizer-type NullTokenizer --vocab-size 258``, whose
end-of-document id is ``vocab_size - 1``. A local Hugging Face ``tokenizer.json`` works too
(``--tokenizer DIR``; train with ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Iterator, Optional, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recipes import data as sft_data  # noqa: E402
from recipes.cpu_warnings import quiet_known_cpu_warnings  # noqa: E402


class InputError(ValueError):
    """A record or file that cannot become a document (the message names the file and line)."""


def _record_text(row: dict, key: str, where: str) -> str:
    """A JSONL record's document: ``row[key]``, else prompt + response, else the messages' contents."""
    if key in row:
        text = row[key]
    elif "prompt" in row and "response" in row:
        text = f"{row['prompt']}\n{row['response']}"
    elif isinstance(row.get("messages"), list):
        text = "\n".join(m.get("content", "") if isinstance(m, dict) else m for m in row["messages"])
    else:
        raise InputError(f"{where}: no {key!r} field (nor prompt/response or messages); choose the field with --json-key")
    if not isinstance(text, str):
        raise InputError(f"{where}: the document text must be a string, got {type(text).__name__}")
    return text


def read_documents(path: str, json_key: str = "text") -> Iterator[str]:
    """Documents of a ``.jsonl`` file (one per record) or of a text file (blank-line-separated)."""
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
                          json_key: str = "text") -> tuple[str, int, int]:
    """Write ``<output_prefix>_text_document.{bin,idx}``; returns the prefix to train on, the number
    of documents and of tokens."""
    quiet_known_cpu_warnings()
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if os.path.isdir(output_prefix) or output_prefix.endswith(os.sep):
        raise InputError(f"--output-prefix {output_prefix} is a directory; give a file-name prefix inside it "
                         f"(e.g. {os.path.join(output_prefix, 'corpus')})")
    tokenizer = sft_data.load_tokenizer(tokenizer_path)
    prefix = f"{output_prefix}_text_document"
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    outputs = (get_bin_path(prefix), get_idx_path(prefix))
    documents = tokens = 0
    try:
        builder = IndexedDatasetBuilder(outputs[0], dtype=DType.optimal_dtype(tokenizer.vocab_size))
        for text in read_documents(input_path, json_key):
            ids = np.asarray([*tokenizer.encode(text), tokenizer.eos_id], dtype=np.int64)
            builder.add_document(ids, [ids.size])
            documents += 1
            tokens += ids.size
        builder.finalize(outputs[1])
        if documents == 0:
            raise InputError(f"{input_path}: no documents")
        # read back what reached the disk: a full disk can truncate a write without an error
        written = IndexedDataset(prefix)
        if len(written) != documents or int(written.sequence_lengths.sum()) != tokens or \
                os.path.getsize(outputs[0]) != tokens * written.index.dtype_size:
            raise InputError(f"{outputs[0]}: the written dataset is incomplete ({os.path.getsize(outputs[0])} bytes); "
                             f"is the disk full? It needs about {tokens * written.index.dtype_size:,} bytes")
    except BaseException:
        for path in outputs:  # no half-written dataset left to be trained on
            if os.path.exists(path):
                os.remove(path)
        raise
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


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="a .jsonl file (one document per record) or a text file (blank-line-separated)")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>_text_document.bin/.idx")
    parser.add_argument("--tokenizer", default=sft_data.DEFAULT_TOKENIZER,
                        help="byte-tokenizer file (default) or a local Hugging Face tokenizer.json / its directory")
    parser.add_argument("--json-key", default="text", help="the JSONL field holding a document's text")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.input):
        parser.error(f"{args.input} is not a file")
    try:
        prefix, documents, tokens = build_indexed_dataset(args.input, args.output_prefix, args.tokenizer, args.json_key)
        flags = megatron_tokenizer_flags(args.tokenizer)
    except (InputError, sft_data.DataError, OSError) as err:
        print(f"make_indexed_dataset: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {prefix}.bin/.idx: {documents} documents, {tokens} tokens; train with --data-path {prefix} {flags}")


if __name__ == "__main__":
    main()
