"""Higher-level questions several rules ask (built on :mod:`gpudoctor.check.facts`)."""

from __future__ import annotations

import re
from typing import Iterator, Optional

import libcst as cst

from gpudoctor import hardware
from gpudoctor.check import apis
from gpudoctor.check.facts import (
    TRAIT_PREPARED, CallSite, FileFacts, IfFrame, LoopFrame, Scope, Value, call_arg, dotted, int_value, name_key, string_value,
)
from gpudoctor.check.finding import Severity


_SALIENT = ("device_map", "dtype", "torch_dtype", "offload_folder", "load_in_8bit", "load_in_4bit", "mixed_precision")


def exclusive_branches(a: tuple, b: tuple) -> bool:
    """Two sites (by their frames) in different branches of the same ``if``: one run never takes both."""
    branches = {id(f.node): f.branch for f in a if isinstance(f, IfFrame)}
    return any(isinstance(f, IfFrame) and branches.get(id(f.node), f.branch) != f.branch for f in b)


def snippet(facts: FileFacts, node: cst.CSTNode, limit: int = 70) -> str:
    """Short source text for messages; a call shows its callee and its placement keywords only."""
    if isinstance(node, cst.Call) and len(facts.module.code_for_node(node)) > limit:
        callee = facts.module.code_for_node(node.func)
        shown = [
            f"{a.keyword.value}={_plain(facts, a.value)}" for a in node.args if a.keyword and a.keyword.value in _SALIENT
        ]
        text = f"{callee}(" + ", ".join(["...", *shown]) + ")"
    else:
        text = _plain(facts, node)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _plain(facts: FileFacts, node: cst.CSTNode) -> str:
    code = facts.module.code_for_node(node)
    # Drop comments and join lines: messages are one line.
    code = "\n".join(line.split("  #")[0] if "  #" in line else line for line in code.splitlines())
    return " ".join(code.split())


def multi_process_severity(facts: FileFacts) -> tuple[Severity, str]:
    """ERROR with the evidence when the file shows it runs as several processes, else INFO."""
    hints = facts.launch_hints
    if hints:
        return Severity.ERROR, "the file shows a multi-process launch (" + ", ".join(f"`{h}`" for h in hints[:3]) + ")"
    return Severity.INFO, "nothing in the file shows a multi-process launch"


def accelerator_calls(facts: FileFacts, scope: Optional[Scope] = None) -> Iterator[CallSite]:
    """Method calls on an Accelerator (``accelerator.backward(...)``), optionally in one scope."""
    for site in facts.calls:
        if site.receiver is None or (scope is not None and site.scope is not scope):
            continue
        if facts.value(site.receiver, site.order, site.scope).kind == "accelerator":
            yield site


def accelerator_for(facts: FileFacts, site: CallSite) -> Optional[CallSite]:
    """An accelerator method call in the same scope as ``site`` (the one nearest before it, else after)."""
    candidates = list(accelerator_calls(facts, site.scope))
    before = [c for c in candidates if c.order < site.order]
    if before:
        return before[-1]
    return candidates[0] if candidates else None


def accelerator_trains(facts: FileFacts) -> bool:
    """An Accelerator drives training here: it prepares objects, or (a notebook cell whose objects were
    prepared in an earlier cell) its ``backward`` runs."""
    return bool(facts.prepare_calls()) or any(c.method == "backward" for c in accelerator_calls(facts))


def prepare_behind(facts: FileFacts, site: CallSite) -> Optional[CallSite]:
    """The ``accelerator.prepare(...)`` call behind a prepared optimizer that ``site``'s function steps
    (``self.opt.step()`` in a method, ``opt.step()`` in a helper that receives it), for a function that never
    names the accelerator itself. A prepared model alone does not count: evaluating or saving it is no
    training step."""
    for step in facts.method_calls("step"):
        if step.scope is not site.scope or step.receiver is None:
            continue
        value = facts.value(step.receiver, step.order, step.scope)
        prepared = value.trait(TRAIT_PREPARED)
        if value.kind == "optimizer" and prepared is not None:
            return prepared
    return None


def reachable_accelerator(facts: FileFacts, prepare: CallSite, site: CallSite) -> Optional[cst.BaseExpression]:
    """The receiver of ``prepare`` when ``site``'s function can name the same accelerator (``self.acc`` in a
    method of the same class, or a global name), else None."""
    key = name_key(prepare.receiver)
    if key is None:
        return None
    if key.startswith("self."):
        same_class = site.scope.class_name is not None and site.scope.class_name == prepare.scope.class_name
        return prepare.receiver if same_class else None
    if facts.assumed_instance(key) is not None:
        return prepare.receiver  # never bound in the file: one global name everywhere
    here = facts.binding_at(key, site.order, site.scope)
    there = facts.binding_at(key, prepare.order, prepare.scope)
    return prepare.receiver if here is not None and here is there else None


def prepares_of(facts: FileFacts, receiver: cst.BaseExpression, order: int, scope: Scope) -> list[CallSite]:
    """The ``prepare`` calls on the same Accelerator as ``receiver`` (the one the same ``Accelerator(...)``
    built, whatever name holds it there)."""
    origin = facts.value(receiver, order, scope).origin().node
    if origin is None:
        return []
    return [site for site in facts.prepare_calls() if facts.value(site.receiver, site.order, site.scope).origin().node is origin]


