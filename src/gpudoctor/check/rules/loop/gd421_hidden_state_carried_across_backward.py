from __future__ import annotations

from typing import Iterator, Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import CallSite, FileFacts, FunctionFrame, LoopFrame, Scope, call_arg, name_key
from gpudoctor.check.facts.records import Binding
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import calling_loops, is_backward, reach


class HiddenStateCarriedAcrossBackward(Rule):
    """A recurrent state (``out, h = rnn(x, h)``, ``h = cell(x, h)``, ``out, self.hidden = self.lstm(x,
    self.hidden)``) carried from one training step into the next without ``.detach()``: the next step's graph
    reaches back into the previous step's graph, whose saved tensors the previous ``backward()`` freed, and the
    second ``backward()`` raises."""

    code = "GD421"
    name = "hidden-state-carried-across-backward"
    summary = "Recurrent hidden state carried into the next training step without detach: the second backward fails"
    triggers = ("RNN", "LSTM", "GRU", "CfC", "LTC")

    def check(self, facts: FileFacts):
        if not any(is_backward(facts, site) for site in facts.calls):
            return
        for site in facts.calls:
            carried = _fed_back(facts, site)
            if not carried or facts.under_no_grad(site.context) or not _is_recurrent(facts, site):
                continue
            if _frozen(facts, site):
                continue  # a frozen recurrent module on inputs without grad returns a state without a graph
            finding = self._carried_by_loop(facts, site, carried) or self._kept_on_module(facts, site, carried)
            if finding is not None:
                yield finding

    # ------------------------------------------------------------ ``for ...: out, h = rnn(x, h); loss.backward()``

    def _carried_by_loop(self, facts: FileFacts, site: CallSite, carried: list[Binding]):
        for loop in reversed(_loops_in_function(site)):
            backward = _backward_after(facts, loop, site, _targets(facts, site))
            if backward is None:
                continue
            if _retains_graph(facts, loop):
                return None
            for binding in carried:
                key = binding.key
                initial = facts.binding_at(key, loop.order, site.scope)
                if initial is None or _reset_in_loop(facts, key, loop, site, carried) or _maybe_detached(facts, key, loop, site):
                    continue
                return self._report(facts, site, key, initial, backward)
        return None

    # ------------------------------------------------ ``def forward(self, x): out, self.hidden = self.lstm(x, self.hidden)``

    def _kept_on_module(self, facts: FileFacts, site: CallSite, carried: list[Binding]):
        method = site.scope
        if method.kind != "function" or not method.class_name:
            return None
        if not facts.is_module_class(method.class_name):
            return None
        for binding in carried:
            key = binding.key
            if not key.startswith("self."):
                continue
            attribute = key.split(".", 1)[1]
            bindings = facts.class_attrs.get(method.class_name, {}).get(key, [])
            initial = [b for b in bindings if b.scope.name == "__init__"]
            if not initial or any(b.scope.name != "__init__" and b not in carried for b in bindings):
                continue  # reset (or detached) somewhere outside the constructor
            if _touched_elsewhere(facts, attribute, site):
                continue
            for loop, call in _steps_running(facts, method):
                backward = _backward_after(facts, loop, call, _targets(facts, call))
                if backward is None or _retains_graph(facts, loop) or facts.under_no_grad(call.context):
                    continue
                return self._report(facts, site, key, initial[-1], backward, step=call)
        return None

    def _report(self, facts: FileFacts, site: CallSite, key: str, initial: Binding, backward: CallSite,
                step: Optional[CallSite] = None):
        where = "every call of the model" if step is not None else "every iteration"
        related = [(initial.target, f"`{key}` is initialised once, here, not per step")]
        if step is not None:
            related.append((step.node, "each training step runs the model here"))
        related.append((backward.node, "this backward() frees the step's graph; the next one runs into it through the state"))
        return self.report(
            site.node,
            f"`{snippet(facts, site.node)}` feeds the state it returned on the previous step back in: `{key}` keeps "
            f"the autograd graph of {where} before it, and the previous `backward()` already freed that graph, so "
            "the second backward raises \"RuntimeError: Trying to backward through the graph a second time (or "
            "directly access saved tensors after they have already been freed)\". `retain_graph=True` only hides it: "
            "the graph then grows with every step (memory and time).",
            fix_hint=f"Detach the state between steps (`{key} = {key}.detach()`, or "
            f"`{key} = tuple(s.detach() for s in {key})` for an LSTM's (h, c)), or re-initialise it for every batch.",
            related=tuple(related),
        )


# ---------------------------------------------------------------------------------------------- the call


def _bare_keys(node: Optional[cst.BaseExpression]) -> Iterator[str]:
    """Names (``h``, ``self.hidden``) an argument passes as they are, also inside a tuple ``(h, c)``; not
    ``h.detach()`` or ``repackage_hidden(h)``, which pass something else."""
    key = name_key(node)
    if key is not None:
        yield key
    elif isinstance(node, (cst.Tuple, cst.List)):
        for element in node.elements:
            yield from _bare_keys(element.value)


