from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import CallSite, FileFacts, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import exclusive_branches, snippet
from gpudoctor.check.rule import Rule

_MULTI_GPU = ("init_process_group", "DistributedDataParallel", "LOCAL_RANK", "torchrun", "nproc_per_node")
# What a checkpoint is restored into: these hold GPU tensors when the training that saved them did.
_RESTORED_KINDS = {"model", "optimizer"}
_NOT_RESTORED_NAME = ("sched", "scaler", "sampler", "loader", "tokenizer", "metric", "ema_decay")


class TorchLoadWithoutMapLocation(Rule):
    """``torch.load(path)`` without ``map_location`` in a script that runs one process per GPU, whose result
    is restored into a model or optimizer (``load_state_dict``): tensors saved from ``cuda:0`` are restored
    onto ``cuda:0`` in *every* rank (``set_device`` does not change that), so GPU 0 holds N copies of the
    checkpoint. A warning: the file cannot show that the checkpoint was saved from a GPU."""

    code = "GD611"
    name = "torch-load-without-map-location"
    summary = "torch.load without map_location in a multi-GPU (one process per GPU) script"
    severity = Severity.WARNING
    triggers = ("torch.load", "load(")

    def check(self, facts: FileFacts):
        hints = [h for h in facts.launch_hints if any(h.startswith(k) for k in _MULTI_GPU)]
        ranks = [h for h in hints if h != "DistributedDataParallel"]
        if not ranks or not (facts.calls_to(*apis.DISTRIBUTED_DATA_PARALLEL) or "init_process_group" in hints):
            return
        loads = facts.calls_to("torch.load")
        for site in loads:
            if site.arg(1, "map_location") is not None:
                continue
            if any(o.arg(1, "map_location") is not None and exclusive_branches(o.context, site.context) for o in loads):
                # ``if args.gpu is None: torch.load(p) else: torch.load(p, map_location=f"cuda:{args.gpu}")``: the
                # one-process-per-GPU path maps; the unmapped branch is the single-process (DataParallel) path.
                continue
            restore = self._restored_into(facts, site)
            if restore is None:
                continue  # data, configs, tensors used as they come: whether they are on a GPU is unknown
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node, 50)}` has no `map_location`, and the file runs one process per GPU "
                f"({', '.join('`' + h + '`' for h in hints[:2])}): the checkpoint restored by "
                f"`{snippet(facts, restore.node, 50)}` comes back on the device each tensor was saved from "
                "(`cuda:0` for a checkpoint saved by rank 0) in every rank, so GPU 0 receives one copy per process "
                "(OOM on GPU 0, or memory held there for the whole run).",
                fix_hint="`torch.load(path, map_location=\"cpu\")` (then load_state_dict copies into each rank's "
                "model), or `map_location=f\"cuda:{local_rank}\"`.",
                related=((restore.node, "the loaded checkpoint is restored here"),),
            )

    @staticmethod
    def _restored_into(facts: FileFacts, load: CallSite) -> Optional[CallSite]:
        """The ``load_state_dict`` of a model or optimizer that receives (part of) what ``load`` returned:
        ``model.load_state_dict(torch.load(p))``, ``ckpt = torch.load(p)`` ... ``model.load_state_dict(ckpt["model"])``."""
        for target in facts.method_calls("load_state_dict"):
            if target.receiver is None:
                continue
            if not _restores_state(facts, target):
                continue
            arg = target.arg(0, "state_dict")
            if arg is not None and _comes_from(facts, arg, load, target.order, target.scope):
                return target
        return None


def _restores_state(facts: FileFacts, target: CallSite) -> bool:
    """The receiver of ``load_state_dict`` is a model or an optimizer: known as one, or unknown (only modules,
    optimizers, schedulers, GradScalers and samplers have the method; the last three are told apart by what
    built them, or by their name when nothing shows it)."""
    kind = facts.value(target.receiver, target.order, target.scope).kind
    if kind in _RESTORED_KINDS:
        return True
    if kind != "unknown":
        return False
    text = facts.module.code_for_node(target.receiver).split(".")[-1].lower()
    return not any(word in text for word in _NOT_RESTORED_NAME)


def _comes_from(facts: FileFacts, node: cst.BaseExpression, load: CallSite, order: int, scope, depth: int = 0) -> bool:
    """``node`` is (part of) what ``load`` returned: through names, ``ckpt["model"]``/``ckpt.get("model")``, the
    parameters of the file's own functions (the first call that passes one) and their returns."""
    if node is load.node:
        return True
    if depth > 8 or node is None:
        return False
    if isinstance(node, cst.Subscript):  # ckpt["model"]
        return _comes_from(facts, node.value, load, order, scope, depth + 1)
    if isinstance(node, cst.Call):
        if isinstance(node.func, cst.Attribute) and node.func.attr.value in ("get", "pop"):
            return _comes_from(facts, node.func.value, load, order, scope, depth + 1)  # ckpt.get("model")
        site = facts.call_site(node)
        if site is None or site.qualname is not None:
            return False
        return any(
            _comes_from(facts, ret.value, load, ret.order, ret.scope, depth + 1)
            for callee in facts.callee_scopes(site) for ret in facts.returns.get(id(callee), ())
        )
    key = name_key(node)
    binding = facts.binding_at(key, order, scope) if key is not None else None
    if binding is None:
        return False
    if binding.kind == "param":  # what the caller passes
        passed = facts.param_argument(binding)
        return passed is not None and _comes_from(facts, passed[0], load, passed[1], passed[2], depth + 1)
    if binding.kind != "assign" or binding.value is None:
        return False
    return _comes_from(facts, binding.value, load, binding.order, binding.scope, depth + 1)
