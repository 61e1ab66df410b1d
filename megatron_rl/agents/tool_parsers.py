"""Tool calls as model families write them: parse them out of a model turn, and write them.

Formats (`fmt`), as the models' chat templates render an assistant turn's tool calls:

- "hermes": Qwen2.5 / Qwen3 / Hermes (ChatML). Each call is a JSON object between tags:
      <tool_call>
      {"name": "calculator", "arguments": {"expression": "2+2"}}
      </tool_call>
  Several calls are several blocks (the template puts a newline before each). Sources: the
  Qwen2.5 / Qwen3 chat templates (`'\\n<tool_call>\\n{"name": "' + name + '", "arguments": ' +
  arguments|tojson + '}\\n</tool_call>'`), vLLM vllm/entrypoints/openai/tool_parsers/
  hermes_tool_parser.py and examples/tool_chat_template_hermes.jinja.
- "llama3_json": Llama 3.1 / 3.2 JSON tool calling. The whole assistant turn is a JSON object
  `{"name": "calculator", "parameters": {...}}` (vLLM also takes "arguments"), optionally after
  the `<|python_tag|>` token; several are separated by ";". Sources: vLLM
  examples/tool_chat_template_llama3.1_json.jinja (`'{"name": "' + name + '", "parameters": ' +
  arguments|tojson + '}'`), vllm/entrypoints/openai/tool_parsers/llama_tool_parser.py.
- "deepseek_v3": DeepSeek-V3 (and R1):
      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator
      ```json
      {"expression": "2+2"}
      ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
  several calls separated by "\\n" inside one calls block. Sources: vLLM
  examples/tool_chat_template_deepseekv3.jinja, vllm/entrypoints/openai/tool_parsers/
  deepseekv3_tool_parser.py.
- "glm45": GLM-4.5 / GLM-4.6: the name after the tag, then key / value pairs:
      <tool_call>calculator
      <arg_key>expression</arg_key>
      <arg_value>2+2</arg_value>
      </tool_call>
  A value is JSON when it parses as JSON, else the string as written (the template writes
  strings raw and everything else with tojson). GLM-4.7's compact form without the newlines
  parses too. Sources: the GLM-4.5 chat template (`'<tool_call>' + tc.name`, `<arg_key>{{ k
  }}</arg_key>`, `<arg_value>{{ v | tojson if v is not string else v }}</arg_value>`), vLLM
  vllm/entrypoints/openai/tool_parsers/glm4_moe_tool_parser.py.

`parse_tool_calls` never raises on what a model wrote: each malformed call becomes one short
error string (bad JSON, no name, arguments that are not an object, an unterminated tag), to be
shown to the model like a failed call. It parses the text it is given: strip a reasoning block
(`<think>...</think>`) first if calls inside the reasoning must not count.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

from megatron_rl.agents.tools import ToolCall
from megatron_rl.errors import ConfigError

FORMATS = ("hermes", "llama3_json", "deepseek_v3", "glm45")

# hermes / glm45
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# llama3_json
PYTHON_TAG = "<|python_tag|>"
LLAMA_END_TOKENS = ("<|eot_id|>", "<|eom_id|>")
# deepseek_v3 (fullwidth bars ｜ U+FF5C and lower one-eighth blocks ▁ U+2581, as in its vocabulary)
DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
# glm45
ARG_KEY_START, ARG_KEY_END = "<arg_key>", "</arg_key>"
ARG_VALUE_START, ARG_VALUE_END = "<arg_value>", "</arg_value>"

_DS_BODY = re.compile(r"^(?P<type>[^\n]*?)" + re.escape(DS_SEP) + r"(?P<name>[^\n]*)\n?\s*```(?:json)?[ \t]*\n?"
                      r"(?P<args>.*?)\n?\s*```\s*$", re.DOTALL)
_GLM_PAIR = re.compile(re.escape(ARG_KEY_START) + r"(?P<key>.*?)" + re.escape(ARG_KEY_END) + r"\s*"
                       + re.escape(ARG_VALUE_START) + r"(?P<value>.*?)" + re.escape(ARG_VALUE_END), re.DOTALL)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
# What a format's parser looks for: never written raw inside a JSON string (see _dumps).
_MARKERS = {
    "hermes": (TOOL_CALL_START, TOOL_CALL_END),
    "llama3_json": (PYTHON_TAG, *LLAMA_END_TOKENS),
    "deepseek_v3": (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP),
    "glm45": (TOOL_CALL_START, TOOL_CALL_END, ARG_KEY_START, ARG_KEY_END, ARG_VALUE_START, ARG_VALUE_END),
}
MAX_SHOWN = 60  # characters of model text quoted in an error


def parse_tool_calls(text: str, fmt: str, tools: list[dict] | None = None) -> tuple[list[ToolCall], list[str]]:
    """(the calls in `text`, in order; one short error string per malformed call).

    `tools` (optional, glm45 only): the OpenAI-style schemas (ToolRegistry.schemas()); a value of a
    parameter whose type is "string" is then kept as written instead of being read as JSON (the
    GLM template writes strings raw, so "42" for a string parameter would otherwise become 42)."""
    _check_format(fmt)
    if not isinstance(text, str) or not text:
        return [], []
    if fmt == "hermes":
        return _parse_hermes(text)
    if fmt == "llama3_json":
        return _parse_llama3_json(text)
    if fmt == "deepseek_v3":
        return _parse_deepseek_v3(text)
    return _parse_glm45(text, _string_parameters(tools))


def has_tool_call_start(text: str, fmt: str) -> bool:
    """Whether `text` contains the start of a call in `fmt` (well-formed or not): the model
    attempted a call. Exactly the texts for which parse_tool_calls finds a call or an error."""
    _check_format(fmt)
    if not isinstance(text, str):
        return False
    if fmt in ("hermes", "glm45"):
        return TOOL_CALL_START in text
    if fmt == "llama3_json":
        return _llama_region(text) is not None
    return DS_CALL_BEGIN in text or DS_CALLS_BEGIN in text


def text_before_tool_calls(text: str, fmt: str) -> str:
    """The part of a model turn before its first tool call (its `content` when the calls are
    returned structured, as an OpenAI-compatible server does); all of it when it has none."""
    _check_format(fmt)
    if fmt == "llama3_json":
        start = _llama_region(text)
        if start is None:
            return text
        tag = text.find(PYTHON_TAG)
        return text[:tag] if 0 <= tag < start else ""
    markers = (DS_CALLS_BEGIN, DS_CALL_BEGIN) if fmt == "deepseek_v3" else (TOOL_CALL_START,)
    starts = [text.find(marker) for marker in markers if marker in text]
    return text[:min(starts)] if starts else text


def format_tool_call(call: ToolCall | tuple[str, dict], fmt: str) -> str:
    """The text a model of the `fmt` family writes for one call (as its chat template renders an
    assistant turn with that call, without the turn's end token).
    parse_tool_calls(format_tool_call(c, fmt), fmt) gives back c's name and arguments."""
    return format_tool_calls([call], fmt)


def format_tool_calls(calls: Iterable[ToolCall | tuple[str, dict]], fmt: str) -> str:
    """The text for several calls in one turn, joined as the `fmt` family's template joins them."""
    _check_format(fmt)
    pairs = [_name_and_arguments(call) for call in calls]
    if fmt == "hermes":
        return "\n".join(f"{TOOL_CALL_START}\n{_dumps({'name': name, 'arguments': args}, fmt)}\n{TOOL_CALL_END}"
                         for name, args in pairs)
    if fmt == "llama3_json":
        return "; ".join(_dumps({"name": name, "parameters": args}, fmt) for name, args in pairs)
    if fmt == "deepseek_v3":
        blocks = "\n".join(f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{_dumps(args, fmt)}\n```{DS_CALL_END}"
                           for name, args in pairs)
        return f"{DS_CALLS_BEGIN}{blocks}{DS_CALLS_END}"
    return "\n".join(_format_glm45(name, args) for name, args in pairs)


# -------------------------------------------------------------------------------- helpers


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")


def _name_and_arguments(call: Any) -> tuple[str, dict]:
    if isinstance(call, ToolCall):
        name, arguments = call.name, call.arguments
    else:
        name, arguments = call
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"tool name {name!r} cannot be written as a call")
    if not isinstance(arguments, dict):
        raise ValueError(f"arguments of {name!r} must be a dict, got {type(arguments).__name__}")
    return name, arguments


def _dumps(value: Any, fmt: str) -> str:
    """JSON as a chat template's `tojson` writes it (transformers: json.dumps(ensure_ascii=False)),
    except that a marker of the format inside a string (a "</tool_call>" in an argument) has its
    "<" written as \\u003c, so that the text parses back to the same call."""
    text = json.dumps(value, ensure_ascii=False)
    for marker in _MARKERS[fmt]:
        if marker in text:
            text = text.replace(marker, "\\u003c" + marker[1:])
    return text


def _refuse_constant(constant: str) -> Any:
    raise ValueError(f"{constant} is not valid JSON")


# json that refuses NaN / Infinity (not JSON, and no tool wants them)
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def _loads(text: str) -> Any:
    return _raw_decode(text, 0, whole=True)[0]


def _raw_decode(text: str, position: int, *, whole: bool = False) -> tuple[Any, int]:
    """_DECODER's decode (whole) / raw_decode; JSON nested deeper than the parser recurses (a
    model can write 10,000 "[" in one turn) is a ValueError like any other malformed call."""
    try:
        return (_DECODER.decode(text), len(text)) if whole else _DECODER.raw_decode(text, position)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _shown(text: str) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "...")


def _json_problem(exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON ({exc.msg} at char {exc.pos})"
    return f"invalid JSON ({exc})"


def _call_from_object(obj: Any, text: str, what: str,
                      argument_keys: tuple[str, ...]) -> tuple[ToolCall | None, str | None]:
    """A ToolCall from a decoded {"name": ..., <argument key>: {...}} object, or an error."""
    if not isinstance(obj, dict):
        return None, f"{what}: expected a JSON object with \"name\" and \"{argument_keys[0]}\", got {_shown(text)}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, f"{what}: missing \"name\" (a string) in {_shown(text)}"
    present = [key for key in argument_keys if key in obj]
    if len(present) > 1:
        return None, f"{what}: both {' and '.join(repr(key) for key in present)} given for {name!r}"
    arguments = obj[present[0]] if present else {}
    if not isinstance(arguments, dict):
        return None, f"{what}: \"{present[0]}\" of {name!r} must be a JSON object, got {_shown(json.dumps(arguments))}"
    return ToolCall(name=name.strip(), arguments=arguments, text=text), None


def _tagged_blocks(text: str, start: str, end: str) -> Iterable[tuple[str | None, str]]:
    """(body or None when unterminated, raw block) for each start...end block, in order. A block
    whose end is missing, or comes after the next start, is unterminated."""
    position = 0
    while True:
        begin = text.find(start, position)
        if begin < 0:
            return
        body_start = begin + len(start)
        close = text.find(end, body_start)
        reopen = text.find(start, body_start)
        if close < 0 or 0 <= reopen < close:
            stop = reopen if reopen >= 0 else len(text)
            yield None, text[begin:stop]
            position = stop
            continue
        yield text[body_start:close], text[begin:close + len(end)]
        position = close + len(end)


# -------------------------------------------------------------------------------- hermes


def _parse_hermes(text: str) -> tuple[list[ToolCall], list[str]]:
    calls, errors = [], []
    for number, (body, raw) in enumerate(_tagged_blocks(text, TOOL_CALL_START, TOOL_CALL_END), start=1):
        what = f"tool call {number}"
        if body is None:
            errors.append(f"{what}: unterminated {TOOL_CALL_START} (no {TOOL_CALL_END}): {_shown(raw)}")
            continue
        try:
            obj = _loads(body.strip())
        except ValueError as exc:
            errors.append(f"{what}: {_json_problem(exc)}: {_shown(body)}")
            continue
        call, error = _call_from_object(obj, raw, what, ("arguments",))
        calls.append(call) if call else errors.append(error)
    return calls, errors


# -------------------------------------------------------------------------------- llama3_json


def _llama_region(text: str) -> int | None:
    """Where the calls start in a Llama 3 turn: after <|python_tag|>, or at the turn's start
    when the turn is a JSON object; None for a plain answer."""
    stripped = text.lstrip()
    if stripped.startswith("{"):
        return len(text) - len(stripped)
    tag = text.find(PYTHON_TAG)
    return tag + len(PYTHON_TAG) if tag >= 0 else None


def _parse_llama3_json(text: str) -> tuple[list[ToolCall], list[str]]:
    start = _llama_region(text)
    if start is None:
        return [], []
    region = text[start:].rstrip()
    while region.endswith(LLAMA_END_TOKENS):  # the turn's end token, when the text kept it
        region = region[:region.rfind("<|")].rstrip()
    calls, errors = [], []
    position, number = 0, 0
    while True:
        while position < len(region) and region[position].isspace():
            position += 1
        if position >= len(region):
            if number == 0:
                errors.append("tool call 1: expected a JSON object {\"name\": ..., \"parameters\": {...}}, got nothing")
            break
        number += 1
        what = f"tool call {number}"
        try:
            obj, end = _raw_decode(region, position)
        except ValueError as exc:
            # skip to the next "; {" (the next call) and carry on; a lone error otherwise
            resume = re.compile(r";\s*\{").search(region, position)
            errors.append(f"{what}: {_json_problem(exc)}: "
                          f"{_shown(region[position:resume.start() if resume else len(region)])}")
            if not resume:
                break
            position = resume.start() + 1
            continue
        call, error = _call_from_object(obj, region[position:end], what, ("parameters", "arguments"))
        calls.append(call) if call else errors.append(error)
        position = end
        while position < len(region) and region[position].isspace():
            position += 1
        if position >= len(region):
            break
        if region[position] == ";":
            position += 1
            if not region[position:].strip():
                break  # a trailing ";"
            continue
        errors.append(f"{what}: unexpected text after the call (separate calls with \";\"): "
                      f"{_shown(region[position:])}")
        break
    return calls, errors


# -------------------------------------------------------------------------------- deepseek_v3


def _parse_deepseek_v3(text: str) -> tuple[list[ToolCall], list[str]]:
    calls, errors = [], []
    blocks = list(_tagged_blocks(text, DS_CALL_BEGIN, DS_CALL_END))
    if not blocks and DS_CALLS_BEGIN in text:
        errors.append(f"tool call 1: {DS_CALLS_BEGIN} without any {DS_CALL_BEGIN}...{DS_CALL_END}")
    for number, (body, raw) in enumerate(blocks, start=1):
        what = f"tool call {number}"
        if body is None:
            errors.append(f"{what}: unterminated {DS_CALL_BEGIN} (no {DS_CALL_END}): {_shown(raw)}")
            continue
        match = _DS_BODY.match(body)
        if not match:
            errors.append(f"{what}: expected function{DS_SEP}NAME then the arguments in a ```json block, "
                          f"got {_shown(body)}")
            continue
        name = match.group("name").strip()
        if not name:
            errors.append(f"{what}: missing the function name after {DS_SEP}")
            continue
        try:
            arguments = _loads(match.group("args").strip() or "{}")
        except ValueError as exc:
            errors.append(f"{what}: {_json_problem(exc)} in the arguments of {name!r}: {_shown(match.group('args'))}")
            continue
        if not isinstance(arguments, dict):
            errors.append(f"{what}: the arguments of {name!r} must be a JSON object, got {_shown(match.group('args'))}")
            continue
        calls.append(ToolCall(name=name, arguments=arguments, text=raw))
    return calls, errors


# -------------------------------------------------------------------------------- glm45


def _string_parameters(tools: list[dict] | None) -> dict[str, set[str]]:
    """{tool name: its parameters of type string} from OpenAI-style schemas."""
    result: dict[str, set[str]] = {}
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        properties = (function.get("parameters") or {}).get("properties") or {}
        result[function["name"]] = {key for key, schema in properties.items()
                                    if isinstance(schema, dict) and schema.get("type") == "string"}
    return result


def _glm_value(raw: str, keep_string: bool) -> Any:
    value = raw.strip()
    if keep_string:
        return value
    try:
        return _loads(value)
    except ValueError:
        return value


def _parse_glm45(text: str, string_parameters: dict[str, set[str]]) -> tuple[list[ToolCall], list[str]]:
    calls, errors = [], []
    for number, (body, raw) in enumerate(_tagged_blocks(text, TOOL_CALL_START, TOOL_CALL_END), start=1):
        what = f"tool call {number}"
        if body is None:
            errors.append(f"{what}: unterminated {TOOL_CALL_START} (no {TOOL_CALL_END}): {_shown(raw)}")
            continue
        first_key = body.find(ARG_KEY_START)
        head = body if first_key < 0 else body[:first_key]
        name = head.strip()
        if not name or not _NAME.match(name):
            errors.append(f"{what}: expected the tool name right after {TOOL_CALL_START}, then "
                          f"{ARG_KEY_START}...{ARG_KEY_END}{ARG_VALUE_START}...{ARG_VALUE_END} pairs; "
                          f"got {_shown(head or body)}")
            continue
        rest = "" if first_key < 0 else body[first_key:]
        arguments: dict[str, Any] = {}
        keep = string_parameters.get(name, set())
        problem = None
        position = 0
        for match in _GLM_PAIR.finditer(rest):
            between = rest[position:match.start()]
            if between.strip():
                problem = f"unexpected text {_shown(between)} between arguments"
                break
            key = match.group("key").strip()
            if not key:
                problem = f"an empty {ARG_KEY_START}"
                break
            if key in arguments:
                problem = f"argument {key!r} given twice"
                break
            arguments[key] = _glm_value(match.group("value"), key in keep)
            position = match.end()
        if problem is None and rest[position:].strip():
            problem = (f"expected {ARG_KEY_START}KEY{ARG_KEY_END}{ARG_VALUE_START}VALUE{ARG_VALUE_END}, got "
                       f"{_shown(rest[position:])}")
        if problem:
            errors.append(f"{what} ({name}): {problem}")
            continue
        calls.append(ToolCall(name=name, arguments=arguments, text=raw))
    return calls, errors


def _format_glm45(name: str, arguments: dict) -> str:
    lines = [f"{TOOL_CALL_START}{name}"]
    for key, value in arguments.items():
        if not isinstance(key, str) or not key.strip() or key != key.strip() or "<" in key:
            raise ValueError(f"argument name {key!r} of {name!r} cannot be written in the glm45 format")
        lines.append(f"{ARG_KEY_START}{key}{ARG_KEY_END}")
        lines.append(f"{ARG_VALUE_START}{_glm_value_text(value)}{ARG_VALUE_END}")
    return "\n".join(lines) + "\n" + TOOL_CALL_END


def _glm_value_text(value: Any) -> str:
    """A string raw, as the template writes it, unless reading it back would change it (it parses
    as JSON, like "42", is empty, has surrounding whitespace, or holds a tag of the format): then
    as a JSON string. Everything else as JSON."""
    if isinstance(value, str):
        try:
            _loads(value.strip())
            reads_as_json = True
        except ValueError:
            reads_as_json = False
        raw_is_exact = (value and value == value.strip() and not reads_as_json
                        and not any(marker in value for marker in _MARKERS["glm45"]))
        if raw_is_exact:
            return value
    return _dumps(value, "glm45")
