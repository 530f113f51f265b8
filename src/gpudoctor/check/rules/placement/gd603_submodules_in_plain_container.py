from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import FileFacts, name_key
from gpudoctor.check.finding import Severity

from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.placement._common import (
    PARAMETERLESS_MODULES,
    given_tensor_argument,
    is_module_constructor,
    method_scopes,
    module_classes,
    parents,
)

# Calls that take the container without registering anything... and calls that may register it.
_HARMLESS = {"len", "enumerate", "zip", "reversed", "iter", "range", "print", "isinstance"}


class SubmodulesInPlainContainer(Rule):
    """``self.layers = [nn.Linear(...) for _ in range(n)]`` (or a dict, or ``self.layers.append(Block())``)
    in an ``nn.Module.__init__``: modules in a Python list/dict are not registered, so ``.to()``/``.cuda()``
    do not move them, ``parameters()`` does not list them (the optimizer never trains them) and
    ``state_dict()`` does not save them. Silent when the container is handed to ``nn.ModuleList``,
    ``nn.Sequential``, ``add_module``, ``setattr`` or any other call that may register it."""

    code = "GD603"
    name = "submodules-in-plain-container"
    summary = "Submodules kept in a Python list/dict attribute instead of nn.ModuleList/nn.ModuleDict"
    severity = Severity.ERROR
    triggers = ("self.",)

    def check(self, facts: FileFacts):
        for class_name in module_classes(facts):
            methods = method_scopes(facts, class_name)
            if any(site.scope in methods for site in facts.method_calls("add_module", "register_module")):
                continue
            if any(site.scope in methods and isinstance(site.node.func, cst.Name) and site.node.func.value == "setattr"
                   for site in facts.calls):
                continue
            for key, bindings in facts.class_attrs.get(class_name, {}).items():
                init = [b for b in bindings if b.scope.name == "__init__" and b.kind == "assign"]
                if len(init) != 1 or len(bindings) != 1:
                    continue
                binding = init[0]
                # ``layers = []`` ... ``self.layers = layers``, and ``extra = self.extra`` aliases.
                keys = {key}
                value = binding.value
                local = facts.assignment_of(value, binding.order, binding.scope)
                if local is not None and local.scope is binding.scope:
                    keys.add(local.key)
                    value = local.value
                for bindings_of_key in binding.scope.bindings.values():
                    for alias in bindings_of_key:
                        if alias.kind == "assign" and name_key(alias.value) == key:
                            keys.add(alias.key)
                kind, example = self._container(facts, value, keys, methods)
                if kind is None or any(self._registered_elsewhere(facts, k, methods) for k in keys):
                    continue
                wrapper = "nn.ModuleDict" if kind == "dict" else "nn.ModuleList"
                if _buffers_only(example):
                    # ``nn.CrossEntropyLoss(weight=w)``: a buffer, no parameter; nothing is left untrained
                    lost = "their tensors are not moved or saved with the model"
                else:
                    lost = ("`model.parameters()` omits them so the optimizer never trains them, and `state_dict()` does "
                            "not save them")
                yield self.report(
                    binding.target,
                    f"`{key}` holds modules ({example}) in a plain Python {kind}, so `{class_name}` does not register "
                    f"them: `model.to(device)`/`.cuda()` leave them on the CPU (\"Expected all tensors to be on the same "
                    f"device\" once the rest is on the accelerator); {lost}.",
                    fix_hint=f"Wrap it: `{key} = {wrapper}(...)`.",
                )

    def _container(self, facts: FileFacts, value, keys: set[str], methods) -> tuple[Optional[str], str]:
        if isinstance(value, (cst.List, cst.Tuple)):
            for element in value.elements:
                name = _weighted_module(facts, element.value)
                if name:
                    return ("list" if isinstance(value, cst.List) else "tuple"), f"`{name}(...)`"
            if not value.elements:
                # self.layers = [] then self.layers.append(Block())
                for site in facts.method_calls("append", "extend", "insert"):
                    if site.scope in methods and name_key(site.receiver) in keys and site.node.args:
                        arg = site.node.args[-1].value
                        built = facts.assignment_of(arg, site.order, site.scope)
                        name = _weighted_module(facts, built.value if built is not None else arg)
                        if name is None and isinstance(arg, (cst.List, cst.ListComp)):
                            inner = arg.elements[0].value if isinstance(arg, cst.List) and arg.elements else getattr(arg, "elt", None)
                            name = _weighted_module(facts, inner)
                        if name:
                            return "list", f"`{name}(...)` appended"
            return None, ""
        if isinstance(value, (cst.ListComp, cst.GeneratorExp)) and not isinstance(value, cst.GeneratorExp):
            name = _weighted_module(facts, value.elt)
            return ("list", f"`{name}(...)`") if name else (None, "")
        if isinstance(value, cst.Dict):
            for element in value.elements:
                if isinstance(element, cst.DictElement):
                    name = _weighted_module(facts, element.value)
                    if name:
                        return "dict", f"`{name}(...)`"
            if not value.elements:
                return self._stored_by_key(facts, keys, methods)
            return None, ""
        if isinstance(value, cst.Call) and not value.args and (
            (isinstance(value.func, cst.Name) and value.func.value == "dict")
            or facts.qualname(value.func) == "collections.OrderedDict"
        ):
            return self._stored_by_key(facts, keys, methods)
        if isinstance(value, cst.DictComp):
            name = _weighted_module(facts, value.value)
            return ("dict", f"`{name}(...)`") if name else (None, "")
        return None, ""

    def _stored_by_key(self, facts: FileFacts, keys: set[str], methods) -> tuple[Optional[str], str]:
        """``self.heads = {}`` then ``self.heads[name] = nn.Linear(...)`` in the class's methods."""
        for site in facts.subscript_assigns:
            if site.scope in methods and site.base_key in keys:
                built = facts.assignment_of(site.value, site.order, site.scope)
                name = _weighted_module(facts, built.value if built is not None else site.value)
                if name:
                    return "dict", f"`{name}(...)` stored by key"
        return None, ""

    def _registered_elsewhere(self, facts: FileFacts, key: str, methods) -> bool:
        """The container is passed to a call (nn.ModuleList(self.layers), nn.Sequential(*self.layers), a helper)."""
        iterated = _iterated_nodes(facts)
        for _, node, scope in facts.name_loads.get(key, ()):
            if scope not in methods and not key.startswith("self."):
                continue  # another function's local of the same name
            if scope not in methods:
                return True  # used from outside the class: unknown
            if id(node) in iterated:
                continue  # ``for layer in tqdm(self.layers)``: only iterated
            up = parents(facts, scope.node)
            parent = up.get(id(node))
            if isinstance(parent, cst.Arg):
                call = up.get(id(parent))
                func = call.func if isinstance(call, cst.Call) else None
                if not (isinstance(func, cst.Name) and func.value in _HARMLESS):
                    return True
        return False


