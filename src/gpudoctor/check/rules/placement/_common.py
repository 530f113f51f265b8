"""Shared questions of the placement family (GD6xx). No torch import: everything is read from the CST."""

from __future__ import annotations

from typing import Iterator, Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, FollowedCall, Scope, call_arg, name_key, string_value
from gpudoctor.check.queries import option_default_expression

# torch functions that allocate a new tensor on the default device (CPU) unless ``device=`` is given.
CREATION = {
    "torch.zeros", "torch.ones", "torch.empty", "torch.full", "torch.arange", "torch.range", "torch.linspace",
    "torch.logspace", "torch.eye", "torch.rand", "torch.randn", "torch.randint", "torch.randperm", "torch.tensor",
    "torch.as_tensor", "torch.from_numpy", "torch.tril_indices", "torch.triu_indices", "torch.normal",
    "torch.FloatTensor", "torch.LongTensor", "torch.Tensor", "torch.BoolTensor", "torch.IntTensor",
}
_WRAPPING = {"torch.tril", "torch.triu", "torch.outer", "torch.exp", "torch.log", "torch.cos", "torch.sin",
             "torch.cumsum", "torch.diag", "torch.flip", "torch.polar", "torch.stack", "torch.cat"}
# Loss modules whose class weight is kept as a buffer (moved only by criterion.to()).
LOSS_MODULES_WITH_WEIGHT = {
    "torch.nn.CrossEntropyLoss": ("weight", 0),
    "torch.nn.NLLLoss": ("weight", 0),
    "torch.nn.BCELoss": ("weight", 0),
    "torch.nn.BCEWithLogitsLoss": ("weight", 0),
    "torch.nn.MultiLabelSoftMarginLoss": ("weight", 0),
    "torch.nn.MultiMarginLoss": ("weight", 2),
}
LOSS_MODULE_EXTRA_WEIGHT = {"torch.nn.BCEWithLogitsLoss": "pos_weight"}
LOSS_FUNCTIONS_WITH_WEIGHT = {
    "torch.nn.functional.cross_entropy",
    "torch.nn.functional.nll_loss",
    "torch.nn.functional.binary_cross_entropy",
    "torch.nn.functional.binary_cross_entropy_with_logits",
    "torch.nn.functional.multilabel_soft_margin_loss",
}
# Keywords of those calls that take a class weight (GD604 reports a CPU tensor there).
LOSS_WEIGHT_KEYWORDS = ("weight", "pos_weight")
# Methods that give a tensor on the same device as the receiver (the CPU-ness propagates).
SAME_DEVICE_METHODS = {
    "unsqueeze", "squeeze", "view", "reshape", "expand", "expand_as", "repeat", "float", "long", "int", "bool",
    "half", "bfloat16", "double", "transpose", "permute", "flatten", "contiguous", "clone", "detach", "t", "T",
    "tril", "triu", "masked_fill", "fill_", "unbind", "chunk", "split", "flip", "cumsum", "sum", "mean", "exp",
    "log", "sqrt", "pow", "abs", "neg", "sin", "cos", "type", "view_as",
}
# Methods whose arguments are sizes or dims, never tensors: the result is still the created tensor.
SHAPE_METHODS = {
    "view", "reshape", "expand", "repeat", "permute", "transpose", "unsqueeze", "squeeze", "flatten", "unflatten",
    "chunk", "split", "narrow", "tile", "roll", "flip", "sum", "mean", "cumsum", "tril", "triu", "contiguous",
}
# Methods whose result no longer is a tensor mixed into device code.
INERT_METHODS = {"item", "tolist", "numpy", "size", "dim", "numel", "shape", "dtype", "device", "ndim", "nelement"}
# Methods that place the tensor: its CPU creation is harmless.
PLACING_METHODS = {"to", "cuda", "type_as", "xpu", "npu", "mps", "pin_memory"}
# Builtins that take a tensor without mixing it with another device.
INERT_CALLS = {"len", "int", "float", "bool", "print", "str", "repr", "isinstance", "type", "range", "list", "tuple",
               "enumerate", "zip", "id", "hash", "min", "max", "abs", "round", "getattr", "hasattr"}
# Names of torch functions that do not take tensors on devices (or take shapes).
_TORCH_NOT_MIXING = {"torch.Size", "torch.device", "torch.no_grad", "torch.is_tensor", "torch.numel",
                     "torch.manual_seed", "torch.set_grad_enabled", "torch.save", "torch.load"}


def creation_qualname(facts: FileFacts, call: cst.CSTNode) -> Optional[str]:
    """``torch.zeros(3)`` without ``device=`` -> "torch.zeros"; anything else -> None."""
    if not isinstance(call, cst.Call):
        return None
    q = facts.qualname(call.func)
    if q in _WRAPPING and call.args and creation_qualname(facts, call.args[0].value):
        return q  # torch.tril(torch.ones(n, n))
    if (
        isinstance(call.func, cst.Attribute)
        and call.func.attr.value in SAME_DEVICE_METHODS
        and creation_qualname(facts, call.func.value)
        and all(_literal_number(a.value) for a in call.args)
    ):
        return creation_qualname(facts, call.func.value)  # torch.ones(n, n).tril()
    if q not in CREATION:
        return None
    if call_arg(call, keyword="device") is not None:
        return None
    if any(a.star for a in call.args):
        return None
    return q


def cpu_tensor(facts: FileFacts, node: Optional[cst.CSTNode], order: int, scope: Scope, depth: int = 0) -> Optional[str]:
    """The ``torch.*`` creation behind a tensor expression made on the CPU: ``torch.ones(n)``,
    ``1 - torch.eye(n)``, ``(torch.arange(n) * 2).float()``, a local bound to one; None otherwise."""
    if node is None or depth > 6:
        return None
    q = creation_qualname(facts, node)
    if q is not None:
        return q
    if isinstance(node, cst.BinaryOperation):
        sides = [cpu_tensor(facts, side, order, scope, depth + 1) for side in (node.left, node.right)]
        others_plain = all(
            found is not None or _literal_number(side) or _plain_number_attribute(facts, side)
            or _number_parameter(facts, side, order, scope)
            for found, side in zip(sides, (node.left, node.right))
        )
        return next((f for f in sides if f), None) if others_plain else None
    if isinstance(node, cst.UnaryOperation):
        return cpu_tensor(facts, node.expression, order, scope, depth + 1)
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in SAME_DEVICE_METHODS:
        # sizes and dims (``.repeat(self.k, n, 1)``) are no tensors; other arguments must be plain numbers
        if node.func.attr.value in SHAPE_METHODS or all(_literal_number(a.value) for a in node.args):
            return cpu_tensor(facts, node.func.value, order, scope, depth + 1)
        return None
    binding = facts.assignment_of(node, order, scope)
    if binding is not None and not binding.key.startswith("self."):
        return cpu_tensor(facts, binding.value, binding.order, binding.scope, depth + 1)
    if isinstance(node, cst.Call) and _own_function_call(facts, node):
        returned = facts.built_by(node, order, scope)  # the file's own helper: what it returns
        if returned is not None and returned is not node:
            return cpu_tensor(facts, returned, *facts._position_of(returned), depth + 1)
    return None


def _own_function_call(facts: FileFacts, call: cst.Call) -> bool:
    site = facts.call_site(call)
    return site is not None and site.qualname is None and bool(facts.callee_scopes(site))


