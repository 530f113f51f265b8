"""Semantics-preserving variants of the rule fixtures, to measure how far each rule's evidence chain reaches.

Every fixture under ``fixtures/`` is rewritten (with libcst transformers) the way people really write the
same program: inside ``main()``, with objects built in helpers, handed to functions, imports aliased or
missing, names changed, expressions split through temporaries, loops through ``enumerate``/``tqdm``/``zip``/
generators/``iter()``+``next()``. A variant of a bug fixture must keep each expected finding (at the line
the flagged code moved to); a variant of a clean fixture must stay clean.

Line tracking: each ``# expect: CODES`` comment is first numbered (``# expect@3: CODES``); the comment
travels with its statement, and a transformation that moves the flagged code elsewhere copies the numbered
comment to the new lines. An expectation is kept when a finding with its code starts on any line carrying
its number.

    PYTHONPATH=src python tests/check/metamorph.py [--verbose] [--transform NAME] [FIXTURE...]
"""

from __future__ import annotations

import builtins
import functools
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import libcst as cst

from gpudoctor.check.facts.nodes import dotted

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"

_EXPECT = re.compile(r"#\s*expect:\s*(?P<codes>GD\d{3}(?:\s*,\s*GD\d{3})*)")
_NUMBERED = re.compile(r"#\s*expect@(?P<id>\d+):\s*(?P<codes>GD\d{3}(?:\s*,\s*GD\d{3})*)")
# Libraries whose imports the snippet variant strips (a cell copied without its imports).
_LIBRARIES = ("torch", "transformers", "accelerate", "peft", "trl", "bitsandbytes")
_BUILTINS = set(dir(builtins)) | {"self", "cls", "__name__", "__file__"}


class NotApplicable(Exception):
    """The transformation does not apply to this file (skipped, not counted)."""


# ----------------------------------------------------------------------------------------------- helpers


def number_expectations(source: str) -> str:
    counter = iter(range(1, 1 << 30))
    return _EXPECT.sub(lambda m: f"# expect@{next(counter)}: {m.group('codes')}", source)


def numbered_expectations(source: str) -> dict[int, tuple[set[int], set[str]]]:
    """id -> (lines carrying it, codes)."""
    out: dict[int, tuple[set[int], set[str]]] = {}
    for number, line in enumerate(source.splitlines(), start=1):
        for match in _NUMBERED.finditer(line):
            lines, codes = out.setdefault(int(match.group("id")), (set(), set()))
            lines.add(number)
            codes.update(c.strip() for c in match.group("codes").split(","))
    return out


def _comments_in(module: cst.Module, node: cst.CSTNode) -> list[str]:
    return [m.group(0) for m in _NUMBERED.finditer(module.code_for_node(node))]


def _with_comment(statement: cst.BaseStatement, comments: Sequence[str]) -> cst.BaseStatement:
    """``statement`` with ``comments`` as its trailing comment (simple statements and compound headers)."""
    if not comments:
        return statement
    text = "  ".join(comments)
    if isinstance(statement, cst.SimpleStatementLine):
        old = statement.trailing_whitespace.comment
        if old is not None and _NUMBERED.search(old.value):
            return statement
        return statement.with_changes(
            trailing_whitespace=cst.TrailingWhitespace(whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(text))
        )
    body = getattr(statement, "body", None)
    if isinstance(body, cst.IndentedBlock):
        return statement.with_changes(
            body=body.with_changes(
                header=cst.TrailingWhitespace(whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(text))
            )
        )
    return statement


def _stmt(code: str) -> cst.BaseStatement:
    return cst.parse_statement(code)


def _is_import(statement: cst.CSTNode) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in statement.body
    )


