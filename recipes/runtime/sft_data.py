"""Supervised fine-tuning data: a tokenizer from a local path and a JSONL file packed into
fixed-length training sequences with a loss mask.

JSONL lines (one JSON object per line, blank lines ignored) take one of three forms:

* ``{"prompt": "...", "response": "..."}`` — loss on the response (and the closing EOS) only;
* ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}``
  — loss on assistant turns only (roles: system, developer, user, assistant, tool); see below;
* ``{"text": "..."}`` — loss on every token.

Each sample becomes ``BOS tokens... EOS``, except ``messages`` records rendered with a chat template
(below), which are exactly the template's rendering. Samples are concatenated in a seeded order and cut into
windows of ``seq_length + 1`` tokens (inputs and shifted labels), as Megatron's GPT datasets pack
documents; the order is a pure function of (seed, sample index), so resuming from a consumed-sample
count reproduces the same batches.

Tokenizers (``--tokenizer PATH``): a Hugging Face ``tokenizer.json`` (file, or a directory holding
one; needs the ``tokenizers`` package), or this project's byte tokenizer file
(``{"type": "bytes", ...}``, shipped as ``recipes/data/byte_tokenizer.json``). Nothing is downloaded.

Chat templates: when the Hugging Face tokenizer's directory holds a chat template
(``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``; the file wins, as in
transformers), ``messages`` records are rendered with it the way transformers' ``apply_chat_template``
renders them (jinja2 sandbox, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``strftime_now``, ``tojson``, the special tokens of ``tokenizer_config.json`` such as ``bos_token``)
and the rendering is tokenized without adding special tokens, e.g. gpt-oss's harmony format or
DeepSeek-V3's ``<｜User｜>...<｜Assistant｜>...<｜end▁of▁sentence｜>``. The loss covers each assistant
message's content and the end-of-turn marker that follows it, never the system/user/tool turns nor
the assistant header: a template with ``{% generation %}`` blocks marks those spans itself;
otherwise the content is located by rendering the conversation again with that content replaced
by a sentinel, and the turn ends where the conversation rendered up to that message ends (when that
rendering is a prefix of the whole one, as with DeepSeek-V3), else after the special token that
follows the content (gpt-oss ends earlier turns with ``<|end|>`` but a final one with
``<|return|>``). Tokens overlapping those character spans (tokenizer offsets) carry the loss.
Without a chat template (and always with the byte tokenizer) every turn is ``"<role>: <content>\\n"``.
"""

from __future__ import annotations

import contextvars
import codecs
import datetime
import json
import os
import re
from dataclasses import dataclass
from typing import Iterator, Optional, Protocol

import numpy as np

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")  # recipes/data
DEFAULT_DATA = os.path.join(DATA_DIR, "tiny_sft.jsonl")
DEFAULT_TOKENIZER = os.path.join(DATA_DIR, "byte_tokenizer.json")


class DataError(ValueError):
    """Bad data or tokenizer input (the message names the file and line)."""


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: Optional[int]  # None only for a Hugging Face tokenizer with a chat template
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus BOS/EOS: needs no vocabulary file and covers any text."""

    bos_id: int = 256
    eos_id: int = 257
    vocab_size: int = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """The text of the byte ids (BOS/EOS dropped; bytes that are not UTF-8 become U+FFFD)."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` package (no network), with the chat
    template of its directory when there is one."""

    def __init__(self, path: str, bos_token: Optional[str] = None, eos_token: Optional[str] = None,
                 chat_template: Optional["ChatTemplate"] = None):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as err:
            raise DataError(f"{path}: reading a Hugging Face tokenizer.json needs `pip install tokenizers`") from err
        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as err:  # the tokenizers package raises a bare Exception for a malformed file
            raise DataError(f"{path}: not a valid Hugging Face tokenizer.json ({_one_line(err)}); "
                            "use the tokenizer.json the model was released with") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        # BOS/EOS frame prompt/response and text records; a chat model's tokenizer may lack a BOS
        # (Qwen's ChatML), which only those records then need
        self.bos_id = self._special_id(path, bos_token, ("<|startoftext|>", "<s>", "<|begin_of_text|>", "<｜begin▁of▁sentence｜>"),
                                       required=chat_template is None)
        self.eos_id = self._special_id(path, eos_token, ("<|endoftext|>", "</s>", "<|end_of_text|>", "<｜end▁of▁sentence｜>"))
        # the special added tokens, longest first: an end-of-turn marker after an assistant message is one
        self.special_tokens = sorted({t.content for t in self._tok.get_added_tokens_decoder().values()
                                      if t.special and t.content}, key=len, reverse=True)

    def _special_id(self, path: str, name: Optional[str], candidates: tuple[str, ...], required: bool = True) -> Optional[int]:
        for token in (name,) if name else candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        if not required:
            return None
        raise DataError(f"{path}: none of the special tokens {list((name,) if name else candidates)} is in the vocabulary")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens kept (a chat reply's channel and end-of-turn markers)."""
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's character span in ``text`` (no special tokens added, as
        transformers tokenizes a rendered chat)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets


