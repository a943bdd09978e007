"""Build a real-text corpus offline from what every machine with this project's dependencies has,
split by domain, with a manifest, a BPE tokenizer and Megatron indexed datasets.

No pretrained MoE can be downloaded on the machines this project is built on, so the model whose
routing the benchmarks replay is trained here (docs/real_routing.md). Its text comes from the
installed Python and its packages, the one body of real text every such machine holds:

========  ===============================================================================  ==================
domain    source                                                                           role
========  ===============================================================================  ==================
code      the standard library's ``*.py`` files (tests, idlelib and pydoc_data excluded)   pretraining
prose     the Python language reference (``pydoc_data/topics.py``, one document per        pretraining
          topic) and the installed packages' long descriptions (``*.dist-info/METADATA``)
legal     licence texts: the interpreter's ``LICENSE.txt`` and every ``LICENSE*``,          narrow fine-tuning
          ``COPYING*``, ``NOTICE*`` file under site-packages (identical texts once)        domain
========  ===============================================================================  ==================

Each document goes to train / valid / test by a hash of its name (90 / 5 / 5), so adding a package
moves no other document between splits. ``manifest.json`` lists every source file with its SHA-256,
size, domain, split and token count, and the versions it came from; ``--check MANIFEST`` rebuilds
and names each file that differs. Outputs under ``--out``::

    manifest.json  tokenizer/tokenizer.json
    <domain>_<split>.jsonl                       one {"text", "source"} record per document
    indexed/<domain>_<split>_text_document.bin/.idx

    python -m recipes.corpus --out ~/.cache/megatron_llep/corpus
"""

from __future__ import annotations

import argparse
import ast
import email.parser
import hashlib
import json
import os
import platform
import signal
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from typing import Iterator, Optional, Sequence

from megatron_llep.writable import OutputError, StagedOutputs, directory_problem

DOMAINS = ("code", "prose", "legal")
SPLITS = ("train", "valid", "test")
SPLIT_PERCENT = (90, 5, 5)
LICENSE_PREFIXES = ("LICENSE", "LICENCE", "COPYING", "NOTICE")
EXCLUDED_STDLIB_DIRS = ("test", "tests", "idlelib", "pydoc_data", "site-packages", "dist-packages", "__pycache__")
SPECIAL_TOKENS = ("<|endoftext|>", "<|startoftext|>")
DEFAULT_VOCAB = 4096


class CorpusError(ValueError):
    """A build or check that cannot go on (one line naming the file or flag)."""


@dataclass(frozen=True)
class Document:
    """One document: its text and where it came from (``stdlib:...``, ``site:...``; ``#topic`` inside a file)."""

    domain: str
    source: str
    text: str

    @property
    def split(self) -> str:
        """train / valid / test by a hash of the source name (stable as other documents come and go)."""
        bucket = int(hashlib.sha256(self.source.encode()).hexdigest()[:8], 16) % 100
        return SPLITS[0] if bucket < SPLIT_PERCENT[0] else SPLITS[1] if bucket < sum(SPLIT_PERCENT[:2]) else SPLITS[2]


@dataclass
class SourceFile:
    path: str  # ``stdlib:<relative>`` or ``site:<relative>``
    domain: str
    sha256: str
    bytes: int
    documents: int


def _roots() -> dict[str, str]:
    paths = sysconfig.get_paths()
    return {"stdlib": os.path.realpath(paths["stdlib"]), "site": os.path.realpath(paths["purelib"])}


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None


def _code_files(stdlib: str) -> Iterator[str]:
    for directory, subdirs, files in os.walk(stdlib):
        subdirs[:] = sorted(d for d in subdirs if d not in EXCLUDED_STDLIB_DIRS)
        yield from (os.path.join(directory, f) for f in sorted(files) if f.endswith(".py"))


def _topics(path: str) -> Iterator[tuple[str, str]]:
    """The language reference's topics (``pydoc_data/topics.py`` holds one dict literal of them)."""
    tree = ast.parse(_read(path) or "")
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values):
                if isinstance(key, ast.Constant) and isinstance(value, ast.Constant) and isinstance(value.value, str):
                    yield key.value, value.value


def _description(path: str) -> str:
    """A wheel's long description (the METADATA body, or its Description header)."""
    message = email.parser.Parser().parsestr(_read(path) or "")
    body = message.get_payload()
    return (body if isinstance(body, str) and body.strip() else message.get("Description", "")).strip()


def _license_files(site: str) -> Iterator[str]:
    for directory, subdirs, files in os.walk(site):
        subdirs.sort()
        subdirs[:] = [d for d in subdirs if d != "__pycache__"]
        yield from (os.path.join(directory, f) for f in sorted(files) if f.upper().startswith(LICENSE_PREFIXES))


