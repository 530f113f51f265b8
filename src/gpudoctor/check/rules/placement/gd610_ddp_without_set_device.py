from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import CallSite, FileFacts, name_key, string_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet, string_through
from gpudoctor.check.rule import Rule

_SET_DEVICE = {"torch.cuda.set_device", "torch.accelerator.set_device_index", "torch.cuda.device", "torch.xpu.set_device",
               "torch.npu.set_device"}
_PLACES_PER_RANK = {"accelerate.Accelerator", "accelerate.PartialState"}
# Object collectives: on an NCCL group they pickle the object into a tensor on ``torch.cuda.current_device()``
# (``_get_object_coll_device`` -> "cuda", ``_object_to_tensor(obj, "cuda", group)``), so without
# ``set_device`` every rank sends from GPU 0. ``send``/``recv``/``broadcast`` take an optional ``device=``.
_OBJECT_COLLECTIVES = {
    f"torch.distributed.{name}" for name in (
        "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list", "send_object_list",
        "recv_object_list",
    )
}


class DdpWithoutSetDevice(Rule):
    """``DistributedDataParallel`` with the model moved to a device *without an index* (``.cuda()``,
    ``.to("cuda")``, ``torch.device("cuda")``) and no ``torch.cuda.set_device(local_rank)`` anywhere: the
    current device of every rank is GPU 0, so every rank puts its replica on GPU 0. Silent when the
    index is given (``.to(local_rank)``, ``f"cuda:{rank}"``), when ``CUDA_VISIBLE_DEVICES`` is set by the
    script, or when accelerate places the processes."""

    code = "GD610"
    name = "ddp-without-set-device"
    summary = "DDP with the model on 'cuda' (no index) and no torch.cuda.set_device(local_rank): every rank uses GPU 0"
    severity = Severity.ERROR
    triggers = ("DistributedDataParallel", "DDP", "_object")

    def check(self, facts: FileFacts):
        setters = facts.calls_to(*_SET_DEVICE, *_PLACES_PER_RANK)
        if "CUDA_VISIBLE_DEVICES" in facts.source:
            return
        ranks = [h for h in facts.launch_hints if h != "DistributedDataParallel"]
        if not ranks:
            return  # nothing shows several processes
        if not setters:
            yield from self._object_collectives(facts)
        for site in facts.calls_to(*apis.DISTRIBUTED_DATA_PARALLEL):
            module = site.arg(0, "module")
            move = self._indexless_move(facts, module, site.order, site.scope)
            if move is None:
                continue
            # A set_device counts unless every one runs later in the function that moved the model: `.cuda()` then
            # `set_device(local_rank)` already put the replica on cuda:0.
            if any(s.scope is not move.scope or s.order < move.order for s in setters):
                continue
            ids = site.arg(1, "device_ids")
            if isinstance(ids, (cst.List, cst.Tuple)) and all(isinstance(e.value, cst.Integer) for e in ids.elements):
                continue  # a fixed device: not the per-rank pattern
            never = (
                f"the script calls `{snippet(facts, setters[0].node, 40)}` only after that move"
                if setters else "the script never calls `torch.cuda.set_device(local_rank)`"
            )
            related = [(move.node, "the model is moved to the accelerator without a device index here")]
            related += [(setter.node, "the device is set only after that move") for setter in setters[:1]]
            related += _group_starts(facts, setters)
            yield self.report(
                site.node,
                f"`{snippet(facts, module, 30)}` was put on the accelerator by `{snippet(facts, move.node, 40)}`, which "
                f"names no device index, and {never}: on every rank "
                "the current device is `cuda:0`, so all replicas (and their activations) land on GPU 0, and NCCL stops "
                "with \"Duplicate GPU detected : rank 1 and rank 0 both on CUDA device ...\" (or GPU 0 runs out of "
                "memory).",
                fix_hint="Right after `init_process_group`, call `torch.cuda.set_device(local_rank)` (local_rank = "
                "`int(os.environ[\"LOCAL_RANK\"])`), and use `device_ids=[local_rank]`.",
                related=tuple(related),
            )

    def _object_collectives(self, facts: FileFacts):
        """``dist.all_gather_object(...)`` (and the other object collectives) in a file that starts an NCCL
        group (``init_process_group("nccl")``, several processes) and never sets each rank's device."""
        inits = facts.calls_to("torch.distributed.init_process_group")
        if not inits or not all(self._nccl_group_of_several(facts, site) for site in inits):
            return
        for site in facts.calls_to(*_OBJECT_COLLECTIVES):
            if site.arg(keyword="device") is not None:
                continue  # ``broadcast_object_list(objs, src=0, device=...)``: the caller picks the device
            name = site.qualname.rsplit(".", 1)[1]
            yield self.report(
                site.node,
                f"`{name}` on the NCCL group pickles the object into a tensor on `torch.cuda.current_device()`, and "
                "the script never calls `torch.cuda.set_device(local_rank)`: on every rank the current device is "
                "`cuda:0`, so all ranks communicate from GPU 0 and NCCL stops (\"Duplicate GPU detected : rank 1 and "
                "rank 0 both on CUDA device ...\") or hangs (pytorch#75619).",
                fix_hint="Right after `init_process_group`, call `torch.cuda.set_device(local_rank)` (local_rank = "
                "`int(os.environ[\"LOCAL_RANK\"])`, or the rank `mp.spawn` passes).",
                related=_group_starts(facts, ()),
            )

    @staticmethod
    def _nccl_group_of_several(facts: FileFacts, site: CallSite) -> bool:
        """``init_process_group("nccl", ...)`` with the backend written out, no ``device_id=`` (which binds the
        group to a device) and no ``world_size=1``."""
        if site.arg(keyword="device_id") is not None:
            return False
        world = site.arg(keyword="world_size")
        if isinstance(world, cst.Integer) and world.value == "1":
            return False
        backend = site.arg(0, "backend")
        if backend is not None and name_key(backend) is not None and "." not in name_key(backend):
            binding = facts.binding_at(name_key(backend), site.order, site.scope)
            backend = binding.value if binding is not None and binding.kind == "assign" else None
        text = string_value(backend)
        if text is None and backend is not None:
            text = "nccl" if facts.qualname(backend) == "torch.distributed.Backend.NCCL" else None
        return text is not None and text.lower() == "nccl"

    def _indexless_move(self, facts: FileFacts, node, order: int, scope, depth: int = 0) -> Optional[CallSite]:
        if node is None or depth > 4:
            return None
        if isinstance(node, cst.Call):
            site = facts.call_site(node)
            if site is not None and site.method in ("cuda", "to") and self._indexless(facts, site):
                return site
            if site is not None and site.qualname is None:  # built by the file's own helper
                for callee in facts.callee_scopes(site):
                    for ret in facts.returns.get(id(callee), ()):
                        found = self._indexless_move(facts, ret.value, ret.order, ret.scope, depth + 1)
                        if found is not None:
                            return found
            return None
        key = name_key(node)
        param = facts.binding_at(key, order, scope) if key is not None else None
        if param is not None and param.kind == "param":  # handed in: what the caller passes
            passed = facts.param_argument(param)
            return self._indexless_move(facts, *passed, depth + 1) if passed is not None else None
        binding = facts.assignment_of(node, order, scope)
        if binding is None:
            return None
        key = binding.key
        for site in facts.calls:
            if binding.order < site.order < order and name_key(site.receiver) == key and site.method in apis.MODULE_MOVES:
                return site if self._indexless(facts, site) else None
        return self._indexless_move(facts, binding.value, binding.order, binding.scope, depth + 1)

    def _indexless(self, facts: FileFacts, site: CallSite) -> bool:
        if site.method == "cuda":
            return not site.node.args
        target = site.arg(0, "device")
        return target is not None and self._cuda_without_index(facts, target, site, 0)

    def _cuda_without_index(self, facts: FileFacts, node, site: CallSite, depth: int) -> bool:
        if depth > 3:
            return False
        if string_through(facts, node, site.order, site.scope) == "cuda":
            return True
        if isinstance(node, cst.Call) and facts.qualname(node.func) == "torch.device" and len(node.args) == 1:
            return string_through(facts, node.args[0].value, site.order, site.scope) == "cuda"
        key = name_key(node)
        if key is not None:
            binding = facts.binding_at(key, site.order, site.scope)
            if binding is not None and binding.kind == "assign":
                return self._cuda_without_index(facts, binding.value, site, depth + 1)
        return False


def _group_starts(facts: FileFacts, setters) -> list:
    """``init_process_group``, right after which ``set_device`` belongs (unless a late one is already there)."""
    if setters:
        return []
    return [(site.node, "the process group starts here, without setting this rank's device")
            for site in facts.calls_to("torch.distributed.init_process_group")[:1]]
