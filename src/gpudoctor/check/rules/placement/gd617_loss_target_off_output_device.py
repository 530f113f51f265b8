from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from gpudoctor import hardware
from gpudoctor.check.facts import TRAIT_DISPATCHED, TRAIT_OFFLOADED, FileFacts, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet, stated_gpus
from gpudoctor.check.rule import Rule

# torch.nn.functional losses that compare an input (arg 0) with a target (arg 1) element-wise: both must be on one
# device (the CUDA kernels check it: "when checking argument for argument target in method
# wrapper_CUDA_nll_loss_forward").
_LOSS_FUNCTIONS = {
    f"torch.nn.functional.{name}"
    for name in (
        "cross_entropy", "nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "mse_loss",
        "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
    )
}
# Tensor methods that return the same data on the same device (a view, a dtype change, a copy).
_SAME_DEVICE = {
    "view", "reshape", "contiguous", "float", "half", "bfloat16", "double", "long", "int", "permute", "transpose",
    "flatten", "squeeze", "unsqueeze", "clone", "detach", "view_as", "reshape_as", "type", "masked_fill", "log_softmax",
    "softmax",
}
_MOVES = {"to", "cuda", "cpu"}
# ``CUDA_VISIBLE_DEVICES=0,1`` (a launch comment, an ``os.environ`` string): two or more devices listed.
_VISIBLE = re.compile(r"CUDA_VISIBLE_DEVICES[\"']?\]?\s*[=:]\s*[\"']?(\d+(?:\s*,\s*\d+)+)")
# A comment that says the script runs on several cards: "双卡", "两张卡"/"2块显卡", "多卡".
_SEVERAL_CARDS = re.compile(r"双卡|[两2二]\s*[张块]\s*(?:显卡|卡|GPU)|多卡")


