"""Questions the memory rules (GD5xx) share: which calls run a model forward, whether autograd records
them, whether a loop trains (calls backward), whether a value is a graph-carrying tensor."""

from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import CallSite, FileFacts, FunctionFrame, LoopFrame, Scope, WithFrame, call_arg, name_key

_MODEL_NAME = re.compile(r"(^|[._])\w*(model|net|network)$", re.IGNORECASE)
EVAL_FUNCTION = re.compile(
    r"(^|_)(eval|evaluate|evaluation|validate|validation|valid|val|predict|prediction|predictions|infer|inference)(_|$)",
    re.IGNORECASE,
)
# Tensor methods that drop the autograd history (or leave Python numbers).
DETACHING = {"item", "detach", "detach_", "tolist", "numpy"}
LOSS_FUNCTIONS = re.compile(
    r"^torch\.nn\.functional\.(cross_entropy|nll_loss|mse_loss|l1_loss|smooth_l1_loss|huber_loss|kl_div|"
    r"binary_cross_entropy|binary_cross_entropy_with_logits)$|^torch\.nn\.\w+Loss$"
)
_LOSS_NAME = re.compile(r"(^|[._])(criterion|loss_fn|loss_func|loss_function|lossfn|compute_loss|loss_fct)$", re.IGNORECASE)


def forward_target(facts: FileFacts, site: CallSite) -> Optional[cst.BaseExpression]:
    """``model(...)`` / ``self.model(...)`` / ``model.forward(...)``: the model expression, else None."""
    func = site.node.func
    if isinstance(func, cst.Attribute) and func.attr.value == "forward":
        func = func.value
    key = name_key(func)
    if key is None or site.qualname is not None:
        return None
    if facts.value(func, site.order, site.scope).kind == "model" or _MODEL_NAME.search(key):
        return func
    if _mode_switched(facts, key, site) or _result_backpropagated(facts, site):
        return func
    return None


def _result_backpropagated(facts: FileFacts, site: CallSite) -> bool:
    """``out = f(**batch)`` then ``out.loss.backward()`` (or ``out.backward()``, ``accelerator.backward(out[0])``)
    in the same function: the call's result carries an autograd graph, so the call is a forward pass, whatever
    ``f`` is named."""
    for binding in facts._bindings_of_value(site.node):
        if binding.kind != "assign" or binding.scope is not site.scope:
            continue
        for call in facts.method_calls("backward"):
            if call.scope is not site.scope or call.order <= binding.order:
                continue
            for read in (call.receiver, *(a.value for a in call.node.args)):
                root = read
                while isinstance(root, (cst.Attribute, cst.Subscript)):
                    root = root.value
                if name_key(root) == binding.key and facts.binding_at(binding.key, call.order, call.scope) is binding:
                    return True
    return False


def _mode_switched(facts: FileFacts, key: str, site: CallSite) -> bool:
    """``encoder.eval()`` earlier in the same function, then ``encoder(imgs)``: an object with a mode switch
    that is called is an ``nn.Module``, whatever its name."""
    for call in facts._calls_on_key.get(key, ()):
        if call.scope is site.scope and call.order < site.order and call.method in ("eval", "train") and not call.node.args:
            return True
    return False


def grad_disabled(facts: FileFacts, context: tuple) -> bool:
    """Under ``torch.no_grad()``/``inference_mode()``/``set_grad_enabled(False)``, as a block or decorator."""
    if facts.under_no_grad(context):
        return True
    for frame in context:
        if isinstance(frame, WithFrame) and frame.qualname in ("torch.set_grad_enabled", "torch.autograd.set_grad_enabled"):
            call = frame.item.item
            if isinstance(call, cst.Call):
                arg = call_arg(call, 0, "mode")
                if isinstance(arg, cst.Name) and arg.value == "False":
                    return True
        if isinstance(frame, FunctionFrame):
            for decorator in frame.scope.decorators:
                if decorator.endswith(("no_grad", "inference_mode")):
                    return True
    return False


