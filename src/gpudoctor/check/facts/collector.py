"""The one walk over a module that fills a :class:`FileFacts` (our own walk over node fields)."""

from __future__ import annotations

import bisect
import dataclasses
import re
from typing import Iterable, Optional, Union

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts.model import FileFacts
from gpudoctor.check.facts.nodes import call_arg, dotted, name_key, receiver_key, string_value
from gpudoctor.check.facts.records import (
    AttributeAssignSite,
    AugAssignSite,
    Binding,
    CallSite,
    DictEntrySite,
    Frame,
    FunctionFrame,
    IfFrame,
    LoopFrame,
    ReturnSite,
    Scope,
    KeyDeletion,
    SubscriptAssignSite,
    WithFrame,
)

_SKIP_FIELD = re.compile(
    r"whitespace|^(lpar|rpar|leading_lines|lines_after_decorators|header|footer|semicolon|comma|"
    r"colon|equal|dot|newline|trailing_whitespace|indent|operator|star|asynchronous|"
    r"lbrace|rbrace|lbracket|rbracket|arrow)$"
)
_FIELDS: dict[type, tuple[str, ...]] = {}


def _child_fields(node_type: type) -> tuple[str, ...]:
    names = _FIELDS.get(node_type)
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(node_type) if not _SKIP_FIELD.search(f.name))
        _FIELDS[node_type] = names
    return names


# type -> 1 (a CSTNode), 2 (a tuple or list), 0 (anything else)
_KIND: dict[type, int] = {}


def _kind(value_type: type) -> int:
    kind = _KIND[value_type] = 1 if issubclass(value_type, cst.CSTNode) else 2 if issubclass(value_type, (tuple, list)) else 0
    return kind