def collect(min_chars: int = 200) -> tuple[list[Document], list[SourceFile]]:
    """Every document of the three domains from this interpreter's files, in a fixed order."""
    roots = _roots()
    docs: list[Document] = []
    files: list[SourceFile] = []
    seen_texts: set[str] = set()

    def name(path: str) -> str:
        for key, root in roots.items():
            if path.startswith(root + os.sep):
                return f"{key}:{os.path.relpath(path, root)}"
        return path

    def add_file(path: str, domain: str, pieces: list[tuple[str, str]]) -> None:
        raw = open(path, "rb").read()
        kept = 0
        for suffix, text in pieces:
            text = text.strip()
            digest = hashlib.sha256(text.encode()).hexdigest()
            if len(text) < min_chars or digest in seen_texts:  # stubs and repeated texts (licences, mostly)
                continue
            seen_texts.add(digest)
            docs.append(Document(domain, name(path) + suffix, text))
            kept += 1
        if kept:
            files.append(SourceFile(name(path), domain, hashlib.sha256(raw).hexdigest(), len(raw), kept))

    for path in _code_files(roots["stdlib"]):
        text = _read(path)
        if text is not None:
            add_file(path, "code", [("", text)])
    topics = os.path.join(roots["stdlib"], "pydoc_data", "topics.py")
    if os.path.isfile(topics):
        add_file(topics, "prose", [(f"#{key}", text) for key, text in _topics(topics)])
    for entry in sorted(os.listdir(roots["site"])):
        metadata = os.path.join(roots["site"], entry, "METADATA")
        if entry.endswith(".dist-info") and os.path.isfile(metadata):
            add_file(metadata, "prose", [("", _description(metadata))])
    for path in [os.path.join(roots["stdlib"], "LICENSE.txt"), *_license_files(roots["site"])]:
        text = _read(path) if os.path.isfile(path) else None
        if text is not None:
            add_file(path, "legal", [("", text)])
    return docs, files


