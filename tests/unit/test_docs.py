"""The docs are the project's own: nothing points outside the repository, and every link and
cited record resolves in it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = re.compile(r"DESIGN\.md|\.\./shared")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
# a path into docs/ with an extension, as prose cites a record (not `git show COMMIT:docs/...`)
DOCS_PATH = re.compile(r"(?<![:\w/.-])docs/[\w./-]+\.(?:md|json|png|txt)\b")


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.decode().split("\0") if name]


def text_of(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
        return None  # binary (a plot), or deleted in the work tree


def manual() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_no_tracked_file_points_outside_the_repository():
    this = Path(__file__).resolve()
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in tracked_files() if path.resolve() != this
             and (text := text_of(path)) is not None
             for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert found == []


def test_every_relative_markdown_link_resolves():
    broken = []
    for doc in manual():
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in the same page
            if not (doc.parent / target.split("#")[0]).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


def test_every_cited_docs_file_exists():
    missing = [f"{path.relative_to(ROOT)}: {cited}"
               for path in tracked_files() if path.suffix in (".md", ".py")
               and (text := text_of(path)) is not None
               for cited in DOCS_PATH.findall(text) if not (ROOT / cited).exists()]
    assert missing == []
