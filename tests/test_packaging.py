"""`pip install .` installs one top-level Python package, `specwire` (nothing named `common`
that could collide with other projects), with its generated gRPC stubs and the console script."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_only_the_specwire_package(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "--wheel-dir", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("specwire-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"specwire"}, sorted(top)
    assert "specwire/v1/generation_pb2.py" in names  # the stubs travel with the package
    assert "specwire/common/client.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "specwire = specwire.common.cli:main" in text
