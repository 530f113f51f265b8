from __future__ import annotations

import re

import libcst as cst

from gpudoctor.check.facts import FileFacts, string_value
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import calling_loops, in_loop, innermost_loop, is_backward, is_optimizer_step, reach

# Any way of clearing gradients we know of; when one appears anywhere in the file we stay silent.
_CLEARS = re.compile(
    r"zero_grad|set_to_none|\.grad\s*=\s*None|\.grad(\.data)?\.zero_\(|\.grad(\.data)?\.fill_\(|\.grad\s*=\s*torch\.zeros"
    r"|\.grad\s*\*=\s*0|grad\.detach_\(\)\.zero_|\.grad\s*=\s*0"
)

# The same, except ``zero_grad()`` calls (which GD402 can attribute to an optimizer or a model).
_CLEARS_OTHER = re.compile(
    r"\.grad\s*=\s*None|\.grad(\.data)?\.zero_\(|\.grad(\.data)?\.fill_\(|\.grad\s*=\s*torch\.zeros"
    r"|\.grad\s*\*=\s*0|grad\.detach_\(\)\.zero_|\.grad\s*=\s*0"
)
_PARAMETER_METHODS = ("parameters", "named_parameters")

# Strings and comments (a docstring that says "we forgot zero_grad" clears nothing).
_STRINGS_AND_COMMENTS = re.compile(
    r"[rRbBuUfF]{0,2}(?:'''.*?'''|\"\"\".*?\"\"\"|'(?:[^'\\\r\n]|\\.)*'|\"(?:[^\"\\\r\n]|\\.)*\")|#[^\r\n]*",
    re.DOTALL,
)


def _clears_gradients(source: str) -> bool:
    return bool(_CLEARS.search(source)) and bool(_CLEARS.search(_STRINGS_AND_COMMENTS.sub(" ", source)))


class ZeroGradMissing(Rule):
    """A loop calls ``backward()`` and ``optimizer.step()`` but nothing in the file ever clears the
    gradients: they accumulate over every iteration, so each update uses the sum of all past gradients."""

    code = "GD402"
    name = "zero-grad-missing"
    summary = "A training loop calls backward() and optimizer.step() but gradients are never zeroed"
    triggers = ("backward",)

    def check(self, facts: FileFacts):
        clears = _clears_gradients(facts.source)
        if clears and _CLEARS_OTHER.search(_STRINGS_AND_COMMENTS.sub(" ", facts.source)):
            return  # ``p.grad = None`` and the like: not attributed to an optimizer
        reported: set[int] = set()
        for step in facts.method_calls("step"):
            if not is_optimizer_step(facts, step):
                continue
            found = self._training_loop(facts, step)
            if found is None:
                continue
            loop, backward, via = found
            if self._optimizer_built_in(facts, step, loop):
                continue  # a fresh optimizer every iteration: a one-off step (numeric checks), not a training loop
            optimizer = facts.value(step.receiver, step.order, step.scope).origin().node
            if clears:
                # some gradients are zeroed: report only an optimizer whose own gradients provably are not
                # (a GAN that zeroes the generator's but never the discriminator's)
                cleared_elsewhere = self._zeroed_others_only(facts, optimizer)
                if cleared_elsewhere is None or id(optimizer) in reported:
                    continue
                reported.add(id(optimizer))
                what = (f"its parameters' gradients are never zeroed (the file zeroes only "
                        f"`{snippet(facts, cleared_elsewhere.node, 40)}`'s)")
            else:
                what = "the gradients are never zeroed (no `zero_grad()` anywhere in the file)"
            where = f" (through `{snippet(facts, via.node, 40)}`)" if via is not None else ""
            yield self.report(
                step.node,
                f"`{snippet(facts, step.node)}` runs in a loop{where} that calls `{snippet(facts, backward.node)}`, but "
                f"{what}: backward() adds to `.grad`, so every update uses the sum of all gradients since the start and "
                "training diverges.",
                fix_hint=f"Call `{snippet(facts, step.receiver, 30)}.zero_grad()` after its `step()` (or at the start of "
                "each iteration).",
                related=((backward.node, "each backward adds to the gradients here"),),
            )

    @staticmethod
    def _zeroed_others_only(facts: FileFacts, optimizer):
        """The first ``zero_grad()`` of the file when every one of them is attributed, to another optimizer or a
        model whose parameters ``optimizer`` does not hold, and ``optimizer`` is built over known models' parameters;
        None when one of them may clear ``optimizer``'s gradients (or the optimizer's parameters are not known)."""
        owners = _parameter_owners(facts, optimizer)
        if not owners:
            return None
        calls = list(facts.method_calls("zero_grad"))
        if not calls:
            return None
        for call in calls:
            if call.receiver is None:
                return None
            target = facts.value(call.receiver, call.order, call.scope)
            origin = target.origin().node
            if origin is None or origin is optimizer or origin in owners:
                return None
            if target.kind == "optimizer":
                if not _parameter_owners(facts, origin):
                    return None  # an optimizer over parameters we cannot name may share them
            elif target.kind != "model":
                return None
            elif any(_built_with(facts, origin, owner) or _built_with(facts, owner, origin) for owner in owners):
                return None  # ``Seq2Seq(encoder, decoder).zero_grad()`` clears the encoder's gradients too
        return calls[0]

    @staticmethod
    def _training_loop(facts: FileFacts, step):
        """(loop, backward call, the loop's call into the helper or None) for the loop that runs ``step``
        together with a backward: directly, or through the file's own helpers up to 3 calls deep (``for batch
        in loader: self.train_step(batch)`` where ``train_step`` calls backward and ``optimizer.step()``)."""
        loop = innermost_loop(step)
        if loop is not None:
            backward = next(
                (c for c in facts.calls if in_loop(c, loop) and is_backward(facts, c) and innermost_loop(c) is loop), None
            )
            return (loop, backward, None) if backward is not None else None
        for loop, via in calling_loops(facts, step.scope):
            backward = next((c for c, _ in reach(facts, loop, depth=3) if is_backward(facts, c)), None)
            if backward is not None:
                return loop, backward, via
        return None

    @staticmethod
    def _optimizer_built_in(facts: FileFacts, step, loop) -> bool:
        origin = facts.value(step.receiver, step.order, step.scope).origin().node
        site = facts.call_site(origin) if origin is not None else None
        return site is not None and in_loop(site, loop)