def _is_docstring(statement: cst.CSTNode) -> bool:
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and len(statement.body) == 1
        and isinstance(statement.body[0], cst.Expr)
        and isinstance(statement.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def _is_main_guard(statement: cst.CSTNode) -> bool:
    return isinstance(statement, cst.If) and "__name__" in cst.Module([]).code_for_node(statement.test)


class _Names(cst.CSTVisitor):
    """Every Name in a tree, split into bound names and the ids of Names that are not variables
    (attribute names, keywords, def/class names, import parts)."""

    def __init__(self) -> None:
        self.all: set[str] = set()
        self.bound: set[str] = set()
        self.params: set[str] = set()
        self.keywords: set[str] = set()
        self.defs: set[str] = set()
        self.not_variables: set[int] = set()
        self.has_global = False
        self.dynamic = False

    def visit_Name(self, node: cst.Name) -> None:
        self.all.add(node.value)
        if node.value in ("locals", "globals", "eval", "exec", "vars"):
            self.dynamic = True

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.not_variables.add(id(node.attr))

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None:
            self.not_variables.add(id(node.keyword))
            self.keywords.add(node.keyword.value)

    def visit_Param(self, node: cst.Param) -> None:
        self.params.add(node.name.value)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.not_variables.add(id(node.name))
        self.defs.add(node.name.value)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.not_variables.add(id(node.name))
        self.defs.add(node.name.value)

    def visit_Import(self, node: cst.Import) -> bool:
        for alias in node.names:
            self.defs.add(_local_name(alias))
        self._module_parts(node)
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        if not isinstance(node.names, cst.ImportStar):
            for alias in node.names:
                self.defs.add(_local_name(alias))
        self._module_parts(node)
        return False

    def _module_parts(self, node: cst.CSTNode) -> None:
        # ``from torch.utils.data import DataLoader``: ``data`` is a module path, never the variable ``data``
        self.not_variables.update(id(n) for n in _walk(node) if isinstance(n, cst.Name))

    def visit_Global(self, node: cst.Global) -> None:
        self.has_global = True

    def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
        self.has_global = True

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self.bound |= _target_names(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self.bound |= _target_names(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self.bound |= _target_names(node.target)

    def visit_For(self, node: cst.For) -> None:
        self.bound |= _target_names(node.target)

    def visit_CompFor(self, node: cst.CompFor) -> None:
        self.bound |= _target_names(node.target)

    def visit_AsName(self, node: cst.AsName) -> None:
        self.bound |= _target_names(node.name)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self.bound |= _target_names(node.target)


def _names(node: cst.CSTNode) -> _Names:
    visitor = _Names()
    node.visit(visitor)
    return visitor


def _target_names(target: cst.CSTNode) -> set[str]:
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, (cst.Tuple, cst.List)):
        out: set[str] = set()
        for element in target.elements:
            out |= _target_names(element.value)
        return out
    if isinstance(target, cst.StarredElement):
        return _target_names(target.value)
    return set()


def _local_name(alias: cst.ImportAlias) -> str:
    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
        return alias.asname.name.value
    return cst.Module([]).code_for_node(alias.name).split(".")[0]


_dotted = dotted


class _ReplaceNames(cst.CSTTransformer):
    """Replace variable Names (not attribute names, keywords, def names) by expressions."""

    def __init__(self, mapping: dict[str, Callable[[], cst.BaseExpression]], not_variables: set[int]) -> None:
        self.mapping = mapping
        self.not_variables = not_variables

    def leave_Name(self, original: cst.Name, updated: cst.Name):
        if id(original) in self.not_variables or original.value not in self.mapping:
            return updated
        return self.mapping[original.value]()


def _fresh(taken: set[str], stem: str) -> str:
    name, n = stem, 1
    while name in taken:
        n += 1
        name = f"{stem}{n}"
    taken.add(name)
    return name


def _indent(statements: Sequence[cst.BaseStatement]) -> cst.IndentedBlock:
    return cst.IndentedBlock(body=list(statements) or [_stmt("pass\n")])


# ----------------------------------------------------------------------------------------------- transformations


def wrap_in_main(module: cst.Module) -> cst.Module:
    """Module-level code moves into ``def main():``, called under ``if __name__ == "__main__":``."""
    names = _names(module)
    if names.has_global or names.dynamic or any(_is_main_guard(s) for s in module.body) or "main" in names.all:
        raise NotApplicable
    head: list[cst.BaseStatement] = []
    defs: list[cst.BaseStatement] = []
    moved: list[cst.BaseStatement] = []
    for i, statement in enumerate(module.body):
        if _is_import(statement) or (i == 0 and _is_docstring(statement)):
            (head if not moved and not defs else defs).append(statement)
        elif isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            defs.append(statement)
        else:
            moved.append(statement)
    if not moved:
        raise NotApplicable
    bound = set()
    for statement in moved:
        bound |= _names(statement).bound
    used_by_defs = set()
    for statement in defs:
        if not _is_import(statement):
            used_by_defs |= _names(statement).all
    if bound & used_by_defs:
        # The functions read module globals the moved code binds: nest them in main() too (closures).
        moved = [s for s in module.body[len(head) :] if not _is_import(s)]
        defs = [s for s in module.body[len(head) :] if _is_import(s)]
    main = cst.FunctionDef(name=cst.Name("main"), params=cst.Parameters(), body=_indent(moved), leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
    guard = _stmt('if __name__ == "__main__":\n    main()\n').with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
    return module.with_changes(body=[*head, *defs, main, guard])


def _module_level_assignments(module: cst.Module) -> list[tuple[list, int, cst.SimpleStatementLine]]:
    """(the body list, index, statement) of ``name = <call of an imported API>`` outside functions and classes."""
    imported = _names_imported(module)
    found: list[tuple[list, int, cst.SimpleStatementLine]] = []

    def scan(body: list) -> None:
        for i, statement in enumerate(body):
            if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1:
                small = statement.body[0]
                if (
                    isinstance(small, cst.Assign)
                    and len(small.targets) == 1
                    and isinstance(small.targets[0].target, cst.Name)
                    and isinstance(small.value, cst.Call)
                    and _callee_head(small.value) in imported
                ):
                    found.append((body, i, statement))
            elif isinstance(statement, (cst.With, cst.If, cst.For, cst.While, cst.Try)):
                block = statement.body
                if isinstance(block, cst.IndentedBlock):
                    scan(block.body)

    scan(list(module.body))
    return found


def _callee_head(call: cst.Call) -> Optional[str]:
    node: cst.CSTNode = call.func
    while True:
        if isinstance(node, cst.Attribute):
            node = node.value
        elif isinstance(node, cst.Call):
            node = node.func
        else:
            break
    return node.value if isinstance(node, cst.Name) else None


def _names_imported(module: cst.Module) -> set[str]:
    out: set[str] = set()
    for statement in module.body:
        if _is_import(statement):
            for small in statement.body:
                if isinstance(small, cst.Import):
                    out |= {_local_name(a) for a in small.names}
                elif isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                    out |= {_local_name(a) for a in small.names}
    return out


class _ReplaceStatements(cst.CSTTransformer):
    """Replace given statements (by identity) with a list of statements."""

    def __init__(self, replacements: dict[int, list[cst.BaseStatement]]) -> None:
        self.replacements = replacements

    def on_leave(self, original, updated):
        replacement = self.replacements.get(id(original))
        if replacement is not None:
            return cst.FlattenSentinel(replacement)
        return updated


def build_in_helper(module: cst.Module) -> cst.Module:
    """``x = Lib(...)`` -> ``def make_x(): return Lib(...)`` then ``x = make_x()`` (module level)."""
    sites = _module_level_assignments(module)
    if not sites:
        raise NotApplicable
    taken = set(_names(module).all)
    replacements: dict[int, list[cst.BaseStatement]] = {}
    for _, _, statement in sites:
        assign = statement.body[0]
        target = assign.targets[0].target.value
        helper = _fresh(taken, f"make_{target}")
        comments = _comments_in(module, statement)
        ret = _with_comment(cst.SimpleStatementLine([cst.Return(assign.value)]), comments)
        definition = cst.FunctionDef(
            name=cst.Name(helper), params=cst.Parameters(), body=_indent([ret]), leading_lines=statement.leading_lines
        )
        call = statement.with_changes(
            body=[assign.with_changes(value=cst.Call(cst.Name(helper)))], leading_lines=[]
        )
        replacements[id(statement)] = [definition, _with_comment(call, comments)]
    return module.visit(_ReplaceStatements(replacements))


def pass_to_function(module: cst.Module, which: int = 0) -> cst.Module:
    """The code after ``x = Lib(...)`` moves into ``def run(x, ...):``, called with the object."""
    names = _names(module)
    if names.has_global or names.dynamic or any(_is_main_guard(s) for s in module.body):
        raise NotApplicable
    body = list(module.body)
    candidates = []
    for i, statement in enumerate(body):
        for b, j, s in _module_level_assignments(module):
            if s is statement and b is not None:
                candidates.append(i)
                break
    # Keep candidates whose name the rest of the module loads.
    useful = []
    for i in candidates:
        target = body[i].body[0].targets[0].target.value
        tail_names = set()
        for statement in body[i + 1 :]:
            if not isinstance(statement, (cst.FunctionDef, cst.ClassDef)) and not _is_import(statement):
                tail_names |= _names(statement).all
        if target in tail_names:
            useful.append(i)
    if which >= len(useful):
        raise NotApplicable
    split = useful[which]
    target = body[split].body[0].targets[0].target.value
    head = body[: split + 1]
    keep: list[cst.BaseStatement] = []
    moved: list[cst.BaseStatement] = []
    for statement in body[split + 1 :]:
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)) or _is_import(statement):
            keep.append(statement)
        else:
            moved.append(statement)
    if not moved:
        raise NotApplicable
    moved_bound = set()
    for statement in moved:
        moved_bound |= _names(statement).bound
    used_by_defs = set()
    for statement in [*head, *keep]:
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            used_by_defs |= _names(statement).all
    if moved_bound & used_by_defs:
        raise NotApplicable
    head_bound = set()
    for statement in head:
        if not isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            head_bound |= _names(statement).bound
    params = [target, *sorted((moved_bound & head_bound) - {target})]
    taken = set(names.all)
    run = _fresh(taken, "run")
    definition = cst.FunctionDef(
        name=cst.Name(run),
        params=cst.Parameters(params=[cst.Param(cst.Name(p)) for p in params]),
        body=_indent(moved),
        leading_lines=[cst.EmptyLine(), cst.EmptyLine()],
    )
    call = _stmt(f"{run}({', '.join(params)})\n").with_changes(leading_lines=[cst.EmptyLine()])
    return module.with_changes(body=[*head, *keep, definition, call])


def pass_to_function_2(module: cst.Module) -> cst.Module:
    return pass_to_function(module, 1)


# Dotted torch paths people import from, longest first: (prefix, how the name is then written).
_TORCH_PATHS = (
    ("torch.nn.utils.", "from"),
    ("torch.nn.functional.", "F"),
    ("torch.utils.data.", "from"),
    ("torch.optim.lr_scheduler.", "from"),
    ("torch.optim.", "from"),
    ("torch.nn.", "nn"),
)


def alias_torch_paths(module: cst.Module) -> cst.Module:
    """``torch.nn.Linear`` -> ``nn.Linear`` (``from torch import nn``), ``torch.nn.functional.x`` -> ``F.x``,
    ``torch.nn.utils.clip_grad_norm_`` -> ``clip_grad_norm_`` (``from torch.nn.utils import ...``)."""
    torch_names = [
        _local_name(a)
        for s in module.body if _is_import(s)
        for small in s.body if isinstance(small, cst.Import)
        for a in small.names if cst.Module([]).code_for_node(a.name) == "torch"
    ]
    if not torch_names:
        raise NotApplicable
    local = torch_names[0]
    names = _names(module)
    taken = set(names.all)
    imports: dict[str, str] = {}  # import statement -> ...
    replaced = 0

    class Rewrite(cst.CSTTransformer):
        def visit_Import(self, node: cst.Import) -> bool:
            return False

        def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
            return False

        def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
            nonlocal replaced
            path = _dotted(updated)
            if not path or not path.startswith(local + "."):
                return updated
            full = "torch" + path[len(local):]
            for prefix, style in _TORCH_PATHS:
                if not full.startswith(prefix) or full.count(".") != prefix.count("."):
                    continue
                last = full[len(prefix):]
                if style == "from":
                    if last in taken and imports.get(last) != prefix[:-1]:
                        return updated
                    imports[last] = prefix[:-1]
                    taken.add(last)
                    replaced += 1
                    return cst.Name(last)
                if style in taken and imports.get(style) != prefix[:-1]:
                    return updated
                imports[style] = prefix[:-1]
                taken.add(style)
                replaced += 1
                return cst.Attribute(cst.Name(style), cst.Name(last))
            return updated

    new = module.visit(Rewrite())
    if not replaced:
        raise NotApplicable
    lines = []
    for name, path in sorted(imports.items()):
        if name == "nn":
            lines.append(_stmt("from torch import nn\n"))
        elif name == "F":
            lines.append(_stmt("import torch.nn.functional as F\n"))
        else:
            lines.append(_stmt(f"from {path} import {name}\n"))
    return _add_imports(new, lines)


def _add_imports(module: cst.Module, lines: list[cst.BaseStatement]) -> cst.Module:
    body = list(module.body)
    last_import = max((i for i, s in enumerate(body) if _is_import(s)), default=-1)
    return module.with_changes(body=[*body[: last_import + 1], *lines, *body[last_import + 1 :]])


def alias_modules(module: cst.Module) -> cst.Module:
    """``import torch`` -> ``import torch as th``; ``from transformers import AutoModel`` ->
    ``import transformers as hf`` and ``hf.AutoModel``: every library name written through a module alias."""
    names = _names(module)
    taken = set(names.all)
    mapping: dict[str, Callable[[], cst.BaseExpression]] = {}
    aliases: dict[str, str] = {}

    def alias_for(package: str) -> str:
        if package not in aliases:
            aliases[package] = _fresh(taken, {"torch": "th", "transformers": "hf", "accelerate": "acc"}.get(package, package[:3] + "_"))
        return aliases[package]

    def attribute_chain(head: str, path: str) -> Callable[[], cst.BaseExpression]:
        def build() -> cst.BaseExpression:
            node: cst.BaseExpression = cst.Name(head)
            for part in path.split("."):
                if part:
                    node = cst.Attribute(node, cst.Name(part))
            return node

        return build

    new_body = []
    for statement in module.body:
        if not _is_import(statement):
            new_body.append(statement)
            continue
        kept = []
        for small in statement.body:
            if isinstance(small, cst.Import):
                for alias in small.names:
                    full = cst.Module([]).code_for_node(alias.name)
                    package = full.split(".")[0]
                    if package not in _LIBRARIES:
                        kept.append(cst.Import([alias.with_changes(comma=cst.MaybeSentinel.DEFAULT)]))
                        continue
                    local = _local_name(alias)
                    if local in names.bound or local in names.params:
                        raise NotApplicable
                    head = alias_for(package)
                    rest = full[len(package):].lstrip(".")
                    if alias.asname is None:
                        # ``import torch.nn`` binds ``torch``: its uses are already full paths.
                        mapping[package] = attribute_chain(head, "")
                    else:
                        mapping[local] = attribute_chain(head, rest)
            elif isinstance(small, cst.ImportFrom) and small.module is not None and not small.relative and not isinstance(small.names, cst.ImportStar):
                module_path = cst.Module([]).code_for_node(small.module)
                package = module_path.split(".")[0]
                if package not in _LIBRARIES:
                    kept.append(small)
                    continue
                head = alias_for(package)
                for alias in small.names:
                    local = _local_name(alias)
                    if local in names.bound or local in names.params:
                        raise NotApplicable
                    name = cst.Module([]).code_for_node(alias.name)
                    mapping[local] = attribute_chain(head, module_path[len(package):].lstrip(".") + "." + name)
            else:
                kept.append(small)
        if kept:
            new_body.append(statement.with_changes(body=[k.with_changes(semicolon=cst.MaybeSentinel.DEFAULT) for k in kept]))
        else:
            # keep the line's comments and spacing on an import of the aliases
            pass
    if not mapping:
        raise NotApplicable
    imports = []
    for package, alias in sorted(aliases.items()):
        imports.append(_stmt(f"import {package} as {alias}\n"))
        # ``import a.b.c`` submodules must stay importable: import every submodule path used before.
    for statement in module.body:
        if _is_import(statement):
            for small in statement.body:
                if isinstance(small, cst.Import):
                    for a in small.names:
                        full = cst.Module([]).code_for_node(a.name)
                        if "." in full and full.split(".")[0] in _LIBRARIES:
                            imports.append(_stmt(f"import {full}\n"))
    module = module.with_changes(body=new_body)
    module = module.visit(_ReplaceNames(mapping, _names(module).not_variables))
    return _add_imports(module, imports)


def rename_variables(module: cst.Module) -> cst.Module:
    """Every variable gets a neutral name (``model`` -> ``v1``): rules must not depend on naming."""
    names = _names(module)
    if names.dynamic:
        raise NotApplicable
    class_level: set[str] = set()
    for node in _walk(module):
        if isinstance(node, cst.ClassDef) and isinstance(node.body, cst.IndentedBlock):
            for statement in node.body.body:
                if not isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
                    class_level |= _names(statement).bound
    renameable = sorted(
        n for n in names.bound | names.params
        if n not in _BUILTINS and n not in names.defs and n not in names.keywords and n not in class_level
        and not n.startswith("__") and n != "_"
    )
    if not renameable:
        raise NotApplicable
    taken = set(names.all)
    mapping = {}
    for name in renameable:
        new = _fresh(taken, "v")
        mapping[name] = (lambda new=new: cst.Name(new))

    class Rename(_ReplaceNames):
        def leave_Param(self, original: cst.Param, updated: cst.Param):
            return updated  # the Name child was renamed already

    return module.visit(Rename(mapping, names.not_variables))


def _walk(node: cst.CSTNode) -> Iterable[cst.CSTNode]:
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(current.children)


_TRIVIAL = (cst.Name, cst.Integer, cst.Float, cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)


def split_temporaries(module: cst.Module) -> cst.Module:
    """An expression goes through a temporary: ``a = f(g(x))`` -> ``tmp = g(x)``... one split per statement:
    an assignment's value, else an expression statement's call receiver or first argument."""
    taken = set(_names(module).all)
    imported = _names_imported(module)
    count = 0

    class Split(cst.CSTTransformer):
        def __init__(self) -> None:
            self.depth = 0  # class bodies: a temporary there would become a class attribute

        def visit_ClassDef(self, node: cst.ClassDef) -> None:
            self.depth += 1

        def leave_ClassDef(self, original, updated):
            self.depth -= 1
            return updated

        def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
            self.depth -= 1 if self.depth else 0

        def leave_SimpleStatementLine(self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine):
            nonlocal count
            if self.depth or len(updated.body) != 1:
                return updated
            small = updated.body[0]
            piece = None
            rebuilt = None
            if isinstance(small, cst.Assign) and not isinstance(small.value, _TRIVIAL) and not isinstance(small.value, (cst.Yield, cst.Await, cst.Lambda, cst.Tuple, cst.Dict, cst.List)):
                name = _fresh(taken, "tmp")
                piece = small.value
                rebuilt = small.with_changes(value=cst.Name(name))
            elif isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
                call = small.value
                name = _fresh(taken, "tmp")
                if isinstance(call.func, cst.Attribute) and not isinstance(call.func.value, _TRIVIAL) and not _is_super(call.func.value) and not _module_path(call.func.value, imported):
                    piece = call.func.value
                    rebuilt = small.with_changes(value=call.with_changes(func=call.func.with_changes(value=cst.Name(name))))
                elif call.args and not call.args[0].star and call.args[0].keyword is None and not isinstance(call.args[0].value, _TRIVIAL + (cst.Lambda, cst.GeneratorExp)):
                    piece = call.args[0].value
                    args = [call.args[0].with_changes(value=cst.Name(name)), *call.args[1:]]
                    rebuilt = small.with_changes(value=call.with_changes(args=args))
            if piece is None:
                return updated
            if _contains_walrus_or_yield(piece):
                return updated
            count += 1
            comments = _comments_in(module, original)
            first = _with_comment(cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(name))], piece)]), comments)
            first = first.with_changes(leading_lines=updated.leading_lines)
            second = _with_comment(updated.with_changes(body=[rebuilt], leading_lines=[]), comments)
            return cst.FlattenSentinel([first, second])

    new = module.visit(Split())
    if not count:
        raise NotApplicable
    return new