# numpy functions that return arrays of a given shape (not scalars).
_NUMPY_ARRAYS = {"ones", "zeros", "empty", "full", "arange", "linspace", "eye", "triu", "tril", "stack", "concatenate",
                 "load", "ones_like", "zeros_like", "meshgrid", "outer", "identity", "tile", "repeat"}


def _numpy_array(facts: FileFacts, node: Optional[cst.CSTNode], order: int, scope: Scope, depth: int = 0) -> bool:
    """``np.triu(np.ones(shape), k=1).astype("uint8")``, a name bound to one, or the file's own helper's
    result: an array with a shape, so ``torch.from_numpy`` of it is no scalar."""
    if node is None or depth > 4:
        return False
    while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and facts.qualname(node.func) is None:
        node = node.func.value  # .astype(...), .reshape(...)
    if isinstance(node, cst.Call):
        q = facts.qualname(node.func) or ""
        if q.startswith("numpy.") and q.split(".")[-1] in _NUMPY_ARRAYS:
            return True
        return _own_function_call(facts, node)
    binding = facts.assignment_of(node, order, scope)
    return binding is not None and _numpy_array(facts, binding.value, binding.order, binding.scope, depth + 1)


def is_scalar_tensor(facts: FileFacts, call: cst.Call) -> bool:
    """``torch.tensor(2.0)``: a 0-dim CPU tensor mixes with CUDA tensors without error."""
    q = facts.qualname(call.func)
    if q in ("torch.tensor", "torch.as_tensor"):
        order, scope = facts._position_of(call)
        return not _sequence_data(facts, call_arg(call, 0, "data"), order, scope)
    if q == "torch.from_numpy":  # numpy scalars/arrays: unknown rank, silent unless the array has a shape
        order, scope = facts._position_of(call)
        return not _numpy_array(facts, call_arg(call, 0), order, scope)
    if q in ("torch.zeros", "torch.ones", "torch.empty", "torch.rand", "torch.randn"):
        first = call_arg(call, 0)
        if isinstance(first, cst.Tuple) and not first.elements:
            return True  # torch.zeros(())
        if first is None and call_arg(call, keyword="size") is None:
            return True
    return False


_SEQUENCES = (cst.List, cst.Tuple, cst.ListComp, cst.GeneratorExp)


def _sequence_data(facts: FileFacts, node: Optional[cst.CSTNode], order: int, scope: Scope, depth: int = 0) -> bool:
    """``[1.0, 2.0]``, ``(n,)``, or a name / ``self.x`` whose every source is such a display (through assignments and
    the arguments the file's calls pass: ``self.size = size`` where ``Layer(..., (k,))``): ``torch.tensor`` of it has
    a dimension."""
    if isinstance(node, _SEQUENCES):
        return True
    if node is None or depth > 6 or name_key(node) is None:
        return False
    return bool(facts.through_name(
        lambda *source: _sequence_data(facts, *source, depth + 1), node, order, scope, attributes=True
    ))


def file_sets_default_device(facts: FileFacts) -> bool:
    return bool(facts.calls_to("torch.set_default_device", "torch.set_default_tensor_type"))


# ------------------------------------------------------------------------------------ nn.Module classes


def class_defs(facts: FileFacts) -> Iterator[cst.ClassDef]:
    stack: list[cst.CSTNode] = list(facts.module.body)
    while stack:
        node = stack.pop(0)
        if isinstance(node, cst.ClassDef):
            yield node
            stack.extend(node.body.body if isinstance(node.body, cst.IndentedBlock) else ())
        elif isinstance(node, (cst.FunctionDef, cst.If, cst.Try)):
            body = node.body
            stack.extend(body.body if isinstance(body, cst.IndentedBlock) else ())


def module_classes(facts: FileFacts) -> dict[str, cst.ClassDef]:
    """Classes of the file that are ``nn.Module`` subclasses (directly, through HF models, or a local base)."""
    return {name: scope.node for name, scope in facts.classes.items() if facts.is_module_class(name)}


def method_scopes(facts: FileFacts, class_name: str) -> list[Scope]:
    return [s for s in facts.functions if s.parent is not None and s.parent.kind == "class" and s.parent.name == class_name]


def is_module_constructor(facts: FileFacts, node: Optional[cst.CSTNode]) -> Optional[str]:
    """``nn.Linear(...)`` / ``MyBlock(...)`` -> a short name; else None."""
    if not isinstance(node, cst.Call):
        return None
    q = facts.qualname(node.func)
    if q:
        parts = q.split(".")
        if (parts[:2] == ["torch", "nn"] and len(parts) == 3 and parts[2][:1].isupper()
                and parts[2] not in ("Parameter", "Buffer", "init")):
            return q.replace("torch.nn.", "nn.")
        if (parts[:3] == ["torch", "nn", "modules"]) and parts[-1][:1].isupper():
            return "nn." + parts[-1]
        if apis.is_cpu_model_builder(q):
            return q
        return None
    if isinstance(node.func, cst.Name) and node.func.value in module_classes(facts):
        return node.func.value
    return None


# ------------------------------------------------------------------------------------ parents and mixing


def parents(facts: FileFacts, root: cst.CSTNode) -> dict[int, cst.CSTNode]:
    """id(child) -> parent for every node under ``root`` (cached per root)."""
    cache = getattr(facts, "_gd6_parents", None)
    if cache is None:
        cache = facts._gd6_parents = {}
    found = cache.get(id(root))
    if found is not None:
        return found
    found = {}
    stack = [root]
    while stack:
        node = stack.pop()
        for child in node.children:
            found[id(child)] = node
            stack.append(child)
    cache[id(root)] = found
    return found


def _literal_number(node: cst.CSTNode) -> bool:
    if isinstance(node, (cst.Integer, cst.Float, cst.Imaginary)):
        return True
    if isinstance(node, cst.UnaryOperation):
        return _literal_number(node.expression)
    return False


