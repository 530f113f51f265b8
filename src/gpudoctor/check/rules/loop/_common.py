"""Questions the training-loop rules (GD4xx) share: which loop a call runs in, what a loop reaches
through the file's own helper functions, whether a call is guarded by a gradient-accumulation test."""

from __future__ import annotations

import re
from typing import Iterable, Optional

import libcst as cst

from gpudoctor.check.facts import PASS_ITEMS, CallSite, FileFacts, FunctionFrame, IfFrame, LoopFrame, Scope, name_key

_OPTIMIZER_NAME = re.compile(r"(^|[._])(opt|optim|optimizer|optimiser)s?(_\w+)?$|optimizer", re.IGNORECASE)
_SCHEDULER_NAME = re.compile(r"sched", re.IGNORECASE)
_ACCUM_WORD = re.compile(r"accum|grad_acc|accumulat", re.IGNORECASE)


def innermost_loop(site) -> Optional[LoopFrame]:
    for frame in reversed(site.context):
        if isinstance(frame, LoopFrame):
            return frame
        if isinstance(frame, FunctionFrame):
            return None  # a loop outside the function does not run the function's body per iteration
    return None


def in_loop(site, loop: LoopFrame) -> bool:
    return any(f is loop for f in site.context)


def frames_inside(site, loop: Optional[LoopFrame]) -> list:
    """The frames of ``site`` nested inside ``loop`` (all frames when loop is None)."""
    if loop is None:
        return list(site.context)
    for i, frame in enumerate(site.context):
        if frame is loop:
            return list(site.context[i + 1 :])
    return []


def is_accumulation_test(facts: FileFacts, test: cst.BaseExpression, depth: int = 0) -> bool:
    """``(step + 1) % accum == 0``, ``step % args.gradient_accumulation_steps == 0``, ``if accumulate_done:``,
    also through a name assigned such a test (``sync = micro_step == grad_accum - 1`` ... ``if sync:``)."""
    text = facts.module.code_for_node(test)
    if _ACCUM_WORD.search(text) or _has_modulo(test) or _last_inner_iteration(facts, test):
        return True
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        test = test.expression
    if depth < 4 and name_key(test) is not None:
        binding = facts.assignment_of(test, *facts._position_of(test))
        if binding is not None and isinstance(
            binding.value, (cst.Comparison, cst.BooleanOperation, cst.UnaryOperation, cst.Name, cst.Attribute)
        ):
            return is_accumulation_test(facts, binding.value, depth + 1)
    return False


def _last_inner_iteration(facts: FileFacts, test: cst.BaseExpression) -> bool:
    """``i == n - 1`` (or ``i + 1 == n``) where ``i`` is the target of a ``for i in range(n)`` loop of the file: the
    last of n micro-steps, what an optimizer step guarded by it accumulates over."""
    if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1 and isinstance(test.comparisons[0].operator, cst.Equal)):
        return False
    code = facts.module.code_for_node
    sides = (test.left, test.comparisons[0].comparator)
    for index, bound in (sides, sides[::-1]):
        if isinstance(index, cst.BinaryOperation) and isinstance(index.operator, cst.Add):
            index, one = index.left, index.right
        elif isinstance(bound, cst.BinaryOperation) and isinstance(bound.operator, cst.Subtract):
            bound, one = bound.left, bound.right
        else:
            continue
        if not (isinstance(index, cst.Name) and isinstance(one, cst.Integer) and one.value == "1"):
            continue
        for loop in facts.loops:
            node = loop.node
            if not (isinstance(node, cst.For) and isinstance(node.target, cst.Name) and node.target.value == index.value):
                continue
            it = node.iter
            if isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and it.func.value == "range" and it.args:
                if code(it.args[-1 if len(it.args) <= 2 else 1].value) == code(bound):
                    return True
    return False


