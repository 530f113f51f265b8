from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import (
    TRAIT_PEFT,
    TRAIT_PREPARED,
    TRAIT_QUANTIZED,
    FileFacts,
    IfFrame,
    Value,
    call_arg,
    dotted,
    is_true,
    name_key,
)
from gpudoctor.check.facts.nodes import walk
from gpudoctor.check import versions
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule

_CAST_MESSAGE = (
    "ValueError: You cannot cast a bitsandbytes model in a new `dtype`. Make sure to load the model using "
    "`from_pretrained` using the desired `dtype` by passing the correct `dtype` argument."
)
_METHOD_MESSAGE = (
    "ValueError: `.{method}()` is not supported for quantized model. Please use the model as it is, since the model "
    "has already been casted to the correct `dtype`."
)
_CUDA_MESSAGE = (
    "ValueError: Calling `cuda()` is not supported for `8-bit` quantized models.  Please use the model as it is, "
    "since the model has already been set to the correct devices."
)


def _value_if_rebinding_skipped(facts: FileFacts, site) -> tuple[Optional[IfFrame], Optional[Value]]:
    """When the receiver's latest assignment sits in an ``if`` (without ``else``) that does not enclose the call:
    (that ``if``, the receiver's value from the assignment before it), else (None, None)."""
    key = name_key(site.receiver)
    binding = facts.binding_at(key, site.order, site.scope) if key is not None else None
    if binding is None or binding.kind != "assign":
        return None, None
    enclosing = {id(frame.node) for frame in site.context if isinstance(frame, IfFrame)}
    branches = [f for f in binding.context if isinstance(f, IfFrame) and id(f.node) not in enclosing]
    if not branches or any(f.node.orelse is not None for f in branches):
        return None, None
    before = facts.binding_at(key, binding.order, binding.scope)
    if before is None or before.kind != "assign" or before.value is None:
        return None, None
    return branches[0], facts.value(before.value, before.order, before.scope)


def _tested_chains(test: cst.BaseExpression) -> set[str]:
    """The names and attribute chains a test reads, longest only (``args.bits``, not ``args``)."""
    found = {dotted(node) for node in walk(test) if isinstance(node, (cst.Name, cst.Attribute))} - {None, "", "None", "True", "False"}
    return {c for c in found if not any(other.startswith(c + ".") for other in found)}


def _quantization_tests(facts: FileFacts, load: cst.Call) -> set[str]:
    """What decides whether ``load`` quantizes: the tests of the ``if``s around its kwargs entries
    (``if args.quantization_bit is not None: kwargs["quantization_config"] = ...``) and of a conditional
    ``quantization_config=... if cond else None`` (directly or through one name)."""
    order, scope = facts._position_of(load)
    chains: set[str] = set()
    for contents in facts.kwargs_contents(load, order, scope):
        for entry in contents.entries.values():
            for frame in entry.context:
                if isinstance(frame, IfFrame):
                    chains |= _tested_chains(frame.test)
    config = facts.keyword_argument(load, "quantization_config", order, scope)
    if isinstance(config, cst.Name):
        binding = facts.binding_at(config.value, order, scope)
        config = binding.value if binding is not None else None
    if isinstance(config, cst.IfExp):
        chains |= _tested_chains(config.test)
    return chains


def _quantized_load(value: Value):
    """The load call of a bitsandbytes model, unless a wrapper (peft, DataParallel, prepare) sits above it:
    the checks live on ``PreTrainedModel`` and a wrapper's ``.half()`` does not call them."""
    current = value
    while current is not None:
        if TRAIT_QUANTIZED in current.traits:
            return current.traits[TRAIT_QUANTIZED]
        if TRAIT_PEFT in current.traits or "wrapper" in current.traits or TRAIT_PREPARED in current.traits:
            return None
        current = current.base
    return None


_MOVE_8BIT_MESSAGE = (
    "ValueError: You need to install `pip install bitsandbytes>=0.48.0` if you want to move a 8-bit model across "
    "devices using to()."
)