def mixing_use(facts: FileFacts, node: cst.CSTNode, root: cst.CSTNode, depth: int = 0) -> Optional[cst.CSTNode]:
    """Where the tensor ``node`` evaluates to meets other tensors (device checks happen), following
    same-device views; None when it is placed, only indexes, is reduced to Python values, or is unknown.

    ``root`` is the enclosing function (names are followed inside it only).
    """
    if depth > 6:
        return None
    up = parents(facts, root)
    child, parent = node, up.get(id(node))
    while parent is not None:
        if isinstance(parent, (cst.Arg, cst.Element, cst.StarredElement)) and not isinstance(parent, cst.Arg):
            child, parent = parent, up.get(id(parent))
            continue
        if isinstance(parent, (cst.List, cst.Tuple)):
            # [a, b] as an argument: look at what takes the list
            child, parent = parent, up.get(id(parent))
            continue
        break
    if parent is None:
        return None
    if isinstance(parent, cst.Attribute) and parent.value is child:
        attr = parent.attr.value
        call = up.get(id(parent))
        if attr in PLACING_METHODS or attr in INERT_METHODS:
            return None
        if isinstance(call, cst.Call) and call.func is parent:
            if attr in SHAPE_METHODS:
                return mixing_use(facts, call, root, depth + 1)  # arange(n).view(1, -1).repeat(b * h, 1)
            others = [a.value for a in call.args]
            if attr in SAME_DEVICE_METHODS and not any(_is_tensor_like_expr(facts, o) for o in others):
                return mixing_use(facts, call, root, depth + 1)
            if others and any(_is_tensor_like_expr(facts, o) for o in others):
                return call  # m.masked_fill_(x > 0, ...), m.add(x)
            return mixing_use(facts, call, root, depth + 1)
        return None  # m.T, m.shape ...
    if isinstance(parent, cst.BinaryOperation):
        other = parent.right if parent.left is child else parent.left
        if _literal_number(other) or _plain_number_attribute(facts, other):
            return mixing_use(facts, parent, root, depth + 1)
        if creation_qualname(facts, other):
            return None
        return parent
    if isinstance(parent, cst.AugAssign) and parent.value is child:
        if _bound_to_creation(facts, name_key(parent.target), root):
            return None  # ``counts = torch.zeros(3)`` ... ``counts += torch.ones(3)``: both on the CPU
        return parent  # ``x += m``: an in-place op of ``x`` with ``m``
    if isinstance(parent, cst.Subscript) and parent.value is child:
        return mixing_use(facts, parent, root, depth + 1)  # a slice or index stays on the tensor's device
    if isinstance(parent, cst.UnaryOperation) and not isinstance(parent.operator, cst.Not):
        return mixing_use(facts, parent, root, depth + 1)  # ~mask, -m: a tensor on the same device
    if isinstance(parent, cst.Comparison):
        return None  # masks from comparisons: their use is followed elsewhere
    if isinstance(parent, cst.Arg):
        call = up.get(id(parent))
        if not isinstance(call, cst.Call):
            return None
        q = facts.qualname(call.func)
        simple = call.func.value if isinstance(call.func, cst.Name) else None
        if simple in INERT_CALLS or q in _TORCH_NOT_MIXING:
            return None
        if q and q in CREATION:
            return None
        if isinstance(call.func, cst.Attribute) and call.func.attr.value in ("register_buffer", "append", "extend", "__setitem__"):
            return None
        if q and (q.startswith("torch.") or q.startswith("einops")):
            return call  # torch.cat([x, m]), F.embedding(m, w), torch.where(...)
        key = name_key(call.func)
        if key and key.startswith("self."):
            if _is_method_of_enclosing_class(facts, key, call):
                return None  # self.helper(m): a method, not a submodule; what it does with m is not followed
            return call  # self.embed(m): the submodule's weights are on the model's device
        if isinstance(call.func, cst.Attribute) and call.func.attr.value in SAME_DEVICE_METHODS | {
            "add", "add_", "mul", "mul_", "sub", "div", "masked_fill_", "masked_fill", "matmul", "bmm", "mm",
            "copy_", "index_select", "gather", "scatter", "scatter_add", "where", "lerp",
        }:
            return call  # x.masked_fill(m, ...), x.add(m)
        return None
    if isinstance(parent, cst.Assign) and parent.value is child and len(parent.targets) == 1:
        key = name_key(parent.targets[0].target)
        if key is None or key.startswith("self."):
            return None
        return _first_mixing_load(facts, key, parent, root, depth)
    return None


def _first_mixing_load(facts: FileFacts, key: str, assign: cst.Assign, root: cst.CSTNode, depth: int) -> Optional[cst.CSTNode]:
    """The loads of ``key`` inside ``root`` after ``assign``; None as soon as the name is placed."""
    loads = _loads_in(facts, key, root)
    start = _first_position(facts, assign.value)
    later = [n for n in loads if _first_position(facts, n) > start]
    for load in later:
        if _placed_here(facts, load, root):
            return None  # m = m.to(x.device) / m.to(x) somewhere: treat the name as handled
    updates = [a for a in _in_place_updates(facts, key, root) if _first_position(facts, a.value) > start]
    for load in sorted(later + updates, key=lambda n: _first_position(facts, n.value if isinstance(n, cst.AugAssign) else n)):
        if isinstance(load, cst.AugAssign):
            value = load.value
            if not (_literal_number(value) or _plain_number_attribute(facts, value) or creation_qualname(facts, value)):
                return load  # ``logits = torch.zeros(b, n)`` ... ``logits += self.fc(h)``: meets the head's output
            continue
        found = mixing_use(facts, load, root, depth + 1)
        if found is not None:
            return found
        if _rebinds(facts, load, key, assign, root):
            return None  # ``m = m.repeat(b, 1).to(x.device)``: later loads see the new value
    return None


def _in_place_updates(facts: FileFacts, key: str, root: cst.CSTNode) -> list[cst.AugAssign]:
    """The ``key += ...`` / ``key *= ...`` statements inside ``root`` (the target is a store, not a load)."""
    found, stack = [], [root]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.AugAssign) and name_key(node.target) == key:
            found.append(node)
        stack.extend(node.children)
    return found


def _bound_to_creation(facts: FileFacts, key: Optional[str], root: cst.CSTNode) -> bool:
    """``key`` is assigned a tensor created on the CPU somewhere inside ``root``."""
    if key is None:
        return False
    stack = [root]
    while stack:
        node = stack.pop()
        if (isinstance(node, cst.Assign) and len(node.targets) == 1 and name_key(node.targets[0].target) == key
                and creation_qualname(facts, node.value)):
            return True
        stack.extend(node.children)
    return False


def _rebinds(facts: FileFacts, load: cst.CSTNode, key: str, assign: cst.Assign, root: cst.CSTNode) -> bool:
    """``load`` is read in the value of a later assignment to the same name (``m = m.repeat(n)...``)."""
    up = parents(facts, root)
    node = up.get(id(load))
    while node is not None and not isinstance(node, (cst.BaseStatement, cst.BaseSmallStatement)):
        node = up.get(id(node))
    return (isinstance(node, cst.Assign) and node is not assign and len(node.targets) == 1
            and name_key(node.targets[0].target) == key)


def _placed_here(facts: FileFacts, load: cst.CSTNode, root: cst.CSTNode) -> bool:
    up = parents(facts, root)
    parent = up.get(id(load))
    return isinstance(parent, cst.Attribute) and parent.value is load and parent.attr.value in PLACING_METHODS


def _loads_in(facts: FileFacts, key: str, root: cst.CSTNode) -> list[cst.CSTNode]:
    out = []
    for _, node, _scope in facts.name_loads.get(key, ()):
        if id(node) in parents(facts, root):
            out.append(node)
    return out


def _first_position(facts: FileFacts, node: cst.CSTNode) -> int:
    pos = facts._node_position.get(id(node))
    if pos is not None:
        return pos[0]
    site = facts.call_site(node) if isinstance(node, cst.Call) else None
    if site is not None:
        return site.order
    for child in node.children:
        p = _first_position(facts, child)
        if p >= 0:
            return p
    return -1


def _plain_number_attribute(facts: FileFacts, node: cst.CSTNode) -> bool:
    """``self.n_heads`` bound in the class to a number: an ``__init__`` argument, a literal, ``config.x``,
    ``int(...)``/``len(...)``. Parameters and buffers (``nn.Parameter``, ``torch.*``) are not."""
    key = name_key(node)
    if key is None or not key.startswith("self."):
        return False
    order, scope = facts._position_of(node)
    binding = facts.binding_at(key, order, scope)
    value = binding.value if binding is not None else None
    if value is None:
        return False
    if _literal_number(value) or isinstance(value, cst.Name):
        return True
    if isinstance(value, cst.Attribute):
        head = value
        while isinstance(head, cst.Attribute):
            head = head.value
        return isinstance(head, cst.Name) and head.value in ("config", "cfg", "args", "hparams", "self")
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Name):
        return value.func.value in ("int", "float", "len", "round", "max", "min")
    return False


