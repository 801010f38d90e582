"""A decoder layer's work between attentions in one call of the product kernel (`kernel_steps.KernelSteps`, on a CPU
whose int4 layers take quantized rows): the same values as TorchScript's spans bit for bit up to SiLU, a row's values
the same in any block and on any thread count, stacked and separate products alike, biases added, and a verifier of
such layers giving a token the same logits in a block and in single steps."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kv_cache_proposer.backends.torch_backend import kernel_steps, layer_steps
from kv_cache_proposer.backends.torch_backend.direct import _linear_of
from kv_cache_proposer.backends.torch_backend.kernel_steps import KernelSteps
from kv_cache_proposer.backends.torch_backend.layer_steps import ScriptedSteps
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from tests.support.backends import assert_steps_meet_the_block

pytestmark = pytest.mark.usefixtures("one_torch_thread", "fresh_product_kernel", "forward_only")


@pytest.fixture
def forward_only() -> Iterator[None]:
    """As the verifier runs its forwards: no autograd records (the model's norms are parameters)."""
    with torch.inference_mode():
        yield


@pytest.fixture
def int4_verifier(checkpoints: dict[str, Path], kernel) -> TorchVerifier:
    if not kernel.serves_int4_qrows:
        pytest.skip(
            "the layer-span kernel serves int4 layers over quantized rows, the kernel's AVX2 build's (a CPU with AVX2, "
            "without AVX-512): this CPU's int4 layers take bfloat16 rows and TorchScript's spans"
        )
    return TorchVerifier.load(checkpoints["llama"], device="cpu", dtype="float32", weights="int4")


def _inputs(rows: int, seed: int, heads: int = 4, dim: int = 16, hidden: int = 64) -> tuple[torch.Tensor, ...]:
    """Hidden states [1, rows, H], attention's output [1, heads, rows, D] and a rotary table [1, 1, rows, D]."""
    generator = torch.Generator().manual_seed(seed)
    angles = torch.rand(1, 1, rows, dim, generator=generator) * 6.0
    return (
        torch.randn(1, rows, hidden, generator=generator),
        torch.randn(1, heads, rows, dim, generator=generator) * 3.0,
        angles.cos(),
        angles.sin(),
    )


def _layers(verifier: TorchVerifier) -> list:
    direct = verifier._direct
    assert direct is not None
    return direct._layers


def test_an_int4_verifier_runs_its_spans_on_the_kernel_and_a_token_gets_the_same_logits_in_any_block(int4_verifier):
    direct = int4_verifier._direct
    assert direct is not None and isinstance(direct._scripted, KernelSteps)
    assert_steps_meet_the_block(int4_verifier, list(range(3, 17)), 6)


def test_the_next_layer_s_inputs_are_torchscript_s_bit_for_bit(int4_verifier):
    layers = _layers(int4_verifier)
    hidden, _, cos, sin = _inputs(5, seed=1)
    ours = KernelSteps().first(hidden, layers[0].inputs, 16, cos, sin)
    theirs = ScriptedSteps().first(hidden, layers[0].inputs, 16, cos, sin)
    assert [tuple(x.shape) for x in ours] == [(1, 4, 5, 16), (1, 2, 5, 16), (1, 2, 5, 16)]
    for mine, expected in zip(ours, theirs, strict=True):
        assert torch.equal(mine, expected)


def test_a_layer_s_output_differs_from_torchscript_s_by_silu_alone(int4_verifier, monkeypatch):
    """Against TorchScript's span with SiLU computed in float64 and rounded once: the norms, products, residuals and
    rotary embedding agree, the kernel's SiLU within a few ulp (its rows then quantized for the down product, where a
    value on a rounding boundary can move one step)."""
    layers = _layers(int4_verifier)
    hidden, attended, cos, sin = _inputs(6, seed=2)
    ours_hidden, ours_qkv = KernelSteps().between(
        hidden, attended, layers[0].output, 16, layers[1].inputs, 16, cos, sin
    )
    last = KernelSteps().last(hidden, attended, layers[2].output, 16, int4_verifier._direct._norm)
    monkeypatch.setattr(layer_steps.F, "silu", lambda x: (x.double() / (1 + torch.exp(-x.double()))).float())
    layer_steps._scripted.cache_clear()
    try:
        scripted = ScriptedSteps()
        hidden_ref, qkv_ref = scripted.between(hidden, attended, layers[0].output, 16, layers[1].inputs, 16, cos, sin)
        last_ref = scripted.last(hidden, attended, layers[2].output, 16, int4_verifier._direct._norm)
    finally:
        monkeypatch.undo()
        layer_steps._scripted.cache_clear()
    for mine, expected in [(ours_hidden, hidden_ref), (last, last_ref), *zip(ours_qkv, qkv_ref, strict=True)]:
        assert mine.shape == expected.shape
        torch.testing.assert_close(mine, expected, rtol=1e-3, atol=1e-4)
        assert float((mine - expected).norm() / expected.norm()) < 1e-5


def test_silu_of_the_kernel_is_within_a_few_ulp_over_the_whole_range(int4_verifier):
    gate = torch.cat([torch.linspace(-120.0, 120.0, 8000), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.9, -87.9, 0, 0])])
    up = torch.randn(gate.shape, generator=torch.Generator().manual_seed(7))
    ours = kernel_steps.silu_times(gate, up)
    exact = (gate.double() / (1 + torch.exp(-gate.double()))).float().double() * up.double()
    ulp = torch.finfo(torch.float32).eps * exact.abs().clamp(min=torch.finfo(torch.float32).tiny)
    errors = ((ours.double() - exact).abs() / ulp)[gate > -80]  # below, SiLU is about 0 (to 1e-33) either way
    assert float(errors.max()) <= 4.0
    assert float(ours[gate <= -80].abs().max()) < 1e-30
    assert torch.equal(ours[gate == 0], torch.zeros_like(ours[gate == 0]))
    with pytest.raises(ValueError, match="SiLU"):
        kernel_steps.silu_times(torch.zeros(12), torch.zeros(12))