def _module_path(node: cst.CSTNode, imported: set[str]) -> bool:
    """``torch.nn.utils``: a module, not a value anyone would put in a variable."""
    from gpudoctor.check.apis import WELL_KNOWN_NAMES

    path = dotted(node)
    return path is not None and (path.split(".")[0] in imported or path.split(".")[0] in WELL_KNOWN_NAMES)


def _is_super(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "super"


def _contains_walrus_or_yield(node: cst.CSTNode) -> bool:
    return any(isinstance(n, (cst.NamedExpr, cst.Yield, cst.Await, cst.GeneratorExp, cst.ListComp, cst.DictComp, cst.SetComp, cst.Lambda)) for n in _walk(node))


def _loop_rewriter(rewrite: Callable[[cst.For, set[str]], Optional[object]], extra_imports: Sequence[str] = ()):
    def transform(module: cst.Module) -> cst.Module:
        taken = set(_names(module).all)
        count = 0

        class Loops(cst.CSTTransformer):
            def leave_For(self, original: cst.For, updated: cst.For):
                nonlocal count
                if updated.orelse is not None or updated.asynchronous is not None:
                    return updated
                if isinstance(updated.iter, cst.Call) and _dotted(updated.iter.func) in ("range", "zip", "enumerate"):
                    return updated
                result = rewrite(updated, taken)
                if result is None:
                    return updated
                count += 1
                return result

        new = module.visit(Loops())
        if not count:
            raise NotApplicable
        return _add_imports(new, [_stmt(line) for line in extra_imports]) if extra_imports else new

    return transform


def _with_tqdm(loop: cst.For, taken: set[str]):
    if isinstance(loop.iter, cst.Call) and (_dotted(loop.iter.func) or "").endswith("tqdm"):
        return None
    return loop.with_changes(iter=cst.Call(cst.Name("tqdm"), [cst.Arg(loop.iter)]))


def _with_enumerate(loop: cst.For, taken: set[str]):
    index = _fresh(taken, "step")
    target = loop.target
    if isinstance(target, cst.Tuple):
        target = target.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return loop.with_changes(
        target=cst.Tuple([cst.Element(cst.Name(index)), cst.Element(target)], lpar=[], rpar=[]),
        iter=cst.Call(cst.Name("enumerate"), [cst.Arg(loop.iter)]),
    )


def _with_zip(loop: cst.For, taken: set[str]):
    index = _fresh(taken, "i")
    target = loop.target
    if isinstance(target, cst.Tuple):
        target = target.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return loop.with_changes(
        target=cst.Tuple([cst.Element(target), cst.Element(cst.Name(index))], lpar=[], rpar=[]),
        iter=cst.parse_expression(f"zip(ITER, itertools.count())").with_changes(
            args=[cst.Arg(loop.iter), cst.Arg(cst.parse_expression("itertools.count()"))]
        ),
    )


def _through_generator(loop: cst.For, taken: set[str]):
    return loop.with_changes(iter=cst.Call(cst.Name("_batches"), [cst.Arg(loop.iter)]))


def through_generator(module: cst.Module) -> cst.Module:
    if "_batches" in _names(module).all:
        raise NotApplicable
    new = _loop_rewriter(_through_generator)(module)
    helper = _stmt("def _batches(iterable):\n    for item in iterable:\n        yield item\n").with_changes(
        leading_lines=[cst.EmptyLine(), cst.EmptyLine()]
    )
    body = list(new.body)
    last_import = max((i for i, s in enumerate(body) if _is_import(s)), default=-1)
    return new.with_changes(body=[*body[: last_import + 1], helper, *body[last_import + 1 :]])


def iter_next(module: cst.Module) -> cst.Module:
    """``for b in loader: ...`` -> ``it = iter(loader)`` / ``while True: try: b = next(it) except StopIteration: break``."""
    taken = set(_names(module).all)
    count = 0

    class Loops(cst.CSTTransformer):
        def leave_For(self, original: cst.For, updated: cst.For):
            nonlocal count
            if updated.orelse is not None or updated.asynchronous is not None or not isinstance(updated.body, cst.IndentedBlock):
                return updated
            if isinstance(updated.iter, cst.Call) and _dotted(updated.iter.func) == "range":
                return updated
            comments = _comments_in(module, original.body.header) + _comments_in(module, original.target) + _comments_in(module, original.iter)
            it = _fresh(taken, "it")
            start = _with_comment(
                cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(it))], cst.Call(cst.Name("iter"), [cst.Arg(updated.iter)]))]),
                comments,
            ).with_changes(leading_lines=updated.leading_lines)
            fetch = _stmt(f"try:\n    X = next({it})\nexcept StopIteration:\n    break\n")
            assign = _with_comment(
                cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(updated.target.with_changes(lpar=[], rpar=[]) if isinstance(updated.target, cst.Tuple) else updated.target)], cst.Call(cst.Name("next"), [cst.Arg(cst.Name(it))]))]),
                comments,
            )
            fetch = fetch.with_changes(body=fetch.body.with_changes(body=[assign]))
            loop = _with_comment(cst.While(test=cst.Name("True"), body=cst.IndentedBlock([fetch, *updated.body.body])), comments)
            count += 1
            return cst.FlattenSentinel([start, loop])

    new = module.visit(Loops())
    if not count:
        raise NotApplicable
    return new


