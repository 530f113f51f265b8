from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import TRAIT_DISPATCHED, TRAIT_OFFLOADED, TRAIT_QUANTIZED, FileFacts, Value, name_key
from gpudoctor.check.facts.nodes import dotted
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.placement._common import creation_qualname

_PARAMETER_ITERATORS = {"parameters", "named_parameters", "buffers", "named_buffers"}


class CpuTensorIntoPlacedModel(Rule):
    """``param.data = torch.tensor(...)`` (a new CPU tensor: no ``device=``) written into a parameter of a
    model that ``from_pretrained`` dispatched with a device map or quantized: the parameter lives on a GPU
    (or on ``meta``, offloaded; or packed by bitsandbytes), and the assignment replaces it with a plain CPU
    tensor."""

    code = "GD613"
    name = "cpu-tensor-into-placed-model"
    summary = "param.data = <new CPU tensor> in a dispatched or quantized model"
    preview = True
    triggers = (".data",)

    def check(self, facts: FileFacts):
        for site in facts.attribute_assigns:
            if site.target.attr.value != "data":
                continue
            created = self._cpu_tensor(facts, site.value, site.order, site.scope)
            if created is None:
                continue
            model, how = self._owning_model(facts, site.target.value, site.order, site.scope)
            if model is None:
                continue
            if model.has(TRAIT_QUANTIZED):
                effect = (
                    "the model is quantized: the parameter's packed bitsandbytes storage is replaced by a full-precision "
                    "CPU tensor while the layer keeps its quantization state, so its forward fails (device mismatch) "
                    "or reads the floats as packed weights"
                )
            elif model.has(TRAIT_OFFLOADED):
                effect = (
                    "the model is dispatched with offloading: an offloaded parameter is on `meta`, and torch raises "
                    "\"RuntimeError: Attempted to call `variable.set_data(tensor)`, but `variable` and `tensor` have "
                    "incompatible tensor type.\"; a parameter on a GPU silently moves to the CPU"
                )
            else:
                effect = (
                    "the model is dispatched by its device map: the parameter silently moves from its GPU to the CPU "
                    "while accelerate's hooks still move the inputs to the GPU, so the next forward raises "
                    "\"RuntimeError: Expected all tensors to be on the same device\" (an offloaded parameter on `meta` "
                    "raises at the assignment already)"
                )
            origin = model.origin().node
            yield self.report(
                site.node,
                f"`{snippet(facts, site.target)} = {snippet(facts, site.value, 40)}` writes a new CPU tensor "
                f"(`{created}` without `device=`) into {how}; {effect}.",
                fix_hint="Copy into the existing tensor, which keeps its device and dtype: `with torch.no_grad(): "
                "param.copy_(new_values)` (or build it with `device=param.device, dtype=param.dtype`). For a quantized "
                "model, load the weights before quantizing.",
                related=((origin, "the model is placed (dispatched or quantized) here"),) if origin is not None else (),
            )

    @staticmethod
    def _cpu_tensor(facts: FileFacts, value: cst.BaseExpression, order: int, scope) -> Optional[str]:
        """The creating call's name when ``value`` is a new CPU tensor, directly or through a name."""
        found = creation_qualname(facts, value)
        if found is None:  # through names, temporaries and the file's own helpers
            found = creation_qualname(facts, facts.built_by(value, order, scope))
        return f"{found}(...)" if found else None

    @staticmethod
    def _owning_model(facts: FileFacts, target: cst.BaseExpression, order: int, scope) -> tuple[Optional[Value], str]:
        """The dispatched/quantized model that owns ``target`` (``param`` of a loop over its parameters,
        or an attribute path ``model.lm_head.weight``), and how the message names the parameter."""
        root = target
        while isinstance(root, (cst.Attribute, cst.Subscript)) or (
            isinstance(root, cst.Call) and isinstance(root.func, cst.Attribute)
        ):
            root = root.func.value if isinstance(root, cst.Call) else root.value
        if root is target and isinstance(target, cst.Name):
            binding = facts.binding_at(target.value, order, scope)
            if binding is None or binding.kind not in ("for", "unpack", "assign") or binding.value is None:
                return None, ""
            if binding.kind == "assign":  # ``weight = model.lm_head.weight`` then ``weight.data = ...``
                if isinstance(binding.value, (cst.Attribute, cst.Subscript, cst.Call)):
                    return CpuTensorIntoPlacedModel._owning_model(facts, binding.value, binding.order, binding.scope)
                return None, ""
            iterable = binding.value
            if isinstance(iterable, cst.Call) and dotted(iterable.func) == "next" and iterable.args:
                iterable = iterable.args[0].value  # ``name, param = next(it)``
            # through enumerate/tqdm/zip, iter() and the file's own generators
            iterable = facts.source_of(iterable, binding.order, binding.scope)
            if not (
                isinstance(iterable, cst.Call)
                and isinstance(iterable.func, cst.Attribute)
                and iterable.func.attr.value in _PARAMETER_ITERATORS
            ):
                return None, ""
            owner = iterable.func.value
            value = facts.value(owner, binding.order, binding.scope)
            how = f"a parameter of `{snippet(facts, owner)}` (from `{snippet(facts, iterable)}`)"
        else:
            if name_key(root) is None:
                return None, ""
            value = facts.value(root, order, scope)
            how = f"a parameter of `{snippet(facts, root)}`"
        if value.kind != "model":
            return None, ""
        device_map = value.trait(TRAIT_DISPATCHED)
        on_gpu = device_map is not None and (device_map.strategy == "auto" or device_map.devices - {"cpu"})
        if not (on_gpu or value.has(TRAIT_QUANTIZED)):
            return None, ""  # a model kept on the CPU takes CPU tensors
        return value, how
