"""``gpudoctor plan --published``: the published measurements the simulator is checked against, through ``plan``.

The points are ``benchmarks/simulate_accuracy.py``'s (PEFT's README table "GPU memory required for adapting
LLMs on the few-shot dataset ought/raft/twitter_complaints", single A100 80GB, measured with
``torch.cuda.max_memory_allocated()`` by PEFT's example scripts; see that file for the reconstruction and
its uncertainties): fp32 weights, AdamW (single-tensor), batch 8 x 64 tokens (labels of 4 tokens for the
T5-family models), LoRA r=8, alpha 32 on peft's default target modules. Each is planned on ``1xA100-80GB``
and the plan's 1-GPU row (its peak allocated memory, the measured quantity) is compared with the
published figure, read as thousands of MiB (the scripts print MiB; the README says "GB").
"""

from __future__ import annotations

from dataclasses import dataclass

from gpudoctor.plan.simulated import Method, Workload

MiB = 1 << 20
GiB = 1 << 30
CARDS = "1xA100-80GB"
FULL = Method("full-fp32", "full fp32", "float32")
LORA = Method("lora-fp32", "LoRA (fp32 base)", "float32", lora=True)


@dataclass(frozen=True)
class Point:
    model: str
    method: Method
    published_gb: float | None  # None: the table says OOM
    target_len: int | None = None

    @property
    def workload(self) -> Workload:
        return Workload(batch=8, seq=64, target_len=self.target_len, lora_r=8, lora_alpha=32, lora_targets=None,
                        foreach=False)


# the order of benchmarks/simulate_accuracy.py's POINTS (a test keeps them the same)
POINTS = [
    Point("bigscience/T0_3B", LORA, 14.4, 4),
    Point("bigscience/bloomz-7b1", LORA, 32.0),
    Point("bigscience/T0_3B", FULL, 47.14, 4),
    Point("bigscience/bloomz-7b1", FULL, None),
    Point("bigscience/mt0-xxl", LORA, 56.0, 4),
    Point("bigscience/mt0-xxl", FULL, None, 4),
]


def reproduce(points=None, use_cache: bool = True, progress=None) -> list[dict]:
    """Each point's published figure next to the plan's 1-GPU row for it."""
    from gpudoctor.plan import simulated
    from gpudoctor.plan.planner import Planner
    from gpudoctor.simulate.cards import parse_spec

    cards = parse_spec(CARDS)
    out = []
    for point in points or POINTS:
        info = simulated.resolve(point.model)
        planner = Planner(info, cards, point.workload, use_cache=use_cache, progress=progress)
        planner.prefetch([(point.method, False, None, "1 GPU")])
        row = planner.rows_for(point.method, False, None, "1 GPU")[0]
        entry = {"model": point.model, "method": point.method.label, "published_gb": point.published_gb,
                 "published": "OOM" if point.published_gb is None else f"{point.published_gb:.2f}GB",
                 "peak_allocated": row.peak_allocated, "peak_reserved": row.peak, "fits": row.fits,
                 "verdict_matches": row.fits == (point.published_gb is not None), "source": row.source, "error": row.error,
                 "gap_percent": None}
        if point.published_gb is not None and not row.error:
            measured = point.published_gb * 1000 * MiB
            entry["gap_percent"] = round((row.peak_allocated - measured) / measured * 100, 1)
        out.append(entry)
    return out


def render(results: list[dict]) -> str:
    lines = [f"Published measurements (PEFT README, 1x A100 80GB, max_memory_allocated) through gpudoctor plan on {CARDS}",
             f"{'model':24} {'method':18} {'published':>10} {'plan':>10} {'gap':>7}  verdict"]
    for r in results:
        plan = "error" if r["error"] else (f"{r['peak_allocated'] / GiB:.2f}GiB" if r["fits"] else "OOM")
        gap = f"{r['gap_percent']:+.1f}%" if r["gap_percent"] is not None and r["fits"] else "-"
        lines.append(f"{r['model']:24} {r['method']:18} {r['published']:>10} {plan:>10} {gap:>7}  "
                     f"{'ok' if r['verdict_matches'] else 'WRONG'}")
    gaps = [abs(r["gap_percent"]) for r in results if r["gap_percent"] is not None and r["fits"]]
    if gaps:
        lines.append(f"largest |gap| {max(gaps):.1f}% (published 'GB' read as 1000 MiB); verdicts right: "
                     f"{sum(r['verdict_matches'] for r in results)}/{len(results)}")
    return "\n".join(lines)