def accelerator_kwargs(facts: FileFacts, receiver: cst.BaseExpression, order: int, scope: Scope) -> dict[str, cst.BaseExpression]:
    value = facts.value(receiver, order, scope)
    call = value.origin().node
    if isinstance(call, cst.Call):
        return {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    return {}


def mixed_precision_fp16(facts: FileFacts, kwargs: dict[str, cst.BaseExpression]) -> bool:
    return string_value(kwargs.get("mixed_precision")) == "fp16"


def sets_requires_grad(facts: FileFacts) -> bool:
    """Whether the file changes what autograd tracks: ``p.requires_grad = ...``, ``x.requires_grad_(...)``, or a
    ``requires_grad=`` argument (``torch.zeros(..., requires_grad=True)``, ``nn.Parameter(w, requires_grad=False)``).
    Reading the flag (``sum(p.numel() for p in model.parameters() if p.requires_grad)``, the usual count of
    trainable parameters) changes nothing."""
    if "requires_grad" not in facts.source:
        return False
    if any(True for _site in facts.method_calls("requires_grad_")):
        return True
    if any(site.target.attr.value == "requires_grad" for site in facts.attribute_assigns):
        return True
    return any(
        arg.keyword is not None and arg.keyword.value == "requires_grad" for site in facts.calls for arg in site.node.args
    )


def trained_models(facts: FileFacts) -> Iterator[tuple[cst.BaseExpression, CallSite, str]]:
    """Expressions that are trained, with the call that trains them and how:

    ``Trainer(model=m)``, ``accelerator.prepare(..., m, ...)`` with an optimizer, an optimizer over
    ``m.parameters()``, ``get_peft_model(m, ...)`` (LoRA training).
    """
    for site in facts.trainer_calls():
        model = site.arg(0, "model")
        if model is not None:
            yield model, site, f"`{(site.qualname or dotted(site.node.func) or 'Trainer').split('.')[-1]}(model=...)`"
    for site in facts.calls:
        if site.qualname and apis.is_optimizer(site.qualname):
            params = site.arg(0, "params")
            owner = _parameters_owner(params)
            owners = [owner] if owner is not None else parameters_owners(facts, params, site.order, site.scope)
            for owner in owners:
                yield owner, site, f"an optimizer over `{snippet(facts, params, 40)}`"
    for site in facts.calls_to(*apis.GET_PEFT_MODEL):
        model = site.arg(0, "model")
        if model is not None:
            yield model, site, "`get_peft_model(...)` (LoRA training)"


def _parameters_owner(params: Optional[cst.BaseExpression]) -> Optional[cst.BaseExpression]:
    """``model.parameters()`` / ``filter(..., model.parameters())`` / ``[p for p in model.parameters() ...]`` -> model."""
    if params is None:
        return None
    if isinstance(params, cst.Call) and isinstance(params.func, cst.Attribute):
        if params.func.attr.value in ("parameters", "named_parameters"):
            return params.func.value
    if isinstance(params, cst.Call) and isinstance(params.func, cst.Name) and params.func.value in ("filter", "list"):
        return _parameters_owner(params.args[-1].value if params.args else None)
    if isinstance(params, (cst.ListComp, cst.GeneratorExp)):
        for_in = params.for_in
        return _parameters_owner(for_in.iter)
    return None


def parameters_owner(facts: FileFacts, params: Optional[cst.BaseExpression], order: int, scope: Scope,
                     depth: int = 0) -> Optional[cst.BaseExpression]:
    """The module whose parameters an optimizer's ``params`` argument holds: the forms of
    :func:`_parameters_owner`, followed through names (``params = model.parameters()``), parameter groups
    (``[{"params": [p for n, p in model.named_parameters() if ...], "weight_decay": 0.01}, ...]``, the
    transformers examples' grouping; every group must come from the same module) and lists filled in a loop
    over the module's parameters (``decay = []``, ``for n, p in model.named_parameters(): decay.append(p)``)."""
    if params is None or depth > 6:
        return None
    owner = _parameters_owner(params)
    if owner is not None:
        return owner
    if isinstance(params, cst.BooleanOperation):  # ``trainable or model.parameters()``: either side, one module
        sides = [parameters_owner(facts, side, order, scope, depth + 1) for side in (params.left, params.right)]
        if all(side is not None for side in sides) and len({dotted(side) for side in sides}) == 1:
            return sides[0]
        return None
    if isinstance(params, (cst.List, cst.Tuple)) and params.elements:
        owners = []
        for element in params.elements:
            item = element.value
            if isinstance(item, cst.Dict):
                item = next(
                    (e.value for e in item.elements if isinstance(e, cst.DictElement) and string_value(e.key) == "params"),
                    None,
                )
            found = parameters_owner(facts, item, order, scope, depth + 1)
            if found is None or dotted(found) is None:
                return None
            owners.append(found)
        if len({dotted(o) for o in owners}) == 1:
            return owners[0]
        # groups over submodules of one model (``net.model``, ``net.cpm``, ...): that model
        roots = {name_key(_attribute_root(o)) for o in owners}
        return _attribute_root(owners[0]) if len(roots) == 1 and None not in roots else None
    if isinstance(params, cst.Call) and facts.qualname(params.func) is None:
        # the file's own helper given the module (``get_parameters_conv(net.model, "weight")``): its parameters
        site = facts.call_site(params)
        if site is not None and facts.callee_scopes(site):
            modules = [a.value for a in params.args if not a.star and _is_module_expression(facts, a.value, order, scope)]
            if len(modules) == 1:
                return modules[0]
    key = name_key(params)
    if key is None:
        return None
    binding = facts.binding_at(key, order, scope)
    if binding is None or binding.value is None or binding.kind not in ("assign", "unpack"):
        return None
    value = binding.value
    if binding.kind == "unpack":
        if not (isinstance(value, (cst.Tuple, cst.List)) and binding.index is not None and binding.index < len(value.elements)):
            return None
        value = value.elements[binding.index].value
    if isinstance(value, cst.List) and not value.elements:
        return _appended_parameters_owner(facts, binding, order)
    return parameters_owner(facts, value, binding.order, binding.scope, depth + 1)


def parameters_owners(facts: FileFacts, params: Optional[cst.BaseExpression], order: int, scope: Scope) -> list[cst.BaseExpression]:
    """Every module whose parameters an optimizer's ``params`` may hold: :func:`parameters_owner`'s forms, and
    ``itertools.chain(unet.parameters(), text_encoder.parameters())``, ``list(a.parameters()) + list(b.parameters())``,
    both branches of ``chain(...) if args.train_text_encoder else unet.parameters()`` (the diffusers examples'
    ``params_to_optimize``), through names."""
    return [owner for owner, _ in parameters_owner_paths(facts, params, order, scope)]


def parameters_owner_paths(facts: FileFacts, params: Optional[cst.BaseExpression], order: int, scope: Scope,
                           depth: int = 0, path: tuple = ()) -> list[tuple[cst.BaseExpression, tuple]]:
    """:func:`parameters_owners` with, for each module, the conditional branches its parameters come through:
    ((test source, "body" | "orelse"), ...) with ``not`` folded into the branch."""
    if params is None or depth > 6:
        return []
    owner = parameters_owner(facts, params, order, scope)
    if owner is not None:
        return [(owner, path)]
    if isinstance(params, cst.IfExp):
        test, negated = params.test, False
        while isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
            test, negated = test.expression, not negated
        text = facts.module.code_for_node(test)
        branches = [(params.body, "orelse" if negated else "body"), (params.orelse, "body" if negated else "orelse")]
        return [found for part, branch in branches
                for found in parameters_owner_paths(facts, part, order, scope, depth + 1, path + ((text, branch),))]
    if isinstance(params, cst.BinaryOperation) and isinstance(params.operator, cst.Add):
        parts = [params.left, params.right]
    elif isinstance(params, cst.Call) and (facts.qualname(params.func) == "itertools.chain" or (
            isinstance(params.func, cst.Name) and params.func.value == "list" and len(params.args) == 1)):
        parts = [arg.value for arg in params.args if not arg.star]
    else:
        sources = facts.follow_name(params, order, scope, params=False) or []
        return [found for source in sources for found in parameters_owner_paths(facts, *source, depth + 1, path)]
    return [found for part in parts for found in parameters_owner_paths(facts, part, order, scope, depth + 1, path)]


def _attribute_root(node: cst.BaseExpression) -> cst.BaseExpression:
    """``net.model.backbone`` -> ``net``."""
    while isinstance(node, cst.Attribute):
        node = node.value
    return node


_MODULE_ONLY_METHODS = {"train", "eval", "parameters", "named_parameters", "modules", "named_modules", "state_dict",
                        "load_state_dict"}


def _is_module_expression(facts: FileFacts, node: cst.BaseExpression, order: int, scope: Scope) -> bool:
    """A model, or a submodule read off one (``net.model`` where ``net`` is a model). A model of a class the
    file imports from its own package is known by its use: ``net.train()``, ``net.load_state_dict(...)``,
    ``DataParallel(net)`` in the same function."""
    root = _attribute_root(node)
    for candidate in {id(node): node, id(root): root}.values():
        if name_key(candidate) is None:
            continue
        if facts.value(candidate, order, scope).kind == "model":
            return True
        key = name_key(candidate)
        for site in facts.calls:
            if site.scope is not scope:
                continue
            if site.method in _MODULE_ONLY_METHODS and name_key(site.receiver) == key and not site.node.args[1:]:
                return True
            if site.qualname in apis.DATA_PARALLEL | apis.DISTRIBUTED_DATA_PARALLEL and name_key(site.arg(0, "module")) == key:
                return True
    return False


def _appended_parameters_owner(facts: FileFacts, binding, order: int) -> Optional[cst.BaseExpression]:
    """``key = []`` filled by ``key.append(p)`` (also ``(a if cond else key).append(p)``) before ``order``, where
    ``p`` is bound by a loop over ``model.parameters()`` / ``model.named_parameters()``: that model."""
    owners = []
    for site in facts.method_calls("append"):
        if site.scope is not binding.scope or not binding.order < site.order < order:
            continue
        receiver = facts.through_temporary(site.receiver)  # ``bucket = (a if c else key); bucket.append(p)``
        receivers = [receiver.body, receiver.orelse] if isinstance(receiver, cst.IfExp) else [receiver]
        if binding.key not in {name_key(r) for r in receivers}:
            continue
        item = site.arg(0)
        loop = next((f for f in reversed(site.context) if isinstance(f, LoopFrame)), None)
        iterated = facts.iterated(loop) if loop is not None else None
        if iterated is None or not isinstance(item, cst.Name):
            return None
        # ``p`` is bound by this loop (``for n, p in ...``, ``for i, (n, p) in enumerate(...)``, ``n, p = next(it)``)
        # over the module's parameters, through ``enumerate``/``tqdm``/``iter``/the file's generators
        item_binding = facts.binding_at(item.value, site.order, site.scope)
        owner = _parameters_owner(iterated[0])
        if owner is None or item_binding is None or item_binding.kind not in ("for", "unpack") or item_binding.order < loop.order:
            return None
        owners.append(owner)
    return owners[0] if owners and len({name_key(o) for o in owners}) == 1 else None


# -- model size from a checkpoint name (GD112 and others) -------------------------------------

_SIZE_IN_NAME = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s*([bBmM])(?![a-zA-Z0-9])")


def checkpoint_name(facts: FileFacts, call: cst.Call, order: int, scope: Scope) -> Optional[str]:
    """The checkpoint string of ``X.from_pretrained("org/name-7b", ...)``: a literal, through name bindings
    and parameter defaults (``def main(name="gpt2-xl")``), or the default of the option an attribute reads
    (``model_args.model_name_or_path`` with a dataclass ``field(default="huggyllama/llama-7b")``,
    ``args.model`` with ``add_argument("--model", default=...)``)."""
    return string_through(facts, call_arg(call, 0, "pretrained_model_name_or_path"), order, scope)


def string_through(facts: FileFacts, node: Optional[cst.BaseExpression], order: int, scope: Scope, depth: int = 4) -> Optional[str]:
    """The string ``node`` holds, followed through bindings, parameter defaults (else the argument the first call
    passes), option defaults and string-keyed entries of the file's dicts (``cfg["device"]`` with
    ``CONFIG = {"device": "cuda"}`` handed in as ``cfg``)."""
    text = string_value(node)
    if text is not None or node is None or depth <= 0:
        return text
    if isinstance(node, cst.Subscript):
        entry = _dict_entry(facts, node, order, scope, depth)
        return string_through(facts, entry.value, entry.order, entry.scope, depth - 1) if entry is not None else None
    key = name_key(node)
    if key is not None and (isinstance(node, cst.Name) or key.startswith("self.")):
        binding = facts.binding_at(key, order, scope)
        if binding is not None and binding.kind in ("assign", "param") and binding.value is not None:
            return string_through(facts, binding.value, binding.order, binding.scope, depth - 1)
        if binding is not None and binding.kind == "param":
            passed = facts.param_argument(binding)
            return string_through(facts, *passed, depth - 1) if passed is not None else None
        if binding is not None or isinstance(node, cst.Name):
            return None
    if isinstance(node, cst.Attribute):
        return option_defaults(facts).get(node.attr.value)
    return None


def _dict_entry(facts: FileFacts, subscript: cst.Subscript, order: int, scope: Scope, depth: int):
    """The live entry ``d["key"]`` reads from a dict the file builds; ``d`` may be a parameter without a default
    (followed to the argument the first call passes)."""
    if len(subscript.slice) != 1 or not isinstance(subscript.slice[0].slice, cst.Index):
        return None
    wanted = string_value(subscript.slice[0].slice.value)
    container: Optional[cst.BaseExpression] = subscript.value
    for _ in range(depth):
        key = name_key(container)
        binding = facts.binding_at(key, order, scope) if key is not None else None
        if binding is None or binding.kind != "param" or binding.value is not None:
            break
        passed = facts.param_argument(binding)
        if passed is None:
            return None
        container, order, scope = passed
    contents = facts.dict_contents(container, order, scope) if wanted is not None else None
    return contents.entries.get(wanted) if contents is not None else None


def option_defaults(facts: FileFacts) -> dict[str, str]:
    """Option name -> its string default, from dataclass fields (``name: str = field(default="x")`` or
    ``= "x"``) and ``add_argument("--name", default="x")`` calls; names with two different defaults are left
    out. Computed once per file."""
    cached = getattr(facts, "_option_defaults", None)
    if cached is not None:
        return cached
    found: dict[str, set[str]] = {}
    for class_scope in facts.classes.values():
        for name, bindings in class_scope.bindings.items():
            for binding in bindings:
                if binding.scope is not class_scope or binding.kind != "assign" or "." in name:
                    continue
                value = binding.value
                if isinstance(value, cst.Call) and (facts.qualname(value.func) or "").endswith("field"):
                    value = call_arg(value, keyword="default")
                text = string_value(value)
                if text is not None:
                    found.setdefault(name, set()).add(text)
    for site in facts.method_calls("add_argument"):
        text = string_value(call_arg(site.node, keyword="default"))
        if text is None:
            continue
        for name in _option_names(site):
            found.setdefault(name, set()).add(text)
    result = {name: next(iter(texts)) for name, texts in found.items() if len(texts) == 1}
    facts._option_defaults = result  # type: ignore[attr-defined]
    return result


def _option_names(site: CallSite) -> set[str]:
    """The attribute names ``add_argument(...)`` stores under: its ``dest``, else each ``--long`` flag with dashes
    turned into underscores."""
    flags = [string_value(a.value) for a in site.node.args if a.keyword is None]
    dest = string_value(call_arg(site.node, keyword="dest"))
    return {dest} if dest else {f.lstrip("-").replace("-", "_") for f in flags if f and f.startswith("--")}


def option_default_expression(
    facts: FileFacts, attribute: cst.Attribute, order: int, scope: Scope
) -> Optional[tuple[cst.BaseExpression, int, Scope]]:
    """(expression, order, scope) of the default of the argparse option ``args.<name>`` reads
    (``add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")``), when ``args`` holds
    what ``parse_args()`` returned and exactly one ``add_argument`` of the file declares that option with a
    default."""
    if not parsed_options(facts, attribute.value, order, scope):
        return None
    name = attribute.attr.value
    declared = []
    for site in facts.method_calls("add_argument"):
        if name in _option_names(site):
            declared.append(site)
    if len(declared) != 1:
        return None
    default = call_arg(declared[0].node, keyword="default")
    return (default, declared[0].order, declared[0].scope) if default is not None else None


_PARSE_METHODS = ("parse_args", "parse_known_args")


def parsed_options(facts: FileFacts, node: Optional[cst.CSTNode], order: int, scope: Scope, depth: int = 0) -> bool:
    """``node`` holds the namespace ``parser.parse_args()`` returns: directly, through names, through every call of
    the file that passes it for a parameter, or returned by the file's own helper (``args = parse_args()``)."""
    if node is None or depth > 4:
        return False
    if isinstance(node, cst.Call):
        if isinstance(node.func, cst.Attribute) and node.func.attr.value in _PARSE_METHODS:
            return True
        site = facts.call_site(node)
        returned = [r for callee in (facts.callee_scopes(site) if site is not None else ())
                    for r in facts.returns.get(id(callee), ()) if r.value is not None]
        return bool(returned) and all(parsed_options(facts, r.value, r.order, r.scope, depth + 1) for r in returned)
    sources = facts.follow_name(node, order, scope) or []
    return bool(sources) and all(parsed_options(facts, *source, depth + 1) for source in sources)


# Checkpoints whose size is a word, not a number (the model cards' parameter counts): T5 v1.1 / Flan-T5 XL and
# XXL, mT5 XL and XXL, Flan-UL2.
_SIZE_BY_NAME = (
    (re.compile(r"^(?:flan-)?t5-(?:v1_1-)?xxl(?:-[\w.-]+)?$", re.IGNORECASE), 11.3e9),
    (re.compile(r"^(?:flan-)?t5-(?:v1_1-)?xl(?:-[\w.-]+)?$", re.IGNORECASE), 2.85e9),
    (re.compile(r"^mt5-xxl$", re.IGNORECASE), 13e9),
    (re.compile(r"^mt5-xl$", re.IGNORECASE), 3.7e9),
    (re.compile(r"^flan-ul2$", re.IGNORECASE), 19.5e9),
    # GPT-2's sizes are words, not numbers (config.json: n_layer/n_embd 48/1600, 36/1280, 24/1024)
    (re.compile(r"^gpt2-xl$", re.IGNORECASE), 1.558e9),
    (re.compile(r"^gpt2-large$", re.IGNORECASE), 7.74e8),
    (re.compile(r"^gpt2-medium$", re.IGNORECASE), 3.55e8),
)


def params_from_name(name: Optional[str]) -> Optional[float]:
    """``meta-llama/Llama-2-7b-chat-hf`` -> 7e9; ``bloom-560m`` -> 5.6e8; None when the name says nothing.

    Only the last path component is read, and only a size written as a separate token (``7b``, ``13B``,
    ``1.5b``, ``560m``); mixtures (``8x7B``) are not guessed."""
    if not name:
        return None
    last = name.rstrip("/").split("/")[-1]
    for pattern, size in _SIZE_BY_NAME:
        if pattern.match(last):
            return size
    sizes = [float(m.group(1)) * (1e9 if m.group(2) in "bB" else 1e6) for m in _SIZE_IN_NAME.finditer(last)]
    if len(sizes) != 1:
        return None
    return sizes[0]


# -- which kind of language model a file trains (GD3xx) ---------------------------------------

_SEQ2SEQ_TOOLS = {"Seq2SeqTrainer", "Seq2SeqTrainingArguments"}  # trainer classes, not models
_SEQ2SEQ_EXTRA = {"EncoderDecoderModel"} | _SEQ2SEQ_TOOLS


def model_class_names(facts: FileFacts) -> set[str]:
    """HF model classes the file imports or calls (``AutoModelForCausalLM``, ``T5ForConditionalGeneration``)."""
    names: set[str] = set()
    qualnames = set(facts.imported_names()) | {c.qualname for c in facts.calls if c.qualname}
    for q in qualnames:
        parts = q.split(".")
        if parts[0] not in ("transformers", "peft", "trl"):
            continue
        for part in parts[1:]:
            if part[:1].isupper():
                if part in _SEQ2SEQ_EXTRA or (apis.is_model_class(part) and not part.startswith("DataCollator")):
                    names.add(part)
                break
    return names


def language_model_kind(facts: FileFacts) -> Optional[str]:
    """"causal" when the file uses a causal-LM class and nothing sequence-to-sequence; "seq2seq" when it
    uses only encoder-decoder classes; "mixed" for both; None when it shows neither."""
    names = model_class_names(facts)
    causal = any(apis.is_causal_lm_class(n) or n.endswith("ForCausalLMWithValueHead") for n in names)
    causal = causal or _loads_remote_causal_lm(facts)
    seq2seq_model = any((apis.is_seq2seq_class(n) or n == "EncoderDecoderModel") and n not in _SEQ2SEQ_TOOLS for n in names)
    if causal and seq2seq_model:
        return "mixed"
    if causal:
        # ``Seq2SeqTrainer`` / ``Seq2SeqTrainingArguments`` around a causal LM (transformers#12259: distilgpt2 under
        # Seq2SeqTrainer) still train a causal LM: the trainer class does not change what the model's loss does.
        return "causal"
    return "seq2seq" if seq2seq_model or any(n in _SEQ2SEQ_TOOLS for n in names) else None


def _loads_remote_causal_lm(facts: FileFacts) -> bool:
    """``AutoModel.from_pretrained("THUDM/chatglm3-6b", trust_remote_code=True)``: a bare ``AutoModel`` whose
    checkpoint's remote code is a causal LM (``apis.REMOTE_CAUSAL_LM_CHECKPOINT``)."""
    for site in facts.calls_to("transformers.AutoModel.from_pretrained"):
        name = checkpoint_name(facts, site.node, site.order, site.scope)
        if name is not None and apis.REMOTE_CAUSAL_LM_CHECKPOINT.search(name):
            return True
    return False


def with_kwarg(call: cst.Call, keyword: str, value: cst.BaseExpression) -> cst.Call:
    """``call`` with ``keyword=value`` appended, keeping the call's layout (one line or one arg a line)."""
    new_arg = cst.Arg(
        keyword=cst.Name(keyword),
        value=value,
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
    )
    args = list(call.args)
    if not args:
        return call.with_changes(args=[new_arg])
    last = args[-1]
    if isinstance(last.comma, cst.Comma):
        # Trailing comma (usually one arg a line): the new arg takes the closing layout, the old last arg
        # takes the separator the others use.
        separator = args[-2].comma if len(args) > 1 and isinstance(args[-2].comma, cst.Comma) else cst.Comma(
            whitespace_after=cst.SimpleWhitespace(" ")
        )
        args[-1] = last.with_changes(comma=separator)
        new_arg = new_arg.with_changes(comma=last.comma)
    else:
        new_arg = new_arg.with_changes(whitespace_after_arg=last.whitespace_after_arg)
        args[-1] = last.with_changes(
            comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")), whitespace_after_arg=cst.SimpleWhitespace("")
        )
    return call.with_changes(args=[*args, new_arg])


# What a file says about its GPUs, in comments, strings or a pasted OOM message.
# "6x RTX 3070 Ti (8 GB each)", "2 x A100 80GB", "4×24GB"
_COUNT_AND_SIZE = re.compile(r"\b(\d{1,2})\s*[x×]\s*[^\n,;=]{0,30}?(\d{1,3}(?:\.\d+)?)\s*(GB|GiB|G)\b", re.IGNORECASE)
# "a 24 GB GPU", "16GB VRAM", "8 GB 显存"
_SIZE_GPU = re.compile(r"\b(\d{1,3}(?:\.\d+)?)\s*(GB|GiB)\s*(?:of\s+)?(?:GPU|VRAM|video memory|显存|graphics card)", re.IGNORECASE)
# A pasted OOM message: "GPU 0 has a total capacty of 7.58 GiB"
_OOM_CAPACITY = re.compile(r"GPU \d+ has a total capac\w* of (\d+(?:\.\d+)?) GiB")
# "8 GB each", "24GB per GPU"
_SIZE_EACH = re.compile(r"\b(\d{1,3}(?:\.\d+)?)\s*(GB|GiB)\b[^\n]{0,20}?\b(?:each|per (?:GPU|card))\b", re.IGNORECASE)
# GPU models -> memory in GB (the smallest common variant), for files that only name their hardware.
_GPU_MEMORY_GB = hardware.nominal_gb_by_family()
_GPU_NAME = re.compile(
    r"\b(?:RTX\s*|GTX\s*|Tesla\s*|NVIDIA\s*)?(" + "|".join(sorted(_GPU_MEMORY_GB, key=len, reverse=True)) + r")(?:\s*Ti)?\b"
)
_GIB_PER_GB = 1.0737  # 1 GiB = 1.0737 GB
# A card named with its size: "NVIDIA A100-SXM4-80GB", "A100 80GB", "A100-80G", "V100-SXM2-32GB"
_GPU_NAME_SIZE = re.compile(
    r"\b(?:RTX\s*|GTX\s*|Tesla\s*|NVIDIA\s*)?(?:" + "|".join(sorted(_GPU_MEMORY_GB, key=len, reverse=True))
    + r")(?:[\s-]*(?:Ti|SXM\d?|PCIe|NVL))*[\s-]*(\d{2,3})\s*G(?:B|iB)?\b",
    re.IGNORECASE,
)


_STATED_GPUS_LAST: list = [None, None, None]  # (source, model_names, answer) of the last call: rules share it


def stated_gpus(source: str, model_names: bool = False) -> Optional[tuple[int, float, str]]:
    """(number of GPUs, GB per GPU, the text that says so), as far as the file states it.

    ``model_names``: also accept "8 GB each" and a bare GPU model ("RTX 3070 Ti" -> 8 GB, count 1).
    """
    last = _STATED_GPUS_LAST
    if last[0] is source and last[1] == model_names:
        return last[2]
    answer = _stated_gpus(source, model_names)
    last[:] = [source, model_names, answer]
    return answer


def _stated_gpus(source: str, model_names: bool) -> Optional[tuple[int, float, str]]:
    match = _COUNT_AND_SIZE.search(source)
    if match and not re.match(r"\s*(RAM|memory\b(?! of the GPU))", source[match.end() : match.end() + 8], re.IGNORECASE):
        size = float(match.group(2)) * (_GIB_PER_GB if match.group(3).lower() == "gib" else 1.0)
        return int(match.group(1)), size, match.group(0)
    match = _OOM_CAPACITY.search(source)
    if match:
        return 1, float(match.group(1)) * _GIB_PER_GB, match.group(0)
    match = _SIZE_GPU.search(source)
    if match:
        size = float(match.group(1)) * (_GIB_PER_GB if match.group(2).lower() == "gib" else 1.0)
        return 1, size, match.group(0)
    if not model_names:
        return None
    match = _GPU_NAME_SIZE.search(source)
    if match:
        count, text = _count_around(source, match)
        return count, float(match.group(1)), text
    match = _SIZE_EACH.search(source)
    if match:
        size = float(match.group(1)) * (_GIB_PER_GB if match.group(2).lower() == "gib" else 1.0)
        return 1, size, match.group(0).strip()
    counted = _COMPACT_COUNT_NAME.search(source) or _PLURAL_NAME.search(source)
    if counted and counted.group(2) in _GPU_MEMORY_GB:
        count = int(counted.group(1)) if counted.group(1).isdigit() else 2
        return count, float(_GPU_MEMORY_GB[counted.group(2)]), counted.group(0).strip()
    named = _GPU_NAME.search(source)
    if named:
        count, text = _count_around(source, named)
        return count, float(_GPU_MEMORY_GB[named.group(1)]), text
    return None


# How many of a named card: "2x RTX 3090", "2 x T4", "two T4s", "dual 3090" before it; Kaggle's accelerator
# label "GPU T4 x2" after it.
_COUNT_BEFORE = re.compile(r"(?:\b(\d{1,2})\s*[x×]|\b(two|dual))\s*(?:NVIDIA\s*)?$", re.IGNORECASE)
_COUNT_AFTER = re.compile(r"^(?:\s*GPUs?)?\s*[x×]\s*(\d{1,2})\b", re.IGNORECASE)


# The forms the name pattern's word boundaries miss: "2xT4" (the launcher/--gpus spelling), "two T4s" (a plural).
_GPU_NAMES_ALTERNATION = "|".join(sorted(_GPU_MEMORY_GB, key=len, reverse=True))
_COMPACT_COUNT_NAME = re.compile(r"\b(\d{1,2})[x×](" + _GPU_NAMES_ALTERNATION + r")(?:\s*Ti)?\b")
_PLURAL_NAME = re.compile(r"\b(\d{1,2}|two|dual)\s+(" + _GPU_NAMES_ALTERNATION + r")s\b", re.IGNORECASE)


def _count_around(source: str, match: re.Match) -> tuple[int, str]:
    """(how many cards the text around a card's name states, the text that says so)."""
    start = max(0, match.start() - 16)
    before = _COUNT_BEFORE.search(source[start : match.start()])
    if before:
        return (int(before.group(1)) if before.group(1) else 2), source[start + before.start() : match.end()].strip()
    after = _COUNT_AFTER.match(source[match.end() : match.end() + 12])
    if after:
        return int(after.group(1)), source[match.start() : match.end() + after.end()].strip()
    return 1, match.group(0).strip()


_DTYPE_BYTES = {"float16": 2, "half": 2, "bfloat16": 2, "float32": 4, "float": 4}


# Checkpoints published in float32 whose config names no dtype: transformers 5's `dtype="auto"` then reads the
# weights' own dtype (modeling_utils.py `_get_dtype` -> `get_state_dict_dtype`), so they load in float32.
# GPT-2: model.safetensors is F32 (gpt2-xl's file is 6.4 GB for 1.56B parameters).
_FLOAT32_CHECKPOINTS = (re.compile(r"^(?:distil)?gpt2(?:-medium|-large|-xl)?$", re.IGNORECASE),)


def weight_bytes(facts: FileFacts, call: cst.Call, value: Optional[Value] = None) -> tuple[int, str]:
    """Bytes per weight of the model ``call`` loads (a ``.half()``-style cast on ``value`` first, then
    ``dtype=``, then the installed transformers' default), and a note saying which applied."""
    from gpudoctor.check import versions
    from gpudoctor.check.facts import TRAIT_CAST

    cast = value.trait(TRAIT_CAST) if value is not None else None
    if cast and cast[0] in _DTYPE_BYTES:
        return _DTYPE_BYTES[cast[0]], f"`{cast[0]}` weights"
    dtype = call_arg(call, keyword="dtype") or call_arg(call, keyword="torch_dtype")
    if dtype is not None:
        q = facts.qualname(dtype) or ""
        name = q.split(".")[-1] if q.startswith("torch.") else string_value(dtype) or ""
        if name in _DTYPE_BYTES:
            return _DTYPE_BYTES[name], f"`{name}` weights"
    version = versions.major_minor(versions.assumed("transformers")[0]) or (5, 0)
    if version >= (5, 0):
        site = facts.call_site(call)
        name = checkpoint_name(facts, call, site.order, site.scope) if site is not None else None
        last = name.rstrip("/").split("/")[-1] if name else ""
        if any(pattern.match(last) for pattern in _FLOAT32_CHECKPOINTS):
            return 4, f"{versions.describe('transformers')} loads the checkpoint's dtype (`dtype=\"auto\"`): `{name}` is stored in float32"
        return 2, f"{versions.describe('transformers')} loads the checkpoint's dtype (`dtype=\"auto\"`); 16-bit assumed"
    return 4, f"{versions.describe('transformers')} loads float32 unless `dtype=` is given"


# -- sizes for device-map arithmetic (GD109) -----------------------------------------------------


def model_size(facts: FileFacts, model: Optional[cst.BaseExpression], order: int, scope: Scope) -> Optional[tuple[float, int, str, str]]:
    """(parameters, bytes per weight, checkpoint name, dtype note) of the ``from_pretrained`` model an
    expression holds (through variables, helpers and parameters), when its checkpoint name gives its size."""
    if model is None:
        return None
    value = facts.value(model, order, scope)
    origin = value.origin()
    if value.kind != "model" or not isinstance(origin.node, cst.Call):
        return None
    load = facts.call_site(origin.node)
    name = checkpoint_name(facts, origin.node, load.order, load.scope) if load else None
    params = params_from_name(name)
    if params is None or name is None:
        return None
    per_weight, note = weight_bytes(facts, origin.node, value)
    return params, per_weight, name, note


_MEMORY_TEXT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GiB|GB|MiB|MB|KiB|KB)?\s*$", re.IGNORECASE)
_MEMORY_UNIT = {"gib": 1024**3, "gb": 1000**3, "mib": 1024**2, "mb": 1000**2, "kib": 1024, "kb": 1000, None: 1}


