from __future__ import annotations

import libcst as cst

from gpudoctor.check.facts import FileFacts, Scope, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.placement._common import (
    creation_qualname,
    file_sets_default_device,
    is_scalar_tensor,
    method_scopes,
    mixing_use,
    module_classes,
)


class TensorCreatedInForward(Rule):
    """``torch.zeros/ones/arange/randn/tensor...`` without ``device=`` inside an ``nn.Module.forward``,
    combined with the inputs or the module's weights: the new tensor is on the CPU while they are on
    the accelerator. Silent when the tensor is placed (``.to(x)``, ``device=``), only indexes, is a
    0-dim scalar (CPU scalars mix with CUDA tensors), or ``torch.set_default_device`` is used."""

    code = "GD601"
    name = "tensor-created-in-forward"
    summary = "Tensor created in nn.Module.forward without device= and mixed with the inputs"
    severity = Severity.WARNING
    triggers = ("forward",)

    def check(self, facts: FileFacts):
        if file_sets_default_device(facts):
            return
        for class_name in module_classes(facts):
            for scope in method_scopes(facts, class_name):
                if scope.name != "forward":
                    continue
                for site in facts.calls:
                    if site.scope is not scope:
                        continue
                    q = creation_qualname(facts, site.node)
                    if q is None or is_scalar_tensor(facts, site.node):
                        continue
                    use = mixing_use(facts, site.node, scope.node)
                    if use is None:
                        continue
                    yield self._report(facts, site, f"`{class_name}.forward`", use)
                yield from self._in_helpers(facts, class_name, scope)

    def _report(self, facts: FileFacts, site, where: str, use):
        return self.report(
            site.node,
            f"`{snippet(facts, site.node)}` in {where} is created on the default device "
            f"(CPU) and then meets the inputs or weights in `{snippet(facts, use, 50)}`; once the model "
            "is on an accelerator this raises \"Expected all tensors to be on the same device, but found "
            "at least two devices, cuda:0 and cpu!\" (`.to()` moves parameters and buffers, never "
            "tensors created while running).",
            fix_hint="Create it where the data is: add `device=x.device` (and `dtype=x.dtype` if needed), "
            "or use `torch.zeros_like(x)` / `x.new_zeros(...)`.",
            related=((use, "it meets the inputs or weights here"),),
        )

    def _in_helpers(self, facts: FileFacts, class_name: str, forward: Scope):
        """Tensors created in the class's own methods that ``forward`` calls (``H = self._set_hidden_state(X,
        H)`` ... ``return torch.zeros(n, self.hidden)``): mixed inside the helper, or returned to ``forward``
        and mixed there."""
        reported: set[int] = set()
        for call in facts.calls:
            if call.scope is not forward:
                continue
            key = name_key(call.node.func)
            if key is None or not key.startswith("self.") or key.count(".") != 1:
                continue
            for helper in facts.callee_scopes(call):
                # the class's own methods, inherited ones, and a subclass's override (a base ``forward`` calling
                # ``self._forward(...)``): what ``self.name(...)`` runs
                if helper is forward or helper.class_name is None:
                    continue
                for site in facts.calls:
                    if site.scope is not helper or id(site.node) in reported:
                        continue
                    if creation_qualname(facts, site.node) is None or is_scalar_tensor(facts, site.node):
                        continue
                    use = mixing_use(facts, site.node, helper.node)
                    where = f"`{helper.class_name}.{helper.name}` (called from `{class_name}.forward`)"
                    if use is None and self._returned(facts, site, helper):
                        use = mixing_use(facts, call.node, forward.node)
                        where = f"`{helper.class_name}.{helper.name}` (returned to `{class_name}.forward`)"
                    if use is not None:
                        reported.add(id(site.node))
                        yield self._report(facts, site, where, use)

    @staticmethod
    def _returned(facts: FileFacts, site, helper: Scope) -> bool:
        """The created tensor is what the helper returns, or one of the tuple it returns: ``return torch.zeros(...)``,
        ``h = torch.zeros(...)`` ... ``return h``, an LSTM's ``return (torch.zeros(...), torch.zeros(...))`` or
        ``return h0, c0``."""
        for ret in facts.returns.get(id(helper), ()):
            if ret.kind != "return" or ret.value is None:
                continue
            parts = [e.value for e in ret.value.elements] if isinstance(ret.value, (cst.Tuple, cst.List)) else [ret.value]
            for part in parts:
                if part is site.node:
                    return True
                binding = facts.assignment_of(part, ret.order, ret.scope)
                if binding is not None and binding.value is site.node:
                    return True
        return False
