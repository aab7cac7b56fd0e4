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
``<!-- sample: run prelude=NAME -->``
    runs between the two parts of ``tests/docs/preludes/NAME.py`` (split at its line
    ``# --- sample ---``; the part after it, if any, checks what the sample did). A
    prelude builds what the sample assumes without showing it on the site: a tiny model
    and Trainer, a process group, a stock run's output. A line ``# include: PART`` stands
    for the text of ``tests/docs/preludes/PART.py``, what several preludes share (their
    names start with ``_``); a prelude may import from the runnable examples (``from
    examples.hf_trainer import Tokens``): the repository is on its path. Its ``# needs:``
    line names the real services the test starts for it: ``s3`` (the testbed's S3 server;
    the endpoint ``http://127.0.0.1:9000`` a sample shows is replaced by the server's, and
    the environment holds its address as ``SAMPLE_S3_ENDPOINT`` and credentials as
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``), ``sshfs:DIR`` or ``s3fs:DIR`` (a real
    sshfs mount, or an s3fs-fuse mount of a bucket of that server, at ``DIR`` in the
    sample's working directory), ``launch:N`` (the sample is a training script,
    ``train.py``, launched on N ranks by ``python -m atomic_checkpoint.launch``; the
    part of the prelude after the sample then runs after the launch, in a fresh
    interpreter). The NCCL backend a sample names runs as gloo: the tests run on CPUs.
``<!-- sample: run exit=N ... -->``
    must exit with status N (a launched job's requeue code).
``<!-- sample: run raises=NAME ... -->``
    must end with the exception ``NAME`` (a "before" sample showing the failure a
    stock run meets).
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
Checkpoint roots written as absolute paths (``"/checkpoints/run1"``, ``"/ckpt/run1"``,
``"/dev/shm/run1"``, ``"/mnt/nfs/..."``, ``"/mnt/bucket/..."``) are rewritten to relative
ones, so that the sample writes into its temporary directory (where a prelude's
``# needs:`` puts the mount the path stands for).
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
_ABSOLUTE_ROOT = re.compile(r"""(["'])/(checkpoints|ckpt|dev/shm|mnt/nfs|mnt/bucket)/""")
#: The S3 endpoint samples show; the test replaces it by its S3 server's.
SHOWN_S3_ENDPOINT = "http://127.0.0.1:9000"
PRELUDES = Path(__file__).resolve().parent / "preludes"
_SPLIT = "# --- sample ---"
_NEEDS = re.compile(r"^# needs:(.*)$", re.M)
_INCLUDE = re.compile(r"^# include: (\w+)\n", re.M)
#: Run before a prelude, so that it can import from examples/ instead of copying them.
_EXAMPLES_IMPORTABLE = f"import sys\n\nsys.path.append({str(REPO)!r})\n"
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
    prelude: str | None = None
    raises: str | None = None
    exit: int = 0
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
        code = [b.code for b in self.blocks] + list(self._prelude())
        return self.blocks[0].setup is not None or any(
            re.search(r"^\s*(import|from) (torch|transformers|accelerate|lightning)\b", c, re.M)
            for c in code
        )

    @property
    def raises(self) -> str | None:
        return self.blocks[-1].raises

    @property
    def exit(self) -> int:
        return self.blocks[-1].exit

    def launch_ranks(self) -> int | None:
        """N when its prelude needs ``launch:N``: the sample is a job of N ranks."""
        for need in self.needs():
            if need.startswith("launch:"):
                return int(need.split(":", 1)[1])
        return None

    def after_script(self) -> str:
        """The prelude's check of what a launched sample did, run after the launch."""
        return self._prelude()[1]

    def needs(self) -> list[str]:
        """The services its prelude's ``# needs:`` line asks for (``s3``, ``sshfs:DIR``...)."""
        m = _NEEDS.search("".join(self._prelude()))
        return m.group(1).split() if m else []

    def _prelude(self) -> tuple[str, str]:
        name = self.blocks[0].prelude
        if name is None:
            return "", ""
        text = (PRELUDES / f"{name}.py").read_text()
        text = _INCLUDE.sub(lambda m: (PRELUDES / f"{m.group(1)}.py").read_text(), text)
        before, _, after = text.partition(_SPLIT)
        return before, after

    def shown_output(self) -> list[str]:
        """The outputs the comments of its ``print(...)`` lines show, in order."""
        shown = []
        for b in self.blocks:
            for line in b.code.splitlines():
                m = _SHOWN.match(line)
                if m:
                    shown.append(m.group(1).strip())
        return shown

    def script(self, s3_endpoint: str | None = None, *, check: bool = True) -> str:
        parts = []
        setup = self.blocks[0].setup
        if setup is not None:
            parts.append(f"# setup={setup}\n" + SETUPS[setup])
        before, after = self._prelude()
        if before:
            parts.append(f"# prelude={self.blocks[0].prelude}\n" + _EXAMPLES_IMPORTABLE + before)
        for b in self.blocks:
            code = _ABSOLUTE_ROOT.sub(r"\1\2/", b.code)
            code = code.replace('init_process_group("nccl")', 'init_process_group("gloo")')
            if s3_endpoint is not None:
                code = code.replace(SHOWN_S3_ENDPOINT, s3_endpoint)
            parts.append(f"# {b.where}\n" + code)
        if check and after.strip():
            parts.append(f"# after the sample: {self.blocks[0].prelude}\n" + after)
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
                        elif word.startswith("prelude="):
                            block.prelude = word.split("=", 1)[1]
                        elif word.startswith("raises="):
                            block.raises = word.split("=", 1)[1]
                        elif word.startswith("exit=") and word[5:].isdigit():
                            block.exit = int(word[5:])
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
        elif b.prelude is not None and not (PRELUDES / f"{b.prelude}.py").is_file():
            known = sorted(p.stem for p in PRELUDES.glob("*.py"))
            out.append(f"{b.where}: no prelude tests/docs/preludes/{b.prelude}.py; known: {known}")
        elif b.continues and (b.prelude or b.setup):
            out.append(f"{b.where}: a `continue` sample runs after the one above: no setup")
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
