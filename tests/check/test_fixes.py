"""``gpudoctor check --fix / --diff / --unsafe-fixes``: edits by node identity, imports, re-parse
guard, atomic writes keeping encoding and line endings, idempotence, suppressions."""

from __future__ import annotations


import libcst as cst
import pytest

from gpudoctor.check import fixes
from gpudoctor.check.finding import Applicability, Edit, Fix
from gpudoctor.check.rule import Rule
from gpudoctor.cli import main

LOOP = """\
import torch
from accelerate import Accelerator

accelerator = Accelerator()
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for batch in loader:
    loss = model(**batch).loss
    loss.backward(){suffix}
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
"""
FIXED_LOOP = """\
import torch
from accelerate import Accelerator

accelerator = Accelerator()
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for batch in loader:
    loss = model(**batch).loss
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
"""
SELECT = ["--select", "GD104,GD105", "--no-cache"]


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_fix_applies_rule_fixes_and_reports(project, capsys) -> None:
    path = project / "train.py"
    path.write_text(LOOP.format(suffix=""))
    code, out, _ = run(capsys, "train.py", "--fix", *SELECT)
    assert path.read_text() == FIXED_LOOP
    assert code == 0, out
    assert "Fixed 2 findings in 1 file (0 remaining)" in out


def test_second_fix_changes_nothing(project, capsys) -> None:
    path = project / "train.py"
    path.write_text(LOOP.format(suffix=""))
    run(capsys, "train.py", "--fix", *SELECT)
    first = path.read_bytes()
    stat = path.stat()
    code, out, _ = run(capsys, "train.py", "--fix", *SELECT)
    assert path.read_bytes() == first
    assert path.stat().st_mtime_ns == stat.st_mtime_ns, "an idempotent --fix must not rewrite the file"
    assert "Fixed 0 findings" in out and code == 0


def test_exit_one_while_findings_remain(project, capsys) -> None:
    path = project / "train.py"
    path.write_text(LOOP.format(suffix="").replace("    optimizer.zero_grad()\n", ""))
    code, out, _ = run(capsys, "train.py", "--fix", "--no-cache", "--select", "GD104,GD105,GD402")
    assert "accelerator.backward(loss)" in path.read_text()
    assert code == 1
    assert "GD402" in out and "GD104" not in out
    assert "Fixed 2 findings in 1 file (1 remaining)" in out


def test_diff_writes_nothing(project, capsys) -> None:
    path = project / "train.py"
    path.write_text(LOOP.format(suffix=""))
    code, out, err = run(capsys, "train.py", "--diff", *SELECT)
    assert path.read_text() == LOOP.format(suffix="")
    assert code == 1
    assert out.startswith("--- a/train.py\n+++ b/train.py\n@@")
    assert "\n-    loss.backward()\n" in out and "\n+    accelerator.backward(loss)\n" in out
    assert "Would fix 2 findings in 1 file." in err
    path.write_text(FIXED_LOOP)
    code, out, err = run(capsys, "train.py", "--diff", *SELECT)
    assert code == 0 and out == "" and "No fixes available" in err


@pytest.mark.parametrize("comment", ["  # noqa: GD104", "  # gpudoctor: ignore[GD104]", "  # noqa"])
def test_suppressed_findings_are_not_fixed(project, capsys, comment) -> None:
    path = project / "train.py"
    path.write_text(LOOP.format(suffix=comment))
    run(capsys, "train.py", "--fix", *SELECT)
    text = path.read_text()
    assert f"    loss.backward(){comment}\n" in text
    assert "accelerator.clip_grad_norm_(" in text


def test_crlf_line_endings_are_kept(project, capsys) -> None:
    path = project / "train.py"
    path.write_bytes(LOOP.format(suffix="").replace("\n", "\r\n").encode())
    run(capsys, "train.py", "--fix", *SELECT)
    assert path.read_bytes() == FIXED_LOOP.replace("\n", "\r\n").encode()


def test_bom_is_kept(project, capsys) -> None:
    path = project / "train.py"
    path.write_bytes(b"\xef\xbb\xbf" + ("# caf\u00e9\n" + LOOP.format(suffix="")).encode())
    run(capsys, "train.py", "--fix", *SELECT)
    assert path.read_bytes() == b"\xef\xbb\xbf" + ("# caf\u00e9\n" + FIXED_LOOP).encode()


def test_pep263_cookie_encoding_is_kept(project, capsys) -> None:
    path = project / "train.py"
    header = "# -*- coding: latin-1 -*-\n# d\u00e9j\u00e0 vu\n"
    path.write_bytes((header + LOOP.format(suffix="")).encode("latin-1"))
    run(capsys, "train.py", "--fix", *SELECT)
    assert path.read_bytes() == (header + FIXED_LOOP).encode("latin-1")


def test_file_mode_is_kept_and_no_temp_left(project, capsys) -> None:
    path = project / "train.py"
    path.write_text(LOOP.format(suffix=""))
    path.chmod(0o754)
    run(capsys, "train.py", "--fix", *SELECT)
    assert path.stat().st_mode & 0o777 == 0o754
    assert sorted(p.name for p in project.iterdir()) == ["train.py"]


def test_unfixable_file_untouched(project, capsys) -> None:
    path = project / "other.py"
    source = "import torch\nx = torch.zeros(3)\n"
    path.write_text(source)
    stat = path.stat()
    code, _, _ = run(capsys, "other.py", "--fix", *SELECT)
    assert code == 0 and path.read_text() == source and path.stat().st_mtime_ns == stat.st_mtime_ns


