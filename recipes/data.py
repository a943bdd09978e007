"""Supervised fine-tuning data: a tokenizer from a local path and a JSONL file packed into
fixed-length training sequences with a loss mask.

JSONL lines (one JSON object per line, blank lines ignored) take one of three forms:

* ``{"prompt": "...", "response": "..."}`` — loss on the response (and the closing EOS) only;
* ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}``
  — loss on assistant turns only; every turn is ``"<role>: <content>\\n"``;
* ``{"text": "..."}`` — loss on every token.

Each sample becomes ``BOS tokens... EOS``. Samples are concatenated in a seeded order and cut into
windows of ``seq_length + 1`` tokens (inputs and shifted labels), as Megatron's GPT datasets pack
documents; the order is a pure function of (seed, sample index), so resuming from a consumed-sample
count reproduces the same batches.

Tokenizers (``--tokenizer PATH``): a Hugging Face ``tokenizer.json`` (file, or a directory holding
one; needs the ``tokenizers`` package), or this project's byte tokenizer file
(``{"type": "bytes", ...}``, shipped as ``recipes/data/byte_tokenizer.json``). Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Protocol

import numpy as np

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
DEFAULT_DATA = os.path.join(DATA_DIR, "tiny_sft.jsonl")
DEFAULT_TOKENIZER = os.path.join(DATA_DIR, "byte_tokenizer.json")


class DataError(ValueError):
    """Bad data or tokenizer input (the message names the file and line)."""


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus BOS/EOS: needs no vocabulary file and covers any text."""

    bos_id: int = 256
    eos_id: int = 257
    vocab_size: int = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HuggingFaceTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` package (no network)."""

    def __init__(self, path: str, bos_token: Optional[str] = None, eos_token: Optional[str] = None):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as err:
            raise DataError(f"{path}: reading a Hugging Face tokenizer.json needs `pip install tokenizers`") from err
        self._tok = _Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special_id(path, bos_token, ("<|startoftext|>", "<s>", "<|begin_of_text|>", "<｜begin▁of▁sentence｜>"))
        self.eos_id = self._special_id(path, eos_token, ("<|endoftext|>", "</s>", "<|end_of_text|>", "<｜end▁of▁sentence｜>"))

    def _special_id(self, path: str, name: Optional[str], candidates: tuple[str, ...]) -> int:
        for token in (name,) if name else candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        raise DataError(f"{path}: none of the special tokens {list((name,) if name else candidates)} is in the vocabulary")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer stored at ``path`` (see the module docstring for the accepted formats)."""
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise DataError(f"tokenizer not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: not a readable tokenizer JSON file ({err})") from err
    if spec.get("type") == "bytes":
        specials = spec.get("special_tokens", {})
        return ByteTokenizer(bos_id=int(specials.get("bos", 256)), eos_id=int(specials.get("eos", 257)),
                             vocab_size=int(spec.get("vocab_size", 258)))
    if "model" in spec:
        return HuggingFaceTokenizer(path)
    raise DataError(f"{path}: neither a byte tokenizer ({{\"type\": \"bytes\"}}) nor a Hugging Face tokenizer.json")


def _tokenize_sample(row: dict, tokenizer: Tokenizer, where: str) -> tuple[list[int], list[bool]]:
    """One JSONL record as token ids with a per-token loss flag."""
    ids, mask = [tokenizer.bos_id], [False]

    def add(text: object, train: bool, field_name: str) -> None:
        if not isinstance(text, str):
            raise DataError(f"{where}: field {field_name!r} must be a string, got {type(text).__name__}")
        piece = tokenizer.encode(text)
        ids.extend(piece)
        mask.extend([train] * len(piece))

    if "prompt" in row or "response" in row:
        if "prompt" not in row or "response" not in row:
            raise DataError(f"{where}: a prompt/response record needs both fields, got {sorted(row)}")
        add(row["prompt"], False, "prompt")
        add(row["response"], True, "response")
    elif "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise DataError(f"{where}: messages[{i}] needs 'role' and 'content'")
            add(f"{message['role']}: ", False, f"messages[{i}].role")
            add(message["content"] + "\n", message["role"] == "assistant", f"messages[{i}].content")
    elif "text" in row:
        add(row["text"], True, "text")
    else:
        raise DataError(f"{where}: expected 'prompt'+'response', 'messages' or 'text', got fields {sorted(row)}")
    ids.append(tokenizer.eos_id)
    mask.append(True)
    return ids, mask


def read_sft_jsonl(path: str, tokenizer: Tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every record of a JSONL file tokenized; errors name the file and line."""
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path}")
    samples = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not valid JSON ({err.msg})") from err
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            ids, mask = _tokenize_sample(row, tokenizer, where)
            samples.append((np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)))
    if not samples:
        raise DataError(f"{path}: no records")
    if max(int(ids.max()) for ids, _ in samples) >= tokenizer.vocab_size:
        raise DataError(f"{path}: tokenizer produced ids beyond its vocabulary size {tokenizer.vocab_size}")
    return samples


class PackedSFTDataset:
    """Samples packed into ``seq_length + 1`` token windows; window ``i`` is a pure function of
    (seed, i), so any rank can produce any window and a resumed run continues exactly."""

    def __init__(self, samples: list[tuple[np.ndarray, np.ndarray]], seq_length: int, seed: int):
        self.seq_length = seq_length
        order = np.random.default_rng(seed).permutation(len(samples))
        self._tokens = np.concatenate([samples[i][0] for i in order])
        self._loss_mask = np.concatenate([samples[i][1] for i in order])
        self.num_windows = (len(self._tokens) - 1) // seq_length
        if self.num_windows < 1:
            raise DataError(f"the data holds {len(self._tokens)} tokens, fewer than one sequence of {seq_length + 1}")

    def window(self, index: int) -> dict[str, np.ndarray]:
        """Window ``index`` (wrapping around the data: epochs repeat the same packing)."""
        start = (index % self.num_windows) * self.seq_length
        tokens = self._tokens[start : start + self.seq_length + 1]
        mask = self._loss_mask[start + 1 : start + self.seq_length + 1]
        return {"tokens": tokens[:-1], "labels": tokens[1:], "loss_mask": mask.astype(np.float32)}


def micro_batches(
    dataset: PackedSFTDataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> Iterator[dict[str, np.ndarray]]:
    """This data-parallel rank's micro-batches from ``consumed_samples`` on (Megatron's sampler
    order: a global batch's micro-batch ``j`` takes samples ``[j*mbs*dp + rank*mbs, ...)``)."""
    index = consumed_samples
    while True:
        first = index + dp_rank * micro_batch_size
        rows = [dataset.window(first + i) for i in range(micro_batch_size)]
        yield {key: np.stack([row[key] for row in rows]) for key in rows[0]}
        index += micro_batch_size * dp_size
