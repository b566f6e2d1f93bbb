"""Every relative link of the README and of docs/ (and every `docs/...` path they name) leads to a
file or folder of the repository, so moving or removing a page cannot leave a dangling link."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
NAMED_DOCS_PATH = re.compile(r"`(docs/[^`<>*\s]+)`")


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", root / "bench" / "PLAN_COST.md", *sorted((root / "docs").rglob("*.md"))]


def dangling_links(root: Path = ROOT) -> list[str]:
    """``page: target`` for every relative link or named docs/ path that leads nowhere."""
    problems = []
    for page in pages(root):
        text = page.read_text()
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                problems.append(f"{page.relative_to(root)}: {target}")
        for named in NAMED_DOCS_PATH.findall(text):
            if not (root / named.split("#", 1)[0].split("::", 1)[0]).exists():
                problems.append(f"{page.relative_to(root)}: `{named}`")
    return problems


def test_every_link_of_the_readme_and_docs_leads_somewhere():
    problems = dangling_links()
    assert not problems, "dangling links:\n" + "\n".join(problems)


def test_a_dangling_link_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "PLAN_COST.md").write_text("see [x](../docs/a.md)\n")
    (tmp_path / "docs" / "a.md").write_text("[b](b.md#part), [web](https://example.com), [here](#top)\n")
    (tmp_path / "README.md").write_text("[a](docs/a.md) and `docs/gone/`\n")
    assert dangling_links(tmp_path) == ["README.md: `docs/gone/`", "docs/a.md: b.md#part"]