def _number_parameter(facts: FileFacts, node: cst.CSTNode, order: int, scope: Scope) -> bool:
    """A parameter of the enclosing function that every call of the file passes a literal number for (or, when
    no call passes it, whose default is one): ``stride`` in ``torch.tensor(anchors) / stride`` of
    ``Head(anchors, stride=8)``. A CPU tensor combined with it stays on the CPU."""
    if not isinstance(node, cst.Name):
        return False
    binding = facts.binding_at(node.value, order, scope)
    if binding is None or binding.kind != "param" or not isinstance(binding.target, cst.Param):
        return False
    passed = list(facts.param_arguments(binding))
    if passed:
        return all(_literal_number(argument) for argument, _, _ in passed)
    default = binding.target.default
    return default is not None and _literal_number(default)


def _is_method_of_enclosing_class(facts: FileFacts, key: str, node: cst.CSTNode) -> bool:
    _, scope = facts._position_of(node.func if isinstance(node, cst.Call) else node)
    name = key.split(".", 1)[1]
    return any(f.class_name == scope.class_name and f.name == name and f.parent is not None and f.parent.kind == "class"
               for f in facts.functions) if scope.class_name else False


def _is_tensor_like_expr(facts: FileFacts, node: cst.CSTNode) -> bool:
    """Anything that may be a tensor (not a literal number, string, None, True/False)."""
    if _literal_number(node) or isinstance(node, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)):
        return False
    if isinstance(node, cst.Name) and node.value in ("None", "True", "False"):
        return False
    if isinstance(node, cst.Comparison):
        return True
    q = facts.qualname(node)
    if q and (q.startswith("torch.float") or q.startswith("torch.int") or q in ("torch.bool", "torch.long")):
        return False
    return True


# ------------------------------------------------------------------------------------ placement of models


def moves_to_accelerator(facts: FileFacts) -> Optional[str]:
    """Evidence in the file that something is put on an accelerator (for severity)."""
    for site in facts.calls:
        if site.method == "cuda":
            return "`.cuda()`"
        if site.method == "to" or site.qualname == "torch.device":
            for arg in site.node.args:
                text = string_value(arg.value)
                if text and text.split(":")[0] in ("cuda", "mps", "xpu", "npu"):
                    return f"`{text}`"
    if "device_map" in facts.source:
        return "`device_map=`"
    return None


def placement(facts: FileFacts, node: Optional[cst.CSTNode], order: int, scope: Scope, depth: int = 0,
              expect_module: bool = False) -> Optional[str]:
    """Where a model expression is, as far as the file shows: "unplaced" (built on the CPU and never moved),
    "placed" (moved, or loaded with a single-device map), "dispatched" (spread by a device map), or None.

    ``expect_module``: the caller knows the value is an ``nn.Module`` (what ``nn.DataParallel`` wraps), so an
    instance of a class imported from the project's own package (``from models import CompletionNetwork``) or a
    torchvision model builder counts as built on the CPU, like the file's own ``nn.Module`` classes."""
    if node is None or depth > 5:
        return None
    if isinstance(node, cst.Call):
        if isinstance(node.func, cst.Attribute) and node.func.attr.value in apis.MODULE_MOVES:
            return "placed"
        q = facts.qualname(node.func)
        if q in apis.DISPATCH:
            return "dispatched"
        if q == "copy.deepcopy" and node.args:  # where the original is when it is copied
            site = facts.call_site(node)
            at = (site.order, site.scope) if site is not None else (order, scope)
            return placement(facts, node.args[0].value, *at, depth + 1, expect_module)
        if q in apis.GET_PEFT_MODEL or q in apis.PEFT_LOADERS or q in apis.PASSTHROUGH:
            # ``PeftModel.from_pretrained(base, path)``, ``get_peft_model(base, cfg)``, ``prepare_model_for_kbit_training(base)``:
            # the adapters are put where the wrapped model is, so the result is where ``base`` is
            site = facts.call_site(node)
            at = (site.order, site.scope) if site is not None else (order, scope)
            return placement(facts, call_arg(node, 0, "model"), *at, depth + 1, expect_module)
        owner_method = apis.hf_class_method(q) if q else None
        if owner_method and owner_method[1] in ("from_pretrained", "from_config") and apis.is_model_class(owner_method[0]):
            device_map = facts.device_map(call_arg(node, keyword="device_map"), order, scope)
            if device_map is None or (device_map.strategy == "single" and device_map.devices <= {"cpu"}):
                return "unplaced"
            return "dispatched" if device_map.maybe_dispatched else "placed"
        if is_module_constructor(facts, node) or (expect_module and _imported_model_constructor(q)):
            return "unplaced"
        site = facts.call_site(node)
        if site is not None and site.qualname is None:  # the file's own helper: what it returns
            for callee in facts.callee_scopes(site):
                for ret in facts.returns.get(id(callee), ()):
                    found = placement(facts, ret.value, ret.order, ret.scope, depth + 1, expect_module)
                    if found is not None:
                        return found
        return None
    key = name_key(node)
    param = facts.binding_at(key, order, scope) if key is not None else None
    if param is not None and param.kind == "param":  # handed in: where the caller's argument is
        if facts.is_trainer_hook_model(param):
            return "placed"  # ``compute_loss(self, model, ...)``: the Trainer's own model, on its device
        passed = facts.param_argument(param)
        return placement(facts, *passed, depth + 1, expect_module) if passed is not None else None
    binding = facts.assignment_of(node, order, scope)
    if binding is None:
        return None
    key = binding.key
    for site in facts.calls:
        if binding.order < site.order < order and name_key(site.receiver) == key and site.method in apis.MODULE_MOVES:
            if facts._same_namespace(site.scope, scope, key):
                return "placed"
        if binding.order < site.order < order and site.qualname in apis.DISPATCH and name_key(call_arg(site.node, 0, "model")) == key:
            return "dispatched"
    built = placement(facts, binding.value, binding.order, binding.scope, depth + 1, expect_module)
    if built in ("placed", "dispatched"):
        return built  # already on a device: a helper it is handed to uses it there
    # Handed to something that may place it (a helper, accelerator.prepare, a Trainer...)
    for site in facts.calls:
        if binding.order < site.order < order and any(name_key(a.value) == key for a in site.node.args):
            if facts._same_namespace(site.scope, scope, key):
                return None
    return built



# Libraries whose classes or builders may place, dispatch or wrap what they build (or are not models at all).
_NOT_PLAIN_CONSTRUCTORS = ("torch.", "transformers.", "accelerate.", "peft.", "diffusers.", "deepspeed.", "timm.",
                           "lightning.", "pytorch_lightning.", "vllm.", "bitsandbytes.")


def _imported_model_constructor(qualname: Optional[str]) -> bool:
    """``CompletionNetwork`` from the project's own ``models`` package (a class name: an instance built where
    its parameters are created, on the CPU), or a ``torchvision.models`` builder (CPU weights)."""
    if not qualname:
        return False
    if qualname.startswith("torchvision.models."):
        return True
    last = qualname.split(".")[-1]
    return "." in qualname and last[:1].isupper() and not last.isupper() and not qualname.startswith(_NOT_PLAIN_CONSTRUCTORS)


# ------------------------------------------------------------------------------------ tensors computed on the CPU

