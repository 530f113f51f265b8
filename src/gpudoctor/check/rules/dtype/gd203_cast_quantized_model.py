from __future__ import annotations

from gpudoctor.check.facts import (
    TRAIT_PEFT,
    TRAIT_PREPARED,
    TRAIT_QUANTIZED,
    FileFacts,
    Value,
    call_arg,
    is_true,
)
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
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node)}` on {'an' if kind.startswith('8') else 'a'} {kind} model loaded by `{snippet(facts, load)}` raises \"{message}\"",
                fix_hint="Use the quantized model as loaded: choose the compute dtype at load time "
                "(`dtype=...`, `bnb_4bit_compute_dtype=...`) and the placement with `device_map=`.",
                severity=Severity.ERROR,
                related=((load, "the model is loaded quantized here"),),
            )

    @staticmethod
    def _bits(facts: FileFacts, load) -> int:
        if is_true(call_arg(load, keyword="load_in_8bit")):
            return 8
        if is_true(call_arg(load, keyword="load_in_4bit")):
            return 4
        config = call_arg(load, keyword="quantization_config")
        site = facts.call_site(load)
        if config is None or site is None:
            return 0
        return facts.value(config, site.order, site.scope).traits.get("bits", 0)
