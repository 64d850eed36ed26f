"""Everyday PyTorch utilities that libraries (Transformers, Diffusers, PEFT, TRL) lean on, each
checked against CPU PyTorch: activation checkpointing's RNG replay, the device RNG consumers
around it, ``torch.Generator(device="neuron")``, integer images through ``F.interpolate``, factory
calls inside compiled graphs, pinned memory, GradScaler's fused ops and the Transformer fast path.
"""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torchneuron

DEV = "neuron"


# -- activation checkpointing replays the device RNG -----------------------------------------------
def _dropout_grads(device, use_checkpoint, use_reentrant=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.GELU(), nn.Linear(32, 4)).to(device)
    x = torch.randn(6, 8).to(device).requires_grad_()
    torch.manual_seed(1)
    y = checkpoint(model, x, use_reentrant=use_reentrant) if use_checkpoint else model(x)
    y.square().sum().backward()
    return [p.grad.cpu() for p in model.parameters()] + [x.grad.cpu()]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_dropout_gradients_equal_plain_gradients(use_reentrant):
    # The recompute in backward must draw the same dropout mask as the forward did: checkpointing
    # saves and restores the device RNG state around it (as it does on CPU, where the two are equal).
    plain = _dropout_grads(DEV, False)
    ckpt = _dropout_grads(DEV, True, use_reentrant)
    for p, c in zip(plain, ckpt):
        torch.testing.assert_close(c, p, rtol=0, atol=0)
    # The reference behaviour: on CPU the two are equal too.
    for p, c in zip(_dropout_grads("cpu", False), _dropout_grads("cpu", True, use_reentrant)):
        torch.testing.assert_close(c, p, rtol=0, atol=0)


def test_fork_rng_restores_the_neuron_generator():
    torch.manual_seed(3)
    before = torch.neuron.get_rng_state()
    with torch.random.fork_rng(device_type="neuron"):
        torch.rand(10, device=DEV)
    assert torch.equal(torch.neuron.get_rng_state(), before)
    a = torch.rand(10, device=DEV).cpu()
    torch.neuron.set_rng_state(before)
    assert torch.equal(torch.rand(10, device=DEV).cpu(), a)


def test_rng_states_round_trip_through_a_checkpoint_file(tmp_path):
    # What accelerate's save_state/load_state do with torch.neuron.get_rng_state_all().
    torch.manual_seed(4)
    torch.rand(3, device=DEV)
    path = tmp_path / "rng.pt"
    torch.save({"neuron": torch.neuron.get_rng_state_all(), "cpu": torch.get_rng_state()}, path)
    expected = F.dropout(torch.ones(64, device=DEV), 0.5).cpu()
    torch.manual_seed(99)
    states = torch.load(path, weights_only=True)
    torch.neuron.set_rng_state_all(states["neuron"])
    torch.set_rng_state(states["cpu"])
    assert torch.equal(F.dropout(torch.ones(64, device=DEV), 0.5).cpu(), expected)
    # Every spelling of the device gives the same state.
    state = torch.neuron.get_rng_state()
    for device in (0, "neuron", "neuron:0", torch.device("neuron", 0)):
        assert torch.equal(torch.neuron.get_rng_state(device), state)


# -- torch.Generator(device="neuron") ----------------------------------------------------------------
def test_neuron_generator_streams_are_reproducible_and_independent_of_the_global_one():
    g = torch.Generator(device=DEV).manual_seed(0)
    assert g.device == torch.device("neuron", 0) and isinstance(g, torch.Generator)
    assert isinstance(torch.default_generator, torch.Generator) and type(torch.Generator()) is torch._C.Generator
    torch.manual_seed(5)
    expected_global = torch.rand(4, device=DEV).cpu()
    torch.manual_seed(5)
    a = torch.randn(2, 3, generator=g, device=DEV).cpu()
    b = torch.randn(2, 3, generator=g, device=DEV).cpu()
    assert not torch.equal(a, b)
    assert torch.equal(torch.rand(4, device=DEV).cpu(), expected_global)   # the global stream did not move
    g.manual_seed(0)
    assert torch.equal(torch.randn(2, 3, generator=g, device=DEV).cpu(), a)
    state = g.get_state()
    twin = torch.Generator(DEV).set_state(state)
    assert torch.equal(torch.rand(5, generator=g, device=DEV).cpu(), torch.rand(5, generator=twin, device=DEV).cpu())
    assert g.initial_seed() == 0


