from __future__ import annotations

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import TRAIT_MOVED, FileFacts, call_arg, name_key, string_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import exclusive_branches, snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.placement._common import PLACING_METHODS, device_sources, placement


class DataParallelModelNotOnDevice0(Rule):
    """``nn.DataParallel(model)`` around a model that is not on ``device_ids[0]``: still on the CPU (never
    moved, before or after wrapping) or spread over several GPUs by a ``device_map`` (the latter overlaps GD111). With two or more
    GPUs the first forward raises. (With one GPU, DataParallel moves the module itself; on a CPU-only
    machine it is a pass-through.)"""

    code = "GD608"
    name = "data-parallel-model-not-on-device0"
    summary = "nn.DataParallel around a model left on the CPU (not on device_ids[0])"
    severity = Severity.WARNING
    triggers = ("DataParallel",)

    def check(self, facts: FileFacts):
        placed_receivers = {id(s.receiver) for s in facts.calls if s.method in PLACING_METHODS and s.receiver is not None}
        for site in facts.calls_to(*apis.DATA_PARALLEL):
            module = site.arg(0, "module")
            if module is None or id(site.node) in placed_receivers:
                continue
            where = placement(facts, module, site.order, site.scope)
            device_ids = site.arg(1, "device_ids")
            several = isinstance(device_ids, (cst.List, cst.Tuple)) and len(device_ids.elements) >= 2
            # A dispatched model is GD111's case (accelerate family); here only the unplaced one.
            if where == "unplaced" and not self._moved_later(facts, site, module):
                severity = Severity.ERROR if several else Severity.WARNING
                gpus = "with the listed `device_ids`" if several else "on a machine with two or more GPUs"
                message = (
                    f"`{snippet(facts, module, 40)}` is still on the CPU when it is wrapped in "
                    f"`{snippet(facts, site.node.func)}` and is never moved; {gpus} the first forward raises "
                    "\"RuntimeError: module must have its parameters and buffers on device cuda:0 (device_ids[0]) "
                    "but found one of them on device: cpu\"."
                )
                hint = "Move it first: `model.to(\"cuda:0\")` (or `.to(f\"cuda:{device_ids[0]}\")`), then wrap."
            else:
                yield from self._moved_elsewhere(facts, site, module, device_ids)
                continue
            created = facts.value(module, site.order, site.scope).origin().node
            yield self.report(
                site.node,
                message,
                fix_hint=hint,
                severity=severity,
                related=((created, "the model is built here, on the CPU"),) if isinstance(created, cst.Call) else (),
            )

    def _moved_elsewhere(self, facts: FileFacts, site, module, device_ids):
        """The module (or its wrapper) ends up on a GPU with a literal index other than ``device_ids[0]``
        (all visible GPUs, from 0, when not given): ``DataParallel(model).to("cuda:1")``."""
        if device_ids is None:
            first = 0
        elif isinstance(device_ids, (cst.List, cst.Tuple)) and device_ids.elements \
                and isinstance(device_ids.elements[0].value, cst.Integer):
            first = int(device_ids.elements[0].value.value)
        else:
            return
        keys = {name_key(module)} | {b.key for b in facts._bindings_of_value(site.node)}
        keys.discard(None)
        moves = [c for c in facts.calls if c.method in apis.MODULE_MOVES and c.scope is site.scope
                 and (name_key(c.receiver) in keys or c.receiver is module)]
        # the latest move of the wrapped value wherever it happened (a helper that builds and moves it, a temporary)
        latest = facts.value(module, site.order, site.scope).trait(TRAIT_MOVED)
        moved = facts.call_site(latest) if isinstance(latest, cst.Call) else None
        if moved is not None and moved not in moves:
            moves.append(moved)
        moves.sort(key=lambda c: c.order)
        if not moves:
            return
        move = moves[-1]
        if move.method not in ("to", "cuda"):
            return
        target = move.arg(0, "device")
        index = self._device_index(facts, target, move.order, move.scope) if move.method == "to" else (
            int(target.value) if isinstance(target, cst.Integer) else None)
        if index is None or index == first:
            return
        yield self.report(
            move.node,
            f"`{snippet(facts, move.node, 50)}` puts the model on `cuda:{index}`, but "
            f"`{snippet(facts, site.node.func)}` runs its replicas from `device_ids[0]` = {first}"
            f"{'' if device_ids is not None else ' (all visible GPUs when `device_ids` is not given)'}; the first forward "
            f"raises \"RuntimeError: module must have its parameters and buffers on device cuda:{first} (device_ids[0]) "
            f"but found one of them on device: cuda:{index}\".",
            fix_hint=f"Put the model's GPU first: `DataParallel(model, device_ids=[{index}, ...])`, or move it to "
            f"`cuda:{first}`.",
            severity=Severity.ERROR,
            related=((site.node, "wrapped here"),),
        )

    def _device_index(self, facts: FileFacts, node, order: int, scope, depth: int = 0):
        """The literal GPU index of a device expression: ``"cuda:1"``, ``torch.device("cuda", 1)``, ``1``, a
        name bound to one, or the GPU branch of ``"cuda:1" if torch.cuda.is_available() else "cpu"``."""
        if node is None or depth > 6:
            return None
        if isinstance(node, cst.Integer):
            return int(node.value)
        text = string_value(node)
        if text is not None:
            head, _, index = text.partition(":")
            return int(index) if head == "cuda" and index.isdigit() else None
        if isinstance(node, cst.IfExp):
            other = string_value(node.orelse)
            return self._device_index(facts, node.body, order, scope, depth + 1) if other in ("cpu", "mps") else None
        if isinstance(node, cst.Call) and facts.qualname(node.func) == "torch.device":
            kind, index = call_arg(node, 0, "type"), call_arg(node, 1, "index")
            if isinstance(index, cst.Integer) and string_value(kind) == "cuda":
                return int(index.value)
            return self._device_index(facts, kind, order, scope, depth + 1) if index is None else None
        # through names, parameters (every call agrees) and the file's helpers (``device = get_device()``)
        found = {self._device_index(facts, *source, depth + 1) for source in device_sources(facts, node, order, scope)}
        return found.pop() if len(found) == 1 and None not in found else None

    def _moved_later(self, facts: FileFacts, site, module) -> bool:
        keys = {name_key(module)}
        for binding in facts._bindings_of_value(site.node):
            keys.add(binding.key)
        keys.discard(None)
        for call in facts.calls:
            if exclusive_branches(site.context, call.context):
                continue  # ``if multi_gpu: DataParallel(model)`` / ``else: model.cuda()``: the wrapped path never moves
            if call.order > site.order and call.method in apis.MODULE_MOVES and name_key(call.receiver) in keys:
                return True
            if call.order > site.order and call.method in apis.MODULE_MOVES and name_key(call.receiver) is not None:
                # the wrapper reached through a helper's return or a temporary
                value = facts.value(call.receiver, call.order, call.scope)
                while value is not None and value.node is not site.node:
                    value = value.base
                if value is not None:
                    return True
            if call.order > site.order and isinstance(call.receiver, cst.Attribute) and call.receiver.attr.value == "module" \
                    and name_key(call.receiver.value) in keys and call.method in apis.MODULE_MOVES:
                return True
        return False