def max_memory_budget(facts: FileFacts, node: Optional[cst.BaseExpression], order: int, scope: Scope) -> Optional[tuple[int, str]]:
    """Total bytes of the GPU and CPU entries of a ``max_memory`` dict (``{0: "22GiB", "cpu": "30GiB"}``;
    through a name, or ``get_balanced_memory(..., max_memory={...})``, which only lowers GPU budgets), and
    its source text; None when any entry or the dict itself is not literal, or it has a "disk" entry."""
    entries = max_memory_entries(facts, node, order, scope)
    if entries is None or "disk" in entries[0]:
        return None
    return sum(entries[0].values()), entries[1]


def max_memory_entries(facts: FileFacts, node: Optional[cst.BaseExpression], order: int, scope: Scope) -> Optional[tuple[dict, str]]:
    """({device: bytes}, source text) of a literal ``max_memory`` dict (through names and
    ``get_balanced_memory(..., max_memory={...})``); devices are ``"cpu"``, ``"disk"``, GPU indexes and
    ``"cuda:N"`` strings as written (a key in a variable, ``{local_rank: "20GiB"}``, as its source text). None when
    the dict or any amount is not literal."""
    for _ in range(4):
        if isinstance(node, (cst.Name, cst.Attribute)) and name_key(node) is not None:
            binding = facts.binding_at(name_key(node), order, scope)
            if binding is None or binding.kind != "assign" or binding.value is None:
                return None
            node, order, scope = binding.value, binding.order, binding.scope
        elif isinstance(node, cst.Call) and (facts.qualname(node.func) or "").endswith("get_balanced_memory"):
            node = call_arg(node, 1, "max_memory")
        else:
            break
    if not isinstance(node, cst.Dict) or not node.elements:
        return None
    entries = {}
    for element in node.elements:
        if not isinstance(element, cst.DictElement):
            return None
        device = string_value(element.key)
        device = device if device is not None else int_value(element.key)
        amount = int_value(element.value)
        if amount is None:
            match = _MEMORY_TEXT.match(string_value(element.value) or "")
            if match is None:
                return None
            amount = int(float(match.group(1)) * _MEMORY_UNIT[match.group(2).lower() if match.group(2) else None])
        entries[device if device is not None else _plain(facts, element.key)] = amount  # a GPU index in a variable
    return entries, _plain(facts, node)


