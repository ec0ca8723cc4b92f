"""Every fenced Python block of README.md and docs/*.md runs as written, on the CPU, in a fresh interpreter.

A block may be preceded by HTML comments (invisible in rendered Markdown) that this test reads:

* ``<!-- snippet: expect-regex PATTERN -->`` — the block's stdout must match PATTERN (``re.search``);
* ``<!-- snippet: skip REASON -->`` — not run here; REASON says what runs it instead.

Each block runs in its own subprocess (``python -c``) from a scratch directory, with this checkout's
``src`` first on the path, under a time limit well above what the blocks need (seconds each).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIMIT_S = 240
MARKER = re.compile(r"<!--\s*snippet:\s*(expect-regex|skip)\s+(.*?)\s*-->")


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    expect: tuple[str, ...]
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Snippet]:
    """The ```python fenced blocks of ``path`` with the snippet markers on the lines right above each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            expect, skip, k = [], None, i - 1
            while k >= 0 and (m := MARKER.search(lines[k])):
                if m.group(1) == "skip":
                    skip = m.group(2)
                else:
                    expect.append(m.group(2))
                k -= 1
            out.append(Snippet(path, i + 1, "\n".join(lines[i + 1 : j]) + "\n", tuple(expect), skip))
            i = j
        i += 1
    return out


SNIPPETS = [s for p in DOCS for s in python_blocks(p)]


def test_the_readme_has_runnable_python_blocks():
    readme = [s for s in SNIPPETS if s.path.name == "README.md" and s.skip is None]
    assert len(readme) >= 5, [s.id for s in readme]  # transformers, vLLM config, runtime, Prometheus, ops


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.id)
def test_snippet_runs_as_written(snippet: Snippet, tmp_path):
    if snippet.skip is not None:
        pytest.skip(snippet.skip)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="")  # the CPU, as the text promises
    proc = subprocess.run([sys.executable, "-c", snippet.code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=LIMIT_S)
    assert proc.returncode == 0, f"{snippet.id} failed:\n{proc.stderr[-3000:]}"
    for pattern in snippet.expect:
        assert re.search(pattern, proc.stdout), f"{snippet.id}: stdout does not match {pattern!r}:\n{proc.stdout[-2000:]}"
