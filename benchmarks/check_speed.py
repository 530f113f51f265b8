"""How fast is `gpudoctor check` compared with parsing alone?

Times, in one run and on the same files (the installed sources of accelerate, peft and trl):

* the engine with every default rule, no cache, one process (discover, prefilter, parse, facts, rules);
* a bare ``libcst.parse_module`` of every file the engine parsed (those that passed the prefilter);

and prints both times and their ratio (target <= 1.5), then the wall time of ``gpudoctor check`` on a
~50-line training script through the CLI in a subprocess (target <= 0.4 s).

    python benchmarks/check_speed.py [--profile] [--repeat N]

``--profile`` prints where the engine's time goes (cProfile, top functions by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

import libcst as cst

from gpudoctor.check.config import Config
from gpudoctor.check.engine import check_file, decode_source, discover, is_relevant

PACKAGES = ("accelerate", "peft", "trl")

SCRIPT = textwrap.dedent(
    '''\
    import math

    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup

    MODEL = "gpt2"
    EPOCHS = 3
    ACCUM = 4


    def build(tokenizer, texts):
        encoded = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        encoded["labels"] = encoded["input_ids"].clone()
        encoded["labels"][encoded["attention_mask"] == 0] = -100
        rows = [dict(zip(encoded, values)) for values in zip(*encoded.values())]
        return DataLoader(rows, batch_size=8, shuffle=True)


    def main():
        accelerator = Accelerator(gradient_accumulation_steps=ACCUM, mixed_precision="bf16")
        tokenizer = AutoTokenizer.from_pretrained(MODEL)
        tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(MODEL)
        loader = build(tokenizer, ["hello world"] * 64)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        steps = math.ceil(len(loader) / ACCUM) * EPOCHS
        scheduler = get_linear_schedule_with_warmup(optimizer, 10, steps)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        for epoch in range(EPOCHS):
            model.train()
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
            accelerator.print(f"epoch {epoch}: loss {loss.item():.3f}")
        accelerator.wait_for_everyone()
        accelerator.unwrap_model(model).save_pretrained("out", save_function=accelerator.save)


    if __name__ == "__main__":
        main()
    '''
)


def corpus() -> list[Path]:
    site = Path(sysconfig.get_paths()["purelib"])
    roots = [site / name for name in PACKAGES if (site / name).is_dir()]
    if not roots:
        sys.exit(f"none of {', '.join(PACKAGES)} is installed in {site}")
    files, _ = discover([str(r) for r in roots], Config(root=site))
    return files


def time_engine(files: list[Path], config: Config) -> float:
    rules = config.selected_rules()
    start = time.process_time()  # CPU time: other processes on a loaded machine do not count
    for path in files:
        check_file(path, config, rules)
    return time.process_time() - start


def time_parse(files: list[Path]) -> tuple[float, int]:
    sources = []
    for path in files:
        data = path.read_bytes()
        if path.suffix == ".py" and is_relevant(data):
            sources.append(decode_source(data))
    start = time.process_time()
    for source in sources:
        cst.parse_module(source)
    return time.process_time() - start, len(sources)


def time_cli(cached: bool = False) -> float:
    """Best wall time of `gpudoctor check` on SCRIPT in a subprocess; ``cached``: unchanged since the last run."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(SCRIPT)
        command = [sys.executable, "-m", "gpudoctor", "check", *([] if cached else ["--no-cache"]), str(script)]
        subprocess.run(command, capture_output=True, cwd=tmp)  # warm the OS file cache (and fill the check cache)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            subprocess.run(command, capture_output=True, cwd=tmp)
            best = min(best, time.perf_counter() - start)
    return best


