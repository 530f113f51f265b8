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
    def estimate(self) -> bool:
        """Arithmetic on the 1-GPU row's simulation, not a sharded simulation of this model (FSDP / ZeRO-3; the
        arithmetic itself is checked against FSDP2 on a layer stack in tests/plan/test_plan_fsdp.py)."""
        return self.placement == "FSDP" and not self.error

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
                "estimate": self.estimate,
                "devices": self.devices}


class Planner:
    """Simulations for one model, workload and set of cards; each result computed once."""

    def __init__(self, info: ModelInfo, cards, workload: Workload, use_cache: bool = True, progress=None):
        self.info, self.cards, self.workload, self.use_cache = info, list(cards), workload, use_cache
        self.progress = progress or (lambda message: None)
        self._maps: dict = {}
        self._collecting: list | None = None
        self._bytes: dict = {}

    # -- simulations ------------------------------------------------------------------------------
    def _sim(self, method, checkpointing, layers, roles=None, workload=None):
        args = (self.info, method, workload or self.workload, checkpointing, self.cards[0], layers, roles)
        if self._collecting is not None:  # listing what to simulate: a placeholder result
            self._collecting.append(args)
            return {"devices": [EMPTY] * len(self.cards), "trainable_bytes": 0}
        return simulated.simulate(*args, use_cache=self.use_cache)

    def prefetch(self, cases: list[tuple]) -> None:
        """Simulate everything ``rows_for`` needs for these cases (its arguments), as many at a time as
        there are cores."""
        self._collecting = []
        try:
            for case in cases:
                self.rows_for(*case)
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

    def module_bytes(self, method: Method, names: list[str]) -> int:
        key = (method, tuple(names))
        if key not in self._bytes:
            self._bytes[key] = simulated.module_bytes(self.info, method, names)
        return self._bytes[key]

    def pipeline(self, method: Method, checkpointing: bool, workload: Workload | None = None) -> tuple[list[dict], int, str]:
        """(peaks per card, offloaded bytes, source) under accelerate's balanced map over all cards."""
        dmap = self.device_map(method)
        offloaded_keys = [k for k, d in dmap.items() if d in ("cpu", "disk")]
        offloaded = self.module_bytes(method, offloaded_keys) if offloaded_keys else 0
        resident = sorted({d for d in dmap.values() if isinstance(d, int)})
        devices = [dict(EMPTY) for _ in self.cards]
        if not resident:
            return devices, offloaded, "simulated"
        roles_n = min(len(resident), 3)
        if not self._extrapolates(method, roles_n):
            run = self._sim(method, checkpointing, None, roles=dmap, workload=workload)
            for i, d in enumerate(resident):
                devices[d] = run["devices"][i] if i < len(run["devices"]) else EMPTY
            return devices, offloaded, "simulated"
        counts = simulated.layers_per_device(self.info, dmap)
        if roles_n == 1:
            devices[resident[0]] = self._pipeline_one_card(method, checkpointing, dmap, resident[0], counts, workload)
            return devices, offloaded, "simulated per device, by layer"
        # one reduced copy on four devices: the first card's modules, a middle card at two depths (its line; the
        # per-layer growth of every card: a decoder layer adds the same weights, state and activations to the card
        # that holds it), the last card's modules. The first and last cards are simulated at their own layer
        # count when it is at most the shallow depth, else there and continued along the middle line.
        k1, k2 = depths(method)
        first, last = resident[0], resident[-1]
        middle_held = [counts.get(d, 0) for d in resident[1:-1]]
        low = min(middle_held, default=0)
        a, b = (low, low + 1) if 0 < low < k1 else (k1, k2)
        edge = {first: min(counts.get(first, 0), k1), last: min(counts.get(last, 0), k1)}
        slot = {first: 0, last: 3}
        roles = {k: (slot.get(d, 1) if isinstance(d, int) else d) for k, d in dmap.items()
                 if simulated.layer_index(self.info, k) is None}
        out = self._sim(method, checkpointing, (edge[first], a, b, edge[last]), roles, workload=workload)["devices"]
        if len(out) < 4:  # a placeholder while listing what to simulate
            out = [EMPTY] * 4
        for d in resident:
            if d in slot:
                point = out[slot[d]]
                devices[d] = point if counts.get(d, 0) == edge[d] else simulated.extrapolate(
                    point, _step(point, out[1], out[2]), counts.get(d, 0), edge[d], edge[d] + (b - a))
            else:
                devices[d] = simulated.extrapolate(out[1], out[2], counts.get(d, 0), a, b)
        return devices, offloaded, "simulated per device, by layer"

    def _pipeline_one_card(self, method, checkpointing, dmap, card, counts, workload) -> dict:
        """A map that puts every resident module on one card: that card's line through two depths."""
        k1, k2 = depths(method)
        held = counts.get(card, 0)
        a, b = (held, held + 1) if 0 < held < k1 else (k1, k2)
        roles = {k: (0 if isinstance(d, int) else d) for k, d in dmap.items() if simulated.layer_index(self.info, k) is None}
        first = self._sim(method, checkpointing, (a,), roles, workload=workload)["devices"][0]
        second = self._sim(method, checkpointing, (b,), roles, workload=workload)["devices"][0]
        return simulated.extrapolate(first, second, held, a, b)

    # -- rows ---------------------------------------------------------------------------------------
    def placements(self, method: Method) -> list[str]:
        multi = ["device_map", "DDP"] + ([] if method.quant_bits else ["FSDP"])
        return ["1 GPU"] + (multi if len(self.cards) > 1 else [])

    def rows_for(self, method: Method, checkpointing: bool, workload: Workload | None = None,
                 only: str | None = None) -> list[Row]:
        """The rows of one method (all its placements, or ``only`` one: what the search probes)."""
        wl = workload or self.workload
        n = len(self.cards)
        usable = [c.usable for c in self.cards]
        placements = [p for p in self.placements(method) if only is None or p == only]
        rows = []
        if any(p != "device_map" for p in placements):
            try:
                one, trainable, source = self.single(method, checkpointing, wl)
            except simulated.SimulationFailed as exc:
                rows = [Row(method, checkpointing, p, [EMPTY] * (1 if p == "1 GPU" else n), usable, 0, 0, "", error=str(exc))
                        for p in placements if p != "device_map"]
            else:
                weight_bytes = self._weight_bytes(method)
                if "1 GPU" in placements:
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
            at = 1 if rows and rows[0].placement == "1 GPU" else 0
            try:
                devices, offloaded, psource = self.pipeline(method, checkpointing, wl)
                rows.insert(at, Row(method, checkpointing, "device_map", devices, usable, offloaded, offloaded, psource))
            except simulated.SimulationFailed as exc:
                rows.insert(at, Row(method, checkpointing, "device_map", [EMPTY] * n, usable, 0, 0, "", error=str(exc)))
        tokens = wl.seq + ((wl.target_len or wl.seq) if self.info.encoder_decoder else 0)
        for row in rows:
            row.seconds_per_sample = seconds_per_sample(method, checkpointing, row.placement, self.cards, self.info.num_params, tokens)
            row.rules = [] if row.error else rules_for(method, row.placement, row.fits, row.offloaded, self.cards[0])
        return rows

    def _weight_bytes(self, method: Method) -> int:
        if not method.quant_bits:
            return self.info.num_params * _dtype_bytes(method.dtype)
        return self.module_bytes(method, [""])