# Names a snippet may use without importing; stripping keeps imports of anything else.
def strip_imports(module: cst.Module) -> cst.Module:
    """A cell copied out of a notebook: the library imports are gone (well-known names stay unbound)."""
    from gpudoctor.check import apis

    known = getattr(apis, "WELL_KNOWN_NAMES", {})
    stripped = 0
    body = []
    for statement in module.body:
        if not _is_import(statement):
            body.append(statement)
            continue
        kept = []
        for small in statement.body:
            if isinstance(small, cst.Import):
                names = [a for a in small.names if not _strippable(a, None, known)]
                stripped += len(small.names) - len(names)
                if names:
                    kept.append(small.with_changes(names=[*names[:-1], names[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)]))
            elif isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar) and small.module is not None:
                module_path = cst.Module([]).code_for_node(small.module)
                names = [a for a in small.names if not _strippable(a, module_path, known)]
                stripped += len(small.names) - len(names)
                if names:
                    names = [*names[:-1], names[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)]
                    kept.append(small.with_changes(names=names))
            else:
                kept.append(small)
        if kept:
            body.append(statement.with_changes(body=kept))
    if not stripped:
        raise NotApplicable
    return module.with_changes(body=body)


def _strippable(alias: cst.ImportAlias, module_path: Optional[str], known: dict) -> bool:
    full = cst.Module([]).code_for_node(alias.name)
    qualified = f"{module_path}.{full}" if module_path else full
    if qualified.split(".")[0] not in _LIBRARIES:
        return False
    return known.get(_local_name(alias)) == qualified