def _wall(command: list[str]) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run(command, capture_output=True)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="print a cProfile summary of the engine run")
    parser.add_argument("--repeat", type=int, default=1, help="best of N runs (default 1)")
    args = parser.parse_args()

    files = corpus()
    config = Config(root=Path.cwd())
    time_engine(files[:20], config)  # import every rule module and warm caches outside the timing
    parse_s, parsed = min((time_parse(files) for _ in range(args.repeat)), key=lambda r: r[0])
    engine_s = min(time_engine(files, config) for _ in range(args.repeat))
    ratio = engine_s / parse_s if parse_s else float("inf")
    print(f"corpus: {len(files)} files under {', '.join(PACKAGES)}; {parsed} pass the prefilter and are parsed")
    print(f"libcst.parse_module only : {parse_s:7.2f} s CPU")
    print(f"gpudoctor check (engine)  : {engine_s:7.2f} s CPU   ({len(config.selected_rules())} default rules, no cache, 1 process)")
    print(f"ratio engine / parse      : {ratio:7.2f}   (target <= 1.5) {'OK' if ratio <= 1.5 else 'ABOVE TARGET'}")
    cli_s = time_cli()
    print(f"CLI on a {len(SCRIPT.splitlines())}-line script : {cli_s:7.3f} s wall, best of 3 (target <= 0.4) {'OK' if cli_s <= 0.4 else 'ABOVE TARGET'}")
    floor = {label: _wall([sys.executable, "-c", code]) for label, code in (("bare python", "pass"), ("import libcst", "import libcst"))}
    print("  for scale, same machine now: " + ", ".join(f"{k} {v:.3f} s" for k, v in floor.items()))
    print(f"  ratio CLI / `python -c 'import libcst'`: {cli_s / floor['import libcst']:.2f} (parsing needs libcst loaded)")
    cached_s = time_cli(cached=True)
    print(f"CLI, same script unchanged (cache) : {cached_s:7.3f} s wall, best of 3 (target <= 0.4) {'OK' if cached_s <= 0.4 else 'ABOVE TARGET'}")

    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        time_engine(files, config)
        profiler.disable()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).sort_stats("cumulative")
        stats.print_stats(35)
        print(out.getvalue())
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())


if __name__ == "__main__":
    main()


# ================================================================================================
# Section 2: the cache and parallel checking (kept separate from the section above).
#
#   * serial vs parallel (all cores) uncached engine time on the same corpus -> speed-up;
#   * a cold run that fills the cache, then the cached re-run of the unchanged tree, in process and
#     through the CLI in a subprocess (target < 1 s for the CLI re-run).


def time_cache_and_parallel() -> None:
    import os

    from gpudoctor.check.engine import check_paths

    files = corpus()
    site = Path(sysconfig.get_paths()["purelib"])
    roots = [str(site / name) for name in PACKAGES if (site / name).is_dir()]
    jobs = os.cpu_count() or 1
    print()
    print(f"-- cache and parallel checking ({len(files)} files, {jobs} cores) --")
    with tempfile.TemporaryDirectory() as tmp:
        config = Config(root=Path(tmp))
        start = time.perf_counter()
        serial = check_paths(roots, config, jobs=1, use_cache=False, progress=False)
        serial_s = time.perf_counter() - start
        start = time.perf_counter()
        parallel = check_paths(roots, config, jobs=jobs, use_cache=False, progress=False)
        parallel_s = time.perf_counter() - start
        same = [(f.path, f.line, f.code) for f in serial.findings] == [(f.path, f.line, f.code) for f in parallel.findings]
        print(f"uncached, 1 process       : {serial_s:7.2f} s")
        print(f"uncached, {jobs} processes{' ' * max(0, 6 - len(str(jobs)))}     : {parallel_s:7.2f} s   speed-up x{serial_s / parallel_s:.2f} (same findings: {same})")
        start = time.perf_counter()
        check_paths(roots, config, jobs=jobs, use_cache=True, progress=False)
        cold_s = time.perf_counter() - start
        start = time.perf_counter()
        cached = check_paths(roots, config, jobs=jobs, use_cache=True, progress=False)
        warm_s = time.perf_counter() - start
        assert len(cached.findings) == len(parallel.findings)
        command = [sys.executable, "-m", "gpudoctor", "check", "-q", "--exit-zero", *roots]
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            subprocess.run(command, capture_output=True, cwd=tmp)
            best = min(best, time.perf_counter() - start)
        print(f"cold run filling the cache: {cold_s:7.2f} s")
        print(f"cached re-run, in process : {warm_s:7.3f} s")
        print(f"cached re-run, CLI        : {best:7.3f} s wall, best of 3 (target < 1 s) {'OK' if best < 1 else 'ABOVE TARGET'}")


if __name__ == "__main__":
    time_cache_and_parallel()
