"""Hugging Face transformers on neuron: loading, forward, generate (dynamic cache, static cache,
static cache under torch.compile), fine-tuning (plain loop and Trainer), and the device queries
transformers/accelerate make. CPU runs of the same tiny random-weight model are the oracle.

Every model here has the same tiny shapes, so executables compiled by one test are reused by the
next. Nothing is downloaded: models come from configs or a folder written by save_pretrained.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import torchneuron

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The hf extra (`pip install -e '.[hf]'`, done by `make test`) provides transformers and accelerate.
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

NEW_TOKENS = 8


def tiny_llama_config(**overrides) -> LlamaConfig:
    kwargs = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def cpu_model(seed: int = 0, **config):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_llama_config(**config)).eval()


def token_batch(seed: int = 0, batch: int = 2, length: int = 8):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, length), generator=g)
    return ids, torch.ones_like(ids)


@pytest.fixture(scope="module")
def pair():
    """(CPU model, the same weights moved to neuron)."""
    model = cpu_model()
    return model, copy.deepcopy(model).to("neuron")


def greedy(model, ids, mask, **kwargs):
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                         max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return out.cpu()


# -- loading and forward --------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_from_config_to_neuron_matches_cpu(attn):
    model = cpu_model(attn_implementation=attn)
    neuron = copy.deepcopy(model).to("neuron")
    assert neuron.config._attn_implementation == attn
    assert neuron.device.type == "neuron"
    # Tied input embedding and LM head stay one parameter after the move.
    assert neuron.lm_head.weight is neuron.model.embed_tokens.weight
    ids, mask = token_batch()
    torchneuron.metrics.reset()
    with torch.no_grad():
        got = neuron(input_ids=ids.to("neuron"), attention_mask=mask.to("neuron")).logits
        want = model(input_ids=ids, attention_mask=mask).logits
    assert got.device.type == "neuron"
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
    assert torchneuron.metrics()["fallbacks"] == {}


def test_from_pretrained_local_folder_with_device_map(tmp_path):
    model = cpu_model(seed=1)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="neuron").eval()
    assert {p.device.type for p in loaded.parameters()} == {"neuron"}
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for name, p in loaded.state_dict().items():
        torch.testing.assert_close(p.cpu(), model.state_dict()[name], rtol=0, atol=0)
    ids, mask = token_batch(seed=1)
    with torch.no_grad():
        got = loaded(input_ids=ids.to("neuron"), attention_mask=mask.to("neuron")).logits
        want = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


def test_padded_batch_forward_matches_cpu(pair):
    # Left padding: the attention mask path (the mask is built from the ids, not just causal).
    model, neuron = pair
    ids, mask = token_batch(seed=2)
    mask[0, :3] = 0
    ids[0, :3] = 0
    with torch.no_grad():
        got = neuron(input_ids=ids.to("neuron"), attention_mask=mask.to("neuron")).logits
        want = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got.cpu()[mask.bool()], want[mask.bool()], rtol=1e-4, atol=1e-5)


# -- generate -------------------------------------------------------------------------------------
def test_generate_greedy_dynamic_cache_matches_cpu(pair):
    model, neuron = pair
    ids, mask = token_batch(seed=3)
    want = greedy(model, ids, mask)
    got = greedy(neuron, ids, mask)
    assert got.shape == (2, 8 + NEW_TOKENS)
    assert torch.equal(got, want)


def test_generate_greedy_static_cache_eager_matches_cpu(pair):
    model, neuron = pair
    ids, mask = token_batch(seed=4)
    want = greedy(model, ids, mask, cache_implementation="static")
    torchneuron.metrics.reset()
    got = greedy(neuron, ids, mask, cache_implementation="static", disable_compile=True)
    assert torch.equal(got, want)
    assert torchneuron.metrics()["graphs_compiled"] == 0   # really eager


def test_generate_static_cache_under_torch_compile_compiles_once(pair):
    """generate() with a static cache compiles the decoding step with backend='neuron' (transformers'
    default on neuron, here also fullgraph): one graph for all tokens, and none on a second call."""
    from transformers import CompileConfig

    model, neuron = pair
    torch._dynamo.reset()
    ids, mask = token_batch(seed=5)
    want = greedy(model, ids, mask, cache_implementation="static")
    compile_config = CompileConfig(backend="neuron", dynamic=False, fullgraph=True, mode="default")
    torchneuron.metrics.reset()
    got = greedy(neuron, ids, mask, cache_implementation="static", compile_config=compile_config)
    first = torchneuron.metrics()
    assert torch.equal(got, want)
    # Decoding steps share one graph: the count does not grow with the number of tokens.
    assert 1 <= first["graphs_compiled"] <= 2, first["graphs_compiled"]
    assert sum(first["recompiles"].values()) <= first["graphs_compiled"] - 1
    assert first["graph_breaks"] == {}

    ids2, mask2 = token_batch(seed=6)
    want2 = greedy(model, ids2, mask2, cache_implementation="static")
    torchneuron.metrics.reset()
    got2 = greedy(neuron, ids2, mask2, cache_implementation="static", compile_config=compile_config)
    assert torch.equal(got2, want2)
    assert torchneuron.metrics()["graphs_compiled"] == 0


def test_generate_default_compile_config_on_neuron_is_neuron_backend(pair):
    _, neuron = pair
    cfg = neuron._default_compile_config()
    assert (cfg.backend, cfg.dynamic) == ("neuron", False)


# -- fine-tuning ----------------------------------------------------------------------------------
def _train_plain(model, device, steps=3):
    model = model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    ids, mask = token_batch(seed=10)   # one batch, so the loss must go down
    for _ in range(steps):
        loss = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=ids.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_fine_tuning_loop_matches_cpu():
    model = cpu_model(seed=7)
    want_losses, want_state = _train_plain(copy.deepcopy(model), "cpu")
    got_losses, got_state = _train_plain(copy.deepcopy(model), "neuron")
    assert got_losses[-1] < got_losses[0]
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=1e-4, atol=1e-5)
    for k in want_state:
        torch.testing.assert_close(got_state[k], want_state[k], rtol=1e-3, atol=1e-4)


class _TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n=8):
        self.items = [token_batch(seed=100 + i, batch=1)[0][0] for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ids = self.items[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _trainer_losses(tmp_path, use_cpu: bool):
    from transformers import Trainer, TrainingArguments

    model = cpu_model(seed=8)
    args = TrainingArguments(output_dir=str(tmp_path / ("cpu" if use_cpu else "neuron")), use_cpu=use_cpu,
                             max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
                             report_to=[], save_strategy="no", seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=_TokenDataset())
    torchneuron.metrics.reset()
    trainer.train()
    device = next(trainer.model.parameters()).device
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], device, args


def test_trainer_on_neuron_matches_cpu(tmp_path):
    want, cpu_device, _ = _trainer_losses(tmp_path, use_cpu=True)
    got, device, args = _trainer_losses(tmp_path, use_cpu=False)
    # TrainingArguments picks the neuron device by itself (no use_cpu, no device argument).
    assert args.device.type == "neuron" and device.type == "neuron" and cpu_device.type == "cpu"
    assert len(got) == len(want) == 3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    # Model, loss and the default fused AdamW all ran on lowered ops.
    assert torchneuron.metrics()["fallbacks"] == {}


class _DropoutRegressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden, self.drop, self.head = torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)

    def forward(self, x, labels=None):
        y = self.head(self.drop(torch.relu(self.hidden(x)))).squeeze(-1)
        return {"loss": (y - labels).square().mean(), "logits": y}


class _RegressionDataset(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(16, 8, generator=g), torch.randn(16, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def _train_with_dropout(output_dir, max_steps, resume=None):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(output_dir), max_steps=max_steps, save_steps=2,
                             per_device_train_batch_size=4, learning_rate=0.1, lr_scheduler_type="constant",
                             report_to=[], seed=0, disable_tqdm=True)
    trainer = Trainer(model=_DropoutRegressor(), args=args, train_dataset=_RegressionDataset())
    trainer.train(resume_from_checkpoint=resume)
    assert args.device.type == "neuron"
    return [p.detach().cpu() for p in trainer.model.parameters()]


def test_trainer_resumed_from_a_checkpoint_continues_the_neuron_dropout_stream(tmp_path):
    # Trainer checkpoints the RNG of the device types it names; neuron's is added to the same file,
    # so a resumed run draws the dropout masks an uninterrupted run draws (it differed by ~0.2).
    uninterrupted = _train_with_dropout(tmp_path / "full", 4)
    _train_with_dropout(tmp_path / "split", 2)
    checkpoint = tmp_path / "split" / "checkpoint-2"
    assert "neuron" in torch.load(checkpoint / "rng_state.pth", weights_only=False)
    resumed = _train_with_dropout(tmp_path / "split", 4, resume=str(checkpoint))
    for got, want in zip(resumed, uninterrupted):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# -- what transformers and accelerate ask of the device -------------------------------------------
def test_transformers_and_accelerate_detect_neuron():
    from accelerate import PartialState
    from accelerate.utils import is_neuron_available
    from transformers import TrainingArguments
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_neuron_available

    assert torch.accelerator.current_accelerator().type == "neuron"
    assert is_torch_neuron_available()
    assert is_neuron_available()
    assert is_torch_bf16_gpu_available()
    state = PartialState()
    try:
        assert state.device.type == "neuron"
    finally:
        PartialState._reset_state()   # a process-wide singleton: leave none behind for other tests
    args = TrainingArguments(output_dir="unused", report_to=[])
    assert args.device == torch.device("neuron:0")
    args = TrainingArguments(output_dir="unused", report_to=[], torch_compile=True)
    assert args.torch_compile_backend == "neuron"


def test_probe_patch_reaches_modules_imported_before_torch():
    """`import transformers` may come before `import torch` (it does not import torch): the probe is
    replaced in every module that imported it by name."""
    import subprocess
    import sys
    code = ("import transformers.training_args as ta, accelerate.state as st, torch\n"
            "print(ta.is_torch_neuron_available(), st.is_neuron_available(), "
            "ta.TrainingArguments(output_dir='x', report_to=[]).device)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "neuron:0"]


def test_dataloader_pin_memory_with_neuron_accelerator():
    data = torch.arange(12.0).view(6, 2)
    loader = torch.utils.data.DataLoader(data, batch_size=4, pin_memory=True)
    batches = list(loader)
    torch.testing.assert_close(torch.cat(batches), data)
    # Other devices keep PyTorch's pinning function (and its errors).
    from torch.utils.data._utils import pin_memory as pm
    assert pm.pin_memory.__module__ == "torchneuron.integrations.data"


def test_autocast_bf16_forward(pair):
    model, neuron = pair
    ids, mask = token_batch(seed=9)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        with torch.autocast("neuron", dtype=torch.bfloat16):
            got = neuron(input_ids=ids.to("neuron"), attention_mask=mask.to("neuron")).logits
    # The LM head ran in bfloat16: its result is bfloat16 and close to the float32 CPU logits.
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), want, rtol=5e-2, atol=5e-2)