def grad_switched_off_before(facts: FileFacts, scope: Scope, order: int) -> bool:
    """``torch.set_grad_enabled(False)`` (a statement) earlier in this scope or the module."""
    for site in facts.calls_to("torch.set_grad_enabled", "torch.autograd.set_grad_enabled"):
        if site.order < order and (site.scope is scope or site.scope.kind == "module"):
            arg = site.arg(0, "mode")
            if isinstance(arg, cst.Name) and arg.value == "False":
                return True
    return False


def trains_between(facts: FileFacts, start: int, end: int, scope: Optional[Scope] = None) -> bool:
    """A ``backward``/``autograd.grad``/optimizer ``step`` call with an order in [start, end]."""
    for site in facts.calls:
        if not (start <= site.order <= end):
            continue
        if scope is not None and site.scope is not scope and not _inside(site.scope, scope):
            continue
        if site.method == "backward" or site.qualname in ("torch.autograd.grad", "torch.autograd.backward"):
            return True
        if site.method == "step" and site.receiver is not None:
            text = facts.module.code_for_node(site.receiver).lower()
            if "opt" in text or facts.value(site.receiver, site.order, site.scope).kind == "optimizer":
                return True
    return False


def _inside(inner: Scope, outer: Scope) -> bool:
    scope = inner.parent
    while scope is not None:
        if scope is outer:
            return True
        scope = scope.parent
    return False


def function_frame(context: tuple) -> Optional[FunctionFrame]:
    for frame in reversed(context):
        if isinstance(frame, FunctionFrame):
            return frame
    return None


def loops_in_function(context: tuple) -> list[LoopFrame]:
    """The loops around a call inside its own function (outermost first)."""
    loops: list[LoopFrame] = []
    for frame in context:
        if isinstance(frame, FunctionFrame):
            loops = []
        elif isinstance(frame, LoopFrame):
            loops.append(frame)
    return loops


def scope_span(facts: FileFacts, scope: Scope) -> tuple[int, int]:
    """Orders covered by a function scope (first and last call/binding seen in it)."""
    orders = [s.order for s in facts.calls if s.scope is scope or _inside(s.scope, scope)]
    for bindings in scope.bindings.values():
        orders += [b.order for b in bindings]
    return (min(orders), max(orders)) if orders else (0, 0)


def is_loss_call(facts: FileFacts, call: cst.Call) -> bool:
    q = facts.qualname(call.func)
    if q and LOSS_FUNCTIONS.match(q):
        # ``F.cross_entropy(...)`` computes a loss; ``nn.CrossEntropyLoss(weight=w)`` only builds the module
        return not q.endswith("Loss")
    key = name_key(call.func)
    if key is None:
        return False
    if _LOSS_NAME.search(key):
        return True
    site = facts.call_site(call)
    if site is not None:
        binding = facts.binding_at(key, site.order, site.scope)
        if binding is not None and isinstance(binding.value, cst.Call):
            inner = facts.qualname(binding.value.func)
            return bool(inner and LOSS_FUNCTIONS.match(inner))
    return False


# ``torch.<f>(x, ...)`` functions whose result carries ``x``'s autograd history.
_GRAPH_KEEPING_FUNCTIONS = {"mean", "sum", "exp", "log", "logsumexp", "abs", "neg", "sqrt", "pow", "squeeze",
                            "flatten", "clamp", "norm", "square", "sigmoid", "tanh"}


