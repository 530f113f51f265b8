from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import (
    IfFrame,
    TRAIT_CAST,
    TRAIT_FP16,
    TRAIT_PEFT,
    TRAIT_PRECISION_CAST,
    TRAIT_QUANTIZED,
    CallSite,
    FileFacts,
    Value,
    call_arg,
    is_true,
)
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import parameters_owner_paths, snippet, string_through, trained_models
from gpudoctor.check.rule import Rule

_UNSCALE = "ValueError: Attempting to unscale FP16 gradients."
# torch.optim's adaptive optimizers (torch 2.13 defaults): update = m / (sqrt(v) + eps) (Adagrad: sqrt(sum g^2) + eps,
# Adamax: max|g| + eps). In float16, eps < 2**-25 (~3e-8) rounds away.
_ADAPTIVE_DEFAULT_EPS = {
    "Adam": 1e-8, "AdamW": 1e-8, "NAdam": 1e-8, "RAdam": 1e-8, "Adamax": 1e-8, "RMSprop": 1e-8, "Adagrad": 1e-10,
}


def _tiny_eps(eps: Optional[cst.BaseExpression], default: float) -> bool:
    """The optimizer's eps is one float16 rounds to 0: the default, or a literal below 2**-25."""
    if eps is None:
        return default < 2 ** -25
    try:
        return float(eps.evaluated_value) < 2 ** -25 if isinstance(eps, (cst.Float, cst.Integer)) else False
    except (AttributeError, ValueError):
        return False


def _dtype_argument(node: cst.CSTNode) -> cst.CSTNode:
    """Where the float16 dtype is written: the ``dtype=``/``torch_dtype=`` argument of the load call (the user fixes
    it there), else the node itself (``.half()``, ``.to(torch.float16)``)."""
    if isinstance(node, cst.Call):
        for keyword in ("torch_dtype", "dtype"):
            arg = call_arg(node, keyword=keyword)
            if arg is not None:
                return arg
    return node


def _fp16_source(value: Value, precision_fp16: bool = False) -> Optional[Value]:
    """The value whose dtype decides the model's weights, if that dtype is float16 (latest cast wins). A cast to
    the mixed-precision dtype (``.to(device, dtype=weight_dtype)``) is float16 when ``precision_fp16``: the file's
    mixed precision setting is fp16."""
    current = value
    while current is not None:
        if TRAIT_CAST in current.traits:
            return current if current.traits[TRAIT_CAST][0] == "float16" else None
        if TRAIT_FP16 in current.traits:
            return current
        if TRAIT_PRECISION_CAST in current.traits:
            return current if precision_fp16 else None
        current = current.base
    return None


