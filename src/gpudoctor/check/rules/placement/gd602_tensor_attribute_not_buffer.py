from __future__ import annotations

import libcst as cst

from gpudoctor.check.facts import FileFacts, string_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.placement._common import (
    cpu_tensor,
    file_sets_default_device,
    is_scalar_tensor,
    method_scopes,
    mixing_use,
    module_classes,
)


class TensorAttributeNotBuffer(Rule):
    """``self.mask = torch.ones(...)`` in an ``nn.Module.__init__``: a plain tensor attribute is not a
    parameter or buffer, so ``model.to(device)``/``.cuda()`` leaves it on the CPU, and ``forward`` then
    mixes it with tensors on the accelerator. Silent when every use in the other methods places it
    (``self.mask.to(x.device)``), when it is reassigned outside ``__init__``, or when it is a 0-dim scalar."""

    code = "GD602"
    name = "tensor-attribute-not-buffer"
    summary = "Tensor kept as a plain nn.Module attribute (not a buffer): .to()/.cuda() do not move it"
    severity = Severity.WARNING
    fixable = None
    triggers = ("self.",)

    def check(self, facts: FileFacts):
        if file_sets_default_device(facts):
            return
        for class_name in module_classes(facts):
            methods = method_scopes(facts, class_name)
            if any(m.name in ("_apply", "to", "cuda") for m in methods):
                continue
            buffers = {
                string_value(site.arg(0, "name"))
                for site in facts.method_calls("register_buffer")
                if site.scope in methods
            }
            attrs = facts.class_attrs.get(class_name, {})
            building = _construction_methods(facts, methods)
            for key, bindings in attrs.items():
                init = [b for b in bindings if b.scope in building]
                if len(init) != 1 or len(bindings) != 1 or key[5:] in buffers:
                    continue
                binding = init[0]
                if binding.kind != "assign" or cpu_tensor(facts, binding.value, binding.order, binding.scope) is None:
                    continue
                local = facts.assignment_of(binding.value, binding.order, binding.scope)  # through a temporary
                made = local.value if local is not None else binding.value
                if isinstance(made, cst.Call) and is_scalar_tensor(facts, made):
                    continue
                use = None
                for _, node, scope in facts.name_loads.get(key, ()):
                    if scope in methods and scope not in building:
                        use = mixing_use(facts, node, scope.node)
                        if use is not None:
                            where = scope.name
                            break
                if use is None:
                    continue
                attr = key[5:]
                yield self.report(
                    binding.value,
                    f"`{key} = {snippet(facts, binding.value, 50)}` is a plain tensor attribute of `{class_name}`, "
                    "not a buffer: `model.to(device)` / `.cuda()` move parameters and buffers only, so it stays on "
                    f"the CPU and `{where}` mixes it with the accelerator tensors in `{snippet(facts, use, 50)}` "
                    "(\"Expected all tensors to be on the same device, but found at least two devices, cuda:0 and "
                    "cpu!\"). It is also missing from `state_dict()`.",
                    fix_hint=f"`self.register_buffer(\"{attr}\", {snippet(facts, binding.value, 40)}, persistent=False)` "
                    "(drop `persistent=False` to save it in checkpoints).",
                    related=((use, f"`{where}` mixes `{key}` with the input's device here"),),
                )


def _construction_methods(facts: FileFacts, methods) -> list:
    """``__init__`` and the methods it calls on ``self`` (``self._build(n)``), which build the module too."""
    found = [m for m in methods if m.name == "__init__"]
    for scope in found:
        for site in facts.calls:
            if site.scope is scope:
                found.extend(c for c in facts.callee_scopes(site) if c in methods and c not in found)
    return found