# Chat templates ------------------------------------------------------------------------------

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# the special-token names transformers passes to a chat template (its ``special_tokens_map``)
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# stands in for an assistant message's content to find where the template puts it (private-use characters)
_SENTINEL = "\ue000llep-assistant-content\ue001"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# (blocks rendered so far, generation spans) while a render runs: ``{% generation %}`` records its span there
_TRACKING: contextvars.ContextVar = contextvars.ContextVar("llep_chat_generation_spans", default=None)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def json_type(value: object) -> str:
    """A JSON value's kind as the file's author wrote it ("null", "a number", ...), for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object" if isinstance(value, dict) else type(value).__name__


def _decode_utf8(raw: bytes, path: str, first_line: int = 1) -> str:
    """``raw`` (the file's text from line ``first_line`` on) as text; bytes that are not UTF-8 are
    named by line and column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + raw.count(b"\n", 0, err.start)
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise DataError(f"{path}:{line}: byte 0x{raw[err.start]:02x} at column {column} is not UTF-8 text; "
                        "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _open_bytes(path: str, what: str):
    """``path`` opened for reading bytes; a directory, a missing or an unreadable file are one-line errors."""
    if os.path.isdir(path):
        raise DataError(f"{what} {path} is a directory, not a file")
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"{what} not found: {path}") from None
    except OSError as err:
        raise DataError(f"{path}: cannot read the {what} ({err.strerror})") from None


def _read_text(path: str, what: str) -> str:
    """A whole UTF-8 text file (a byte-order mark, as Windows editors write one, is dropped)."""
    with _open_bytes(path, what) as f:
        return _decode_utf8(f.read().removeprefix(codecs.BOM_UTF8), path)


def _jinja_environment():
    """The sandboxed environment transformers' ``apply_chat_template`` renders chat templates in
    (transformers/utils/chat_template_utils.py, ``_cached_compile_jinja_template``)."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as err:
        raise DataError("rendering a chat template needs `pip install 'jinja2>=3.1.6'`") from err
    from packaging.version import Version

    if Version(jinja2.__version__) < Version("3.1.6"):  # older sandboxes have known escapes (transformers refuses them too)
        raise DataError(f"rendering a chat template needs jinja2>=3.1.6, not {jinja2.__version__}: `pip install -U jinja2`")

    class GenerationBlocks(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: records the character span of the block."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller):
            text = caller()
            tracking = _TRACKING.get()
            if tracking is not None:
                blocks, spans = tracking
                start = sum(len(block) for block in blocks)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' override: no HTML escaping, and these options
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        # as transformers: ``dict(...)`` and ``dict.fromkeys`` only
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # as transformers: namespaces take no underscore-prefixed attributes
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


class ChatTemplate:
    """A Hugging Face chat template, rendered as transformers' ``apply_chat_template`` renders it."""

    def __init__(self, template: str, source: str, variables: Optional[dict[str, str]] = None):
        self.source = source  # the file it came from (named in errors)
        self.variables = dict(variables or {})  # bos_token, eos_token, ... as transformers passes them
        self.has_generation_blocks = bool(_GENERATION_TAG.search(template))
        environment = _jinja_environment()
        try:
            self._template = environment.from_string(template)
        except Exception as err:  # jinja2.TemplateSyntaxError and the like
            raise DataError(f"{source}: the chat template does not compile ({_one_line(err)}); fix or remove it") from err

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               now: Optional[datetime.datetime] = None) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its ``{% generation %}`` blocks.
        ``now`` fixes what ``strftime_now`` returns (the renders of one record agree on the date)."""
        now = now or datetime.datetime.now()
        context = {**self.variables, "messages": messages, "tools": None, "documents": None,
                   "add_generation_prompt": add_generation_prompt, "strftime_now": lambda fmt: now.strftime(fmt)}
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _TRACKING.set((blocks, spans))
        try:
            for block in self._template.generate(**context):
                blocks.append(block)
        finally:
            _TRACKING.reset(token)
        return "".join(blocks), spans


def _template_token(value: object) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_json_object(path: str, what: str) -> dict:
    """The JSON object in ``path`` (``what`` it holds, for messages); DataError naming the file (and
    line) when it is not UTF-8, not JSON or not an object."""
    text = _read_text(path, what)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno})") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected the {what} as a JSON object, got {json_type(value)}")
    return value


def load_chat_template(directory: str) -> Optional[ChatTemplate]:
    """The chat template of a Hugging Face tokenizer directory, or None when it has none:
    ``chat_template.jinja`` if present (newer transformers releases save it there; it wins, as in
    transformers), else ``tokenizer_config.json``'s ``chat_template`` (a string, or the older list of
    ``{"name", "template"}`` of which ``default`` is used). Template variables: the special tokens of
    ``tokenizer_config.json`` (else ``special_tokens_map.json``)."""
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = read_json_object(config_path, "tokenizer config") if os.path.isfile(config_path) else {}
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        template, source = _read_text(jinja_path, "chat template"), jinja_path
    else:
        template, source = config.get("chat_template"), config_path
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if "default" not in named:
                raise DataError(f"{config_path}: 'chat_template' lists {sorted(map(str, named))} but no 'default'")
            template = named["default"]
        if template is None:
            return None
        if not isinstance(template, str):
            raise DataError(f"{config_path}: 'chat_template' must be a string, got {json_type(template)}")
    special_map_path = os.path.join(directory, "special_tokens_map.json")
    special_map = read_json_object(special_map_path, "special tokens map") if os.path.isfile(special_map_path) else {}
    variables = {}
    for name in _TEMPLATE_TOKENS:
        value = _template_token(config.get(name))
        if value is None:
            value = _template_token(special_map.get(name))
        if value is not None:
            variables[name] = value
    return ChatTemplate(template, source, variables)


def _check_messages(messages: object, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f"{where}: messages[{i}] needs 'role' and 'content'")
        if message["role"] not in CHAT_ROLES:
            raise DataError(f"{where}: messages[{i}] has role {message['role']!r}; use one of {', '.join(CHAT_ROLES)}")
        if not isinstance(message["content"], str):
            raise DataError(f"{where}: messages[{i}].content must be a string, got {json_type(message['content'])}")
    return messages


def _content_spans(render, messages: list[dict], text: str, where: str) -> dict[int, tuple[int, int]]:
    """Where ``text`` (the rendered conversation) holds each assistant message's content, found by
    rendering it again with the contents replaced by sentinels: all at once when the template puts
    them in verbatim, else one message at a time (a template may trim or cut a content)."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistants:
        return {}
    sentinels = {i: f"\ue000{n}{_SENTINEL}" for n, i in enumerate(assistants)}
    probe_text = render([{**m, "content": sentinels[i]} if i in sentinels else m for i, m in enumerate(messages)])
    pieces = re.split("(" + "|".join(map(re.escape, sentinels.values())) + ")", probe_text)
    if pieces[1::2] == list(sentinels.values()):  # each once, in order
        position, rebuilt, spans = 0, [], {}
        for k, piece in enumerate(pieces):
            if k % 2:
                i = assistants[k // 2]
                piece = messages[i]["content"]
                spans[i] = (position, position + len(piece))
            rebuilt.append(piece)
            position += len(piece)
        if "".join(rebuilt) == text:
            return spans
    spans = {}
    for i in assistants:  # one at a time: the template transforms a content or renders it more than once
        probe_text = render([{**m, "content": _SENTINEL} if j == i else m for j, m in enumerate(messages)])
        if probe_text.count(_SENTINEL) != 1:
            raise DataError(f"{where}: the chat template renders messages[{i}].content {probe_text.count(_SENTINEL)} "
                            "times, not once; cannot place the loss mask (mark it with {% generation %} in the template)")
        head, tail = probe_text.split(_SENTINEL)
        if not (text.startswith(head) and text.endswith(tail) and len(head) + len(tail) <= len(text)):
            raise DataError(f"{where}: the chat template renders messages[{i}] around its content differently "
                            "depending on that content; cannot place the loss mask (mark it with {% generation %})")
        spans[i] = (len(head), len(text) - len(tail))
    return spans


def _assistant_spans(render, messages: list[dict], text: str, special_tokens: list[str],
                     where: str) -> list[tuple[int, int]]:
    """Character spans of ``text`` (the rendered conversation) that carry the loss: each assistant
    message's content and the end-of-turn marker after it, not the header before it."""
    spans = []
    for i, (start, end) in sorted(_content_spans(render, messages, text, where).items()):
        turn = text if i == len(messages) - 1 else render(messages[: i + 1])
        if len(turn) > end and text.startswith(turn):
            stop = len(turn)  # the template's own end of this turn (DeepSeek-V3: <｜end▁of▁sentence｜>)
        else:  # rendered differently as the last message (gpt-oss: <|return|> there, <|end|> here)
            stop = end  # the special token right after the content (after whitespace), if any
            after = len(text) - len(text[end:].lstrip())
            marker = next((t for t in special_tokens if text.startswith(t, after)), None)
            if marker is not None:
                stop = after + len(marker)
        spans.append((start, stop))
    return spans


def _render_chat(tokenizer: HuggingFaceTokenizer, messages: list[dict], where: str) -> tuple[list[int], list[bool]]:
    """A conversation rendered with the tokenizer's chat template and tokenized, with the loss on
    the assistant messages' contents and end-of-turn markers (see the module docstring)."""
    template = tokenizer.chat_template
    now = datetime.datetime.now()  # one date for all renders of the record (strftime_now)
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # transformers drops None values

    def render_with_spans(chat: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        try:
            return template.render(chat, now=now)
        except Exception as err:  # raise_exception, undefined fields, type errors inside the template
            raise DataError(f"{where}: the chat template {template.source} failed: {_one_line(err)}; "
                            "fix the record or the template") from err

    text, spans = render_with_spans(messages)
    if not template.has_generation_blocks:
        spans = _assistant_spans(lambda chat: render_with_spans(chat)[0], messages, text, tokenizer.special_tokens, where)
    ids, offsets = tokenizer.encode_with_offsets(text)
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    first, last = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(ids), dtype=bool)
    for start, stop in spans:  # every token overlapping a span (as transformers' assistant masks)
        mask |= (first < stop) & (last > start)
    return ids, mask.tolist()


def _byte_tokenizer(spec: dict, path: str) -> ByteTokenizer:
    """The byte tokenizer a ``{"type": "bytes"}`` file describes, its ids checked (256 bytes, then BOS/EOS)."""
    specials = spec.get("special_tokens", {})
    if not isinstance(specials, dict):
        raise DataError(f"{path}: 'special_tokens' must be an object like {{\"bos\": 256, \"eos\": 257}}, "
                        f"got {json_type(specials)}")
    values = {"special_tokens.bos": specials.get("bos", 256), "special_tokens.eos": specials.get("eos", 257),
              "vocab_size": spec.get("vocab_size", 258)}
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 256:
            raise DataError(f"{path}: '{name}' must be an integer >= 256 (ids 0..255 are the bytes), "
                            f"got {json_type(value)}")
    bos, eos, vocab_size = values.values()
    if bos == eos or max(bos, eos) >= vocab_size:
        raise DataError(f"{path}: BOS {bos} and EOS {eos} must be distinct ids below 'vocab_size' {vocab_size}")
    return ByteTokenizer(bos_id=bos, eos_id=eos, vocab_size=vocab_size)


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer stored at ``path`` (see the module docstring for the accepted formats)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise DataError(f"tokenizer not found: the directory {path} has no tokenizer.json")
        path = os.path.join(path, "tokenizer.json")
    spec = read_json_object(path, "tokenizer")
    if spec.get("type") == "bytes":
        return _byte_tokenizer(spec, path)
    if "model" in spec:
        if not isinstance(spec["model"], dict):
            raise DataError(f"{path}: 'model' must be an object like {{\"type\": \"BPE\", \"vocab\": {{...}}, ...}}, "
                            f"got {json_type(spec['model'])}; use the tokenizer.json the model was released with")
        return HuggingFaceTokenizer(path, chat_template=load_chat_template(os.path.dirname(os.path.abspath(path))))
    raise DataError(f"{path}: neither a byte tokenizer ({{\"type\": \"bytes\"}}) nor a Hugging Face tokenizer.json")


def _tokenize_sample(row: dict, tokenizer: Tokenizer, where: str) -> tuple[list[int], list[bool]]:
    """One JSONL record as token ids with a per-token loss flag."""
    chat = "messages" in row and "prompt" not in row and "response" not in row
    if chat and getattr(tokenizer, "chat_template", None) is not None:
        return _render_chat(tokenizer, _check_messages(row["messages"], where), where)
    if tokenizer.bos_id is None:
        raise DataError(f"{where}: this tokenizer has no BOS token, which records other than 'messages' "
                        "(rendered with its chat template) need; write the record as 'messages'")
    ids, mask = [tokenizer.bos_id], [False]

    def add(text: object, train: bool, field_name: str) -> None:
        if not isinstance(text, str):
            raise DataError(f"{where}: field {field_name!r} must be a string, got {json_type(text)}")
        piece = tokenizer.encode(text)
        ids.extend(piece)
        mask.extend([train] * len(piece))

    if "prompt" in row or "response" in row:
        if "prompt" not in row or "response" not in row:
            raise DataError(f"{where}: a prompt/response record needs both fields, got {sorted(row)}")
        add(row["prompt"], False, "prompt")
        add(row["response"], True, "response")
    elif "messages" in row:
        messages = _check_messages(row["messages"], where)
        for i, message in enumerate(messages):
            add(f"{message['role']}: ", False, f"messages[{i}].role")
            add(message["content"] + "\n", message["role"] == "assistant", f"messages[{i}].content")
    elif "text" in row:
        add(row["text"], True, "text")
    else:
        raise DataError(f"{where}: expected 'prompt'+'response', 'messages' or 'text', got fields {sorted(row)}")
    ids.append(tokenizer.eos_id)
    mask.append(True)
    return ids, mask


def prompt_token_ids(record: dict, tokenizer: Tokenizer, where: str, chat_template: bool = True) -> list[int]:
    """A generation prompt, ``{"prompt": text}`` or ``{"messages": [...]}`` (the conversation so far),
    tokenized as fine-tuning renders such turns, up to where the model's reply begins: with the
    tokenizer's chat template and its generation prompt (the assistant header; a ``prompt`` is one user
    message) when it has one and ``chat_template``; otherwise BOS + the text, or BOS + ``role: content``
    lines + ``assistant: ``. Errors name ``where`` (file:line or flag)."""
    if ("prompt" in record) == ("messages" in record):
        raise DataError(f"{where}: a prompt record needs either 'prompt' (a string) or 'messages' (a list), "
                        f"got fields {sorted(record)}")
    if "prompt" in record and not isinstance(record["prompt"], str):
        raise DataError(f"{where}: field 'prompt' must be a string, got {json_type(record['prompt'])}")
    template = getattr(tokenizer, "chat_template", None) if chat_template else None
    if template is not None:
        messages = _check_messages(record["messages"], where) if "messages" in record else \
            [{"role": "user", "content": record["prompt"]}]
        try:
            text, _ = template.render(messages, add_generation_prompt=True)
        except Exception as err:  # raise_exception, undefined fields, type errors inside the template
            raise DataError(f"{where}: the chat template {template.source} failed: {_one_line(err)}; "
                            "fix the record or the template, or pass --no-chat-template") from err
        return tokenizer.encode(text)
    if "prompt" in record:
        text = record["prompt"]
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in _check_messages(record["messages"], where))
        text += "assistant: "
    return ([] if tokenizer.bos_id is None else [tokenizer.bos_id]) + tokenizer.encode(text)