# ------------------------------------------------------------------------------------------------
# rules made for these tests (never registered: ``code`` is set after the class exists)


def _rule(name: str, check, applicability=Applicability.SAFE):
    cls = type(name, (Rule,), {"name": name.lower(), "summary": "test", "check": check})
    cls.code = "GD999"
    cls._applicability = applicability
    return cls


def _calls_named(facts, name):
    for site in facts.calls:
        if isinstance(site.node.func, cst.Name) and site.node.func.value == name:
            yield site


def _config_rule(applicability=Applicability.SAFE):
    def check(self, facts):
        for site in _calls_named(facts, "make_config"):
            replacement = cst.parse_expression("BitsAndBytesConfig(load_in_4bit=True)")
            fix = Fix("use BitsAndBytesConfig", self._applicability, (Edit(site.node, replacement),), (("transformers", "BitsAndBytesConfig"),))
            yield self.report(site.node, "make_config", fix=fix)

    return _rule("ConfigRule", check, applicability)


def _broken_rule():
    def check(self, facts):
        for site in _calls_named(facts, "make_config"):
            # A replacement whose code does not parse back (libcst validates names on construction).
            name = cst.Name("ok")
            object.__setattr__(name, "value", "a b")
            yield self.report(site.node, "broken", fix=Fix("broken", Applicability.SAFE, (Edit(site.node, name),)))

    return _rule("BrokenRule", check)


CONFIG_SOURCE = """\
import torch
from transformers import AutoModelForCausalLM

config = make_config()
model = AutoModelForCausalLM.from_pretrained("m", quantization_config=make_config())
"""


def test_fix_adds_missing_import_once() -> None:
    rule = _config_rule()
    result = fixes.fix_text(CONFIG_SOURCE, "x.py", [rule], unsafe=False)
    assert result.fixed == 2
    assert result.text == (
        "import torch\n"
        "from transformers import BitsAndBytesConfig, AutoModelForCausalLM\n\n"
        "config = BitsAndBytesConfig(load_in_4bit=True)\n"
        'model = AutoModelForCausalLM.from_pretrained("m", quantization_config=BitsAndBytesConfig(load_in_4bit=True))\n'
    )
    again = fixes.fix_text(result.text, "x.py", [rule], unsafe=False)
    assert again.fixed == 0 and again.text == result.text


def test_import_added_when_module_not_imported() -> None:
    source = "import torch\n\nconfig = make_config()\n"
    result = fixes.fix_text(source, "x.py", [_config_rule()], unsafe=False)
    assert result.text.count("from transformers import BitsAndBytesConfig\n") == 1
    cst.parse_module(result.text)


def test_unsafe_fixes_need_opt_in() -> None:
    rule = _config_rule(Applicability.UNSAFE)
    assert fixes.fix_text(CONFIG_SOURCE, "x.py", [rule], unsafe=False).fixed == 0
    assert fixes.fix_text(CONFIG_SOURCE, "x.py", [rule], unsafe=True).fixed == 2


def test_fix_producing_invalid_code_writes_nothing(tmp_path, capsys) -> None:
    path = tmp_path / "x.py"
    path.write_text(CONFIG_SOURCE)
    with pytest.raises(fixes.FixError, match="does not parse"):
        fixes.fix_text(CONFIG_SOURCE, "x.py", [_broken_rule()], unsafe=False)
    outcome = fixes.fix_python_file(path, "x.py", [_broken_rule()], unsafe=False)
    assert outcome.data is None and "nothing written" in outcome.error
    assert path.read_text() == CONFIG_SOURCE


def test_overlapping_fixes_are_applied_over_passes() -> None:
    def check(self, facts):
        for site in _calls_named(facts, "outer"):
            yield self.report(site.node, "outer", fix=Fix("o", Applicability.SAFE, (Edit(site.node.func, cst.Name("OUTER")),)))
        for site in _calls_named(facts, "inner"):
            yield self.report(site.node, "inner", fix=Fix("i", Applicability.SAFE, (Edit(site.node, cst.parse_expression("INNER()")),)))
        for site in _calls_named(facts, "wrap"):
            # Replaces the whole call, which contains the `inner()` call: overlaps its edit.
            yield self.report(site.node, "wrap", fix=Fix("w", Applicability.SAFE, (Edit(site.node, cst.parse_expression("wrapped(inner())")),)))

    rule = _rule("Overlap", check)
    result = fixes.fix_text("import torch\nx = wrap(inner())\ny = outer(1)\n", "x.py", [rule], unsafe=False)
    assert result.text == "import torch\nx = wrapped(INNER())\ny = OUTER(1)\n"
    assert result.fixed == 3


def test_nothing_fixed_beyond_max_passes() -> None:
    def check(self, facts):  # a rule whose fix never converges
        for site in _calls_named(facts, "f"):
            yield self.report(site.node, "f", fix=Fix("again", Applicability.SAFE, (Edit(site.node, cst.parse_expression("g(f())")),)))

    result = fixes.fix_text("import torch\nf()\n", "x.py", [_rule("Loop", check)], unsafe=False)
    assert result.fixed == fixes.MAX_PASSES
    assert result.text == "import torch\n" + "g(" * 5 + "f()" + ")" * 5 + "\n"
