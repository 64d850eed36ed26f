"""The libraries users bring, on tiny random models built offline, against CPU PyTorch.

PEFT (LoRA training, merge, adapter save/load), TRL (``SFTTrainer``), Diffusers (UNet2DCondition and
DiT forward/backward, a DDPM training step, a DDIM sampling loop driven by a neuron
``torch.Generator``), and transformers features that lean on the device: gradient checkpointing
with dropout, ``GradScaler`` with an overflow, ``torch.compile`` with the default cache.

The ``ecosystem`` extra (``pip install -e '.[ecosystem]'``, done by ``make test``) provides diffusers,
peft, trl and datasets; without it these tests skip. Nothing is downloaded: every model comes from a
config, the tokenizer from a word list. docs/ecosystem.md has the measured table these back.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import torchneuron

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

DEV = "neuron"
WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "log", "red", "big", "quietly", "home"]


def tiny_llama(seed=0, **overrides):
    kwargs = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**kwargs))


def batch(seed=0, size=2, length=10):
    ids = torch.randint(3, 32, (size, length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


def close(got, want, rtol=1e-4, atol=1e-5):
    torch.testing.assert_close(got.detach().cpu() if isinstance(got, torch.Tensor) else got, want,
                               rtol=rtol, atol=atol)


# -- PEFT ------------------------------------------------------------------------------------------
def _lora_run(device, tmp_path):
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                    target_modules=["q_proj", "v_proj"])).to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, mask = (t.to(device) for t in batch(1))
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits.cpu()
    lora = {k: v.detach().cpu() for k, v in model.state_dict().items() if "lora_" in k}
    model.save_pretrained(tmp_path / device)
    with torch.no_grad():
        merged = model.merge_and_unload()(input_ids=ids).logits.cpu()
    return losses, adapted, lora, merged


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_peft_lora_training_merge_and_adapter_reload_match_cpu(tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel
    want = _lora_run("cpu", tmp_path)
    got = _lora_run(DEV, tmp_path)
    close(torch.tensor(got[0]), torch.tensor(want[0]))
    assert got[0][-1] < got[0][0]
    close(got[1], want[1], rtol=1e-4, atol=1e-4)
    for k in want[2]:
        close(got[2][k], want[2][k], rtol=1e-3, atol=1e-4)
    close(got[3], want[3], rtol=1e-4, atol=1e-4)
    close(got[3], got[1], rtol=1e-4, atol=1e-4)   # merging changes nothing the model computes
    # The adapter saved on neuron loads onto a fresh base model on neuron (and matches CPU's).
    reloaded = PeftModel.from_pretrained(tiny_llama().to(DEV), tmp_path / DEV).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=batch(1)[0].to(DEV)).logits
    close(logits, want[1], rtol=1e-4, atol=1e-4)


# -- TRL -------------------------------------------------------------------------------------------
def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def sentences(n=16, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (int(torch.randint(4, 12, (1,), generator=g)),),
                                                     generator=g).tolist()) for _ in range(n)]


def _sft_losses(tmp_path, use_cpu):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    args = SFTConfig(output_dir=str(tmp_path / ("cpu" if use_cpu else "neuron")), use_cpu=use_cpu, max_steps=4,
                     per_device_train_batch_size=4, learning_rate=5e-3, logging_steps=1, report_to=[],
                     save_strategy="no", seed=0, disable_tqdm=True, max_length=32, bf16=False, fp16=False)
    trainer = SFTTrainer(model=tiny_llama(3), args=args, processing_class=word_tokenizer(),
                         train_dataset=Dataset.from_dict({"text": sentences()}))
    torchneuron.metrics.reset()
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], args


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trl_sft_trainer_loss_curve_matches_cpu(tmp_path):
    pytest.importorskip("trl")
    want, cpu_args = _sft_losses(tmp_path, use_cpu=True)
    got, args = _sft_losses(tmp_path, use_cpu=False)
    # TRL's neuron path: batches padded to multiples of 128 tokens (CPU pads to the longest), which
    # must not change the loss.
    assert args.device.type == "neuron" and args.pad_to_multiple_of == 128 and cpu_args.pad_to_multiple_of is None
    assert len(got) == len(want) == 4
    close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    assert torchneuron.metrics()["fallbacks"] == {}


# -- Diffusers -------------------------------------------------------------------------------------
def tiny_unet():
    from diffusers import UNet2DConditionModel
    torch.manual_seed(0)
    return UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(16, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                                attention_head_dim=8, norm_num_groups=8)


def tiny_dit():
    from diffusers import DiTTransformer2DModel
    torch.manual_seed(0)
    return DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                 num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10,
                                 norm_num_groups=32)


def _forward_backward(model, device, inputs):
    # eval(): DiT drops class labels at random in training mode (the gradients are the same code).
    model = copy.deepcopy(model).to(device).eval()
    args = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    out = model(**args).sample
    out.square().mean().backward()
    return out.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["unet2d_condition", "dit"])
def test_diffusers_forward_and_backward_match_cpu(kind):
    pytest.importorskip("diffusers")
    g = torch.Generator().manual_seed(1)
    if kind == "dit":
        model = tiny_dit()
        inputs = {"hidden_states": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor([3, 7]),
                  "class_labels": torch.tensor([1, 4])}
    else:
        model = tiny_unet()
        inputs = {"sample": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor([10, 500]),
                  "encoder_hidden_states": torch.randn(2, 5, 16, generator=g)}
    want, want_grads = _forward_backward(model, "cpu", inputs)
    got, grads = _forward_backward(model, DEV, inputs)
    close(got, want, rtol=1e-4, atol=1e-4)
    assert grads.keys() == want_grads.keys()
    for name in want_grads:
        close(grads[name], want_grads[name], rtol=1e-3, atol=1e-4)


def _ddpm_step(device):
    from diffusers import DDPMScheduler
    model = tiny_unet().to(device)
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)   # Adam would turn rounding noise in ~0 gradients into lr-sized steps
    g = torch.Generator().manual_seed(2)
    clean, cond = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 5, 16, generator=g)
    noise, steps = torch.randn(2, 4, 8, 8, generator=g), torch.tensor([100, 900])
    noisy = scheduler.add_noise(clean.to(device), noise.to(device), steps.to(device))
    loss = torch.nn.functional.mse_loss(model(noisy, steps.to(device), cond.to(device)).sample, noise.to(device))
    loss.backward()
    opt.step()
    return loss.item(), noisy.cpu(), {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_diffusers_ddpm_training_step_matches_cpu():
    pytest.importorskip("diffusers")
    want_loss, want_noisy, want_state = _ddpm_step("cpu")
    loss, noisy, state = _ddpm_step(DEV)
    close(noisy, want_noisy)
    assert loss == pytest.approx(want_loss, rel=1e-4)
    for k in want_state:
        close(state[k], want_state[k], rtol=1e-3, atol=1e-4)


def _ddim_loop(model, device, latents, cond, eta, generator=None, steps=3):
    from diffusers import DDIMScheduler
    scheduler = DDIMScheduler(num_train_timesteps=1000)
    scheduler.set_timesteps(steps)
    x = latents.to(device)
    with torch.no_grad():
        for t in scheduler.timesteps:
            eps = model(x, t, cond.to(device)).sample
            x = scheduler.step(eps, t, x, eta=eta, generator=generator).prev_sample
    return x.cpu()


def test_diffusers_ddim_sampling_with_a_neuron_generator():
    pytest.importorskip("diffusers")
    from diffusers.utils.torch_utils import randn_tensor
    model = tiny_unet().eval()
    neuron_model = copy.deepcopy(model).to(DEV)
    cond = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))
    # The Diffusers idiom, pipe(..., generator=torch.Generator(device).manual_seed(0)). For neuron
    # devices randn_tensor draws on the host from the generator, then moves the latents: a neuron
    # generator seeded with s gives the numbers of torch.Generator().manual_seed(s) on CPU.
    latents = randn_tensor((2, 4, 8, 8), generator=torch.Generator(DEV).manual_seed(0), device=torch.device(DEV))
    cpu_latents = randn_tensor((2, 4, 8, 8), generator=torch.Generator().manual_seed(0))
    assert latents.device.type == "neuron"
    close(latents, cpu_latents, rtol=0, atol=0)
    for eta in (0.0, 1.0):   # eta > 0 draws fresh noise from the generator at every step
        want = _ddim_loop(model, "cpu", cpu_latents, cond, eta, torch.Generator().manual_seed(9))
        got = _ddim_loop(neuron_model, DEV, latents, cond, eta, torch.Generator(DEV).manual_seed(9))
        close(got, want, rtol=1e-4, atol=1e-4)
    # Random ops on the device itself draw from the generator's own stream, reproducibly.
    first = torch.randn(2, 4, generator=torch.Generator(DEV).manual_seed(9), device=DEV)
    assert torch.equal(first.cpu(), torch.randn(2, 4, generator=torch.Generator(DEV).manual_seed(9), device=DEV).cpu())


# -- transformers features that lean on the device --------------------------------------------------
def _gpt2_grads(device, checkpointing):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                       resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)).to(device).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = batch(4)[0].to(device)
    torch.manual_seed(11)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_with_dropout_gives_the_plain_gradients():
    # The recompute must replay the forward's dropout masks (as it does on CPU).
    for device in ("cpu", DEV):
        plain, ckpt = _gpt2_grads(device, False), _gpt2_grads(device, True)
        assert plain.keys() == ckpt.keys()
        for name in plain:
            torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-5, atol=1e-6, msg=f"{device}: {name}")


def _scaled_training(device, inject_at=1, steps=4):
    model = tiny_llama(6).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
    ids = batch(7)[0].to(device)
    losses, scales = [], []
    for step in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        if step == inject_at:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, scales, {k: v.detach().cpu() for k, v in model.state_dict().items()}


@pytest.mark.filterwarnings("ignore:torchneuron.*float64")   # GradScaler's inv_scale round trip
def test_grad_scaler_with_an_injected_inf_matches_cpu():
    want_losses, want_scales, want_state = _scaled_training("cpu")
    torchneuron.metrics.reset()
    losses, scales, state = _scaled_training(DEV)
    assert scales == want_scales and scales[1] == want_scales[0] / 2   # the overflow step backed off
    close(torch.tensor(losses), torch.tensor(want_losses))
    assert losses[2] == pytest.approx(losses[1], rel=1e-6)             # ... and skipped its update
    for k in want_state:
        close(state[k], want_state[k], rtol=1e-4, atol=1e-5)
    assert torchneuron.metrics()["fallbacks"] == {}


def test_compiled_causal_lm_forward_with_the_default_cache_matches_cpu():
    # use_cache=True builds a DynamicCache, which creates tensors inside the compiled code.
    model = tiny_llama(8).eval()
    ids, mask = batch(9)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=True).logits
        compiled = torch.compile(copy.deepcopy(model).to(DEV), backend="neuron")
        out = compiled(input_ids=ids.to(DEV), attention_mask=mask.to(DEV), use_cache=True)
    assert out.past_key_values is not None
    close(out.logits, want, rtol=1e-4, atol=1e-4)
