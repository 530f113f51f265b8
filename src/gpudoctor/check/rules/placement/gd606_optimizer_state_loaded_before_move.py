from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import CallSite, FileFacts, call_arg, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import parameters_owner, snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.placement._common import moves_to_accelerator

_DTYPE_NAMES = {"float16", "half", "bfloat16", "float32", "float", "float64", "double"}


class OptimizerStateLoadedBeforeMove(Rule):
    """``optimizer.load_state_dict(...)`` and *then* ``model.to(device)``: ``load_state_dict`` casts the
    saved state (Adam's ``exp_avg``...) to each parameter's device *at load time*, i.e. the CPU; moving
    the model afterwards moves the parameters but not the optimizer state, and the first
    ``optimizer.step()`` mixes devices. Silent when the state is loaded after the move, or loaded again
    (``opt.load_state_dict(opt.state_dict())``) / the optimizer rebuilt after it."""

    code = "GD606"
    name = "optimizer-state-loaded-before-move"
    summary = "optimizer.load_state_dict() before model.to(device): the restored state stays on the CPU"
    severity = Severity.ERROR
    triggers = ("load_state_dict",)

    def check(self, facts: FileFacts):
        evidence = moves_to_accelerator(facts)
        for load in facts.method_calls("load_state_dict"):
            opt_key = name_key(load.receiver)
            if opt_key is None:
                continue
            if facts.value(load.receiver, load.order, load.scope).kind != "optimizer":
                continue
            built = facts.built_by(load.receiver, load.order, load.scope)  # through temporaries and helpers
            if built is None or not built.args:
                continue
            params = built.args[0].value
            site = facts.call_site(built)
            if site is None:
                continue
            owner = parameters_owner(facts, params, site.order, site.scope)  # names, param groups, helpers
            model_key = name_key(owner)
            if model_key is None:
                continue
            origin = facts.value(owner, site.order, site.scope).origin().node if site is not None else None
            move = self._later_move(facts, model_key, load, origin)
            if move is None or _moved_before(facts, model_key, load):
                continue  # no move after the load, or the parameters were already placed when it ran
            if self._state_recast(facts, opt_key, load, move):
                continue
            severity = Severity.ERROR if evidence else Severity.WARNING
            yield self.report(
                load.node,
                f"`{snippet(facts, load.node, 60)}` restores the optimizer state onto the devices `{model_key}`'s "
                f"parameters have now (the CPU); `{snippet(facts, move.node, 40)}` later moves the parameters but not "
                "that state, so the first `step()` fails: \"Tensors of the same index must be on the same device and "
                "the same dtype...\" (foreach/fused Adam, the CUDA default) or \"Expected all tensors to be on the "
                "same device\" (`foreach=False`).",
                fix_hint=f"Move the model first (`{snippet(facts, move.node, 40)}`), then create the optimizer and call "
                f"`{opt_key}.load_state_dict(...)`; or call `{opt_key}.load_state_dict({opt_key}.state_dict())` after "
                "the move to re-place the state.",
                severity=severity,
                related=((move.node, "the parameters move here, the restored state does not"),),
            )

    def _later_move(self, facts: FileFacts, model_key: str, load: CallSite, origin) -> Optional[CallSite]:
        found = self._move_after(facts, model_key, load.order, load.scope, origin)
        if found is not None:
            return found
        # The load runs in a helper or method (``self.load(path)``, ``resume(model, opt, path)``): a move after the
        # call that runs it, in the caller (the model named there: the same ``self.x``, or the argument passed).
        for caller_key, order, scope in self._callers(facts, model_key, load.scope):
            found = self._move_after(facts, caller_key, order, scope, None)
            if found is not None:
                return found
        return None

    @staticmethod
    def _callers(facts: FileFacts, model_key: str, function):
        if function.kind != "function":
            return
        binding = next(iter(function.bindings.get(model_key, ())), None)
        if binding is not None and binding.kind == "param":
            for arg, order, scope in facts.param_arguments(binding):
                key = name_key(arg)
                if key is not None:
                    yield key, order, scope
        elif model_key.startswith("self.") and model_key not in function.bindings:
            for site in facts.call_sites_of(function):
                if site.scope.class_name == function.class_name and name_key(site.node.func) == f"self.{function.name}":
                    yield model_key, site.order, site.scope
        elif binding is None:  # the model is the caller's (the optimizer came in as an argument built over it)
            for site in facts.call_sites_of(function):
                yield model_key, site.order, site.scope

    def _move_after(self, facts: FileFacts, model_key: str, after: int, where, origin) -> Optional[CallSite]:
        for site in facts.calls:
            if site.order <= after or site.method not in apis.MODULE_MOVES:
                continue
            key = name_key(site.receiver)
            wrapped = _wrapped_module(facts, site.receiver)  # ``nn.DataParallel(model).cuda()`` moves ``model``
            if wrapped is not None:
                key = name_key(wrapped)
            same = key == model_key and facts._same_namespace(site.scope, where, model_key)
            if not same and not (origin is not None and key is not None and site.scope is where
                                 and facts.value(site.receiver, site.order, site.scope).origin().node is origin):
                continue
            if site.scope is not where and site.scope.kind != "module" and where.kind != "module":
                continue
            if site.method == "to" and not any(_device_arg(facts, a, site) for a in site.node.args):
                continue
            return site
        return None

    def _state_recast(self, facts: FileFacts, opt_key: str, load: CallSite, move: CallSite) -> bool:
        for site in facts.method_calls("load_state_dict"):
            if site is load or name_key(site.receiver) != opt_key or not facts._same_namespace(site.scope, load.scope, opt_key):
                continue
            if site.scope is move.scope or site.scope.kind == "module" or move.scope.kind == "module":
                if site.order > move.order:
                    return True
            elif any(call.scope is move.scope and call.order > move.order for call in facts.call_sites_of(site.scope)):
                return True  # a helper/method that reloads the state, called after the move
        for _key, bindings in ((opt_key, move.scope.bindings.get(opt_key, ())),):
            if any(b.order > move.order for b in bindings):
                return True
        return False


