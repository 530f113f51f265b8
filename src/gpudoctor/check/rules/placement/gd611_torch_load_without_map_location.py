from __future__ import annotations

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import exclusive_branches, snippet
from gpudoctor.check.rule import Rule

_MULTI_GPU = ("init_process_group", "DistributedDataParallel", "LOCAL_RANK", "torchrun", "nproc_per_node")


class TorchLoadWithoutMapLocation(Rule):
    """``torch.load(path)`` without ``map_location`` in a script that runs one process per GPU: tensors
    saved from ``cuda:0`` are restored onto ``cuda:0`` in *every* rank (``set_device`` does not change
    that), so GPU 0 holds N copies of the checkpoint. Preview: the file cannot show whether the
    checkpoint holds CUDA tensors at all."""

    code = "GD611"
    name = "torch-load-without-map-location"
    summary = "torch.load without map_location in a multi-GPU (one process per GPU) script"
    severity = Severity.WARNING
    preview = True
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
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node, 50)}` has no `map_location`, and the file runs one process per GPU "
                f"({', '.join('`' + h + '`' for h in hints[:2])}): tensors saved from a GPU come back on the device "
                "they were saved from (`cuda:0`) in every rank, so GPU 0 receives one copy per process (OOM on GPU 0, "
                "or a replica silently built there).",
                fix_hint="`torch.load(path, map_location=\"cpu\")` (then load_state_dict copies into each rank's "
                "model), or `map_location=f\"cuda:{local_rank}\"`.",
            )
