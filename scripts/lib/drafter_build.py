"""The drafter a training run starts from: a DFlash drafter shaped after the verifier (`--layers`, its target
layers, width and attention), with fresh weights or, with `--init`, a saved drafter's."""

from __future__ import annotations

import argparse

import torch
from transformers import Qwen3Config

from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.proposers.dflash.checkpoint import load_drafter
from kv_cache_proposer.proposers.dflash.config import DFlashSpec
from kv_cache_proposer.proposers.dflash.model import DFlashDrafter
from kv_cache_proposer.proposers.dflash.training import default_target_layers


def build_drafter(args: argparse.Namespace, verifier: TorchVerifier) -> tuple[DFlashDrafter, DFlashSpec]:
    """The drafter `train_dflash.py`'s arguments describe, on the CPU, and its spec; with `--init`, holding that
    saved drafter's weights (which must have the same target layers and layer count)."""
    vconfig = verifier.model.config.get_text_config()
    layers = args.target_layers or default_target_layers(verifier.num_layers, max(2, args.layers))
    mask = args.mask_token_id
    if mask is None:
        from transformers import AutoTokenizer

        mask = AutoTokenizer.from_pretrained(args.model, local_files_only=True).mask_token_id
        if mask is None:
            raise SystemExit("the tokenizer has no mask token: pass --mask-token-id")
    head_dim = int(getattr(vconfig, "head_dim", None) or vconfig.hidden_size // vconfig.num_attention_heads)
    window = args.sliding_window or None
    config = Qwen3Config(
        vocab_size=verifier.vocab_size,
        hidden_size=verifier.hidden_size,
        intermediate_size=args.intermediate_size or int(vconfig.intermediate_size),
        num_hidden_layers=args.layers,
        num_attention_heads=int(vconfig.num_attention_heads),
        num_key_value_heads=int(vconfig.num_key_value_heads),
        head_dim=head_dim,
        rms_norm_eps=float(getattr(vconfig, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(getattr(vconfig, "max_position_embeddings", 32768)),
        rope_parameters=getattr(vconfig, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False,
        use_sliding_window=window is not None,
        sliding_window=window,
        layer_types=["sliding_attention" if window else "full_attention"] * args.layers,
    )
    spec = DFlashSpec(
        block_size=args.block_size,
        target_layer_ids=tuple(layers),
        mask_token_id=int(mask),
        num_target_layers=verifier.num_layers,
    )
    torch.manual_seed(args.seed)
    drafter = DFlashDrafter(config, len(layers))
    if args.init is not None:
        initial, initial_spec = load_drafter(args.init, device=torch.device("cpu"), dtype=torch.float32)
        if initial_spec.target_layer_ids != spec.target_layer_ids or len(initial.layers) != len(drafter.layers):
            raise SystemExit(f"--init {args.init} has other target layers or another layer count than this run")
        drafter.load_state_dict(initial.state_dict())
    return drafter, spec