# torch functions that count or summarise their first input on its device (class weights from labels).
_COUNTING = {"torch.bincount", "torch.histc", "torch.unique"}
# Methods that reduce to one number unless given a dim.
_REDUCTIONS = {"sum", "mean", "max", "min", "prod", "norm", "std", "var", "median", "amax", "amin"}
_ELEMENTWISE = {"clamp", "clamp_", "clip", "reciprocal", "rsqrt", "sqrt", "log", "exp", "pow", "abs", "neg",
                "float", "double", "half", "long", "to_dense", "contiguous", "clone", "detach", "view", "reshape",
                "flatten", "squeeze", "unsqueeze", "softmax", "log_softmax", "normalize"}


def cpu_computed(facts: FileFacts, node: Optional[cst.CSTNode], order: int, scope: Scope, depth: int = 0, passed=None) -> Optional[tuple[cst.CSTNode, bool]]:
    """(the expression that makes it, whether it has elements beyond one) when ``node`` is a tensor computed
    on the CPU and never placed: a ``torch.*`` creation without ``device=`` (``torch.tensor(w)``,
    ``torch.from_numpy(a)``), a count over data the file never moves (``torch.bincount(labels)`` of a
    parameter), and arithmetic, element-wise methods and reductions of those, through names, parameters and
    the file's own helpers (a helper's parameters as that call passes them). None when anything on the way
    may be on another device."""
    if node is None or depth > 10:
        return None
    method_call = isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and facts.qualname(node.func) is None
    q = None if method_call else creation_qualname(facts, node)
    if q is not None:
        return node, not (isinstance(node, cst.Call) and is_scalar_tensor(facts, node))
    if isinstance(node, cst.Call):
        q = facts.qualname(node.func)
        if q in _COUNTING and call_arg(node, keyword="device") is None:
            data = call_arg(node, 0, "input")
            if _unmoved_data(facts, data, order, scope, depth + 1, passed):
                return node, True
            return None
        if isinstance(node.func, cst.Attribute) and q is None:
            method = node.func.attr.value
            if method in _REDUCTIONS | _ELEMENTWISE | SAME_DEVICE_METHODS and all(
                not _is_tensor_like_expr(facts, a.value) or a.keyword is not None and a.keyword.value in ("min", "max", "dim", "dtype")
                or _python_number(a.value)
                or method in SHAPE_METHODS  # sizes and dims: ``.expand(x.size(0), -1)``
                # ``mask.float().masked_fill(mask == 0, v)``: every tensor operand is on the CPU too
                or cpu_computed(facts, a.value, order, scope, depth + 1, passed) is not None
                for a in node.args
            ):
                found = cpu_computed(facts, node.func.value, order, scope, depth + 1, passed)
                if found is None:
                    return None
                reduced = method in _REDUCTIONS and not node.args
                return found[0], found[1] and not reduced
            return None
        if _own_function_call(facts, node):  # every return on the CPU (its parameters as this call passes them)
            site = facts.call_site(node)
            return facts.every_return(
                site, lambda value, at, within, callee: cpu_computed(facts, value, at, within, depth + 1, FollowedCall(site, callee))
            )
        return None
    if isinstance(node, cst.BinaryOperation):
        sides = [cpu_computed(facts, side, order, scope, depth + 1, passed) for side in (node.left, node.right)]
        # a CPU tensor with elements meets the other side: the result is on the CPU, or the operation raises
        vectors = [s for s in sides if s is not None and s[1]]
        if vectors:
            return vectors[0]
        return None
    if isinstance(node, cst.Comparison) and len(node.comparisons) == 1:
        sides = [cpu_computed(facts, side, order, scope, depth + 1, passed)
                 for side in (node.left, node.comparisons[0].comparator)]
        vectors = [s for s in sides if s is not None and s[1]]
        return vectors[0] if vectors else None
    if isinstance(node, cst.UnaryOperation):
        return cpu_computed(facts, node.expression, order, scope, depth + 1, passed)
    return facts.through_name(
        lambda *source: cpu_computed(facts, *source, depth + 1, passed), node, order, scope,
        stop=lambda binding, at: _placed_after(facts, binding, at), passed=passed,
    )


def _python_number(node: cst.CSTNode) -> bool:
    """``float("-inf")``, ``int(n)``, ``len(x)``: a Python number, not a tensor."""
    return (isinstance(node, cst.Call) and isinstance(node.func, cst.Name)
            and node.func.value in ("float", "int", "len", "round", "bool"))


def cpu_tensor_mapping(facts: FileFacts, node: Optional[cst.CSTNode], order: int, scope: Scope, depth: int = 0) -> Optional[cst.CSTNode]:
    """The store that fills it when ``node`` is a mapping whose every value the file turns into a CPU tensor and
    never places: ``for k, v in inputs.items(): inputs[k] = torch.tensor(v)`` (the ``prepare_input`` helper of
    many Kaggle NLP notebooks), through names and the file's own helpers. None when any store into it may be on
    another device, or when it is moved."""
    if node is None or depth > 6:
        return None
    if isinstance(node, cst.Call):
        if not _own_function_call(facts, node):
            return None
        site = facts.call_site(node)
        return facts.every_return(site, lambda value, at, within, _callee: cpu_tensor_mapping(facts, value, at, within, depth + 1))
    key = name_key(node)
    if key is None or "." in key:
        return None
    binding = facts.binding_at(key, order, scope)
    if binding is None or binding.kind != "assign" or binding.scope is not scope or _placed_after(facts, binding, order):
        return None
    stores = False
    filled = None
    for loop in _nodes_of(scope.node, cst.For):
        if not binding.order < facts._position_of(loop.iter)[0] < order:
            continue
        item_key = _items_loop_key(facts, loop, key, scope)
        for statement in _nodes_of(loop.body, cst.Assign):
            if len(statement.targets) != 1 or not _stores_into(statement.targets[0].target, key):
                continue
            at, within = facts._position_of(statement.value)
            if within is not scope or cpu_computed(facts, statement.value, at, within) is None:
                return None  # ``inputs[k] = v.to(device)``: not (only) CPU tensors
            stores = True
            if item_key is not None and _stores_into(statement.targets[0].target, key, item_key):
                filled = statement.value
    if filled is not None or stores:
        return filled
    # ``inputs = prepare_input(cfg, text)`` with nothing stored into it here: what the helper returns
    return cpu_tensor_mapping(facts, binding.value, binding.order, binding.scope, depth + 1)


def _nodes_of(root: cst.CSTNode, kind: type) -> list:
    found, stack = [], [root]
    while stack:
        node = stack.pop()
        if isinstance(node, kind):
            found.append(node)
        stack.extend(node.children)
    return found


def _items_loop_key(facts: FileFacts, loop: cst.For, key: str, scope: Scope) -> Optional[str]:
    """``k`` for ``for k, v in key.items():`` (every entry of ``key`` is visited; also through ``enumerate``/
    ``zip``/``tqdm``/the file's generators), else None."""
    for name, bindings in scope.bindings.items():
        for binding in bindings:
            if binding.kind != "for" or binding.value is not loop.iter:
                continue
            found = loop_item_source(facts, loop.iter, binding.path, binding.order, scope)
            if found is None or found[1] != (0,):
                continue
            items = found[0]
            if (isinstance(items, cst.Call) and isinstance(items.func, cst.Attribute) and items.func.attr.value == "items"
                    and name_key(items.func.value) == key and not items.args):
                return name
    return None


