"""recipes/corpus.py: the real-text corpus built from this interpreter's own files (smoke-sized
here): three domains, stable splits, a manifest that detects a changed source, a BPE tokenizer, and
Megatron indexed datasets holding exactly the tokenized documents."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from recipes import corpus  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    manifest = corpus.build(str(out), vocab_size=320, max_docs_per_split=8, log=lambda _: None)
    return out, manifest


def test_every_domain_comes_from_the_interpreters_files():
    docs, files = corpus.collect()
    by_domain = {d: [x for x in docs if x.domain == d] for d in corpus.DOMAINS}
    assert all(len(v) >= 20 for v in by_domain.values()), {d: len(v) for d, v in by_domain.items()}
    assert all(x.source.startswith("stdlib:") and x.source.endswith(".py") for x in by_domain["code"])
    assert all("/test/" not in x.source for x in by_domain["code"])
    assert any(x.source.startswith("stdlib:pydoc_data/topics.py#") for x in by_domain["prose"])
    assert any("MIT License" in x.text or "Apache License" in x.text for x in by_domain["legal"])
    assert len({x.text for x in docs}) == len(docs)  # identical texts (licences) once
    # splits: a pure function of the name, roughly 90/5/5
    splits = [x.split for x in docs]
    assert splits == [corpus.Document(x.domain, x.source, "").split for x in docs]
    assert 0.8 < splits.count("train") / len(splits) < 0.97
    assert {f.path for f in files} == {x.source.split("#")[0] for x in docs}


def test_indexed_datasets_hold_the_tokenized_documents(built):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer

    out, manifest = built
    tokenizer = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.get_vocab_size() == manifest["vocab_size"] == 320
    for name, entry in manifest["splits"].items():
        texts = [json.loads(line)["text"] for line in open(out / f"{name}.jsonl", encoding="utf-8")]
        dataset = IndexedDataset(str(out / entry["prefix"]))
        assert len(dataset) == entry["documents"] == len(texts)
        for i, text in enumerate(texts):
            want = tokenizer.encode(text, add_special_tokens=False).ids + [eos]
            np.testing.assert_array_equal(dataset[i], want)
        assert sum(len(dataset[i]) for i in range(len(dataset))) == entry["tokens"]
    assert "--null-tokenizer-eod-id 0" in manifest["null_tokenizer_flags"]


def test_check_finds_a_changed_source(built, tmp_path):
    out, _ = built
    assert corpus.check(str(out / "manifest.json"), str(tmp_path / "same"), log=lambda _: None) == []
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"][0]["sha256"] = "0" * 64  # negative control: one source file "changed"
    manifest["files"].append(dict(manifest["files"][1], path="site:gone/LICENSE"))
    (tmp_path / "edited.json").write_text(json.dumps(manifest))
    problems = corpus.check(str(tmp_path / "edited.json"), str(tmp_path / "again"), log=lambda _: None)
    assert problems == ["missing here: site:gone/LICENSE", f"differs (sha256): {manifest['files'][0]['path']}"]


def test_usage_errors_are_one_line(tmp_path):
    def run(*argv):
        proc = subprocess.run([sys.executable, "-m", "recipes.corpus", *argv], cwd=ROOT, capture_output=True, text=True)
        return proc.returncode, proc.stderr.strip().splitlines()[-1]

    assert run("--out", str(tmp_path / "o"), "--vocab-size", "100")[0] == 2
    code, line = run("--out", str(tmp_path / "o"), "--check", str(tmp_path / "nope.json"))
    assert code == 2 and "--check" in line
    (tmp_path / "file").write_text("x")
    code, line = run("--out", str(tmp_path / "file" / "sub"))
    assert code == 2 and "--out" in line
