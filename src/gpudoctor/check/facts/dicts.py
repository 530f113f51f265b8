"""What a dict holds at a call: the one reader of the dicts a file passes as ``**kwargs`` (or as
``model_kwargs=``).

``dict_contents(expr, order, scope)`` replays, in flow order, what the file does to the dict ``expr``
names before ``order``: the entries of its display ``{"k": v}`` or ``dict(k=v)``, then ``d["k"] = v``,
``d.update({...})`` / ``d.update(k=v)``, ``d.setdefault("k", v)``, ``del d["k"]``, ``d.pop("k")`` and
``d.clear()`` — through the name the call uses and the names it aliases (``kwargs = base_kwargs``: one
dict, two names). Entries the file cannot read (``d.update(other)``, ``{**other}``) are not there; a
mutation in a branch counts as done. Kept as a mixin of ``FileFacts`` (``model.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

import libcst as cst

from gpudoctor.check.facts.nodes import call_arg, dotted, name_key, string_value

if TYPE_CHECKING:
    from gpudoctor.check.facts.records import Binding, Scope

_ALIAS_DEPTH = 3  # ``kwargs = base_kwargs``: how many names to follow to the dict
_MUTATORS = ("pop", "update", "setdefault", "clear")


@dataclass(eq=False, repr=False)
class DictEntry:
    """One live entry: ``key`` maps to ``value``, put there by ``node`` (a display's ``DictElement``, a
    ``dict(k=v)`` / ``d.update(k=v)`` ``Arg``, a ``d["k"] = v`` ``Assign``, a ``setdefault`` ``Call``)."""

    key: str
    value: cst.BaseExpression
    node: cst.CSTNode
    order: int  # when the entry was put in the dict
    scope: "Scope"
    context: tuple  # the frames around the statement that put it there
    how: str  # "display" | "store" | "update" | "setdefault" | "passed" (a keyword a call gives a ``**kw`` parameter)


@dataclass(eq=False, repr=False)
class DictContents:
    """The dict an expression evaluates to at one point: its live entries in insertion order, and the
    assignments followed to reach it (the name the call uses first, the display's last; empty for a
    display written in place)."""

    entries: dict[str, DictEntry]
    bindings: tuple["Binding", ...]

    @property
    def name(self) -> Optional[str]:
        """The name bound to the display (the last alias followed)."""
        return self.bindings[-1].key if self.bindings else None


class DictContentsQueries:
    """Mixin of ``FileFacts``: the contents of a dict the file builds, at a call."""

    def dict_contents(self, expr: Optional[cst.CSTNode], order: int, scope: "Scope") -> Optional[DictContents]:
        """What the dict ``expr`` evaluates to holds at ``order``; None when ``expr`` is not a dict the file
        builds (a parameter, a call's result, an unknown name). Cached: callers read, never change, the result."""
        cache = self.__dict__.setdefault("_dict_contents", {})
        key = (id(expr), order, id(scope))
        if key not in cache:
            cache[key] = self._replay_dict(expr, order, scope)
        return cache[key]

    def _replay_dict(self, expr: Optional[cst.CSTNode], order: int, scope: "Scope") -> Optional[DictContents]:
        bindings: list[Binding] = []
        at, where = order, scope
        for _ in range(_ALIAS_DEPTH + 1):
            key = name_key(expr) if expr is not None else None
            if key is None:
                break
            binding = self.binding_at(key, at, where)
            if binding is not None and binding.kind == "param":
                return self._star_kwargs_passed(binding)
            if binding is None or binding.kind != "assign" or binding.value is None:
                return None
            bindings.append(binding)
            expr, at, where = binding.value, binding.order, binding.scope
        entries = self._display_entries(expr, at, where)
        if entries is None:
            return self._returned_dict(expr, bindings)
        for event in sorted(self._dict_mutations(bindings, order), key=lambda e: e[0]):
            _apply(entries, event)
        return DictContents(entries, tuple(bindings))

    def _star_kwargs_passed(self, binding: "Binding") -> Optional[DictContents]:
        """``def load(path, **kw): return AutoModel.from_pretrained(path, **kw)`` called once by the file,
        ``load(p, load_in_8bit=True)``: ``kw`` holds the keywords that call passes beyond the named parameters
        (also those of a ``**dict`` it passes). None for any other parameter, or a function called more than once
        (each call fills it differently) or not at all."""
        function = binding.scope.node
        if not isinstance(function, cst.FunctionDef) or function.params.star_kwarg is not binding.target:
            return None
        calls = self.call_sites_of(binding.scope)
        if len(calls) != 1:
            return None
        site = calls[0]
        named = {p.name.value for p in (*function.params.posonly_params, *function.params.params, *function.params.kwonly_params)}
        entries: dict[str, DictEntry] = {}
        for arg in site.node.args:
            if arg.star == "**":
                passed = self.dict_contents(arg.value, site.order, site.scope)
                if passed is None:
                    return None  # an unknown dict: what ``kw`` holds is not known
                entries.update((k, e) for k, e in passed.entries.items() if k not in named)
            elif arg.keyword is not None and arg.keyword.value not in named:
                key = arg.keyword.value
                entries[key] = DictEntry(key, arg.value, arg, site.order, site.scope, site.context, "passed")
        return DictContents(entries, ())

    def _returned_dict(self, expr, bindings: list["Binding"]) -> Optional[DictContents]:
        """``**self.loading_kwargs()``: the dict the file's own function returns, when every ``return`` of it gives
        a dict the file builds; the entries of all of them (a key one branch returns counts, as a store in a
        branch does)."""
        site = self._call_by_node.get(id(expr)) if isinstance(expr, cst.Call) else None
        if site is None or site.qualname is not None:
            return None
        callees = self.callee_scopes(site)
        if len(callees) != 1:
            return None
        returns = [r for r in self.returns.get(id(callees[0]), ()) if r.kind == "return"]
        entries: dict[str, DictEntry] = {}
        for ret in returns:
            contents = self.dict_contents(ret.value, ret.order, ret.scope) if ret.value is not None else None
            if contents is None:
                return None
            for key, entry in contents.entries.items():
                entries.setdefault(key, entry)
        return DictContents(entries, tuple(bindings)) if returns else None

    def kwargs_contents(self, call: cst.Call, order: int, scope: "Scope") -> Iterator[DictContents]:
        """The contents of each ``**dict`` argument of ``call`` the file builds, in argument order."""
        for arg in call.args:
            if arg.star == "**":
                contents = self.dict_contents(arg.value, order, scope)
                if contents is not None:
                    yield contents

    def kwargs_entry(self, call: cst.Call, keyword: str, order: int, scope: "Scope") -> Optional[DictEntry]:
        """``keyword``'s live entry in the ``**`` dicts of ``call``."""
        for contents in self.kwargs_contents(call, order, scope):
            if keyword in contents.entries:
                return contents.entries[keyword]
        return None

    def keyword_argument(self, call: cst.Call, keyword: str, order: int, scope: "Scope") -> Optional[cst.BaseExpression]:
        """``call``'s ``keyword=`` argument, also when it comes in ``**kwargs`` from a dict the file builds
        (see ``dict_contents``)."""
        found = call_arg(call, keyword=keyword)
        if found is not None:
            return found
        entry = self.kwargs_entry(call, keyword, order, scope)
        return entry.value if entry is not None else None

    def _display_entries(self, expr, order: int, scope: "Scope") -> Optional[dict[str, DictEntry]]:
        """The entries a ``{...}`` display or a ``dict(k=v)`` call starts with (the last of duplicate keys wins,
        as in Python); None for any other expression."""
        entries: dict[str, DictEntry] = {}
        if isinstance(expr, cst.Dict):
            for element in expr.elements:
                key = string_value(element.key) if isinstance(element, cst.DictElement) else None
                if key is not None:
                    entries[key] = DictEntry(key, element.value, element, order, scope, (), "display")
            return entries
        if isinstance(expr, cst.Call) and dotted(expr.func) == "dict" and self.binding_at("dict", order, scope) is None:
            for arg in expr.args:
                if arg.keyword is not None:
                    entries[arg.keyword.value] = DictEntry(arg.keyword.value, arg.value, arg, order, scope, (), "display")
            return entries
        return None

    def _dict_mutations(self, bindings: list["Binding"], order: int) -> Iterator[tuple]:
        """(order, operation, key, DictEntry or None) for each change made to the dict before ``order``, through
        any name bound to it (see ``_dict_names``)."""

        names = self._dict_names(bindings)

        def through(key: Optional[str], at: int, where: "Scope") -> bool:
            return key in names and at < order and self.binding_at(key, at, where) in names[key]

        for site in self.subscript_assigns:
            if through(site.base_key, site.order, site.scope) and len(site.target.slice) == 1:
                index = site.target.slice[0].slice
                key = string_value(index.value) if isinstance(index, cst.Index) else None
                if key is not None:
                    yield site.order, "set", key, DictEntry(key, site.value, site.node, site.order, site.scope, site.context, "store")
        for deletion in self.key_deletions:
            if deletion.key is not None and through(deletion.base_key, deletion.order, deletion.scope):
                yield deletion.order, "delete", deletion.key, None
        for site in self.method_calls(*_MUTATORS):
            if not through(name_key(site.receiver), site.order, site.scope):
                continue
            if site.method in ("pop", "clear"):
                key = string_value(site.arg(0)) if site.method == "pop" else None
                if site.method == "clear" or key is not None:
                    yield site.order, site.method, key, None
            elif site.method == "setdefault":
                key, value = string_value(site.arg(0)), site.arg(1)
                if key is not None and value is not None:
                    yield site.order, "setdefault", key, DictEntry(key, value, site.node, site.order, site.scope, site.context, "setdefault")
            else:
                given = [a for a in site.node.args if a.keyword is None and not a.star]
                added = (self._display_entries(given[0].value, site.order, site.scope) if len(given) == 1 else None) or {}
                for arg in site.node.args:
                    if arg.keyword is not None:
                        added[arg.keyword.value] = DictEntry(arg.keyword.value, arg.value, arg, site.order, site.scope, (), "update")
                for key, entry in added.items():
                    entry.order, entry.context, entry.how = site.order, site.context, "update"
                    yield site.order, "set", key, entry


    def _dict_names(self, bindings: list["Binding"]) -> dict[str, list["Binding"]]:
        """Every name bound to the dict, with the bindings that make it so: the aliases followed from the call
        (``bindings``), and the names later bound to one of them (``alias = kwargs``)."""
        index = self.__dict__.get("_alias_index")
        if index is None:  # once per file: ``a = b`` bindings by the name they read
            index = self.__dict__["_alias_index"] = {}
            for where in [self.module_scope, *self.functions, *self.classes.values()]:
                for found in where.bindings.values():
                    for binding in found:
                        if binding.kind == "assign" and name_key(binding.value) is not None:
                            index.setdefault(name_key(binding.value), []).append(binding)
        names: dict[str, list[Binding]] = {}
        todo = list(bindings)
        while todo:
            binding = todo.pop()
            if binding in names.get(binding.key, ()):
                continue
            names.setdefault(binding.key, []).append(binding)
            todo += [
                alias for alias in index.get(binding.key, ())
                if self.binding_at(binding.key, alias.order, alias.scope) is binding
            ]
        return names


def _apply(entries: dict[str, DictEntry], event: tuple) -> None:
    _order, operation, key, entry = event
    if operation == "set":
        entries[key] = entry  # an existing key keeps its place, as in Python
    elif operation == "setdefault":
        entries.setdefault(key, entry)
    elif operation in ("delete", "pop"):
        entries.pop(key, None)
    elif operation == "clear":
        entries.clear()
