"""The documentation holds together on its own: every relative link in the README,
CONTRIBUTING.md, bench/README.md and docs/ reaches a file of this repository (and a heading of
it, for a `#anchor`, by GitHub's anchor rules), the README stays a short front page, and
neither those documents nor the comments in config/ point at texts that are not in the
repository (a numbered specification, its sections, a tracker's issues).

Pure file reading: no gateway import, no network, well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: the documents whose links must resolve
LINKED = sorted(
    [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "bench" / "README.md",
        *(ROOT / "docs").glob("*.md"),
    ]
)

#: the documents, configuration comments and code that must not cite an outside
#: specification (this file names the pattern, so it is left out)
SELF_CONTAINED = sorted([
    *LINKED,
    *(ROOT / "config").glob("*.yaml"),
    ROOT / "pyproject.toml",
    *(path for top in ("gateway", "providers", "tests") for path in (ROOT / top).rglob("*")
      if path.suffix in (".py", ".js", ".html", ".css") and path != Path(__file__).resolve()),
])

README_MAX_LINES = 250

#: citations of texts outside the repository: a specification, its sections, a tracker's issues
OUTSIDE = re.compile(r"SPEC\s*§|SPEC\.md|§\s*\d|\bissues?\s+\d+|\bthe spec\b", re.IGNORECASE)

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target); the target ends at whitespace or the closing bracket
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a shell block is no heading,
    and a `[x](y)` in code is no link)."""
    lines: list[str] = []
    fence: str | None = None
    for line in text.splitlines():
        match = FENCE.match(line)
        if match:
            marker = match.group(1)
            if fence is None:
                fence = marker
            elif marker == fence:
                fence = None
            continue
        if fence is None:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lowercased, every character that is
    not a letter, digit, underscore, hyphen or space dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "")
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2 ... for repeats."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """Every link target outside code, a link whose text wraps onto the next line included."""
    prose = "\n".join(prose_lines(path.read_text(encoding="utf-8")))
    return LINK.findall(INLINE_CODE.sub("", prose))


def test_the_checked_documents_exist() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in LINKED}
    assert {"README.md", "CONTRIBUTING.md", "docs/hedging.md"} <= names, names


@pytest.mark.parametrize("path", LINKED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(path: Path) -> None:
    broken: list[str] = []
    for target in links(path):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not destination.exists():
            broken.append(f"{target}: no such file")
            continue
        if ROOT not in destination.parents and destination != ROOT:
            broken.append(f"{target}: outside the repository")
            continue
        if anchor:
            if destination.suffix != ".md":
                broken.append(f"{target}: anchor into a file that is not markdown")
            elif unquote(anchor).lower() not in anchors(destination):
                broken.append(f"{target}: no heading with that anchor")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)


def readme_section(title: str) -> str:
    """The prose of the README's `## title` section, up to the next heading of its level."""
    lines = prose_lines((ROOT / "README.md").read_text(encoding="utf-8"))
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end])


def code_constant(path: str, name: str) -> int:
    """An integer constant as written in a module (read as text: no gateway import)."""
    found = re.search(rf"^{name} = ([0-9_]+)$", (ROOT / path).read_text(encoding="utf-8"),
                      re.MULTILINE)
    assert found, f"{path}: no {name}"
    return int(found.group(1))


def test_the_readme_says_what_the_secure_defaults_cost() -> None:
    """The front page tells a new user which defaults refuse what, before they find out from
    a 403 or a 415: the settings that loosen each, and the body limits as the code has them."""
    section = " ".join(readme_section("Security").split())
    for said in ("server.api_keys", "server.allowed_origins", "server.allowed_hosts",
                 "server.ops_keys", "403", "415", "content-type: application/json",
                 "no CORS headers", "(docs/security.md)"):
        assert said in section, said
    depth = code_constant("gateway/wire/validate.py", "MAX_BODY_DEPTH")
    values = code_constant("gateway/wire/validate.py", "MAX_BODY_VALUES")
    assert f"{depth} levels" in section and f"{values:,} values" in section


def test_the_readme_keeps_the_test_command_in_a_code_block() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    code = [line for line in text.splitlines() if line not in prose_lines(text)]
    assert any(line.strip() == "bash .ci/run" for line in code)


@pytest.mark.parametrize("path", SELF_CONTAINED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_reference_to_an_outside_specification(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    cited = [
        f"{number}: {line.strip()}"
        for number, line in enumerate(text.splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not cited, "\n".join(cited)


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("Workers and replicas", "workers-and-replicas"),
        ("Traces (OpenTelemetry)", "traces-opentelemetry"),
        ("`hedge-gateway bench`", "hedge-gateway-bench"),
        ("2026-12-02 08:06 UTC: the figures", "2026-12-02-0806-utc-the-figures"),
        ("Soak: ten minutes of mixed traffic", "soak-ten-minutes-of-mixed-traffic"),
        ("The [front server](x.md)", "the-front-server"),
        ("delay_rule and budget", "delay_rule-and-budget"),
    ],
)
def test_slugs_follow_github(heading: str, expected: str) -> None:
    assert slug(heading) == expected


def test_fenced_code_is_neither_heading_nor_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n```bash\n# not a heading\necho [x](missing.md)\n```\n"
        "See [here](#title) and `[code](nowhere.md)`, [a wrapped\nlink](#title-1).\n"
        "## Title\n"
    )
    assert anchors(page) == {"title", "title-1"}
    assert links(page) == ["#title", "#title-1"]
