"""Tools for multi-turn agents: schemas from type hints, the registry, argument checks, the
four tool-call formats (parse, write, round trip) and the exact calculator. CPU, no model."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Literal, Optional

import pytest

from megatron_rl.agents.calculator import calculator
from megatron_rl.agents.tool_parsers import (DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP,
                                             FORMATS, format_tool_call, format_tool_calls, has_tool_call_start,
                                             parse_tool_calls)
from megatron_rl.agents.tools import ToolCall, ToolError, ToolRegistry, tool_spec
from megatron_rl.errors import ConfigError

# ------------------------------------------------------------------ tools used by the tests

CALLED: list[str] = []


def search(query: str, top_k: int = 3, mode: Literal["fast", "exact"] = "fast", tags: list[str] | None = None,
           weights: dict[str, float] | None = None, threshold: Optional[float] = None, verbose: bool = False,
           extra: dict = None) -> list:  # noqa: RUF013 - a default without Optional: still not required
    """Search the corpus for passages about a query.

    Returns the best passages first; this paragraph is not part of the description.

    Args:
        query: What to look for.
        top_k (int): How many passages to return,
            at most 10.
        mode: Fast (approximate) or exact.
        tags: Only passages with all these tags.
        weights: Per-field weights.

    Returns:
        The passages.
    """
    CALLED.append("search")
    return [query, top_k, mode, tags, weights, threshold, verbose, extra]


def word_count(text: str) -> int:
    """Count the words of a text.

    Args:
        text: The text.
    """
    CALLED.append("word_count")
    return len(text.split())


def failing(x: int) -> str:
    """Always fails."""
    raise RuntimeError("backend unavailable")


def picky(name: str) -> str:
    """Raises ToolError itself: its message reaches the model as it is."""
    raise ToolError(f"no page named {name!r}")


def as_dict(key: str) -> dict:
    """A dict result."""
    return {"key": key, "value": "é"}


async def slow_double(x: int) -> int:
    """Doubles a number, asynchronously.

    Args:
        x: The number.
    """
    await asyncio.sleep(0)
    return 2 * x


def untyped(x, y: int) -> int:
    """No hint on x."""
    return y


NOT_CALLABLE = 42


# ------------------------------------------------------------------ schemas


def test_schema_from_type_hints_and_docstring():
    spec = tool_spec(search)
    assert spec.name == "search" and spec.function is search
    assert spec.description == "Search the corpus for passages about a query."
    assert spec.parameters == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What to look for."},
            "top_k": {"type": "integer", "description": "How many passages to return, at most 10."},
            "mode": {"type": "string", "enum": ["fast", "exact"], "description": "Fast (approximate) or exact."},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "Only passages with all these tags."},
            "weights": {"type": "object", "additionalProperties": {"type": "number"},
                        "description": "Per-field weights."},
            "threshold": {"type": "number"},
            "verbose": {"type": "boolean"},
            "extra": {"type": "object"},
        },
        "required": ["query"],
    }


def test_optional_without_default_is_not_required():
    def lookup(key: str, namespace: str | None) -> str:
        """Look a key up."""
        return f"{namespace}/{key}"

    spec = tool_spec(lookup)
    assert spec.parameters["required"] == ["key"]
    assert spec.parameters["properties"]["namespace"] == {"type": "string"}
    assert ToolRegistry([spec]).call(ToolCall("lookup", {"key": "a"})) == "None/a"


@pytest.mark.parametrize("hint, expected", [
    ("missing", "has no type hint"),
    ("tuple", "not supported"),
    ("union", "not supported"),
    ("varargs", "*args"),
])
def test_schema_refuses_a_parameter_it_cannot_describe(hint, expected):
    if hint == "missing":
        function, parameter = untyped, "x"
    elif hint == "tuple":
        def function(point: tuple[int, int]) -> int:
            return 0
        parameter = "point"
    elif hint == "union":
        def function(value: int | str) -> int:
            return 0
        parameter = "value"
    else:
        def function(*values: int) -> int:
            return 0
        parameter = "values"
    with pytest.raises(ConfigError) as info:
        tool_spec(function)
    message = str(info.value)
    assert function.__qualname__ in message and repr(parameter) in message and expected in message


# ------------------------------------------------------------------ registry


def test_registry_from_paths_builtin_and_import_path():
    CALLED.clear()
    registry = ToolRegistry.from_paths(["calculator", f"{__name__}:word_count", f"{__name__}:search"])
    assert registry.names == ["calculator", "word_count", "search"]
    assert CALLED == []  # nothing is called at construction
    schemas = registry.schemas()
    expression_doc = tool_spec(calculator).parameters["properties"]["expression"]["description"]
    assert expression_doc.startswith("The expression, using numbers") and "e.g." in expression_doc
    assert schemas[0] == {"type": "function", "function": {
        "name": "calculator",
        "description": calculator.__doc__.strip().splitlines()[0],
        "parameters": {"type": "object", "required": ["expression"],
                       "properties": {"expression": {"type": "string", "description": expression_doc}}},
    }}
    assert schemas[1]["function"]["parameters"]["required"] == ["text"]
    json.dumps(schemas)  # what a chat template receives must be JSON
    assert registry.call(ToolCall("calculator", {"expression": "1/3 + 1/6"})) == "1/2"
    assert registry.call(ToolCall("word_count", {"text": "one two three"})) == "3"
    assert CALLED == ["word_count"]


@pytest.mark.parametrize("entry, expected", [
    ("word_count", "neither a built-in tool (calculator, python) nor an import path"),
    ("no_such_package_xyz.tools:search", "cannot import 'no_such_package_xyz.tools'"),
    (f"{__name__}:no_such_function", "has no 'no_such_function'"),
    (f"{__name__}:NOT_CALLABLE", "is a int, not a function"),
    (f"{__name__}:untyped", "parameter 'x' has no type hint"),
    (f"{__name__}:ToolCall", "not a function"),
])
def test_registry_bad_paths_name_the_entry(entry, expected):
    with pytest.raises(ConfigError) as info:
        ToolRegistry.from_paths(["calculator", entry], where="rollout.tools")
    message = str(info.value)
    assert f"rollout.tools[1]={entry!r}" in message and expected in message


def test_registry_names_an_entry_whose_module_fails_to_import(tmp_path, monkeypatch):
    (tmp_path / "tool_module_that_fails.py").write_text("raise RuntimeError('no API key')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        ToolRegistry.from_paths(["tool_module_that_fails:search"], where="rollout.tools")
    assert str(info.value) == ("rollout.tools[0]='tool_module_that_fails:search': cannot import "
                               "'tool_module_that_fails' (RuntimeError: no API key); is its package installed or "
                               "on PYTHONPATH?")


def test_registry_refuses_duplicate_names():
    with pytest.raises(ConfigError, match=r"rollout\.tools\[1\]='megatron_rl.agents.calculator:calculator'.*"
                                          r"already given by 'calculator'"):
        ToolRegistry.from_paths(["calculator", "megatron_rl.agents.calculator:calculator"])
    with pytest.raises(ConfigError, match="two tools are named 'word_count'"):
        ToolRegistry([word_count, tool_spec(word_count)])


# ------------------------------------------------------------------ calls


@pytest.fixture
def registry():
    return ToolRegistry([calculator, search, failing, as_dict, slow_double, picky])


@pytest.mark.parametrize("call, expected", [
    (ToolCall("calculatr", {"expression": "1"}),
     "error: unknown tool 'calculatr'; available tools: calculator, search, failing, as_dict, slow_double, picky"),
    (ToolCall("calculator", {"expr": "1+1"}),
     "error: calculator: unknown argument 'expr'; expected: expression (string)"),
    (ToolCall("calculator", {}), "error: calculator: missing argument 'expression'; expected: expression (string)"),
    (ToolCall("calculator", {"expression": None}),
     "error: calculator: missing argument 'expression'; expected: expression (string)"),
    (ToolCall("calculator", {"expression": 12}),
     "error: calculator: argument 'expression' must be a string, got integer 12"),
    (ToolCall("calculator", ["1+1"]), "error: calculator: arguments must be an object; expected: expression (string)"),
    (ToolCall("search", {"query": "q", "top_k": "3"}),
     "error: search: argument 'top_k' must be an integer, got string \"3\""),
    (ToolCall("search", {"query": "q", "top_k": True}),
     "error: search: argument 'top_k' must be an integer, got boolean true"),
    (ToolCall("search", {"query": "q", "mode": "slow"}),
     "error: search: argument 'mode' must be one of \"fast\", \"exact\", got \"slow\""),
    (ToolCall("search", {"query": "q", "tags": ["a", 1]}),
     "error: search: argument 'tags[1]' must be a string, got integer 1"),
    (ToolCall("search", {"query": "q", "weights": {"a": "x"}}),
     "error: search: argument \"weights['a']\" must be a number, got string \"x\""),
    (ToolCall("failing", {"x": 1}), "error: failing: RuntimeError: backend unavailable"),
    (ToolCall("picky", {"name": "Zork"}), "error: picky: no page named 'Zork'"),
    (ToolCall("calculator", {"expression": "1/0"}), "error: calculator: division by zero in '1/0'"),
])
def test_call_errors_are_short_observations(registry, call, expected):
    with pytest.raises(ToolError) as info:
        registry.call(call)
    assert str(info.value) == expected


def test_call_lists_every_expected_argument(registry):
    with pytest.raises(ToolError) as info:
        registry.call(ToolCall("search", {"q": "x"}))
    assert str(info.value) == ("error: search: unknown argument 'q'; expected: query (string), top_k (integer, "
                               "optional), mode (one of \"fast\", \"exact\", optional), tags (array of string, "
                               "optional), weights (object, optional), threshold (number, optional), verbose (boolean, "
                               "optional), extra (object, optional)")


def test_call_runs_with_defaults_and_converts_results(registry):
    CALLED.clear()
    # omitted and null optional arguments take their defaults; an integral float is an integer
    result = registry.call(ToolCall("search", {"query": "q", "top_k": 5.0, "threshold": None, "tags": ["a"]}))
    assert json.loads(result) == ["q", 5, "fast", ["a"], None, None, False, None]
    assert registry.call(ToolCall("search", {"query": "q", "threshold": 1})).startswith('["q", 3, "fast"')
    assert registry.call(ToolCall("as_dict", {"key": "k"})) == '{"key": "k", "value": "é"}'
    assert registry.call(ToolCall("calculator", {"expression": "123456789 * 987654321"})) == "121932631112635269"


def test_async_tool_runs_in_the_calling_thread(registry):
    assert registry.call(ToolCall("slow_double", {"x": 21})) == "42"
    results = []
    worker = threading.Thread(target=lambda: results.append(registry.call(ToolCall("slow_double", {"x": 2}))))
    worker.start()
    worker.join()
    assert results == ["4"]

    async def inside_a_loop():
        return registry.call(ToolCall("slow_double", {"x": 1}))

    with pytest.raises(RuntimeError, match="worker thread"):
        asyncio.run(inside_a_loop())


# ------------------------------------------------------------------ parsers


def names_and_arguments(calls):
    return [(call.name, call.arguments) for call in calls]


def test_hermes_qwen_output():
    text = ("<think>\nI need the product first, then a search.\n</think>\n\n"
            "I'll compute it and look it up.\n"
            "<tool_call>\n{\"name\": \"calculator\", \"arguments\": "
            "{\"expression\": \"123456789 * 987654321\"}}\n</tool_call>\n"
            "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"Fermat\", \"top_k\": 2}}\n</tool_call>")
    calls, errors = parse_tool_calls(text, "hermes")
    assert errors == []
    assert names_and_arguments(calls) == [("calculator", {"expression": "123456789 * 987654321"}),
                                          ("search", {"query": "Fermat", "top_k": 2})]
    assert calls[0].text == ("<tool_call>\n{\"name\": \"calculator\", \"arguments\": "
                             "{\"expression\": \"123456789 * 987654321\"}}\n</tool_call>")
    compact = '<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}</tool_call>'
    assert names_and_arguments(parse_tool_calls(compact, "hermes")[0]) == [("calculator", {"expression": "2"})]
    assert parse_tool_calls("The answer is 4.", "hermes") == ([], [])

    malformed = ("<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1+1\"}\n</tool_call>\n"
                 "<tool_call>\n{\"arguments\": {\"expression\": \"2\"}}\n</tool_call>\n"
                 "<tool_call>\n{\"name\": \"calculator\", \"arguments\": \"2+2\"}\n</tool_call>\n"
                 "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"3\"}}\n</tool_call>\n"
                 "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expr")
    calls, errors = parse_tool_calls(malformed, "hermes")
    assert names_and_arguments(calls) == [("calculator", {"expression": "3"})]
    assert len(errors) == 4
    assert errors[0].startswith("tool call 1: invalid JSON")
    assert errors[1].startswith("tool call 2: missing \"name\"")
    assert errors[2].startswith("tool call 3: \"arguments\" of 'calculator' must be a JSON object")
    assert errors[3].startswith("tool call 5: unterminated <tool_call>")
    # an opening tag followed by another opening tag is unterminated too
    calls, errors = parse_tool_calls('<tool_call>{"name": "a"<tool_call>{"name": "b", "arguments": {}}</tool_call>',
                                     "hermes")
    assert names_and_arguments(calls) == [("b", {})] and errors[0].startswith("tool call 1: unterminated")


def test_llama3_json_output():
    text = '{"name": "calculator", "parameters": {"expression": "2**-1"}}'
    calls, errors = parse_tool_calls(text, "llama3_json")
    assert errors == [] and names_and_arguments(calls) == [("calculator", {"expression": "2**-1"})]
    assert calls[0].text == text
    several = ('<|python_tag|>{"name": "calculator", "parameters": {"expression": "1; 2"}}; '
               '{"name": "search", "arguments": {"query": "x"}}<|eom_id|>')
    calls, errors = parse_tool_calls(several, "llama3_json")
    assert errors == []
    assert names_and_arguments(calls) == [("calculator", {"expression": "1; 2"}), ("search", {"query": "x"})]
    # a plain answer (even one that mentions JSON) is no call
    assert parse_tool_calls('The result is {"name": 1}.', "llama3_json") == ([], [])

    calls, errors = parse_tool_calls('{"name": "calculator", "parameters": {"expression": "1+1"}; '
                                     '{"parameters": {}}; {"name": "calculator", "parameters": ["1"]}; '
                                     '{"name": "calculator", "parameters": {"expression": "5"}} and then text',
                                     "llama3_json")
    assert names_and_arguments(calls) == [("calculator", {"expression": "5"})]
    assert [error.split(":")[0] for error in errors] == ["tool call 1", "tool call 2", "tool call 3", "tool call 4"]
    assert "invalid JSON" in errors[0] and "missing \"name\"" in errors[1]
    assert "must be a JSON object" in errors[2] and "unexpected text after the call" in errors[3]
    assert parse_tool_calls('<|python_tag|>{"name": "calculator", "parameters": {"expression"', "llama3_json")[1]
    assert "both" in parse_tool_calls('{"name": "a", "parameters": {}, "arguments": {}}', "llama3_json")[1][0]


def test_deepseek_v3_output():
    text = ("Let me compute both."
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n"
            "```json\n{\"expression\": \"1/3 + 1/6\"}\n```<｜tool▁call▁end｜>\n"
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
            "{\"query\": \"DeepSeek\", \"top_k\": 1}\n"
            "```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>")
    calls, errors = parse_tool_calls(text, "deepseek_v3")
    assert errors == []
    assert names_and_arguments(calls) == [("calculator", {"expression": "1/3 + 1/6"}),
                                          ("search", {"query": "DeepSeek", "top_k": 1})]
    assert calls[0].text.startswith(DS_CALL_BEGIN) and calls[0].text.endswith(DS_CALL_END)

    malformed = (f"{DS_CALLS_BEGIN}"
                 f"{DS_CALL_BEGIN}function{DS_SEP}calculator\n```json\n{{\"expression\": \"1\"\n```{DS_CALL_END}\n"
                 f"{DS_CALL_BEGIN}function{DS_SEP}calculator\n{{\"expression\": \"2\"}}{DS_CALL_END}\n"
                 f"{DS_CALL_BEGIN}function{DS_SEP}calculator\n```json\n[\"3\"]\n```{DS_CALL_END}\n"
                 f"{DS_CALL_BEGIN}function{DS_SEP}calculator\n```json\n{{\"expression\": \"4\"}}\n```{DS_CALL_END}\n"
                 f"{DS_CALL_BEGIN}function{DS_SEP}calculator\n```json\n{{\"expr")
    calls, errors = parse_tool_calls(malformed, "deepseek_v3")
    assert names_and_arguments(calls) == [("calculator", {"expression": "4"})]
    assert len(errors) == 4
    assert "invalid JSON" in errors[0] and "```json block" in errors[1]
    assert "must be a JSON object" in errors[2] and errors[3].startswith("tool call 5: unterminated")
    assert parse_tool_calls(f"{DS_CALLS_BEGIN}{DS_CALLS_END}", "deepseek_v3")[1]
    # the arguments belong in a ```json fence, opened and closed
    for body in ('calculator\n{"expression": "2"}\n```', 'calculator\n```json\n{"expression": "2"}'):
        calls, errors = parse_tool_calls(f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}{body}{DS_CALL_END}"
                                         f"{DS_CALLS_END}", "deepseek_v3")
        assert calls == [] and "```json block" in errors[0], body


def test_glm45_output():
    text = ("<think>Two calls.</think>\n"
            "<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>2**10 - 24</arg_value>\n</tool_call>\n"
            "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>GLM tool calling</arg_value>\n"
            "<arg_key>top_k</arg_key>\n<arg_value>2</arg_value>\n<arg_key>tags</arg_key>\n"
            "<arg_value>[\"a\", \"b\"]</arg_value>\n</tool_call>"
            "<tool_call>word_count<arg_key>text</arg_key><arg_value>compact GLM-4.7 form</arg_value></tool_call>")
    calls, errors = parse_tool_calls(text, "glm45")
    assert errors == []
    assert names_and_arguments(calls) == [("calculator", {"expression": "2**10 - 24"}),
                                          ("search", {"query": "GLM tool calling", "top_k": 2, "tags": ["a", "b"]}),
                                          ("word_count", {"text": "compact GLM-4.7 form"})]
    # with the schemas, a string parameter keeps what the model wrote even when it reads as JSON
    numeric = "<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>42</arg_value>\n</tool_call>"
    assert parse_tool_calls(numeric, "glm45")[0][0].arguments == {"expression": 42}
    schemas = ToolRegistry([calculator]).schemas()
    assert parse_tool_calls(numeric, "glm45", tools=schemas)[0][0].arguments == {"expression": "42"}

    malformed = ("<tool_call>\n<arg_key>expression</arg_key>\n<arg_value>1</arg_value>\n</tool_call>\n"
                 "<tool_call>{\"name\": \"calculator\", \"arguments\": {}}</tool_call>\n"
                 "<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>1</arg_value>\n"
                 "<arg_key>expression</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n"
                 "<tool_call>calculator\n<arg_key>expression</arg_key>\n3\n</tool_call>\n"
                 "<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>4</arg_value>\n</tool_call>\n"
                 "<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>5")
    calls, errors = parse_tool_calls(malformed, "glm45")
    assert names_and_arguments(calls) == [("calculator", {"expression": 4})]
    assert len(errors) == 5
    assert "expected the tool name" in errors[0] and "expected the tool name" in errors[1]
    assert "given twice" in errors[2] and "expected <arg_key>KEY" in errors[3]
    assert errors[4].startswith("tool call 6: unterminated")


TRICKY_CALLS = [
    ("calculator", {"expression": "(1/3 + 2**-1) * 6"}),
    ("search", {"query": "2024", "top_k": 3, "tags": ["a;b", "c"], "weights": {"x": 0.5}, "verbose": True,
                "threshold": None, "mode": " spaced ", "extra": {}, "empty": ""}),
    # strings holding every family's markers, newlines, fences, separators and non-ASCII text
    ("word_count", {"text": "one\ntwo </arg_value> <arg_key> </tool_call> <tool_call> ```json ; {\"name\": 1} "
                            "<|python_tag|> <|eot_id|> <｜tool▁call▁end｜> <｜tool▁sep｜> 中文 \\u003c",
                    "nested": [{"text": "</tool_call>"}]}),
    ("no_arguments", {}),
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_then_parse_round_trips(fmt):
    for name, arguments in TRICKY_CALLS:
        text = format_tool_call((name, arguments), fmt)
        calls, errors = parse_tool_calls(text, fmt)
        assert errors == [] and names_and_arguments(calls) == [(name, arguments)], text
        assert has_tool_call_start(text, fmt)
        assert format_tool_call(calls[0], fmt) == text
    text = format_tool_calls(TRICKY_CALLS, fmt)
    calls, errors = parse_tool_calls(text, fmt)
    assert errors == [] and names_and_arguments(calls) == TRICKY_CALLS, text


def test_formats_are_what_the_chat_templates_render():
    call = ToolCall("calculator", {"expression": "1+1"})
    assert format_tool_call(call, "hermes") == ('<tool_call>\n{"name": "calculator", "arguments": '
                                                '{"expression": "1+1"}}\n</tool_call>')
    assert format_tool_call(call, "llama3_json") == '{"name": "calculator", "parameters": {"expression": "1+1"}}'
    assert format_tool_call(call, "deepseek_v3") == (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n"
        "{\"expression\": \"1+1\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert format_tool_call(call, "glm45") == ("<tool_call>calculator\n<arg_key>expression</arg_key>\n"
                                               "<arg_value>1+1</arg_value>\n</tool_call>")


def test_has_tool_call_start():
    assert has_tool_call_start("Sure. <tool_call>\n{\"name\": \"calc", "hermes")
    assert not has_tool_call_start("No call here.", "hermes")
    assert has_tool_call_start("<|python_tag|>{\"na", "llama3_json")
    assert has_tool_call_start('  {"name": "calculator"', "llama3_json")
    assert not has_tool_call_start('The answer is {"name": 1}', "llama3_json")
    assert has_tool_call_start("ok<｜tool▁calls▁begin｜>", "deepseek_v3")
    assert not has_tool_call_start("<tool_call>", "deepseek_v3")
    assert has_tool_call_start("<tool_call>calcul", "glm45")
    for fmt in FORMATS:  # an attempted call is exactly a text that parses to a call or an error
        for text in ("plain", format_tool_call(("f", {}), fmt), format_tool_call(("f", {}), fmt)[:15]):
            calls, errors = parse_tool_calls(text, fmt)
            assert has_tool_call_start(text, fmt) == bool(calls or errors), (fmt, text)


def test_unknown_format_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown tool-call format 'qwen'; known: hermes, llama3_json"):
        parse_tool_calls("<tool_call>", "qwen")


# ------------------------------------------------------------------ calculator


@pytest.mark.parametrize("expression, expected", [
    ("123456789 * 987654321", "121932631112635269"),
    ("1/3 + 1/6", "1/2"),
    ("2**-1", "1/2"),
    ("0.1 + 0.2", "3/10"),
    ("-(7) // 2", "-4"),
    ("7 % -3", "-2"),
    ("-1/2 * 3", "-3/2"),
    ("+-+2.50", "-5/2"),
    ("(2**100 + 1) - 2**100", "1"),
    ("1.5e-3", "3/2000"),
    ("6 / 3", "2"),
    ("2**1000", str(2**1000)),
])
def test_calculator_is_exact(expression, expected):
    assert calculator(expression) == expected


def test_calculator_refuses_huge_powers_before_computing_them():
    started = time.perf_counter()
    with pytest.raises(ValueError, match="result too large"):
        calculator("((10**1000)**9) ** 1000")  # 9,000,000 digits: seconds of work if it were computed
    assert time.perf_counter() - started < 1.0


def test_calculator_prints_results_past_pythons_int_string_limit():
    result = calculator("(10**1000)**9 * 10**999 * 9 + ((10**1000)**9 * 10**999 - 1)")
    assert result == "9" * 10_000  # 10**10000 - 1: the largest number allowed, over the 4300-digit str limit


@pytest.mark.parametrize("expression, expected", [
    ("__import__('os')", "function calls are not allowed"),
    ("__import__('os').system('true')", "not allowed"),
    ("x + 1", "names are not allowed"),
    ("abs(-2)", "function calls are not allowed"),
    ("(1).__class__", "attributes are not allowed"),
    ("'1' + '2'", "only numbers are allowed"),
    ("True + 1", "only numbers are allowed"),
    ("1 << 2", "the operator LShift is not allowed"),
    ("1 < 2", "comparisons are not allowed"),
    ("2 ** 0.5", "not an integer"),
    ("2 ** 1001", "exponent 1001 too large"),
    ("9 ** 999 ** 2", "too large"),
    ("(10**1000) ** 11", "result too large (more than 10000 digits)"),
    ("(10**1000)**9 * 10**999 * 10", "result too large"),
    ("1 / 0", "division by zero"),
    ("1 // (2 - 2)", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("1 +", "cannot parse"),
    ("", "empty expression"),
    ("-" * 1500 + "1", "too deeply nested"),
])
def test_calculator_refuses(expression, expected):
    with pytest.raises(ValueError) as info:
        calculator(expression)
    assert expected in str(info.value)
    if "not allowed" in expected:
        assert "allowed: integers and decimals" in str(info.value)


DEEP = "[" * 10_000 + "]" * 10_000  # deeper than Python's JSON parser recurses


@pytest.mark.parametrize("fmt, text", [
    ("hermes", f"<tool_call>{DEEP}</tool_call>"),
    ("llama3_json", '{"name": "calculator", "parameters": ' + DEEP + "}"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n"
                    + DEEP + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("glm45", f"<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>{DEEP}</arg_value>\n</tool_call>"),
])
def test_a_call_nested_deeper_than_the_parser_recurses_is_a_malformed_call(fmt, text):
    """A model can write 10,000 "[" in one turn: json's RecursionError escaped the parser and ended
    the trajectory with a traceback; it is one malformed call like any other (or, where a format
    keeps the value as text, a call whose argument is that text)."""
    calls, errors = parse_tool_calls(text, fmt)
    if errors:
        assert calls == [] and len(errors) == 1 and "nested too deeply" in errors[0], errors
    else:
        assert len(calls) == 1 and calls[0].arguments == {"expression": DEEP}, calls