class LossTargetOffOutputDevice(Rule):
    """A loss computed by hand (``F.cross_entropy(logits, labels)``, ``nn.CrossEntropyLoss()(...)``) on the output of
    a model dispatched over several GPUs by a ``device_map``, with a target that is not moved to the output's
    device: the output comes from the last module (``lm_head``) on the last GPU, the target from the batch on the
    first GPU (or the CPU), and the loss kernel refuses two devices. An explicit map with two or more GPUs is an
    error; an ``auto`` map (a warning) only when the file shows several GPUs (``CUDA_VISIBLE_DEVICES=0,1``, ``max_memory`` for two
    GPUs, "双卡", ``--gpus``): on one GPU it places everything there. The model may be the one a Trainer subclass's
    ``compute_loss(self, model, inputs)`` receives. Silent when the target is moved to a tensor's ``.device``."""

    code = "GD617"
    name = "loss-target-off-output-device"
    summary = "Hand-written loss on the output of a model dispatched over several GPUs with a target left on another device"
    severity = Severity.ERROR
    triggers = ("device_map",)

    def check(self, facts: FileFacts):
        for site in facts.calls:
            args = self._loss_arguments(facts, site)
            if args is None:
                continue
            output, target = args
            made = self._model_output(facts, output, site.order, site.scope)
            if made is None:
                continue
            model_call, model = made
            placement = self._several_gpus(facts, model)
            if placement is None:
                continue
            severity, how = placement
            chain = self._target_chain(facts, target, site.order, site.scope)
            if chain is None:
                continue
            steps, moved = chain
            if moved is not None and moved is not False:
                continue  # moved to a tensor's device: the fix
            if any(self._model_output(facts, step, site.order, site.scope) for step in steps if isinstance(step, cst.Call)):
                continue  # the target is computed from the output itself
            device_map = model.trait(TRAIT_DISPATCHED)
            placer = model.trait("dispatch_call") or (device_map.node if device_map is not None else None) or model.origin().node
            related = [(node, "the target is made here, on the batch's device") for node in self._target_bindings(facts, target, site)]
            related.append((placer, f"`{snippet(facts, placer, 40)}` spreads the model over the GPUs here"))
            related.append((model_call, "the output comes from the model's last module, on the last GPU"))
            target_text = snippet(facts, target, 40)
            output_name = _innermost(output)
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node, 50)}` compares `{snippet(facts, output, 40)}`, an output of `{snippet(facts, model_call, 30)}`, "
                f"with `{target_text}`; {how}, so the output is on the last GPU while the target stays where the batch was put "
                "(the first GPU or the CPU): the loss raises \"RuntimeError: Expected all tensors to be on the same device, but "
                "found at least two devices, cuda:1 and cuda:0! (when checking argument for argument target in method "
                "wrapper_CUDA_nll_loss_forward)\".",
                fix_hint=f"Move the target to the output's device: `{target_text}.to({snippet(facts, output_name, 30)}.device)` "
                "(or let the model compute the loss: `model(**inputs, labels=labels).loss` moves the labels itself).",
                severity=severity,
                related=tuple(related),
            )

    # ------------------------------------------------------------------------------------------ the loss

    @staticmethod
    def _loss_arguments(facts: FileFacts, site) -> Optional[tuple[cst.BaseExpression, cst.BaseExpression]]:
        """(input, target) of ``F.cross_entropy(input, target)`` or of a call of a ``torch.nn.*Loss`` instance."""
        if site.qualname in _LOSS_FUNCTIONS:
            first, second = site.arg(0, "input"), site.arg(1, "target")
        elif site.qualname is None and isinstance(site.node.func, (cst.Name, cst.Attribute)):
            built = facts.built_by(site.node.func, site.order, site.scope)
            q = facts.qualname(built.func) if built is not None else None
            if not q or not q.startswith("torch.nn.") or not q.endswith("Loss"):
                return None
            positional = [a.value for a in site.node.args if a.keyword is None and not a.star]
            if len(positional) != 2:
                return None
            first, second = positional
        else:
            return None
        if first is None or second is None:
            return None
        return first, second

    # ------------------------------------------------------------------------------------------ the output

    def _model_output(self, facts: FileFacts, node, order: int, scope, depth: int = 0):
        """(the model call, the model's value) when ``node`` is a view/attribute/element of a model call's output."""
        if node is None or depth > 12:
            return None
        if isinstance(node, cst.Name):
            sources = facts.follow_name(node, order, scope, params=False)
            if not sources or len(sources) != 1:
                return None
            return self._model_output(facts, *sources[0], depth + 1)
        if isinstance(node, cst.Subscript):
            return self._model_output(facts, node.value, order, scope, depth + 1)
        if isinstance(node, cst.Attribute):
            return self._model_output(facts, node.value, order, scope, depth + 1)
        if isinstance(node, cst.Call):
            func = node.func
            if isinstance(func, cst.Attribute) and func.attr.value in _SAME_DEVICE:
                return self._model_output(facts, func.value, order, scope, depth + 1)
            if isinstance(func, (cst.Name, cst.Attribute)) and facts.qualname(func) is None:
                value = facts.value(func, order, scope)
                if value.kind == "model":
                    return node, value
        return None

    @staticmethod
    def _several_gpus(facts: FileFacts, model) -> Optional[tuple[Severity, str]]:
        """(severity, how) when the model's device map puts it on two or more GPUs, shown by the map itself or by the
        GPUs the file states next to an ``auto`` map; None otherwise (one GPU, offload, unknown)."""
        device_map = model.trait(TRAIT_DISPATCHED)
        if device_map is None or model.has(TRAIT_OFFLOADED):
            return None
        gpus = {d for d in device_map.devices if d not in ("cpu", "disk", "meta")}
        if device_map.strategy == "explicit" and len(gpus) >= 2:
            return Severity.ERROR, f"its device map puts the model on {', '.join(sorted(map(str, gpus)))}"
        if device_map.strategy != "auto":
            return None
        visible = _VISIBLE.search(facts.source)
        if visible is not None:
            return Severity.WARNING, (
                f"`device_map={device_map.label or 'auto'}` spreads it over every visible GPU and the file runs it with "
                f"`{visible.group(0).strip()}`"
            )
        cards = _SEVERAL_CARDS.search(facts.source)
        if cards is not None:
            return Severity.WARNING, (
                f"`device_map={device_map.label or 'auto'}` spreads it over every visible GPU and the file runs it on "
                f"several (\"{cards.group(0)}\")"
            )
        gpus_known = hardware.for_file(stated_gpus(facts.source, model_names=True))
        if gpus_known is not None and gpus_known.count >= 2:
            return Severity.WARNING, (
                f"`device_map={device_map.label or 'auto'}` spreads it over every visible GPU ({gpus_known.describe()})"
            )
        return None

    # ------------------------------------------------------------------------------------------ the target

    def _target_chain(self, facts: FileFacts, node, order: int, scope, depth: int = 0):
        """(the expressions the target is derived from, how it is moved: None never, False to a fixed device or the
        model's first device, the ``.to(x.device)`` call when to a tensor's device); None when it is not followed."""
        steps: list[cst.CSTNode] = []
        moved = None
        current, where = node, (order, scope)
        while current is not None and depth < 16:
            depth += 1
            steps.append(current)
            if isinstance(current, cst.Name):
                binding = facts.binding_at(current.value, *where)
                if binding is None or binding.kind != "assign" or binding.value is None:
                    return steps, moved  # a parameter, a loop target: where the batch puts it
                current, where = binding.value, (binding.order, binding.scope)
                continue
            if isinstance(current, cst.Subscript):
                current = current.value
                continue
            if isinstance(current, cst.Attribute):
                current = current.value
                continue
            if isinstance(current, cst.Call) and isinstance(current.func, cst.Attribute):
                method = current.func.attr.value
                if method in _MOVES:
                    if moved is None:  # the latest move decides
                        moved = self._tensor_device_move(facts, current, *where)
                    current = current.func.value
                    continue
                if method in _SAME_DEVICE or method in ("pop", "get"):
                    current = current.func.value
                    continue
            return None  # anything else: a computation whose device is not followed
        return steps, moved

    @staticmethod
    def _tensor_device_move(facts: FileFacts, call: cst.Call, order: int, scope):
        """``.to(x.device)`` with ``x`` not a model (a tensor's device: the output's, presumably): the call; a move
        anywhere else (``.cuda()``, ``.to("cuda:0")``, ``.to(device)``, ``.to(model.device)``: the first GPU): False."""
        method = call.func.attr.value
        if method != "to":
            return False
        for arg in call.args:
            value = arg.value
            if isinstance(value, cst.Attribute) and value.attr.value == "device":
                owner = facts.value(value.value, order, scope)
                return False if owner.kind == "model" else call
            if isinstance(value, cst.Name):
                binding = facts.binding_at(value.value, order, scope)
                bound = binding.value if binding is not None and binding.kind == "assign" else None
                if isinstance(bound, cst.Attribute) and bound.attr.value == "device":
                    owner = facts.value(bound.value, binding.order, binding.scope)
                    return False if owner.kind == "model" else call
        return False

    @staticmethod
    def _target_bindings(facts: FileFacts, target, site) -> list[cst.CSTNode]:
        """The assignment of the name the target is read through (where ``.to(...)`` belongs)."""
        key = name_key(target)
        node = target
        while key is None and isinstance(node, (cst.Call, cst.Subscript, cst.Attribute)):
            node = node.func.value if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) else getattr(node, "value", None)
            key = name_key(node) if node is not None else None
        if key is None:
            return []
        binding = facts.binding_at(key, site.order, site.scope)
        if binding is None or binding.kind != "assign" or binding.value is None:
            return []
        return [binding.value]


def _innermost(node: cst.BaseExpression) -> cst.BaseExpression:
    """``logits`` of ``logits[:, :-1].reshape(-1, v)``: the name a view chain starts from (the expression itself if none)."""
    current = node
    while True:
        if isinstance(current, cst.Call) and isinstance(current.func, cst.Attribute):
            current = current.func.value
        elif isinstance(current, cst.Subscript):
            current = current.value
        else:
            return current if isinstance(current, (cst.Name, cst.Attribute)) else node