def _step(point: dict, low: dict, high: dict) -> dict:
    """``point`` moved by the difference from ``low`` to ``high`` (every number and category, and each phase's
    peak where all three have it)."""
    out = {key: point[key] + high[key] - low[key] for key in ("peak_allocated", "peak_reserved")}
    out["breakdown"] = {c: point["breakdown"].get(c, 0) + high["breakdown"].get(c, 0) - low["breakdown"].get(c, 0)
                        for c in simulated.CATEGORIES}
    phases = [point.get("phases") or {}, low.get("phases") or {}, high.get("phases") or {}]
    out["phases"] = {name: _step(phase, phases[1][name], phases[2][name]) for name, phase in phases[0].items()
                     if name in phases[1] and name in phases[2]}
    return out


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


# Phases in which FSDP / ZeRO-3 holds gathered (unsharded) layers: it gathers a layer's weights for its forward
# and again for its backward, and frees them after; the optimizer step works on the shards only.
_GATHERING_PHASES = ("forward", "eval", "backward")


def fsdp_peaks(one: dict, n: int, layer_bytes: int, state_bytes: int) -> dict:
    """One card of FSDP / ZeRO-3 from the 1-GPU simulation, phase by phase when it has phases: weights,
    gradients and optimizer state sharded n ways; the optimizer step's temporaries too (AdamW's per-parameter
    arithmetic runs on the shards); two full layers gathered during forward and backward; activations and other
    temporaries as on one GPU (each rank runs its own batch). The card's peak is the highest phase. Without
    phases (an older result): ``state_bytes`` sharded at the 1-GPU peak, two gathered layers added."""
    gathered = _round_segment(2 * layer_bytes)
    phases = one.get("phases") or {}
    if not phases:
        state = min(state_bytes, one["peak_allocated"])
        change = -state + -(-state // n) + gathered
        breakdown = dict(one["breakdown"])
        breakdown["sharded_state"] = -(-state // n)
        breakdown["gathered_layers"] = gathered
        return {"peak_allocated": one["peak_allocated"] + change, "peak_reserved": one["peak_reserved"] + change,
                "breakdown": breakdown}
    cards = {name: _fsdp_phase(name, phase, n, gathered) for name, phase in phases.items()}
    name = max(cards, key=lambda k: cards[k]["peak_allocated"])
    out = dict(cards[name])
    out["peak_reserved"] = max(card["peak_reserved"] for card in cards.values())
    out["phases"] = cards
    return out


def _fsdp_phase(name: str, phase: dict, n: int, gathered: int) -> dict:
    b = phase["breakdown"]
    resident = b.get("weights", 0) + b.get("gradients", 0) + b.get("optimizer_state", 0)
    temporaries = b.get("temporaries", 0)
    kept_temporaries = -(-temporaries // n) if name == "optimizer_step" else temporaries
    extra = gathered if name in _GATHERING_PHASES else 0
    change = -resident + -(-resident // n) - temporaries + kept_temporaries + extra
    breakdown = {c: v for c, v in b.items() if c not in ("weights", "gradients", "optimizer_state")}
    breakdown["temporaries"] = kept_temporaries
    breakdown["sharded_state"] = -(-resident // n)
    breakdown["gathered_layers"] = extra
    allocated = phase["peak_allocated"] + change
    # the caching allocator's slack over what is allocated stays what it was in this phase on one GPU
    return {"peak_allocated": allocated, "peak_reserved": max(phase["peak_reserved"] + change, allocated),
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
        plan.largest_batch, plan.largest_seq = search_limits(planner, best, info)
    return plan


def fixed_part(row: Row) -> int:
    """What of ``row``'s peak (fullest card, reserved) does not grow with the batch or the sequence: the peak
    less the activations and temporaries at that moment (the search's point at 0, only for aiming)."""
    device = row.devices[row.fullest]
    growing = sum(device["breakdown"].get(c, 0) for c in ("activations", "temporaries", "other"))
    return max(device["peak_reserved"] - growing, 0)


def search_limits(planner: Planner, best: Row, info: ModelInfo) -> tuple[int | None, int | None]:
    """The largest batch (at the planned sequence length) and sequence length (at the planned batch) that
    fit ``best``'s method and placement; only that placement is simulated, and the two searches' probes
    are simulated side by side."""
    from gpudoctor.plan.search import run_together, steps

    workload = planner.workload
    change = {"batch": lambda b: dataclasses.replace(workload, batch=b), "seq": lambda s: dataclasses.replace(workload, seq=s)}

    def row_at(name):
        return lambda x: planner.rows_for(best.method, best.checkpointing, change[name](x), best.placement)[0]

    def before(probes):
        planner.prefetch([(best.method, best.checkpointing, change[name](x), best.placement) for name, x in probes])

    max_seq = int(getattr(info.config, "max_position_embeddings", 0) or getattr(info.config, "n_positions", 0) or 32768)
    floor = fixed_part(best)
    found = run_together({"batch": (steps(workload.batch, 4096, floor=floor), row_at("batch")),
                          "seq": (steps(workload.seq, max_seq, floor=floor), row_at("seq"))}, before=before)
    return found["batch"], found["seq"]
