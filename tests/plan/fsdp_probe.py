"""Rank 0 of torch FSDP2 (``fully_shard``) over N virtual cards: one training step on the simulation engine.

Run as ``python fsdp_probe.py LAYERS RANKS``; prints ``{"peak_allocated": ..., "breakdown": {...}}`` of rank 0
(cuda:0) for a stack of ``LAYERS`` fp32 ``Linear(4096, 4096)``, each its own FSDP unit, AdamW; ``RANKS`` 1: the
same step on one card without FSDP (what ``plan``'s FSDP arithmetic starts from). torch's fake
process group stands in for the other ranks (collectives return without data, as fake tensors have none)
and the virtual backend gets stand-ins for the streams and events FSDP2 orders its copies with. A process of
its own: the process group and the backend's stand-ins are global.
"""

import contextlib
import json
import sys

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from gpudoctor.simulate import Simulation
from gpudoctor.simulate.cuda_api import _NoOpEvent, _NoOpStream  # the engine's stand-ins for torch.cuda's


def main(layers: int, ranks: int) -> dict:
    if ranks > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    with Simulation(f"{ranks}xH200") as sim:
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(layers)]).cuda()
        if ranks > 1:
            backend = torch.gpu  # the virtual backend's module (registered on entering the simulation)
            default = _NoOpStream(0)
            backend.Stream, backend.Event = _NoOpStream, _NoOpEvent
            backend.current_stream = backend.default_stream = lambda device=None: default
            backend.stream = lambda stream: contextlib.nullcontext()
            with unset_fake_temporarily():  # the mesh's rank arithmetic needs real tensors
                mesh = init_device_mesh("gpu", (ranks,))
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        for _ in range(2):
            model(torch.randn(8, 4096, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        device = sim.summary()["devices"][0]
    phases = {name: {"peak_allocated": p["allocated"], "peak_reserved": p["reserved"], "breakdown": p.get("by_category") or {}}
              for name, p in (device.get("phase_peaks") or {}).items()}
    return {"peak_allocated": device["peak_allocated"], "peak_reserved": device["peak_reserved"],
            "breakdown": device["breakdown_at_peak"], "phases": phases}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))))
