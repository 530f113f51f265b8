from __future__ import annotations

from typing import Iterator, Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, IfFrame, LoopFrame, call_arg, name_key
from gpudoctor.check.facts.nodes import walk
from gpudoctor.check.queries import parameters_owner, snippet, trained_models
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import is_backward, parameters_held_by, trainer_trained

# Calls that take the model without adding or unfreezing parameters: an optimizer reads them, a wrapper scatters
# them, ``print``/``len`` look at them.
_INERT_TAKERS = {"print", "len", "str", "repr", "id", "type", "isinstance", "summary"}
_WRAPPERS = {"torch.nn.DataParallel", "torch.nn.parallel.DistributedDataParallel", "torch.compile"}
# Calls that only freeze: loralib's helper sets requires_grad=False on the non-LoRA weights and never sets True
# (microsoft/LoRA loralib/utils.py), so LoRA weights frozen before it stay frozen.
_FREEZE_ONLY = {"loralib.mark_only_lora_as_trainable", "loralib.utils.mark_only_lora_as_trainable"}
# Calls that only read the model's weights (the adapter state dict to save).
_READ_ONLY = {
    "loralib.lora_state_dict", "loralib.utils.lora_state_dict", "peft.get_peft_model_state_dict",
    "peft.utils.get_peft_model_state_dict",
}
# Methods of the model that return the model itself (or nothing) without new parameters.
_SAME_MODEL_METHODS = {"to", "cuda", "cpu", "train", "eval", "float", "half", "double", "bfloat16", "type"}
# Methods that only read the model (or run it) and add no parameter.
_READING_METHODS = _SAME_MODEL_METHODS | {
    "parameters", "named_parameters", "modules", "named_modules", "children", "named_children", "buffers",
    "state_dict", "zero_grad", "forward", "generate", "save_pretrained", "print_trainable_parameters",
    "gradient_checkpointing_enable", "gradient_checkpointing_disable", "enable_input_require_grads",
}