def _has_modulo(node: cst.CSTNode) -> bool:
    if isinstance(node, cst.BinaryOperation):
        if isinstance(node.operator, cst.Modulo) and not isinstance(node.left, (cst.SimpleString, cst.FormattedString)):
            return True
        return _has_modulo(node.left) or _has_modulo(node.right)
    if isinstance(node, cst.Comparison):
        return _has_modulo(node.left) or any(_has_modulo(c.comparator) for c in node.comparisons)
    if isinstance(node, cst.BooleanOperation):
        return _has_modulo(node.left) or _has_modulo(node.right)
    if isinstance(node, cst.UnaryOperation):
        return _has_modulo(node.expression)
    return False


def accumulation_guard(facts: FileFacts, site, loop: Optional[LoopFrame]) -> Optional[IfFrame]:
    for frame in frames_inside(site, loop):
        if isinstance(frame, IfFrame) and is_accumulation_test(facts, frame.test):
            return frame
    return None


def receiver_kind(facts: FileFacts, site: CallSite) -> str:
    if site.receiver is None:
        return "unknown"
    return facts.value(site.receiver, site.order, site.scope).kind


def is_optimizer_call(facts: FileFacts, site: CallSite) -> bool:
    """``optimizer.step()`` / ``opt.zero_grad()``: the receiver evaluates to an optimizer, or is named like one."""
    if site.receiver is None:
        return False
    kind = receiver_kind(facts, site)
    if kind == "optimizer":
        return True
    if kind != "unknown":
        return False
    text = _receiver_text(site.receiver)
    if text and _OPTIMIZER_NAME.search(text) and not _SCHEDULER_NAME.search(text):
        return True
    return _steps_and_zeroes(facts, site)


def _steps_and_zeroes(facts: FileFacts, site: CallSite) -> bool:
    """An unknown object whose ``.step()`` and ``.zero_grad()`` are both called in one function is used as an
    optimizer (a module has no ``step``, a scheduler no ``zero_grad``), whatever its name; a GradScaler's
    ``scaler.step(opt)`` steps it too."""
    key = name_key(site.receiver)
    if key is None:
        return False
    methods = {c.method for c in facts._calls_on_key.get(key, ()) if c.scope is site.scope}
    if "zero_grad" in methods and "step" not in methods and any(
        c.scope is site.scope and c.node.args and name_key(c.node.args[0].value) == key
        and receiver_kind(facts, c) == "grad_scaler"
        for c in facts.method_calls("step")
    ):
        methods.add("step")
    return {"step", "zero_grad"} <= methods


def is_scheduler_call(facts: FileFacts, site: CallSite) -> bool:
    if site.receiver is None:
        return False
    kind = receiver_kind(facts, site)
    if kind == "scheduler":
        return True
    if kind != "unknown":
        return False
    text = _receiver_text(site.receiver)
    return bool(text and _SCHEDULER_NAME.search(text.split(".")[-1]))


def _receiver_text(node: cst.CSTNode) -> Optional[str]:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        head = _receiver_text(node.value)
        return f"{head}.{node.attr.value}" if head else node.attr.value
    return None


def trainer_trains(facts: FileFacts) -> bool:
    """A transformers/trl trainer's ``.train()`` is called somewhere in the file."""
    return any(facts.value(c.receiver, c.order, c.scope).kind == "trainer" for c in facts.method_calls("train"))


def trainer_trained(facts: FileFacts, site: CallSite) -> bool:
    """The trainer the construction ``site`` builds has ``.train()`` called on it (through a name, or on the
    construction itself: ``DPOTrainer(...).train()``); a trainer only evaluated trains nothing."""
    for call in facts.method_calls("train"):
        if call.receiver is None or call.order <= site.order:
            continue
        if call.receiver is site.node:
            return True
        value = facts.value(call.receiver, call.order, call.scope)
        if value.kind == "trainer" and value.node is site.node:
            return True
    return False


