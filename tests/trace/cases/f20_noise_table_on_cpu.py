"""Diffusion training: a noise schedule object (not an nn.Module) keeps alphas_cumprod on the CPU and is gathered with
GPU timesteps in the user's add_noise (the `extract(a, t)` helper of DDPM code bases).

Source: https://github.com/huggingface/diffusers/issues/9485 (alphas_cumprod on cpu indexed by cuda timesteps)
and https://github.com/explainingai-code/DDPM-Pytorch/issues/5
"""
# case: {"kind": "failure", "exit": 1, "module": null, "cause": "user_code_mismatch", "fix": ["alphas_cumprod", ".to("]}
import torch
import torch.nn as nn

from gpudoctor.virtual import VirtualGPUs, fake_place


class NoiseSchedule:
    def __init__(self, steps=1000):
        self.alphas_cumprod = torch.cumprod(1 - torch.linspace(1e-4, 0.02, steps), 0)

    def add_noise(self, x, noise, t):
        a = self.alphas_cumprod.gather(-1, t).sqrt().view(-1, 1)  # <- line
        return a * x + (1 - a).sqrt() * noise


def main():
    schedule = NoiseSchedule()
    denoiser = nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 16))
    with VirtualGPUs():
        fake_place(denoiser, "gpu:0")
        x = torch.randn(8, 16, device="gpu:0")
        noise = torch.randn_like(x)
        t = torch.randint(0, 1000, (8,), device="gpu:0")
        loss = (denoiser(schedule.add_noise(x, noise, t)) - noise).pow(2).mean()
        loss.backward()


main()