def _stores_into(target: cst.BaseExpression, key: str, index: Optional[str] = None) -> bool:
    """``target`` is ``key[...]`` (``key[index]`` when ``index`` is given)."""
    if not (isinstance(target, cst.Subscript) and name_key(target.value) == key and len(target.slice) == 1):
        return False
    if index is None:
        return True
    element = target.slice[0].slice
    return isinstance(element, cst.Index) and isinstance(element.value, cst.Name) and element.value.value == index


def _placed_after(facts: FileFacts, binding, order: int) -> bool:
    """The name assigned by ``binding`` is moved (``key.to(...)`` / ``key.cuda()``) between the binding and
    ``order``."""
    return binding.kind == "assign" and any(
        binding.order < site.order < order and site.method in PLACING_METHODS and name_key(site.receiver) == binding.key
        and site.scope is binding.scope
        for site in facts.calls
    )


def _unmoved_data(facts: FileFacts, node: Optional[cst.CSTNode], order: int, scope: Scope, depth: int, passed=None) -> bool:
    """A CPU tensor, or a parameter that no call of the file passes and that its function never moves (the
    labels a dataset holds, handed to a counting helper)."""
    if node is None or depth > 10:
        return False
    if cpu_computed(facts, node, order, scope, depth + 1, passed) is not None:
        return True
    key = name_key(node)
    if key is None or "." in key:
        return False
    binding = facts.binding_at(key, order, scope)
    if binding is None or binding.kind != "param":
        return False
    arguments = facts.param_sources(binding, passed)
    if arguments:
        return all(_unmoved_data(facts, *argument, depth + 1) for argument in arguments)
    if passed is not None and passed.callee is binding.scope:
        return False  # the call being followed passes it by keyword or star: not followed
    if facts.value(node, order, scope).kind != "unknown":
        return False
    return not any(
        site.scope is binding.scope and site.method in PLACING_METHODS and name_key(site.receiver) == key
        for site in facts.calls
    )


_ACCELERATORS = ("cuda", "xpu", "mps", "npu")


def on_accelerator(facts: FileFacts, node: Optional[cst.CSTNode], order: int, scope: Scope, depth: int = 0) -> Optional[cst.CSTNode]:
    """The call that puts the tensor ``node`` on an accelerator (``x.cuda()``, ``x.to("cuda")``,
    ``x.to(device)`` with ``device = "cuda" if ... else "cpu"``), followed through views, arithmetic,
    comparisons, names and parameters (every call of the file passes one); None when not shown."""
    if node is None or depth > 20:
        return None
    q = facts.qualname(node.func) if isinstance(node, cst.Call) else None
    if q in CREATION:  # ``torch.tensor(obs, device=device)``
        target = call_arg(node, keyword="device")
        return node if target is not None and accelerator_device(facts, target, order, scope, depth + 1) else None
    if q in _JOINING:  # ``torch.cat(batch.state)``: where the joined tensors are
        return _all_on_accelerator(facts, facts.items_of(call_arg(node, 0, "tensors"), order, scope), depth)
    if isinstance(node, cst.IfExp):  # ``None if terminated else torch.tensor(obs, device=device)``
        branches = [b for b in (node.body, node.orelse) if not _is_none(b)]
        return _all_on_accelerator(facts, [(b, order, scope) for b in branches], depth)
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
        method = node.func.attr.value
        if method in ("cuda", "xpu", "npu", "mps") and facts.qualname(node.func) is None:
            return node
        if method == "to":
            target = call_arg(node, 0, "device")
            if target is not None and accelerator_device(facts, target, order, scope, depth + 1):
                return node
            return None
        if method in SAME_DEVICE_METHODS | SHAPE_METHODS | {"masked_fill", "ne", "eq", "lt", "gt", "le", "ge"}:
            return on_accelerator(facts, node.func.value, order, scope, depth + 1)
        return None
    if isinstance(node, cst.Call) and _own_function_call(facts, node):
        return _returned_on_accelerator(facts, node, (), depth)
    if isinstance(node, (cst.Subscript, cst.Attribute)):
        if isinstance(node, cst.Attribute) and node.attr.value not in ("T", "mT", "data"):
            return None
        return on_accelerator(facts, node.value, order, scope, depth + 1)
    if isinstance(node, cst.Comparison):
        return on_accelerator(facts, node.left, order, scope, depth + 1)
    if isinstance(node, cst.BinaryOperation):
        return on_accelerator(facts, node.left, order, scope, depth + 1) or on_accelerator(facts, node.right, order, scope, depth + 1)
    if isinstance(node, cst.UnaryOperation):
        return on_accelerator(facts, node.expression, order, scope, depth + 1)
    key = name_key(node)
    binding = facts.binding_at(key, order, scope) if key is not None and not key.startswith("self.") else None
    if binding is not None and binding.kind == "unpack" and isinstance(binding.value, cst.Call) and binding.path \
            and _own_function_call(facts, binding.value):
        return _returned_on_accelerator(facts, binding.value, binding.path, depth)  # ``x, y = get_batch(data, i)``
    if binding is not None and binding.kind == "for" and binding.value is not None:
        return _item_on_accelerator(facts, binding, depth)  # ``[s for s in batch.next_state if s is not None]``
    if binding is not None and facts.trainer_prepared_batch(binding):
        return binding.target  # ``compute_loss(self, model, inputs)``: the trainer moved the batch to its device
    return facts.through_name(lambda *source: on_accelerator(facts, *source, depth + 1), node, order, scope)


# torch functions that join tensors: the result is on the device of the tensors joined.
_JOINING = {"torch.cat", "torch.concat", "torch.concatenate", "torch.stack", "torch.hstack", "torch.vstack", "torch.dstack"}


def _is_none(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.Name) and node.value == "None"


def _all_on_accelerator(facts: FileFacts, sources: Optional[list], depth: int) -> Optional[cst.CSTNode]:
    """The call that puts the first of ``sources`` (expression, order, scope) on an accelerator, when every one
    that is not ``None`` is shown on one (tensors joined, a sequence's items, the branches of a conditional)."""
    found = None
    for node, order, scope in sources or ():
        if _is_none(node):
            continue
        placed = on_accelerator(facts, node, order, scope, depth + 1)
        if placed is None:
            return None
        found = found or placed
    return found


def _item_on_accelerator(facts: FileFacts, binding, depth: int) -> Optional[cst.CSTNode]:
    """A ``for`` target (a comprehension's too) is on an accelerator when every item of what it iterates is (the
    part at its unpacking path of each stored record)."""
    items = facts.items_of(binding.value, binding.order, binding.scope)
    if items is None or len(binding.path) > 1:
        return None
    if binding.path:
        parts = [facts.record_field(node, binding.path[0], order, scope) for node, order, scope in items]
        if any(part is None for part in parts):
            return None
        items = [source for part in parts for source in part]
    return _all_on_accelerator(facts, items, depth)


def only_called_in_callee(facts: FileFacts, call, key: str) -> bool:
    """``call`` hands ``key`` to the file's own function(s) (``train(model, loader, criterion, device)``), and there
    the parameter is only ever called (``criterion(logits, y)``): the call delivers the object, it does not place it
    (no ``.to()``, not stored, not passed on)."""
    callees = facts.callee_scopes(call)
    if not callees:
        return False
    for function in callees:
        if not isinstance(function.node, cst.FunctionDef):
            return False
        parameters = function.node.params
        names = {
            param.name.value
            for param in (*parameters.posonly_params, *parameters.params, *parameters.kwonly_params)
            if name_key(facts.argument_for(call, function, param)) == key
        }
        if not names:
            return False
        up = parents(facts, function.node)
        for name in names:
            for _order, load, scope in facts.name_loads.get(name, ()):
                if id(load) not in up:
                    continue  # another function's name
                parent = up.get(id(load))
                if not (isinstance(parent, cst.Call) and parent.func is load):
                    return False
    return True


