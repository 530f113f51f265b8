from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import CallSite, FileFacts, call_arg, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.placement._common import (
    PLACING_METHODS,
    TENSOR_ARGUMENTS,
    accelerator_device,
    cpu_computed,
    holds_no_tensors,
    module_classes,
    moves_to_accelerator,
    on_accelerator,
    only_called_in_callee,
    placement,
)


class SecondModelInputsElsewhere(Rule):
    """A second model (reference, reward, teacher) that was loaded and never placed (no ``device_map``,
    no ``.to()``, not handed to a Trainer/``prepare``/helper) is called with inputs that were moved for
    the first model (``batch.to(model.device)``, ``.to("cuda")``): the inputs are on the accelerator,
    its weights on the CPU. ``generate`` is not reported (it moves CPU inputs; a plain forward does not), nor
    is a module without parameters or buffers (``nn.CrossEntropyLoss()``, ``nn.ReLU()``)."""

    code = "GD609"
    name = "second-model-inputs-elsewhere"
    summary = "A second model (reference/teacher/reward) left on the CPU is fed inputs placed for the first"
    severity = Severity.ERROR
    triggers = (".to(", ".cuda(", "compute_loss")

    def check(self, facts: FileFacts):
        evidence = moves_to_accelerator(facts)
        for site in facts.calls:
            b_key = name_key(site.node.func)
            if b_key is None or facts.value(site.node.func, site.order, site.scope).kind != "model":
                continue
            if placement(facts, site.node.func, site.order, site.scope) != "unplaced":
                continue
            if b_key.startswith("self.") and site.scope.class_name in module_classes(facts):
                continue  # a submodule of an nn.Module: ``.to()`` of the enclosing module places it
            if self._handed_over(facts, b_key, site):
                continue
            if holds_no_tensors(facts, site.node.func, site.order, site.scope) or self._weights_placed(facts, site):
                continue  # ``criterion = nn.CrossEntropyLoss()``: no weights, it runs where its inputs are
            for arg in site.node.args:
                moved = self._moved_input(facts, arg.value, site)
                if moved is None:  # ``torch.tensor(obs, device=device)``, ``torch.cat`` of such tensors from a replay memory
                    placed = on_accelerator(facts, arg.value, site.order, site.scope)
                    moved = (placed, None) if placed is not None else None
                if moved is None:
                    continue
                move_call, target_model = moved
                if target_model == b_key:
                    continue
                placed_for = f" for `{target_model}`" if target_model else ""
                by_trainer = isinstance(move_call, cst.Param)  # ``compute_loss``'s batch: the trainer moved it
                if by_trainer and _torch_module(facts, site):
                    break  # a weighted ``nn.CrossEntropyLoss(weight=cpu_tensor)`` in ``compute_loss``: GD604 reports it
                severity = Severity.ERROR if evidence or target_model or by_trainer else Severity.WARNING
                mover = (
                    "the trainer moves to its device before it calls `compute_loss`" if by_trainer
                    else f"`{snippet(facts, move_call, 50)}` put on the device{placed_for}"
                )
                yield self.report(
                    site.node,
                    f"`{b_key}` is never placed (loaded on the CPU, not moved, not given a device map), but it is called "
                    f"with `{snippet(facts, arg.value, 30)}`, which {mover}; the forward mixes devices: \"Expected all "
                    "tensors to be on the same device, but found at least two devices, cuda:0 and cpu!\"",
                    fix_hint=f"Place `{b_key}` too (`{b_key}.to(device)`, `device_map=`, or pass it to the trainer / "
                    "`accelerator.prepare`), or send its own inputs to its device.",
                    severity=severity,
                    related=self._related(facts, site, move_call),
                )
                break

    @staticmethod
    def _related(facts: FileFacts, site: CallSite, move_call: cst.CSTNode) -> tuple:
        """Where its input is placed, and, for a model called through an attribute (``self.teacher``, stored from a
        constructor argument), where it was loaded (``teacher = X.from_pretrained(...)``, followed through the
        attribute and the parameters it was handed through): the line a fix changes."""
        related = [(move_call, "its input is placed here")]
        if not (name_key(site.node.func) or "").startswith("self."):
            return tuple(related)
        built = facts.built_by(site.node.func, site.order, site.scope)
        if isinstance(built, cst.Call) and built is not site.node:
            related.append((built, "the model is loaded here and never placed"))
        return tuple(related)

    def _handed_over(self, facts: FileFacts, key: str, site: CallSite) -> bool:
        for call in facts.calls:
            if call is site:
                continue
            if any(name_key(a.value) == key for a in call.node.args) and not only_called_in_callee(facts, call, key):
                return True
            if call.method in PLACING_METHODS and name_key(call.receiver) == key:
                return True
        return False

    def _weights_placed(self, facts: FileFacts, site: CallSite) -> bool:
        """A weighted loss whose only tensors, its ``weight=``/``pos_weight=``, were built on a device
        (``nn.CrossEntropyLoss(weight=w.cuda())``) or may have been: a weight the file does not show made on the CPU
        (a parameter, an unknown helper's result) may be on the inputs' device, and then nothing mixes."""
        built = facts.built_by(site.node.func, site.order, site.scope)
        if not isinstance(built, cst.Call):
            return False
        name = (facts.qualname(built.func) or "").split(".")[-1]
        if name not in TENSOR_ARGUMENTS or not (facts.qualname(built.func) or "").startswith("torch.nn."):
            return False
        order, scope = facts._position_of(built)
        for arg in built.args:
            if arg.star:
                return False
            if arg.keyword is not None and arg.keyword.value not in TENSOR_ARGUMENTS[name]:
                continue  # ignore_index=, reduction=, label_smoothing=
            if isinstance(arg.value, (cst.Integer, cst.Float, cst.SimpleString)):
                continue  # MultiMarginLoss(1, 0.5, ...): the numbers before the weight
            weight = facts.built_by(arg.value, order, scope)
            on_device = isinstance(weight, cst.Call) and (
                (isinstance(weight.func, cst.Attribute) and weight.func.attr.value in PLACING_METHODS)
                or call_arg(weight, keyword="device") is not None
            )
            if not on_device and cpu_computed(facts, arg.value, order, scope) is not None:
                return False
        return True

    def _moved_input(self, facts: FileFacts, node, site: CallSite) -> Optional[tuple[cst.Call, Optional[str]]]:
        """(the .to call, the model whose device it targets) for an input moved to an accelerator."""
        call = node
        order, scope = site.order, site.scope
        for _ in range(4):  # through temporaries: ``tmp = x.to(...)``; ``inputs = tmp``
            while isinstance(call, cst.Subscript):
                call = call.value  # ``batch["input_ids"]`` of a batch moved as a whole
            if name_key(call) is None:
                break
            binding = facts.binding_at(name_key(call), order, scope)
            if binding is not None and binding.kind == "unpack" and isinstance(binding.value, cst.Tuple) and binding.path:
                element = _element(binding.value, binding.path)  # ``x, y = x.to(device), y.to(device)``
                if element is None:
                    return None
                call, order, scope = element, binding.order, binding.scope
                continue
            if binding is None or binding.kind != "assign":
                return None
            call, order, scope = binding.value, binding.order, binding.scope
            if isinstance(call, cst.DictComp):
                call = call.value  # ``{k: v.to(policy.device) for k, v in batch.items()}``
            elif isinstance(call, (cst.ListComp, cst.GeneratorExp)):
                call = call.elt
        if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute) and call.func.attr.value in ("to", "cuda")):
            return None
        if call.func.attr.value == "cuda":
            return call, None
        target = call.args[0].value if call.args else None
        if isinstance(target, cst.Attribute) and target.attr.value == "device":
            owner = name_key(target.value)
            if owner and facts.value(target.value, site.order, site.scope).kind == "model":
                if placement(facts, target.value, site.order, site.scope) in ("placed", "dispatched"):
                    return call, owner
                return None
            # not a model's device: ``args.device`` (an option whose default is "cuda"), ``x.device`` of a placed tensor
        from gpudoctor.check.facts import string_value

        text = string_value(target)
        if text and text.startswith("cuda"):
            return call, None
        if target is not None and accelerator_device(facts, target, order, scope):
            return call, None  # ``.to(device)`` with ``device = torch.device("cuda" if ... else "cpu")``, handed in
        return None


def _element(value: cst.BaseExpression, path: tuple[int, ...]) -> Optional[cst.BaseExpression]:
    """The element at ``path`` of nested tuple literals, or None when the shape does not fit."""
    for index in path:
        if not isinstance(value, cst.Tuple) or index >= len(value.elements) or isinstance(value.elements[index], cst.StarredElement):
            return None
        value = value.elements[index].value
    return value


def _torch_module(facts: FileFacts, site: CallSite) -> bool:
    """The called object is a ``torch.nn`` module built in the file (a loss, a layer), not a loaded model."""
    built = facts.built_by(site.node.func, site.order, site.scope)
    return isinstance(built, cst.Call) and (facts.qualname(built.func) or "").startswith("torch.nn.")
