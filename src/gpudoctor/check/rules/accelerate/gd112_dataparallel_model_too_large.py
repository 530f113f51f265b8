from __future__ import annotations

from gpudoctor import hardware
from gpudoctor.check import apis
from gpudoctor.check.facts import TRAIT_DISPATCHED, TRAIT_PEFT, TRAIT_QUANTIZED, FileFacts, call_arg
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import _parameters_owner, checkpoint_name, params_from_name, sets_requires_grad, snippet, stated_gpus, weight_bytes
from gpudoctor.check.rule import Rule

_GIB = 1024**3


class DataParallelModelTooLarge(Rule):
    """``nn.DataParallel`` around a full fine-tune of a model whose name says it has billions of
    parameters: DataParallel keeps the whole model, its gradients and the optimizer state on
    ``device_ids[0]`` and replicates the weights to every GPU on each forward, so more GPUs add no memory."""

    code = "GD112"
    name = "dataparallel-model-too-large"
    summary = "nn.DataParallel for a full fine-tune too large for one GPU (DataParallel does not split the model)"
    severity = Severity.WARNING
    triggers = ("DataParallel",)

    def check(self, facts: FileFacts):
        if sets_requires_grad(facts):
            return  # parameters are frozen somewhere: the trained part is unknown
        for site in facts.calls_to(*apis.DATA_PARALLEL):
            module = call_arg(site.node, 0, "module")
            if module is None:
                continue
            value = facts.value(module, site.order, site.scope)
            if value.kind != "model" or value.has(TRAIT_DISPATCHED) or value.has(TRAIT_PEFT) or value.has(TRAIT_QUANTIZED):
                continue
            origin = value.origin()
            if not origin.trait("class") or origin.node is None:
                continue
            load_site = facts.call_site(origin.node)
            if load_site is None:
                continue
            name = checkpoint_name(facts, origin.node, load_site.order, load_site.scope)
            params = params_from_name(name)
            if params is None:
                continue
            optimizer = self._full_optimizer(facts, value)
            if optimizer is None:
                continue
            bytes_per_weight, dtype_note = weight_bytes(facts, origin.node, value)
            opt_name = optimizer.qualname.split(".")[-1]
            state = 2 * bytes_per_weight if opt_name in ("Adam", "AdamW") else 0
            per_param = 2 * bytes_per_weight + state
            total = params * per_param / _GIB
            gpus = hardware.for_file(stated_gpus(facts.source, model_names=True))
            if gpus is not None:
                if total <= gpus.gib_each:
                    continue
                severity = Severity.ERROR
                said = f" The GPUs are {gpus.describe()} (~{gpus.gib_each:.0f} GiB each)."
            elif total * _GIB > hardware.LARGEST_COMMON_GB * hardware.GB:
                severity = Severity.WARNING
                said = (
                    f" The hardware is unknown (give `--gpus`); this exceeds {hardware.LARGEST_COMMON_GB} GB, the largest "
                    "common card (RTX 3090/4090, A10G, L4)."
                )
            else:
                continue  # fits a common card: the hardware is unknown
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node)}` wraps a full fine-tune of `{name}` (~{params / 1e9:g}B parameters from "
                f"its name). DataParallel keeps weights, gradients and `{opt_name}` state on `device_ids[0]`: "
                f"~{per_param} B/param ({dtype_note}) = ~{total:.0f} GiB on GPU 0 before activations, and it copies the "
                f"~{params * bytes_per_weight / _GIB:.0f} GiB of weights to every other GPU on each forward; more GPUs add no "
                f"memory, so this runs out of memory on GPU 0 unless it alone holds all of it.{said}",
                fix_hint="Split the model instead of replicating it: LoRA (peft) on a single GPU or `device_map=\"auto\"` "
                "in one process, or shard it with FSDP/DeepSpeed ZeRO via `accelerate launch`.",
                severity=severity,
                related=((origin.node, "the model is loaded here"),),
            )

    @staticmethod
    def _full_optimizer(facts: FileFacts, dp_value):
        for site in facts.calls:
            if not (site.qualname and apis.is_optimizer(site.qualname)):
                continue
            owner = _parameters_owner(site.arg(0, "params"))
            if owner is None:
                continue
            owned = facts.value(owner, site.order, site.scope)
            if owned.has(TRAIT_PEFT):
                continue
            if owned.origin().node is dp_value.origin().node:
                return site
        return None
