"""SFT data: tokenizers from local files, JSONL records to tokens with loss masks, packing and the
resumable data-parallel sampler (checked against hand-computed expectations)."""

import json

import numpy as np
import pytest

from recipes.runtime.sft_data import (
    DEFAULT_DATA,
    DEFAULT_TOKENIZER,
    ByteTokenizer,
    DataError,
    PackedSFTDataset,
    load_tokenizer,
    micro_batches,
    read_sft_jsonl,
)

pytestmark = pytest.mark.release_independent  # .ci/run tests it on one Megatron-Core release


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


# Chat templates -------------------------------------------------------------------------------
#
# Tiny tokenizer directories written here: a byte-level tokenizer.json (every UTF-8 byte a token,
# no merges, so any text round-trips) with the chat markers as added special tokens, and a chat
# template modelled on a real one. The expected renderings and trained strings below are typed by
# hand from the templates, not computed with recipes.runtime.sft_data.

# Modelled on openai/gpt-oss-20b's chat_template.jinja (harmony format), simplified: the fixed system
# message with `strftime_now`, a first system/developer message becomes the developer message, user
# turns `<|start|>user<|message|>...<|end|>`, assistant turns `<|start|>assistant<|channel|>final
# <|message|>...<|end|>` except the last one of a training rendering, which ends with `<|return|>`,
# the `raise_exception` on channel tags in the content, and the generation prompt
# `<|start|>assistant` (tools, builtin tools and the analysis channel left out).
HARMONY_TEMPLATE = """{#- simplified from openai/gpt-oss-20b chat_template.jinja #}
{{- "<|start|>system<|message|>" }}
{{- "You are ChatGPT, a large language model trained by OpenAI.\\n" }}
{{- "Current date: " + strftime_now("%Y-%m-%d") + "\\n\\n" }}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{{- "<|end|>" }}
{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if developer_message %}
    {{- "<|start|>developer<|message|># Instructions\\n\\n" + developer_message + "<|end|>" }}
{%- endif %}
{%- for message in loop_messages -%}
    {%- if message.role == 'assistant' -%}
        {%- if "<|channel|>final<|message|>" in message.content %}
            {{- raise_exception("You have passed a message containing <|channel|> tags in the content field.") }}
        {%- endif %}
        {%- if loop.last and not add_generation_prompt %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
        {%- endif %}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}"""
HARMONY_TOKENS = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"]

# Modelled on deepseek-ai/DeepSeek-V3's tokenizer_config.json chat_template, simplified (tool calls
# and tool outputs left out): system messages joined into a system prompt after `bos_token`, user
# turns `<｜User｜>...`, assistant turns `<｜Assistant｜>...<｜end▁of▁sentence｜>`, and the assistant header
# `<｜Assistant｜>` at the end only with `add_generation_prompt`. Written on one line as there.
DEEPSEEK_V3_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}"
    "{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    "{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor -%}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
)
DEEPSEEK_V3_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]

# ChatML (Qwen-style) with the contents trimmed, as Llama-3's template trims them: the content is
# not rendered verbatim, so the loss mask is placed one message at a time.
CHATML_TRIM_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# the same with transformers' {% generation %} blocks around what the assistant writes
CHATML_GENERATION_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_level_tokenizer(special_tokens):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special_tokens))
    return tok


def _tokenizer_dir(path, special_tokens, template, *, jinja_file=False, bos=None, eos=None):
    """A Hugging Face tokenizer directory: tokenizer.json, tokenizer_config.json and the chat
    template in the config or in chat_template.jinja."""
    path.mkdir(parents=True, exist_ok=True)
    _byte_level_tokenizer(special_tokens).save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    if bos:  # DeepSeek-V3 writes its special tokens as AddedToken objects
        config["bos_token"] = {"__type": "AddedToken", "content": bos, "lstrip": False, "normalized": True,
                               "rstrip": False, "single_word": False}
    if eos:
        config["eos_token"] = eos
    if template is not None:
        if jinja_file:
            (path / "chat_template.jinja").write_text(template, encoding="utf-8")
        else:
            config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return path


def _harmony_dir(tmp_path):
    return _tokenizer_dir(tmp_path / "gpt-oss", HARMONY_TOKENS, HARMONY_TEMPLATE, jinja_file=True,
                          bos="<|startoftext|>", eos="<|return|>")


