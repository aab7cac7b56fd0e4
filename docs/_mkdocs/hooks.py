"""MkDocs hooks of the documentation site: pages built from the sources they document.

The site reuses text that already lives elsewhere instead of copying it (copies drift):

``<!-- readme-section: TITLE -->``
    replaced by the body of README.md's section whose heading is exactly TITLE (any
    level), up to the next heading of the same or a higher level; headings inside it are
    re-levelled to start at ``##``. A TITLE that README.md no longer has fails the build,
    naming the page, so a renamed README section is noticed at once.
``<!-- readme-intro -->``
    replaced by what README.md says between its title and its first section.
``<!-- cli-reference -->``
    replaced by the ``--help`` output of ``atomic-checkpoint`` and of each of its
    commands, run at build time (``python -m atomic_checkpoint CMD --help``, 100 columns),
    so the page always shows the options of the code being documented.
``<!-- benchmark-figures: PATH.json -->``
    replaced by two tables built from that JSON document (written by
    ``benchmarks/run.py --json``; PATH is relative to docs/): each target met or
    missed, and the median seconds of each method and size; then the machine it ran on.

README.md's links to its own sections (GitHub anchors) are re-pointed at the page that
includes the section; a link to a section no page includes fails the build.
``tests/docs`` uses the same page list and section splitter to find the code samples
and to check, without building the site, that every included section still exists.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

_DIRECTIVE = re.compile(r"^<!--\s*([a-z-]+)(?::\s*(.*?))?\s*-->\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```+|~~~+)")


_DIRECTIVES = ("readme-section", "readme-intro", "cli-reference", "benchmark-figures")


class DocsBuildError(Exception):
    """A page asks for something its source no longer has (the build must fail)."""


@dataclass(frozen=True)
class Heading:
    level: int
    title: str
    line: int  # index into the document's lines


def headings(lines: list[str]) -> list[Heading]:
    """Markdown ATX headings outside fenced code blocks (``# train.py`` in a block is code)."""
    found: list[Heading] = []
    fence: str | None = None
    for i, line in enumerate(lines):
        m = _FENCE.match(line)
        if m:
            marker = m.group(1)
            if fence is None:
                fence = marker
            elif marker.startswith(fence):
                fence = None
            continue
        if fence is None:
            h = _HEADING.match(line)
            if h:
                found.append(Heading(len(h.group(1)), h.group(2), i))
    return found


def section_range(lines: list[str], title: str, *, where: str = "README.md") -> tuple[int, int]:
    """Line indexes ``(heading, end)`` of the section headed ``title``: from its heading to
    the next heading of the same or a higher level (or the end of the document)."""
    hs = headings(lines)
    matches = [h for h in hs if h.title == title]
    if len(matches) != 1:
        known = ", ".join(repr(h.title) for h in hs)
        what = "no" if not matches else f"{len(matches)}"
        raise DocsBuildError(f"{where} has {what} section titled {title!r}; its sections: {known}")
    start = matches[0]
    end = next((h.line for h in hs if h.line > start.line and h.level <= start.level), len(lines))
    return start.line, end


def section_lines(lines: list[str], title: str, *, where: str = "README.md") -> list[str]:
    """The body of the section headed ``title`` (the heading line itself excluded)."""
    first, end = section_range(lines, title, where=where)
    hs = headings(lines)
    start = next(h for h in hs if h.line == first)
    body = lines[start.line + 1 : end]
    # Re-level sub-headings so that the section's children become "##" on the page.
    shift = start.level + 1 - 2
    out: list[str] = []
    inner = {h.line: h for h in hs if start.line < h.line < end}
    for offset, line in enumerate(body, start=start.line + 1):
        h = inner.get(offset)
        out.append(line if h is None else "#" * max(2, h.level - shift) + " " + h.title)
    while out and not out[0].strip():
        out.pop(0)
    while out and not out[-1].strip():
        out.pop()
    return out


def github_slug(title: str) -> str:
    """The anchor GitHub gives a README heading (what README.md's own links use)."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


_ANCHOR_LINK = re.compile(r"\]\(#([^)\s]+)\)")
_DOCS_LINK = re.compile(r"\]\(docs/([^)#\s]+)(#[^)\s]*)?\)")


def _pages_including(docs_dir: Path) -> dict[str, str]:
    """README section title -> the first page (docs-relative, sorted) that includes it."""
    found: dict[str, str] = {}
    for path in sorted(docs_dir.rglob("*.md")):
        rel = path.relative_to(docs_dir).as_posix()
        if rel.startswith("_mkdocs/"):
            continue
        for line in path.read_text().splitlines():
            m = _DIRECTIVE.match(line.strip())
            if m and m.group(1) == "readme-section":
                found.setdefault((m.group(2) or "").strip(), rel)
    return found


def readme_section(title: str, page: str | None = None, docs_dir: Path | None = None) -> str:
    """README.md's section ``title``, its links to other README sections re-pointed."""
    text = "\n".join(section_lines(README.read_text().splitlines(), title))
    return text if page is None or docs_dir is None else repoint_links(text, page, docs_dir)


def repoint_links(text: str, page: str, docs_dir: Path) -> str:
    """Point README.md's links to its own sections (``](#anchor)``, GitHub's anchors) at
    the page of this site that includes that section, and its links into docs/ at those
    pages (``page`` is where ``text`` goes, relative to docs/)."""
    from markdown.extensions.toc import slugify

    titles = {github_slug(h.title): h.title for h in headings(README.read_text().splitlines())}
    including = _pages_including(docs_dir)

    def repoint(m: re.Match[str]) -> str:
        target = titles.get(m.group(1))
        if target is None:
            raise DocsBuildError(f"README.md links to #{m.group(1)}, which no heading has")
        if target not in including:
            raise DocsBuildError(
                f"README.md links to its section {target!r}, which no page of the site "
                f"includes: add `<!-- readme-section: {target} -->` to a page"
            )
        rel = os.path.relpath(including[target], os.path.dirname(page) or ".")
        here = including[target] == page
        return f"]({'' if here else rel}#{slugify(target, '-')})"

    def into_docs(m: re.Match[str]) -> str:
        # README.md links docs/X.md from the repository root; on the site X.md is a page.
        rel = os.path.relpath(m.group(1), os.path.dirname(page) or ".")
        return f"]({rel}{m.group(2) or ''})"

    return _DOCS_LINK.sub(into_docs, _ANCHOR_LINK.sub(repoint, text))


def readme_intro() -> str:
    lines = README.read_text().splitlines()
    hs = headings(lines)
    if not hs or hs[0].level != 1:
        raise DocsBuildError("README.md does not start with a '# title' heading")
    end = hs[1].line if len(hs) > 1 else len(lines)
    return "\n".join(lines[hs[0].line + 1 : end]).strip()


def cli_commands() -> list[str]:
    """The sub-commands of ``atomic-checkpoint``, in the order ``--help`` lists them."""
    sys.path.insert(0, str(REPO / "src"))
    try:
        from atomic_checkpoint.cli import build_parser
    finally:
        sys.path.pop(0)
    import argparse

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    raise DocsBuildError("atomic_checkpoint.cli.build_parser() has no sub-commands")


def cli_help(args: list[str]) -> str:
    env = dict(os.environ, COLUMNS="100", PYTHONPATH=str(REPO / "src"), NO_COLOR="1")
    proc = subprocess.run(
        [sys.executable, "-m", "atomic_checkpoint", *args, "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )
    if proc.returncode != 0:
        raise DocsBuildError(
            f"`atomic-checkpoint {' '.join(args)} --help` exited {proc.returncode}: "
            f"{proc.stderr.strip()}"
        )
    return proc.stdout.rstrip()


def cli_reference() -> str:
    parts = ["```text", "$ atomic-checkpoint --help", cli_help([]), "```"]
    for cmd in cli_commands():
        parts += ["", f"## `{cmd}`", "", "```text", f"$ atomic-checkpoint {cmd} --help"]
        parts += [cli_help([cmd]), "```"]
    return "\n".join(parts)


def _seconds(value: Any) -> str:
    return "" if value is None else f"{value:.3g}"


def benchmark_figures(json_path: Path) -> str:
    """The targets and the median seconds per method and size, from ``benchmarks/run.py --json``."""
    try:
        doc = json.loads(json_path.read_text())
        sizes = sorted(doc["sizes"].items(), key=lambda kv: kv[1]["state_bytes"])
        targets = doc["targets"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DocsBuildError(f"cannot read benchmark results {json_path}: {exc}") from exc
    rows = ["| figure | size | value | target | |", "|---|---|---|---|---|"]
    for t in targets:
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "**missed**")
        value = "" if t["value"] is None else f"{t['value']:.3g}"
        rows.append(f"| {t['figure']} | {t['size']} | {value} | {t['target']} | {verdict} |")
    # Per method: the async figures (blocked, durable) where a method has them, else its time.
    series: dict[tuple[str, str], None] = {}
    for _, s in sizes:
        for name, fig in s["medians"].items():
            keys = [k for k in ("blocked_s", "durable_s") if k in fig] or ["s"]
            for key in keys:
                if isinstance(fig.get(key), (int, float)):
                    series[(name, key)] = None
    rows += ["", "| median seconds | " + " | ".join(label for label, _ in sizes) + " |"]
    rows.append("|---|" + "---|" * len(sizes))
    for name, key in series:
        label = f"`{name}`" if key == "s" else f"`{name}` ({key[:-2]})"
        cells = [_seconds(s["medians"].get(name, {}).get(key)) for _, s in sizes]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    env = doc.get("environment", {})
    cfg = doc.get("config", {})
    rows += [
        "",
        f"{cfg.get('rounds', '?')} rounds per size, directory on "
        f"`{cfg.get('directory_fs', '?')}`, {env.get('cpus', '?')} CPUs, Python "
        f"{env.get('python', '?')}, torch {env.get('torch', '?')}, {env.get('platform', '?')}; "
        f"cold loads {'measured' if cfg.get('cold_loads') else 'skipped (not root)'}.",
    ]
    return "\n".join(rows)


def expand(markdown: str, page_src: str, docs_dir: Path) -> str:
    """Replace every directive of a page's markdown (see the module docstring)."""
    out: list[str] = []
    for line in markdown.splitlines():
        m = _DIRECTIVE.match(line.strip())
        if not m or m.group(1) not in _DIRECTIVES:
            out.append(line)
            continue
        name, arg = m.group(1), (m.group(2) or "").strip()
        try:
            if name == "readme-section":
                out.append(readme_section(arg, page_src, docs_dir))
            elif name == "readme-intro":
                out.append(repoint_links(readme_intro(), page_src, docs_dir))
            elif name == "cli-reference":
                out.append(cli_reference())
            else:
                out.append(benchmark_figures(docs_dir / arg))
        except DocsBuildError as exc:
            raise DocsBuildError(f"{page_src}: {line.strip()}: {exc}") from exc
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    from mkdocs.exceptions import PluginError

    try:
        return expand(markdown, page.file.src_uri, Path(config["docs_dir"]))
    except DocsBuildError as exc:
        raise PluginError(str(exc)) from exc


def iter_markdown_sources() -> Iterator[Path]:
    """README.md and every page of the site (what ``tests/docs`` scans for samples)."""
    yield README
    docs = REPO / "docs"
    for path in sorted(docs.rglob("*.md")):
        if "_mkdocs" not in path.relative_to(docs).parts:
            yield path
