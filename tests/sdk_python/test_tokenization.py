"""kakeya.tokenization on real Hugging Face tokenizers built from the bundled model's files."""

from __future__ import annotations

from pathlib import Path

import kakeya
import pytest
from kakeya.tokenization import (
    AppendOnlyChat,
    TemplateError,
    from_openai_messages,
    load_tokenizer,
    openai_to_template_messages,
    render_chat_text,
    tokens_for_chat,
)
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "inference_engine" / "models" / "kakeya-tiny"
QWEN3_STYLE = ROOT / "sdks" / "python" / "examples" / "qwen3_style_chat_template.jinja"


@pytest.fixture(scope="module")
def chatml():
    return load_tokenizer(BUNDLED)


@pytest.fixture(scope="module")
def qwen3_style():
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(BUNDLED / "tokenizer.json"), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = QWEN3_STYLE.read_text()
    return tokenizer


def _reply(tokenizer, text: str) -> list[int]:
    """Tokens a model would generate for a reply: the text, then its end-of-turn token."""
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_tokens_for_chat_is_the_templates_rendering_with_a_generation_prompt(chatml):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tokens_for_chat(messages, chatml)
    assert ids == chatml.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert chatml.decode(ids).endswith("<|im_start|>assistant\n")
    assert not chatml.decode(tokens_for_chat(messages, chatml, add_generation_prompt=False)).endswith("assistant\n")


def test_openai_messages_become_template_messages(chatml):
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    converted = openai_to_template_messages(messages)
    assert [m["role"] for m in converted] == ["system", "user", "assistant", "tool"]
    assert converted[1] == {"role": "user", "content": "ab", "name": "ann"}
    assert converted[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert converted[3]["tool_call_id"] == "c1"
    ids = from_openai_messages(messages[:2], chatml)
    assert chatml.decode(ids) == render_chat_text(converted[:2], chatml)


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "function", "content": "legacy"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]},
        {"role": "user", "content": 5},
    ],
)
def test_openai_messages_the_helpers_cannot_render_are_invalid(message):
    with pytest.raises(kakeya.InvalidArgument):
        openai_to_template_messages([message])


def test_append_only_deltas_equal_a_full_rendering_when_the_template_is_stable(chatml):
    chat = AppendOnlyChat(chatml)
    conversation = [{"role": "user", "content": "first question"}]
    chat.add_messages(conversation)
    for reply, question in (("answer one", "second"), ("answer two", "third")):
        chat.add_generated(_reply(chatml, reply))
        conversation += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
        chat.add_messages(conversation[-1:])
    assert chat.tokens == tokens_for_chat(conversation, chatml)


def test_a_reply_cut_before_its_end_of_turn_is_closed_by_the_next_delta(chatml):
    chat = AppendOnlyChat(chatml)
    chat.add_messages([{"role": "user", "content": "q"}])
    chat.add_generated(chatml.encode("partial", add_special_tokens=False))  # max_tokens hit: no <|im_end|>
    delta = chat.add_messages([{"role": "user", "content": "go on"}])
    assert chatml.decode(delta).startswith("<|im_end|>\n<|im_start|>user\ngo on")


def test_re_rendering_a_qwen3_style_history_is_not_an_extension_but_the_deltas_are(qwen3_style):
    settings = {"enable_thinking": False}
    conversation = [{"role": "user", "content": "first"}]
    first_prompt = tokens_for_chat(conversation, qwen3_style, **settings)
    reply = _reply(qwen3_style, "answer")
    held = first_prompt + reply  # what the session holds after the first turn
    conversation += [{"role": "assistant", "content": "answer"}, {"role": "user", "content": "second"}]
    rerendered = tokens_for_chat(conversation, qwen3_style, **settings)
    assert rerendered[: len(held)] != held, "the earlier turn's empty think block vanished on re-rendering"

    chat = AppendOnlyChat(qwen3_style, **settings)
    assert chat.add_messages(conversation[:1]) == first_prompt
    chat.add_generated(reply)
    delta = chat.add_messages(conversation[-1:])
    assert chat.tokens == held + delta
    assert (
        qwen3_style.decode(delta)
        == "\n<|im_start|>user\nsecond<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_the_chat_helper_refuses_calls_out_of_order_and_templates_it_cannot_split(chatml):
    chat = AppendOnlyChat(chatml)
    with pytest.raises(kakeya.InvalidArgument):
        chat.add_generated([1])
    with pytest.raises(kakeya.InvalidArgument):
        chat.add_messages([])
    chat.add_messages([{"role": "user", "content": "q"}])
    with pytest.raises(kakeya.InvalidArgument):
        chat.add_messages([{"role": "user", "content": "again"}])
    mangling = PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED / "tokenizer.json"))
    mangling.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(TemplateError):
        AppendOnlyChat(mangling)