class AllParametersFrozen(Rule):
    """Every parameter of a model is frozen (``for p in model.parameters(): p.requires_grad = False`` with no
    condition, or ``model.requires_grad_(False)``) and nothing adds or unfreezes one afterwards, yet an optimizer
    is then built over that model's parameters and the file calls ``backward()``: the classic transfer-learning
    slip of replacing the head *before* the freeze loop, which freezes the new head too."""

    code = "GD422"
    name = "all-parameters-frozen"
    summary = "An optimizer trains a model whose parameters were all frozen (requires_grad=False) just before"
    triggers = ("requires_grad", "Peft", "prepare_model_for_kbit_training")

    def check(self, facts: FileFacts):
        if self._unfreezes_anything(facts):
            return
        backward = any(is_backward(facts, c) for c in facts.calls)
        yield from self._frozen_models_trained(facts, backward)
        if not backward:
            return
        for freeze_node, model, order, scope, assignment in self._freezes(facts):
            freeze_related = ((assignment, "every parameter is frozen here"),) if assignment is not None else ()
            key = name_key(model)
            if key is None:
                continue
            optimizer = self._optimizer_over(facts, key, order, scope)
            if optimizer is None:
                continue
            if self._model_changed(facts, key, order, 1 << 30, scope):
                continue  # also after the optimizer: a head attached later may get its own optimizer
            filtered = _filters_requires_grad(optimizer.arg(0, "params"))
            effect = (
                "the optimizer gets no parameter at all: \"ValueError: optimizer got an empty parameter list\""
                if filtered
                else "the optimizer holds only frozen parameters and updates nothing, and `backward()` of a loss "
                "computed through the model raises \"RuntimeError: element 0 of tensors does not require grad and does "
                "not have a grad_fn\""
            )
            yield self.report(
                freeze_node,
                f"This freezes every parameter of `{key}` and nothing adds or unfreezes one before "
                f"`{snippet(facts, optimizer.node, 50)}` trains it: {effect}. A head assigned before the freeze "
                "(`model.fc = nn.Linear(...)`) is frozen too.",
                fix_hint=f"Freeze first, then attach the new layers (`{key}.fc = nn.Linear(...)` after the loop), or "
                "set `requires_grad = True` on the layers to train.",
                related=((optimizer.node, "the optimizer is built over the frozen parameters here"), *freeze_related),
            )

    def _frozen_models_trained(self, facts: FileFacts, backward: bool):
        """A model whose value says every parameter is frozen (``PeftModel.from_pretrained`` without
        ``is_trainable=True``; ``prepare_model_for_kbit_training`` given the model with its adapters) handed to a
        Trainer that trains it, or to an optimizer in a file that calls ``backward()`` (``backward``)."""
        reported: set[int] = set()
        for node, site, how in trained_models(facts):
            if site.qualname in apis.GET_PEFT_MODEL:
                continue  # adds trainable adapters
            is_trainer = site in facts.trainer_calls()
            if not (trainer_trained(facts, site) if is_trainer else backward):
                continue
            if is_trainer and call_arg(site.node, keyword="peft_config") is not None:
                continue  # the trainer adds its own adapters
            frozen = facts.value(node, site.order, site.scope).frozen_by()
            if frozen is None or id(frozen) in reported:
                continue
            key = name_key(node)
            if key is not None:  # a name: not changed between its binding and the training (a call: trained as made)
                binding = facts.binding_at(key, site.order, site.scope)
                if binding is None or self._model_changed(facts, key, binding.order, site.order, site.scope):
                    continue
            reported.add(id(frozen))
            frozen_site = facts.call_site(frozen)
            if frozen_site is not None and frozen_site.qualname in apis.PEFT_LOADERS:
                what = (
                    f"`{snippet(facts, frozen, 50)}` loads the adapter for inference: without `is_trainable=True` peft "
                    "0.21 freezes every adapter weight (\"trainable params: 0\")"
                )
                fix = "Pass `is_trainable=True` to `PeftModel.from_pretrained(...)` to keep training the adapter."
            else:
                what = (
                    f"`{snippet(facts, frozen, 50)}` sets requires_grad=False on every parameter of the model it is "
                    "given, and here that model already holds its adapters, so the adapter weights are frozen too"
                )
                fix = (
                    "Call `prepare_model_for_kbit_training` on the base model, before `get_peft_model` / "
                    "`PeftModel.from_pretrained(..., is_trainable=True)`."
                )
            yield self.report(
                frozen,
                f"{what}, yet {how} trains `{snippet(facts, node, 30)}`: the first `backward()` raises "
                "\"RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn\" (with the "
                "input embeddings hooked to require grad it runs and updates nothing).",
                fix_hint=fix,
                related=((site.node, "the frozen model is trained here"),),
            )

    @staticmethod
    def _unfreezes_anything(facts: FileFacts) -> bool:
        """Any ``x.requires_grad = <not False>`` or ``x.requires_grad_()``/``(True)`` in the file: parameters may be
        unfrozen (layers chosen by name, a helper), so "all frozen" is no longer shown."""
        for site in facts.attribute_assigns:
            if site.target.attr.value == "requires_grad" and not _is_false(site.value):
                return True
        for site in facts.method_calls("requires_grad_"):
            if not _is_false(call_arg(site.node, 0, "requires_grad")):
                return True
        return False

    @staticmethod
    def _freezes(facts: FileFacts) -> Iterator[tuple[cst.CSTNode, cst.BaseExpression, int, object, Optional[cst.CSTNode]]]:
        """(node to report, the model, order, scope, the ``requires_grad = False`` store of a loop) for an
        unconditional freeze of all of a model's parameters."""
        for site in facts.attribute_assigns:
            if site.target.attr.value != "requires_grad" or not _is_false(site.value):
                continue
            loop = _enclosing_loop(site.context)
            if loop is None:
                continue
            model = parameters_held_by(facts, site.target.value, site.order, site.scope)
            if model is None or not _binds_per_iteration(facts, loop, site):
                continue
            if len([s for s in loop.node.body.body if not _pulls_next(s)]) != 1:
                continue  # other statements in the loop body may skip or unfreeze some parameters
            yield loop.node, model, loop.order, site.scope, site.node
        for site in facts.method_calls("requires_grad_"):
            if _is_false(call_arg(site.node, 0, "requires_grad")) and site.receiver is not None \
                    and not any(isinstance(f, (IfFrame, LoopFrame)) for f in site.context):
                yield site.node, site.receiver, site.order, site.scope, None

    @staticmethod
    def _optimizer_over(facts: FileFacts, key: str, order: int, scope):
        for site in facts.calls:
            if site.order <= order or site.scope is not scope or not site.qualname or not apis.is_optimizer(site.qualname):
                continue
            owner = parameters_owner(facts, site.arg(0, "params"), site.order, site.scope)
            if owner is not None and name_key(owner) == key:
                return site
        return None

    @staticmethod
    def _model_changed(facts: FileFacts, key: str, start: int, end: int, scope) -> bool:
        """After the freeze (until ``end``): a store into the model (``model.fc = ...``,
        ``model.classifier[6] = ...``), a rebinding to something else than the model itself, or the model handed
        to a call that may add parameters (``get_peft_model``, the file's own helpers, ``add_module``)."""
        def rooted(node) -> bool:
            while isinstance(node, (cst.Attribute, cst.Subscript)):
                node = node.value
            return isinstance(node, cst.Name) and node.value == key

        for site in facts.attribute_assigns:
            if start < site.order < end and rooted(site.target.value) and not _config_store(site.target):
                return True
        for site in facts.subscript_assigns:
            if start < site.order < end and rooted(site.target.value):
                return True
        binding_at_freeze = facts.binding_at(key, start, scope)
        for binding in scope.bindings.get(key, ()):
            if start < binding.order < end and binding is not binding_at_freeze and not _same_model(binding.value, key, facts):
                return True
        for site in facts.calls:
            if not start < site.order < end:
                continue
            if site.receiver is not None and name_key(site.receiver) == key and site.method not in _READING_METHODS:
                return True  # ``model.add_module(...)``, ``model.load_adapter(...)``
            if any(name_key(a.value) == key for a in site.node.args):
                func = site.node.func
                if isinstance(func, cst.Name) and func.value in _INERT_TAKERS:
                    continue
                if site.qualname in _WRAPPERS or site.qualname in _FREEZE_ONLY or site.qualname in _READ_ONLY:
                    continue
                return True
        return False


