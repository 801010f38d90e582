"""Generation controls through the running server, on both backends: grammar-constrained output is valid and the
same with every proposer, log-probabilities match a plain forward, penalties match a direct computation, stop
sequences end the generation, and bad controls are INVALID_ARGUMENT."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from inference_engine.generated import runtime_pb2 as pb
from tests.support.backends import BACKENDS
from tests.support.checkpoints import VOCAB_SIZE
from tests.support.server import create, generate, info
from tests.support.tokenizers import EOS_TOKEN_ID, save_test_tokenizer

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{2}"


def _prompts(count: int = 4) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(1, VOCAB_SIZE) for _ in range(n)] for n in (6, 13, 21, 9)][:count]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding only the test tokenizer: the server compiles grammars against it."""
    return save_test_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def _text(tokenizer: Tokenizer, tokens: list[int]) -> str:
    assert tokens and tokens[-1] == EOS_TOKEN_ID, "a completed grammar ends with the end-of-sequence token"
    return tokenizer.decode(tokens[:-1], skip_special_tokens=False)


def _valid_for_schema(document: object) -> bool:
    if not isinstance(document, dict) or set(document) != {"name", "age", "ok", "tags"}:
        return False
    name, age, ok, tags = document["name"], document["age"], document["ok"], document["tags"]
    return (
        isinstance(name, str)
        and len(name) <= 6
        and isinstance(age, int)
        and not isinstance(age, bool)
        and 0 <= age <= 120
        and isinstance(ok, bool)
        and isinstance(tags, list)
        and len(tags) <= 2
        and all(t in ("a", "b") for t in tags)
    )


def _schema() -> pb.GrammarConstraint:
    return pb.GrammarConstraint(json_schema=json.dumps(SCHEMA))


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_schema_constrained_greedy_output_is_valid_on_every_prompt(serve, tokenizer_dir, tokenizer, backend):
    server = serve("qwen3", model=str(tokenizer_dir))
    for prompt in _prompts():
        result = generate(server.stub, create(server.stub, initial=prompt), max_tokens=96, grammar=_schema())
        assert result.done.stop_reason == pb.STOP_REASON_EOS
        assert _valid_for_schema(json.loads(_text(tokenizer, result.tokens)))
    # One compilation served every generation: the compiled grammar is cached per model and grammar.
    assert server.runtime.grammars.compiler().compiled_count == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_lark_and_gbnf_constrained_outputs_match_their_grammar(serve, tokenizer_dir, tokenizer, backend):
    server = serve("llama", model=str(tokenizer_dir))
    grammars = {
        REGEX: pb.GrammarConstraint(regex=REGEX),
        r"(yes|no) [0-9]": pb.GrammarConstraint(lark='start: ("yes" | "no") " " /[0-9]/'),
        r"(on|off)[0-9]?": pb.GrammarConstraint(gbnf='root ::= ("on" | "off") [0-9]?'),
    }
    for pattern, grammar in grammars.items():
        for prompt in _prompts(3):
            result = generate(server.stub, create(server.stub, initial=prompt), max_tokens=40, grammar=grammar)
            assert result.done.stop_reason == pb.STOP_REASON_EOS
            assert re.fullmatch(pattern, _text(tokenizer, result.tokens)), (pattern, result.tokens)


@pytest.fixture(scope="module")
def proposers(checkpoints, tmp_path_factory):
    from tests.support.checkpoints import save_dflash_drafter

    root = tmp_path_factory.mktemp("control_proposers")
    return {
        "ngram": {"proposer": "ngram", "num_draft_tokens": 5, "ngram_max_n": 3},
        "draft_model_self": {"proposer": "draft_model", "draft_model": str(checkpoints["qwen3"])},
        # full: every step drafts (the cost policy, dflash's auto, may decline the random drafter's drafts)
        "dflash": {
            "proposer": "dflash",
            "draft_model": str(save_dflash_drafter(root / "dflash")),
            "draft_policy": "full",
        },
    }


GREEDY: dict[str, object] = {}
SAMPLED = {"temperature": 0.9, "seed": 5, "min_p": 0.02}
PENALISED = {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.2, "penalty_window_tokens": 12}
SPECULATION_CASES = [
    *[("torch", p, "greedy") for p in ("ngram", "draft_model_self", "dflash")],
    *[("torch", p, "sampled") for p in ("draft_model_self", "dflash")],
    *[("mlx", p, "greedy") for p in ("ngram", "dflash")],
    ("mlx", "draft_model_self", "sampled"),
]


