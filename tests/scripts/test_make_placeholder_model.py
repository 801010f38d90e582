import importlib.util
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "inference_engine" / "models" / "kakeya-tiny"


def test_the_script_reproduces_the_bundled_placeholder_model(tmp_path):
    out = tmp_path / "model"
    result = subprocess.run(
        [sys.executable, "scripts/make_placeholder_model.py", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    fresh, bundled = load_file(out / "model.safetensors"), load_file(BUNDLED / "model.safetensors")
    assert fresh.keys() == bundled.keys()
    assert all(torch.equal(fresh[name], bundled[name]) for name in fresh)
    assert (out / "tokenizer.json").read_text() == (BUNDLED / "tokenizer.json").read_text()


def test_the_bundled_model_decodes_through_the_serving_path_and_round_trips_text():
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED, local_files_only=True)
    ids = tokenizer.encode("def main():\n    return 42")
    assert tokenizer.decode(ids) == "def main():\n    return 42"
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")
    verifier = TorchVerifier.load(BUNDLED, device="cpu", dtype="float32")
    assert verifier.vocab_size == len(tokenizer)
    decoder = Decoder(verifier)
    seq = SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=ids)
    step = decoder.step(seq, SamplingParams(), GenerationBudget(4), 0)
    assert len(step.tokens) == 1 and 0 <= step.tokens[0] < verifier.vocab_size


def _module_doc(path: Path) -> str:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module.__doc__ or ""


def test_every_script_documents_its_usage():
    # scripts/lib holds the modules the scripts import, not scripts of their own.
    scripts = sorted(p for p in (ROOT / "scripts").rglob("*.py") if "lib" not in p.relative_to(ROOT / "scripts").parts)
    assert any(script.parent != ROOT / "scripts" for script in scripts), "scripts in subfolders are checked too"
    for script in scripts:
        assert "Usage" in _module_doc(script), script.relative_to(ROOT)