def jsonl_objects(path: str, what: str) -> Iterator[tuple[str, dict]]:
    """``("file:line", record)`` for every non-blank line of a JSONL file; a line that is not UTF-8,
    not JSON, not a JSON object or holds half a surrogate pair (``"\\udcff"``) is a one-line
    :class:`DataError` naming the file and line."""
    with _open_bytes(path, what) as f:
        for number, raw in enumerate(f, start=1):
            line = _decode_utf8(raw.removeprefix(codecs.BOM_UTF8) if number == 1 else raw, path, number)
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {json_type(row)}")
            if "\\u" in line:  # an escape of half a UTF-16 pair is no text: no tokenizer or output file takes it
                try:
                    json.dumps(row, ensure_ascii=False).encode("utf-8")
                except UnicodeEncodeError as err:
                    raise DataError(f"{where}: \\u{ord(err.object[err.start]):04x} is half of a UTF-16 surrogate pair, "
                                    "not a character; write the character itself or its whole pair") from None
            yield where, row


def read_sft_jsonl(path: str, tokenizer: Tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every record of a JSONL file tokenized; errors name the file and line."""
    if os.path.isdir(path):
        inside = sorted(name for name in os.listdir(path) if name.endswith(".jsonl"))
        hint = f" (it holds {', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''})" if inside else ""
        raise DataError(f"data {path} is a directory, not a JSONL file: give one .jsonl file{hint}")
    samples = []
    for where, row in jsonl_objects(path, "data file"):
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
