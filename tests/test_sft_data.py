"""SFT data: tokenizers from local files, JSONL records to tokens with loss masks, packing and the
resumable data-parallel sampler (checked against hand-computed expectations)."""

import json

import numpy as np
import pytest

from recipes.data import (
    DEFAULT_DATA,
    DEFAULT_TOKENIZER,
    ByteTokenizer,
    DataError,
    PackedSFTDataset,
    load_tokenizer,
    micro_batches,
    read_sft_jsonl,
)


def _write(tmp_path, lines, name="sft.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_shipped_data_and_tokenizer_load():
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER)
    assert tokenizer == ByteTokenizer()
    samples = read_sft_jsonl(DEFAULT_DATA, tokenizer)
    assert len(samples) == 240
    assert all(ids[0] == 256 and ids[-1] == 257 and mask[-1] and not mask[0] for ids, mask in samples)


def test_prompt_response_trains_on_the_response_only(tmp_path):
    (ids, mask), = read_sft_jsonl(_write(tmp_path, [json.dumps({"prompt": "Hi", "response": "é!"})]), ByteTokenizer())
    assert ids.tolist() == [256, ord("H"), ord("i"), 0xC3, 0xA9, ord("!"), 257]
    assert mask.tolist() == [False, False, False, True, True, True, True]


def test_messages_train_on_assistant_turns_only(tmp_path):
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    (ids, mask), = read_sft_jsonl(_write(tmp_path, [json.dumps(row)]), ByteTokenizer())
    text = bytes(ids[1:-1].tolist()).decode()
    assert text == "user: q\nassistant: a\n"
    trained = bytes(ids[mask][:-1].tolist()).decode()  # without the EOS
    assert trained == "a\n"


def test_text_records_train_on_everything_but_bos(tmp_path):
    (ids, mask), = read_sft_jsonl(_write(tmp_path, ['{"text": "abc"}', ""]), ByteTokenizer())
    assert mask.tolist() == [False, True, True, True, True]


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "a", "response": "b"}', '{"prompt": "a"'], ":2: not valid JSON"),
        (['["a"]'], ":1: expected a JSON object"),
        (['{"prompt": "a"}'], ":1: a prompt/response record needs both fields"),
        (['{"response": 3, "prompt": "a"}'], ":1: field 'response' must be a string"),
        (['{"messages": [{"role": "user"}]}'], ":1: messages[0] needs 'role' and 'content'"),
        (['{"title": "x"}'], ":1: expected 'prompt'+'response', 'messages' or 'text'"),
        (["", "  "], ": no records"),
    ],
)
def test_bad_records_are_named_by_file_and_line(tmp_path, lines, message):
    path = _write(tmp_path, lines)
    with pytest.raises(DataError, match=f"^{path}{message}".replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        read_sft_jsonl(path, ByteTokenizer())


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="data file not found"):
        read_sft_jsonl(str(tmp_path / "nope.jsonl"), ByteTokenizer())
    with pytest.raises(DataError, match="tokenizer not found"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text('{"vocab": {}}')
    with pytest.raises(DataError, match="neither a byte tokenizer"):
        load_tokenizer(str(tmp_path))


def test_hugging_face_tokenizer_json_from_a_local_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<|startoftext|>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(str(tmp_path))
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (5, 1, 0)
    (ids, mask), = read_sft_jsonl(_write(tmp_path, ['{"prompt": "hello", "response": "world moon"}']), tokenizer)
    assert ids.tolist() == [1, 2, 3, 4, 0] and mask.tolist() == [False, False, True, True, True]


def _samples(lengths):
    """Samples whose tokens are their global position in the concatenation (before shuffling)."""
    out, start = [], 0
    for n in lengths:
        out.append((np.arange(start, start + n), np.arange(start, start + n) % 2 == 0))
        start += n
    return out


def test_packing_tiles_the_shuffled_stream_into_shifted_windows():
    samples = _samples([5, 7, 3, 9])
    dataset = PackedSFTDataset(samples, seq_length=4, seed=0)
    order = np.random.default_rng(0).permutation(4)
    stream = np.concatenate([samples[i][0] for i in order])
    assert dataset.num_windows == (24 - 1) // 4
    for i in range(dataset.num_windows):
        w = dataset.window(i)
        assert w["tokens"].tolist() == stream[4 * i : 4 * i + 4].tolist()
        assert w["labels"].tolist() == stream[4 * i + 1 : 4 * i + 5].tolist()
        assert w["loss_mask"].tolist() == (stream[4 * i + 1 : 4 * i + 5] % 2 == 0).astype(float).tolist()
    assert dataset.window(dataset.num_windows)["tokens"].tolist() == dataset.window(0)["tokens"].tolist()
    with pytest.raises(DataError, match="fewer than one sequence"):
        PackedSFTDataset(_samples([3]), seq_length=4, seed=0)


def test_sampler_splits_global_batches_across_dp_ranks_and_resumes():
    dataset = PackedSFTDataset(_samples([200]), seq_length=4, seed=0)
    first = lambda batch: (batch["tokens"][:, 0] // 4).tolist()  # noqa: E731  window index of each row
    ranks = [micro_batches(dataset, 0, micro_batch_size=2, dp_rank=r, dp_size=2) for r in range(2)]
    step = [[first(next(it)) for it in ranks] for _ in range(3)]
    # micro-batch j of rank r holds windows j*4 + 2r, +1
    assert step == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    resumed = micro_batches(dataset, 8, micro_batch_size=2, dp_rank=1, dp_size=2)
    assert first(next(resumed)) == [10, 11]
