"""``make_plan``: every (method, checkpointing, placement) of a model on a set of cards, from simulations.

* **1 GPU**: the simulated step on one card (extrapolated by layer, see :mod:`gpudoctor.plan.simulated`).
* **device_map**: accelerate's balanced map over all cards in one process, simulated per device.
* **DDP**: one full copy per card, each with its own batch: the 1-GPU simulation plus DDP's gradient
  buckets (a flat copy of the trainable gradients, ``gradient_as_bucket_view=False``, the default).
* **FSDP / ZeRO-3**: weights, gradients and AdamW's moments (bytes of the simulated model's parameters)
  divided by the number of cards, plus the two decoder layers FSDP gathers at a time (the current one and the prefetched
  next), plus the rest of the 1-GPU peak (activations, temporaries) unchanged. Not for quantized bases.

Every number is the engine's (or arithmetic on the engine's categories, named in ``source``);
``tests/plan`` compares them with direct simulations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from gpudoctor.plan import simulated
from gpudoctor.plan.simulated import Method, ModelInfo, Workload, depths
from gpudoctor.plan.strategies import METHOD_RANK, PLACEMENT_RANK, methods_for, rules_for, seconds_per_sample

MiB = 1 << 20
EMPTY = {"peak_allocated": 0, "peak_reserved": 0, "breakdown": {c: 0 for c in simulated.CATEGORIES}}
SEGMENT = 2 * MiB  # large-pool segments are rounded to 2 MiB


@dataclass
class Row:
    method: Method
    checkpointing: bool
    placement: str
    devices: list[dict]  # per card: peak_allocated, peak_reserved, breakdown
    usable: list[int]
    cpu_ram: int
    offloaded: int
    source: str
    seconds_per_sample: float | None = None
    rules: list[str] = field(default_factory=list)
    error: str | None = None  # the engine could not simulate this case

    @property
    def fullest(self) -> int:
        return max(range(len(self.devices)), key=lambda i: self.devices[i]["peak_reserved"] / max(self.usable[i], 1))

    @property
    def peak(self) -> int:
        return self.devices[self.fullest]["peak_reserved"]

    @property
    def peak_allocated(self) -> int:
        return self.devices[self.fullest]["peak_allocated"]

    @property
    def headroom(self) -> int:
        return self.usable[self.fullest] - self.peak

    @property
    def fits(self) -> bool:
        return all(d["peak_reserved"] <= u for d, u in zip(self.devices, self.usable)) and not self.offloaded and not self.error

    @property
    def verdict(self) -> str:
        if self.error:
            return "not simulated"
        if self.offloaded:
            return "no (offload)"
        if self.fits:
            return "fits"
        # the real allocator frees its cache and retries before it fails: allocated is the hard floor
        if all(d["peak_allocated"] <= u for d, u in zip(self.devices, self.usable)):
            return "tight"
        return "no"

    def to_json(self) -> dict:
        return {"method": self.method.key, "method_label": self.method.label, "gradient_checkpointing": self.checkpointing,
                "placement": self.placement, "gpus": len(self.devices), "fullest_gpu": self.fullest,
                "peak_reserved": self.peak, "peak_allocated": self.peak_allocated, "usable": self.usable[self.fullest],
                "headroom": self.headroom, "fits": self.fits, "verdict": self.verdict, "cpu_ram": self.cpu_ram,
                "seconds_per_sample": self.seconds_per_sample, "rules": self.rules, "source": self.source, "error": self.error,
                "devices": self.devices}


class Planner:
    """Simulations for one model, workload and set of cards; each result computed once."""

    def __init__(self, info: ModelInfo, cards, workload: Workload, use_cache: bool = True, progress=None):
        self.info, self.cards, self.workload, self.use_cache = info, list(cards), workload, use_cache
        self.progress = progress or (lambda message: None)
        self._maps: dict = {}
        self._collecting: list | None = None
        self._quantized_bytes: dict = {}

    # -- simulations ------------------------------------------------------------------------------
    def _sim(self, method, checkpointing, layers, roles=None, workload=None):
        args = (self.info, method, workload or self.workload, checkpointing, self.cards[0], layers, roles)
        if self._collecting is not None:  # listing what to simulate: a placeholder result
            self._collecting.append(args)
            return {"devices": [EMPTY] * len(self.cards), "trainable_bytes": 0}
        return simulated.simulate(*args, use_cache=self.use_cache)

    def prefetch(self, cases: list[tuple[Method, bool, Workload | None]]) -> None:
        """Simulate everything ``rows_for`` needs for these cases, as many at a time as there are cores."""
        self._collecting = []
        try:
            for method, checkpointing, workload in cases:
                self.rows_for(method, checkpointing, workload)
            requests = self._collecting
        finally:
            self._collecting = None
        simulated.prefetch(requests, use_cache=self.use_cache, progress=self.progress)

    def _extrapolates(self, method: Method, roles: int) -> bool:
        return self.info.layers_path is not None and self.info.num_layers > depths(method)[1] * roles

    def single(self, method: Method, checkpointing: bool, workload: Workload | None = None) -> tuple[dict, int, str]:
        """(peaks on one card, trainable bytes, source) of the whole model."""
        k1, k2 = depths(method)
        if not self._extrapolates(method, 1):
            run = self._sim(method, checkpointing, None, workload=workload)
            return run["devices"][0], run["trainable_bytes"], "simulated"
        first = self._sim(method, checkpointing, (k1,), workload=workload)
        second = self._sim(method, checkpointing, (k2,), workload=workload)
        n = self.info.num_layers
        trainable = int(round(simulated.linear(first["trainable_bytes"], second["trainable_bytes"], n, k1, k2)))
        return simulated.extrapolate(first["devices"][0], second["devices"][0], n, k1, k2), trainable, "simulated, by layer"

    def device_map(self, method: Method) -> dict:
        if method not in self._maps:
            self._maps[method] = simulated.device_map_for(self.info, method, self.cards)
        return self._maps[method]

    def pipeline(self, method: Method, checkpointing: bool, workload: Workload | None = None) -> tuple[list[dict], int, str]:
        """(peaks per card, offloaded bytes, source) under accelerate's balanced map over all cards."""
        dmap = self.device_map(method)
        offloaded_keys = [k for k, d in dmap.items() if d in ("cpu", "disk")]
        offloaded = simulated.module_bytes(self.info, method, offloaded_keys) if offloaded_keys else 0
        resident = sorted({d for d in dmap.values() if isinstance(d, int)})
        devices = [dict(EMPTY) for _ in self.cards]
        roles_n = min(len(resident), 3)
        if not resident:
            return devices, offloaded, "simulated"
        k1, k2 = depths(method)
        counts = simulated.layers_per_device(self.info, dmap)
        # a card with fewer layers than the shallowest copy (e.g. only the embeddings) is off the line: whole model
        if not self._extrapolates(method, roles_n) or min(counts.get(d, 0) for d in resident) < k1:
            run = self._sim(method, checkpointing, None, roles=dmap, workload=workload)
            for i, d in enumerate(resident):
                devices[d] = run["devices"][i] if i < len(run["devices"]) else EMPTY
            return devices, offloaded, "simulated"
        role_of = {d: (0 if d == resident[0] else roles_n - 1 if d == resident[-1] else 1) for d in resident}
        roles = {k: (role_of[d] if isinstance(d, int) else d) for k, d in dmap.items() if simulated.layer_index(self.info, k) is None}
        first = self._sim(method, checkpointing, (k1,) * roles_n, roles, workload=workload)
        second = self._sim(method, checkpointing, (k2,) * roles_n, roles, workload=workload)
        for d in resident:
            r = role_of[d]
            devices[d] = simulated.extrapolate(first["devices"][r], second["devices"][r], counts.get(d, 0), k1, k2)
        return devices, offloaded, "simulated per device, by layer"

    # -- rows ---------------------------------------------------------------------------------------
    def rows_for(self, method: Method, checkpointing: bool, workload: Workload | None = None) -> list[Row]:
        wl = workload or self.workload
        n = len(self.cards)
        usable = [c.usable for c in self.cards]
        weight_bytes = self._weight_bytes(method)
        placements = ["1 GPU"] + (["device_map", "DDP"] + ([] if method.quant_bits else ["FSDP"]) if n > 1 else [])
        rows = []
        try:
            one, trainable, source = self.single(method, checkpointing, wl)
        except simulated.SimulationFailed as exc:
            rows = [Row(method, checkpointing, p, [EMPTY] * (1 if p == "1 GPU" else n), usable, 0, 0, "", error=str(exc))
                    for p in placements if p != "device_map"]
        else:
            rows.append(Row(method, checkpointing, "1 GPU", [one], usable[:1], 0, 0, source))
            if "DDP" in placements:
                rows.append(Row(method, checkpointing, "DDP", [ddp_peaks(one, trainable)] * n, usable,
                                n * weight_bytes, 0, f"{source} + DDP gradient buckets"))
            if "FSDP" in placements:
                layer_bytes = self.info.layer_params * _dtype_bytes(method.dtype)
                # AdamW keeps two moments shaped and typed like each trainable parameter, gradients one more
                state = weight_bytes + 3 * trainable
                rows.append(Row(method, checkpointing, "FSDP", [fsdp_peaks(one, n, layer_bytes, state)] * n, usable,
                                weight_bytes, 0, f"{source}; state / {n} + 2 gathered layers"))
        if "device_map" in placements:
            try:
                devices, offloaded, psource = self.pipeline(method, checkpointing, wl)
                rows.insert(1, Row(method, checkpointing, "device_map", devices, usable, offloaded, offloaded, psource))
            except simulated.SimulationFailed as exc:
                rows.insert(1, Row(method, checkpointing, "device_map", [EMPTY] * n, usable, 0, 0, "", error=str(exc)))
        tokens = wl.seq + ((wl.target_len or wl.seq) if self.info.encoder_decoder else 0)
        for row in rows:
            row.seconds_per_sample = seconds_per_sample(method, checkpointing, row.placement, self.cards, self.info.num_params, tokens)
            row.rules = [] if row.error else rules_for(method, row.placement, row.fits, row.offloaded, self.cards[0])
        return rows

    def _weight_bytes(self, method: Method) -> int:
        if not method.quant_bits:
            return self.info.num_params * _dtype_bytes(method.dtype)
        if method not in self._quantized_bytes:
            self._quantized_bytes[method] = simulated.module_bytes(self.info, method, [""])
        return self._quantized_bytes[method]


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def _round_segment(n: int) -> int:
    return -(-n // SEGMENT) * SEGMENT


def ddp_peaks(one: dict, trainable_bytes: int) -> dict:
    """One card of DDP: the 1-GPU peak plus the gradient buckets (a flat copy of every trainable gradient)."""
    bucket = _round_segment(trainable_bytes)
    breakdown = dict(one["breakdown"])
    breakdown["gradients"] = breakdown.get("gradients", 0) + bucket
    return {"peak_allocated": one["peak_allocated"] + bucket, "peak_reserved": one["peak_reserved"] + bucket, "breakdown": breakdown}


def fsdp_peaks(one: dict, n: int, layer_bytes: int, state_bytes: int) -> dict:
    """One card of FSDP / ZeRO-3 from the 1-GPU peak: ``state_bytes`` (weights, gradients and AdamW's two
    moments, all resident at the 1-GPU peak) sharded n ways, two full layers gathered."""
    state = min(state_bytes, one["peak_allocated"])
    gathered = _round_segment(2 * layer_bytes)
    change = -state + -(-state // n) + gathered
    breakdown = dict(one["breakdown"])
    breakdown["sharded_state"] = -(-state // n)
    breakdown["gathered_layers"] = gathered
    return {"peak_allocated": one["peak_allocated"] + change, "peak_reserved": one["peak_reserved"] + change,
            "breakdown": breakdown}


@dataclass
class Plan:
    info: ModelInfo
    cards: list
    workload: Workload
    rows: list[Row]
    recommended: Row | None
    largest_batch: int | None = None
    largest_seq: int | None = None

    def to_json(self) -> dict:
        from gpudoctor.plan.advice import recommendation, snippet

        return {"model": self.info.name, "model_source": self.info.source, "cards": [c.name for c in self.cards],
                "usable_per_card": [c.usable for c in self.cards], "workload": dataclasses.asdict(self.workload),
                "rows": [r.to_json() for r in self.rows],
                "recommended": self.recommended.to_json() if self.recommended else None,
                "recommendation": recommendation(self), "code": snippet(self),
                "largest_batch": self.largest_batch, "largest_seq": self.largest_seq}


def choose(rows: list[Row]) -> Row | None:
    """The least change to full fine-tuning that fits: method first, then no checkpointing, then the simplest launch."""
    fitting = [r for r in rows if r.fits and not r.rules]
    if not fitting:
        fitting = [r for r in rows if r.fits]
    return min(fitting, key=lambda r: (METHOD_RANK[r.method.key], r.checkpointing, PLACEMENT_RANK[r.placement]), default=None)


def make_plan(model: str, cards, workload: Workload, *, use_cache: bool = True, search: bool = True,
              methods: list[str] | None = None, progress=None) -> Plan:
    from gpudoctor.simulate.cards import parse_spec

    cards = parse_spec(cards) if isinstance(cards, str) else list(cards)
    info = simulated.resolve(model)
    planner = Planner(info, cards, workload, use_cache=use_cache, progress=progress)
    cases = [(m, checkpointing, None) for m in methods_for(cards) if not methods or m.key in methods for checkpointing in (False, True)]
    planner.prefetch(cases)
    rows = [row for method, checkpointing, _ in cases for row in planner.rows_for(method, checkpointing)]
    best = choose(rows)
    plan = Plan(info, cards, workload, rows, best)
    if best is not None and search:
        from gpudoctor.plan.search import largest

        def fits_with(**change):
            wl = dataclasses.replace(workload, **change)
            planner.prefetch([(best.method, best.checkpointing, wl)])
            return next(r for r in planner.rows_for(best.method, best.checkpointing, wl) if r.placement == best.placement)

        plan.largest_batch = largest(lambda b: fits_with(batch=b), workload.batch, limit=4096)
        max_seq = int(getattr(info.config, "max_position_embeddings", 0) or getattr(info.config, "n_positions", 0) or 32768)
        plan.largest_seq = largest(lambda s: fits_with(seq=s), workload.seq, limit=max_seq)
    return plan