_LAUNCH_MODE_TEST = re.compile(
    r"(?<![a-z])(?:rank|world|ddp|distributed|process(?:es)?|num_gpus|device_count)(?![a-z])", re.IGNORECASE
)


def device_map_chosen_per_launch(facts: FileFacts, site: CallSite, expr: Optional[cst.BaseExpression] = None) -> bool:
    """The device map of the load ``site`` (``expr``: its ``device_map`` argument, found when not given) depends on
    the launch mode: an ``if`` on rank/world size, or a name bound to different maps (bound twice to the same
    "auto" is no choice). With several processes such a file gives each rank its own map (GD101, GD107)."""
    if expr is None:
        expr = facts.keyword_argument(site.node, "device_map", site.order, site.scope)
        if expr is None:
            return False
    frames = list(site.context)
    if call_arg(site.node, keyword="device_map") is not expr:  # from a ``**kwargs`` dict: where it was filled
        for contents in facts.kwargs_contents(site.node, site.order, site.scope):
            if contents.bindings:
                binding = contents.bindings[-1]
                frames += list(binding.context)
                if sum(b.kind != "param" for b in binding.scope.bindings.get(binding.key, [])) > 1:
                    return True  # ``kwargs = {...}`` bound twice (per launch mode, say)
            frames += [f for entry in contents.entries.values() for f in entry.context]
    key = name_key(expr)
    if key is not None:
        binding = facts.binding_at(key, site.order, site.scope)
        if binding is None:
            return True
        frames += list(binding.context)
        scope_bindings = binding.scope.bindings.get(key, [])
        assigned = [b for b in scope_bindings if b.kind != "param"]
        if len(assigned) > 1 and not all(_same_auto_map(facts, b) for b in assigned):
            return True
        for param in (b for b in scope_bindings if b.kind == "param"):
            # a parameter: a choice per launch unless every call of the function passes the same automatic map
            passed = list(facts.param_arguments(param))
            if not passed or len(passed) != len(facts.call_sites_of(param.scope)):
                return True
            for argument, order, scope in passed:
                device_map = facts.device_map(argument, order, scope)
                if device_map is None or device_map.strategy != "auto":
                    return True
    return any(isinstance(f, IfFrame) and _tests_launch_mode(facts, f.test) for f in frames)


