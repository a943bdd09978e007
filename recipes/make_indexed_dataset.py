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
import signal
import sys
from typing import Optional, Sequence

from megatron_llep.writable import OutputError
from recipes.runtime import sft_data
from recipes.runtime.indexed_data import DEFAULT_JSON_KEY, InputError, build_indexed_dataset, megatron_tokenizer_flags


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="a .jsonl file (one document per record) or a text file (blank-line-separated)")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>_text_document.bin/.idx")
    parser.add_argument("--tokenizer", default=sft_data.DEFAULT_TOKENIZER,
                        help="byte-tokenizer file (default) or a local Hugging Face tokenizer.json / its directory")
    parser.add_argument("--json-key", default=None,
                        help=f"the JSONL field holding a document's text (default: {DEFAULT_JSON_KEY!r}, else "
                             "prompt + response, else the messages' contents)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.input):
        parser.error(f"{args.input} is not a file")
    try:
        prefix, documents, tokens = build_indexed_dataset(args.input, args.output_prefix, args.tokenizer, args.json_key)
        flags = megatron_tokenizer_flags(args.tokenizer)
    except (InputError, sft_data.DataError, OSError) as err:
        print(f"make_indexed_dataset: error: {err}", file=sys.stderr)
        raise SystemExit(1 if isinstance(err, OutputError) else 2) from None
    except KeyboardInterrupt:  # Ctrl-C: the staged files are gone already, the previous pair untouched
        print(f"make_indexed_dataset: stopped by SIGINT: nothing written to {args.output_prefix}_text_document.*",
              file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    print(f"wrote {prefix}.bin/.idx: {documents} documents, {tokens} tokens; train with --data-path {prefix} {flags}")


if __name__ == "__main__":
    main()
