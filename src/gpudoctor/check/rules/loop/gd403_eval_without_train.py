from __future__ import annotations

import libcst as cst

from gpudoctor.check.facts import FileFacts
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import is_backward, reach, receiver_kind

_BUILTINS = {"print", "len", "range", "enumerate", "zip", "float", "int", "str", "sum", "min", "max", "abs", "round",
             "list", "dict", "tuple", "set", "sorted", "isinstance", "getattr", "setattr", "hasattr", "next", "iter",
             "open", "format", "repr", "any", "all", "map", "filter", "type", "super", "bool"}
_NOT_MODULES = {"trainer", "accelerator", "optimizer", "scheduler", "dataloader", "tokenizer", "training_args"}


def is_eval_call(facts: FileFacts, site) -> bool:
    if site.receiver is None or site.qualname is not None:
        return False
    if site.method == "eval" and not site.node.args:
        return receiver_kind(facts, site) not in _NOT_MODULES
    if site.method == "train" and len(site.node.args) == 1:
        arg = site.node.args[0].value
        return isinstance(arg, cst.Name) and arg.value == "False" and receiver_kind(facts, site) not in _NOT_MODULES
    return False


def is_train_call(facts: FileFacts, site) -> bool:
    if site.method != "train" or site.receiver is None or site.qualname is not None:
        return False
    args = site.node.args
    if len(args) > 1 or (args and isinstance(args[0].value, cst.Name) and args[0].value.value == "False"):
        return False
    return receiver_kind(facts, site) not in _NOT_MODULES


class EvalWithoutTrain(Rule):
    """``model.eval()`` inside the loop that trains, with no ``model.train()`` anywhere in that loop
    (directly or in the helpers it calls): every training step after the first evaluation runs in
    eval mode, with dropout off and batch-norm statistics frozen."""

    code = "GD403"
    name = "eval-without-train"
    summary = "model.eval() inside the training loop is never undone by model.train()"
    triggers = (".eval()", ".train(False)")

    def check(self, facts: FileFacts):
        reported: set[int] = set()
        for loop in facts.loops:
            reached = reach(facts, loop)
            if not any(is_backward(facts, c) for c, _ in reached):
                continue
            if any(is_train_call(facts, c) for c, _ in reached):
                continue
            trained = self._trained_keys(facts, [c for c, _ in reached])
            backward, backward_via = next((c, v) for c, v in reached if is_backward(facts, c))
            for site, via in reached:
                if not is_eval_call(facts, site):
                    continue
                node = via.node if via is not None else site.node
                if id(node) in reported:
                    continue
                key = snippet(facts, site.receiver)
                if via is not None:
                    key = self._argument_for(facts, site, via) or key  # ``evaluate(model, ...)``: the caller's model
                if trained and key not in trained and not key.startswith("self."):
                    continue  # e.g. a frozen teacher that stays in eval mode on purpose
                if via is not None and self._maybe_other_module(facts, site, via, loop, trained):
                    continue
                reported.add(id(node))
                where = f" (in `{snippet(facts, via.node.func)}`)" if via is not None else ""
                yield self.report(
                    node,
                    f"`{snippet(facts, site.node)}`{where} runs inside the loop that trains, and nothing in that loop "
                    "calls `.train()` again: every later training step runs in eval mode (dropout off, batch-norm "
                    "statistics frozen, and gradient checkpointing in transformers models skipped).",
                    fix_hint=f"Call `{key}.train()` at the start of each training epoch/step, or after the evaluation.",
                    related=(
                        *(((site.node, "the model is switched to eval mode here"),) if via is not None else ()),
                        ((backward_via or backward).node, "training goes on here, in eval mode"),
                        *self._train_before_loop(facts, loop, key),
                    ),
                )

    @staticmethod
    def _train_before_loop(facts: FileFacts, loop, key: str):
        """The last ``key.train()`` before the loop, in the loop's scope: the one switch to train mode, made once,
        that the fix moves into the loop."""
        before = [
            c for c in facts.calls
            if c.order < loop.order and c.scope is loop.scope and is_train_call(facts, c) and snippet(facts, c.receiver) == key
        ]
        return ((before[-1].node, "train mode is set only once, here, before the loop"),) if before else ()

    @staticmethod
    def _maybe_other_module(facts: FileFacts, site, via, loop, trained: set[str]) -> bool:
        """The helper's ``.eval()`` receiver is a parameter whose argument at ``via`` is bound, in the loop, to
        something other than the trained modules on some path (``test_model = ema_model.ema if use_ema else
        model`` written as an if/else): evaluation runs on an EMA copy, and the trained model keeps its mode."""
        key = EvalWithoutTrain._argument_for(facts, site, via)
        if key is None:
            return False
        values = [
            b.value
            for b in via.scope.bindings.get(key, ())
            if b.kind == "assign" and b.value is not None and loop.order < b.order < via.order
        ]
        return len(values) > 1 and any(snippet(facts, v) not in trained for v in values)

    @staticmethod
    def _argument_for(facts: FileFacts, site, via) -> str | None:
        """The caller's argument (at ``via``) for the helper parameter that ``site`` calls ``.eval()`` on."""
        binding = facts.binding_at(snippet(facts, site.receiver), site.order, site.scope)
        if binding is None or binding.kind != "param" or not isinstance(binding.target, cst.Param):
            return None
        callee = next(iter(facts.callee_scopes(via)), None)
        if callee is None or binding.scope is not callee:
            return None
        params = [*callee.node.params.posonly_params, *callee.node.params.params]
        position = next((i for i, p in enumerate(params) if p is binding.target), None)
        if position is not None and callee.class_name and params and params[0].name.value == "self":
            position -= 1
        arg = via.arg(position, binding.target.name.value)
        return snippet(facts, arg) if arg is not None else None

    @staticmethod
    def _trained_keys(facts: FileFacts, calls) -> set[str]:
        """Names called like a model (``model(x)``) in the loop: the modules being trained."""
        keys = set()
        for site in calls:
            if facts.under_no_grad(site.context):
                continue
            func = site.node.func
            if site.method is None and site.qualname is None:
                if isinstance(func, cst.Name) and (func.value in _BUILTINS or facts.callee_scopes(site)):
                    continue  # ``print(...)``, ``evaluate(model, ...)``: not a module being trained
                text = facts.module.code_for_node(func)
                keys.add(text)
            elif site.method == "forward" and site.receiver is not None:
                keys.add(facts.module.code_for_node(site.receiver))
        return keys