class Fp16TrainableParams(Rule):
    """fp16 mixed precision (``TrainingArguments(fp16=True)``, ``Accelerator(mixed_precision="fp16")``,
    ``GradScaler``) while the *trained* parameters are float16: a full fine-tune of a
    ``dtype=torch.float16``/``.half()`` model, or peft with ``modules_to_save`` (the saved copy stays
    fp16) or ``autocast_adapter_dtype=False``, or a peft model cast to float16 after the wrap (``.half()`` reaches the
    adapters). The scaler refuses to unscale fp16 gradients. Plain LoRA
    on an fp16 base is fine: peft upcasts the adapters to float32 by default."""

    code = "GD204"
    name = "fp16-trainable-params"
    summary = "fp16 AMP (GradScaler) while the trained parameters are float16 (Attempting to unscale FP16 gradients)"
    triggers = ("fp16", "GradScaler", ".half(", "float16")

    def check(self, facts: FileFacts):
        if facts.calls_to(*apis.PASSTHROUGH, *apis.UPCAST_TRAINABLE) or self._upcast_loop(facts) or self._submodule_kept_float32(facts):
            return  # trainable params are upcast to float32 (prepare_model_for_kbit_training or by hand)
        found = self._amp(facts)
        if found is None:
            yield from self._pure_fp16_adaptive(facts)
            return
        amp, amp_node, amp_site = found
        # the mixed-precision setting itself says fp16 (not only a GradScaler): its dtype variable is float16. Under
        # DeepSpeed accelerate reports mixed_precision "no" (accelerate 1.15 state.py: the DeepSpeed config owns it).
        precision_fp16 = (
            amp_site.qualname in (*apis.ACCELERATOR, *apis.TRAINING_ARGS)
            and "deepspeed" not in facts.source.lower()
        )
        seen: set[int] = set()
        for node, site, how in sorted(trained_models(facts), key=lambda t: t[1].order):
            value = facts.value(node, site.order, site.scope)
            if value.kind != "model" or value.has(TRAIT_QUANTIZED):
                continue
            if site.qualname in apis.GET_PEFT_MODEL:
                peft = Value("model", site.node, {TRAIT_PEFT: site.node}, base=value)
            else:
                peft = value.carrier(TRAIT_PEFT)
            base = peft.base if peft is not None else value
            if base is None:
                continue
            # a cast of the wrapped model itself (not when the training call is the wrap: nothing sits above it)
            recast = (
                _cast_after_wrap(value, peft, precision_fp16)
                if peft is not None and site.qualname not in apis.GET_PEFT_MODEL else None
            )
            if recast is not None:
                origin = id(base.origin().node)
                if origin in seen:
                    continue
                seen.add(origin)
                yield self.report(
                    site.node,
                    f"{how} trains `{snippet(facts, node)}`, a peft model cast to float16 after it was wrapped "
                    f"(`{snippet(facts, recast.node)}`), and {amp}: the cast reaches the LoRA adapters too (peft upcasts "
                    f"them to float32 only when `get_peft_model` wraps the model), so the trained parameters are float16 "
                    f"and the first optimizer step (or gradient clipping) raises \"{_UNSCALE}\"",
                    fix_hint="Drop the cast after `get_peft_model` (load the base in float16 instead), or upcast the "
                    "trainable parameters afterwards: `for p in model.parameters(): if p.requires_grad: p.data = p.data.float()`.",
                    severity=Severity.ERROR,
                    related=(
                        (recast.node, "this casts the wrapped model, adapters included, to float16"),
                        (peft.node, "the peft model is made here"),
                        (amp_node, "fp16 AMP is turned on here"),
                    ),
                )
                continue
            fp16 = _fp16_source(base, precision_fp16)
            if fp16 is None or _cast_on_other_branch(facts, fp16.node, node, site):
                continue
            if peft is None and _frozen_without_adapters(facts, node, site):
                continue  # ``itertools.chain(unet.parameters(), vae.parameters())`` with the vae frozen: no gradients
            origin = id(base.origin().node)
            if origin in seen:
                continue
            related = [(_dtype_argument(fp16.node), "the weights are loaded in float16 here")]
            if peft is not None:
                found_reason = self._peft_fp16_reason(facts, peft.node)
                if found_reason is None:
                    continue  # LoRA adapters are upcast to float32 by default: fine
                reason, cause = found_reason
                what = f"the peft model keeps trainable float16 parameters ({reason})"
                related += [(cause, "this keeps trainable parameters in float16"), (peft.node, "the peft model is made here")]
            else:
                injected = _adapter_injected(facts, node, site)
                what = (
                    f"`{snippet(facts, injected.node, 50)}` injects LoRA layers in the base layers' float16 dtype (peft "
                    "0.21's `inject_adapter_in_model`, behind diffusers'/transformers' `add_adapter`, does not upcast them "
                    "as `get_peft_model` does), so the trained adapters are float16"
                    if injected is not None
                    else "all its parameters are trained in float16 (full fine-tune)"
                )
            related.append((amp_node, "fp16 AMP is turned on here"))
            seen.add(origin)
            yield self.report(
                site.node,
                f"{how} trains `{snippet(facts, node)}`, whose weights are float16 (`{snippet(facts, fp16.node)}`), "
                f"and {amp}: {what}, so the first optimizer step (or gradient clipping) raises \"{_UNSCALE}\"",
                fix_hint="Load the weights in float32 and let fp16 autocast do the rest, use bf16, or upcast the "
                "trainable parameters: `for p in model.parameters(): if p.requires_grad: p.data = p.data.float()`.",
                severity=Severity.ERROR,
                related=tuple(related),
            )

    def _pure_fp16_adaptive(self, facts: FileFacts):
        """No mixed precision at all: a float16 model trained in full by an adaptive optimizer built over its
        parameters with the default ``eps``. The optimizer's state and arithmetic are float16 too: ``eps=1e-8``
        rounds to 0 and squared gradients under ~8e-3 underflow to 0, so the first step divides by zero (run here:
        ``nn.Linear(64, 8).half()`` + ``Adam``, 49 of 512 weights non-finite after one step; SGD stays finite)."""
        seen: set[int] = set()
        for node, site, how in sorted(trained_models(facts), key=lambda t: t[1].order):
            name = (site.qualname or "").rsplit(".", 1)[-1]
            if not (site.qualname or "").startswith("torch.optim.") or name not in _ADAPTIVE_DEFAULT_EPS:
                continue
            if not _tiny_eps(call_arg(site.node, keyword="eps"), _ADAPTIVE_DEFAULT_EPS[name]):
                continue
            value = facts.value(node, site.order, site.scope)
            if value.kind != "model" or value.has(TRAIT_QUANTIZED) or value.carrier(TRAIT_PEFT) is not None:
                continue
            fp16 = _fp16_source(value)
            if fp16 is None or not _same_path(facts, fp16.node, site) or id(value.origin().node) in seen:
                continue
            seen.add(id(value.origin().node))
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node.func)}` trains `{snippet(facts, node)}`, whose weights are float16 "
                f"(`{snippet(facts, fp16.node)}`), without mixed precision: the optimizer's state and update are float16 "
                f"as well, its `eps` ({_ADAPTIVE_DEFAULT_EPS[name]:g}) rounds to 0 and squared gradients below ~8e-3 "
                "underflow to 0, so the first step divides by zero and the weights turn inf/NaN (the loss becomes nan).",
                fix_hint="Keep the weights in float32 and train with `torch.autocast(\"cuda\", dtype=torch.float16)` and a "
                "`GradScaler` (or use bf16), or give the optimizer an eps float16 can hold (`eps=1e-4`).",
                severity=Severity.ERROR,
                related=((fp16.node, "the weights are made float16 here"),),
            )

    @staticmethod
    def _amp(facts: FileFacts) -> Optional[tuple[str, cst.CSTNode, CallSite]]:
        """How the file turns on fp16 AMP with a GradScaler, where (the setting the user turns off), and the call
        that does it (keywords also read from a ``**kwargs`` dict: ``TrainingArguments(**{"fp16": True, ...})``)."""
        for site in facts.calls_to(*apis.TRAINING_ARGS):
            # where: the ``fp16=True`` the user turns off (its value, also inside a ``**kwargs`` dict)
            flag = facts.keyword_argument(site.node, "fp16", site.order, site.scope)
            if is_true(flag):
                return f"`{snippet(facts, site.node.func)}(fp16=True)` turns on fp16 AMP with a GradScaler", flag, site
        for site in facts.calls_to(*apis.ACCELERATOR):
            # ``Accelerator(mixed_precision=args.mixed_precision)``: the option's default counts (what runs without it)
            flag = facts.keyword_argument(site.node, "mixed_precision", site.order, site.scope)
            if string_through(facts, flag, site.order, site.scope) == "fp16":
                return f"`{snippet(facts, site.node.func)}(mixed_precision=\"fp16\")` unscales gradients with a GradScaler", flag, site
        for site in facts.calls_to(*apis.GRAD_SCALER):
            enabled = call_arg(site.node, keyword="enabled")
            if enabled is None or is_true(enabled):
                return f"`{snippet(facts, site.node)}` unscales the gradients", site.node, site
        return None

    @staticmethod
    def _upcast_loop(facts: FileFacts) -> bool:
        for assign in facts.attribute_assigns:
            # ``p.data = p.data.float()`` / ``.to(torch.float32)``: trainable parameters upcast by hand
            if assign.target.attr.value == "data" and re.search(r"\.float\(\)|float32", facts.module.code_for_node(assign.value)):
                return True
        for loop in facts.loops:
            if loop.iter is None:
                continue
            if "parameters(" not in facts.module.code_for_node(loop.iter):
                continue
            body = facts.module.code_for_node(loop.node.body)
            if ".float()" in body or "float32" in body:
                return True
        return False

    @staticmethod
    def _submodule_kept_float32(facts: FileFacts) -> bool:
        """``model.half()`` then ``model.transformer.prefix_encoder.float()`` (ChatGLM P-tuning v2; also
        ``.float().cuda()``, ``.to(torch.float32)``): a sub-module of the model cast back to float32 in place, the
        recipe that trains an fp32 part (prefix encoder, head) on a frozen fp16 body, like the hand upcast of the
        trainable parameters above."""
        for site in facts.calls:
            if not site.statement:
                continue
            call = site.node
            while isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute):  # ``X.float().cuda()``
                method, receiver = call.func.attr.value, call.func.value
                dtype = call_arg(call, 0, "dtype")
                to_float32 = method == "to" and dtype is not None and facts.qualname(dtype) in ("torch.float32", "torch.float")
                if (method == "float" or to_float32) and isinstance(receiver, cst.Attribute):
                    owner = receiver.value
                    while isinstance(owner, cst.Attribute) and facts.value(owner, site.order, site.scope).kind != "model":
                        owner = owner.value
                    if facts.value(owner, site.order, site.scope).kind == "model":
                        return True
                call = facts.through_temporary(receiver)  # ``tmp = X.float()`` ... ``tmp.cuda()``
        return False

    @staticmethod
    def _peft_fp16_reason(facts: FileFacts, peft_call) -> Optional[tuple[str, cst.CSTNode]]:
        """Why the peft model trains float16 parameters, and the argument that causes it."""
        site = facts.call_site(peft_call) if peft_call is not None else None
        if site is None or site.qualname not in apis.GET_PEFT_MODEL:
            return None
        autocast = call_arg(site.node, keyword="autocast_adapter_dtype")
        if autocast is not None and facts.module.code_for_node(autocast) == "False":
            return "`autocast_adapter_dtype=False` leaves the adapters in float16", autocast
        config = facts.built_by(call_arg(site.node, 1, "peft_config"), site.order, site.scope)
        if config is None:
            return None
        modules = call_arg(config, keyword="modules_to_save")
        if modules is not None and facts.module.code_for_node(modules) not in ("None", "[]"):
            return f"`modules_to_save={snippet(facts, modules)}` trains a float16 copy of those modules", modules
        task = call_arg(config, keyword="task_type")
        if task is not None and "SEQ_CLS" in facts.module.code_for_node(task):
            return "`task_type=SEQ_CLS` adds the classifier head to `modules_to_save`, a float16 copy", task
        return None


