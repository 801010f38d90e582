"""In-process measurements of restoration plans on one verifier: needle recall, logit divergence from `full`, and
the per-position K/V rows f_θ is fitted on. Shared by `plan_restore.py` and `train_f_theta.py`."""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from tqdm import tqdm

from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.restoration import LinearProjection, RestorationPlan, RestorationSetup, Rotary
from kv_cache_proposer.restoration.drafter_context import DrafterContext
from kv_cache_proposer.restoration.projection import kv_rows
from kv_cache_proposer.restoration.rebuild import forward_kv
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import DlmRestoreStrategy, FullStrategy
from lib.corpus import manual_sections, read_text, split_sources, stdlib_sources
from lib.niah import build_chat_document, build_document


@dataclass(frozen=True, slots=True)
class Needled:
    """A needle test: the prompt's tokens and the value its answer must contain."""

    prompt: list[int]
    value: str


@dataclass(frozen=True, slots=True)
class Probe:
    """What a plan is measured on: needle documents and held-out text, under one sink + window."""

    documents: list[Needled]
    texts: list[list[int]]  # held-out token sequences longer than the window, for logit divergence
    sink: int
    window: int
    max_tokens: int
    decode: Callable[[list[int]], str]


def corpus_lines(tokenizer: Any) -> list[list[int]]:
    """Token ids of every line of the held-out corpus files (the needle documents' filler)."""
    _, held = split_sources(stdlib_sources())
    lines = [line for path in held for line in read_text(path).splitlines(True)]
    return [ids for ids in tokenizer(lines, add_special_tokens=False)["input_ids"] if ids]


def token_stream(tokenizer: Any, count: int, length: int, rng: random.Random, *, held_out: bool) -> list[list[int]]:
    """`count` sequences of `length` tokens: consecutive corpus files (training or held-out) from random starts."""
    train, held = split_sources(stdlib_sources())
    paths = held if held_out else train
    out = []
    for _ in range(count):
        index = rng.randrange(len(paths))
        tokens: list[int] = []
        while len(tokens) < length:
            tokens += tokenizer.encode(read_text(paths[index % len(paths)]), add_special_tokens=False)
            index += 1
        out.append(tokens[:length])
    return out


def make_probe(
    tokenizer: Any,
    *,
    lengths: Sequence[int],
    samples: int,
    texts: int,
    sink: int,
    window: int,
    seed: int,
    chat: bool = False,
) -> Probe:
    """Needle documents at every length (depths spread evenly) and held-out texts of the longest length. `chat`:
    prose documents with the question in a user turn, in the model's chat template (`build_chat_document`), whose
    answers get 32 tokens (the model may restate the question first); else source code with an answer prefix."""
    rng = random.Random(seed)
    depths = [i / max(1, samples - 1) for i in range(samples)]
    documents: list[Needled] = []
    if chat:
        filler = [text for _, text in manual_sections()]
        for length in lengths:
            for depth in depths:
                document = build_chat_document(tokenizer, filler, length, depth, rng)
                documents.append(Needled(document.prompt, document.value))
    else:
        lines = corpus_lines(tokenizer)
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        for length in lengths:
            for depth in depths:
                code = build_document(lines, encode, length, [depth], rng)
                documents.append(Needled(code.prompt, code.needles[0].value))
    return Probe(
        documents=documents,
        texts=token_stream(tokenizer, texts, max(lengths), rng, held_out=True),
        sink=sink,
        window=window,
        max_tokens=32 if chat else 10,
        decode=tokenizer.decode,
    )


def _cache(verifier: Any, plan: RestorationPlan | None, probe: Probe) -> Any:
    if plan is None:
        return verifier.new_cache(FullStrategy())
    strategy = DlmRestoreStrategy(sink=probe.sink, window=probe.window)
    return verifier.new_cache(strategy, restoration=RestorationSetup(plan))