def is_backward(facts: FileFacts, site: CallSite) -> bool:
    """``loss.backward()``, ``scaler.scale(loss).backward()``, ``accelerator.backward(loss)``, ``torch.autograd.backward``."""
    if site.qualname == "torch.autograd.backward":
        return True
    return site.method == "backward" and site.qualname is None and site.receiver is not None


# -------------------------------------------------------------------- helper functions


def calls_in_function(facts: FileFacts, scope: Scope) -> list[CallSite]:
    index = getattr(facts, "_gd4_calls_by_function", None)
    if index is None:
        index = {}
        for site in facts.calls:
            for frame in site.context:
                if isinstance(frame, FunctionFrame):
                    index.setdefault(id(frame.scope), []).append(site)
        facts._gd4_calls_by_function = index
    return index.get(id(scope), [])


def reach(facts: FileFacts, loop: LoopFrame, depth: int = 2) -> list[tuple[CallSite, Optional[CallSite]]]:
    """Calls that run in ``loop``: (call, the loop's call into a helper that runs it, or None when direct)."""
    out: list[tuple[CallSite, Optional[CallSite]]] = []
    direct = [c for c in facts.calls if loop.order < c.order <= loop.end_order and in_loop(c, loop)]
    seen: set[int] = set()
    for site in direct:
        out.append((site, None))
        _descend(facts, site, site, depth, out, seen)
    return out


def _descend(facts, site, via, depth, out, seen) -> None:
    if depth <= 0:
        return
    for scope in facts.callee_scopes(site):
        if id(scope) in seen:
            continue
        seen.add(id(scope))
        for inner in calls_in_function(facts, scope):
            out.append((inner, via))
            _descend(facts, inner, via, depth - 1, out, seen)


def calling_loops(facts: FileFacts, scope: Scope, depth: int = 3) -> list[tuple[LoopFrame, CallSite]]:
    """The loops that run the file's own function ``scope`` through at most ``depth`` calls: (the loop, the
    loop's call that leads into ``scope``). ``for batch in loader: self.train_step(batch)`` runs the body of
    ``train_step`` once per batch."""
    out: list[tuple[LoopFrame, CallSite]] = []
    seen: set[int] = set()

    def climb(target: Scope, level: int) -> None:
        if level <= 0 or target.kind != "function" or id(target) in seen:
            return
        seen.add(id(target))
        for call in facts.call_sites_of(target):
            loop = innermost_loop(call)
            if loop is not None:
                out.append((loop, call))
            elif call.scope.kind == "function":
                climb(call.scope, level - 1)

    climb(scope, depth)
    return out


def trainer_in_file(facts: FileFacts) -> bool:
    return bool(facts.trainer_calls())


def first(iterable: Iterable):
    for item in iterable:
        return item
    return None


_SCALER_NAME = re.compile(r"scaler", re.IGNORECASE)


def is_optimizer_step(facts: FileFacts, site: CallSite) -> bool:
    """``optimizer.step()`` or ``scaler.step(optimizer)`` (a GradScaler steps the optimizer it is given)."""
    if site.method != "step":
        return False
    if is_optimizer_call(facts, site):
        return True
    if site.receiver is None or not site.node.args:
        return False
    if receiver_kind(facts, site) == "grad_scaler":
        return True  # GradScaler.step(optimizer)
    text = _receiver_text(site.receiver) or ""
    if not _SCALER_NAME.search(text.split(".")[-1]):
        return False
    arg = site.node.args[0].value
    text = _receiver_text(arg) or ""
    return facts.value(arg, site.order, site.scope).kind == "optimizer" or bool(_OPTIMIZER_NAME.search(text))


def is_zero_grad(facts: FileFacts, site: CallSite) -> bool:
    """``optimizer.zero_grad()`` or ``model.zero_grad()``."""
    if site.method != "zero_grad" or site.receiver is None:
        return False
    if is_optimizer_call(facts, site):
        return True
    kind = receiver_kind(facts, site)
    if kind == "model":
        return True
    text = (_receiver_text(site.receiver) or "").split(".")[-1].lower()
    return kind == "unknown" and ("model" in text or "net" in text)




