from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import CallSite, FileFacts, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import _parameters_owner, snippet
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
            params_binding = facts.assignment_of(params, site.order, site.scope) if site is not None else None
            owner = _parameters_owner(params_binding.value if params_binding is not None else params)
            model_key = name_key(owner)
            if model_key is None:
                continue
            origin = facts.value(owner, site.order, site.scope).origin().node if site is not None else None
            move = self._later_move(facts, model_key, load, origin)
            if move is None:
                continue
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
        for site in facts.calls:
            if site.order <= load.order or site.method not in apis.MODULE_MOVES:
                continue
            key = name_key(site.receiver)
            same = key == model_key and facts._same_namespace(site.scope, load.scope, model_key)
            if not same and not (origin is not None and key is not None and site.scope is load.scope
                                 and facts.value(site.receiver, site.order, site.scope).origin().node is origin):
                continue
            if site.scope is not load.scope and site.scope.kind != "module" and load.scope.kind != "module":
                continue
            if site.method == "to" and not any(_device_arg(facts, a, site) for a in site.node.args):
                continue
            return site
        return None

    def _state_recast(self, facts: FileFacts, opt_key: str, load: CallSite, move: CallSite) -> bool:
        for site in facts.method_calls("load_state_dict"):
            if (site.order > move.order and name_key(site.receiver) == opt_key
                    and facts._same_namespace(site.scope, load.scope, opt_key)):
                return True
        for _key, bindings in ((opt_key, move.scope.bindings.get(opt_key, ())),):
            if any(b.order > move.order for b in bindings):
                return True
        return False


def _device_arg(facts: FileFacts, arg: cst.Arg, site: CallSite) -> bool:
    if arg.keyword is not None and arg.keyword.value not in ("device",):
        return False
    built = facts.assignment_of(arg.value, site.order, site.scope)  # dtype = torch.float16; net.to(dtype)
    q = facts.qualname(built.value if built is not None else arg.value) or ""
    return not (q.startswith("torch.") and q.split(".")[-1] in _DTYPE_NAMES)
