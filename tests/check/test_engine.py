"""The engine: discovery, prefilter, bad input, suppressions, configuration."""

from __future__ import annotations

import textwrap
from pathlib import Path

from gpudoctor.check.config import Config
from gpudoctor.check.engine import check_paths, check_source, discover, is_relevant

BACKWARD = textwrap.dedent(
    """\
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(torch.nn.Linear(2, 2), torch.optim.SGD([], lr=0.1))
    for batch in range(3):
        loss = model(batch).sum()
        loss.backward(){suffix}
        optimizer.step()
        optimizer.zero_grad()
    """
)


def write(tmp_path: Path, name: str, text: str, encoding: str = "utf-8") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode(encoding))
    return path


def codes(result) -> list[tuple[str, int, str]]:
    return [(Path(f.path).name, f.line, f.code) for f in result.findings]


def test_finds_and_positions(tmp_path):
    write(tmp_path, "train.py", BACKWARD.format(suffix=""))
    result = check_paths([str(tmp_path)], Config(root=tmp_path))
    assert codes(result) == [("train.py", 8, "GD104")]
    finding = result.findings[0]
    assert (finding.column, finding.end_line) == (5, 8)
    assert finding.source_line.strip() == "loss.backward()"


def test_noqa_and_ignore_comments(tmp_path):
    for i, suffix in enumerate(["  # noqa: GD104", "  # noqa", "  # gpudoctor: ignore[GD104]", "  # gpudoctor: ignore"]):
        write(tmp_path, f"t{i}.py", BACKWARD.format(suffix=suffix))
    write(tmp_path, "other.py", BACKWARD.format(suffix="  # noqa: GD105"))
    result = check_paths([str(tmp_path)], Config(root=tmp_path))
    assert codes(result) == [("other.py", 8, "GD104")]


def test_prefilter_skips_unrelated_files_unparsed(tmp_path):
    write(tmp_path, "broken_but_unrelated.py", "def (:\n")
    assert not is_relevant(b"import numpy\nprint('torch is mentioned in a string')\n")
    assert is_relevant(b"import os\nfrom accelerate import Accelerator\n")
    result = check_paths([str(tmp_path)], Config(root=tmp_path))
    assert result.errors == [] and result.files[0].skipped


def test_syntax_error_reported_and_others_still_checked(tmp_path):
    write(tmp_path, "a_bad.py", "import torch\n\ndef f(:\n    pass\n")
    write(tmp_path, "b_good.py", BACKWARD.format(suffix=""))
    result = check_paths([str(tmp_path)], Config(root=tmp_path))
    assert codes(result) == [("b_good.py", 8, "GD104")]
    [error] = result.errors
    assert error.startswith(str(tmp_path / "a_bad.py") + ":3:") and "syntax error" in error


def test_encodings(tmp_path):
    latin = "# -*- coding: latin-1 -*-\n# café\n" + BACKWARD.format(suffix="")
    write(tmp_path, "latin.py", latin, encoding="latin-1")
    write(tmp_path, "bom.py", "\ufeff" + BACKWARD.format(suffix=""))
    (tmp_path / "bad.py").write_bytes(b"import torch\nx = '\xff\xfe'\n")
    result = check_paths([str(tmp_path)], Config(root=tmp_path))
    assert codes(result) == [("bom.py", 8, "GD104"), ("latin.py", 10, "GD104")]
    assert len(result.errors) == 1 and "bad.py" in result.errors[0] and "decode" in result.errors[0]


def test_missing_path_is_an_error_not_a_crash(tmp_path):
    write(tmp_path, "train.py", BACKWARD.format(suffix=""))
    result = check_paths([str(tmp_path / "nope.py"), str(tmp_path)], Config(root=tmp_path))
    assert codes(result) == [("train.py", 8, "GD104")]
    assert result.errors == [f"{tmp_path / 'nope.py'}: no such file or directory"]


def test_discovery_skips_vcs_venvs_builds_and_excludes(tmp_path):
    for folder in [".git", "venv", "build", "node_modules", "pkg.egg-info", "myenv", "generated"]:
        write(tmp_path, f"{folder}/x.py", BACKWARD.format(suffix=""))
    (tmp_path / "myenv" / "pyvenv.cfg").write_text("home = /usr\n")
    write(tmp_path, "src/keep.py", BACKWARD.format(suffix=""))
    files, errors = discover([str(tmp_path)], Config(root=tmp_path, exclude=["generated"]))
    assert [p.relative_to(tmp_path).as_posix() for p in files] == ["src/keep.py"] and not errors


def test_config_select_ignore_per_file(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.gpudoctor]\nignore = ["GD105"]\nper-file-ignores = {"legacy/*" = ["GD104"]}\nexclude = ["skipme.py"]\n'
    )
    write(tmp_path, "legacy/old.py", BACKWARD.format(suffix=""))
    write(tmp_path, "new.py", BACKWARD.format(suffix=""))
    write(tmp_path, "skipme.py", BACKWARD.format(suffix=""))
    config = Config.discover(tmp_path)
    assert config.source == tmp_path / "pyproject.toml"
    result = check_paths([str(tmp_path)], config)
    assert codes(result) == [("new.py", 8, "GD104")]
    config.select = ["GD105"]
    assert codes(check_paths([str(tmp_path)], config)) == []


def test_rules_see_aliases():
    source = textwrap.dedent(
        """\
        import torch.nn as nn
        from accelerate import Accelerator as Acc
        from torch.nn.utils import clip_grad_norm_ as clip

        acc = Acc(mixed_precision="fp16")
        model, opt = acc.prepare(nn.Linear(2, 2), None)
        clip(model.parameters(), 1.0)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        """
    )
    findings = check_source(source)
    assert [(f.line, f.code, f.severity.value) for f in findings] == [(7, "GD105", "error"), (8, "GD105", "error")]


def test_named_files_are_checked_unless_force_exclude(tmp_path):
    target = write(tmp_path, "generated/train.py", BACKWARD.format(suffix=""))
    config = Config(root=tmp_path, exclude=["generated"])
    assert [p.name for p in discover([str(target)], config)[0]] == ["train.py"]  # named: checked, like ruff
    config.force_exclude = True  # what the pre-commit hooks pass
    assert discover([str(target)], config)[0] == []
