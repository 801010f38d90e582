"""The int8 LM head's integer sums on the compiled kernel: the same integers as oneDNN's `_int_mm` for every width,
row count and value, so an int8 head gives a token the same logits whichever computes them, through the
verifier's forwards too; built once, and turned off or failing to build, `_int_mm` computes every product."""

from __future__ import annotations

import pytest
import torch

from kv_cache_proposer.backends.torch_backend import int8_rows
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.backends.torch_backend.weights import INT8_SPLIT, PackedLinear, integer_head_product
from kv_cache_proposer.strategies import FullStrategy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def kernel() -> int8_rows.Int8Rows:
    int8_rows.int8_rows.cache_clear()
    loaded = int8_rows.int8_rows()
    if loaded is None:
        pytest.skip("no C compiler or no AVX512-VNNI on this CPU: the int8 row kernel does not run, _int_mm does")
    return loaded


@pytest.fixture(autouse=True)
def _fresh_kernel():
    int8_rows.int8_rows.cache_clear()
    yield
    int8_rows.int8_rows.cache_clear()


def _codes(outputs: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (outputs, width), generator=generator, dtype=torch.int8)
    codes[0] = 127  # the largest sums the codes allow
    codes[1] = -127
    return codes


@pytest.mark.parametrize("width", [8, 63, 64, 96, 130, 576])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 8, 13])
def test_the_kernel_sums_are_int_mm_s_for_every_width_and_row_count(kernel, width, rows):
    codes = _codes(301, width, width)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randint(-127, 128, (rows, width), generator=generator, dtype=torch.int8)
    x[0] = 127
    x[-1] = -127
    sums = kernel.sums(x, codes, int8_rows.code_offsets(codes), 2)
    assert sums.dtype == torch.int32 and sums.shape == (rows, 301)
    assert torch.equal(sums, torch._int_mm(x, codes.t()))


def test_the_kernel_reads_code_rows_in_place_from_a_wider_matrix(kernel):
    wide = _codes(200, 160, 3)
    codes = wide[:, :96]  # rows 160 apart
    x = torch.randint(-127, 128, (2, 96), dtype=torch.int8)
    assert torch.equal(kernel.sums(x, codes, int8_rows.code_offsets(codes), 1), torch._int_mm(x, codes.t()))


def test_the_kernel_refuses_what_it_does_not_serve(kernel):
    codes = _codes(10, 64, 0)
    with pytest.raises(ValueError, match="does not serve 65 rows"):
        kernel.sums(torch.zeros(65, 64, dtype=torch.int8), codes, int8_rows.code_offsets(codes), 1)
    with pytest.raises(ValueError, match="as long as the input rows"):
        kernel.sums(torch.zeros(2, 32, dtype=torch.int8), codes, int8_rows.code_offsets(codes), 1)


def test_row_sums_run_few_rows_on_the_kernel_and_more_on_int_mm(kernel, monkeypatch):
    calls: list[int] = []

    class Counting:
        def sums(self, rows, codes, offsets, threads):
            calls.append(int(rows.shape[0]))
            return kernel.sums(rows, codes, offsets, threads)

    monkeypatch.setattr(int8_rows, "int8_rows", lambda: Counting())
    codes = _codes(50, 64, 1)
    offsets = int8_rows.code_offsets(codes)
    for count in (1, int8_rows.MAX_ROWS, int8_rows.MAX_ROWS + 1):
        x = torch.randint(-127, 128, (count, 64), dtype=torch.int8)
        assert torch.equal(int8_rows.row_sums(x, codes, offsets), torch._int_mm(x, codes.t()))
    assert torch.equal(int8_rows.row_sums(x, codes, None), torch._int_mm(x, codes.t()))
    assert calls == [1, int8_rows.MAX_ROWS]


def test_an_int8_head_gives_the_same_logits_on_the_kernel_as_on_int_mm(kernel, monkeypatch):
    if not integer_head_product():
        pytest.skip("this CPU has no int8 dot products: an int8 head multiplies its codes in float32, not as integers")
    generator = torch.Generator().manual_seed(2)
    source = torch.nn.Linear(96, 300, bias=True)
    with torch.no_grad():
        source.weight.copy_(torch.randn(300, 96, generator=generator))
    head = PackedLinear(source, "int8", wide=True)
    assert head.kind == INT8_SPLIT
    x = torch.randn(2, 5, 96, generator=generator)
    x[..., 7] *= 40  # an outlier input
    on_kernel = [head(x[:, :count]) for count in (1, 2, 3, 5)]
    monkeypatch.setenv(int8_rows.ENV, "off")
    int8_rows.int8_rows.cache_clear()
    assert int8_rows.int8_rows() is None
    for count, logits in zip((1, 2, 3, 5), on_kernel, strict=True):
        assert torch.equal(head(x[:, :count]), logits), count


def test_a_verifier_s_decode_logits_do_not_depend_on_the_kernel(checkpoints, kernel, monkeypatch):
    if not integer_head_product():
        pytest.skip("this CPU has no int8 dot products: an int8 head multiplies its codes in float32, not as integers")

    def logits() -> list[torch.Tensor]:
        verifier = TorchVerifier.load(checkpoints["llama"], device="cpu", dtype="float32", weights="int4")
        cache = verifier.new_cache(FullStrategy())
        out = []
        for block in ([3, 4, 5, 6, 7, 8, 9], [10], [11, 12], [13]):  # a prefill, decode steps, a short block
            out.append(verifier.verify(cache, block, len(block)).logits.clone())
            verifier.commit(cache, len(block))
        return out

    with_kernel = logits()
    monkeypatch.setenv(int8_rows.ENV, "off")
    int8_rows.int8_rows.cache_clear()
    for on, off in zip(with_kernel, logits(), strict=True):
        assert torch.equal(on, off)


def test_the_kernel_can_be_turned_off_and_a_failed_build_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(int8_rows.ENV, "off")
    with caplog.at_level("INFO", logger=int8_rows.__name__):
        assert int8_rows.int8_rows() is None
    assert "_int_mm (KAKEYA_INT8_ROWS=off)" in caplog.text
    monkeypatch.delenv(int8_rows.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    broken = tmp_path / "cc"
    broken.write_text(
        "#!/bin/sh\n[ \"$1\" = --version ] && echo broken-cc 1.0 && exit 0\necho 'no such cpu' >&2\nexit 1\n"
    )
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    int8_rows.int8_rows.cache_clear()
    with caplog.at_level("WARNING", logger=int8_rows.__name__):
        assert int8_rows.int8_rows() is None
    assert "the compiled kernel is unavailable" in caplog.text and "no such cpu" in caplog.text
    codes = _codes(20, 64, 4)
    x = torch.randint(-127, 128, (2, 64), dtype=torch.int8)
    assert torch.equal(int8_rows.row_sums(x, codes, int8_rows.code_offsets(codes)), torch._int_mm(x, codes.t()))