def _fed_back(facts: FileFacts, site: CallSite) -> list[Binding]:
    """The targets of ``out, h = f(x, h)`` that the call also receives as its state (any argument after the
    input, or a keyword)."""
    passed: set[str] = set()
    for position, arg in enumerate(site.node.args):
        if arg.star or (arg.keyword is None and position == 0):
            continue
        passed.update(_bare_keys(arg.value))
    if not passed:
        return []
    return [b for b in facts._bindings_of_value(site.node) if b.key in passed and b.scope is site.scope]


def _targets(facts: FileFacts, site: CallSite) -> set[str]:
    return {b.key for b in facts._bindings_of_value(site.node) if b.scope is site.scope}


def _is_recurrent(facts: FileFacts, site: CallSite, depth: int = 0) -> bool:
    """The callee is a recurrent module (``nn.LSTM``, ``nn.GRUCell``, ...), or a module class of this file whose
    ``forward`` passes its state parameter to one and returns the state it gets back."""
    built = facts.built_by(site.node.func, site.order, site.scope)
    if built is not None and facts.qualname(built.func) in apis.RECURRENT_MODULES:
        return True
    own_class = _instance_class(facts, site)
    if depth < 2 and own_class is not None:
        return _forward_returns_state(facts, own_class, depth + 1)
    return False


def _instance_class(facts: FileFacts, site: CallSite) -> Optional[str]:
    """The module class of this file whose instance ``site`` calls (``model = Net().to(device)`` ... ``model(x)``)."""
    value = facts.value(site.node.func, site.order, site.scope)
    name = value.trait("class") if value.kind == "model" else None
    if isinstance(name, str) and facts.is_module_class(name):
        return name
    return None


def _forward_returns_state(facts: FileFacts, class_name: str, depth: int) -> bool:
    forward = next((f for f in facts.functions if f.name == "forward" and f.class_name == class_name), None)
    if forward is None:
        return False
    parameters = {key for key, bindings in forward.bindings.items() if any(b.kind == "param" for b in bindings)}
    for inner in facts.calls:
        if inner.scope is not forward or not _is_recurrent(facts, inner, depth):
            continue
        passed = {k for i, a in enumerate(inner.node.args) if a.keyword is not None or i > 0 for k in _bare_keys(a.value)}
        if not passed & parameters:
            continue
        states = {b for b in facts._bindings_of_value(inner.node) if b.scope is forward}
        for returned in facts.returns.get(id(forward), ()):
            for key in _bare_keys(returned.value):
                if facts.binding_at(key, returned.order, forward) in states:
                    return True
    return False


def _frozen(facts: FileFacts, site: CallSite) -> bool:
    """``rnn.requires_grad_(False)``, or ``p.requires_grad = False`` in a loop over ``rnn.parameters()``."""
    callee = facts.module.code_for_node(site.node.func)
    for call in facts.method_calls("requires_grad_"):
        arg = call_arg(call.node, 0, "requires_grad")
        if isinstance(arg, cst.Name) and arg.value == "False" and call.receiver is not None:
            if facts.module.code_for_node(call.receiver) == callee:
                return True
    for assign in facts.attribute_assigns:
        if assign.target.attr.value != "requires_grad" or not (isinstance(assign.value, cst.Name) and assign.value.value == "False"):
            continue
        # what the loop really iterates: ``enumerate(rnn.parameters())``, ``next(it)`` on ``iter(...)``, ...
        iterated = [facts.iterated(f) for f in assign.context if isinstance(f, LoopFrame)]
        if any(seen is not None and facts.module.code_for_node(seen[0]).startswith(callee + ".") for seen in iterated):
            return True
    return False


# ---------------------------------------------------------------------------------------------- the loop


def _loops_in_function(site: CallSite) -> list[LoopFrame]:
    loops: list[LoopFrame] = []
    for frame in site.context:
        if isinstance(frame, FunctionFrame):
            loops = []  # a loop around the function's definition does not run its body per iteration
        elif isinstance(frame, LoopFrame):
            loops.append(frame)
    return loops


def _backward_after(facts: FileFacts, loop: LoopFrame, site: CallSite, outputs: set[str]) -> Optional[CallSite]:
    """A backward() that runs later in the same iteration of ``loop`` on a loss computed from the call's outputs
    (one run by a helper the loop calls after the call counts: its loss is out of sight)."""
    dependents = _dependents(facts, loop, site, outputs)
    for call, via in reach(facts, loop):
        if not is_backward(facts, call):
            continue
        if via is not None:
            if via.order > site.order:
                return call
            continue
        if call.order <= site.order:
            continue
        used = set(_keys_in(call.receiver)) | {k for arg in call.node.args for k in _keys_in(arg.value)}
        if used & dependents:
            return call
    return None