def _cast_after_wrap(value: Value, peft: Value, precision_fp16: bool) -> Optional[Value]:
    """The latest dtype cast applied to the peft model itself (between ``value`` and the wrap), if it is float16:
    ``model = get_peft_model(model, config); model.half()`` casts the adapters get_peft_model had upcast."""
    current: Optional[Value] = value
    while current is not None and current is not peft:
        if TRAIT_CAST in current.traits:
            return current if current.traits[TRAIT_CAST][0] == "float16" else None
        if TRAIT_PRECISION_CAST in current.traits:
            return current if precision_fp16 else None
        current = current.base
    return None


def _same_path(facts: FileFacts, cast: cst.CSTNode, site) -> bool:
    """Every ``if`` branch the cast sits in also holds the training call (``if args.eval_only: model.half()`` does
    not reach an optimizer built in the ``else``)."""
    cast_site = facts.call_site(cast) if isinstance(cast, cst.Call) else None
    if cast_site is None:
        return True
    here = {(id(f.node), f.branch) for f in site.context if isinstance(f, IfFrame)}
    return all((id(f.node), f.branch) in here for f in cast_site.context if isinstance(f, IfFrame))


def _branch_of(facts: FileFacts, test: cst.BaseExpression, branch: str) -> tuple[str, str]:
    """(test source without leading ``not``, the branch it is taken on): ``if not x:`` body is x's orelse."""
    while isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        test, branch = test.expression, "orelse" if branch == "body" else "body"
    return facts.module.code_for_node(test), branch