@dataclass(frozen=True)
class Transform:
    name: str
    apply: Callable[[cst.Module], cst.Module]
    imports: tuple[str, ...] = ()


TRANSFORMS: tuple[Transform, ...] = (
    Transform("main", wrap_in_main),
    Transform("helper", build_in_helper),
    Transform("pass", pass_to_function),
    Transform("pass2", pass_to_function_2),
    Transform("alias-paths", alias_torch_paths),
    Transform("alias-modules", alias_modules),
    Transform("rename", rename_variables),
    Transform("temporary", split_temporaries),
    Transform("enumerate", _loop_rewriter(_with_enumerate)),
    Transform("tqdm", _loop_rewriter(_with_tqdm, ("from tqdm import tqdm\n",))),
    Transform("zip", _loop_rewriter(_with_zip, ("import itertools\n",))),
    Transform("generator", through_generator),
    Transform("iter-next", iter_next),
    Transform("snippet", strip_imports),
    Transform("main+rename", lambda m: rename_variables(wrap_in_main(m))),
)


# ----------------------------------------------------------------------------------------------- running


def fixture_files() -> list[Path]:
    # fixtures/field is the recall corpus (marked `# defect:`, measured by benchmarks/recall.py), not rule fixtures.
    return sorted(p for p in FIXTURES.rglob("*.py") if p.relative_to(FIXTURES).parts[0] not in ("trace", "field"))