@pytest.mark.parametrize("draw", [
    lambda g: torch.randint(0, 10, (8,), generator=g, device=DEV),
    lambda g: torch.randperm(8, generator=g, device=DEV),
    lambda g: torch.multinomial(torch.ones(6, device=DEV), 3, generator=g),
    lambda g: torch.bernoulli(torch.full((8,), 0.5, device=DEV), generator=g),
    lambda g: torch.empty(8, device=DEV).uniform_(generator=g),
    lambda g: torch.empty(8, device=DEV).exponential_(generator=g),
    lambda g: torch.normal(torch.zeros(8, device=DEV), 1.0, generator=g),
])
def test_random_ops_draw_from_the_generator_they_are_given(draw):
    first = draw(torch.Generator(DEV).manual_seed(7)).cpu()
    assert torch.equal(draw(torch.Generator(DEV).manual_seed(7)).cpu(), first)


def test_a_cpu_generator_on_a_neuron_op_is_refused_as_on_cuda():
    with pytest.raises(RuntimeError, match="Expected a 'neuron' device type for generator but found 'cpu'"):
        torch.randn(3, generator=torch.Generator().manual_seed(0), device=DEV)


def test_neuron_generators_pickle_copy_and_default_generators():
    import copy
    import pickle
    g = torch.Generator(DEV).manual_seed(3)
    torch.rand(2, generator=g, device=DEV)
    for twin in (pickle.loads(pickle.dumps(g)), copy.deepcopy(g), g.clone_state()):
        assert torch.equal(twin.get_state(), g.get_state()) and twin.initial_seed() == 3
    default = torch.neuron.default_generators[0]
    torch.neuron.manual_seed(11)
    assert default.initial_seed() == 11 and torch.equal(default.get_state(), torch.neuron.get_rng_state())


# -- integer images through interpolation and pooling -----------------------------------------------
def _image(dtype, shape, channels_last=False):
    torch.manual_seed(0)
    x = torch.randint(0, 256, shape, dtype=torch.int64)
    x = x.to(dtype) if dtype != torch.bool else x > 127
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


UINT8_RESIZES = [
    # (mode, antialias, align_corners, size or scale_factor)
    ("bilinear", False, False, (5, 6)), ("bilinear", False, True, (17, 20)), ("bilinear", False, False, (9, 23)),
    ("bilinear", True, False, (5, 6)), ("bilinear", True, True, (4, 30)), ("bilinear", True, False, 0.4),
    ("bicubic", False, False, (5, 6)), ("bicubic", False, True, (17, 20)), ("bicubic", False, False, 2.5),
    ("bicubic", True, False, (5, 6)), ("bicubic", True, False, (17, 20)), ("bicubic", True, True, (3, 31)),
]


