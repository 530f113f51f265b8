"""What a sequence holds: the one reader of the lists and deques a file fills and reads back as records.

``items_of(expr, order, scope)`` gives every expression that may be an element of the sequence ``expr``, as
(expression, order, scope) to read: the elements of a display (``[a, b]``, ``(*xs, c)``), the element of a
comprehension, what the file stores into a list or deque it names (``memory.append(t)``, ``appendleft``,
``insert``, ``extend``, ``+=``, ``memory[i] = t``, in any function that sees the same name), through the calls
that keep the items (``random.sample(memory, k)``, ``list(...)``, ``deque(...)``, a slice, the file's own
helpers' returns) and the fields of transposed records (``batch = Transition(*zip(*transitions))`` ...
``batch.state``; ``states, actions = zip(*transitions)``). ``record_field(item, field, ...)`` reads one field of a
stored record: ``Transition(state, action, ...)`` of a ``namedtuple``/``NamedTuple``/dataclass, or a tuple.

None when the file does not show every element: the sequence is handed to a call that may store into it, or
comes from something not followed. Kept as a mixin of ``FileFacts`` (``model.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import libcst as cst

from gpudoctor.check.facts.nodes import call_arg, name_key, string_value

if TYPE_CHECKING:
    from gpudoctor.check.facts.records import Scope

Source = tuple  # (expression, order, scope)

# Calls whose result holds the items of their first argument (by qualname, or a builtin's name).
_KEEP_ITEMS = {
    "list", "tuple", "sorted", "reversed", "set", "frozenset", "iter", "collections.deque", "random.sample",
    "random.choices", "itertools.islice",
}
# Calls that read a sequence without storing into it.
_READ_ONLY = _KEEP_ITEMS | {
    "len", "print", "zip", "enumerate", "min", "max", "sum", "any", "all", "bool", "str", "repr", "isinstance",
    "random.choice", "random.shuffle", "numpy.random.shuffle",
}
# Methods that store one item (the argument at this position).
_STORE_ONE = {"append": 0, "appendleft": 0, "insert": 1, "add": 0}
_STORE_MANY = {"extend", "extendleft"}
_DEPTH = 10


class ContainerItems:
    """What sequences hold (a mixin of ``FileFacts``)."""

    def items_of(self, node: Optional[cst.CSTNode], order: int, scope: "Scope", depth: int = 0) -> Optional[list[Source]]:
        """Every expression that may be an element of the sequence ``node``; None when not all are shown."""
        if node is None or depth > _DEPTH:
            return None
        if isinstance(node, (cst.List, cst.Tuple, cst.Set)):
            found: list[Source] = []
            for element in node.elements:
                if isinstance(element, cst.StarredElement):
                    inner = self.items_of(element.value, order, scope, depth + 1)
                    if inner is None:
                        return None
                    found += inner
                else:
                    found.append((element.value, order, scope))
            return found
        if isinstance(node, (cst.ListComp, cst.SetComp, cst.GeneratorExp)):
            return [(node.elt, self._inside_comprehension(node, order, scope), scope)]
        if isinstance(node, cst.Subscript):
            if all(isinstance(s.slice, cst.Slice) for s in node.slice):
                return self.items_of(node.value, order, scope, depth + 1)  # ``memory[-1000:]``
            return None
        if isinstance(node, cst.Call):
            return self._items_of_call(node, order, scope, depth)
        if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value != "self":
            return self._transposed_field(node.value, node.attr.value, order, scope, depth)
        return self._items_of_name(node, order, scope, depth)

    def record_field(self, item: cst.CSTNode, field: Union[int, str], order: int, scope: "Scope", depth: int = 0) -> Optional[list[Source]]:
        """The expressions one field of a stored record may be: ``Transition(s, a, s2, r)`` (a ``namedtuple``,
        ``NamedTuple`` or dataclass of the file; ``field`` by name or position), ``(s, a, s2, r)`` (by position),
        a name bound to one; ``Transition(*args)`` in a function reads what each of its calls passes."""
        if depth > _DEPTH:
            return None
        if isinstance(item, (cst.Tuple, cst.List)) and isinstance(field, int):
            elements = item.elements
            if any(isinstance(e, cst.StarredElement) for e in elements[: field + 1]) or field >= len(elements):
                return None
            return [(elements[field].value, order, scope)]
        if isinstance(item, cst.Call):
            names = self.record_fields(item.func, order, scope)
            if names is None:
                return None
            name = field if isinstance(field, str) else names[field] if field < len(names) else None
            if name not in names:
                return None
            if any(a.keyword is not None and a.keyword.value == name for a in item.args):
                return [(call_arg(item, keyword=name), order, scope)]
            return self._positional(item, names.index(name), order, scope)
        key = name_key(item)
        if key is None:
            return None
        binding = self.binding_at(key, order, scope)
        if binding is None or binding.kind != "assign" or binding.value is None:
            return None
        return self.record_field(binding.value, field, binding.order, binding.scope, depth + 1)

    def record_fields(self, func: cst.CSTNode, order: int, scope: "Scope") -> Optional[list[str]]:
        """Field names of a record type the file defines: ``namedtuple("T", ("a", "b"))`` / ``"a b"`` /
        ``"a, b"``, ``typing.NamedTuple("T", [("a", int)])``, a ``NamedTuple`` subclass or a dataclass (its
        annotated class attributes, in order)."""
        key = name_key(func)
        if key is None or "." in key:
            return None
        if key in self.classes:
            return self._class_fields(self.classes[key])
        binding = self.binding_at(key, order, scope)
        made = binding.value if binding is not None and binding.kind == "assign" else None
        if not isinstance(made, cst.Call):
            return None
        q = self.qualname(made.func) or ""
        fields = call_arg(made, 1, "field_names") if q == "collections.namedtuple" else (
            call_arg(made, 1, "fields") if q == "typing.NamedTuple" else None)
        text = string_value(fields)
        if text is not None:
            return text.replace(",", " ").split()
        if isinstance(fields, (cst.List, cst.Tuple)):
            names = []
            for element in fields.elements:
                value = element.value
                if isinstance(value, cst.Tuple) and value.elements:  # NamedTuple("T", [("a", int), ...])
                    value = value.elements[0].value
                name = string_value(value)
                if name is None:
                    return None
                names.append(name)
            return names
        return None

    # ------------------------------------------------------------------ helpers

    def _class_fields(self, class_scope: "Scope") -> Optional[list[str]]:
        node = class_scope.node
        bases = {self.qualname(b.value) for b in node.bases}
        decorators = {(self.qualname(d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator) or "")
                      for d in node.decorators}
        if not (bases & {"typing.NamedTuple"} or decorators & {"dataclasses.dataclass"}):
            return None
        names = []
        for statement in node.body.body:
            if isinstance(statement, cst.SimpleStatementLine):
                for small in statement.body:
                    if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
                        names.append(small.target.value)
        return names

    def _inside_comprehension(self, node, order: int, scope: "Scope") -> int:
        """An order at which the comprehension's element reads its own ``for`` targets (bound after the
        statement that holds it started)."""
        innermost = node.for_in
        while innermost.inner_for_in is not None:
            innermost = innermost.inner_for_in
        current = scope
        while current is not None:
            for bindings in current.bindings.values():
                for binding in bindings:
                    if binding.kind == "for" and binding.value is innermost.iter:
                        return max(order, binding.order + 1)
            current = current.parent
        return order

    def _positional(self, call: cst.Call, index: int, order: int, scope: "Scope") -> Optional[list[Source]]:
        """The argument a record call passes at ``index``; through ``Record(*args)`` inside a function whose
        ``*args`` each call of the file fills."""
        position = 0
        for arg in call.args:
            if arg.keyword is not None:
                break
            if arg.star == "*":
                star = name_key(arg.value)
                binding = self.binding_at(star, order, scope) if star else None
                if binding is None or binding.kind != "param" or not isinstance(binding.target, cst.Param) \
                        or binding.target is not getattr(binding.scope.node.params, "star_arg", None):
                    return None
                return self._star_argument(binding, index - position)
            if arg.star:
                return None
            if position == index:
                return [(arg.value, order, scope)]
            position += 1
        return None

    def _star_argument(self, binding, index: int) -> Optional[list[Source]]:
        """What every call of the file passes at ``index`` inside the ``*args`` of ``binding``'s function."""
        function = binding.scope
        before = len([*function.node.params.posonly_params, *function.node.params.params])
        if function.parent is not None and function.parent.kind == "class":
            before -= 1  # self
        found = []
        for site in self.call_sites_of(function):
            positional = [a for a in site.node.args if a.keyword is None]
            if any(a.star for a in positional[: before + index + 1]) or before + index >= len(positional):
                return None
            found.append((positional[before + index].value, site.order, site.scope))
        return found or None

    def _items_of_call(self, call: cst.Call, order: int, scope: "Scope", depth: int) -> Optional[list[Source]]:
        name = self._callee_name(call)
        if name in _KEEP_ITEMS:
            positional = [a for a in call.args if a.keyword is None]
            if not positional:  # ``deque(maxlen=10000)``, ``list()``: empty
                return [] if all(a.keyword is not None and a.keyword.value == "maxlen" for a in call.args) else None
            if positional[0].star:
                return None
            return self.items_of(positional[0].value, order, scope, depth + 1)
        site = self._call_by_node.get(id(call))
        callees = self.callee_scopes(site) if site is not None and site.qualname is None else []
        found: list[Source] = []
        for callee in callees:
            returns = self.returns.get(id(callee), ())
            if not returns:
                return None
            for ret in returns:
                inner = self.items_of(ret.value, ret.order, ret.scope, depth + 1)
                if inner is None:
                    return None
                found += inner
        return found if callees else None

    def _transposed_field(self, record: cst.CSTNode, field: Union[int, str], order: int, scope: "Scope", depth: int) -> Optional[list[Source]]:
        """The ``field`` of each record in ``rows``, for ``Record(*zip(*rows))`` (or ``zip(*rows)`` unpacked)
        bound to ``record``: a sequence per field."""
        key = name_key(record)
        binding = self.binding_at(key, order, scope) if key is not None else None
        if binding is None or binding.value is None:
            return None
        made = binding.value
        if binding.kind == "assign" and isinstance(made, cst.Call) and len(made.args) == 1 and made.args[0].star == "*":
            if self.record_fields(made.func, binding.order, binding.scope) is None:
                return None
            made = made.args[0].value  # ``Transition(*zip(*rows))``
        elif binding.kind != "assign":
            return None
        rows = self._zipped_rows(made)
        if rows is None:
            return None
        return self._fields_of_rows(rows, field, binding.order, binding.scope, depth)

    def _zipped_rows(self, node: cst.CSTNode) -> Optional[cst.BaseExpression]:
        """``rows`` of ``zip(*rows)``."""
        if (isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "zip"
                and len(node.args) == 1 and node.args[0].star == "*"):
            return node.args[0].value
        return None

    def _fields_of_rows(self, rows, field, order: int, scope: "Scope", depth: int) -> Optional[list[Source]]:
        items = self.items_of(rows, order, scope, depth + 1)
        if items is None:
            return None
        found: list[Source] = []
        for item in items:
            part = self.record_field(*item[:1], field, *item[1:], depth + 1)
            if part is None:
                return None
            found += part
        return found

    def _items_of_name(self, node: cst.CSTNode, order: int, scope: "Scope", depth: int) -> Optional[list[Source]]:
        key = name_key(node)
        binding = self.binding_at(key, order, scope) if key is not None else None
        if binding is None:
            return None
        if binding.kind == "unpack" and binding.value is not None and len(binding.path) == 1:
            rows = self._zipped_rows(binding.value)  # ``states, actions, rewards = zip(*batch)``
            if rows is None:
                return None
            return self._fields_of_rows(rows, binding.path[0], binding.order, binding.scope, depth)
        if binding.kind == "param":
            sources = self.param_sources(binding)
            if not sources:
                return None
            found: list[Source] = []
            for source in sources:
                inner = self.items_of(*source, depth + 1)
                if inner is None:
                    return None
                found += inner
            return found
        if binding.kind != "assign" or binding.value is None:
            return None
        found = self.items_of(binding.value, binding.order, binding.scope, depth + 1)
        if found is None:
            return None
        stored = self._stored_into(key, binding, depth)
        return None if stored is None else found + stored

    def _stored_into(self, key: str, binding, depth: int) -> Optional[list[Source]]:
        """What the file stores into the container ``key`` names (in any function that sees that name); None
        when the name is handed to a call that may store into it."""
        found: list[Source] = []
        for site in self.calls:
            if not self._same_namespace(site.scope, binding.scope, key):
                continue
            if name_key(site.receiver) == key and site.method in _STORE_ONE:
                value = call_arg(site.node, _STORE_ONE[site.method])
                if value is None:
                    return None
                found.append((value, site.order, site.scope))
            elif name_key(site.receiver) == key and site.method in _STORE_MANY:
                inner = self.items_of(call_arg(site.node, 0), site.order, site.scope, depth + 1)
                if inner is None:
                    return None
                found += inner
            elif any(name_key(a.value) == key for a in site.node.args) and self._callee_name(site.node) not in _READ_ONLY:
                return None  # ``fill(memory)``: may store anything
        for aug in self.aug_assigns:
            if aug.target_key == key and self._same_namespace(aug.scope, binding.scope, key):
                inner = self.items_of(aug.node.value, aug.order, aug.scope, depth + 1)
                if inner is None:
                    return None
                found += inner
        for store in self.subscript_assigns:
            if store.base_key == key and self._same_namespace(store.scope, binding.scope, key):
                found.append((store.value, store.order, store.scope))
        return found

    def _callee_name(self, call: cst.Call) -> Optional[str]:
        """The qualname of a library callee, or the name of a builtin the file does not rebind."""
        q = self.qualname(call.func)
        if q is not None:
            return q
        if isinstance(call.func, cst.Name) and call.func.value not in self._bound_names:
            return call.func.value
        return None