def _tests_launch_mode(facts: FileFacts, test: cst.BaseExpression, depth: int = 0) -> bool:
    """The ``if`` test reads the launch mode: its text names rank/world size/``ddp``/the GPU count, or a name in it
    is assigned from one (``ddp = world_size != 1`` with ``world_size = int(os.environ["WORLD_SIZE"])``, whatever
    the names are called), followed two assignments back."""
    if _LAUNCH_MODE_TEST.search(facts.module.code_for_node(test)):
        return True
    if depth >= 2:
        return False
    names = {n.value for n in _names_in(test)}
    scopes = (facts.module_scope, *facts.functions)
    return any(
        binding.value is not None and _tests_launch_mode(facts, binding.value, depth + 1)
        for name in names for scope in scopes for binding in scope.bindings.get(name, ())
        if binding.kind in ("assign", "augassign")
    )


def _names_in(node: cst.CSTNode) -> Iterator[cst.Name]:
    if isinstance(node, cst.Name):
        yield node
    elif isinstance(node, cst.Attribute):
        yield from _names_in(node.value)  # ``args.ddp``: the object's name (its attribute is read as text above)
    else:
        for child in node.children:
            yield from _names_in(child)


def _same_auto_map(facts: FileFacts, binding) -> bool:
    """The binding stores an automatic map (``"auto"``, ``"balanced"`` ...), not a per-rank one."""
    if binding.value is None:
        return False
    device_map = facts.device_map(binding.value, binding.order, binding.scope)
    return device_map is not None and device_map.strategy == "auto"