@pytest.mark.parametrize("channels", [3, 5])   # CPU takes its AVX kernel for <= 4 channels, its generic one above
@pytest.mark.parametrize("mode,antialias,align_corners,size", UINT8_RESIZES)
def test_uint8_interpolation_matches_cpu_exactly(channels, mode, antialias, align_corners, size):
    x = _image(torch.uint8, (2, channels, 9, 11), channels_last=channels == 3)
    kw = {"mode": mode, "antialias": antialias, "align_corners": align_corners}
    kw.update({"scale_factor": size} if isinstance(size, float) else {"size": size})
    expected = F.interpolate(x, **kw)
    got = F.interpolate(x.to(DEV), **kw)
    assert got.dtype == torch.uint8
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("fn", [
    lambda x: F.interpolate(x, size=(5, 6), mode="bilinear"),
    lambda x: F.interpolate(x, size=(5, 6), mode="bicubic"),
    lambda x: F.interpolate(x, size=(5, 6), mode="bilinear", antialias=True),
    lambda x: F.interpolate(x, size=(5, 6), mode="area"),
    lambda x: F.interpolate(x.flatten(2), size=5, mode="linear"),
    lambda x: F.interpolate(x.unsqueeze(2), size=(2, 5, 6), mode="trilinear"),
    lambda x: F.grid_sample(x, torch.zeros(2, 3, 3, 2, device=x.device), align_corners=False),
], ids=["bilinear", "bicubic", "bilinear-aa", "area", "linear", "trilinear", "grid_sample"])
def test_interpolation_of_other_integer_dtypes_is_refused_as_on_cpu(fn, dtype):
    # CPU has no kernel for these; neuron must not return numbers computed with integer weights.
    x = _image(dtype, (2, 3, 9, 11))
    with pytest.raises(NotImplementedError, match="not implemented for"):
        fn(x)
    with pytest.raises(NotImplementedError, match="not implemented for"):
        fn(x.to(DEV))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("fn", [
    lambda x: F.interpolate(x, size=(7, 13), mode="nearest"),
    lambda x: F.interpolate(x, size=(7, 13), mode="nearest-exact"),
    lambda x: F.max_pool2d(x, 3, 2),
    lambda x: F.pad(x, (2, 1, 1, 2), mode="reflect"),
], ids=["nearest", "nearest-exact", "max_pool2d", "reflect"])
def test_integer_paths_that_cpu_computes_match_it(fn, dtype):
    x = _image(dtype, (2, 3, 9, 11))
    try:
        expected = fn(x)
    except (NotImplementedError, RuntimeError):
        pytest.skip(f"CPU has no kernel for {dtype}")
    torch.testing.assert_close(fn(x.to(DEV)).cpu(), expected, rtol=0, atol=0)


# -- factory calls inside compiled graphs ---------------------------------------------------------
COMPILED_FACTORIES = {
    "tensor": lambda x: x * torch.tensor([1.0, 2.0], device=x.device),
    "tensor-int": lambda x: x + torch.tensor([3, 4], device=x.device),
    "tensor-0d": lambda x: x * torch.tensor(2.5, device=x.device),
    "tensor-empty": lambda x: torch.cat([x.flatten(), torch.tensor([], device=x.device)]),
    "tensor-bool": lambda x: x.masked_fill(torch.tensor([True, False], device=x.device), 0.0),
    "new_tensor": lambda x: x + x.new_tensor([1.0, 2.0]),
    "arange": lambda x: x + torch.arange(0.5, 2.0, 0.75, device=x.device),
    "full": lambda x: x + torch.full((3, 2), 7, device=x.device),
    "zeros": lambda x: x + torch.zeros(3, 2, device=x.device),
}


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("name", sorted(COMPILED_FACTORIES))
def test_factories_inside_compiled_graphs_match_cpu(name, requires_grad):
    fn = COMPILED_FACTORIES[name]
    x = torch.randn(3, 2)
    expected = fn(x)
    xn = x.to(DEV).requires_grad_(requires_grad)
    got = torch.compile(fn, backend="neuron")(xn)
    if requires_grad:
        got.sum().backward()
        assert xn.grad is not None
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.detach().cpu(), expected)


# -- pinned host memory with neuron as the accelerator ---------------------------------------------
def test_pin_memory_gives_a_pinned_host_copy():
    t = torch.arange(6.0).reshape(2, 3).t()
    p = t.pin_memory()
    assert p.device.type == "cpu" and p.is_pinned() and p[0].is_pinned() and not t.is_pinned()
    assert p.stride() == t.stride() and p.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert torch.equal(p, t) and p.pin_memory() is p
    torch.testing.assert_close(p.to(DEV, non_blocking=True).cpu(), t)
    w = torch.ones(3, requires_grad=True)
    w.pin_memory().sum().backward()
    assert torch.equal(w.grad, torch.ones(3))


