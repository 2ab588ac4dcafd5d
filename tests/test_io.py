"""Atomic outputs: all or nothing, ordinary permissions."""

import os
import stat

import polars as pl
import pytest

from kvdiverge.io.files import atomic_path, write_parquet_atomic, write_text_atomic


def test_atomic_writes_land_whole_with_ordinary_permissions(tmp_path):
    out = write_parquet_atomic(pl.DataFrame({"a": [1, 2]}), tmp_path / "sub" / "t.parquet")
    assert pl.read_parquet(out)["a"].to_list() == [1, 2]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask
    write_text_atomic("héllo", tmp_path / "t.html")
    assert (tmp_path / "t.html").read_text(encoding="utf-8") == "héllo"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub", "t.html"]  # no temporary left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["t.txt"]


def test_a_folder_is_replaced_whole_or_not_at_all(tmp_path):
    out = tmp_path / "model"
    with atomic_path(out, directory=True) as tmp:
        (tmp / "a.txt").write_text("first")
    with atomic_path(out, directory=True) as tmp:
        (tmp / "b.txt").write_text("second")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]  # the old folder is gone, not merged
    with pytest.raises(RuntimeError, match="half way"):
        with atomic_path(out, directory=True) as tmp:
            (tmp / "c.txt").write_text("partial")
            raise RuntimeError("half way")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary folder left