def _dependents(facts: FileFacts, loop: LoopFrame, site: CallSite, outputs: set[str]) -> set[str]:
    """Names computed, later in the loop body, from the call's outputs (``loss = criterion(out, y)``,
    ``loss += ...``)."""
    found = set(outputs)
    steps: list[tuple[int, str, Optional[cst.CSTNode]]] = []
    for key, bindings in site.scope.bindings.items():
        steps.extend((b.order, key, b.value) for b in bindings if site.order < b.order <= loop.end_order and b.value is not None)
    steps.extend(
        (a.order, a.target_key, a.node.value) for a in facts.aug_assigns
        if a.target_key and a.scope is site.scope and site.order < a.order <= loop.end_order
    )
    for _, key, value in sorted(steps, key=lambda step: step[0]):
        if key not in found and set(_keys_in(value)) & found:
            found.add(key)
    return found


def _keys_in(node: Optional[cst.CSTNode]) -> Iterator[str]:
    if node is None:
        return
    key = name_key(node)
    if key is not None:
        yield key
        return
    for child in node.children:
        yield from _keys_in(child)


def _retains_graph(facts: FileFacts, loop: LoopFrame) -> bool:
    """``backward(retain_graph=True)`` (or any value but False): a different problem, a graph kept on purpose."""
    for call, _ in reach(facts, loop):
        if not is_backward(facts, call):
            continue
        retain = call_arg(call.node, None, "retain_graph")
        if retain is not None and not (isinstance(retain, cst.Name) and retain.value == "False"):
            return True
    return False


def _reset_in_loop(facts: FileFacts, key: str, loop: LoopFrame, site: CallSite, carried: list[Binding]) -> bool:
    """``h = h.detach()``, ``h = init_hidden()``, ``h = repackage_hidden(h)``, ... anywhere in the loop; for
    ``self.hidden``, any binding outside the constructor (a method the loop calls may reset it)."""
    for binding in site.scope.bindings.get(key, ()):
        if loop.order < binding.order <= loop.end_order and binding not in carried:
            return True
    if key.startswith("self.") and site.scope.class_name:
        for binding in facts.class_attrs.get(site.scope.class_name, {}).get(key, ()):
            if binding.scope is not site.scope and binding.scope.name != "__init__":
                return True
        return False
    # A function the loop calls that binds the same name (``global h; h = None``) may reset it.
    for call, _ in reach(facts, loop):
        if any(key in scope.bindings for scope in facts.callee_scopes(call)):
            return True
    return False


def _maybe_detached(facts: FileFacts, key: str, loop: LoopFrame, site: CallSite) -> bool:
    """An in-place ``detach_()`` in the loop, or the state handed to a function of the file or an unknown
    function, which may detach it in place."""
    for call, via in reach(facts, loop):
        if call.method == "detach_" or call is site:
            if call.method == "detach_":
                return True
            continue
        if via is not None:
            continue
        passed = {k for arg in call.node.args for k in _bare_keys(arg.value)}
        if key in passed and _may_detach_argument(facts, call):
            return True
    return False


def _may_detach_argument(facts: FileFacts, call: CallSite) -> bool:
    """A function of the file, or one the file cannot show; not a library module (``readout(h)``), nor a module
    class of the file whose ``forward`` never calls ``detach_()``."""
    own_class = _instance_class(facts, call)
    if own_class is not None:
        return any(
            inner.method == "detach_" for scope in facts.functions if scope.class_name == own_class
            for inner in facts.calls if inner.scope is scope
        )
    if facts.callee_scopes(call):
        return True
    if call.qualname is not None or call.method is not None:
        return False
    return facts.value(call.node.func, call.order, call.scope).kind != "model"


# ---------------------------------------------------------------------------------------------- model-owned state


def _touched_elsewhere(facts: FileFacts, attribute: str, site: CallSite) -> bool:
    """``model.hidden = ...``, ``model.hidden[0].detach_()``, ``reset(model.hidden)``: the state is reset or
    handled from outside the module."""
    if any(a.target.attr.value == attribute for a in facts.attribute_assigns):
        return True
    for call in facts.calls:
        if call is site:
            continue
        parts = [call.receiver] + [arg.value for arg in call.node.args]
        if call.scope.class_name not in (None, site.scope.class_name):
            parts = [p for p in parts if not _is_self_attribute(p)]  # another class's own ``self.hidden``
        if any(_names_attribute(part, attribute) for part in parts if part is not None):
            if call.scope is site.scope and call.order > site.order and call.method is None and call.qualname is None:
                return True
            if call.scope is not site.scope:
                return True
    return False


def _is_self_attribute(node: Optional[cst.CSTNode]) -> bool:
    return node is not None and (name_key(node) or "").startswith("self.")


def _names_attribute(node: cst.CSTNode, attribute: str) -> bool:
    if isinstance(node, cst.Attribute) and node.attr.value == attribute:
        return True
    return any(_names_attribute(child, attribute) for child in node.children)


def _steps_running(facts: FileFacts, method: Scope) -> Iterator[tuple[LoopFrame, CallSite]]:
    """Loops that run ``method`` once per iteration: ``model(x)`` for ``forward``, or calls of the method."""
    if method.name == "forward":
        for call in facts.calls:
            if call.method is not None:
                continue
            if _instance_class(facts, call) != method.class_name:
                continue
            for loop in reversed(_loops_in_function(call)):
                yield loop, call
            for loop, into in calling_loops(facts, call.scope):
                yield loop, into
    else:
        yield from calling_loops(facts, method)
