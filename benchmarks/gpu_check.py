"""Run the trace scenarios on real CUDA and print PyTorch's real messages next to gpudoctor's reports.

    python benchmarks/gpu_check.py [--json out.json]

Needs at least one CUDA GPU (two for the multi-GPU rows, which are skipped with a note otherwise).
Each scenario runs in its own subprocess (a CUDA error can poison a context) with a 90 s limit;
the whole script takes well under 5 minutes on one H200. It builds tiny Llama models from configs
(nothing is downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

PRELUDE = textwrap.dedent("""
    import json, sys, torch, torch.nn as nn
    from transformers import LlamaConfig, LlamaForCausalLM
    from gpudoctor.trace.api import Probe
    def llama(layers=2):
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    def report(run, *models):
        probe = Probe(*models, print_on_error=False)
        try:
            with probe:
                run()
        except BaseException as exc:
            print("REAL MESSAGE:", type(exc).__name__, str(exc)[:400])
        probe.print_report()
        print("JSON:" + json.dumps(probe.report(), default=str))
""")

SCENARIOS = {
    "5a_batch_on_cpu": (1, """
        m = llama().cuda()
        report(lambda: m(input_ids=torch.randint(0, 256, (2, 8))), m)
    """),
    "tensor_created_in_forward": (1, """
        class M(nn.Module):
            def __init__(self):
                super().__init__(); self.p = nn.Linear(8, 8)
            def forward(self, x):
                return self.p(x) * torch.ones(x.shape[0], 8)
        m = M().cuda()
        report(lambda: m(torch.randn(2, 8, device="cuda")), m)
    """),
    "conv_input_type": (1, """
        m = nn.Conv2d(3, 4, 3).cuda()
        report(lambda: m(torch.randn(1, 3, 8, 8)), m)
    """),
    "index_on_other_device": (1, """
        class M(nn.Module):
            def __init__(self):
                super().__init__(); self.table = torch.arange(10.)  # plain attribute stays on CPU
            def forward(self, t):
                return self.table[t]
        m = M().cuda()
        report(lambda: m(torch.tensor([1, 2], device="cuda")), m)
    """),
    "16a_optimizer_state_foreach": (1, """
        m = nn.Linear(8, 8); opt = torch.optim.Adam(m.parameters())
        m(torch.randn(2, 8)).sum().backward(); opt.step()
        m.cuda()
        def run():
            m(torch.randn(2, 8, device="cuda")).sum().backward(); opt.step()
        report(run, m)
    """),
    "cuda_oom_single_allocation": (1, """
        class Big(nn.Module):
            def __init__(self):
                super().__init__(); self.p = nn.Linear(8, 8)
            def forward(self, x):
                return self.p(x) + torch.empty(1 << 40, device="cuda")[:8]
        m = Big().cuda()
        report(lambda: m(torch.randn(2, 8, device="cuda")), m)
    """),
    "cuda_oom_training": (1, """
        free, total = torch.cuda.mem_get_info()
        torch.cuda.set_per_process_memory_fraction(min(1.0, 2 * 2**30 / total))
        m = llama(layers=8).cuda().train()
        ids = torch.randint(0, 256, (64, 2048), device="cuda")
        report(lambda: m(input_ids=ids, labels=ids).loss.backward(), m)
    """),
    "1d_offload_training_silent": (1, """
        import tempfile
        from accelerate import dispatch_model
        m = llama()
        dm = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.norm": 0, "lm_head": 0}
        m = dispatch_model(m, device_map=dm, main_device=0, offload_dir=tempfile.mkdtemp())
        opt = torch.optim.AdamW(m.parameters())
        ids = torch.randint(0, 256, (2, 8), device="cuda")
        def run():
            for _ in range(2):
                m(input_ids=ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad()
        report(run, m)
    """),
    "5e_manual_split": (2, """
        m = llama()
        m.model.embed_tokens.cuda(0); m.model.layers[0].cuda(0); m.model.rotary_emb.cuda(0)
        m.model.layers[1].cuda(1); m.model.norm.cuda(1); m.lm_head.cuda(1)
        report(lambda: m(input_ids=torch.randint(0, 256, (1, 4), device="cuda:0")), m)
    """),
    "6a_dataparallel_split": (2, """
        m = nn.Sequential(nn.Linear(8, 8).cuda(0), nn.Linear(8, 8).cuda(1))
        report(lambda: nn.DataParallel(m)(torch.randn(4, 8, device="cuda:0")), m)
    """),
    "12b_split_decoder_layer": (2, """
        from accelerate import dispatch_model
        m = llama()
        dm = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0.self_attn": 0, "model.layers.0.input_layernorm": 0,
              "model.layers.0.post_attention_layernorm": 0, "model.layers.0.mlp": 1, "model.layers.1": 1, "model.norm": 1, "lm_head": 1}
        m = dispatch_model(m, device_map=dm)
        report(lambda: m(input_ids=torch.randint(0, 256, (1, 4))), m)
    """),
    "15b_moved_after_dispatch": (2, """
        from accelerate import dispatch_model
        m = llama()
        dm = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1, "lm_head": 1}
        m = dispatch_model(m, device_map=dm)
        m.to("cuda:0")
        report(lambda: m(input_ids=torch.randint(0, 256, (1, 4))), m)
    """),
}


# --simulate accuracy: the same training step measured on this GPU and simulated on the CPU
# (gpudoctor.simulate.simulate_step); prints peak allocated for both and the gap in %.
TRAINING_STEPS = {
    "llama_fp32_full": dict(hidden=1024, layers=8, batch=4, seq=512, dtype="float32", lora=None),
    "llama_bf16_lora": dict(hidden=2048, layers=8, batch=4, seq=1024, dtype="bfloat16", lora={"r": 16, "lora_alpha": 32}),
    "llama_fp32_amp": dict(hidden=1024, layers=8, batch=8, seq=512, dtype="float32", lora=None, autocast="float16"),
}

STEP_CODE = textwrap.dedent("""
    import json, sys, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    spec = json.loads(sys.argv[1])
    def factory():
        config = LlamaConfig(hidden_size=spec["hidden"], intermediate_size=spec["hidden"] * 8 // 3, num_hidden_layers=spec["layers"],
                             num_attention_heads=spec["hidden"] // 64, num_key_value_heads=spec["hidden"] // 64, vocab_size=32000)
        return LlamaForCausalLM(config).to(getattr(torch, spec["dtype"]))
    if sys.argv[2] == "measure":
        from peft import LoraConfig, get_peft_model
        net = factory()
        if spec["lora"]:
            net = get_peft_model(net, LoraConfig(task_type="CAUSAL_LM", **spec["lora"]))
        net.cuda().train()
        opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4)
        for _ in range(2):
            ids = torch.randint(0, 32000, (spec["batch"], spec["seq"]), device="cuda")
            with torch.autocast("cuda", dtype=getattr(torch, spec.get("autocast") or "float16"), enabled=bool(spec.get("autocast"))):
                loss = net(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True); del loss
        print("PEAK", torch.cuda.max_memory_allocated())
    else:
        from gpudoctor.simulate import simulate_step
        r = simulate_step(factory, "1xH200", batch=spec["batch"], seq=spec["seq"], lora=spec["lora"], autocast=spec.get("autocast"))
        print("PEAK", r["devices"][0]["peak_allocated"])