def _deepseek_dir(tmp_path):
    return _tokenizer_dir(tmp_path / "deepseek-v3", DEEPSEEK_V3_TOKENS, DEEPSEEK_V3_TEMPLATE,
                          bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>")


def _trained_runs(tokenizer_dir, ids, mask):
    """The text of every maximal run of loss-carrying tokens, decoded with `tokenizers` itself."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    runs, run = [], []
    for token, trained in zip(list(ids) + [None], list(mask) + [False]):
        if trained:
            run.append(int(token))
        elif run:
            runs.append(tok.decode(run, skip_special_tokens=False))
            run = []
    return runs


def _decode(tokenizer_dir, ids):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).decode([int(i) for i in ids], skip_special_tokens=False)


def _assert_trains_exactly(tokenizer_dir, ids, mask, expected_runs):
    assert _trained_runs(tokenizer_dir, ids, mask) == expected_runs


def _read_one(tmp_path, tokenizer_dir, row):
    (ids, mask), = read_sft_jsonl(_write(tmp_path, [json.dumps(row, ensure_ascii=False)]), load_tokenizer(str(tokenizer_dir)))
    return ids, mask


CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, of course."},
]


HARMONY_SYSTEM = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                  "Current date: {}\n\n# Valid channels: analysis, commentary, final. Channel must be included for "
                  "every message.<|end|>")


def test_gpt_oss_harmony_template_trains_on_assistant_contents_and_end_markers(tmp_path):
    import datetime

    directory = _harmony_dir(tmp_path)
    before = datetime.date.today().isoformat()
    ids, mask = _read_one(tmp_path, directory, {"messages": CONVERSATION})
    dates = {before, datetime.date.today().isoformat()}  # in case the test runs across midnight
    rendered = _decode(directory, ids)
    expected = {
        HARMONY_SYSTEM.format(date)
        + "<|start|>developer<|message|># Instructions\n\nAnswer briefly.<|end|>"
        "<|start|>user<|message|>Capital of France?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Paris.<|end|>"
        "<|start|>user<|message|>And of Italy?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Rome, of course.<|return|>"
        for date in dates
    }
    assert rendered in expected  # the template's rendering, nothing added (no BOS/EOS of our own)
    # earlier turns end with <|end|>, the last with <|return|>; header, system, developer, user not trained
    _assert_trains_exactly(directory, ids, mask, ["Paris.<|end|>", "Rome, of course.<|return|>"])
    assert ids.dtype == np.int64 and mask.dtype == bool and len(ids) == len(mask)


def test_negative_control_the_mask_check_fails_when_a_user_turn_is_trained(tmp_path):
    directory = _harmony_dir(tmp_path)
    ids, mask = _read_one(tmp_path, directory, {"messages": CONVERSATION})
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    start, end = tok.token_to_id("<|start|>"), tok.token_to_id("<|end|>")
    user = tok.encode("user", add_special_tokens=False).ids
    # the first user turn: from its <|start|> to its <|end|>, found in the ids independently of the code
    first = next(i for i in range(len(ids)) if ids[i] == start and ids[i + 1 : i + 1 + len(user)].tolist() == user)
    last = next(i for i in range(first, len(ids)) if ids[i] == end)
    with_user = mask.copy()
    with_user[first : last + 1] = True
    _assert_trains_exactly(directory, ids, mask, ["Paris.<|end|>", "Rome, of course.<|return|>"])
    with pytest.raises(AssertionError):
        _assert_trains_exactly(directory, ids, with_user, ["Paris.<|end|>", "Rome, of course.<|return|>"])
    # and a mask that also took the assistant header would fail too
    header = tok.encode("<|start|>assistant<|channel|>final<|message|>", add_special_tokens=False).ids
    at = next(i for i in range(len(ids)) if ids[i : i + len(header)].tolist() == header)
    with_header = mask.copy()
    with_header[at : at + len(header)] = True
    with pytest.raises(AssertionError):
        _assert_trains_exactly(directory, ids, with_header, ["Paris.<|end|>", "Rome, of course.<|return|>"])


def test_deepseek_v3_template_trains_on_assistant_contents_and_end_markers(tmp_path):
    directory = _deepseek_dir(tmp_path)
    two_systems = [{"role": "system", "content": "Be brief."}] + CONVERSATION
    ids, mask = _read_one(tmp_path, directory, {"messages": two_systems})
    assert _decode(directory, ids) == (
        "<｜begin▁of▁sentence｜>Be brief.\n\nAnswer briefly."
        "<｜User｜>Capital of France?<｜Assistant｜>Paris.<｜end▁of▁sentence｜>"
        "<｜User｜>And of Italy?<｜Assistant｜>Rome, of course.<｜end▁of▁sentence｜>"
    )
    # the header <｜Assistant｜> (in the prefix only with add_generation_prompt) is not trained
    _assert_trains_exactly(directory, ids, mask, ["Paris.<｜end▁of▁sentence｜>", "Rome, of course.<｜end▁of▁sentence｜>"])
    # a conversation ending on a user turn trains the assistant turns before it; one assistant turn alone
    ids, mask = _read_one(tmp_path, directory, {"messages": CONVERSATION[1:4]})
    _assert_trains_exactly(directory, ids, mask, ["Paris.<｜end▁of▁sentence｜>"])
    ids, mask = _read_one(tmp_path, directory, {"messages": [{"role": "user", "content": "é?"},
                                                             {"role": "assistant", "content": "ü, ß."}]})
    assert _decode(directory, ids) == "<｜begin▁of▁sentence｜><｜User｜>é?<｜Assistant｜>ü, ß.<｜end▁of▁sentence｜>"
    _assert_trains_exactly(directory, ids, mask, ["ü, ß.<｜end▁of▁sentence｜>"])


def test_templates_that_trim_contents_or_mark_generation_blocks(tmp_path):
    trim = _tokenizer_dir(tmp_path / "trim", CHATML_TOKENS, CHATML_TRIM_TEMPLATE, eos="<|im_end|>")
    row = {"messages": [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "  hello there \n"},
                        {"role": "user", "content": "bye"}, {"role": "assistant", "content": "bye!"}]}
    ids, mask = _read_one(tmp_path, trim, row)
    assert _decode(trim, ids) == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello there<|im_end|>\n"
                                  "<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\nbye!<|im_end|>\n")
    _assert_trains_exactly(trim, ids, mask, ["hello there<|im_end|>\n", "bye!<|im_end|>\n"])
    generation = _tokenizer_dir(tmp_path / "generation", CHATML_TOKENS, CHATML_GENERATION_TEMPLATE, eos="<|im_end|>")
    ids, mask = _read_one(tmp_path, generation, row)
    _assert_trains_exactly(generation, ids, mask, ["  hello there \n<|im_end|>", "bye!<|im_end|>"])
    # ChatML tokenizers have no BOS: fine for messages, a clear error for records framed BOS ... EOS
    path = _write(tmp_path, [json.dumps(row), '{"text": "plain"}'])
    with pytest.raises(DataError, match=r":2: this tokenizer has no BOS token, .*; write the record as 'messages'$"):
        read_sft_jsonl(path, load_tokenizer(str(trim)))


@pytest.mark.parametrize("which", ["harmony", "deepseek-v3", "generation"])
def test_chat_rendering_matches_transformers_apply_chat_template(tmp_path, which):
    transformers = pytest.importorskip("transformers")
    directory = {"harmony": _harmony_dir, "deepseek-v3": _deepseek_dir,
                 "generation": lambda p: _tokenizer_dir(p / "g", CHATML_TOKENS, CHATML_GENERATION_TEMPLATE)}[which](tmp_path)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    ids, mask = _read_one(tmp_path, directory, {"messages": CONVERSATION})
    out = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=which == "generation")
    assert ids.tolist() == list(out["input_ids"])
    if which == "generation":
        assert mask.astype(int).tolist() == list(out["assistant_masks"])


def test_byte_tokenizer_and_template_less_tokenizers_keep_the_simple_format(tmp_path):
    row = {"messages": CONVERSATION[:3]}
    simple = "system: Answer briefly.\nuser: Capital of France?\nassistant: Paris.\n"
    # the byte tokenizer ignores a chat template next to it
    byte_dir = tmp_path / "bytes"
    byte_dir.mkdir()
    (byte_dir / "tokenizer.json").write_text(open(DEFAULT_TOKENIZER, encoding="utf-8").read(), encoding="utf-8")
    (byte_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": DEEPSEEK_V3_TEMPLATE}), encoding="utf-8")
    (byte_dir / "chat_template.jinja").write_text(HARMONY_TEMPLATE, encoding="utf-8")
    tokenizer = load_tokenizer(str(byte_dir))
    assert tokenizer == ByteTokenizer()
    (ids, mask), = read_sft_jsonl(_write(tmp_path, [json.dumps(row)]), tokenizer)
    assert ids[0] == 256 and ids[-1] == 257 and bytes(ids[1:-1].tolist()).decode() == simple
    assert bytes(ids[mask][:-1].tolist()).decode() == "Paris.\n" and mask[-1]
    # a Hugging Face tokenizer without a chat template (no tokenizer_config.json, or one without a template)
    for config in (False, True):
        directory = _tokenizer_dir(tmp_path / f"plain{config}", HARMONY_TOKENS, None, bos="<|startoftext|>")
        if not config:
            (directory / "tokenizer_config.json").unlink()
        ids, mask = _read_one(tmp_path, directory, row)
        assert _decode(directory, ids) == "<|startoftext|>" + simple + "<|endoftext|>"
        _assert_trains_exactly(directory, ids, mask, ["Paris.\n<|endoftext|>"])


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "bot", "content": "x"}], ":1: messages[0] has role 'bot'; use one of system, developer, user, assistant, tool"),
        ([{"role": "user", "content": ["x"]}], ":1: messages[0].content must be a string, got an array"),
        ([{"role": "user", "content": None}], ":1: messages[0].content must be a string, got null"),
        ([{"role": 3, "content": "x"}], ":1: messages[0] has role 3; use one of"),
    ],
)
@pytest.mark.parametrize("tokenizer", ["bytes", "harmony"])
def test_bad_messages_are_one_line_errors_naming_file_and_line(tmp_path, messages, message, tokenizer):
    tok = ByteTokenizer() if tokenizer == "bytes" else load_tokenizer(str(_harmony_dir(tmp_path)))
    path = _write(tmp_path, [json.dumps({"messages": messages})])
    with pytest.raises(DataError) as err:
        read_sft_jsonl(path, tok)
    assert str(err.value).startswith(path + message) and "\n" not in str(err.value)


def test_a_template_that_raises_or_does_not_compile_is_a_one_line_error(tmp_path):
    directory = _harmony_dir(tmp_path)
    bad = {"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": "<|channel|>final<|message|>a"}]}
    path = _write(tmp_path, ['{"text": "fine"}', json.dumps(bad)])
    with pytest.raises(DataError) as err:
        read_sft_jsonl(path, load_tokenizer(str(directory)))
    assert str(err.value) == (
        f"{path}:2: the chat template {directory / 'chat_template.jinja'} failed: You have passed a message "
        "containing <|channel|> tags in the content field.; fix the record or the template"
    )
    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }", encoding="utf-8")
    with pytest.raises(DataError, match=r"chat_template\.jinja: the chat template does not compile \(.*\); fix or remove it$"):
        load_tokenizer(str(directory))
    # a template field the record lacks: named, one line
    (directory / "chat_template.jinja").write_text("{{ messages[0].content + messages[0].name }}", encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_sft_jsonl(_write(tmp_path, [json.dumps({"messages": [{"role": "user", "content": "q"}]})]),
                       load_tokenizer(str(directory)))
    assert ":1: the chat template" in str(err.value) and "\n" not in str(err.value)


def test_chat_template_file_wins_over_tokenizer_config_and_list_form(tmp_path):
    directory = _deepseek_dir(tmp_path)
    row = {"messages": CONVERSATION[1:3]}
    ids, _ = _read_one(tmp_path, directory, row)
    assert _decode(directory, ids).startswith("<｜begin▁of▁sentence｜><｜User｜>")
    # the older list form of tokenizer_config.json's chat_template: the "default" entry
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = [{"name": "tool_use", "template": "unused"}, {"name": "default", "template": DEEPSEEK_V3_TEMPLATE}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    assert _read_one(tmp_path, directory, row)[0].tolist() == ids.tolist()
    # chat_template.jinja next to it takes precedence, as in transformers
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ '<｜User｜>' if m.role == 'user' else '<｜Assistant｜>' }}{{ m.content }}{% endfor %}"
        "{{ eos_token }}", encoding="utf-8")
    ids, mask = _read_one(tmp_path, directory, row)
    assert _decode(directory, ids) == "<｜User｜>Capital of France?<｜Assistant｜>Paris.<｜end▁of▁sentence｜>"
    _assert_trains_exactly(directory, ids, mask, ["Paris.<｜end▁of▁sentence｜>"])