def _wrapped_module(facts: FileFacts, node) -> Optional[cst.BaseExpression]:
    """The module a ``DataParallel(...)``/``DistributedDataParallel(...)`` call wraps (their moves move it)."""
    if isinstance(node, cst.Call) and facts.qualname(node.func) in apis.DATA_PARALLEL | apis.DISTRIBUTED_DATA_PARALLEL:
        return call_arg(node, 0, "module")
    return None


def _moves(facts: FileFacts, site: CallSite) -> bool:
    """``.cuda()``/``.to(device)`` (not ``.to(torch.float16)``)."""
    return site.method in apis.MODULE_MOVES and (
        site.method != "to" or any(_device_arg(facts, a, site) for a in site.node.args)
    )


def _moved_before(facts: FileFacts, model_key: str, load: CallSite) -> bool:
    """The model was put on a device before the state is loaded (``net = Net().cuda()``, ``net.to(device)``): the
    state is restored onto those devices, and a later ``.cuda()`` changes nothing."""
    binding = facts.binding_at(model_key, load.order, load.scope)
    if binding is not None and binding.kind == "assign" and isinstance(binding.value, cst.Call) and binding.scope is load.scope:
        site = facts.call_site(binding.value)
        if site is not None and _moves(facts, site):
            return True
    start = binding.order if binding is not None and binding.scope is load.scope else -1
    return any(  # source order is run order only within one function
        site.scope is load.scope and start < site.order < load.order and _moves(facts, site)
        and name_key(site.receiver) == model_key
        for site in facts.calls
    )


def _device_arg(facts: FileFacts, arg: cst.Arg, site: CallSite) -> bool:
    if arg.keyword is not None and arg.keyword.value not in ("device",):
        return False
    built = facts.assignment_of(arg.value, site.order, site.scope)  # dtype = torch.float16; net.to(dtype)
    q = facts.qualname(built.value if built is not None else arg.value) or ""
    return not (q.startswith("torch.") and q.split(".")[-1] in _DTYPE_NAMES)