_PINNED_FACTORIES = {
    "empty": lambda pin: torch.empty(2, 3, pin_memory=pin).fill_(1.5),
    "empty_strided": lambda pin: torch.empty_strided((2, 3), (1, 2), pin_memory=pin).fill_(2.0),
    "zeros": lambda pin: torch.zeros(2, 3, pin_memory=pin),
    "ones": lambda pin: torch.ones(2, 3, dtype=torch.int64, pin_memory=pin),
    "full": lambda pin: torch.full((2, 3), 7.0, pin_memory=pin),
    "arange": lambda pin: torch.arange(6, pin_memory=pin),
    "linspace": lambda pin: torch.linspace(0, 1, 5, pin_memory=pin),
    "eye": lambda pin: torch.eye(3, pin_memory=pin),
    "tensor": lambda pin: torch.tensor([[1, 2], [3, 4]], pin_memory=pin),
    "randn": lambda pin: torch.randn(4, 5, pin_memory=pin),
    "randint": lambda pin: torch.randint(0, 9, (6,), pin_memory=pin),
    "zeros_like": lambda pin: torch.zeros_like(torch.ones(2, 2), pin_memory=pin),
    "full_like": lambda pin: torch.full_like(torch.ones(2, 2), 3.0, pin_memory=pin),
    "new_zeros": lambda pin: torch.ones(2).new_zeros((3,), pin_memory=pin),
    "new_full": lambda pin: torch.ones(2).new_full((3,), 4.0, pin_memory=pin),
    "hann_window": lambda pin: torch.hann_window(4, pin_memory=pin),
    "fftfreq": lambda pin: torch.fft.fftfreq(4, pin_memory=pin),
}


@pytest.mark.parametrize("name", sorted(_PINNED_FACTORIES))
def test_factories_allocate_pinned_host_memory(name):
    # With neuron as the accelerator these raised NotImplementedError (PyTorch asks the backend's
    # hooks for a pinned allocator). The pinned result equals the plain one, random streams included.
    torch.manual_seed(3)
    pinned = _PINNED_FACTORIES[name](True)
    torch.manual_seed(3)
    plain = _PINNED_FACTORIES[name](False)
    assert pinned.device.type == "cpu" and pinned.is_pinned() and not plain.is_pinned()
    assert pinned.dtype == plain.dtype and pinned.stride() == plain.stride()
    assert torch.equal(pinned, plain)
    torch.testing.assert_close(pinned.to(DEV, non_blocking=True).cpu(), plain)


def test_factories_without_pinning_are_untouched():
    assert not torch.empty(3).is_pinned() and not torch.zeros(3, pin_memory=False).is_pinned()
    # A factory for the device itself is not a host allocation and keeps PyTorch's own handling.
    assert torch.zeros(3, device=DEV).device.type == DEV
    assert torch.empty.__name__ == "empty" and torch.Tensor.new_zeros.__name__ == "new_zeros"
    # PyTorch's identity-keyed factory tables still work: a device context moves factory results
    # (transformers builds models under one; a lost context gave wrong logits).
    with torch.device(DEV):
        made = [torch.empty(2), torch.zeros(2), torch.arange(2), torch.tensor([1.0]), torch.randn(2)]
    assert {t.device.type for t in made} == {DEV}


def test_pinned_factories_stay_transparent_to_torchscript_and_dynamo():
    @torch.jit.script
    def scripted(n: int):
        return torch.zeros(n) + torch.arange(n) + torch.fft.fftfreq(n)

    torch.testing.assert_close(scripted(4), torch.zeros(4) + torch.arange(4) + torch.fft.fftfreq(4))

    def fn(x):
        return x + torch.full((3,), 2.0, device=x.device) + x.new_ones(3) + torch.arange(3, device=x.device)

    got = torch.compile(fn, backend="neuron", fullgraph=True)(torch.ones(3, device=DEV))
    torch.testing.assert_close(got.cpu(), fn(torch.ones(3)))


def test_save_on_cpu_with_pinning_offloads_activations_for_neuron():
    # transformers' gradient_checkpointing_enable(offload=True) path.
    from torch.autograd.graph import save_on_cpu
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.to(DEV)
    with save_on_cpu(pin_memory=True, device_type="neuron"):
        loss = model(x.to(DEV)).square().sum()
    loss.backward()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad.cpu(), e)


# -- GradScaler's fused ops run on the device ------------------------------------------------------
def _scaler_run(device, inject, steps=6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 8, growth_interval=2)
    data = torch.randn(steps, 5, 8)
    scales, losses = [], []
    for i in range(steps):
        opt.zero_grad()
        loss = model(data[i].to(device)).square().mean()
        scaler.scale(loss).backward()
        if i in inject:
            model[0].weight.grad[0, 0] = inject[i]
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        losses.append(loss.item())
    return scales, losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["downcast", "error"])
