"""Eager training on neuron matches CPU PyTorch step by step, with zero CPU fallbacks."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchneuron

pytestmark = pytest.mark.usefixtures("strict_fallback", "both_eager_modes")

STEPS = 20


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.net = nn.Sequential(nn.Linear(16 * 4, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(),
                                 nn.LayerNorm(64), nn.Linear(64, 32), nn.SiLU(), nn.Linear(32, 32), nn.Tanh(),
                                 nn.Linear(32, 5))

    def forward(self, tokens):
        return self.net(self.emb(tokens).flatten(1))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Sigmoid(), nn.AvgPool2d(2))
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class TinyAttention(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


OPTIMIZERS = {
    "sgd": lambda p, fe: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=fe),
    "adam": lambda p, fe: torch.optim.Adam(p, lr=2e-3, foreach=fe),
    "adamw": lambda p, fe: torch.optim.AdamW(p, lr=2e-3, weight_decay=0.05, foreach=fe),
}


def train(make_model, batch, target, loss_fn, device, make_opt, steps=STEPS):
    torch.manual_seed(0)
    model = make_model().to(device)
    opt = make_opt(model.parameters())
    x, y = batch.to(device), target.to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def assert_losses_match(cpu, neuron, rtol=1e-4):
    for step, (a, b) in enumerate(zip(cpu, neuron)):
        assert abs(a - b) <= rtol * abs(a) + 1e-6, f"step {step}: cpu {a} neuron {b}"


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("foreach", [False, True])
def test_mlp_training_matches_cpu(opt, foreach):
    torch.manual_seed(1)
    tokens, labels = torch.randint(0, 50, (16, 4)), torch.randint(0, 5, (16,))
    make_opt = lambda p: OPTIMIZERS[opt](p, foreach)  # noqa: E731
    cpu, _ = train(MLP, tokens, labels, F.cross_entropy, "cpu", make_opt)
    neu, _ = train(MLP, tokens, labels, F.cross_entropy, "neuron", make_opt)
    assert_losses_match(cpu, neu)
    assert neu[-1] < neu[0]
    assert torchneuron.metrics()["fallbacks"] == {}


def test_cnn_training_matches_cpu_with_batchnorm_train_and_eval():
    torch.manual_seed(2)
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    make_opt = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    cpu, cpu_model = train(CNN, images, labels, F.cross_entropy, "cpu", make_opt)
    neu, neu_model = train(CNN, images, labels, F.cross_entropy, "neuron", make_opt)
    assert_losses_match(cpu, neu)
    for (name, a), (_, b) in zip(cpu_model.state_dict().items(), neu_model.state_dict().items()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-3, atol=1e-4, msg=name)  # running stats too
    cpu_model.eval()
    neu_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(neu_model(images.to("neuron")).cpu(), cpu_model(images), rtol=1e-4, atol=1e-5)
    assert torchneuron.metrics()["fallbacks"] == {}


def test_attention_regression_with_mse():
    torch.manual_seed(3)
    x, y = torch.randn(4, 8, 32), torch.randn(4, 8, 32)
    make_opt = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
    cpu, _ = train(TinyAttention, x, y, F.mse_loss, "cpu", make_opt)
    neu, _ = train(TinyAttention, x, y, F.mse_loss, "neuron", make_opt)
    assert_losses_match(cpu, neu)
    assert torchneuron.metrics()["fallbacks"] == {}


def test_inference_ops_without_grad():
    torch.manual_seed(4)
    x = torch.randn(6, 10)
    with torch.no_grad():
        for f in (lambda t: F.softmax(t, dim=-1), lambda t: F.log_softmax(t, dim=0), torch.sigmoid, torch.tanh,
                  lambda t: F.dropout(t, 0.5, training=False), lambda t: F.gelu(t, approximate="tanh")):
            torch.testing.assert_close(f(x.to("neuron")).cpu(), f(x), rtol=1e-5, atol=1e-6)
    drop = nn.Dropout(0.5).to("neuron")
    out = drop(torch.ones(1000, device="neuron"))
    assert ((out == 0) | (out == 2)).all().item()
    assert torchneuron.metrics()["fallbacks"] == {}
