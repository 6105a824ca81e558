"""Reasoning models' thinking split from their answers, whole and as it streams in any pieces."""

from __future__ import annotations

import random

import pytest

from common.pb import generate_pb2 as pb
from gateway.errors import BadRequest
from gateway.reasoning import Reasoning, ReasoningStream

R1, QWEN3, MISTRAL = Reasoning("deepseek_r1"), Reasoning("qwen3"), Reasoning("mistral")
KIMI = Reasoning("kimi_k2")
SECTION = "<|tool_calls_section_begin|>"
CASES = [
    (R1, "<think>Let me see.</think>It is 4.", ("Let me see.", "It is 4.")),
    (R1, "Let me see.</think>It is 4.", ("Let me see.", "It is 4.")),  # the prompt opened the thinking
    (R1, "<think>Still thinking", ("Still thinking", None)),  # cut short: all thinking
    (R1, "<think>Done.</think>", ("Done.", None)),
    (QWEN3, "<think>Hmm.</think>\n\nIt is 4.", ("Hmm.", "\n\nIt is 4.")),
    (Reasoning("qwen3", thinking=False), "It is 4.", (None, "It is 4.")),  # enable_thinking false: all answer
    (QWEN3, "<think></think>It is 4.", (None, "It is 4.")),
    (QWEN3, "Hmm.</think>It is 4.", ("Hmm.", "It is 4.")),  # Qwen3.5's template opened the thinking
    (QWEN3, "<think>Still thinking", ("Still thinking", None)),  # cut short: all thinking, as vLLM reads it
    (QWEN3, "Plan.<tool_call>\n<function=f>\n</function>", ("Plan.", "<tool_call>\n<function=f>\n</function>")),
    (QWEN3, "Say <tool_call> then.</think>Ok", ("Say <tool_call> then.", "Ok")),  # a mention ends nothing
    (Reasoning("glm45"), "<think>Hmm.</think>It is 4.", ("Hmm.", "It is 4.")),
    (Reasoning("glm45"), "It is 4.", (None, "It is 4.")),  # enable_thinking false
    (Reasoning("glm45"), "a</think>b", (None, "a</think>b")),  # it did not open its thinking: all answer
    (Reasoning("glm45"), "<think>abc", ("abc", None)),
    (Reasoning("glm45"), "<thinking aloud> is no tag", (None, "<thinking aloud> is no tag")),
    (MISTRAL, "[THINK]Hmm.[/THINK]It is 4.", ("Hmm.", "It is 4.")),  # Magistral's tags
    (MISTRAL, "It is 4.", (None, "It is 4.")),
    (MISTRAL, "<think>x</think>y", (None, "<think>x</think>y")),  # another family's tags are text
    (KIMI, "Hmm.</think>It is 4.", ("Hmm.", "It is 4.")),
    (KIMI, f"Need the clock.{SECTION}<|tool_call_begin|>", ("Need the clock.", f"{SECTION}<|tool_call_begin|>")),
    (KIMI, f"<think>A</think>B{SECTION}", ("A", f"B{SECTION}")),
    (KIMI, "Still thinking", ("Still thinking", None)),
    (Reasoning("deepseek_v3", thinking=False), "It is 4.</think>", (None, "It is 4.</think>")),
]


@pytest.mark.parametrize(("parser", "text", "expected"), CASES)
def test_split(parser: Reasoning, text: str, expected: tuple[str | None, str | None]) -> None:
    assert parser.split(text) == expected


@pytest.mark.parametrize(("parser", "text", "expected"), [c for c in CASES if not c[1].startswith("Let")])
def test_streamed_in_any_pieces_as_split_whole(
    parser: Reasoning, text: str, expected: tuple[str | None, str | None]
) -> None:
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = ReasoningStream(parser)
        thought = answer = ""
        for i, piece in enumerate(pieces):
            more_thought, more_answer = stream.feed(piece, final=i == len(pieces) - 1)
            thought, answer = thought + more_thought, answer + more_answer
        assert (thought or None, answer or None) == expected, pieces


def test_an_r1_stream_without_its_opening_tag_is_thinking_until_the_end_tag() -> None:
    stream = ReasoningStream(R1)
    assert stream.feed("Let me ", final=False) == ("Let me ", "")
    assert stream.feed("see.</th", final=False) == ("see.", "")
    assert stream.feed("ink>4", final=True) == ("", "4")


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        Reasoning("granite")


def test_a_constrained_answer_waits_for_the_end_of_thinking() -> None:
    params = pb.SamplingParams(structured_output=pb.StructuredOutput(json_object=True))
    QWEN3.prepare(params)
    assert params.structured_output.starts_after == "</think>" and params.structured_output.reopened_by == "<think>"
    free = pb.SamplingParams()
    R1.prepare(free)
    assert not free.HasField("structured_output") and not free.HasField("skip_special_tokens")
    magistral = pb.SamplingParams(structured_output=pb.StructuredOutput(json_object=True))
    MISTRAL.prepare(magistral)  # its tags are special tokens: their text is kept, to be split
    assert magistral.structured_output.starts_after == "[/THINK]" and not magistral.skip_special_tokens
    asked = pb.SamplingParams(skip_special_tokens=True)
    MISTRAL.prepare(asked)
    assert asked.skip_special_tokens  # the request's own choice stands


def test_gpt_oss_s_tags_are_kept_and_its_answer_is_not_constrained() -> None:
    """Harmony's final header varies and an earlier turn's is in the prompt: a structured output
    would constrain the wrong text, so it is refused with the reason."""
    params = pb.SamplingParams()
    Reasoning("openai_gptoss").prepare(params)
    assert params.HasField("skip_special_tokens") and not params.skip_special_tokens
    with pytest.raises(BadRequest, match="is not served with the openai_gptoss reasoning parser"):
        Reasoning("openai_gptoss").prepare(pb.SamplingParams(structured_output=pb.StructuredOutput(json_object=True)))
    assert Reasoning("openai_gptoss").split("<|channel|>analysis<|message|>Hm.<|end|>") == ("Hm.", None)


@pytest.mark.parametrize(
    ("parser", "variables", "thinks"),
    [
        ("deepseek_v3", {}, False),  # V3.1 thinks only when asked
        ("deepseek_v3", {"thinking": True}, True),
        ("deepseek_v3", {"enable_thinking": True}, True),
        ("kimi_k2", {}, True),  # Kimi's thinking models think unless told not to
        ("kimi_k2", {"thinking": False}, False),
        ("qwen3", {}, True),  # Qwen3 thinks unless told not to
        ("qwen3", {"enable_thinking": False}, False),
    ],
)
def test_template_variables_switch_a_model_s_thinking(parser: str, variables: dict[str, bool], thinks: bool) -> None:
    reasoning = Reasoning(parser).for_request(variables)
    assert reasoning.thinking is thinks
    params = pb.SamplingParams(structured_output=pb.StructuredOutput(json_object=True))
    reasoning.prepare(params)
    assert params.structured_output.starts_after == ("</think>" if thinks else "")  # without thinking: from the start
    if not thinks:
        assert reasoning.split("It is 4.") == (None, "It is 4.")
        assert ReasoningStream(reasoning).feed("It is", final=False) == ("", "It is")