def test_grad_scaler_float64_round_trip_is_not_the_users(policy, monkeypatch):
    # GradScaler computes 1/scale in float64 and converts back at once: no float64 warning, count
    # or TORCHNEURON_FLOAT64=error failure for it, while the user's own float64 still gets them.
    monkeypatch.setattr(torchneuron.config, "float64", policy)
    torchneuron.metrics.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scales, _, params = _scaler_run(DEV, {2: float("inf")}, steps=4)
    assert not torchneuron.metrics()["float64_downcasts"]
    expected_scales, _, expected = _scaler_run("cpu", {2: float("inf")}, steps=4)
    assert scales == expected_scales
    for got, want in zip(params, expected):
        torch.testing.assert_close(got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.ones(2, device=DEV).double()
        except TypeError as e:
            assert policy == "error" and "TORCHNEURON_FLOAT64" in str(e)
        else:
            assert policy == "downcast" and torchneuron.metrics()["float64_downcasts"]


@pytest.mark.usefixtures("strict_fallback")
@pytest.mark.parametrize("inject", [{}, {2: float("inf")}, {1: float("nan"), 4: float("-inf")}])
def test_grad_scaler_skips_and_rescales_like_cpu_without_fallbacks(inject):
    cpu_scales, cpu_losses, cpu_params = _scaler_run("cpu", inject)
    scales, losses, params = _scaler_run(DEV, inject)
    assert scales == cpu_scales
    torch.testing.assert_close(losses, cpu_losses)
    for p, c in zip(params, cpu_params):
        torch.testing.assert_close(p, c)


@pytest.mark.usefixtures("strict_fallback")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_amp_unscale_and_update_scale_ops_match_cpu(dtype):
    grads = [torch.randn(5, 3).to(dtype) * 1000, torch.randn(7).to(dtype)]
    grads[1][3] = float("nan") if dtype != torch.float32 else float("inf")
    results = {}
    for device in ("cpu", DEV):
        gs = [g.clone().to(device) for g in grads]
        found = torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(gs, found, torch.full((1,), 1 / 1024, device=device))
        scale, tracker = torch.full((1,), 65536.0, device=device), torch.ones(1, dtype=torch.int32, device=device)
        torch._amp_update_scale_(scale, tracker, torch.zeros(1, device=device), 3.0, 0.5, 2)
        grown = (scale.cpu().clone(), tracker.cpu().clone())
        torch._amp_update_scale_(scale, tracker, found, 3.0, 0.5, 2)
        huge = torch.full((1,), 3e38, device=device)   # growing it would overflow: kept as it is
        torch._amp_update_scale_(huge, torch.ones(1, dtype=torch.int32, device=device),
                                 torch.zeros(1, device=device), 3.0, 0.5, 2)
        results[device] = ([g.cpu() for g in gs], found.cpu(), grown, scale.cpu(), tracker.cpu(), huge.cpu())
    cpu, neuron = results["cpu"], results[DEV]
    torch.testing.assert_close(neuron, cpu, equal_nan=True)
    assert cpu[1].item() == 1.0


# -- nn.TransformerEncoder's inference fast path runs on the device ---------------------------------
@pytest.mark.usefixtures("strict_fallback")
@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu")])
def test_transformer_encoder_fast_path_matches_cpu_without_fallbacks(norm_first, activation):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True, norm_first=norm_first,
                                       activation=activation)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 16)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    masks = [{}, {"src_key_padding_mask": padding}, {"mask": causal},
             {"mask": causal, "src_key_padding_mask": padding}]
    with torch.no_grad():
        expected = [encoder(x, **m) for m in masks]
        encoder.to(DEV)
        got = [encoder(x.to(DEV), **{k: v.to(DEV) for k, v in m.items()}) for m in masks]
    assert torchneuron.metrics.op_calls["_transformer_encoder_layer_fwd"] == 2 * len(masks)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.cpu(), e, rtol=1e-5, atol=1e-5)