def _built_with(facts: FileFacts, container, part, depth: int = 0) -> bool:
    """The module built by the call ``container`` is given the module ``part`` (an argument, in a list/tuple, or
    nested in another such construction): ``Seq2Seq(encoder, decoder)``, ``nn.Sequential(*[body, head])``."""
    if not isinstance(container, cst.Call) or depth > 3:
        return False
    for arg in container.args:
        stack = [arg.value]
        while stack:
            node = stack.pop()
            if isinstance(node, (cst.List, cst.Tuple)):
                stack.extend(e.value for e in node.elements)
                continue
            order, scope = facts._position_of(node)
            if facts.value(node, order, scope).origin().node is part:
                return True
            if isinstance(node, cst.Call) and _built_with(facts, node, part, depth + 1):
                return True
    return False


def _parameter_owners(facts: FileFacts, optimizer) -> list:
    """The origins of the models whose ``.parameters()`` the optimizer built by ``optimizer`` holds
    (``Adam(netD.parameters())``, ``list(a.parameters()) + list(b.parameters())``, param groups, through names);
    [] when anything else feeds it (a parameter list built elsewhere, an unknown object)."""
    site = facts.call_site(optimizer) if isinstance(optimizer, cst.Call) else None
    if site is None:
        return []
    params = site.arg(0, "params")
    if params is None:
        return []
    owners: list = []
    stack = [(params, site.order, site.scope, 0)]
    while stack:
        node, order, scope, depth = stack.pop()
        if depth > 6:
            return []
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in _PARAMETER_METHODS:
            model = facts.value(node.func.value, order, scope)
            if model.kind != "model" or model.origin().node is None:
                return []
            owners.append(model.origin().node)
            continue
        if isinstance(node, (cst.Name, cst.Attribute)):
            binding = facts.assignment_of(node, order, scope)
            if binding is None:
                return []
            stack.append((binding.value, binding.order, binding.scope, depth + 1))
            continue
        if isinstance(node, cst.Call):  # list(...), itertools.chain(...), filter(lambda p: ..., m.parameters())
            children = [a.value for a in node.args if a.keyword is None]
        elif isinstance(node, (cst.List, cst.Tuple)):
            children = [e.value for e in node.elements]
        elif isinstance(node, cst.Dict):  # a param group: only its parameters matter, not lr/weight_decay
            groups = [e for e in node.elements if isinstance(e, cst.DictElement) and string_value(e.key) == "params"]
            if len(groups) != 1:
                return []
            children = [groups[0].value]
        elif isinstance(node, cst.BinaryOperation):
            children = [node.left, node.right]
        elif isinstance(node, cst.Lambda):
            children = []
        else:
            return []
        stack.extend((c, order, scope, depth + 1) for c in children)
    return owners
