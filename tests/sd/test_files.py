"""Files the SD layer writes (PNGs, the demo checkpoint) get the mode the umask gives new files.

Oracle: the mode of a file made with plain ``open(path, "w")`` under the same umask.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
from PIL import Image

from ov_accelerate_sd.demo_checkpoint import demo_checkpoint
from ov_accelerate_sd.pnginfo import read_png_infotext, save_png
from ov_backend.files import atomic_path

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX file modes")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _under_umask(mask: int, write) -> None:
    old = os.umask(mask)
    try:
        write()
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_png_mode_follows_the_umask(tmp_path: Path, mask: int) -> None:
    png, plain = tmp_path / "00000-1.png", tmp_path / "plain"

    def write() -> None:
        save_png(Image.new("RGB", (8, 8), "red"), png, "a cat\nSteps: 1, Seed: 1, Size: 8x8")
        plain.open("w").close()

    _under_umask(mask, write)
    assert _mode(png) == _mode(plain) == 0o666 & ~mask
    assert read_png_infotext(png).startswith("a cat")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00000-1.png", "plain"]


def test_demo_checkpoint_mode_follows_the_umask(tmp_path: Path) -> None:
    made: list[Path] = []

    def write() -> None:
        made.append(demo_checkpoint(tmp_path))
        (tmp_path / "plain").open("w").close()

    _under_umask(0o022, write)
    assert _mode(made[0]) == _mode(tmp_path / "plain") == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == [made[0].name, "plain"]


def test_atomic_path_keeps_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "a.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]
    with atomic_path(target) as tmp:
        tmp.write_text("new")
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]