def test_a_row_s_values_do_not_depend_on_its_block_or_the_thread_count(int4_verifier):
    layers = _layers(int4_verifier)
    hidden, attended, cos, sin = _inputs(9, seed=4)
    steps = KernelSteps()
    whole_hidden, whole_qkv = steps.between(hidden, attended, layers[0].output, 16, layers[1].inputs, 16, cos, sin)
    for start, end in [(0, 1), (3, 4), (2, 7), (8, 9)]:
        part = (
            hidden[:, start:end],
            attended[:, :, start:end],
            cos[:, :, start:end],
            sin[:, :, start:end],
        )
        threads = torch.get_num_threads()
        torch.set_num_threads(2 if end - start > 1 else 1)
        try:
            h, qkv = steps.between(part[0], part[1], layers[0].output, 16, layers[1].inputs, 16, part[2], part[3])
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(h, whole_hidden[:, start:end])
        for mine, whole in zip(qkv, whole_qkv, strict=True):
            assert torch.equal(mine, whole[:, :, start:end])


def test_separate_products_and_biases_give_what_torchscript_gives(int4_verifier):
    """Q/K/V as three products and gate/up as two (a layer whose outputs do not stack) give the stacked layer's
    values; a bias on each is added as `weights.linear` adds it."""
    decoder = int4_verifier.model.get_decoder()
    layer, following = decoder.layers[0], decoder.layers[1]
    stacked = _layers(int4_verifier)
    generator = torch.Generator().manual_seed(5)

    def with_bias(module) -> tuple:
        w = _linear_of(module, True)
        return (w[0], torch.randn(w[0].shape[0] * 8, generator=generator), *w[2:])

    separate_inputs = (
        *stacked[1].inputs[:2],
        [
            _linear_of(m, True)
            for m in (following.self_attn.q_proj, following.self_attn.k_proj, following.self_attn.v_proj)
        ],
        *stacked[1].inputs[3:],
    )
    mlp = layer.mlp
    separate_output = (
        *stacked[0].output[:3],
        [_linear_of(mlp.gate_proj, True), _linear_of(mlp.up_proj, True)],
        stacked[0].output[4],
    )
    assert kernel_steps.serves([(separate_inputs, separate_output, 16)], 64)
    hidden, attended, cos, sin = _inputs(4, seed=6)
    steps = KernelSteps()
    expected = steps.between(hidden, attended, stacked[0].output, 16, stacked[1].inputs, 16, cos, sin)
    got = steps.between(hidden, attended, separate_output, 16, separate_inputs, 16, cos, sin)
    assert torch.equal(got[0], expected[0]) and all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=True))

    biased = (
        *separate_inputs[:2],
        [with_bias(m) for m in (following.self_attn.q_proj, following.self_attn.k_proj, following.self_attn.v_proj)],
        *separate_inputs[3:],
    )
    ours = steps.first(hidden, biased, 16, cos, sin)
    theirs = ScriptedSteps().first(hidden, biased, 16, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert not torch.equal(ours[2], expected[1][2])  # the bias changed V


def test_layers_the_kernel_does_not_serve_keep_torchscript_s_spans(checkpoints: dict[str, Path], int4_verifier):
    layers = _layers(int4_verifier)
    spans = [(layer.inputs, layer.output, layer.head_dim) for layer in layers]
    assert kernel_steps.serves(spans, 64)
    assert not kernel_steps.serves(spans, 48)  # another hidden size than the norms'
    q_normed = [((*inputs[:4], torch.ones(16), None, 1e-6), output, dim) for inputs, output, dim in spans]
    assert not kernel_steps.serves(q_normed, 64)  # Q/K norms (Qwen3)
    assert not kernel_steps.serves([(inputs, output, 8) for inputs, output, _ in spans], 64)  # heads of 8 values
    float_verifier = TorchVerifier.load(checkpoints["llama"], device="cpu", dtype="float32")
    assert isinstance(float_verifier._direct._scripted, ScriptedSteps)
    qwen3 = TorchVerifier.load(checkpoints["qwen3"], device="cpu", dtype="float32", weights="int4")
    assert isinstance(qwen3._direct._scripted, ScriptedSteps)
