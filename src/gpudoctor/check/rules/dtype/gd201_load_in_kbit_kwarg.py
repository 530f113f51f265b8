from __future__ import annotations

import libcst as cst

from gpudoctor.check import apis, versions
from gpudoctor.check.facts import FileFacts
from gpudoctor.check.finding import Applicability, Edit, Fix, Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule

_KWARGS = ("load_in_8bit", "load_in_4bit")


class LoadInKbitKwarg(Rule):
    """``load_in_8bit=``/``load_in_4bit=`` passed to a config's ``from_pretrained`` (silently ignored: the
    model loads unquantized) or straight to a model's ``from_pretrained`` (removed in transformers 5:
    ``TypeError`` from the model's ``__init__``; deprecated in 4.x)."""

    code = "GD201"
    name = "load-in-kbit-kwarg"
    summary = "load_in_8bit/load_in_4bit passed as a from_pretrained kwarg instead of quantization_config"
    fixable = "unsafe"
    triggers = ("load_in_8bit", "load_in_4bit")

    def check(self, facts: FileFacts):
        for site in facts.calls:
            owner_method = apis.hf_class_method(site.qualname) if site.qualname else None
            if not owner_method or owner_method[1] != "from_pretrained":
                continue
            owner = owner_method[0]
            kbit = [a for a in site.node.args if a.keyword is not None and a.keyword.value in _KWARGS]
            if not kbit:
                continue
            if apis.is_config_class(owner) or owner == "AutoConfig":
                yield self.report(
                    kbit[0],
                    f"`{owner}.from_pretrained(..., {kbit[0].keyword.value}={snippet(facts, kbit[0].value)})`: a config does not quantize. The "
                    "keyword is silently ignored (no `quantization_config` is created), so the model built from "
                    "this config loads in full precision.",
                    fix_hint="Pass `quantization_config=BitsAndBytesConfig(load_in_8bit=True)` to the model's "
                    "`from_pretrained` (from transformers); `from_config` cannot load quantized weights.",
                )
            elif apis.is_model_class(owner):
                yield self._model_kwarg(facts, site, owner, kbit)

    def _model_kwarg(self, facts: FileFacts, site, owner: str, kbit: list[cst.Arg]):
        version, _found = versions.assumed("transformers")
        mm = versions.major_minor(version) or (5, 0)
        described = versions.describe("transformers")
        key = kbit[0].keyword.value
        if mm >= (5, 0):
            cls = "<model class>" if owner.startswith("Auto") else owner
            message = (
                f"`{key}=` is no longer a `from_pretrained` argument: with {described} it reaches the model's "
                f"constructor and raises \"TypeError: {cls}.__init__() got an unexpected keyword argument '{key}'\""
                + (" (e.g. `LlamaForCausalLM.__init__()`)" if owner.startswith("Auto") else "")
                + "."
            )
            severity = Severity.ERROR
        else:
            message = (
                f"`{key}=` in `from_pretrained` is deprecated with {described} and removed in transformers 5, "
                "where it raises a TypeError from the model's constructor."
            )
            severity = Severity.WARNING
        fix = None
        has_qconfig = any(a.keyword is not None and a.keyword.value == "quantization_config" for a in site.node.args)
        if not has_qconfig:
            config = cst.Call(
                func=cst.Name("BitsAndBytesConfig"),
                args=[
                    cst.Arg(
                        keyword=cst.Name(a.keyword.value),
                        value=a.value.deep_clone(),
                        equal=cst.AssignEqual(
                            whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
                        ),
                    )
                    for a in kbit
                ],
            )
            first = kbit[0]
            replacement = first.with_changes(keyword=cst.Name("quantization_config"), value=config)
            if len(kbit) > 1 and site.node.args[-1] is kbit[-1]:
                replacement = replacement.with_changes(comma=kbit[-1].comma)  # the call's last arg goes away
            edits = [Edit(first, replacement)] + [Edit(a, None) for a in kbit[1:]]
            fix = Fix(
                "Replace with `quantization_config=BitsAndBytesConfig(...)` (needs bitsandbytes)",
                Applicability.UNSAFE,
                tuple(edits),
                imports=(("transformers", "BitsAndBytesConfig"),),
            )
        return self.report(
            kbit[0],
            message,
            fix_hint="Use `quantization_config=BitsAndBytesConfig(" + ", ".join(f"{a.keyword.value}=..." for a in kbit) + ")`.",
            severity=severity,
            fix=fix,
        )