def _iterated_nodes(facts: FileFacts) -> set[int]:
    """Nodes that ``for`` loops iterate (through ``tqdm``/``enumerate``/the file's own generators)."""
    cached = getattr(facts, "_gd603_iterated", None)
    if cached is None:
        cached = set()
        for loop in facts.loops:
            found = facts.iterated(loop)
            if found is not None:
                cached.add(id(found[0]))
        facts._gd603_iterated = cached
    return cached


def _weighted_module(facts: FileFacts, node) -> Optional[str]:
    """A module constructor (``nn.Linear(...)``, the file's own module class), except the ``torch.nn`` modules that hold
    no parameter and no buffer (``nn.ReLU()``, ``nn.Dropout()``): unregistered, they lose nothing and run anywhere."""
    name = is_module_constructor(facts, node)
    if name is not None and name.startswith("nn.") and name[3:] in PARAMETERLESS_MODULES:
        # a weighted loss (``nn.CrossEntropyLoss(weight=w)``) holds its weight as a buffer: unregistered, it stays behind
        return name if given_tensor_argument(node, name[3:]) else None
    return name


def _buffers_only(example: str) -> bool:
    """The example module (``\`nn.CrossEntropyLoss(...)\` appended``) is a parameterless ``torch.nn`` class that
    only holds a buffer it was given."""
    name = example.strip("`").split("(")[0]
    return name.startswith("nn.") and name[3:] in PARAMETERLESS_MODULES
