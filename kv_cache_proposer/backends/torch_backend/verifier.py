"""The PyTorch verifier: one forward per block through the model's own classes and transformers' cache API."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel

from kv_cache_proposer.backends.torch_backend.features import concatenated, layer_outputs
from kv_cache_proposer.backends.torch_backend.kv_store import StagingCache, TorchSessionCache
from kv_cache_proposer.backends.torch_backend.loader import load_causal_lm, resolve_device, resolve_dtype
from kv_cache_proposer.backends.torch_backend.sampler import pick_tokens
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import KVStrategy
from kv_cache_proposer.verifier import VerifyOutput


class TorchVerifier:
    """A Hugging Face causal LM serving per-session caches."""

    def __init__(self, model: PreTrainedModel, *, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        config = model.config.get_text_config()
        self._config = config
        self._num_layers = int(config.num_hidden_layers)
        self._vocab_size = int(config.vocab_size)
        layer_types = getattr(config, "layer_types", None)
        sliding_window = getattr(config, "sliding_window", None)
        if layer_types is None:
            kind = "sliding_attention" if sliding_window and getattr(config, "use_sliding_window", True) else None
            layer_types = [kind or "full_attention"] * self._num_layers
        self._layer_types: list[str] = list(layer_types)
        self._sliding_window: int | None = int(sliding_window) if sliding_window else None
        self._per_type_masks = len(set(self._layer_types)) > 1
        self._additive_mask = model.config._attn_implementation == "eager"

    @classmethod
    def load(cls, model_dir: str | Path, *, device: str = "auto", dtype: str = "auto") -> TorchVerifier:
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        model = load_causal_lm(model_dir, torch_device, torch_dtype)
        return cls(model, device=torch_device, dtype=torch_dtype)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def hidden_size(self) -> int:
        return int(self._config.hidden_size)

    @property
    def description(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"torch {self._config.model_type} ({self._num_layers} layers) on {self.device} {dtype}"

    def new_cache(self, strategy: KVStrategy) -> TorchSessionCache:
        return TorchSessionCache(strategy, num_layers=self._num_layers, device=self.device)

    @torch.inference_mode()
    def verify(
        self,
        cache: TorchSessionCache,
        token_ids: Sequence[int],
        logits_rows: int,
        *,
        feature_layers: Sequence[int] = (),
        extend_stage: bool = False,
    ) -> VerifyOutput:
        block_len = len(token_ids)
        key_positions = cache.begin_stage(block_len, extend=extend_stage)  # [K]
        query_positions = key_positions[-block_len:]  # [n]
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        with layer_outputs(self.model, feature_layers) as captured:
            output = self.model(
                input_ids=input_ids,
                position_ids=query_positions[None, :],
                attention_mask=self._attention_masks(cache.strategy, query_positions, key_positions),
                past_key_values=StagingCache(cache),
                use_cache=True,
                logits_to_keep=logits_rows,
            )
        features = concatenated(captured, feature_layers)[0] if feature_layers else None  # [n, L*H]
        return VerifyOutput(output.logits[0, -logits_rows:].float(), features)  # logits [rows, V]

    @torch.inference_mode()
    def commit(self, cache: TorchSessionCache, count: int) -> None:
        cache.commit(count)

    def pick_tokens(self, logits: torch.Tensor, params: SamplingParams, positions: Sequence[int]) -> list[int]:
        return pick_tokens(logits, params, positions)

    def host_logits(self, logits: torch.Tensor) -> np.ndarray:
        return logits.double().cpu().numpy()

    def _attention_masks(
        self, strategy: KVStrategy, query_positions: torch.Tensor, key_positions: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        q = query_positions[:, None]  # [n, 1]
        k = key_positions[None, :]  # [1, K]
        allowed = (k >= 0) & (k <= q) & strategy.visible(q, k)  # [n, K]
        masks = {"full_attention": allowed}
        if "sliding_attention" in self._layer_types:
            window = self._sliding_window or 0
            masks["sliding_attention"] = allowed & (q - k < window)
        formatted = {kind: self._format_mask(mask) for kind, mask in masks.items()}
        if self._per_type_masks:
            return formatted
        return formatted[self._layer_types[0]]

    def _format_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = allowed[None, None]  # [1, 1, n, K]
        if not self._additive_mask:
            return mask
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(mask, zero, torch.finfo(self.dtype).min)
