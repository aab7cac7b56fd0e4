"""The parts of the documentation site that can go stale without a build: the README
sections its pages include, and README.md's links between its own sections. The whole
site is built, in strict mode, by ``scripts/docs.sh``.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import pytest

from tests.docs import samples as S


def test_every_readme_section_the_site_includes_exists() -> None:
    hooks = S.hooks
    asked = 0
    for page in (S.REPO / "docs").rglob("*.md"):
        for line in page.read_text().splitlines():
            m = hooks._DIRECTIVE.match(line.strip())
            if m and m.group(1) == "readme-section":
                assert hooks.readme_section(m.group(2)).strip(), f"{page}: {line}"
                asked += 1
            elif m and m.group(1) == "readme-intro":
                assert hooks.readme_intro().strip(), f"{page}: {line}"
    assert asked >= 10


def test_readme_sections_end_at_the_next_heading_not_at_a_comment_in_code() -> None:
    hooks = S.hooks
    lines = ["# t", "## A", "```bash", "# not a heading", "```", "### A.1", "x", "## B", "y"]
    assert hooks.section_lines(lines, "A") == ["```bash", "# not a heading", "```", "## A.1", "x"]
    with pytest.raises(hooks.DocsBuildError, match="no section titled 'C'"):
        hooks.section_lines(lines, "C")


def test_every_link_between_readme_sections_lands_on_a_page_of_the_site() -> None:
    hooks = S.hooks
    readme = hooks.README.read_text()
    assert hooks._ANCHOR_LINK.findall(readme), "README.md has no links to its own sections"
    text = hooks.repoint_links(readme, "cli.md", S.REPO / "docs")
    pages = re.findall(r"\]\(([^)#\s:]+\.md)(?:#[^)\s]*)?\)", text)
    assert pages, text
    missing = [p for p in pages if not (S.REPO / "docs" / p).is_file()]
    assert missing == [], f"README.md links to pages the site does not have: {missing}"
    with pytest.raises(hooks.DocsBuildError, match="which no heading has"):
        hooks.repoint_links("see [x](#no-such-section)", "cli.md", S.REPO / "docs")


def _extension(name: str) -> Any:
    """The site's griffe extension ``docs/_mkdocs/<name>.py`` (not a package: loaded by
    path, as mkdocs.yml names it)."""
    spec = importlib.util.spec_from_file_location(f"_{name}", S.REPO / f"docs/_mkdocs/{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load docs/_mkdocs/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grouped_args_become_one_entry_per_parameter_for_the_api_reference() -> None:
    module = _extension("grouped_args")
    doc = (
        "Doc.\n\nArgs:\n    a, b: as for x.\n    c: own.\n    d, e:\n        as for y.\n\n"
        "Note:\n    f, g: h"
    )
    assert module.split_grouped_args(doc).splitlines() == [
        "Doc.",
        "",
        "Args:",
        "    a: as for x.",
        "    b: as for x.",
        "    c: own.",
        "    d:",
        "        as for y.",
        "    e:",
        "        as for y.",
        "",
        "Note:",
        "    f, g: h",
    ]


def test_a_parameters_of_twin_shows_its_originals_signature_in_the_api_reference() -> None:
    griffe = pytest.importorskip("griffe", reason="the site's dependencies (scripts/docs.sh deps)")
    module = _extension("shared_params")

    def load(*extensions: object) -> object:
        return griffe.load(
            "atomic_checkpoint",
            search_paths=[str(S.REPO / "src")],
            extensions=griffe.load_extensions(*extensions),
        )

    def params(fn: object, skip_first: bool = False) -> list[tuple[str, str, str]]:
        ps = list(fn.parameters)[1 if skip_first else 0 :]  # type: ignore[attr-defined]
        return [(p.name, str(p.annotation), str(p.default)) for p in ps]

    pkg = load(module.SharedParameters())
    manager, dcp, hf = pkg["manager"], pkg["integrations.dcp"], pkg["integrations.hf"]
    mgr = manager["CheckpointManager"]
    assert params(mgr["save_async"]) == params(mgr["save"])
    assert ("overwrite", "bool", "False") in params(mgr["save_async"])
    assert params(dcp["async_save_dcp"]) == params(dcp["save_dcp"])
    init = hf["AtomicCheckpointCallback"]["__init__"]
    assert params(init)[0] == ("self", "None", "None")
    assert params(init, skip_first=True) == params(hf["make_atomic"], skip_first=True)
    # Without the extension the reference showed bare names (no types, no defaults).
    bare = load()["manager"]["CheckpointManager"]["save_async"]
    assert ("overwrite", "None", "None") in params(bare)