def recall(verifier: Any, plan: RestorationPlan | None, probe: Probe, desc: str = "recall") -> float:
    """Fraction of the probe's needles recalled by greedy decoding under `plan` (None: `full`)."""
    decoder = Decoder(verifier, prefill_chunk_tokens=512)
    hits = 0
    for doc in tqdm(probe.documents, desc=desc, unit="doc", file=sys.stderr, leave=False):
        seq = SequenceState(cache=_cache(verifier, plan, probe), tokens=list(doc.prompt))
        budget = GenerationBudget(max_new_tokens=probe.max_tokens)
        generated: list[int] = []
        while len(generated) < probe.max_tokens:
            generated += decoder.step(seq, SamplingParams(), budget, len(generated)).tokens
        seq.cache.release()
        hits += doc.value in probe.decode(generated)
    return hits / len(probe.documents)


def logit_divergence(verifier: Any, plan: RestorationPlan, probe: Probe, chunk: int = 64) -> float:
    """Mean KL(full || plan) of the next-token distributions at the positions past sink + window."""
    divergences = []
    for tokens in probe.texts:
        rows = {}
        for name, chosen in (("full", None), ("plan", plan)):
            cache = _cache(verifier, chosen, probe)
            parts = []
            for start in range(0, len(tokens), chunk):
                block = tokens[start : start + chunk]
                parts.append(verifier.host_logits(verifier.verify(cache, block, len(block)).logits))
                verifier.commit(cache, len(block))
            cache.release()
            rows[name] = np.concatenate(parts)[probe.sink + probe.window :]
        divergences.append(_kl(rows["full"], rows["plan"]))
    return float(np.mean(divergences))


def _kl(reference: np.ndarray, other: np.ndarray) -> float:
    def log_softmax(x: np.ndarray) -> np.ndarray:
        shifted = x - x.max(axis=-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))

    p_log, q_log = log_softmax(reference), log_softmax(other)
    return float(np.mean(np.sum(np.exp(p_log) * (p_log - q_log), axis=-1)))


DRAFTER_ROWS = -1  # the key of the drafter context rows among the per-layer K/V rows
POSITIONS = -2  # the key of the rows' positions in their texts


def add_key_frame_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--key-frame",
        choices=("unrotated", "stored"),
        default="stored",
        help="the frame f_θ maps keys in: stored (as the cache holds them, turned by their positions; default) or "
        "unrotated (turned back from their positions before the map and turned to them after it, where the verifier "
        "has rotary position embeddings: far lower K error, but no better recall or KL on the default model)",
    )


def key_frame_rotary(args: argparse.Namespace, verifier: Any) -> Rotary | None:
    """The rotary f_θ turns keys by under `--key-frame` (None: keys as stored)."""
    return verifier_rotary(verifier) if args.key_frame == "unrotated" else None


def least_squares_method(ridge: float, rotary: Rotary | None) -> str:
    """How a plan's f_θ was fitted, for its notes."""
    return f"closed-form ridge least squares, ridge {ridge}, keys {'unrotated' if rotary else 'as stored'}"


def verifier_rotary(verifier: Any) -> Rotary | None:
    """The rotary position embedding a torch verifier turns its keys by, when it has one over whole heads (None
    otherwise: f_θ then maps keys as stored)."""
    model = verifier.model
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if inv_freq is None or 2 * int(inv_freq.numel()) != head_dim:
        return None
    return Rotary(inv_freq.float().cpu().numpy(), float(getattr(rotary, "attention_scaling", 1.0)))