def _cast_on_other_branch(facts: FileFacts, cast: cst.CSTNode, trained: cst.BaseExpression, site) -> bool:
    """The float16 cast runs on one branch of a test and the optimizer only holds the model's parameters on the
    other (``if not args.train_text_encoder: text_encoder.to(dtype=weight_dtype)`` with ``chain(unet.parameters(),
    text_encoder.parameters()) if args.train_text_encoder else unet.parameters()``): never both on one run."""
    cast_site = facts.call_site(cast) if isinstance(cast, cst.Call) else None
    if cast_site is None:
        return False
    cast_branches = dict(_branch_of(facts, f.test, f.branch) for f in cast_site.context if isinstance(f, IfFrame))
    if not cast_branches:
        return False
    paths = [path for owner, path in parameters_owner_paths(facts, site.arg(0, "params"), site.order, site.scope)
             if facts.module.code_for_node(owner) == facts.module.code_for_node(trained)]
    return bool(paths) and all(
        any(cast_branches.get(text, branch) != branch for text, branch in path) for path in paths
    )


def _adapter_injected(facts: FileFacts, trained: cst.BaseExpression, site):
    """``unet.add_adapter(lora_config)`` on the trained model before the training call: its call site."""
    text = facts.module.code_for_node(trained)
    return next(
        (
            call for call in facts.method_calls("add_adapter")
            if call.receiver is not None and facts.module.code_for_node(call.receiver) == text and call.order < site.order
        ),
        None,
    )


def _frozen_without_adapters(facts: FileFacts, trained: cst.BaseExpression, site) -> bool:
    """``vae.requires_grad_(False)`` on every path before the training call, never undone, no adapter injected: its
    parameters get no gradient, and the GradScaler skips parameters without one."""
    text = facts.module.code_for_node(trained)
    calls = [c for c in facts.method_calls("requires_grad_") if c.receiver is not None
             and facts.module.code_for_node(c.receiver) == text and c.order < site.order]
    frozen = [c for c in calls if c.node.args and facts.module.code_for_node(c.node.args[0].value) == "False"]
    unconditional = any(not any(isinstance(f, IfFrame) for f in c.context) for c in frozen)
    return unconditional and len(frozen) == len(calls) and _adapter_injected(facts, trained, site) is None
