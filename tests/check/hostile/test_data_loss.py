"""Issue 11, items 8-10: the cache never follows a link and only deletes what it wrote; ``--fix``
never overwrites an edit made meanwhile, keeps the file's bytes outside its edits, refuses read-only
files and keeps hard links."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpudoctor.check import cache, fixes
from gpudoctor.cli import main

from hostile_support import BACKWARD, write

FIXED_LINE = "    accelerator.backward(loss)\n"


def project_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and ".gpudoctor_cache" not in p.parts}


# --------------------------------------------------------------------------------------- item 8


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symbolic links here")
def test_cache_folder_as_a_link_is_never_followed(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for i in range(12):
        (tmp_path / f"data{i}.json").write_text('{"keep": %d}\n' % i)
    write(tmp_path, "train.py", BACKWARD)
    (tmp_path / ".gpudoctor_cache").symlink_to(".")
    before = project_files(tmp_path)
    for select in ("GD1", "GD2", "GD3", "GD4", "GD5", "GD6", "GD104", "GD105", "GD106", "GD107"):
        main(["check", ".", "-q", "--select", select])  # ten settings: would prune through the link
    assert project_files(tmp_path) == before  # nothing deleted, no .gitignore written
    capsys.readouterr()
    assert main(["clean"]) == 2
    assert "never follows" in capsys.readouterr().err
    assert project_files(tmp_path) == before and (tmp_path / ".gpudoctor_cache").is_symlink()


def test_cache_prunes_and_cleans_only_its_own_files(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "train.py", BACKWARD)
    folder = tmp_path / ".gpudoctor_cache"
    folder.mkdir()
    (folder / "notes.json").write_text("mine\n")
    for select in ("GD1", "GD2", "GD3", "GD4", "GD5", "GD6", "GD104", "GD105", "GD106", "GD107"):
        main(["check", ".", "-q", "--select", select])
    own = [p.name for p in folder.iterdir() if cache._SETTINGS_FILE.fullmatch(p.name)]
    assert len(own) == cache.MAX_SETTINGS_FILES and (folder / "notes.json").read_text() == "mine\n"
    capsys.readouterr()
    assert main(["clean"]) == 0
    assert "other files were left" in capsys.readouterr().err
    assert [p.name for p in folder.iterdir()] == ["notes.json"]


def test_cache_file_as_a_link_is_not_read(tmp_path):
    from gpudoctor.check.config import Config
    from gpudoctor.check.engine import check_paths

    path = write(tmp_path, "t.py", BACKWARD)
    config = Config(root=tmp_path)
    store = cache.Cache.for_run(config)
    store.file.parent.mkdir()
    if Path("/dev/zero").exists():
        store.file.symlink_to("/dev/zero")  # read to exhaustion before
        assert [f.code for f in check_paths([str(path)], config, use_cache=True).findings] == ["GD104"]
        # The link itself was replaced by the atomic rename: nothing was written through it.
        assert not store.file.is_symlink() and store.file.stat().st_size < 10_000


# --------------------------------------------------------------------------------------- item 9


def test_fix_never_overwrites_an_edit_saved_meanwhile(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, "train.py", BACKWARD)
    edited = BACKWARD + "# saved by the editor while gpudoctor was fixing\n"
    real_fix_text = fixes.fix_text

    def slow_fix_text(*args, **kwargs):
        result = real_fix_text(*args, **kwargs)
        path.write_text(edited)  # the user saves in between
        return result

    monkeypatch.setattr(fixes, "fix_text", slow_fix_text)
    code = main(["check", "train.py", "--fix", "--no-cache", "--select", "GD104"])
    out = capsys.readouterr().out
    assert path.read_text() == edited
    assert code == 1 and "changed while it was being fixed" in out and "Fixed 0 findings" in out


# --------------------------------------------------------------------------------------- item 10


@pytest.mark.parametrize(
    "newline, tail",
    [("\n", "\n\n   \n"), ("\r", "\r"), ("\r\n", "\r\n\r\n  \r\n"), ("\n", ""), ("\n", "\n# last words\n\n")],
    ids=["blank-lines", "cr-only", "crlf-blank", "no-newline", "comment"],
)
def test_fix_keeps_the_file_byte_for_byte_outside_its_edit(tmp_path, monkeypatch, newline, tail):
    monkeypatch.chdir(tmp_path)
    body = BACKWARD.rstrip("\n").replace("\n", newline)
    path = tmp_path / "train.py"
    path.write_bytes((body + tail).encode())
    main(["check", "train.py", "--fix", "--no-cache", "--select", "GD104", "-q"])
    expected = (body.replace("    loss.backward()", FIXED_LINE.rstrip("\n")) + tail).encode()
    assert path.read_bytes() == expected


def test_fix_refuses_a_read_only_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, "train.py", BACKWARD)
    path.chmod(0o444)
    try:
        assert main(["check", "train.py", "--fix", "--no-cache", "--select", "GD104"]) == 1
        assert path.read_text() == BACKWARD
        assert "read-only; not fixed" in capsys.readouterr().out
    finally:
        path.chmod(0o644)


@pytest.mark.skipif(not hasattr(os, "link"), reason="no hard links here")
def test_fix_keeps_hard_links(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, "train.py", BACKWARD)
    os.link(path, tmp_path / "alias.py")
    main(["check", "train.py", "--fix", "--no-cache", "--select", "GD104", "-q"])
    assert FIXED_LINE in path.read_text()
    assert (tmp_path / "alias.py").read_text() == path.read_text()
    assert os.stat(path).st_ino == os.stat(tmp_path / "alias.py").st_ino