def train_tokenizer(docs: Sequence[Document], vocab_size: int, out_dir: str, outputs: StagedOutputs) -> str:
    """A byte-level BPE tokenizer (``tokenizers``) trained on the train split of every domain, staged in
    ``outputs`` as ``out_dir``/tokenizer.json (with its tokenizer_config.json); returns the staged
    tokenizer.json to read until ``outputs`` is committed. The trainer is deterministic for a fixed
    input order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((d.text for d in docs if d.split == "train"), trainer=trainer)
    staged = outputs.stage(os.path.join(out_dir, "tokenizer.json"))
    tokenizer.save(staged.temporary)
    # transformers' AutoTokenizer (Megatron's HuggingFaceTokenizer) reads the directory with this
    with outputs.open(os.path.join(out_dir, "tokenizer_config.json")) as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[1],
                   "eos_token": SPECIAL_TOKENS[0]}, f, indent=1)
    return staged.temporary


def _versions() -> dict[str, str]:
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for package in ("torch", "megatron-core", "tokenizers", "numpy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return versions


def build(out: str, vocab_size: int = DEFAULT_VOCAB, max_docs_per_split: Optional[int] = None,
          log=print) -> dict:
    """Write the corpus, the tokenizer and the indexed datasets under ``out``; returns the manifest."""
    from recipes.runtime import sft_data
    from recipes.runtime.indexed_data import build_indexed_dataset, megatron_tokenizer_flags

    start = time.perf_counter()
    docs, files = collect()
    if max_docs_per_split is not None:  # smoke-sized corpora (tests): the first documents of each domain and split
        kept = {x.source for d in DOMAINS for split in SPLITS
                for x in [y for y in docs if y.domain == d and y.split == split][:max_docs_per_split]}
        docs = [d for d in docs if d.source in kept]
        names = {d.source.split("#")[0] for d in docs}
        files = [f for f in files if f.path in names]
    missing = [d for d in DOMAINS if not any(x.domain == d and x.split == "train" for x in docs)]
    if missing:
        raise CorpusError(f"no training documents for domain(s) {missing} in this Python's files")
    log(f"[corpus] {len(docs)} documents from {len(files)} files; training a {vocab_size}-token BPE tokenizer")
    with StagedOutputs("--out") as outputs:  # every file whole, committed together: a failure keeps the last corpus
        tokenizer_path = train_tokenizer(docs, vocab_size, os.path.join(out, "tokenizer"), outputs)
        tokenizer = sft_data.load_tokenizer(tokenizer_path)
        splits: dict[str, dict] = {}
        for domain in DOMAINS:
            for split in SPLITS:
                chosen = [d for d in docs if d.domain == domain and d.split == split]
                if not chosen:
                    continue
                jsonl = outputs.stage(os.path.join(out, f"{domain}_{split}.jsonl"))
                with open(jsonl.temporary, "w", encoding="utf-8") as f:
                    for d in chosen:
                        f.write(json.dumps({"text": d.text, "source": d.source}, ensure_ascii=False) + "\n")
                prefix, n_docs, n_tokens = build_indexed_dataset(
                    jsonl.temporary, os.path.join(out, "indexed", f"{domain}_{split}"), tokenizer_path, outputs=outputs)
                splits[f"{domain}_{split}"] = dict(documents=n_docs, tokens=n_tokens,
                                                   characters=sum(len(d.text) for d in chosen),
                                                   prefix=os.path.relpath(prefix, out))
                log(f"[corpus] {domain}/{split}: {n_docs} documents, {n_tokens:,} tokens")
        tokens_by_source = {}
        for d in docs:
            key = d.source.split("#")[0]
            tokens_by_source[key] = tokens_by_source.get(key, 0) + len(tokenizer.encode(d.text)) + 1
        manifest = dict(
            versions=_versions(), vocab_size=tokenizer.vocab_size, split_percent=SPLIT_PERCENT,
            megatron_tokenizer_flags=megatron_tokenizer_flags(tokenizer_path).replace(os.path.abspath(out), "<corpus>"),
            null_tokenizer_flags=f"--tokenizer-type NullTokenizer --vocab-size {tokenizer.vocab_size} "
                                 f"--null-tokenizer-eod-id {tokenizer.eos_id}",
            tokenizer_sha256=hashlib.sha256(open(tokenizer_path, "rb").read()).hexdigest(),
            max_docs_per_split=max_docs_per_split, splits=splits,
            files=[dict(asdict(f), tokens=tokens_by_source.get(f.path, 0)) for f in files],
        )
        with outputs.open(os.path.join(out, "manifest.json")) as f:
            json.dump(manifest, f, indent=1)
    log(f"[corpus] wrote {out} in {time.perf_counter() - start:.0f} s")
    return manifest


def read_manifest(path: str) -> dict:
    """The corpus manifest ``path`` (``--check``); CorpusError naming the file and the field when it
    is not one :func:`build` wrote."""
    from recipes.runtime import sft_data

    try:
        want = sft_data.read_json_object(path, "corpus manifest")
    except sft_data.DataError as err:
        raise CorpusError(f"--check {err}; give the manifest.json python -m recipes.corpus wrote") from None
    fields = {"vocab_size": int, "files": list, "tokenizer_sha256": str}
    wrong = [name for name, kind in fields.items() if not isinstance(want.get(name), kind)]
    if not isinstance(want.get("max_docs_per_split", None), (int, type(None))):
        wrong.append("max_docs_per_split")
    if not wrong and not all(isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("sha256"), str)
                             for f in want["files"]):
        wrong.append("files[].path/sha256")
    if wrong:
        raise CorpusError(f"--check {path}: not a corpus manifest ({', '.join(wrong)} missing or of the wrong type); "
                          "give the manifest.json python -m recipes.corpus wrote")
    return want


def check(manifest_path: str, out: str, log=print) -> list[str]:
    """Rebuild into ``out`` and compare with ``manifest_path``: the differences, one line each."""
    want = read_manifest(manifest_path)
    got = build(out, want["vocab_size"], want.get("max_docs_per_split"), log=log)
    problems = []
    old = {f["path"]: f for f in want["files"]}
    new = {f["path"]: f for f in got["files"]}
    problems += [f"missing here: {p}" for p in sorted(set(old) - set(new))]
    problems += [f"not in the manifest: {p}" for p in sorted(set(new) - set(old))]
    problems += [f"differs (sha256): {p}" for p in sorted(set(old) & set(new)) if old[p]["sha256"] != new[p]["sha256"]]
    if want["tokenizer_sha256"] != got["tokenizer_sha256"]:
        problems.append("the tokenizer differs")
    return problems


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.corpus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="BPE vocabulary incl. 2 special tokens")
    parser.add_argument("--max-docs-per-split", type=int, default=None, help="smoke-sized corpus (tests)")
    parser.add_argument("--check", default=None, metavar="MANIFEST",
                        help="rebuild into --out and list the files that differ from this manifest (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.vocab_size < 256 + len(SPECIAL_TOKENS):
        parser.error(f"--vocab-size must cover the 256 byte symbols and {len(SPECIAL_TOKENS)} special tokens, "
                     f"got {args.vocab_size}")
    if args.max_docs_per_split is not None and args.max_docs_per_split < 1:
        parser.error(f"--max-docs-per-split must be positive, got {args.max_docs_per_split}")
    if args.check and not os.path.isfile(args.check):
        parser.error(f"--check: {args.check} is not a file")
    problem = directory_problem(args.out)
    if problem:
        parser.error(f"--out: {problem}; give a writable directory")
    try:
        if args.check:
            problems = check(args.check, args.out)
            for line in problems:
                print(f"[corpus] {line}")
            print(f"[corpus] {'matches' if not problems else f'{len(problems)} difference(s) from'} {args.check}")
            raise SystemExit(1 if problems else 0)
        build(args.out, args.vocab_size, args.max_docs_per_split)
    except (CorpusError, OSError) as err:  # a write failed (OutputError): the last corpus is still there, whole
        print(f"[corpus] error: {err}", file=sys.stderr)
        raise SystemExit(1 if isinstance(err, OutputError) else 2) from None
    except KeyboardInterrupt:  # Ctrl-C: the staged files are gone already, the last corpus untouched
        print(f"[corpus] stopped by SIGINT: nothing written to {args.out}", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None


if __name__ == "__main__":
    main()
