"""Training data of the kakeya-tiny family: a byte-level BPE tokenizer built from the corpus, token streams for
language modelling, and needle-in-a-haystack documents for long-context retrieval."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lib.corpus import read_text
from lib.niah import build_document

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(files: list[Path], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (digits split one per token, so numbers copy digit by digit) with chat and mask specials."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((read_text(p) for p in files), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@dataclass
class EncodedCorpus:
    """A corpus as one token stream (files separated by <|endoftext|>) and as per-line token lists."""

    stream: np.ndarray
    lines: list[list[int]]


def encode_corpus(tokenizer: PreTrainedTokenizerFast, files: list[Path]) -> EncodedCorpus:
    texts = [read_text(p) for p in files]
    backend = tokenizer.backend_tokenizer
    separator = int(tokenizer.convert_tokens_to_ids("<|endoftext|>"))  # type: ignore[arg-type]
    stream: list[int] = []
    for encoding in backend.encode_batch(texts):
        stream += [*encoding.ids, separator]
    lines = [e.ids for e in backend.encode_batch([line for text in texts for line in text.splitlines(True)]) if e.ids]
    return EncodedCorpus(np.asarray(stream, dtype=np.int32), lines)


class BatchSampler:
    """Batches of one sequence length: plain corpus windows and needle documents, with per-token loss weights
    (needle answers weigh `answer_weight`)."""

    def __init__(
        self,
        corpus: EncodedCorpus,
        tokenizer: PreTrainedTokenizerFast,
        *,
        niah_fraction: float,
        answer_weight: float,
        seed: int,
    ) -> None:
        self.corpus = corpus
        self.encode = lambda text: tokenizer.backend_tokenizer.encode(text).ids
        self.niah_fraction = niah_fraction
        self.answer_weight = answer_weight
        self.rng = random.Random(seed)

    def state(self) -> object:
        return self.rng.getstate()

    def restore(self, state: object) -> None:
        self.rng.setstate(state)  # type: ignore[arg-type]

    def batch(self, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B, T+1], loss weights [B, T]) where weights[t] applies to predicting tokens[t+1]."""
        rows, weights = [], []
        for _ in range(batch_size):
            if self.rng.random() < self.niah_fraction:
                row, weight = self._needle_row(seq_len + 1)
            else:
                start = self.rng.randrange(len(self.corpus.stream) - seq_len - 1)
                row = self.corpus.stream[start : start + seq_len + 1].tolist()
                weight = [1.0] * seq_len
            rows.append(row)
            weights.append(weight)
        return torch.tensor(rows, dtype=torch.long), torch.tensor(weights)

    def _needle_row(self, length: int) -> tuple[list[int], list[float]]:
        count = self.rng.randint(1, 4)
        depths = [self.rng.random() for _ in range(count)]
        doc = build_document(self.corpus.lines, self.encode, length, depths, self.rng)
        row = (doc.prompt + doc.answer)[:length]
        row += [0] * (length - len(row))
        weight = [1.0] * (length - 1)
        for start, end in doc.answer_spans:
            # weight[t] scores the prediction of token t + 1
            for t in range(start - 1, min(end - 1, length - 1)):
                weight[t] = self.answer_weight
        return row, weight


def windows(stream: np.ndarray, seq_len: int, count: int) -> Iterator[torch.Tensor]:
    """`count` evenly spaced windows of `seq_len + 1` tokens (held-out evaluation)."""
    starts = np.linspace(0, len(stream) - seq_len - 2, count).astype(int)
    for start in starts:
        yield torch.from_numpy(stream[start : start + seq_len + 1].astype(np.int64))
