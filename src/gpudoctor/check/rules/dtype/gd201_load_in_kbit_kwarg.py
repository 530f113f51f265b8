from __future__ import annotations

import libcst as cst

from gpudoctor.check import apis, versions
from gpudoctor.check.facts import DictEntry, FileFacts, is_true
from gpudoctor.check.finding import Applicability, Edit, Fix, Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule

_KWARGS = ("load_in_8bit", "load_in_4bit")


class LoadInKbitKwarg(Rule):
    """``load_in_8bit=``/``load_in_4bit=`` passed to a config's ``from_pretrained`` (silently ignored: the
    model loads unquantized) or to a model's ``from_pretrained`` (removed in transformers 5:
    ``TypeError`` from the model's ``__init__``; deprecated in 4.x) — as keywords, through a ``**dict``,
    or in a ``pipeline(..., model_kwargs={...})``."""

    code = "GD201"
    name = "load-in-kbit-kwarg"
    summary = "load_in_8bit/load_in_4bit passed as a from_pretrained kwarg instead of quantization_config"
    fixable = "unsafe"
    triggers = ("load_in_8bit", "load_in_4bit")

    def check(self, facts: FileFacts):
        for site in facts.calls:
            if site.qualname in _PIPELINE:
                entries = self._dict_entries(facts, site.arg(keyword="model_kwargs"), site)
                if entries:
                    yield self._removed_argument(facts, site, entries, "model")
                continue
            owner_method = apis.hf_class_method(site.qualname) if site.qualname else None
            wrapper = site.qualname in apis.VALUE_HEAD_WRAPPERS_FROM_PRETRAINED
            if wrapper:
                owner_method = (site.qualname.split(".")[1], "from_pretrained")
            if not owner_method or owner_method[1] != "from_pretrained":
                continue
            owner = owner_method[0]
            kbit = [a for a in site.node.args if a.keyword is not None and a.keyword.value in _KWARGS]
            splat = [e for a in site.node.args if a.star == "**" for e in self._dict_entries(facts, a.value, site)]
            if not kbit and not splat:
                continue
            if apis.is_config_class(owner) or owner == "AutoConfig":
                first = (kbit or splat)[0]
                key, value = _key_value(first)
                yield self.report(
                    _node(first),
                    f"`{owner}.from_pretrained(..., {key}={snippet(facts, value)})`: a config does not quantize. The "
                    "keyword is silently ignored (no `quantization_config` is created), so the model built from "
                    "this config loads in full precision.",
                    fix_hint="Pass `quantization_config=BitsAndBytesConfig(load_in_8bit=True)` to the model's "
                    "`from_pretrained` (from transformers); `from_config` cannot load quantized weights.",
                    related=((site.node, "the config is loaded here"),),
                )
            elif apis.is_model_class(owner):
                yield self._removed_argument(
                    facts, site, kbit or splat, owner, fixable=bool(kbit) and not splat, wrapper=wrapper
                )

    @staticmethod
    def _dict_entries(facts: FileFacts, expr, site) -> list[DictEntry]:
        """The live ``load_in_*`` entries of the dict ``expr`` at ``site`` (see ``FileFacts.dict_contents``)."""
        contents = facts.dict_contents(expr, site.order, site.scope)
        return [e for e in contents.entries.values() if e.key in _KWARGS] if contents is not None else []

    def _removed_argument(self, facts: FileFacts, site, kbit: list, owner: str, fixable: bool = False, wrapper: bool = False):
        version, _found = versions.assumed("transformers")
        mm = versions.major_minor(version) or (5, 0)
        described = versions.describe("transformers")
        keys = [_key_value(a)[0] for a in kbit]
        named = "`/`".join(f"{k}=" for k in keys)
        through_pipeline = owner == "model"
        via = f" (through `{snippet(facts, site.node.func)}(..., model_kwargs=...)`, passed on to `from_pretrained`)" if through_pipeline else ""
        if wrapper:
            trl = versions.installed("trl")
            via = (
                f" (trl's `{owner}.from_pretrained` passes it on to transformers' `from_pretrained`"
                + (
                    f"; trl {trl}, installed here, no longer ships the value-head classes, so with it the import fails first"
                    if (versions.major_minor(trl) or (0, 0)) >= (1, 0) else ""
                )
                + ")"
            )
            owner = "<model class>"
        if mm >= (5, 0):
            cls = "<model class>" if owner.startswith("Auto") or owner == "model" else owner
            message = (
                f"`{named}` is no longer a `from_pretrained` argument{via}: with {described} it reaches the model's "
                f"constructor and raises \"TypeError: {cls}.__init__() got an unexpected keyword argument '{keys[0]}'\""
                + (" (e.g. `LlamaForCausalLM.__init__()`)" if cls == "<model class>" else "")
                + (", which `pipeline` reports as \"ValueError: Could not load model ... with any of the following classes\"" if through_pipeline else "")
                + "."
            )
            severity = Severity.ERROR
        else:
            message = (
                f"`{named}` in `from_pretrained`{via} is deprecated with {described} and removed in transformers 5, "
                "where it raises a TypeError from the model's constructor."
            )
            severity = Severity.WARNING
        fix = self._fix(site, kbit) if fixable else None
        wanted = [k for a, k in zip(kbit, keys) if is_true(_key_value(a)[1])]
        return self.report(
            _node(kbit[0]),
            message,
            fix_hint=(
                f"Use `quantization_config=BitsAndBytesConfig({', '.join(f'{k}=True' for k in wanted) or 'load_in_8bit=True'})`"
                " when you want a quantized model, and drop the `load_in_*=` arguments (a `False` one only has to go)."
            ),
            severity=severity,
            fix=fix,
            related=(
                *((_node(a), f"`{k}` is passed here too") for a, k in zip(kbit[1:], keys[1:])),
                (site.node, "the model is loaded here"),
            ),
        )

    @staticmethod
    def _fix(site, kbit: list[cst.Arg]):
        """Literal ``True`` keywords become a ``BitsAndBytesConfig``; literal ``False`` ones are deleted.
        A flag (``load_in_8bit=FLAG``) gets no fix: ``BitsAndBytesConfig(load_in_8bit=False)`` is *not*
        "no quantization" — transformers 5.24 picks the 4-bit quantizer for any BitsAndBytesConfig
        without ``load_in_8bit=True`` (``quantizers/auto.py``: ``_8bit`` if ``load_in_8bit`` else ``_4bit``)."""
        if any(a.keyword.value == "quantization_config" for a in site.node.args if a.keyword is not None):
            return None
        on = [a for a in kbit if is_true(a.value)]
        off = [a for a in kbit if isinstance(a.value, cst.Name) and a.value.value == "False"]
        if len(on) + len(off) != len(kbit) or len(on) > 1:
            return None  # a variable decides, or both True (which raises anyway)
        args = list(site.node.args)
        remaining = [a for a in args if not any(a is o for o in off)]
        # Deleting the call's last arguments: the new last one takes over their (absent) trailing comma.
        last = remaining[-1] if remaining and remaining[-1] is not args[-1] else None
        edits = [Edit(a, None) for a in off]
        if not on:
            if last is not None:
                edits.append(Edit(last, last.with_changes(comma=args[-1].comma)))
            return Fix(
                "Delete `" + "`, `".join(f"{a.keyword.value}=False" for a in off) + "` (it asks for no quantization)",
                Applicability.SAFE,
                tuple(edits),
            )
        keep = on[0]
        config = cst.Call(
            func=cst.Name("BitsAndBytesConfig"),
            args=[
                cst.Arg(
                    keyword=cst.Name(keep.keyword.value),
                    value=keep.value.deep_clone(),
                    equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
                )
            ],
        )
        replacement = keep.with_changes(keyword=cst.Name("quantization_config"), value=config)
        if last is keep:
            replacement = replacement.with_changes(comma=args[-1].comma)
        elif last is not None:
            edits.append(Edit(last, last.with_changes(comma=args[-1].comma)))
        return Fix(
            "Replace with `quantization_config=BitsAndBytesConfig(...)` (needs bitsandbytes)",
            Applicability.UNSAFE,
            (Edit(keep, replacement), *edits),
            imports=(("transformers", "BitsAndBytesConfig"),),
        )


_PIPELINE = {"transformers.pipeline", "transformers.pipelines.pipeline"}


def _key_value(node) -> tuple[str, cst.BaseExpression]:
    """(keyword, value) of a ``load_in_*=`` argument or a dict's entry."""
    if isinstance(node, cst.Arg):
        return node.keyword.value, node.value
    return node.key, node.value


def _node(entry) -> cst.CSTNode:
    """The node to report for an argument or a dict's entry (its element, keyword or store)."""
    return entry.node if isinstance(entry, DictEntry) else entry
