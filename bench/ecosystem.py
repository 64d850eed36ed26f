"""The libraries users bring, measured side by side on CPU and neuron (docs/ecosystem.md's table).

For each workload: the same tiny random model (built offline from a config, same seed) runs a few
warm-up steps on CPU and on neuron; the outputs of those steps are compared (max |neuron - CPU|),
the CPU fallbacks counted, then steady-state steps are timed on both (median of repeats, device
synchronised) and printed as a ratio. Needs the ecosystem extra (``make test`` installs it).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/ecosystem.py [--steps 5] [--only NAME] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import torchneuron  # noqa: E402

# The tiny models and data of tests/test_ecosystem.py, so the table and the tests measure the same.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_ecosystem import batch, sentences, tiny_dit, tiny_llama, tiny_unet, word_tokenizer  # noqa: E402

WARMUP = 3


def sync(device):
    if device == "neuron":
        torch.neuron.synchronize()


def ids(seed=0, size=2, length=10):
    return batch(seed, size, length)[0]


# -- workloads: setup(device) -> step() returning the tensor to compare ------------------------------
def peft_lora(device):
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                    target_modules=["q_proj", "v_proj"])).to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = ids(1).to(device)

    def step():
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def _fwd_bwd(model, inputs):
    def step():
        model.zero_grad()
        out = model(**inputs).sample
        out.square().mean().backward()
        return out.detach()
    return step


def unet_fwd_bwd(device):
    g = torch.Generator().manual_seed(1)
    inputs = {"sample": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor([10, 500]),
              "encoder_hidden_states": torch.randn(2, 5, 16, generator=g)}
    return _fwd_bwd(tiny_unet().to(device), {k: v.to(device) for k, v in inputs.items()})


def dit_fwd_bwd(device):
    g = torch.Generator().manual_seed(1)
    inputs = {"hidden_states": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor([3, 7]),
              "class_labels": torch.tensor([1, 4])}
    return _fwd_bwd(tiny_dit().eval().to(device), {k: v.to(device) for k, v in inputs.items()})


def ddpm_step(device):
    from diffusers import DDPMScheduler
    model = tiny_unet().to(device)
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    clean, cond, noise = (t.to(device) for t in (torch.randn(2, 4, 8, 8, generator=g),
                                                 torch.randn(2, 5, 16, generator=g),
                                                 torch.randn(2, 4, 8, 8, generator=g)))
    steps = torch.tensor([100, 900]).to(device)

    def step():
        noisy = scheduler.add_noise(clean, noise, steps)
        loss = torch.nn.functional.mse_loss(model(noisy, steps, cond).sample, noise)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def ddim_loop(device):
    from diffusers import DDIMScheduler
    from diffusers.utils.torch_utils import randn_tensor
    model = tiny_unet().eval().to(device)
    cond = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3)).to(device)
    # Latents from a neuron generator on both sides (copied to CPU for the CPU run).
    latents = randn_tensor((2, 4, 8, 8), generator=torch.Generator("neuron").manual_seed(0),
                           device=torch.device("neuron")).to(device)
    scheduler = DDIMScheduler(num_train_timesteps=1000)
    scheduler.set_timesteps(3)

    def step():
        x = latents
        with torch.no_grad():
            for t in scheduler.timesteps:
                x = scheduler.step(model(x, t, cond).sample, t, x, eta=0.0).prev_sample
        return x
    return step


def gradient_checkpointing(device):
    # Checkpointed GPT-2 with dropout 0.3; compared: checkpointed minus plain gradients (CPU and
    # neuron draw different dropout masks, so the two devices are not compared with each other).
    from transformers import GPT2Config, GPT2LMHeadModel

    def make(checkpointing):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                           resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)).to(device).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    plain, ckpt = make(False), make(True)
    x = ids(4).to(device)

    def grads(model, seed):
        model.zero_grad()
        torch.manual_seed(seed)
        model(input_ids=x, labels=x).loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    seeds = iter(range(1000))

    def step():
        seed = next(seeds)
        return grads(ckpt, seed) - grads(plain, seed)
    return step


def grad_scaler(device):
    model = tiny_llama(6).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
    x = ids(7).to(device)
    count = iter(range(1000))

    def step():
        loss = model(input_ids=x, labels=x).loss
        scaler.scale(loss).backward()
        if next(count) == 1:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return torch.stack([loss.detach(), torch.tensor(scaler.get_scale(), device=device)])
    return step


def compiled_lm(device):
    model = tiny_llama(8).eval().to(device)
    fn = torch.compile(model, backend="neuron") if device == "neuron" else model
    x = ids(9).to(device)

    def step():
        with torch.no_grad():
            return fn(input_ids=x, use_cache=True).logits
    return step


def encoder_fast_path(device):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval().to(device)
    x = torch.randn(4, 32, 64).to(device)

    def step():
        with torch.no_grad():
            return encoder(x)
    return step


def uint8_resize(device):
    import torch.nn.functional as F
    x = torch.randint(0, 256, (8, 3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    x = x.to(device)

    def step():
        return F.interpolate(x, size=(37, 45), mode="bilinear", antialias=True)
    return step


WORKLOADS = {
    "peft-lora-train-step": peft_lora,
    "diffusers-unet2dcond-fwd-bwd": unet_fwd_bwd,
    "diffusers-dit-fwd-bwd": dit_fwd_bwd,
    "diffusers-ddpm-train-step": ddpm_step,
    "diffusers-ddim-3-steps": ddim_loop,
    "hf-gpt2-checkpointing-dropout": gradient_checkpointing,
    "gradscaler-llama-step": grad_scaler,
    "torch.compile-llama-fwd-cache": compiled_lm,
    "nn.TransformerEncoder-fast-path": encoder_fast_path,
    "uint8-resize-antialias": uint8_resize,
}


def _time(step, device, steps, repeats=3):
    samples = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        samples.append((time.perf_counter() - start) / steps)
    return statistics.median(samples)


def measure(name, steps):
    setup = WORKLOADS[name]
    results = {}
    for device in ("cpu", "neuron"):
        torchneuron.metrics.reset()
        step = setup(device)
        outs = [step().float().cpu() for _ in range(WARMUP)]
        seconds = _time(step, device, steps)
        results[device] = (outs, seconds, dict(torchneuron.metrics.fallbacks))
    (cpu_outs, cpu_s, _), (outs, s, fallbacks) = results["cpu"], results["neuron"]
    if name == "hf-gpt2-checkpointing-dropout":
        diff = max(o.abs().max().item() for o in outs)        # checkpointed - plain, on neuron
        cpu_diff = max(o.abs().max().item() for o in cpu_outs)
        detail = f"ckpt-plain {diff:.1e} (CPU {cpu_diff:.1e})"
    else:
        diff = max((o - c).abs().max().item() for o, c in zip(outs, cpu_outs))
        detail = f"{diff:.1e}"
    return detail, fallbacks, s, cpu_s


def trl_sft(steps):
    """SFTTrainer: losses of the first steps compared, time per step after them."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer
    tokenizer = word_tokenizer()
    text = sentences(64)

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, args, state, control, **kw):
            sync(args.device.type)
            self.ends.append(time.perf_counter())

    out = {}
    for device in ("cpu", "neuron"):
        import tempfile
        clock = Clock()
        args = SFTConfig(output_dir=tempfile.mkdtemp(), use_cpu=device == "cpu", max_steps=WARMUP + steps,
                         per_device_train_batch_size=4, learning_rate=5e-3, logging_steps=1, report_to=[],
                         save_strategy="no", seed=0, disable_tqdm=True, max_length=32)
        trainer = SFTTrainer(model=tiny_llama(3), args=args, processing_class=tokenizer,
                             train_dataset=Dataset.from_dict({"text": text}), callbacks=[clock])
        torchneuron.metrics.reset()
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        gaps = [b - a for a, b in zip(clock.ends[WARMUP - 1:], clock.ends[WARMUP:])]
        out[device] = (losses, statistics.median(gaps), dict(torchneuron.metrics.fallbacks))
    diff = max(abs(a - b) for a, b in zip(out["neuron"][0], out["cpu"][0]))
    return f"{diff:.1e}", out["neuron"][2], out["neuron"][1], out["cpu"][1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--only", default=None)
    # CPU PyTorch's OpenMP threads spin-wait: on a loaded 2-core machine two of them run a tiny
    # model 10-200x slower than one. Use --threads 2 on a quiet machine.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}; CPU threads {args.threads}")
    print(f"{'workload':34s} {'max |neuron-CPU|':>26s} {'fallbacks':>10s} {'neuron ms':>10s} {'CPU ms':>8s} {'ratio':>6s}")
    names = list(WORKLOADS) + ["trl-sft-trainer-step"]
    for name in names:
        if args.only and args.only not in name:
            continue
        detail, fallbacks, s, cpu_s = trl_sft(args.steps) if name.startswith("trl") else measure(name, args.steps)
        fb = sum(fallbacks.values())
        print(f"{name:34s} {detail:>26s} {fb:>10d} {s * 1e3:10.3g} {cpu_s * 1e3:8.3g} {s / cpu_s:6.2g}", flush=True)
        if fallbacks:
            print(f"{'':34s} fallbacks: {fallbacks}")


if __name__ == "__main__":
    main()
