"""Resuming: the optimizer state comes back on the CPU (map_location="cpu") while the parameters are on the GPU.

Source: https://github.com/huggingface/transformers/issues/24708 (optimizer state on another device after resume)
and https://github.com/rasbt/LLMs-from-scratch/issues/232
"""
# case: {"kind": "failure", "exit": 1, "module": null, "cause": "optimizer_state_device", "fix": ["load_state_dict"]}
import torch
import torch.nn as nn

from gpudoctor.virtual import VirtualGPUs, fake_place


def train_step(model, opt):
    model(torch.randn(8, 16, device="gpu:0")).pow(2).mean().backward()
    opt.step()  # <- line
    opt.zero_grad()


def main():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    with VirtualGPUs():
        fake_place(model, "gpu:0")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        train_step(model, opt)
        # what torch.load(ckpt, map_location="cpu") + opt.load_state_dict(...) leaves behind
        for state in opt.state.values():
            state["exp_avg"] = state["exp_avg"].to("cpu")
            state["exp_avg_sq"] = state["exp_avg_sq"].to("cpu")
        train_step(model, opt)


main()