@functools.lru_cache(maxsize=None)
def variant(source: str, transform: Transform) -> Optional[str]:
    """The transformed, numbered source; None when the transformation does not apply."""
    module = cst.parse_module(number_expectations(source))
    try:
        new = transform.apply(module)
    except NotApplicable:
        return None
    code = new.code
    compile(code, "<variant>", "exec")  # a transformation must produce valid Python
    return code


@dataclass
class Outcome:
    fixture: str
    transform: str
    kept: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    lost: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    lost_lines: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # findings at lines that expect nothing
    clean: bool = False  # the fixture expects nothing


def run_variant(path: Path, transform: Transform, source: Optional[str] = None) -> Optional[Outcome]:
    from gpudoctor.check.engine import check_source
    from gpudoctor.check.registry import all_rules

    original = source if source is not None else path.read_text(encoding="utf-8")
    code = variant(original, transform)
    if code is None:
        return None
    expected = numbered_expectations(code)
    findings = check_source(code, str(path), rules=all_rules())
    outcome = Outcome(str(path.relative_to(ROOT)), transform.name, clean=not expected)
    found = {(f.line, f.code) for f in findings}
    matched: set[tuple[int, str]] = set()
    for _, (lines, codes) in sorted(expected.items()):
        for code_ in sorted(codes):
            hits = {(line, code_) for line in lines} & found
            if hits:
                outcome.kept[code_] += 1
                matched |= hits
            else:
                outcome.lost[code_] += 1
                outcome.lost_lines.append(f"{code_} at {sorted(lines)}")
    expected_lines = {(line, c) for lines, codes in expected.values() for line in lines for c in codes}
    for f in findings:
        if (f.line, f.code) not in expected_lines:
            outcome.extra.append(f"{f.code} at {f.line}: {f.message[:90]}")
    return outcome


