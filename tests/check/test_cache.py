"""The result cache, parallel checking and the progress bar."""

from __future__ import annotations

import time
from pathlib import Path


from gpudoctor.check import cache, engine
from gpudoctor.check.config import Config
from gpudoctor.check.engine import check_paths
from gpudoctor.cli import main

SOURCE = """\
import torch
from accelerate import Accelerator

accelerator = Accelerator(mixed_precision="fp16")
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for batch in loader:
    loss = model(**batch).loss{extra}
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def tree(root: Path, n: int) -> None:
    for i in range(n):
        folder = root / f"pkg{i % 3}"
        folder.mkdir(exist_ok=True)
        (folder / f"m{i}.py").write_text(SOURCE.format(extra="\n" * (i % 4)))
    (root / "plain.py").write_text("print('no torch here')\n")


def summary(result) -> list[tuple]:
    return [(f.path, f.line, f.column, f.code, f.severity, f.message, f.fix.description if f.fix else None) for f in result.findings]


def no_parsing(monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("a cached file was analysed again")

    monkeypatch.setattr(engine, "check_source", boom)


def test_unchanged_files_come_from_the_cache(tmp_path, monkeypatch) -> None:
    tree(tmp_path, 5)
    config = Config(select=["GD104"], root=tmp_path)
    first = check_paths([str(tmp_path)], config, use_cache=True)
    assert len(first.findings) == 5
    assert list((tmp_path / ".gpudoctor_cache").glob("*.json"))
    assert (tmp_path / ".gpudoctor_cache" / "CACHEDIR.TAG").is_file()
    no_parsing(monkeypatch)
    second = check_paths([str(tmp_path)], config, use_cache=True)
    assert summary(second) == summary(first)
    assert all(f.fix is not None and f.fix.edits == () for f in second.findings)


def test_changed_content_is_rechecked(tmp_path) -> None:
    tree(tmp_path, 2)
    config = Config(select=["GD104"], root=tmp_path)
    check_paths([str(tmp_path)], config, use_cache=True)
    target = tmp_path / "pkg0" / "m0.py"
    target.write_text(SOURCE.format(extra="").replace("    loss.backward()\n", "    accelerator.backward(loss)\n"))
    result = check_paths([str(tmp_path)], config, use_cache=True)
    assert [Path(f.path).name for f in result.findings] == ["m1.py"]


def test_settings_are_part_of_the_key(tmp_path) -> None:
    a = cache.settings_key(Config(select=["GD104"], root=tmp_path))
    assert a == cache.settings_key(Config(select=["GD104"], root=tmp_path))
    assert a != cache.settings_key(Config(select=["GD104"], root=tmp_path, preview=True))
    assert a != cache.settings_key(Config(select=["GD104"], root=tmp_path, target_versions={"transformers": "4.46"}))
    assert a != cache.settings_key(Config(select=["GD104", "GD105"], root=tmp_path))
    # and results under other settings are not reused
    tree(tmp_path, 1)
    check_paths([str(tmp_path)], Config(select=["GD104"], root=tmp_path), use_cache=True)
    assert check_paths([str(tmp_path)], Config(select=["GD105"], root=tmp_path), use_cache=True).findings == []


def test_errors_are_cached_with_their_path(tmp_path, monkeypatch) -> None:
    (tmp_path / "bad.py").write_text("import torch\ndef f(:\n")
    config = Config(root=tmp_path)
    first = check_paths([str(tmp_path / "bad.py")], config, use_cache=True).errors
    no_parsing(monkeypatch)
    monkeypatch.chdir(tmp_path)
    second = check_paths(["bad.py"], config, use_cache=True).errors
    assert len(first) == 1 and second == ["bad.py" + first[0][len(str(tmp_path / "bad.py")):]]


def test_no_cache_flag_and_clean(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    tree(tmp_path, 1)
    main(["check", ".", "--no-cache", "-q"])
    assert not (tmp_path / ".gpudoctor_cache").exists()
    main(["check", ".", "-q"])
    assert (tmp_path / ".gpudoctor_cache").is_dir()
    capsys.readouterr()
    assert main(["clean"]) == 0
    assert "Removed" in capsys.readouterr().out
    assert not (tmp_path / ".gpudoctor_cache").exists()
    assert cache.clean(tmp_path) == (None, "")


def test_cache_lives_in_the_config_root(tmp_path, monkeypatch) -> None:
    (tmp_path / "pyproject.toml").write_text("[tool.gpudoctor]\nselect = ['GD104']\n")
    sub = tmp_path / "src" / "deep"
    sub.mkdir(parents=True)
    (sub / "t.py").write_text(SOURCE.format(extra=""))
    monkeypatch.chdir(sub)
    main(["check", "t.py", "-q"])
    assert (tmp_path / ".gpudoctor_cache").is_dir() and not (sub / ".gpudoctor_cache").exists()
    assert cache.clean(sub) == (str(tmp_path / ".gpudoctor_cache"), "removed")


def test_corrupt_cache_is_ignored(tmp_path) -> None:
    tree(tmp_path, 1)
    config = Config(select=["GD104"], root=tmp_path)
    check_paths([str(tmp_path)], config, use_cache=True)
    for file in (tmp_path / ".gpudoctor_cache").glob("*.json"):
        file.write_text("{not json")
    assert len(check_paths([str(tmp_path)], config, use_cache=True).findings) == 1


def test_parallel_matches_serial(tmp_path) -> None:
    tree(tmp_path, 30)
    (tmp_path / "bad.py").write_text("import torch\ndef f(:\n")
    config = Config(select=["GD1"], root=tmp_path)
    serial = check_paths([str(tmp_path)], config, jobs=1)
    parallel = check_paths([str(tmp_path)], config, jobs=3)
    assert summary(parallel) == summary(serial) and len(serial.findings) == 30
    assert parallel.errors == serial.errors and len(serial.errors) == 1
    assert [r.path for r in parallel.files] == [r.path for r in serial.files]
    assert all(f.node is None and f.fix is not None and f.fix.edits == () for f in parallel.findings)


def test_a_crashing_rule_only_fails_its_file(tmp_path, monkeypatch) -> None:
    tree(tmp_path, 3)
    real = engine.check_source

    def flaky(source, path="<string>", *args, **kwargs):
        if path.endswith("m1.py"):
            raise KeyError("boom")
        return real(source, path, *args, **kwargs)

    monkeypatch.setattr(engine, "check_source", flaky)
    result = check_paths([str(tmp_path)], Config(select=["GD104"], root=tmp_path))
    assert len(result.findings) == 2
    [error] = result.errors
    assert "m1.py: internal error while checking (KeyError" in error


def test_progress_bar_does_not_disturb_results(tmp_path, capsys) -> None:
    tree(tmp_path, 12)
    config = Config(select=["GD104"], root=tmp_path)
    result = check_paths([str(tmp_path)], config, jobs=2, progress=True)
    assert len(result.findings) == 12
    assert capsys.readouterr().out == ""


def test_cached_rerun_is_fast(tmp_path) -> None:
    tree(tmp_path, 120)
    config = Config(root=tmp_path)
    check_paths([str(tmp_path)], config, jobs=2, use_cache=True)
    start = time.perf_counter()
    result = check_paths([str(tmp_path)], config, jobs=2, use_cache=True)
    elapsed = time.perf_counter() - start
    assert len(result.files) == 121
    assert elapsed < 1.0, f"a cached re-check of 121 files took {elapsed:.2f}s"


def test_a_run_served_from_the_cache_imports_neither_libcst_nor_rules(tmp_path) -> None:
    import subprocess
    import sys

    tree(tmp_path, 2)
    code = (
        "import sys; from gpudoctor.cli import main; "
        f"main(['check', {str(tmp_path)!r}, '-q', '--exit-zero']); "
        "print('LOADED', sorted(m for m in sys.modules if m == 'libcst' or m.rsplit('.', 1)[-1].startswith('gd')))"
    )
    cold = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert "'libcst'" in cold  # the first run parses
    warm = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert "LOADED []" in warm
