"""The CBLAS library behind MLX's CPU kernels (`--mlx-blas`): with `auto` the daemon's MLX backend calls the system
OpenBLAS instead of the reference BLAS the Linux wheel bundles, computes the same logits up to float32 rounding and
decodes the same greedy tokens; a library it cannot use stops the start with a message.

The choice must happen before MLX loads, and this test process has loaded MLX already, so every run here is a child
process: a Python process per choice, and the `kakeya-runtime` console script."""

from __future__ import annotations

import _ctypes
import json
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generated import runtime_pb2_grpc
from tests.support.children import run_child
from tests.support.daemon import Daemon
from tests.support.server import create, generate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not list(Path("/usr/lib").glob("*/openblas-pthread/libopenblas.so.0")),
        reason=(
            "no system OpenBLAS: scripts/install_system_packages.sh installs the Debian package libopenblas0-pthread"
        ),
    ),
]

PROMPT = list(range(7, 7 + 300))  # long enough that attention's products go through sgemm with many keys
NEW_TOKENS = 24

# One greedy generation through the engine on the bundled model, with the CBLAS library chosen first.
_RUN = """
import json, sys
from kv_cache_proposer.backends.mlx_blas import use_mlx_blas
blas = use_mlx_blas(sys.argv[1])
assert "mlx.core" not in sys.modules
import numpy as np
from inference_engine.config import BUNDLED_MODEL_DIR
from kv_cache_proposer.backends import load_verifier
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy
verifier = load_verifier("mlx", BUNDLED_MODEL_DIR, device="cpu", dtype="float32")
prompt, new_tokens = json.loads(sys.argv[2]), int(sys.argv[3])
out = verifier.verify(verifier.new_cache(FullStrategy()), prompt, logits_rows=1)
logits = np.array(out.logits, dtype=np.float32)[-1]
seq = SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=list(prompt))
decoder, budget, tokens = Decoder(verifier), GenerationBudget(max_new_tokens=new_tokens), []
while len(tokens) < new_tokens:
    tokens += decoder.step(seq, SamplingParams(), budget, len(tokens)).tokens
print(json.dumps({"library": blas.library, "description": verifier.description, "key_block": verifier.key_block,
                  "logits": logits.tolist(), "tokens": tokens}))
"""


def _run(choice: str) -> dict:
    done = run_child([sys.executable, "-c", _RUN, choice, json.dumps(PROMPT), str(NEW_TOKENS)])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_auto_makes_mlx_call_the_system_openblas_with_the_same_logits_and_greedy_tokens():
    bundled, openblas = _run("bundled"), _run("auto")
    assert bundled["library"] == "bundled" and "CPU BLAS: bundled" in bundled["description"]
    assert "libopenblas" in openblas["library"] and "CPU BLAS: libopenblas" in openblas["description"]
    a, b = np.array(bundled["logits"]), np.array(openblas["logits"])
    # Another sgemm rounds differently: not bit for bit the same logits (so MLX really called OpenBLAS), the same
    # within float32 rounding, and the same greedy tokens.
    assert np.abs(a - b).max() > 0
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    assert len(openblas["tokens"]) == NEW_TOKENS and openblas["tokens"] == bundled["tokens"]
    # Only the bundled BLAS sums a row alone, so only there does a bounded cache lay its keys out for exactness.
    assert bundled["key_block"] == 64 and openblas["key_block"] is None


def test_the_daemon_serves_with_openblas_and_names_it_in_its_model_description():
    daemon = Daemon("serve", "--backend", "mlx", "--device", "cpu", "--port", "0", "--metrics-port", "-1")
    try:
        host, port = daemon.wait_listening()
        assert "MLX CPU BLAS: libopenblas" in daemon.output
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest())
            assert "CPU BLAS: libopenblas" in info.description
            served = generate(stub, create(stub, initial=PROMPT[:40]), max_tokens=8).tokens
        assert len(served) == 8
    finally:
        daemon.kill()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--backend", "mlx", "--mlx-blas", "/nonexistent/libopenblas.so.0"], "no such file"),
        (["--backend", "mlx", "--mlx-blas", _ctypes.__file__], "exports no cblas_sgemm"),
        (["--backend", "torch", "--mlx-blas", "bundled"], "applies to the mlx backend, not torch"),
    ],
)
def test_a_blas_the_daemon_cannot_use_stops_the_start_with_a_message(flags, message):
    daemon = Daemon("serve", *flags, "--device", "cpu", "--port", "0", "--metrics-port", "-1")
    assert daemon.wait(timeout_s=120) == 2
    assert message in daemon.output