def run_all(files: Optional[Sequence[Path]] = None, transforms: Sequence[Transform] = TRANSFORMS) -> list[Outcome]:
    out = []
    for path in files or fixture_files():
        source = path.read_text(encoding="utf-8")
        for transform in transforms:
            outcome = run_variant(path, transform, source)
            if outcome is not None:
                out.append(outcome)
    return out


def per_rule(outcomes: Iterable[Outcome]) -> dict[str, tuple[int, int]]:
    """rule -> (kept, total) over every variant of every bug fixture."""
    table: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for outcome in outcomes:
        for code, n in outcome.kept.items():
            table[code][0] += n
            table[code][1] += n
        for code, n in outcome.lost.items():
            table[code][1] += n
    return {code: (kept, total) for code, (kept, total) in sorted(table.items())}


def summary(outcomes: Sequence[Outcome]) -> str:
    lines = ["rule   kept/variants  share   lost in"]
    lost_by: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for outcome in outcomes:
        for code, n in outcome.lost.items():
            lost_by[code][outcome.transform] += n
    for code, (kept, total) in per_rule(outcomes).items():
        where = ", ".join(f"{t}:{n}" for t, n in sorted(lost_by[code].items(), key=lambda kv: -kv[1]))
        lines.append(f"{code}  {kept:4d}/{total:<4d}      {kept / total:5.0%}   {where}")
    kept = sum(k for k, _ in per_rule(outcomes).values())
    total = sum(t for _, t in per_rule(outcomes).values())
    lines.append(f"all    {kept:4d}/{total:<4d}      {kept / max(total, 1):5.0%}")
    by_transform: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for outcome in outcomes:
        by_transform[outcome.transform][0] += sum(outcome.kept.values())
        by_transform[outcome.transform][1] += sum(outcome.kept.values()) + sum(outcome.lost.values())
    lines.append("by transformation: " + ", ".join(
        f"{name} {k}/{t}" for name, (k, t) in sorted(by_transform.items()) if t
    ))
    noisy_clean = [o for o in outcomes if o.clean and o.extra]
    extras = sum(len(o.extra) for o in outcomes if not o.clean)
    lines.append(f"clean-fixture variants with findings: {len(noisy_clean)} of {sum(1 for o in outcomes if o.clean)}; "
                 f"findings at unexpected lines in bug-fixture variants: {extras}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    verbose = "--verbose" in argv
    names = [argv[i + 1] for i, a in enumerate(argv) if a == "--transform"]
    paths = [Path(a).resolve() for a in argv if a.endswith(".py")]
    transforms = [t for t in TRANSFORMS if not names or t.name in names]
    outcomes = run_all(paths or None, transforms)
    if verbose:
        for o in outcomes:
            if o.lost_lines or o.extra:
                print(f"{o.fixture} [{o.transform}]")
                for line in o.lost_lines:
                    print(f"    lost  {line}")
                for line in o.extra:
                    print(f"    extra {line}")
    print(summary(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
