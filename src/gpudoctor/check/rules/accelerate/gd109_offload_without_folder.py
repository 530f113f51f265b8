from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check import apis, versions
from gpudoctor.check.facts import FileFacts, call_arg, string_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import _DTYPE_BYTES, max_memory_budget, model_size, snippet
from gpudoctor.check.rule import Rule

# (qualname) -> (device_map position, folder keyword, folder position, exact message)
_ACCELERATE = {
    "accelerate.load_checkpoint_and_dispatch": (
        2,
        "offload_folder",
        5,
        "ValueError: At least one of the model submodule will be offloaded to disk, please pass along an "
        "`offload_folder`.",
    ),
    "accelerate.dispatch_model": (
        1,
        "offload_dir",
        4,
        "ValueError: We need an `offload_dir` to dispatch this model according to this `device_map`, the following "
        "submodules need to be offloaded: ...",
    ),
}


class OffloadWithoutFolder(Rule):
    """A device map that puts modules on ``"disk"`` without the folder the loader needs:
    ``load_checkpoint_and_dispatch`` without ``offload_folder``, ``dispatch_model`` without ``offload_dir``
    (or ``offload_index``), and ``from_pretrained`` of a non-safetensors checkpoint without
    ``offload_folder``. Disk offload from a safetensors checkpoint needs no folder in transformers 5."""

    code = "GD109"
    name = "offload-without-folder"
    summary = 'A device map with "disk" entries but no offload folder'
    triggers = ("disk", "infer_auto_device_map", "max_memory")

    @staticmethod
    def _computed_disk(facts: FileFacts, site, device_map) -> Optional[str]:
        """A computed map (``infer_auto_device_map(model, max_memory=...)``, or ``device_map="auto"`` with
        ``max_memory=`` on the call) that must send modules to "disk": accelerate fills the GPUs and the CPU up
        to their ``max_memory`` budgets and puts the rest on disk, so a model larger than the budgets together
        is partly on disk. The size is the checkpoint's (by its name) at its weight dtype."""
        if device_map.strategy != "auto":
            return None
        infer = device_map.node
        if isinstance(infer, cst.Call) and facts.qualname(infer.func) in apis.INFER_DEVICE_MAP:
            infer_site = facts.call_site(infer)
            if infer_site is None:
                return None
            model_node, memory_node = call_arg(infer, 0, "model"), call_arg(infer, 1, "max_memory")
            order, scope = infer_site.order, infer_site.scope
            dtype_node = call_arg(infer, 3, "dtype")
            how = "`infer_auto_device_map(...)`"
        elif site.qualname == "accelerate.load_checkpoint_and_dispatch":
            model_node, memory_node = call_arg(site.node, 0, "model"), call_arg(site.node, 3, "max_memory")
            order, scope = site.order, site.scope
            dtype_node = call_arg(site.node, keyword="dtype")
            how = "`device_map=\"auto\"`"
        else:
            return None
        budget = max_memory_budget(facts, memory_node, order, scope)
        size = model_size(facts, model_node, order, scope)
        if budget is None or size is None:
            return None
        params, per_weight, name, note = size
        if dtype_node is not None:
            dtype = (facts.qualname(dtype_node) or string_value(dtype_node) or "").split(".")[-1]
            if dtype not in _DTYPE_BYTES:
                return None
            per_weight, note = _DTYPE_BYTES[dtype], f"`dtype={dtype}`"
        need = params * per_weight
        total, text = budget
        if need <= total:
            return None
        return (
            f"gets a device map computed by {how} that must use disk: `{name}` is ~{params / 1e9:g}B parameters x "
            f"{per_weight} B ({note}) = ~{need / 1e9:.0f} GB, more than its `max_memory` budgets together "
            f"({text} = {total / 1e9:.1f} GB), so accelerate places the remaining modules on \"disk\""
        )

    def check(self, facts: FileFacts):
        for site in facts.calls:
            q = site.qualname
            if q is None:
                continue
            call = site.node
            if any(a.star for a in call.args):
                continue
            if q in _ACCELERATE:
                map_pos, folder_kw, folder_pos, message = _ACCELERATE[q]
                if call_arg(call, folder_pos, folder_kw) is not None:
                    continue
                if q == "accelerate.dispatch_model" and call_arg(call, 5, "offload_index") is not None:
                    continue
                device_map = facts.device_map(call_arg(call, map_pos, "device_map"), site.order, site.scope)
                if device_map is None:
                    continue
                if "disk" in device_map.devices:
                    why = "gets a device map with `\"disk\"` entries"
                else:
                    why = self._computed_disk(facts, site, device_map)
                    if why is None:
                        continue
                yield self.report(
                    call,
                    f"`{snippet(facts, call)}` {why} but no `{folder_kw}=`, so it raises \"{message}\"",
                    fix_hint=f"Pass `{folder_kw}=\"offload\"` (any writable folder), or keep those modules on cpu.",
                    related=_map_written(device_map),
                )
                continue
            owner_method = apis.hf_class_method(q)
            if not (owner_method and owner_method[1] == "from_pretrained" and apis.is_model_class(owner_method[0])):
                continue
            if call_arg(call, keyword="offload_folder") is not None:
                continue
            safetensors = call_arg(call, keyword="use_safetensors")
            if not (safetensors is not None and facts.module.code_for_node(safetensors) == "False"):
                continue  # safetensors checkpoints are read in place: no folder needed
            device_map = facts.device_map(call_arg(call, keyword="device_map"), site.order, site.scope)
            if device_map is None or "disk" not in device_map.devices:
                continue
            assumed = versions.describe("transformers")
            yield self.report(
                call,
                f"`{snippet(facts, call)}` offloads modules to disk from a non-safetensors checkpoint "
                f"(`use_safetensors=False`) without `offload_folder=`; assuming {assumed}, loading raises \"ValueError: "
                "The current `device_map` had weights offloaded to the disk, which needed to be re-saved. ... Please "
                "provide an `offload_folder` for them in `from_pretrained`.\"",
                fix_hint="Pass `offload_folder=\"offload\"`, or load the safetensors weights (disk offload then reads "
                "them in place).",
                severity=Severity.WARNING,
                related=_map_written(device_map),
            )


def _map_written(device_map) -> tuple:
    """Where the device map that offloads is written (a dict bound to a name, or built elsewhere)."""
    return ((device_map.node, "the device map that offloads is written here"),) if device_map.node is not None else ()