class _Collector:
    """Walks the module once and fills a :class:`FileFacts`."""

    def __init__(self, facts: FileFacts) -> None:
        self.facts = facts
        self.order = 0
        self.frames: list[Frame] = []
        self.scope = facts.module_scope
        self.statement: Optional[cst.CSTNode] = None
        facts._statement_by_node = {}
        facts._node_position = {}
        facts._bindings_by_value = {}
        self.enter = {
            cst.Import: self.on_import,
            cst.ImportFrom: self.on_import_from,
            cst.FunctionDef: self.on_function,
            cst.ClassDef: self.on_class,
            cst.For: self.on_for,
            cst.While: self.on_while,
            cst.With: self.on_with,
            cst.If: self.on_if,
            cst.Assign: self.on_assign,
            cst.Del: self.on_del,
            cst.AnnAssign: self.on_ann_assign,
            cst.AugAssign: self.on_aug_assign,
            cst.Call: self.on_call,
            cst.Name: self.on_name,
            cst.Attribute: self.on_attribute,
            cst.Dict: self.on_dict,
            cst.SimpleStatementLine: self.on_statement,
            cst.Expr: self.on_expr,
            cst.Return: self.on_return,
            cst.CompFor: self.on_comp_for,
            cst.ListComp: self.on_comprehension,
            cst.SetComp: self.on_comprehension,
            cst.GeneratorExp: self.on_comprehension,
            cst.DictComp: self.on_comprehension,
            cst.Yield: self.on_yield,
        }

    # -- traversal

    def walk(self, node: cst.CSTNode) -> None:
        handler = self.enter.get(type(node))
        if handler is not None and handler(node) is False:
            return
        self.walk_children(node)

    def walk_children(self, node: cst.CSTNode) -> None:
        # The hottest loop of the collector: ``walk`` inlined, and a node / sequence / other test by
        # type (a dict lookup) instead of isinstance against the CSTNode ABC.
        enter, kinds = self.enter, _KIND
        names = _FIELDS.get(type(node)) or _child_fields(type(node))
        for name in names:
            child = getattr(node, name)
            kind = kinds.get(type(child))
            if kind is None:
                kind = _kind(type(child))
            if kind == 1:
                handler = enter.get(type(child))
                if handler is None or handler(child) is not False:
                    self.walk_children(child)
            elif kind == 2:
                for item in child:
                    kind = kinds.get(type(item))
                    if kind is None:
                        kind = _kind(type(item))
                    if kind == 1:
                        handler = enter.get(type(item))
                        if handler is None or handler(item) is not False:
                            self.walk_children(item)

    def tick(self) -> int:
        self.order += 1
        return self.order

    def bind(self, key: str, target, value, kind="assign", index=None, path=()) -> None:
        binding = Binding(key, self.tick(), self.scope, target, value, kind, index, tuple(self.frames), path)
        self.scope.bindings.setdefault(key, []).append(binding)
        self.facts._bound_names.add(key)
        if key.startswith("self.") and self.scope.class_name:
            self.facts.class_attrs.setdefault(self.scope.class_name, {}).setdefault(key, []).append(binding)
        if value is not None:
            self.facts._bindings_by_value.setdefault(id(value), []).append(binding)

    def bind_target(self, target: cst.BaseExpression, value, kind="assign", index=None, path=()) -> None:
        key = name_key(target)
        if key is not None:
            self.bind(key, target, value, kind, index, path)
            return
        if isinstance(target, (cst.Tuple, cst.List)):
            for i, element in enumerate(target.elements):
                inner = element.value
                if type(inner) is cst.StarredElement:
                    continue
                self.bind_target(inner, value, "unpack" if kind == "assign" else kind, i, (*path, i))
            return
        # Subscript and other attribute targets: their parts are loads.
        self.walk(target)

    # -- handlers (return False when they walked the children themselves)

    def on_statement(self, node: cst.SimpleStatementLine):
        previous, self.statement = self.statement, node
        self.walk_children(node)
        self.statement = previous
        return False

    def on_expr(self, node: cst.Expr):
        if type(node.value) is cst.Call:
            self._statement_call = node.value
        return None

    def on_comprehension(self, node):
        # In execution order: the iteration binds the targets before the element is computed.
        self.walk(node.for_in)
        if type(node) is cst.DictComp:
            self.walk(node.key)
            self.walk(node.value)
        else:
            self.walk(node.elt)
        return False

    def on_comp_for(self, node: cst.CompFor):
        # ``for k, v in batch.items()`` inside a comprehension: bound in the enclosing scope's namespace
        # (a simplification: comprehension variables do not leak in Python 3, but names rarely clash).
        self.walk(node.iter)
        self.bind_target(node.target, node.iter, "for")
        for condition in node.ifs:
            self.walk(condition)
        if node.inner_for_in is not None:
            self.walk(node.inner_for_in)
        return False

    def on_return(self, node: cst.Return):
        if node.value is not None:
            self.walk(node.value)
        self.facts.returns.setdefault(id(self.scope), []).append(ReturnSite(node, self.tick(), self.scope, node.value))
        return False

    def on_yield(self, node: cst.Yield):
        value = node.value
        kind = "yield"
        if type(value) is cst.From:
            value, kind = value.item, "yield from"
        if value is not None:
            self.walk(value)
        self.facts.yields.setdefault(id(self.scope), []).append(ReturnSite(node, self.tick(), self.scope, value, kind))
        return False

    def on_import(self, node: cst.Import):
        for alias in node.names:
            full = dotted(alias.name) or ""
            if alias.asname is not None and type(alias.asname.name) is cst.Name:
                self.facts.imports[alias.asname.name.value] = full
            else:
                head = full.split(".")[0]
                self.facts.imports[head] = head
        return False

    def on_import_from(self, node: cst.ImportFrom):
        if type(node.names) is cst.ImportStar:
            module = "" if node.relative or node.module is None else dotted(node.module) or ""
            self.facts.star_imports.append(module)
        if node.relative or node.module is None or type(node.names) is cst.ImportStar:
            return False
        module = dotted(node.module) or ""
        for alias in node.names:
            name = dotted(alias.name) or ""
            local = alias.asname.name.value if alias.asname is not None and type(alias.asname.name) is cst.Name else name
            self.facts.imports[local] = f"{module}.{name}"
        return False

    def _decorator_name(self, decorator: cst.BaseExpression) -> Optional[str]:
        """The qualified name of a decorator; ``builtins.staticmethod`` for the builtin (a staticmethod receives
        no ``self``: its arguments map to its parameters from the first)."""
        expr = decorator.func if type(decorator) is cst.Call else decorator
        q = self.facts.qualname(expr)
        if q is None and type(expr) is cst.Name and expr.value in ("staticmethod", "classmethod") \
                and expr.value not in self.facts.imports:
            return f"builtins.{expr.value}"
        return q

    def on_function(self, node: cst.FunctionDef):
        for decorator in node.decorators:
            self.walk(decorator)
        decorators = tuple(q for q in (self._decorator_name(d.decorator) for d in node.decorators) if q)
        class_name = self.scope.name if self.scope.kind == "class" else self.scope.class_name
        self.bind(node.name.value, node, None, "def")
        scope = Scope("function", node.name.value, node, self.scope, class_name, decorators=decorators)
        self.facts.functions.append(scope)
        outer_scope, outer_frames = self.scope, self.frames
        self.scope, self.frames = scope, [*self.frames, FunctionFrame(scope)]
        for param in _params(node.params):
            self.bind(param.name.value, param, param.default, "param")
        self.walk(node.body)
        self.scope, self.frames = outer_scope, outer_frames
        return False

    def on_class(self, node: cst.ClassDef):
        for base in node.bases:
            self.walk(base.value)
        self.bind(node.name.value, node, None, "def")
        scope = Scope("class", node.name.value, node, self.scope, node.name.value)
        self.facts.classes.setdefault(node.name.value, scope)
        outer = self.scope
        self.scope = scope
        self.walk(node.body)
        self.scope = outer
        return False

    def on_for(self, node: cst.For):
        self.walk(node.iter)
        self._loop(node, node.iter, lambda: self.bind_target(node.target, node.iter, "for"))
        return False

    def on_while(self, node: cst.While):
        self.walk(node.test)
        self._loop(node, None, lambda: None)
        return False

    def _loop(self, node: Union[cst.For, cst.While], iterated, bind_target) -> None:
        frame = LoopFrame(node, self.tick(), iterated, scope=self.scope)
        self.facts.loops.append(frame)
        self.frames.append(frame)
        bind_target()
        self.walk(node.body)
        frame.end_order = self.tick()
        self.frames.pop()
        if node.orelse is not None:
            self.walk(node.orelse)

    def on_with(self, node: cst.With):
        pushed = 0
        for item in node.items:
            self.walk(item.item)
            expr = item.item
            call = expr if type(expr) is cst.Call else None
            func = call.func if call is not None else expr
            receiver = func.value if type(func) is cst.Attribute else None
            method = func.attr.value if type(func) is cst.Attribute else None
            self.frames.append(WithFrame(node, item, self.facts.qualname(func), receiver, method))
            pushed += 1
            if item.asname is not None:
                self.bind_target(item.asname.name, expr, "with")
        self.walk(node.body)
        del self.frames[len(self.frames) - pushed :]
        return False

    def on_if(self, node: cst.If):
        self.walk(node.test)
        self.frames.append(IfFrame(node, node.test, "body"))
        self.walk(node.body)
        self.frames.pop()
        if node.orelse is not None:
            self.frames.append(IfFrame(node, node.test, "orelse"))
            self.walk(node.orelse)
            self.frames.pop()
        return False

    def on_del(self, node: cst.Del):
        """``del kw["key"]``: recorded so a dict entry stored earlier is known to be gone."""
        self.walk(node.target)
        targets = [e.value for e in node.target.elements] if isinstance(node.target, (cst.Tuple, cst.List)) else [node.target]
        for target in targets:
            if type(target) is cst.Subscript and len(target.slice) == 1 and type(target.slice[0].slice) is cst.Index:
                self.facts.key_deletions.append(
                    KeyDeletion(string_value(target.slice[0].slice.value), name_key(target.value), self.tick(), self.scope)
                )
        return False

    def on_assign(self, node: cst.Assign):
        self.walk(node.value)
        for target in node.targets:
            t = target.target
            if type(t) is cst.Subscript:
                self.walk(t)
                self.facts.subscript_assigns.append(
                    SubscriptAssignSite(node, self.tick(), name_key(t.value), t, node.value, self.scope, tuple(self.frames))
                )
                continue
            if type(t) is cst.Attribute and name_key(t) is None:
                self.facts.attribute_assigns.append(
                    AttributeAssignSite(node, self.order + 1, t, node.value, self.scope, tuple(self.frames))
                )
            self.bind_target(t, node.value)
        return False

    def on_ann_assign(self, node: cst.AnnAssign):
        if node.value is not None:
            self.walk(node.value)
            self.bind_target(node.target, node.value)
        return False

    def on_aug_assign(self, node: cst.AugAssign):
        self.walk(node.value)
        key = name_key(node.target)
        self.facts.aug_assigns.append(AugAssignSite(node, self.tick(), key, self.scope, tuple(self.frames)))
        if key is not None:
            self.bind(key, node.target, None, "augassign")
        else:
            self.walk(node.target)
        return False

    def on_call(self, node: cst.Call):
        func = node.func
        method = func.attr.value if type(func) is cst.Attribute else None
        receiver = func.value if type(func) is cst.Attribute else None
        statement = getattr(self, "_statement_call", None) is node
        # Walk the receiver first so nested calls get lower orders (they run first).
        self.walk(func)
        site = CallSite(
            node, self.tick(), self.facts.qualname(func), method, receiver, self.scope, tuple(self.frames), statement
        )
        self.facts.calls.append(site)
        self.facts._call_by_node[id(node)] = site
        if site.qualname:
            self.facts._calls_by_qualname.setdefault(site.qualname, []).append(site)
        if self.statement is not None:
            self.facts._statement_by_node[id(node)] = self.statement
        key = receiver_key(receiver)  # ``pipe.unet.to(...)`` too: see _pipeline_component
        if key is not None:
            self.facts._calls_on_key.setdefault(key, []).append(site)
        if site.qualname in apis.DISPATCH:
            first = call_arg(node, 0, "model")
            first_key = name_key(first)
            if first_key is not None:
                self.facts._calls_on_key.setdefault(first_key, []).append(site)
        for arg in node.args:
            self.walk(arg.value)
        return False

    def on_name(self, node: cst.Name):
        self.facts.name_loads.setdefault(node.value, []).append((self.tick(), node, self.scope))
        self.facts._node_position[id(node)] = (self.order + 1, self.scope)
        return False

    def on_attribute(self, node: cst.Attribute):
        key = name_key(node)
        if key is not None:
            self.facts.name_loads.setdefault(key, []).append((self.tick(), node, self.scope))
            self.facts._node_position[id(node)] = (self.order + 1, self.scope)
            return False
        owner = name_key(node.value)
        if owner is not None:
            self.facts.member_uses.setdefault(owner, set()).add(node.attr.value)
        self.walk(node.value)
        return False

    def on_dict(self, node: cst.Dict):
        for element in node.elements:
            if type(element) is cst.DictElement:
                key = string_value(element.key)
                self.walk(element.value)
                if key is not None:
                    self.facts.dict_entries.append(
                        DictEntrySite(key, element.value, element, self.tick(), self.scope, tuple(self.frames), node)
                    )
                else:
                    self.walk(element.key)
            else:
                self.walk(element.value)
        return False