@pytest.mark.parametrize(("backend", "proposer", "mode"), SPECULATION_CASES)
def test_constrained_output_with_each_proposer_equals_constrained_output_without_speculation(
    serve, tokenizer_dir, proposers, backend, proposer, mode
):
    plain = serve("qwen3", model=str(tokenizer_dir))
    speculative = serve("qwen3", model=str(tokenizer_dir), **proposers[proposer])
    sampling = {**(SAMPLED if mode == "sampled" else GREEDY), **PENALISED}
    drafted = 0
    for prompt in _prompts(3):
        for grammar in (_schema(), None):
            kwargs = {"max_tokens": 40, "logprobs": True, "top_logprobs": 3, **sampling}
            if grammar is not None:
                kwargs["grammar"] = grammar
            expected = generate(plain.stub, create(plain.stub, initial=prompt), **kwargs)
            result = generate(speculative.stub, create(speculative.stub, initial=prompt), **kwargs)
            assert result.tokens == expected.tokens
            assert result.done.stop_reason == expected.done.stop_reason
            for got, want in zip(result.scored, expected.scored, strict=True):
                assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
                assert [a.token_id for a in got.top_logprobs] == [a.token_id for a in want.top_logprobs]
            drafted += result.done.draft_token_count
    assert drafted > 0


