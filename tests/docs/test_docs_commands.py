"""Every ``bash`` block of README.md and docs/ is either run here as written or says why not.

A block is marked by an HTML comment on the line before its fence (invisible on the rendered page):

* ``<!-- cpu-test -->``: run on CPU by this test, in order with the page's other marked blocks, in
  one scratch directory per page (linked to the repository's ``recipes/``, ``launch/``,
  ``benchmarks/``, ``docs/``), with ``HOME`` there too (``~/.cache/megatron_llep`` is the page's own).
  ``<!-- cpu-test smoke: "A" -> "B", ... -->`` replaces text A by B first, to cut a long run to
  smoke size (more iterations, bigger models); nothing else in the command changes. A leading
  ``pip install ... &&`` is dropped: the suite runs in the environment it installs.
* ``<!-- not-cpu-tested: why -->``: GPUs, several nodes, the user's own files, or hours of CPU.

A page may need files a reader makes first by a step this test cannot take verbatim (the corpus of
docs/real_routing.md is built by a Python call, at smoke size here): :data:`PAGE_SETUP`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from test_pretrain import HAVE_MEGATRON_TRAINING, _free_port  # noqa: E402

PAGES = ["README.md", *sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
                              if name.endswith(".md"))]
FENCE = re.compile(r"(?:<!--\s*(?P<marker>[^\n]*?)\s*-->\n)?```bash\n(?P<body>.*?)\n```", re.S)
SMOKE = re.compile(r'"([^"]*)"\s*->\s*"([^"]*)"')
LINKED = ("recipes", "launch", "benchmarks", "docs")
PAGES_NEEDING_MEGATRON_LM = {"docs/pretrain.md", "docs/real_routing.md"}


@dataclass
class Block:
    page: str
    line: int
    body: str
    marker: str
    replacements: list[tuple[str, str]] = field(default_factory=list)

    @property
    def runs(self) -> bool:
        return self.marker.startswith("cpu-test")

    def command(self) -> str:
        text = self.body
        for old, new in self.replacements:
            assert old in text, f"{self.page}:{self.line}: smoke replacement {old!r} is not in the command"
            text = text.replace(old, new)
        return re.sub(r"^pip install [^\n]*?&&\s*", "", text, flags=re.M)


def blocks(page: str) -> list[Block]:
    text = open(os.path.join(ROOT, page)).read()
    found = []
    for match in FENCE.finditer(text):
        marker = (match.group("marker") or "").strip()
        block = Block(page, text[:match.start("body")].count("\n"), match.group("body"), marker)
        if marker.startswith("cpu-test smoke:"):
            block.replacements = SMOKE.findall(marker)
            assert block.replacements, f"{page}:{block.line}: cpu-test smoke: needs \"old\" -> \"new\" pairs"
        found.append(block)
    return found


@pytest.mark.release_independent
def test_every_bash_block_is_run_or_says_why_not():
    unmarked = [f"{block.page}:{block.line}" for page in PAGES for block in blocks(page)
                if not (block.marker == "cpu-test" or block.marker.startswith("cpu-test smoke:")
                        or re.match(r"not-cpu-tested: \S", block.marker))]
    assert not unmarked, f"bash blocks without <!-- cpu-test --> or <!-- not-cpu-tested: why --> before them: {unmarked}"


@pytest.mark.release_independent
def test_the_marker_parser_sees_markers_and_replacements():
    """Negative control of the parser: a block without its marker counts as unmarked, and a smoke
    replacement that is not in the command is an error rather than silently skipped."""
    page = "docs/pretrain.md"
    marked = [block for block in blocks(page) if block.runs]
    assert marked and all(block.line > 0 for block in marked)
    stripped = Block(page, 1, "python x.py --train-iters 10", "")
    assert not stripped.runs
    with pytest.raises(AssertionError, match="not in the command"):
        Block(page, 1, "python x.py", "cpu-test smoke:", [("--train-iters 10", "--train-iters 2")]).command()
    assert Block(page, 1, "pip install -e . && python x.py", "cpu-test").command() == "python x.py"


def _smoke_corpus(home: str) -> None:
    """docs/real_routing.md's corpus, where the page puts it (``python -m recipes.corpus --out``),
    at smoke size: the page's 4,096-token vocabulary, a few documents per split."""
    from recipes import corpus

    corpus.build(os.path.join(home, ".cache", "megatron_llep", "corpus"), vocab_size=4096, max_docs_per_split=6,
                 log=lambda _: None)


PAGE_SETUP = {"docs/real_routing.md": _smoke_corpus}


def _run_page(page: str, tmp_path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    for name in LINKED:
        os.symlink(os.path.join(ROOT, name), work / name)
    home = str(work)
    if page in PAGE_SETUP:
        PAGE_SETUP[page](home)
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, HOME=home, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
               PET_MASTER_PORT=_free_port(), OMP_NUM_THREADS="1",
               MEGATRON_LLEP_CACHE=os.environ.get("MEGATRON_LLEP_CACHE",
                                                  os.path.expanduser(os.path.join("~", ".cache", "megatron_llep"))))
    env.pop("WANDB_MODE", None)  # the entry points' own offline default is part of what runs
    for block in (b for b in blocks(page) if b.runs):
        command = block.command()
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=work, env=env, capture_output=True,
                              text=True, timeout=900)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{page}:{block.line} exit {proc.returncode}:\n{command}\n...\n{output[-3000:]}"
        assert "Traceback" not in output, f"{page}:{block.line}:\n{command}\n...\n{output[-3000:]}"


# A page without Megatron-LM's loop runs the recipes that tests/entry_points runs on every release: .ci/run
# runs it on one release; the pages that need Megatron-LM run wherever it is installed.
@pytest.mark.parametrize("page", [p if p in PAGES_NEEDING_MEGATRON_LM else pytest.param(p, marks=pytest.mark.release_independent)
                                  for p in PAGES if any(b.runs for b in blocks(p))])
def test_documented_cpu_commands_run_as_written(page, tmp_path):
    if page in PAGES_NEEDING_MEGATRON_LM and not HAVE_MEGATRON_TRAINING:
        pytest.skip("megatron.training (Megatron-LM's loop) is not in this megatron-core wheel (0.17+ ship it)")
    _run_page(page, tmp_path)
    shutil.rmtree(tmp_path / "work", ignore_errors=True)