def kv_rows_by_layer(
    verifier: Any, texts: Sequence[list[int]], layers: Sequence[int], drafter: DrafterContext | None = None
) -> dict[int, np.ndarray]:
    """Full-attention K/V of every position of `texts` as feature rows `[N, 2 * H * D]`, per layer, and each
    row's position in its text `[N]` under `POSITIONS`; with `drafter`, also its context rows `[N, H]` of the same
    positions under `DRAFTER_ROWS`."""
    collected: dict[int, list[np.ndarray]] = {layer: [] for layer in layers}
    collected[POSITIONS] = [np.arange(len(tokens), dtype=np.int64) for tokens in texts]
    if drafter is not None:
        collected[DRAFTER_ROWS] = []
    ops = verifier.array_ops
    for tokens in tqdm(texts, desc="collect K/V", unit="text", file=sys.stderr, leave=False):
        cache = verifier.new_cache(FullStrategy())
        feature_layers = () if drafter is None else drafter.target_layer_ids
        out = verifier.verify(cache, tokens, 1, feature_layers=feature_layers)
        if drafter is not None:
            collected[DRAFTER_ROWS].append(drafter.apply(ops.to_host(out.features)))
        verifier.commit(cache, len(tokens))
        for layer in layers:
            keys, values, _ = cache.resident_kv(layer)
            collected[layer].append(kv_rows(ops.to_host(keys), ops.to_host(values)))
        cache.release()
    return {layer: np.concatenate(rows) for layer, rows in collected.items()}


def position_bytes(verifier: Any, dtype_bytes: int = 2) -> int:
    """Bytes of one position's K/V in one layer at `dtype_bytes` per value (bf16: 2), from a probe forward."""
    cache = verifier.new_cache(FullStrategy())
    verifier.verify(cache, [0], 1)
    verifier.commit(cache, 1)
    keys, _, _ = cache.resident_kv(0)
    shape = keys.shape  # [1, H, 1, D]
    cache.release()
    return 2 * int(shape[1]) * int(shape[3]) * dtype_bytes


def fit_projections(
    plan: RestorationPlan,
    rows: dict[int, np.ndarray],
    *,
    ridge: float,
    holdout: float = 0.1,
    rotary: Rotary | None = None,
) -> tuple[RestorationPlan, dict[str, float]]:
    """Fit a linear f_θ (closed-form ridge least squares; with `rotary`, in the keys' unrotated frame) for every
    `projected` layer of `plan` from K/V rows of every layer (and their `POSITIONS`); returns the plan with them and
    each map's relative error on the held-out tail of the rows, measured on the K/V as stored."""
    projections, errors = {}, {}
    positions = rows[POSITIONS]
    for index, source in enumerate(plan.layers):
        if source.from_layer is None and not source.from_drafter:
            continue
        x = rows[DRAFTER_ROWS if source.from_drafter else source.from_layer]  # type: ignore[index]
        y = rows[index]
        cut = int(len(x) * (1 - holdout))
        fit = partial(LinearProjection.fit, ridge=ridge, rotary=rotary, reads_keys=not source.from_drafter)
        trial = fit(x[:cut], y[:cut], positions=positions[:cut])
        residual = trial.apply(x[cut:], positions[cut:]) - y[cut:]
        spread = y[cut:] - y[cut:].mean(axis=0)
        name = "drafter" if source.from_drafter else f"L{source.from_layer}"
        errors[f"{name}->L{index}"] = float(np.sum(residual**2) / max(np.sum(spread**2), 1e-12))
        projections[index] = fit(x, y, positions=positions)
    return plan.with_projections(projections), errors


def token_only_layers(verifier: Any, tokens: Sequence[int], *, start: int, tolerance: float = 1e-4) -> list[int]:
    """Layers whose K/V of `tokens[start:]` are the same when computed from those tokens alone (at their positions)
    as with the whole sequence before them: the layers a `tokens` source rebuilds exactly."""
    ops = verifier.array_ops
    full = verifier.new_cache(FullStrategy())
    verifier.verify(full, list(tokens), 1)
    verifier.commit(full, len(tokens))
    alone = forward_kv(
        verifier.forward_layers,
        ops,
        verifier.num_layers,
        list(tokens[start:]),
        start=start,
        last_layer=verifier.num_layers - 1,
    )
    found = []
    for layer in range(verifier.num_layers):
        keys, values, _ = full.resident_kv(layer)
        reference = kv_rows(ops.to_host(keys), ops.to_host(values))[start:]
        rebuilt = kv_rows(ops.to_host(alone[layer][0]), ops.to_host(alone[layer][1]))
        if np.abs(rebuilt - reference).max() <= tolerance * max(np.abs(reference).max(), 1e-6):
            found.append(layer)
    full.release()
    return found
