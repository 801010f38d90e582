"""The shim's text codec: incremental decoding equals decoding in one piece, stop strings cut the text at their first
occurrence, and a model without a tokenizer or chat template is refused with a clear error."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from inference_engine.config import BUNDLED_MODEL_DIR
from inference_engine.errors import InvalidArgument
from inference_engine.transport.text_codec import StopStrings, TextCodec, TextDecoder, TokenizerUnavailable

TINY = TextCodec.load(BUNDLED_MODEL_DIR)
TINY_TOKENIZER = TINY._tokenizer
assert TINY_TOKENIZER is not None
EOS = TINY_TOKENIZER.convert_tokens_to_ids("<|im_end|>")
END_OF_TEXT = TINY_TOKENIZER.convert_tokens_to_ids("<|endoftext|>")


def _run(decoder: TextDecoder, tokens: list[int]) -> tuple[str, list[str]]:
    pieces = [decoder.push(t) for t in tokens] + [decoder.finish()]
    return "".join(pieces), [p for p in pieces if p]


def _reference(tokens: list[int]) -> str:
    assert TINY_TOKENIZER is not None
    return TINY_TOKENIZER.decode([t for t in tokens if t not in (EOS, END_OF_TEXT)], skip_special_tokens=True)


def test_the_bundled_model_has_a_chat_template_and_its_end_of_turn_token_ends_generations():
    assert TINY.has_chat_template and TINY.missing_reason == ""
    assert TINY.eos_token_ids == tuple(sorted((EOS, END_OF_TEXT)))
    rendered = TINY.render_chat([{"role": "user", "content": "hi"}])
    assert TINY_TOKENIZER is not None
    assert TINY_TOKENIZER.decode(rendered) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(TINY_TOKENIZER) - 1), max_size=40))
def test_incremental_decoding_equals_decoding_all_tokens_at_once(tokens):
    text, _ = _run(TINY.decoder(), tokens)
    assert text == _reference(tokens)


def test_a_character_split_across_tokens_is_released_only_when_complete():
    message = "héllo wörld 日本語 🎉 done"
    tokens = TINY.encode_prompt(message)
    # byte-level: some multi-byte characters span several tokens, which decode alone to replacement characters
    assert any("\ufffd" in TINY_TOKENIZER.decode([t]) for t in tokens)
    text, pieces = _run(TINY.decoder(), tokens)
    assert text == message
    assert all("\ufffd" not in piece for piece in pieces)


def test_pieces_that_depend_on_their_neighbours_decode_as_in_one_piece(tmp_path):
    # a sentencepiece-style tokenizer: decoded alone, "▁world" loses its leading space
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    corpus = ["hello world how are you today", "the world is wide and the sky is blue"] * 20
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path)
    codec = TextCodec.load(tmp_path)
    tokens = codec.encode_prompt("hello world how are you")
    assert codec._tokenizer is not None and codec._tokenizer.decode(tokens[1:2]) == "world"
    text, pieces = _run(codec.decoder(), tokens)
    assert text == "hello world how are you" and len(pieces) == len(tokens)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=32, max_value=126), min_size=1, max_size=40),
    st.integers(min_value=0, max_value=39),
    st.integers(min_value=1, max_value=4),
)
def test_the_text_ends_before_the_first_stop_string_and_nothing_after_it_leaks(data, start, length):
    message = bytes(data).decode()
    tokens = TINY.encode_prompt(message)
    stop = message[start : start + length] or "\x00"
    decoder = TINY.decoder([stop, "\x01never"])
    text, _ = _run(decoder, tokens)
    expected = message[: message.find(stop)] if stop in message else message
    assert text == expected == decoder.text
    assert decoder.stopped == (stop in message)


def test_the_stop_is_found_at_the_token_that_completes_it_and_later_tokens_are_ignored():
    decoder = TINY.decoder(["lo w"])
    tokens = TINY.encode_prompt("hello world")
    released = []
    for token in tokens:
        released.append(decoder.push(token))
        if decoder.stopped:
            break
    assert "".join(released) == "hel"
    completed = len(released)
    assert "lo w" in TINY_TOKENIZER.decode(tokens[:completed]) and "lo w" not in TINY_TOKENIZER.decode(
        tokens[: completed - 1]
    )
    assert decoder.push(TINY.encode_prompt("x")[0]) == "" and decoder.finish() == ""


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot():
    stops = StopStrings(("abc", "xyz"))
    assert stops.safe_length("hello ab") == len("hello ")
    assert stops.safe_length("hello a") == len("hello ")
    assert stops.safe_length("hello x") == len("hello ")
    assert stops.safe_length("hello abd") == len("hello abd")
    assert stops.find("ab xyz abc", 0) == 3
    assert StopStrings(()).safe_length("abc") == 3


def test_the_end_of_sequence_token_is_not_decoded():
    decoder = TINY.decoder()
    tokens = [*TINY.encode_prompt("ok"), EOS]
    assert _run(decoder, tokens)[0] == "ok"


def test_a_directory_without_tokenizer_files_has_no_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    codec = TextCodec.load(tmp_path)
    assert "holds no tokenizer" in codec.missing_reason
    for call in (
        lambda: codec.render_chat([{"role": "user", "content": "x"}]),
        lambda: codec.encode_prompt("x"),
        codec.decoder,
    ):
        with pytest.raises(TokenizerUnavailable, match="needs the model's tokenizer"):
            call()


def test_without_a_chat_template_chat_is_refused_but_prompts_still_encode(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL_DIR, model)
    (model / "chat_template.jinja").unlink()
    codec = TextCodec.load(model)
    assert not codec.has_chat_template
    with pytest.raises(TokenizerUnavailable, match="no chat template"):
        codec.render_chat([{"role": "user", "content": "x"}])
    assert codec.encode_prompt("ab") == TINY.encode_prompt("ab")


def test_a_template_that_rejects_the_messages_is_an_invalid_argument(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL_DIR, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    codec = TextCodec.load(model)
    with pytest.raises(InvalidArgument, match="no system role"):
        codec.render_chat([{"role": "system", "content": "x"}])


def test_end_of_sequence_ids_come_from_the_tokenizer_and_the_generation_config(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL_DIR, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [256, 258]}))
    assert TextCodec.load(model).eos_token_ids == tuple(sorted({EOS, 256, 258}))
