"""Each backend loads, serves and decodes in a process where the other backend's framework cannot be imported."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.checkpoints import save_dflash_drafter
from tests.support.children import run_child

ROOT = Path(__file__).resolve().parents[3]

# `sys.modules[name] = None` makes `import name` fail and `find_spec(name)` report it absent, as if uninstalled.
_DECODE = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None
from inference_engine.config import ServerConfig
from inference_engine.server import load_runtime
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import SinkWindowStrategy

config = ServerConfig(backend={backend!r}, model={model!r}, device="cpu", dtype="float32", proposer="dflash",
                      draft_model={drafter!r})
runtime = load_runtime(config)
verifier = runtime.verifier
strategy = SinkWindowStrategy(sink=2, window=8)
draft = runtime.proposer.open(strategy)
seq = SequenceState(cache=verifier.new_cache(strategy), tokens=list(range(1, 20)), draft_session=draft)
decoder = Decoder(verifier)
produced, drafted = [], 0
while len(produced) < 6:
    step = decoder.step(seq, SamplingParams(temperature=0.8, seed=1), GenerationBudget(6), len(produced))
    produced += step.tokens
    drafted += step.drafted
imported = sorted({{m.split(".")[0] for m, module in sys.modules.items() if module is not None}})
print("decoded", len(produced), verifier.description, "drafted", drafted > 0)
print("frameworks", [m for m in imported if m in ("torch", "mlx", "mlx_lm")])
"""


def _decode_without(blocked: tuple[str, ...], backend: str, model: Path, drafter: Path) -> str:
    """Decode with the DFlash proposer on `backend` while the `blocked` modules cannot be imported."""
    code = textwrap.dedent(_DECODE.format(blocked=blocked, backend=backend, model=str(model), drafter=str(drafter)))
    result = run_child([sys.executable, "-c", code], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> Path:
    return save_dflash_drafter(tmp_path_factory.mktemp("dflash") / "drafter")


def test_the_mlx_backend_never_requires_torch(verifier_pool, drafter):
    out = _decode_without(("torch",), "mlx", verifier_pool.model_dir("mlx", "qwen3"), drafter)
    assert "decoded 6 mlx qwen3" in out and "drafted True" in out
    assert "frameworks ['mlx', 'mlx_lm']" in out


def test_the_torch_backend_never_requires_or_imports_mlx(verifier_pool, drafter):
    out = _decode_without(("mlx", "mlx_lm"), "torch", verifier_pool.model_dir("torch", "qwen3"), drafter)
    assert "decoded 6 torch qwen3" in out and "drafted True" in out
    assert "frameworks ['torch']" in out
