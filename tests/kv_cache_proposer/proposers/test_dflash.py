"""The DFlash drafter: checkpoint format, drafting with cached context equals the training forward."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from safetensors.torch import load_file

from kv_cache_proposer.errors import ModelLoadError
from kv_cache_proposer.proposers.dflash.checkpoint import load_drafter
from kv_cache_proposer.proposers.dflash.config import read_config
from kv_cache_proposer.proposers.dflash.proposer import DFlashProposer
from kv_cache_proposer.proposers.dflash.training import block_loss, default_target_layers, sample_anchors
from kv_cache_proposer.strategies import FullStrategy, SinkWindowStrategy
from tests.support.checkpoints import VOCAB_SIZE, save_dflash_drafter

PUBLISHED_NAMES = {
    "fc.weight",
    "hidden_norm.weight",
    "norm.weight",
    *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
    "layers.0.self_attn.q_norm.weight",
    "layers.0.self_attn.k_norm.weight",
    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    "layers.0.input_layernorm.weight",
    "layers.0.post_attention_layernorm.weight",
}


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return save_dflash_drafter(tmp_path_factory.mktemp("dflash") / "drafter")


def test_the_saved_drafter_uses_exactly_the_published_names_and_config_fields(drafter_dir):
    assert set(load_file(drafter_dir / "model.safetensors")) == PUBLISHED_NAMES
    raw = json.loads((drafter_dir / "config.json").read_text())
    assert raw["block_size"] == 4 and raw["num_target_layers"] == 3
    assert raw["dflash_config"] == {"target_layer_ids": [0, 2], "mask_token_id": VOCAB_SIZE - 1}


def test_a_config_with_the_dflash_fields_at_the_top_level_loads_the_same(drafter_dir, tmp_path):
    raw = json.loads((drafter_dir / "config.json").read_text())
    flat = {**raw, **raw.pop("dflash_config")}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    _, spec = read_config(tmp_path)
    _, reference = read_config(drafter_dir)
    assert spec == reference


def test_loading_rejects_missing_weights_and_unsupported_variants(drafter_dir, tmp_path):
    raw = json.loads((drafter_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="no weights"):
        load_drafter(tmp_path, device=torch.device("cpu"), dtype=torch.float32)
    state = load_file(drafter_dir / "model.safetensors")
    del state["fc.weight"]
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"fc\.weight"):
        load_drafter(tmp_path, device=torch.device("cpu"), dtype=torch.float32)
    raw["architectures"] = ["DFlash2DraftModel"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="not supported"):
        read_config(tmp_path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_target_layers": 5}, "verifier of 5 layers"),
        ({"target_layer_ids": (0, 7)}, "do not fit"),
        ({"mask_token_id": VOCAB_SIZE}, "mask_token_id"),
    ],
)
def test_a_drafter_built_for_another_verifier_is_refused(drafter_dir, verifiers, change, message):
    drafter, spec = load_drafter(drafter_dir, device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(ModelLoadError, match=message):
        DFlashProposer(drafter, dataclasses.replace(spec, **change), verifiers["qwen3"])


@pytest.mark.parametrize("strategy", [FullStrategy(), SinkWindowStrategy(sink=2, window=1000)], ids=["full", "sink"])
def test_drafting_with_cached_context_equals_the_training_forward(drafter_dir, verifiers, strategy):
    verifier = verifiers["qwen3"]
    proposer = DFlashProposer.load(drafter_dir, verifier)
    rng = random.Random(0)
    tokens = [rng.randrange(VOCAB_SIZE - 1) for _ in range(30)]
    layers = proposer.spec.target_layer_ids
    features = verifier.verify(verifier.new_cache(FullStrategy()), tokens, 1, feature_layers=layers).features[None]
    anchor = 17
    session = proposer.open(strategy)
    # The context arrives in the chunks the decoder would commit.
    for begin, end in ((0, 9), (9, 10), (10, anchor)):
        session.on_commit(tokens, end, features[0, begin:end])
    drafts = session.propose(tokens[: anchor + 1], 3)

    head = verifier.model.get_output_embeddings()
    embed = verifier.model.get_input_embeddings().weight
    captured = {}
    original = head.forward
    head.forward = lambda hidden: captured.setdefault("logits", original(hidden))
    with torch.no_grad():  # the features were captured in inference mode
        try:
            block_loss(
                proposer.drafter,
                embed,
                head,
                torch.tensor([tokens]),
                features,
                torch.tensor([anchor]),
                block_size=4,
                mask_token_id=proposer.spec.mask_token_id,
                gamma=4.0,
            )
        finally:
            head.forward = original
    assert drafts == captured["logits"][0, 0].argmax(-1).tolist()
    assert session.nbytes > 0 and session.propose(tokens[:anchor], 3) == [], "no draft without the context"


def test_default_target_layers_and_anchor_sampling():
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layers(3, 2) == [0, 1]
    anchors = sample_anchors(64, 8, 10, torch.Generator().manual_seed(0))
    assert anchors.tolist() == sorted(set(anchors.tolist())) and anchors.min() >= 1 and anchors.max() <= 56


def test_per_row_anchors_score_each_row_as_alone_and_acceptance_counts_leading_hits(drafter_dir, verifiers):
    verifier = verifiers["qwen3"]
    proposer = DFlashProposer.load(drafter_dir, verifier)
    rng = random.Random(4)
    tokens = torch.tensor([[rng.randrange(VOCAB_SIZE - 1) for _ in range(24)] for _ in range(2)])
    layers = proposer.spec.target_layer_ids
    features = torch.stack(
        [
            verifier.verify(verifier.new_cache(FullStrategy()), row.tolist(), 1, feature_layers=layers).features
            for row in tokens
        ]
    )
    embed = verifier.model.get_input_embeddings().weight
    head = verifier.model.get_output_embeddings()
    anchors = torch.tensor([[3, 9], [12, 17]])
    kwargs = {"block_size": 4, "mask_token_id": proposer.spec.mask_token_id, "gamma": 4.0}
    with torch.no_grad():
        both = block_loss(proposer.drafter, embed, head, tokens, features, anchors, **kwargs)
        alone = [
            block_loss(proposer.drafter, embed, head, tokens[i : i + 1], features[i : i + 1], anchors[i], **kwargs)
            for i in range(2)
        ]
    torch.testing.assert_close(both.loss, (alone[0].loss + alone[1].loss) / 2)
    torch.testing.assert_close(both.slot_accuracy, (alone[0].slot_accuracy + alone[1].slot_accuracy) / 2)
    assert both.acceptance_length == pytest.approx((alone[0].acceptance_length + alone[1].acceptance_length) / 2)

    # A drafter that always drafts the block's own targets is accepted in full: 1 + (block_size - 1) tokens.
    original = head.forward
    targets = {}

    def perfect(hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.full((*hidden.shape[:-1], VOCAB_SIZE), -1e4)
        return logits.scatter(-1, targets["ids"][..., None], 1e4)

    block_pos = anchors[:, :, None] + torch.arange(1, 4)
    targets["ids"] = tokens.gather(1, block_pos.view(2, -1)).view(2, 2, 3)
    head.forward = perfect
    try:
        with torch.no_grad():
            stats = block_loss(proposer.drafter, embed, head, tokens, features, anchors, **kwargs)
    finally:
        head.forward = original
    assert stats.acceptance_length == 4.0 and stats.slot_accuracy.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_scripted_forward_and_context_projection_are_the_module_s_bit_for_bit(bias, tmp_path):
    from kv_cache_proposer.proposers.dflash.steps import ScriptedDrafter

    directory = save_dflash_drafter(tmp_path / "drafter", layers=2, sliding_window=6, attention_bias=bias, seed=5)
    drafter, _ = load_drafter(directory, device=torch.device("cpu"), dtype=torch.float32)
    assert drafter.layer_windows == [6, None]
    assert all((layer.self_attn.k_proj.bias is not None) == bias for layer in drafter.layers)
    scripted = ScriptedDrafter(drafter)
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for context, block in ((1, 2), (9, 4), (40, 8)):
            features = torch.randn(1, context, 2 * 64, generator=generator)
            positions = torch.arange(3, 3 + context)[None]
            kv = drafter.context_kv(features, positions)
            for (keys, values), (fast_keys, fast_values) in zip(
                kv, scripted.context_kv(features, positions), strict=True
            ):
                assert torch.equal(keys, fast_keys) and torch.equal(values, fast_values)
            embeds = torch.randn(1, block, 64, generator=generator)
            query = torch.arange(3 + context, 3 + context + block)[None]
            keys_at = torch.cat([positions, query], dim=1)
            allowed = torch.ones(1, 1, block, context + block, dtype=torch.bool)
            masks = drafter.layer_masks(allowed, query[0, :, None], keys_at[0, None, :])

            def store(layer, keys, values, kv=kv):
                return torch.cat([kv[layer][0], keys], dim=2), torch.cat([kv[layer][1], values], dim=2)

            for layer_masks in (masks, [None, None]):
                hidden = drafter(embeds, query, layer_masks, store)
                assert torch.equal(scripted.forward(embeds, query, layer_masks, store), hidden)