def _params(params: cst.Parameters) -> Iterable[cst.Param]:
    yield from params.posonly_params
    yield from params.params
    if type(params.star_arg) is cst.Param:
        yield params.star_arg
    yield from params.kwonly_params
    if params.star_kwarg is not None:
        yield params.star_kwarg


def collect(module: cst.Module, source: str, path: str = "<string>") -> FileFacts:
    facts = FileFacts(module, source, path)
    collector = _Collector(facts)
    collector.walk(module)
    collector.__dict__.clear()  # its dispatch table of bound methods is a cycle that would keep the tree alive
    _inline_temporaries(facts)
    return facts


def _inline_temporaries(facts: FileFacts) -> None:
    """Resolve single-use temporaries once for every rule: ``tmp = expr`` read exactly once, by the next
    binding of its scope or a use before one, is ``expr`` itself. ``tmp = model.to(dtype); model = tmp`` binds
    ``model`` to ``model.to(dtype)`` (``engine, _, loader, _ = tmp`` unpacks ``deepspeed.initialize(...)``), so
    rules that read what a name was assigned (``binding.value``, the bindings of a call's result) see the call;
    ``facts.through_temporary(tmp)`` gives ``expr`` for a temporary used as a receiver or an argument."""
    binding_orders: dict[int, list[int]] = {}
    for key, loads in facts.name_loads.items():
        if len(loads) != 1 or "." in key:
            continue
        order, load, scope = loads[0]
        bindings = scope.bindings.get(key, ())
        temporary = bindings[0] if len(bindings) == 1 else None
        if temporary is None or temporary.kind != "assign" or temporary.value is None or temporary.order >= order:
            continue
        orders = binding_orders.get(id(scope))
        if orders is None:
            orders = binding_orders[id(scope)] = sorted(b.order for bs in scope.bindings.values() for b in bs)
        if bisect.bisect_right(orders, temporary.order) != bisect.bisect_left(orders, order):
            continue  # something is rebound in between: ``expr`` might read another value there
        facts._temporaries[id(load)] = temporary
        copies = facts._bindings_by_value.pop(id(load), [])
        for copy in copies:
            copy.value = temporary.value
        if copies:
            holders = facts._bindings_by_value.setdefault(id(temporary.value), [])
            holders[:] = [b for b in holders if b is not temporary] + copies
    if facts._temporaries:
        _inline_uses(facts)


def _inline_uses(facts: FileFacts) -> None:
    """A single-use temporary that holds a name (``tmp = self.net``) and is read as a call's receiver
    (``tmp.to(device)``) is that name there: the call is on ``self.net``. A temporary that holds any other
    expression keeps its own name as the receiver (a message names what the user wrote); rules that follow a
    receiver chain ask ``facts.through_temporary``."""
    touched: set[str] = set()
    for site in facts.calls:
        if site.receiver is None or id(site.receiver) not in facts._temporaries:
            continue
        held = facts.through_temporary(site.receiver)
        key = receiver_key(held)
        if key is not None:
            site.receiver = held
            facts._calls_on_key.setdefault(key, []).append(site)
            touched.add(key)
    for key in touched:
        facts._calls_on_key[key].sort(key=lambda c: c.order)
