"""The Python code samples of README.md and of the documentation site, as the tests run them.

Every fenced ``python`` block in README.md and docs/**/*.md carries a marker on the line
right above its fence (an HTML comment, invisible once rendered):

``<!-- sample: run -->``
    runs as it is, in a fresh interpreter whose working directory is an empty temporary
    directory.
``<!-- sample: run setup=NAME -->``
    runs after the setup ``NAME`` of :data:`SETUPS` (a small model and optimizer for
    samples that, like the README's two lines, use the names of the reader's training
    script).
``<!-- sample: run continue -->``
    runs in the same interpreter right after the sample above it in the same file (the
    README's save, then its restart).
``<!-- sample: skip REASON -->``
    is not run; REASON says what it needs (a GPU job, an S3 bucket, a mount) and which
    test or example runs the same thing.

A ``python`` block without a marker is an error: a new sample must say whether it runs.
A ``print(...)`` whose comment starts like a value (``# [200, 300]: ...``, ``# 200 True``)
shows the sample's output: the printed line must be that comment, or its beginning up
to a colon or a space.
Checkpoint roots written as absolute paths (``"/checkpoints/run1"``, ``"/ckpt/run1"``)
are rewritten to relative ones, so that the sample writes into its temporary directory.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

_MARKER = re.compile(r"^<!--\s*sample:\s*(run|skip)\b(.*?)-->\s*$")
_FENCE_OPEN = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
_ABSOLUTE_ROOT = re.compile(r"""(["'])/(checkpoints|ckpt)/""")
_SHOWN = re.compile(r"""^\s*print\(.*\)\s+#\s*([\[{(0-9'"-].*)$""")


def missing_output(shown: list[str], stdout: str) -> list[str]:
    """The shown outputs that the printed lines do not match, in order."""
    printed = [ln.strip() for ln in stdout.splitlines()]
    missing = []
    i = 0
    for want in shown:
        while i < len(printed) and not (
            printed[i]
            and want.startswith(printed[i])
            and want[len(printed[i]) : len(printed[i]) + 1] in ("", ":", " ")
        ):
            i += 1
        if i == len(printed):
            missing.append(want)
            i = 0
        else:
            i += 1
    return missing


#: Code run before a sample marked ``setup=NAME``.
SETUPS = {
    "training": """\
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(4, 8)).sum().backward()
opt.step()
step, loss = 100, 0.25
""",
}
SETUPS["manager"] = (
    SETUPS["training"]
    + """\
from atomic_checkpoint import CheckpointManager

mgr = CheckpointManager("ckpt-sample")
"""
)


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    action: str | None  # "run", "skip" or None (unmarked)
    setup: str | None = None
    continues: bool = False
    reason: str = ""

    @property
    def where(self) -> str:
        path = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{path}:{self.line}"


@dataclass
class Sample:
    """One interpreter run: a ``run`` block and the ``run continue`` blocks after it."""

    blocks: list[Block] = field(default_factory=list)

    @property
    def where(self) -> str:
        return self.blocks[0].where

    @property
    def needs_torch(self) -> bool:
        return self.blocks[0].setup is not None or any(
            re.search(r"^\s*(import|from) torch\b", b.code, re.M) for b in self.blocks
        )

    def shown_output(self) -> list[str]:
        """The outputs the comments of its ``print(...)`` lines show, in order."""
        shown = []
        for b in self.blocks:
            for line in b.code.splitlines():
                m = _SHOWN.match(line)
                if m:
                    shown.append(m.group(1).strip())
        return shown

    def script(self) -> str:
        parts = []
        setup = self.blocks[0].setup
        if setup is not None:
            parts.append(f"# setup={setup}\n" + SETUPS[setup])
        for b in self.blocks:
            parts.append(f"# {b.where}\n" + _ABSOLUTE_ROOT.sub(r"\1\2/", b.code))
        return "\n".join(parts)


def python_blocks(path: Path) -> list[Block]:
    """Every fenced python block of a markdown file, with the marker above it (if any)."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE_OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        if lang in ("python", "py"):
            marker = _MARKER.match(lines[i - 1].strip()) if i > 0 else None
            block = Block(path, i + 1, "\n".join(lines[i + 1 : j]) + "\n", None)
            if marker:
                block.action = marker.group(1)
                words = marker.group(2).strip()
                if block.action == "skip":
                    block.reason = words
                else:
                    for word in words.split():
                        if word == "continue":
                            block.continues = True
                        elif word.startswith("setup="):
                            block.setup = word.split("=", 1)[1]
                        else:
                            block.reason = f"unknown word {word!r} in the marker"
            blocks.append(block)
        i = j + 1
    return blocks


def _hooks() -> Any:
    """docs/_mkdocs/hooks.py, which lists the pages and splits README.md into sections."""
    spec = importlib.util.spec_from_file_location("_docs_hooks", REPO / "docs/_mkdocs/hooks.py")
    if spec is None or spec.loader is None:
        raise ImportError("cannot load docs/_mkdocs/hooks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_docs_hooks", module)
    spec.loader.exec_module(module)
    return module


hooks = _hooks()


def sources() -> list[Path]:
    return list(hooks.iter_markdown_sources())


def all_blocks() -> list[Block]:
    return [b for path in sources() for b in python_blocks(path)]


def problems(blocks: list[Block]) -> list[str]:
    """What is wrong with the markers of these blocks (one line each)."""
    out = []
    previous: Block | None = None
    for b in blocks:
        if b.action is None:
            out.append(
                f"{b.where}: python block without a marker: put `<!-- sample: run -->` or "
                "`<!-- sample: skip WHY -->` on the line above its fence (tests/docs/samples.py)"
            )
        elif b.action == "skip" and not b.reason:
            out.append(f"{b.where}: `sample: skip` must say why the sample cannot run here")
        elif b.action == "run" and b.reason:
            out.append(f"{b.where}: {b.reason}")
        elif b.setup is not None and b.setup not in SETUPS:
            out.append(f"{b.where}: unknown setup {b.setup!r}; known: {sorted(SETUPS)}")
        elif b.continues and (
            previous is None or previous.path != b.path or previous.action != "run"
        ):
            out.append(f"{b.where}: `continue` needs a runnable sample right above it")
        previous = b
    return out


def samples(paths: list[Path] | None = None) -> list[Sample]:
    """The runnable samples, in file order (``continue`` blocks joined to theirs)."""
    out: list[Sample] = []
    for path in paths if paths is not None else sources():
        current: Sample | None = None
        for b in python_blocks(path):
            if b.action != "run":
                current = None
            elif b.continues and current is not None:
                current.blocks.append(b)
            else:
                current = Sample([b])
                out.append(current)
    return out


def readme_section_samples(title: str) -> list[Sample]:
    """The runnable samples of one README.md section (the packaging test runs these)."""
    first, end = hooks.section_range(hooks.README.read_text().splitlines(), title)
    return [s for s in samples([hooks.README]) if first < s.blocks[0].line - 1 < end]
