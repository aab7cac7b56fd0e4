"""The wheel and the sdist: they build, their metadata is complete, and the wheel works
when installed the way README.md's "Install" section says, in a fresh venv.

Both are built with setuptools' PEP 517 hooks (what ``python -m build --no-isolation``
calls), from a copy of the files a release contains, so the test needs neither the
network nor the ``build`` package and writes nothing into the working tree. The
fresh-venv test installs from PyPI (or pip's cache), with ``torch==2.13.0`` named in the
same command as the README says, pinned by ``requirements/constraints.txt``.
"""

from __future__ import annotations

import email.parser
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.docs import samples as S

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "atomic_checkpoint"
EXTRAS = {"torch", "s3", "fsspec", "hf", "lightning", "dev"}


def _version() -> str:
    text = (PACKAGE / "_version.py").read_text()
    m = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", text)
    if m is None:
        raise AssertionError(f"no __version__ in {PACKAGE / '_version.py'}")
    return m.group(1)


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"wheel": ..., "sdist": ...}`` built from a copy of pyproject.toml, README.md, src/."""
    tree = tmp_path_factory.mktemp("tree")
    shutil.copy2(REPO / "pyproject.toml", tree)
    shutil.copy2(REPO / "README.md", tree)
    shutil.copytree(
        REPO / "src",
        tree / "src",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
    )
    out = tmp_path_factory.mktemp("dist")
    hooks = (
        "import sys\n"
        "from setuptools import build_meta as b\n"
        "out = sys.argv[1]  # build_meta rewrites sys.argv while it runs\n"
        "b.build_sdist(out)\n"
        "b.build_wheel(out)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", hooks, str(out)],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"building failed:\n{proc.stdout}\n{proc.stderr}"
    assert "deprecated" not in proc.stderr.lower(), proc.stderr
    built = {"sdist": sorted(out.glob("*.tar.gz")), "wheel": sorted(out.glob("*.whl"))}
    assert all(len(v) == 1 for v in built.values()), built
    return {k: v[0] for k, v in built.items()}


def _metadata(wheel: Path) -> tuple[email.message.Message, set[str]]:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(info).decode())
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        meta["X-Entry-Points"] = z.read(entry).decode()
    return meta, names


def test_wheel_metadata_and_contents(dists: dict[str, Path]) -> None:
    wheel = dists["wheel"]
    assert wheel.name == f"atomic_checkpoint-{_version()}-py3-none-any.whl"
    meta, names = _metadata(wheel)
    assert meta["Name"] == "atomic-checkpoint"
    assert meta["Version"] == _version()
    assert (meta["License-Expression"] or meta["License"]) == "Apache-2.0"
    assert meta["Requires-Python"] == ">=3.10"
    assert meta["Summary"]
    assert meta["Description-Content-Type"] == "text/markdown"
    assert str(meta.get_payload()).strip() == (REPO / "README.md").read_text().strip()
    assert set(meta.get_all("Provides-Extra", [])) == EXTRAS
    requires = meta.get_all("Requires-Dist", [])
    assert [r for r in requires if "extra ==" not in r] == ["xxhash>=3"], requires
    assert 'torch>=2.2; extra == "torch"' in requires
    assert "atomic-checkpoint = atomic_checkpoint.cli:main" in meta["X-Entry-Points"]
    assert "atomic_checkpoint/py.typed" in names
    # Every module of the package ships, and nothing else does (no tests, docs, examples).
    modules = {p.relative_to(REPO / "src").as_posix() for p in PACKAGE.rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    assert all(n.startswith(("atomic_checkpoint/", "atomic_checkpoint-")) for n in names), names


def test_every_extra_is_satisfied_by_the_pinned_versions(dists: dict[str, Path]) -> None:
    """``pip install 'atomic-checkpoint[hf]'`` (or any extra) with the project's pins: each
    requirement of each extra names a package that constraints.txt pins, to a version the
    requirement accepts (bootstrap installs exactly those, so the extras are tested)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (REPO / "requirements" / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    meta, _ = _metadata(dists["wheel"])
    checked = 0
    for text in meta.get_all("Requires-Dist", []):
        req = Requirement(text)
        extras = [e for e in EXTRAS if req.marker is not None and req.marker.evaluate({"extra": e})]
        pinned = pins.get(canonicalize_name(req.name))
        if extras == ["dev"] or (not extras and req.marker is None and pinned is None):
            continue  # dev tools and the core's own dependency are installed from dev.txt
        assert pinned is not None, f"{text}: {req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pinned, prereleases=True), f"{text}: pinned {pinned}"
        checked += 1
    assert checked >= 7, checked


def test_sdist_contains_what_the_wheel_is_built_from(dists: dict[str, Path]) -> None:
    sdist = dists["sdist"]
    assert sdist.name == f"atomic_checkpoint-{_version()}.tar.gz"
    top = f"atomic_checkpoint-{_version()}/"
    with tarfile.open(sdist) as t:
        names = {n.removeprefix(top) for n in t.getnames()}
    assert {"pyproject.toml", "README.md", "PKG-INFO", "src/atomic_checkpoint/py.typed"} <= names
    modules = {p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py")}
    assert modules <= names, sorted(modules - names)


def test_twine_check_passes(dists: dict[str, Path]) -> None:
    pytest.importorskip(
        "twine", reason="twine comes with requirements/docs.txt (scripts/docs.sh installs it)"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, dists.values())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _readme_install_command() -> list[str]:
    """The ``pip install`` line of README.md's "Install" section, as words."""
    lines = S.hooks.section_lines((REPO / "README.md").read_text().splitlines(), "Install")
    found = [ln.split("#")[0].strip() for ln in lines if ln.strip().startswith("pip install ")]
    assert len(found) == 1, f"README.md's Install section should have one pip line: {found}"
    return shlex.split(found[0])


@pytest.mark.slow
def test_fresh_venv_installs_the_wheel_as_the_readme_says_and_runs_it(
    dists: dict[str, Path], tmp_path: Path
) -> None:
    words = _readme_install_command()
    spec = next(w for w in words if w.startswith("atomic-checkpoint"))
    assert "torch==2.13.0" in words, f"README's install line must pin torch: {words}"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # The README's line, with the built wheel in place of the name on the package index.
    args = [
        str(dists["wheel"]) + spec.removeprefix("atomic-checkpoint") if w == spec else w
        for w in words[2:]
    ]
    pip = [str(py), "-m", "pip", "install", "--no-input", "--progress-bar", "off"]
    pip += ["-c", str(REPO / "requirements" / "constraints.txt"), *args]
    proc = subprocess.run(pip, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{shlex.join(pip)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr}"

    work = tmp_path / "work"
    work.mkdir()

    def run(*cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=120)

    where = run(str(py), "-c", "import atomic_checkpoint as a; print(a.__file__, a.__version__)")
    assert where.returncode == 0, where.stderr
    assert where.stdout.startswith(str(venv)), f"imported from outside the venv: {where.stdout}"
    assert where.stdout.split()[1] == _version()

    helped = run(str(venv / "bin" / "atomic-checkpoint"), "--help")
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: atomic-checkpoint"), helped.stdout

    two_lines = S.readme_section_samples("Two lines")
    assert two_lines, "README.md's 'Two lines' section has no runnable sample"
    for sample in two_lines:
        script = tmp_path / "sample.py"
        script.write_text(sample.script())
        ran = run(str(py), str(script))
        assert ran.returncode == 0, f"{sample.where}:\n{sample.script()}\n{ran.stderr}"
        assert "resumed from step 100" in ran.stdout, ran.stdout

    verified = run(str(venv / "bin" / "atomic-checkpoint"), "verify", "checkpoints/run1")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "checkpoint-100" in verified.stdout, verified.stdout