def _reference_logits(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
    return logits.double().numpy()


def _log_softmax(row: np.ndarray) -> np.ndarray:
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_equal_those_of_a_plain_forward_of_the_same_model(serve, reference_models, backend):
    server = serve("gemma3")
    prompt = _prompts(1)[0]
    result = generate(server.stub, create(server.stub, initial=prompt), max_tokens=8, logprobs=True, top_logprobs=5)
    assert len(result.scored) == len(result.tokens) == 8
    history = list(prompt)
    for scored in result.scored:
        expected = _log_softmax(_reference_logits(reference_models["gemma3"], history))
        assert scored.logprob == pytest.approx(expected[scored.token_id], abs=1e-4)
        best = np.argsort(-expected, kind="stable")[:5]
        assert [a.token_id for a in scored.top_logprobs] == best.tolist()
        assert [a.logprob for a in scored.top_logprobs] == pytest.approx(expected[best].tolist(), abs=1e-4)
        history.append(scored.token_id)


def test_sampled_logprobs_are_those_of_the_tempered_top_k_distribution(serve, reference_models):
    server = serve("qwen3")
    prompt = _prompts(1)[0]
    sampling = {"temperature": 0.7, "top_k": 4, "seed": 3}
    result = generate(server.stub, create(server.stub, initial=prompt), max_tokens=6, logprobs=True, **sampling)
    history = list(prompt)
    for scored in result.scored:
        scaled = _reference_logits(reference_models["qwen3"], history) / 0.7
        kept = np.argsort(-scaled, kind="stable")[:4]
        assert scored.token_id in kept
        expected = _log_softmax(scaled[kept])[list(kept).index(scored.token_id)]
        assert scored.logprob == pytest.approx(expected, abs=1e-4)
        history.append(scored.token_id)


def _penalised(row: np.ndarray, history: list[int], window: int, rep: float, pres: float, freq: float) -> np.ndarray:
    out = row.copy()
    recent = history[-window:]
    for token in set(recent):
        count = recent.count(token)
        value = out[token]
        value = value / rep if value > 0 else value * rep
        out[token] = value - freq * count - pres
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_penalised_greedy_tokens_match_a_direct_reference_computation(serve, reference_models, backend):
    server = serve("llama")
    prompt = [5, 9, 5, 9, 5, 9, 7]
    penalties = {"repetition_penalty": 1.8, "presence_penalty": 0.7, "frequency_penalty": 0.3}
    window = 6
    sid = create(server.stub, initial=prompt)
    result = generate(server.stub, sid, max_tokens=12, penalty_window_tokens=window, **penalties)
    history, expected = list(prompt), []
    for _ in range(12):
        row = _penalised(_reference_logits(reference_models["llama"], history), history, window, 1.8, 0.7, 0.3)
        expected.append(int(row.argmax()))
        history.append(expected[-1])
    assert result.tokens == expected
    unpenalised = generate(server.stub, create(server.stub, initial=prompt), max_tokens=12)
    assert unpenalised.tokens != expected, "the penalties must change this output, or the test proves nothing"


@pytest.mark.parametrize("backend", BACKENDS)
def test_stop_sequences_end_the_generation_after_their_first_match_across_block_boundaries(serve, checkpoints, backend):
    # The verifier drafting for itself gets whole blocks accepted, so the windows below start and end at every
    # offset of a block: some lie inside one step's tokens, others span two steps.
    server = serve("qwen3", proposer="draft_model", draft_model=str(checkpoints["qwen3"]))
    prompt = _prompts(1)[0]
    free = generate(server.stub, create(server.stub, initial=prompt), max_tokens=24).tokens
    absent = min(set(range(VOCAB_SIZE)) - set(free))
    spanning = 0
    for start in range(12):
        stop = free[start : start + 3]
        first_end = next(i + 3 for i in range(len(free) - 2) if free[i : i + 3] == stop)
        sequences = [pb.StopSequence(token_ids=[absent] * 2), pb.StopSequence(token_ids=stop)]
        result = generate(server.stub, create(server.stub, initial=prompt), max_tokens=24, stop_sequences=sequences)
        assert result.tokens == free[:first_end]
        assert result.done.stop_reason == pb.STOP_REASON_STOP_SEQUENCE
        assert result.done.HasField("stop_sequence_index") and result.done.stop_sequence_index == 1
        spanning += result.done.verifier_forward_count > 1
    assert spanning, "some stop sequence must have been completed in a later step than the one it began in"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grammar_the_tokenizer_cannot_spell_stops_at_a_dead_end(serve, tokenizer_dir, backend):
    server = serve("qwen3", model=str(tokenizer_dir))
    sid = create(server.stub, initial=_prompts(1)[0])
    result = generate(server.stub, sid, max_tokens=10, grammar=pb.GrammarConstraint(regex="ab\u00e9"))
    assert result.done.stop_reason == pb.STOP_REASON_GRAMMAR_DEAD_END
    assert result.tokens == [ord("a") - 33 + 3, ord("b") - 33 + 3]  # byte-level ids of 'a' and 'b'
    again = generate(server.stub, sid, max_tokens=3)
    assert len(again.tokens) == 3, "the session goes on after a dead end"


BAD_CONTROLS = [
    ({"grammar": pb.GrammarConstraint(json_schema='{"type": 3}')}, "does not compile"),
    ({"grammar": pb.GrammarConstraint(json_schema="not json")}, "not JSON"),
    ({"grammar": pb.GrammarConstraint(regex="(")}, "does not compile"),
    ({"grammar": pb.GrammarConstraint(lark="start: nowhere")}, "does not compile"),
    ({"grammar": pb.GrammarConstraint()}, "one of json_schema"),
    ({"stop_sequences": [pb.StopSequence(token_ids=[1, VOCAB_SIZE])]}, "outside the vocabulary"),
    ({"stop_sequences": [pb.StopSequence()]}, "stop_sequences[0]"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in 0..20"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"penalty_window_tokens": 0}, "penalty_window_tokens"),
    ({"min_p": 1.5}, "min_p"),
]


@pytest.mark.parametrize(("controls", "reason"), BAD_CONTROLS, ids=[r for _, r in BAD_CONTROLS])
def test_bad_controls_are_invalid_argument_with_the_reason_and_leave_the_session_intact(
    serve, tokenizer_dir, controls, reason
):
    server = serve("qwen3", model=str(tokenizer_dir))
    sid = create(server.stub, initial=[3, 4, 5])
    with pytest.raises(grpc.RpcError) as caught:
        generate(server.stub, sid, max_tokens=4, **controls)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in caught.value.details()
    assert info(server.stub, sid).history_length == 3
    assert len(generate(server.stub, sid, max_tokens=2).tokens) == 2


def test_a_grammar_on_a_model_whose_tokenizer_does_not_fit_is_invalid_argument(serve):
    server = serve("qwen3")  # serves the test checkpoint with the bundled model's 4096-token tokenizer
    sid = create(server.stub, initial=[3, 4, 5])
    with pytest.raises(grpc.RpcError) as caught:
        generate(server.stub, sid, max_tokens=4, grammar=pb.GrammarConstraint(regex="a+"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokenizer" in caught.value.details()


def test_converse_streams_scored_tokens_and_applies_the_grammar(serve, tokenizer_dir, tokenizer):
    server = serve("qwen3", model=str(tokenizer_dir))
    sid = create(server.stub, initial=_prompts(1)[0])
    command = pb.GenerateCommand(max_tokens=30, grammar=pb.GrammarConstraint(regex=REGEX), logprobs=True)
    replies = list(
        server.stub.Converse(
            iter(
                [
                    pb.ConverseRequest(command_id=1, bind=pb.BindCommand(session_id=sid)),
                    pb.ConverseRequest(command_id=2, generate=command),
                ]
            )
        )
    )
    scored = [r.scored_token for r in replies if r.WhichOneof("event") == "scored_token"]
    assert scored and all(r.WhichOneof("event") != "token_id" for r in replies)
    assert all(s.logprob <= 0.0 for s in scored)
    assert re.fullmatch(REGEX, _text(tokenizer, [s.token_id for s in scored]))
    assert replies[-1].done.stop_reason == pb.STOP_REASON_EOS