def graph_tensor(facts: FileFacts, node: Optional[cst.BaseExpression], order: int, scope: Scope, depth: int = 0) -> Optional[str]:
    """What ``node`` is when it is a tensor that carries autograd history from a model or a loss:
    "loss" (``outputs.loss``, ``criterion(...)``), "logits" (``outputs.logits``, other outputs),
    "output" (``model(...)``); None when it is detached or unknown."""
    if node is None or depth > 6:
        return None
    if isinstance(node, cst.BinaryOperation):
        return graph_tensor(facts, node.left, order, scope, depth + 1) or graph_tensor(facts, node.right, order, scope, depth + 1)
    if isinstance(node, cst.Call):
        func = node.func
        if isinstance(func, cst.Attribute) and func.attr.value in DETACHING:
            return None
        if isinstance(func, cst.Name) and func.value in ("float", "int", "len", "sum", "list", "round"):
            return None
        q = facts.qualname(func) or ""
        if q.startswith("torch.") and q.split(".")[-1] in _GRAPH_KEEPING_FUNCTIONS and node.args:
            return graph_tensor(facts, node.args[0].value, order, scope, depth + 1)  # ``torch.mean(log_likelihood)``
        if isinstance(func, cst.Attribute) and func.attr.value in ("cpu", "to", "mean", "sum", "float", "cuda", "squeeze", "view"):
            return graph_tensor(facts, func.value, order, scope, depth + 1)
        if is_loss_call(facts, node):
            return "loss"
        site = facts.call_site(node)
        if site is not None and forward_target(facts, site) is not None:
            return "output"
        return None
    if isinstance(node, cst.Attribute):
        if node.attr.value == "data":
            return None
        base = graph_tensor(facts, node.value, order, scope, depth + 1)
        if base == "output":
            return "loss" if node.attr.value == "loss" else "logits"
        return None
    if isinstance(node, cst.Subscript):
        base = graph_tensor(facts, node.value, order, scope, depth + 1)
        if base == "output":
            index = node.slice[0].slice if len(node.slice) == 1 else None
            from gpudoctor.check.facts import string_value

            if isinstance(index, cst.Index) and (string_value(index.value) == "loss"):
                return "loss"
            return "logits"
        return base
    binding = facts.assignment_of(node, order, scope)
    if binding is None:
        key = name_key(node)
        updated = facts.binding_at(key, order, scope) if key is not None else None
        if updated is not None and updated.kind == "augassign":
            # ``loss += reg``: the earlier value plus the added term
            update = next((a for a in facts.aug_assigns if a.node.target is updated.target), None)
            before = facts.binding_at(key, updated.order - 1, updated.scope)
            earlier = graph_tensor(facts, node, updated.order - 1, updated.scope, depth + 1) if before is not updated else None
            added = graph_tensor(facts, update.node.value, update.order, update.scope, depth + 1) if update else None
            return earlier or added
        return None
    return graph_tensor(facts, binding.value, binding.order, binding.scope, depth + 1)


def torch_no_grad_expr(facts: FileFacts) -> Optional[cst.BaseExpression]:
    """``torch.no_grad`` spelled with the file's own import (``torch``, ``import torch as th``, ``from torch import no_grad``)."""
    for local, full in facts.imports.items():
        if apis.canonical(full) == "torch.no_grad":
            return cst.Name(local)
    for local, full in facts.imports.items():
        if full == "torch":
            return cst.Attribute(value=cst.Name(local), attr=cst.Name("no_grad"))
    return None


def called_without_grad(facts: FileFacts, context: tuple) -> bool:
    """The enclosing function is called somewhere under no_grad (then whether grad is on is unknown)."""
    frame = function_frame(context)
    if frame is None:
        return False
    name = frame.scope.name
    for site in facts.calls:
        func = site.node.func
        if (isinstance(func, cst.Name) and func.value == name) or (isinstance(func, cst.Attribute) and func.attr.value == name):
            if grad_disabled(facts, site.context):
                return True
    return False


def computed_at(facts: FileFacts, expr: cst.BaseExpression, site, what: str) -> tuple:
    """Related location: the assignment that computes the tensor a name holds (none for an expression written in place)."""
    held = facts.assignment_of(expr, site.order, site.scope) if isinstance(expr, (cst.Name, cst.Attribute)) else None
    return ((held.value, what),) if held is not None and held.value is not None else ()
