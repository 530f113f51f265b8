from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import FileFacts, Scope, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.placement._common import parents

_NOT_IN_PLACE = {"to", "cuda", "cpu", "half", "float", "double", "bfloat16", "long", "int", "bool", "type", "pin_memory"}


class TensorToResultDiscarded(Rule):
    """``x.to(device)`` / ``x.cuda()`` as a statement on a tensor: ``Tensor.to`` returns a new tensor and
    leaves ``x`` where it was (unlike ``nn.Module.to`` and ``BatchEncoding.to``, which work in place).
    Only reported when the receiver is known to be a tensor (the facts' lattice: a ``torch.*`` result, an
    item of a ``DataLoader`` batch whatever the collate function, a tokenizer's or model's output, arithmetic
    and views of those); never a module, a batch itself (a ``BatchEncoding`` moves in place) or an unknown."""

    code = "GD605"
    name = "tensor-to-result-discarded"
    summary = "tensor.to(...)/.cuda() used as a statement: the result is discarded, the tensor does not move"
    severity = Severity.WARNING
    triggers = (".to(", ".cuda(", ".cpu(", ".half(", ".float(")

    def check(self, facts: FileFacts):
        for site in facts.calls:
            if not site.statement or site.method not in _NOT_IN_PLACE or site.receiver is None:
                continue
            why = self._tensor_evidence(facts, site.receiver, site.order, site.scope)
            if why is None:
                why = self._loop_item_used_as_tensor(facts, site) or self._made_by_tensor_method(facts, site)
            if why is None:
                continue
            if facts.value(site.receiver, site.order, site.scope).kind == "model":
                continue
            target = snippet(facts, site.receiver, 40)
            key = name_key(site.receiver)
            use = facts.next_use(key, site.order, site.scope) if key is not None else None
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node, 60)}` discards its result: `{target}` is a tensor ({why}), and "
                f"`Tensor.{site.method}()` returns a new tensor instead of changing it in place (only `nn.Module` "
                f"moves itself). `{target}` stays where it was, which surfaces later as \"Expected all tensors to be "
                "on the same device\" or as work silently done on the CPU.",
                fix_hint=f"Assign the result: `{target} = {snippet(facts, site.node, 60)}`.",
                related=((use, f"`{target}` is used here, still where it was"),) if use is not None else (),
            )

    def _loop_item_used_as_tensor(self, facts: FileFacts, site) -> Optional[str]:
        """A loop item (``for x, y in loader`` / ``x, y = next(it)``) of an unknown iterable that the same loop
        body then hands to a loss module (whose arguments are tensors), or, when it is an unpacked part of the
        item, as the first positional argument to a model: ``x.to(device)`` ... ``model(x)``. A whole item
        passed to a model may be a ``BatchEncoding`` (moved in place) and is not counted."""
        receiver = site.receiver
        if not isinstance(receiver, cst.Name):
            return None
        binding = facts.binding_at(receiver.value, site.order, site.scope)
        if binding is None or binding.kind not in ("for", "unpack"):
            return None
        if binding.kind == "unpack" and not (
            isinstance(binding.value, cst.Call) and isinstance(binding.value.func, cst.Name)
            and binding.value.func.value == "next"
        ):
            return None
        part = self._part_of_item(binding)
        loop_end = self._loop_end(facts, binding)
        for call in facts.calls:
            if call.scope is not site.scope or not site.order < call.order < loop_end:
                continue
            positions = [
                i for i, a in enumerate(a for a in call.node.args if a.keyword is None and not a.star)
                if isinstance(a.value, cst.Name) and a.value.value == receiver.value
            ]
            if not positions or facts.binding_at(receiver.value, call.order, call.scope) is not binding:
                continue
            kind = _callee_kind(facts, call)
            if kind == "loss":
                return f"a loop item passed to the loss `{snippet(facts, call.node.func, 30)}`"
            if kind == "model" and part and positions[0] == 0:
                return f"a part of a loop item passed to the model `{snippet(facts, call.node.func, 30)}`"
        return None

    @staticmethod
    def _made_by_tensor_method(facts: FileFacts, site) -> Optional[str]:
        """``img = tfms(image).unsqueeze(0)``: a name bound to the result of a method only tensors have
        (numpy arrays, modules and encodings have no ``unsqueeze``/``permute``)."""
        receiver = site.receiver
        if not isinstance(receiver, cst.Name):
            return None
        binding = facts.binding_at(receiver.value, site.order, site.scope)
        value = binding.value if binding is not None and binding.kind == "assign" else None
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value in _TENSOR_ONLY_METHODS:
            return f"made by `.{value.func.attr.value}()`, a method only tensors have"
        return None

    @staticmethod
    def _part_of_item(binding) -> bool:
        """``for x, y in loader`` binds parts of one item; ``for i, batch in enumerate(loader)`` and ``for a, b
        in zip(xs, ys)`` bind whole items."""
        path, iterable = binding.path, binding.value
        if binding.kind == "unpack" and isinstance(iterable, cst.Call) and iterable.args:
            iterable = iterable.args[0].value  # next(it)
        while path and isinstance(iterable, cst.Call) and isinstance(iterable.func, cst.Name):
            name = iterable.func.value
            args = [a.value for a in iterable.args if a.keyword is None and not a.star]
            if name in ("enumerate", "zip") and args:
                index = 0 if name == "enumerate" else path[0]
                if name == "enumerate" and path[0] != 1 or index >= len(args):
                    return True
                iterable, path = args[index], path[1:]
            elif name in ("tqdm", "iter", "list", "tuple", "sorted", "reversed") and args:
                iterable = args[0]
            else:
                break
        return bool(path)

    @staticmethod
    def _loop_end(facts: FileFacts, binding) -> int:
        if binding.kind == "for":
            for loop in facts.loops:
                if loop.order <= binding.order and loop.scope is binding.scope and loop.iter is binding.value:
                    return loop.end_order
        ends = [loop.end_order for loop in facts.loops if loop.scope is binding.scope and loop.order < binding.order < loop.end_order]
        return min(ends) if ends else 1 << 60

    def _tensor_evidence(self, facts: FileFacts, node: cst.CSTNode, order: int, scope: Scope) -> Optional[str]:
        """Why ``node`` is a tensor (from the facts' lattice), or None when it may be anything else."""
        value = facts.value(node, order, scope)
        if value.kind != "tensor":
            return None
        while value is not None:
            item_of = value.traits.get("batch_item")
            if item_of is not None:
                loader = item_of.traits.get("loader")
                if loader is not None and loader.node is not None:
                    return f"an item of a batch from `{snippet(facts, loader.node, 30)}`"
                return "an item of a batch"
            if value.traits.get("created"):
                return f"made by `{value.traits['created']}`"
            if value.traits.get("output") is not None:
                return "part of a model's or tokenizer's output"
            if value.traits.get("parameter") is not None:
                return "a module's parameter"
            value = value.base
        return "a tensor"


_TENSOR_ONLY_METHODS = {"unsqueeze", "permute"}
_MODEL_METHODS = {"eval", "train", "parameters", "named_parameters", "state_dict", "zero_grad"}


def _callee_kind(facts: FileFacts, call) -> Optional[str]:
    """"loss" for a loss module, "model" for a torch/transformers model (or a parameter the function calls
    ``.eval()``/``.train()``/``.parameters()`` on), None otherwise (the file's own modules whose ``forward``
    reads its input as a mapping are not counted)."""
    func = call.node.func
    if call.qualname in _FUNCTIONAL_LOSSES:
        return "loss"
    value = facts.value(func, call.order, call.scope)
    if value.kind == "model":
        cls = str(value.trait("class") or "")
        if cls.endswith("Loss"):
            return "loss"
        if cls in facts.classes:
            return "model" if _forward_takes_tensor(facts, cls) else None
        return "model"
    if value.kind != "unknown" or not isinstance(func, cst.Name):
        return None
    binding = facts.binding_at(func.value, call.order, call.scope)
    if binding is None or binding.kind != "param":
        return None
    for other in facts.calls:
        if other.scope is not call.scope or other.method not in _MODEL_METHODS:
            continue
        root = facts.through_temporary(other.receiver)
        while isinstance(root, cst.Call) and isinstance(root.func, cst.Attribute):
            root = facts.through_temporary(root.func.value)  # model.to(device).eval()
        if isinstance(root, cst.Name) and root.value == func.value:
            return "model"
    if _output_to_loss(facts, call):
        return "model"  # ``criterion(model(x), y)``: a handed-in callable whose output a loss module takes
    return None


def _output_to_loss(facts: FileFacts, call) -> bool:
    """The call's result is an argument of a loss module's call, directly (``criterion(model(x), y)``) or
    through the name it is bound to (``out = model(x)`` ... ``criterion(out, y)``)."""
    up = parents(facts, call.scope.node)
    parent = up.get(id(call.node))
    if isinstance(parent, cst.Arg):
        outer = facts.call_site(up.get(id(parent)))
        return outer is not None and outer is not call and _loss_call(facts, outer)
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0].target, cst.Name):
        key = parent.targets[0].target.value
        for other in facts.calls:
            if other.scope is call.scope and other.order > call.order and _loss_call(facts, other) and any(
                isinstance(a.value, cst.Name) and a.value.value == key
                and getattr(facts.binding_at(key, other.order, other.scope), "value", None) is call.node
                for a in other.node.args
            ):
                return True
    return False


def _loss_call(facts: FileFacts, call) -> bool:
    if call.qualname in _FUNCTIONAL_LOSSES:
        return True
    value = facts.value(call.node.func, call.order, call.scope)
    return value.kind == "model" and str(value.trait("class") or "").endswith("Loss")


# torch.nn.functional losses: every positional input is a tensor.
_FUNCTIONAL_LOSSES = {f"torch.nn.functional.{name}" for name in (
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "kl_div", "cosine_embedding_loss", "margin_ranking_loss",
    "multilabel_soft_margin_loss", "soft_margin_loss", "triplet_margin_loss", "poisson_nll_loss",
)}


def _forward_takes_tensor(facts: FileFacts, class_name: str) -> bool:
    """The class's ``forward`` does not read its first input as a mapping or an object (``x["ids"]``,
    ``x.input_ids``, ``**x``)."""
    for scope in facts.functions:
        if scope.class_name != class_name or scope.name != "forward" or not isinstance(scope.node, cst.FunctionDef):
            continue
        params = [*scope.node.params.posonly_params, *scope.node.params.params][1:]
        if not params:
            return False
        name = params[0].name.value
        for node in _walk(scope.node.body):
            if isinstance(node, cst.Subscript) and isinstance(node.value, cst.Name) and node.value.value == name:
                index = node.slice[0].slice if node.slice else None
                if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
                    return False
            if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == name:
                if node.attr.value not in ("shape", "size", "device", "dtype", "view", "reshape", "to", "float",
                                           "long", "unsqueeze", "squeeze", "flatten", "permute", "transpose"):
                    return False
            if isinstance(node, cst.Arg) and node.star == "**" and isinstance(node.value, cst.Name) and node.value.value == name:
                return False
        return True
    return False


def _walk(node: cst.CSTNode):
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(current.children)