def _returned_on_accelerator(facts: FileFacts, call: cst.Call, path: tuple[int, ...], depth: int) -> Optional[cst.CSTNode]:
    """What the file's own helper returns (the element at ``path`` of a returned tuple) is on an accelerator on
    every ``return`` of it; None when one return is not shown to be, or a return's shape does not fit ``path``."""
    return facts.every_return(
        facts.call_site(call), lambda value, order, scope, _callee: on_accelerator(facts, value, order, scope, depth + 1), path
    )


def accelerator_device(facts: FileFacts, node: Optional[cst.CSTNode], order: int, scope: Scope, depth: int = 0) -> bool:
    """``"cuda:0"``, ``torch.device("cuda")``, ``"cuda" if torch.cuda.is_available() else "cpu"`` (the
    branch taken on a machine with a GPU), a name bound to one, ``x.device`` of a tensor on an accelerator."""
    if node is None or depth > 24:
        return False
    text = string_value(node)
    if text is not None:
        return text.split(":")[0] in _ACCELERATORS
    if isinstance(node, cst.IfExp):
        return accelerator_device(facts, node.body, order, scope, depth + 1)
    if isinstance(node, cst.Call) and facts.qualname(node.func) == "torch.device":
        return accelerator_device(facts, call_arg(node, 0, "type"), order, scope, depth + 1)
    if isinstance(node, cst.Attribute) and node.attr.value == "device":
        if on_accelerator(facts, node.value, order, scope, depth + 1) is not None:
            return True
        if not (name_key(node) or "").startswith("self.") and option_default_expression(facts, node, order, scope) is None:
            return False  # ``x.device`` of a tensor not shown on an accelerator (``args.device``, an option, is read below)
        # ``self.device``: an attribute of the file's object, bound like any name (``self.device = torch.device(...)``)
    # a name bound to one, a device handed in as a parameter (every call of the file passes one), a helper's return
    sources = device_sources(facts, node, order, scope)
    if not sources and isinstance(node, cst.Attribute) and facts.attribute_store(node, order, scope) is None:
        # ``args.device`` of ``add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")``
        default = option_default_expression(facts, node, order, scope)
        sources = [default] if default is not None else []
    return bool(sources) and all(accelerator_device(facts, *source, depth + 1) for source in sources)


def device_sources(facts: FileFacts, node: Optional[cst.CSTNode], order: int, scope: Scope) -> list:
    """(expression, order, scope) that a device expression stands for, one step back: the value of the name
    (``self.x`` too), what every call of the file passes for a parameter, what the file's own helper returns
    (``device = get_device()``); empty when none is shown."""
    if isinstance(node, cst.Call) and _own_function_call(facts, node):
        site = facts.call_site(node)
        return [(r.value, r.order, r.scope) for callee in facts.callee_scopes(site)
                for r in facts.returns.get(id(callee), ()) if r.value is not None]
    return facts.follow_name(node, order, scope, attributes=True) or []


# Wrappers whose forward moves (scatters) the inputs onto the devices of the wrapped module.
INPUT_MOVING_WRAPPERS = frozenset({"DataParallel", "DistributedDataParallel"})


def wrapper_moves_inputs(model) -> bool:
    """A wrapper (possibly under other values) that moves its inputs: DataParallel, DistributedDataParallel."""
    while model is not None:
        wrapper = str((model.traits or {}).get("wrapper") or "")
        if wrapper.split(".")[-1] in INPUT_MOVING_WRAPPERS:
            return True
        model = model.base
    return False


# ------------------------------------------------------------------------------------ modules without tensors

# ``torch.nn`` classes that hold no parameter and no buffer as built by default (torch 2.13; proven by
# tests/check/test_parameterless_modules.py with real torch): activations, dropouts, pooling, shape and
# distance modules and the losses. Such a module runs on its inputs' device; there is nothing to place.
PARAMETERLESS_MODULES = frozenset({
    # activations
    "ReLU", "ReLU6", "LeakyReLU", "ELU", "CELU", "SELU", "GELU", "SiLU", "Mish", "GLU", "Sigmoid", "Tanh", "Softmax",
    "Softmax2d", "Softmin", "LogSoftmax", "LogSigmoid", "Softplus", "Softsign", "Softshrink", "Hardshrink",
    "Hardsigmoid", "Hardswish", "Hardtanh", "Tanhshrink", "RReLU", "Threshold",
    # dropouts, identity, shapes, pooling, upsampling
    "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout", "Identity", "Flatten",
    "Unflatten", "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
    "Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d", "PixelShuffle", "PixelUnshuffle", "ZeroPad2d",
    "CosineSimilarity", "PairwiseDistance",
    # losses (the weighted ones only without a weight: see TENSOR_ARGUMENTS)
    "L1Loss", "MSELoss", "SmoothL1Loss", "HuberLoss", "KLDivLoss", "CrossEntropyLoss", "NLLLoss", "BCELoss",
    "BCEWithLogitsLoss", "CTCLoss", "PoissonNLLLoss", "GaussianNLLLoss", "CosineEmbeddingLoss", "MarginRankingLoss",
    "HingeEmbeddingLoss", "SoftMarginLoss", "MultiLabelMarginLoss", "MultiLabelSoftMarginLoss", "MultiMarginLoss",
    "TripletMarginLoss", "TripletMarginWithDistanceLoss",
})
# Weighted losses register their ``weight`` (and ``pos_weight``) as buffers when given one.
TENSOR_ARGUMENTS = {
    "CrossEntropyLoss": ("weight",), "NLLLoss": ("weight",), "BCELoss": ("weight",),
    "BCEWithLogitsLoss": ("weight", "pos_weight"), "MultiLabelSoftMarginLoss": ("weight",),
    "MultiMarginLoss": ("weight",),
}


def holds_no_tensors(facts: FileFacts, node: Optional[cst.CSTNode], order: int, scope: Scope) -> bool:
    """The module expression is built without parameters or buffers: a parameterless ``torch.nn`` module
    (``nn.CrossEntropyLoss()``, ``nn.ReLU()``), or an instance of the file's own ``nn.Module`` class that stores
    only such modules and plain values (``CombineLoss()`` holding ``FocalLoss()`` and ``nn.BCEWithLogitsLoss()``),
    directly or through a name bound to one: nothing of it is on any device."""
    built = facts.built_by(node, order, scope)
    return isinstance(built, cst.Call) and _built_without_tensors(facts, built)


def _built_without_tensors(facts: FileFacts, built: cst.Call, depth: int = 0) -> bool:
    parts = (facts.qualname(built.func) or "").split(".")
    if parts[:2] == ["torch", "nn"] and parts[-1] in PARAMETERLESS_MODULES:
        return not given_tensor_argument(built, parts[-1])
    class_name = name_key(built.func)
    return class_name is not None and _class_holds_no_tensors(facts, class_name, depth)


_PLAIN_NN_BASES = frozenset({"torch.nn.Module", "torch.nn.modules.Module", "torch.nn.modules.module.Module"})
_TENSOR_HOLDERS = frozenset({"Parameter", "register_buffer", "register_parameter", "ParameterList", "ParameterDict"})


