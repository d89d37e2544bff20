"""gpuwatch.atomic.write_file, the one way the package replaces a file: old or new, never half, no temp
file left behind whatever fails."""

from __future__ import annotations

import os
import stat

import pytest

from gpuwatch.atomic import write_file


def _left(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_bytes_text_and_a_writer_function(tmp_path):
    assert write_file(tmp_path / "a.bin", b"\x00\x01") == 2
    assert write_file(tmp_path / "b.txt", "é\n") == 3  # UTF-8
    assert write_file(tmp_path / "c", lambda tmp: tmp.write_bytes(b"xyz"), fsync=False) == 3
    assert (tmp_path / "b.txt").read_text(encoding="utf-8") == "é\n"
    assert _left(tmp_path) == ["a.bin", "b.txt", "c"]


def test_replaces_and_sets_the_mode(tmp_path):
    p = tmp_path / "r.html"
    p.write_text("old")
    write_file(p, "new", mode=0o644)
    assert p.read_text() == "new" and stat.S_IMODE(os.stat(p).st_mode) == 0o644


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path, exc):
    p = tmp_path / "meta.json"
    p.write_text("old")

    def half(tmp):
        tmp.write_text("half")
        raise exc
    with pytest.raises(type(exc)):
        write_file(p, half)
    assert p.read_text() == "old" and _left(tmp_path) == ["meta.json"]


def test_a_failed_rename_leaves_no_temp(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("a folder is in the way")
    with pytest.raises(OSError):
        write_file(tmp_path / "d", "text")
    assert _left(tmp_path) == ["d"]
