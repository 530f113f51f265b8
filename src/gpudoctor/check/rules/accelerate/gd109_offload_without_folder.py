from __future__ import annotations

from gpudoctor.check import apis, versions
from gpudoctor.check.facts import FileFacts, call_arg
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
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
    triggers = ("disk",)

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
                if device_map is None or "disk" not in device_map.devices:
                    continue
                yield self.report(
                    call,
                    f"`{snippet(facts, call)}` gets a device map with `\"disk\"` entries but no `{folder_kw}=`, so it "
                    f"raises \"{message}\"",
                    fix_hint=f"Pass `{folder_kw}=\"offload\"` (any writable folder), or keep those modules on cpu.",
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
            )