def _class_holds_no_tensors(facts: FileFacts, class_name: str, depth: int = 0) -> bool:
    """The file's ``nn.Module`` class (bases ``nn.Module`` or such classes of the file) whose methods store on
    ``self`` only literals, parameters with a literal default, and modules built without tensors; no
    ``nn.Parameter``/``register_buffer`` anywhere in it."""
    cache = facts.__dict__.setdefault("_class_holds_no_tensors", {})  # each class body walked once per file and depth
    key = (class_name, depth)
    if key not in cache:
        cache[key] = _decide_class_holds_no_tensors(facts, class_name, depth)
    return cache[key]


def _decide_class_holds_no_tensors(facts: FileFacts, class_name: str, depth: int) -> bool:
    scope = facts.classes.get(class_name)
    if depth > 3 or scope is None or not isinstance(scope.node, cst.ClassDef) or not facts.is_module_class(class_name):
        return False
    for base in scope.node.bases:
        local = name_key(base.value)
        if facts.qualname(base.value) not in _PLAIN_NN_BASES and not (
            local in facts.classes and local != class_name and _class_holds_no_tensors(facts, local, depth + 1)
        ):
            return False
    stores = _SelfStores()
    scope.node.visit(stores)
    if stores.holds_tensor_api:
        return False
    for value, function in stores.values:
        if _literal_number(value) or string_value(value) is not None or _constant_name(value):
            continue
        if isinstance(value, cst.Name) and _literal_default(function, value.value):
            continue
        if isinstance(value, cst.Call) and _built_without_tensors(facts, value, depth + 1):
            continue
        return False
    return True


class _SelfStores(cst.CSTVisitor):
    """Every ``self.x = value`` in a class body (with its method), and whether it names a tensor-holding API."""

    def __init__(self) -> None:
        self.values: list[tuple[cst.BaseExpression, Optional[cst.FunctionDef]]] = []
        self.holds_tensor_api = False
        self._functions: list[cst.FunctionDef] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._functions.append(node)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self._functions.pop()

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            if isinstance(target.target, cst.Attribute) and name_key(target.target.value) == "self":
                self.values.append((node.value, self._functions[-1] if self._functions else None))

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if isinstance(node.target, cst.Attribute) and name_key(node.target.value) == "self" and node.value is not None:
            self.values.append((node.value, self._functions[-1] if self._functions else None))

    def visit_Name(self, node: cst.Name) -> None:
        if node.value in _TENSOR_HOLDERS:
            self.holds_tensor_api = True

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value in _TENSOR_HOLDERS:
            self.holds_tensor_api = True


def _literal_default(function: Optional[cst.FunctionDef], name: str) -> bool:
    """``def __init__(self, gamma=2)``: the parameter ``name`` of ``function`` has a literal default."""
    if function is None:
        return False
    for param in (*function.params.params, *function.params.kwonly_params):
        if param.name.value == name:
            default = param.default
            return default is not None and (
                _literal_number(default) or string_value(default) is not None or _constant_name(default)
            )
    return False


def given_tensor_argument(call: cst.Call, class_name: str) -> bool:
    """``nn.CrossEntropyLoss(weight=w)`` / ``nn.BCEWithLogitsLoss(pos_weight=p)``: a parameterless ``torch.nn``
    class (``class_name``) built with a tensor it registers as a buffer, so the module does hold a tensor."""
    tensor_keywords = TENSOR_ARGUMENTS.get(class_name)
    if not tensor_keywords:
        return False
    for arg in call.args:
        if arg.star:
            return True  # ``**loss_kwargs``: may carry a weight
        if arg.keyword is None:
            if not (_literal_number(arg.value) or string_value(arg.value) is not None or _constant_name(arg.value)):
                return True  # ``nn.CrossEntropyLoss(class_weights)``: the first positional is the weight
        elif arg.keyword.value in tensor_keywords and not _constant_name(arg.value):
            return True
    return False


def _constant_name(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.Name) and node.value in ("None", "True", "False")


# Builtins/tqdm that hand the items of their first argument through unchanged.
_PASS_ITEMS = {"tqdm", "iter", "list", "tuple", "sorted", "reversed"}


def loop_item_source(facts: FileFacts, iterable, path: tuple[int, ...], order: int, scope: Scope, depth: int = 0):
    """(the collection, the path inside one of its items, where it is read) for a loop iterable and the path of a
    loop target inside its item:
    ``enumerate(loader)`` at (1, 0) -> (loader, (0,)); ``zip(a, b)`` at (0, 1) -> (a, (1,)); names bound to
    ``iter(loader)`` / ``tqdm(loader)`` are followed."""
    while depth < 8:
        depth += 1
        if isinstance(iterable, cst.Name):
            binding = facts.binding_at(iterable.value, order, scope)
            if binding is not None and binding.kind == "assign" and isinstance(binding.value, cst.Call):
                name = (facts.qualname(binding.value.func) or name_key(binding.value.func) or "").split(".")[-1]
                if name in _PASS_ITEMS | {"enumerate", "zip"}:
                    iterable, order, scope = binding.value, binding.order, binding.scope
                    continue
            return iterable, path, order, scope
        if not isinstance(iterable, cst.Call):
            return None
        name = (facts.qualname(iterable.func) or name_key(iterable.func) or "").split(".")[-1]
        args = [a.value for a in iterable.args if a.keyword is None and not a.star]
        if name not in _PASS_ITEMS | {"enumerate", "zip"}:
            relayed = _relayed_by_generator(facts, iterable)
            if relayed is not None:  # ``for x, y in batches(loader)``: the file's generator yields its items
                iterable, order, scope = relayed
                continue
            return iterable, path, order, scope  # ``for x, y in DataLoader(...)``
        if not args or facts.binding_at(name, order, scope) is not None:
            return None  # a function of the file's own that happens to share the name
        if name == "enumerate":
            if not path or path[0] != 1:
                return None
            iterable, path = args[0], path[1:]
        elif name == "zip":
            if not path or path[0] >= len(args):
                return None
            iterable, path = args[path[0]], path[1:]
        else:
            iterable = args[0]
    return None


def _relayed_by_generator(facts: FileFacts, call: cst.Call) -> Optional[tuple[cst.BaseExpression, int, Scope]]:
    """(what it iterates, where) when ``call`` runs a generator of the file that yields each item of one loop
    unchanged (``def batches(it): for item in it: yield item``), read through this call's argument for its
    parameter; None for anything else (a generator that builds or changes its items)."""
    site = facts.call_site(call)
    callees = facts.callee_scopes(site) if site is not None and site.qualname is None else []
    if len(callees) != 1:
        return None
    callee = callees[0]
    yielded = facts.yields.get(id(callee), ())
    if len(yielded) != 1 or yielded[0].kind == "yield from" or not isinstance(yielded[0].value, cst.Name):
        return None
    loops = [loop for loop in facts.loops if loop.scope is callee and loop.order < yielded[0].order < loop.end_order]
    if len(loops) != 1 or loops[0].iter is None or not isinstance(loops[0].node.target, cst.Name):
        return None
    loop = loops[0]
    if loop.node.target.value != yielded[0].value.value:
        return None
    key = name_key(loop.iter)
    binding = facts.binding_at(key, loop.order, callee) if key is not None else None
    if binding is not None and binding.kind == "param" and isinstance(binding.target, cst.Param):
        argument = facts.argument_for(site, callee, binding.target)
        return (argument, site.order, site.scope) if argument is not None else None
    return loop.iter, loop.order, callee