""")


def compare_simulated() -> None:
    print("\n" + "=" * 100 + "\nsimulated (gpudoctor trace --simulate engine, on CPU) vs measured (this GPU) peak allocated")
    for name, spec in TRAINING_STEPS.items():
        peaks = {}
        for how in ("measure", "simulate"):
            env = dict(os.environ, CUDA_VISIBLE_DEVICES="" if how == "simulate" else os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
            proc = subprocess.run([sys.executable, "-c", STEP_CODE, json.dumps(spec), how], capture_output=True, text=True, timeout=300, env=env)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("PEAK")]
            peaks[how] = int(lines[-1].split()[1]) if lines else None
            if not lines:
                print(f"{name} {how} failed: {proc.stderr[-800:]}")
        if peaks["measure"] and peaks["simulate"]:
            gap = (peaks["simulate"] - peaks["measure"]) / peaks["measure"] * 100
            print(f"{name:20} measured {peaks['measure'] / 2**30:7.2f} GiB  simulated {peaks['simulate'] / 2**30:7.2f} GiB  gap {gap:+.1f}%")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="gpudoctor trace scenarios on real CUDA")
    parser.add_argument("--json", help="write every scenario's report here")
    parser.add_argument("--only", nargs="*", help="scenario names")
    parser.add_argument("--no-simulate", action="store_true", help="skip the simulated-versus-measured comparison")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU (the CPU test-suite covers the same scenarios on virtual GPUs)")
        return 2
    n_gpus = torch.cuda.device_count()
    print(f"torch {torch.__version__}, {n_gpus} GPU(s): {torch.cuda.get_device_name(0)}")
    results = {}
    for name, (needs, body) in SCENARIOS.items():
        if args.only and name not in args.only:
            continue
        print("\n" + "=" * 100 + f"\n{name}")
        if n_gpus < needs:
            print(f"skipped: needs {needs} GPUs, this machine has {n_gpus}")
            continue
        start = time.time()
        try:
            proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                                  timeout=90, env=dict(os.environ, COLUMNS="120"))
            out = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            out = f"TIMEOUT after 90 s\n{exc.stdout or ''}"
        for line in out.splitlines():
            if line.startswith("JSON:"):
                results[name] = json.loads(line[5:])
            else:
                print(line)
        print(f"[{time.time() - start:.1f} s]")
    if not args.no_simulate and not args.only:
        compare_simulated()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
