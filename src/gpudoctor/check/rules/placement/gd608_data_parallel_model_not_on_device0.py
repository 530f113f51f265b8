from __future__ import annotations

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.placement._common import PLACING_METHODS, placement


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
                continue
            yield self.report(site.node, message, fix_hint=hint, severity=severity)

    def _moved_later(self, facts: FileFacts, site, module) -> bool:
        keys = {name_key(module)}
        for binding in facts._bindings_of_value(site.node):
            keys.add(binding.key)
        keys.discard(None)
        for call in facts.calls:
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