def _config_store(target: cst.Attribute) -> bool:
    """``model.config.use_cache = False``: a setting, not a parameter."""
    node: cst.BaseExpression = target
    while isinstance(node, (cst.Attribute, cst.Subscript)):
        if isinstance(node, cst.Attribute) and node.attr.value in ("config", "generation_config"):
            return True
        node = node.value
    return False


def _same_model(value: Optional[cst.BaseExpression], key: str, facts: FileFacts) -> bool:
    """``model.to(device)`` / ``model.cuda()`` / ``nn.DataParallel(model)``: the same parameters."""
    if name_key(value) == key:
        return True
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value in _SAME_MODEL_METHODS:
        return _same_model(value.func.value, key, facts)  # ``nn.DataParallel(model).cuda()``
    if isinstance(value, cst.Call) and facts.qualname(value.func) in _WRAPPERS:
        return bool(value.args) and _same_model(value.args[0].value, key, facts)
    return False


def _is_false(node: Optional[cst.BaseExpression]) -> bool:
    return isinstance(node, cst.Name) and node.value == "False"


def _enclosing_loop(context: tuple) -> Optional[LoopFrame]:
    """The innermost loop around a statement, when no ``if`` sits between them (the statement runs on every
    iteration)."""
    for frame in reversed(context):
        if isinstance(frame, IfFrame):
            return None
        if isinstance(frame, LoopFrame):
            return frame
    return None


def _binds_per_iteration(facts: FileFacts, loop: LoopFrame, site) -> bool:
    """The frozen name is the item ``loop`` takes on each iteration: its ``for`` target, or bound by ``next()``
    inside it (``while True: p = next(it)``)."""
    binding = facts.binding_at(name_key(site.target.value), site.order, site.scope)
    if binding is None:
        return False
    if binding.kind == "for":
        return isinstance(loop.node, cst.For) and any(node is binding.target for node in walk(loop.node.target))
    return isinstance(loop.node, cst.While) and loop.order < binding.order < loop.end_order


def _pulls_next(statement: cst.CSTNode) -> bool:
    """``try: p = next(it)`` / ``except StopIteration: break``: how a ``while`` loop takes its item."""
    if not isinstance(statement, cst.Try) or len(statement.body.body) != 1:
        return False
    pulled = statement.body.body[0]
    return isinstance(pulled, cst.SimpleStatementLine) and any(
        isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "next" for node in walk(pulled)
    )


def _filters_requires_grad(params: Optional[cst.BaseExpression]) -> bool:
    """``filter(lambda p: p.requires_grad, model.parameters())`` or ``[p for p in ... if p.requires_grad]``."""
    if params is None:
        return False
    for node in walk(params):
        if isinstance(node, cst.Attribute) and node.attr.value == "requires_grad":
            return True
    return False
