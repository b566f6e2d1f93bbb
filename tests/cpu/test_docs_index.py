"""The README stays a page a newcomer reads in two minutes, and every page of docs/ can be found:
each docs/*.md is listed in docs/README.md, and each page under docs/evidence/ in
docs/evidence/README.md or in the README.md of its folder, itself listed there. The README's
set-up and main-job commands are the ones CI runs (``.ci/run``)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 150
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)


def linked_pages(page: Path) -> set[Path]:
    """The pages a page links to (a link to a folder leads to its README.md), resolved."""
    found = set()
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        found.add(path / "README.md" if path.is_dir() else path)
    return found


def reachable_through_indexes(start: Path, within: Path) -> set[Path]:
    """``start`` and the pages reached from it by links, following on only from the README.md
    pages (the indexes) inside ``within``."""
    seen, todo = set(), [start.resolve()]
    while todo:
        page = todo.pop()
        if page in seen or not page.is_file():
            continue
        seen.add(page)
        if page.name == "README.md" and page.is_relative_to(within.resolve()):
            todo.extend(linked_pages(page))
    return seen


def unindexed_pages(root: Path = ROOT) -> list[str]:
    """The pages of docs/ that no index lists, relative to the repository."""
    docs = root / "docs"
    index = linked_pages(docs / "README.md")
    missing = [p for p in sorted(docs.glob("*.md")) if p.name != "README.md" and p.resolve() not in index]
    evidence = docs / "evidence"
    if evidence.is_dir():
        reached = reachable_through_indexes(evidence / "README.md", evidence) if (
            (evidence / "README.md").resolve() in index) else set()
        missing += [p for p in sorted(evidence.rglob("*.md")) if p.resolve() not in reached]
    return [str(p.relative_to(root)) for p in missing]


def section_commands(markdown: str, heading: str) -> list[list[str]]:
    """The words of each command line in the bash blocks of the section ``## heading``."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", markdown, re.S | re.M)
    assert match, f"no section '## {heading}'"
    lines = [line for block in CODE_BLOCK.findall(match.group(1)) for line in block.splitlines()]
    return [words for line in lines if (words := shlex.split(line, comments=True))]


def ci_commands(script: str) -> list[list[str]]:
    """The words of each command of a shell script, ``python3 -m`` dropped, ``--quiet`` left out."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        words = [w for w in shlex.split(line, comments=True) if w != "--quiet"]
        commands.append(words[2:] if words[:2] == ["python3", "-m"] else words)
    return [c for c in commands if c]


def test_the_readme_is_read_in_two_minutes():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move details to docs/"


def test_every_page_of_docs_is_listed_in_an_index():
    missing = unindexed_pages()
    assert not missing, "pages no index lists (add them to docs/README.md or docs/evidence/README.md):\n" + "\n".join(
        missing)


def test_an_unlisted_page_is_found(tmp_path):
    docs, runs = tmp_path / "docs", tmp_path / "docs" / "evidence" / "runs"
    runs.mkdir(parents=True)
    (docs / "README.md").write_text("[a](a.md), [evidence](evidence/)\n")
    for name in ("a.md", "b.md"):
        (docs / name).write_text("[back](README.md)\n")
    (docs / "evidence" / "README.md").write_text("[runs](runs/README.md), [b](../b.md)\n")
    (runs / "README.md").write_text("[one](one.md)\n")
    (runs / "one.md").write_text("")
    (runs / "two.md").write_text("")
    assert unindexed_pages(tmp_path) == ["docs/b.md", "docs/evidence/runs/two.md"]


def test_evidence_the_docs_index_does_not_list_is_unlisted(tmp_path):
    (tmp_path / "docs" / "evidence").mkdir(parents=True)
    (tmp_path / "docs" / "README.md").write_text("nothing\n")
    (tmp_path / "docs" / "evidence" / "README.md").write_text("")
    assert unindexed_pages(tmp_path) == ["docs/evidence/README.md"]


def test_the_readme_sets_up_and_runs_as_ci_does():
    readme = (ROOT / "README.md").read_text()
    ci = ci_commands((ROOT / ".ci" / "run").read_text())
    assert section_commands(readme, "Run") == [["pytest", "-n", "auto"]]
    assert ["pytest", "-n", "auto"] in ci
    setup = [words for words in section_commands(readme, "Set up") if words[:2] == ["pip", "install"]]
    torch_first, project = setup
    assert torch_first[:3] == ["pip", "install", "torch==2.13.0"] and project == ["pip", "install", "-e", ".[test]"]
    assert ci.index(["pip", "install", "torch==2.13.0"]) < ci.index(["pip", "install", "-e", ".[test]"])
