from __future__ import annotations

import re

import libcst as cst

from gpudoctor.check.facts import FileFacts, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.memory._common import called_without_grad, computed_at, graph_tensor, grad_disabled, loops_in_function, trains_between

_TO_CPU = re.compile(r"\.cpu\(\)|\.to\(\s*['\"]cpu['\"]")


class OutputsAppendedWithGraph(Rule):
    """Model outputs (logits, hidden states, the loss tensor) appended to a list inside a loop with
    autograd on and without ``.detach()``/``.item()``: the list keeps every step's tensors, and with
    them their autograd graphs. Without a backward in the loop each step's activations stay alive too."""

    code = "GD503"
    name = "outputs-appended-with-graph"
    summary = "Model outputs appended to a list in a loop without detach(): every step's graph is kept"
    severity = Severity.WARNING
    preview = True
    triggers = ("append",)

    def check(self, facts: FileFacts):
        for site in facts.method_calls("append", "extend"):
            if site.receiver is None or len(site.node.args) != 1 or grad_disabled(facts, site.context):
                continue
            if called_without_grad(facts, site.context):
                continue
            if site.scope.name == "forward" and site.scope.class_name and facts.is_module_class(site.scope.class_name):
                continue  # an nn.Module's forward collecting per-step outputs: the caller's backward needs the graph
            loops = loops_in_function(site.context)
            key = name_key(site.receiver)
            if not loops or key is None:
                continue
            binding = facts.binding_at(key, loops[0].order, site.scope)
            if binding is None or binding.order > loops[0].order or not isinstance(binding.value, (cst.List, cst.Call)):
                continue  # the list must outlive the loop iterations
            if _bounded(facts, key, binding, loops[-1]):
                continue  # a deque(maxlen=...), or a list emptied in the loop: it keeps a few steps, it does not grow
            value = site.node.args[0].value
            kind = graph_tensor(facts, value, site.order, site.scope)
            if kind is None:
                continue
            loop = loops[-1]
            trains = trains_between(facts, loop.order, loop.end_order)
            if trains:
                held = facts.assignment_of(value, site.order, site.scope)  # ``kept = out.logits.cpu()``
                made = held.value if held is not None else value
                if kind == "loss" or _TO_CPU.search(facts.module.code_for_node(made)):
                    continue  # backward freed the activations; a scalar or a CPU copy is small
                effect = (
                    "backward frees the activations, but the list keeps every step's output tensor on the device "
                    "(logits are batch x sequence x vocabulary each): memory grows with every step"
                )
            else:
                effect = (
                    "nothing in the loop calls backward, so each kept tensor also keeps its whole graph and the "
                    "activations saved for backward: memory grows by a training step's activations per batch "
                    "until CUDA runs out of memory"
                )
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node)}` keeps a model output with its autograd history across iterations; "
                f"{effect}.",
                fix_hint=f"Append `{snippet(facts, value, 40)}.detach().cpu()` (or `.item()`/`.tolist()` for "
                "numbers), and run evaluation under `torch.no_grad()`.",
                related=computed_at(facts, value, site, "the output, with its graph, is computed here"),
            )


def _bounded(facts: FileFacts, key: str, binding, loop) -> bool:
    """The container ``key`` keeps a bounded number of items across the iterations of ``loop``: a
    ``deque(maxlen=n)``, or it is emptied inside the loop (``key.clear()``, ``key = []``)."""
    made = binding.value
    if isinstance(made, cst.Call) and facts.qualname(made.func) == "collections.deque":
        maxlen = made.args[1].value if len(made.args) > 1 and made.args[1].keyword is None else None
        maxlen = next((a.value for a in made.args if a.keyword is not None and a.keyword.value == "maxlen"), maxlen)
        if maxlen is not None and not (isinstance(maxlen, cst.Name) and maxlen.value == "None"):
            return True
    emptied = any(
        loop.order < c.order < loop.end_order and c.method == "clear" and name_key(c.receiver) == key for c in facts.calls
    )
    rebound = any(loop.order < b.order < loop.end_order and b.kind == "assign" for b in binding.scope.bindings.get(key, ()))
    return emptied or rebound