def parameters_held_by(facts: FileFacts, name: cst.BaseExpression, order: int, scope: Scope) -> Optional[cst.BaseExpression]:
    """The module whose parameters ``name`` holds one at a time, else None: ``p`` of ``for p in
    model.parameters()`` -> ``model``, seen through ``enumerate``/``tqdm``/``zip``, ``for n, p in
    model.named_parameters()``, ``it = iter(model.parameters())`` ... ``p = next(it)``, and the file's own
    generators fed with the parameters (what ``facts.source_of`` follows)."""
    key = name_key(name)
    binding = facts.binding_at(key, order, scope) if key is not None else None
    if binding is None or binding.value is None:
        return None
    if binding.kind == "for":
        return _module_of_items(facts, binding.value, binding.order, binding.scope, binding.path)
    value = binding.value
    if binding.kind in ("assign", "unpack") and isinstance(value, cst.Call) and isinstance(value.func, cst.Name) \
            and value.func.value == "next" and value.args:
        return _module_of_items(facts, value.args[0].value, binding.order, binding.scope, binding.path)
    return None


def _module_of_items(facts: FileFacts, iterable: cst.BaseExpression, order: int, scope: Scope,
                     path: tuple[int, ...], depth: int = 0) -> Optional[cst.BaseExpression]:
    """The module when the item of ``iterable`` at ``path`` is one of its parameters."""
    if depth > 6:
        return None
    key = name_key(iterable)
    if key is not None:
        binding = facts.binding_at(key, order, scope)
        if binding is not None and binding.kind == "assign" and isinstance(binding.value, (cst.Call, cst.Name)):
            return _module_of_items(facts, binding.value, binding.order, binding.scope, path, depth + 1)
        if binding is not None and binding.kind == "param":
            passed = facts.param_argument(binding)
            if passed is not None:
                argument, at, caller = passed
                return _module_of_items(facts, argument, at, caller, path, depth + 1)
        return None
    if not isinstance(iterable, cst.Call):
        return None
    func = iterable.func
    args = [a.value for a in iterable.args if a.keyword is None and not a.star]
    if isinstance(func, cst.Attribute) and not iterable.args:
        if func.attr.value == "parameters" and not path:
            return func.value
        if func.attr.value == "named_parameters" and path == (1,):
            return func.value
        return None
    called = facts.qualname(func) or ""
    local = isinstance(func, cst.Name) and called in ("", func.value)
    last = called.split(".")[-1] if called else (func.value if isinstance(func, cst.Name) else "")
    if last in PASS_ITEMS and args and (local or called.split(".")[0] in ("tqdm", "rich")):
        return _module_of_items(facts, args[0], order, scope, path, depth + 1)
    if last == "enumerate" and local and args and path and path[0] == 1:
        return _module_of_items(facts, args[0], order, scope, path[1:], depth + 1)
    if last == "zip" and local and path and path[0] < len(args):
        return _module_of_items(facts, args[path[0]], order, scope, path[1:], depth + 1)
    site = facts.call_site(iterable)
    if site is None or site.qualname is not None:
        return None
    for callee in facts.callee_scopes(site):  # one of the file's generators: what it iterates, for this call
        for yielded in facts.yields.get(id(callee), ()):
            for loop in facts.loops:
                if loop.scope is not callee or not loop.order < yielded.order < loop.end_order \
                        or not isinstance(loop.node, cst.For) or name_key(yielded.value) != name_key(loop.node.target):
                    continue
                source = name_key(loop.iter)
                binding = facts.binding_at(source, yielded.order, callee) if source is not None else None
                if binding is not None and binding.kind == "param" and isinstance(binding.target, cst.Param):
                    argument = facts.argument_for(site, callee, binding.target)
                    if argument is not None:
                        return _module_of_items(facts, argument, site.order, site.scope, path, depth + 1)
    return None