def _bnb_before_0_48() -> bool:
    """The installed (or targeted) bitsandbytes is older than 0.48; unknown -> False (nothing to say)."""
    version = versions.major_minor(versions.installed("bitsandbytes"))
    return version is not None and version < (0, 48)


class CastQuantizedModel(Rule):
    """``.half()``, ``.float()``, ``.to(dtype)`` on a bitsandbytes model, or ``.cuda()`` on an 8-bit one:
    transformers refuses them. ``.to(device)`` is flagged only for an 8-bit model when the installed (or
    targeted) bitsandbytes is older than 0.48 (4-bit moves are allowed)."""

    code = "GD203"
    name = "cast-quantized-model"
    summary = "Casting a bitsandbytes-quantized model (.half()/.float()/.to(dtype)) or .cuda() on 8-bit"
    triggers = ("load_in_", "BitsAndBytesConfig")

    def check(self, facts: FileFacts):
        for site in facts.method_calls("half", "float", "to", "cuda"):
            if site.receiver is None or site.qualname is not None:
                continue
            value = facts.value(site.receiver, site.order, site.scope)
            if value.kind != "model":
                continue
            load = _quantized_load(value)
            skipped_if = None
            if load is None:
                # ``if checkpoint: model = PeftModel.from_pretrained(model, ...)`` then ``model.half()``: when the
                # ``if`` is not taken the receiver is still the bare quantized model.
                skipped_if, before = _value_if_rebinding_skipped(facts, site)
                load = _quantized_load(before) if before is not None else None
                if load is not None and _tested_chains(skipped_if.test) & _quantization_tests(facts, load):
                    load = None  # the ``if`` tests what decided the quantization: skipping it may mean unquantized
            if load is None:
                continue
            if facts.on_another_path(value, site.context):
                continue  # under a test of what decided the loading kwargs (``if device_map is None:``)
            bits = self._bits(facts, load)
            if site.method in ("half", "float"):
                message = _METHOD_MESSAGE.format(method=site.method)
            elif site.method == "cuda":
                if bits != 8:
                    continue
                message = _CUDA_MESSAGE
            else:
                moved = facts.value(site.node, site.order + 1, site.scope)
                if "cast" not in moved.traits and call_arg(site.node, keyword="dtype") is None:
                    # .to(device): allowed for 4-bit; for 8-bit only refused by bitsandbytes < 0.48
                    if bits != 8 or not _bnb_before_0_48():
                        continue
                    message = _MOVE_8BIT_MESSAGE + f" (bitsandbytes {versions.installed('bitsandbytes')})"
                else:
                    message = _CAST_MESSAGE
            kind = f"{bits}-bit" if bits else "bitsandbytes"
            path = ""
            if skipped_if is not None:
                path = f" when `if {snippet(facts, skipped_if.test, 50)}:` is not taken (the wrapper it binds is skipped)"
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node)}` on {'an' if kind.startswith('8') else 'a'} {kind} model loaded by `{snippet(facts, load)}` raises \"{message}\"{path}",
                fix_hint="Use the quantized model as loaded: choose the compute dtype at load time "
                "(`dtype=...`, `bnb_4bit_compute_dtype=...`) and the placement with `device_map=`; cast only a model "
                "that was not quantized.",
                # On one path only: fails in a configuration the file does not show on every run.
                severity=Severity.ERROR if skipped_if is None else Severity.WARNING,
                related=((load, "the model is loaded quantized here"),),
            )

    @staticmethod
    def _bits(facts: FileFacts, load) -> int:
        """The bit width the load asks for, also when its kwargs come in a ``**kwargs`` dict the file builds
        (``kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)``)."""
        site = facts.call_site(load)
        if site is None:
            return 0
        keyword = lambda name: facts.keyword_argument(load, name, site.order, site.scope)  # noqa: E731
        if is_true(keyword("load_in_8bit")):
            return 8
        if is_true(keyword("load_in_4bit")):
            return 4
        config = keyword("quantization_config")
        if config is None:
            return 0
        return facts.value(config, site.order, site.scope).traits.get("bits", 0)
