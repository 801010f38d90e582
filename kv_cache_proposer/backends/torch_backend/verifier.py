"""The PyTorch verifier: one forward per block through the model's own classes and transformers' cache API."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import numpy as np
import torch
from transformers import PreTrainedModel

from kv_cache_proposer.backends.base import BackendModel, LoadedModelSpec
from kv_cache_proposer.backends.batching import BatchLayout
from kv_cache_proposer.backends.choices import COMPILE_MODES, KV_DTYPES, TORCH_FORWARDS
from kv_cache_proposer.backends.torch_backend.arrays import TorchArrayOps
from kv_cache_proposer.backends.torch_backend.attention import StagingCache
from kv_cache_proposer.backends.torch_backend.direct import OVER_HISTORY, DirectForward, Masks, Stage, unsupported
from kv_cache_proposer.backends.torch_backend.exact_attention import KEY_BLOCK
from kv_cache_proposer.backends.torch_backend.features import concatenated, first_layers, layer_outputs
from kv_cache_proposer.backends.torch_backend.layer_steps import compile_cache_dir
from kv_cache_proposer.backends.torch_backend.loader import load_causal_lm, resolve_device, resolve_dtype
from kv_cache_proposer.backends.torch_backend.sampler import pick_tokens
from kv_cache_proposer.backends.torch_backend.weights import pack_linears
from kv_cache_proposer.cache import DenseLayerStore, SessionCache, visible_keys
from kv_cache_proposer.cache.protocol import KeyPart
from kv_cache_proposer.errors import ModelLoadError
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.verifier import BatchBlock, VerifyOutput

log = logging.getLogger(__name__)


class TorchVerifier(BackendModel[torch.Tensor]):
    """A Hugging Face causal LM serving per-session caches."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        device: torch.device,
        dtype: torch.dtype,
        forward: str = "auto",
        compile: str = "auto",
        weights: str = "float32",
        kv_dtype: str = "auto",
    ) -> None:
        """`forward`: auto runs the model's forward directly over its weights where the architecture allows
        (`direct.py`: Llama, Mistral, Qwen2, Qwen3 with SDPA attention; transformers' values within float
        rounding, less Python) and through transformers' modules otherwise, with a CPU's shape-invariant
        attention and products: a token's values do not depend on the blocks that delivered its history or on
        the rows beside it in a batched forward; fast runs the direct forward without them (faster, and the last
        bits of a token's values then depend on those); library always runs transformers' modules. `compile`: on
        compiles the direct forward's decode steps and speculative blocks with torch.compile here
        (`layer_steps.py`; their values then differ from transformers' by float rounding), and runs them
        scripted, with a warning logged, where that fails; off, and auto (on every device: compiled steps
        measured no faster on a CPU, and are not yet measured on a GPU), run them scripted. `weights`: how
        `model`'s linear layers are held (`load`). `kv_dtype`: model holds a session's dense K/V in `dtype`;
        bfloat16 rounds them to bfloat16 as they are stored (half the bytes for attention to read; queries meet
        them at bfloat16), which needs the direct forward; auto is bfloat16 where that runs and the linear
        layers are held at 8 or 4 bits (their products round their inputs, the attention's output among them, to
        bfloat16 already), else model. Sessions whose layers store K/V another way (a compressor, restoration)
        are not affected."""
        if forward not in TORCH_FORWARDS:
            raise ValueError(f"unknown forward {forward!r}; expected one of {', '.join(TORCH_FORWARDS)}")
        if compile not in COMPILE_MODES:
            raise ValueError(f"unknown compile {compile!r}; expected one of {', '.join(COMPILE_MODES)}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown kv_dtype {kv_dtype!r}; expected one of {', '.join(KV_DTYPES)}")
        config = model.config.get_text_config()
        num_layers = int(config.num_hidden_layers)
        spec = LoadedModelSpec(
            backend="torch",
            model_type=str(config.model_type),
            vocab_size=int(config.vocab_size),
            num_layers=num_layers,
            hidden_size=int(config.hidden_size),
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
        )
        super().__init__(spec, TorchArrayOps(device))
        self.model = model
        self.device = device
        self.dtype = dtype
        self.weights = weights
        layer_types = getattr(config, "layer_types", None)
        sliding_window = getattr(config, "sliding_window", None)
        if layer_types is None:
            kind = "sliding_attention" if sliding_window and getattr(config, "use_sliding_window", True) else None
            layer_types = [kind or "full_attention"] * num_layers
        self._layer_types: list[str] = list(layer_types)
        self._sliding_window: int | None = int(sliding_window) if sliding_window else None
        self._per_type_masks = len(set(self._layer_types)) > 1
        self._all_full_attention = set(self._layer_types) == {"full_attention"}
        self._additive_mask = model.config._attn_implementation == "eager"
        reason = unsupported(model) if forward != "library" else "asked for"
        self._direct = DirectForward(model, self._layer_types, invariant=forward == "auto") if reason is None else None
        direct = "direct" if forward == "auto" else "direct, fast kernels"
        self.forward_path = direct if reason is None else f"transformers modules ({reason})"
        self.compile_s: float | None = None  # seconds compiling took, where the steps run compiled
        if kv_dtype == "bfloat16" and self._direct is None:
            raise ModelLoadError(f"K/V held at bfloat16 need the direct forward; this one runs {self.forward_path}")
        if kv_dtype == "auto":
            kv_dtype = "bfloat16" if self._direct is not None and weights in ("int8", "int4") else "model"
        if kv_dtype == "bfloat16" and dtype != torch.bfloat16:
            self.dense_store = functools.partial(DenseLayerStore, dtype=torch.bfloat16)
            self.model_spec = dataclasses.replace(spec, kv_dtype="bfloat16")
        if compile == "on":
            self._compile_steps()

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        forward: str = "auto",
        compile: str = "auto",
        weights: str = "float32",
        kv_dtype: str = "auto",
    ) -> TorchVerifier:
        """`weights`: float32 keeps the linear layers in `dtype`; bfloat16, int8 or int4 holds them so
        (`weights.pack_linears`), with activations in `dtype`; `kv_dtype` as the constructor takes it."""
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        model = load_causal_lm(model_dir, torch_device, torch_dtype)
        if weights != "float32":
            pack_linears(model, weights)
        return cls(
            model,
            device=torch_device,
            dtype=torch_dtype,
            forward=forward,
            compile=compile,
            weights=weights,
            kv_dtype=kv_dtype,
        )

    @property
    def description(self) -> str:
        held = f", weights: {self.weights}" if self.weights != "float32" else ""
        return f"{super().description}{held}, forward: {self.forward_path}"

    @property
    def compiled(self) -> bool:
        """Whether decode steps and speculative blocks run compiled by torch.compile."""
        return self._direct is not None and self._direct.compiled

    def _compile_steps(self) -> None:
        if self._direct is None:
            log.warning("compile on: not compiled, the forward runs through %s", self.forward_path)
            return
        try:
            seconds = self._direct.compile_steps()
        except Exception as exc:  # inductor raises many kinds: no C++ compiler, an operation it cannot lower, ...
            why = f"{type(exc).__name__}: {next(iter(str(exc).strip().splitlines()), '')}"
            log.warning("compile on: compiling the decode step failed, it runs scripted (%s)", why)
            self.forward_path = f"direct (compilation failed: {type(exc).__name__})"
            return
        self.compile_s = seconds
        self.forward_path = "direct, compiled"
        log.info(
            "compiled the decode step in %.1f s (inductor cache: %s)",
            seconds,
            compile_cache_dir(),
            extra={"compile_s": round(seconds, 2)},
        )

    @property
    def reads_held_keys(self) -> bool:
        return self._direct is not None  # the direct forward reads held parts; transformers' modules read dense K/V

    @property
    def key_block(self) -> int | None:
        return KEY_BLOCK if self._direct is not None and self._direct.exact else None

    @torch.inference_mode()
    def forward(
        self,
        cache: SessionCache[torch.Tensor],
        token_ids: Sequence[int],
        logits_rows: int,
        feature_layers: Sequence[int],
    ) -> VerifyOutput[torch.Tensor]:
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        return self._forward_ids(cache, input_ids, logits_rows, feature_layers)

    @torch.inference_mode()
    def burst(
        self,
        cache: SessionCache[torch.Tensor],
        token_ids: Sequence[int],
        steps: int,
        feature_layers: Sequence[int] = (),
    ) -> tuple[list[int], torch.Tensor | None]:
        # Each step's token stays on the device and feeds the next forward, so the host queues every forward of
        # the burst without waiting for one; the tokens cross to the host once, at the end.
        first = self.verify(cache, token_ids, 1, feature_layers=feature_layers)
        rows, features = [first.logits], [first.features]  # [1, V] and [n or 1, L*H] each
        for _ in range(steps - 1):
            cache.begin_stage(1, extend=True)
            out = self._forward_ids(cache, rows[-1].argmax(dim=-1)[None], 1, feature_layers)  # input [1, 1]
            rows.append(out.logits)
            features.append(out.features)
        picks = [int(t) for t in torch.cat(rows).argmax(dim=-1).tolist()]
        cache.name_stage([*token_ids, *picks[:-1]])
        if not feature_layers:
            return picks, None
        return picks, torch.cat([cast(torch.Tensor, f) for f in features])

    @torch.inference_mode()
    def run_layers(self, cache: SessionCache[torch.Tensor], token_ids: Sequence[int], last_layer: int) -> None:
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        position_ids, masks = self._call_inputs(cache)
        if self._direct is not None:
            self._direct.stage_layers(input_ids, position_ids, masks, cache.stage_layer_parts, last_layer)
            return
        with first_layers(self.model, last_layer + 1):
            self._run(input_ids, position_ids, masks, cache, 1, ())

    def _forward_ids(
        self,
        cache: SessionCache[torch.Tensor],
        input_ids: torch.Tensor,
        logits_rows: int,
        feature_layers: Sequence[int],
    ) -> VerifyOutput[torch.Tensor]:
        position_ids, masks = self._call_inputs(cache)
        logits, features = self._run(input_ids, position_ids, masks, cache, logits_rows, feature_layers)
        return VerifyOutput(logits[0, -logits_rows:].float(), None if features is None else features[0])

    def _call_inputs(self, cache: SessionCache[torch.Tensor]) -> tuple[torch.Tensor, Masks]:
        """The position ids `[1, n]` and masks of the model call in flight."""
        position_ids = torch.tensor(cache.call.query_positions[None, :], device=self.device)  # [1, n]
        return position_ids, self._call_masks(cache)

    def _call_masks(self, cache: SessionCache[torch.Tensor]) -> Masks:
        """The masks of the model call in flight over `cache` alone."""
        n = len(cache.call.query_positions)
        masks: Masks = self._attention_masks(cache)
        if masks is None and self._direct is not None and n > 1 and cache.call.keys_before_queries:
            # transformers builds this block's causal mask itself; the direct forward is handed it, or told that
            # the block reads every earlier key and itself causally where its attention builds that mask itself
            implied = self._direct.implies_mask(n)
            masks = OVER_HISTORY if implied else self._attention_masks(cache, always=True)
        return masks

    def _run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        masks: Masks,
        stager: SessionCache[torch.Tensor] | BatchLayout[torch.Tensor],
        logits_to_keep: int | torch.Tensor,
        feature_layers: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [1, rows, V] and the chosen layers' features [1, T, L*H] of one model call, staging into
        `stager`: directly over the weights, or through transformers' modules."""
        if self._direct is not None:
            stage = stager.stage_layer_parts if not isinstance(stager, BatchLayout) else _by_row(stager)
            logits, outputs = self._direct(input_ids, position_ids, masks, stage, logits_to_keep, feature_layers)
            return logits, torch.cat([outputs[i] for i in feature_layers], dim=-1) if feature_layers else None
        with layer_outputs(self.model, feature_layers) as captured:
            output = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=masks,
                past_key_values=StagingCache(stager),
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        return output.logits, concatenated(captured, feature_layers) if feature_layers else None

    @torch.inference_mode()
    def forward_batch(
        self, blocks: Sequence[BatchBlock[torch.Tensor]], feature_layers: Sequence[int]
    ) -> list[VerifyOutput[torch.Tensor]]:
        # Packed: the blocks run as one sequence with per-token positions, so rows of different lengths (a prefill
        # chunk beside decode steps) cost no padding. The direct forward attends each row over its own keys under
        # the mask its block gets alone; transformers' modules read every row's keys under a block-diagonal mask.
        layout = BatchLayout(blocks, self.array_ops, packed=True)
        input_ids = torch.tensor(layout.token_matrix(), dtype=torch.long, device=self.device)  # [1, T]
        position_ids = torch.from_numpy(layout.position_matrix()).to(self.device)  # [1, T]
        chosen: Masks
        if self._direct is not None:
            chosen = [self._call_masks(block.cache) for block in blocks]
        else:
            masks = {"full_attention": self._format_batch_mask(layout.mask())}
            if "sliding_attention" in self._layer_types:
                masks["sliding_attention"] = self._format_batch_mask(layout.mask(window=self._sliding_window or 0))
            chosen = masks if self._per_type_masks else masks[self._layer_types[0]]
        wanted = torch.tensor(layout.logits_indices(), dtype=torch.long, device=self.device)
        logits, captured = self._run(input_ids, position_ids, chosen, layout, wanted, feature_layers)
        logits = logits[0].float()  # [sum of logits rows, V]
        features = None if captured is None else captured[0]  # [T, L*H]
        outputs = []
        row = 0
        for index, block in enumerate(blocks):
            _, start, end = layout.query_span(index)
            outputs.append(
                VerifyOutput(logits[row : row + block.logits_rows], None if features is None else features[start:end])
            )
            row += block.logits_rows
        return outputs

    @torch.inference_mode()
    def commit(self, cache: SessionCache[torch.Tensor], count: int) -> None:
        cache.commit(count)

    def _kv_like(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=self.device)

    def pick_tokens(self, logits: torch.Tensor, params: SamplingParams, positions: Sequence[int]) -> list[int]:
        return pick_tokens(logits, params, positions)

    def host_logits(self, logits: torch.Tensor) -> np.ndarray:
        return logits.double().cpu().numpy()

    def _attention_masks(
        self, cache: SessionCache[torch.Tensor], *, always: bool = False
    ) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """The masks of the forward in flight; unless `always`, None where the library's own causal mask says the
        same (an unbounded cache read alone is in position order), which lets attention skip the mask for a single
        query."""
        strategy, query_positions, key_positions = cache.strategy, cache.call.query_positions, cache.call.key_positions
        own = cache.call.own_keys
        unbounded = strategy.bounded_slots is None and cache.call.prefix_keys == 0 and not own
        if unbounded and self._all_full_attention and not always:
            return None
        masks = {"full_attention": visible_keys(strategy, query_positions, key_positions, own_keys=own)}  # [n, K]
        if "sliding_attention" in self._layer_types:
            window = self._sliding_window or 0
            masks["sliding_attention"] = visible_keys(
                strategy, query_positions, key_positions, window=window, own_keys=own
            )
        formatted = {kind: self._format_mask(mask) for kind, mask in masks.items()}
        if self._per_type_masks:
            return formatted
        return formatted[self._layer_types[0]]

    def _format_batch_mask(self, allowed: np.ndarray) -> torch.Tensor:
        return self._format_mask(allowed[0])

    def _format_mask(self, allowed: np.ndarray) -> torch.Tensor:
        mask = torch.from_numpy(allowed).to(self.device)[None, None]  # [1, 1, n, K]
        if not self._additive_mask:
            return mask
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(mask, zero, torch.finfo(self.dtype).min)


def _by_row(layout: BatchLayout[torch.Tensor]) -> Stage:
    """A batched forward's staging: a packed layout's rows each in parts (attention reads a row's held keys over
    its own queries), a padded layout's keys as one dense part."""
    if layout.packed:
        return layout.stage_layer_rows

    def stage(layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[KeyPart[torch.Tensor], ...]:
        return (layout.stage_layer(layer_idx, keys, values),)

    return stage
