"""Tools a multi-turn agent may call: their schemas, where they come from, and how a call runs.

    rollout.tools: ["calculator", "my_pkg.tools:search"]     # built-in short names or import paths

    def search(query: str, top_k: int = 3) -> list[str]:
        \"\"\"Search the corpus for passages about a query.

        Args:
            query: What to look for.
            top_k: How many passages to return.
        \"\"\"

A tool is a plain function with type hints. `tool_spec` turns its signature and Google-style
docstring into the JSON schema the chat template shows the model (first docstring paragraph:
the description; "Args:" lines: the parameters'). Supported hints: str, int, float, bool,
list / list[X], dict / dict[str, X], Literal[...] (an enum), Optional[X] / `X | None`. A
parameter with a default or an Optional hint is not required; omitted (or given as null), it
takes its default, or None when it has none.

`ToolRegistry.call(ToolCall)` checks the arguments against the schema (unknown tool, missing,
unknown or mistyped arguments), runs the function and returns its result as text (dict and
list results as JSON). Whatever stops a call, including an exception the tool raises, comes
out as ToolError, whose message is the short observation the model reads ("error: ...").

Tools are meant to be sync functions: the rollout runs `call` in a thread pool with
`rollout.env_timeout_s`. An `async def` tool works too: `call` runs it to completion with
`asyncio.run` in the calling thread, so `call` must then not be called from a thread with a
running event loop (it raises RuntimeError there: call it from a worker thread).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Union

from megatron_rl.errors import ConfigError

# Built-in tools, by the short name a config may use.
BUILTIN_TOOLS = {
    "calculator": "megatron_rl.agents.calculator:calculator",
    "python": "megatron_rl.agents.python_tool:python",
}

# How long an error observation may get before it is cut (the model reads it as its next turn).
MAX_ERROR_CHARS = 400

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_TYPE_WORDS = {"string": "a string", "integer": "an integer", "number": "a number",
               "boolean": "a boolean", "array": "an array", "object": "an object"}


@dataclass(frozen=True)
class ToolCall:
    """One call as parsed from a model turn. `text` is the raw call as the model wrote it."""

    name: str
    arguments: dict
    text: str = ""


@dataclass(frozen=True)
class ToolSpec:
    """A tool: its name, description, JSON schema of its parameters and the function."""

    name: str
    description: str
    parameters: dict
    function: Callable


class ToolError(Exception):
    """A call that cannot run or failed. `str(error)` is the observation the model sees."""


# -------------------------------------------------------------------------------- schemas


def tool_spec(function: Callable) -> ToolSpec:
    """The ToolSpec of `function`, its schema built from its type hints and docstring.
    ConfigError naming the function and parameter for a hint that is missing or unsupported."""
    label = _label(function)
    if not callable(function):
        raise ConfigError(f"tool {label} is not callable")
    name = getattr(function, "__name__", None)
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"tool {label}: its name {name!r} cannot be a tool name (letters, digits, _ . -, "
                          f"starting with a letter or _); wrap it in a named def")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"tool {label}: no inspectable signature ({exc}); wrap it in a def with type hints") from exc
    try:
        hints = typing.get_type_hints(function)
    except Exception as exc:  # noqa: BLE001 - an unresolvable annotation is the tool author's to fix
        raise ConfigError(f"tool {label}: cannot resolve its type hints ({type(exc).__name__}: {exc})") from exc
    description, arg_docs = _parse_docstring(inspect.getdoc(function) or "")
    properties: dict[str, dict] = {}
    required: list[str] = []
    for parameter in signature.parameters.values():
        where = f"tool {label}, parameter {parameter.name!r}"
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD, parameter.POSITIONAL_ONLY):
            kind = {parameter.VAR_POSITIONAL: "*args", parameter.VAR_KEYWORD: "**kwargs",
                    parameter.POSITIONAL_ONLY: "positional-only"}[parameter.kind]
            raise ConfigError(f"{where}: a {kind} parameter cannot be given by a tool call; "
                              f"use named parameters with type hints")
        if parameter.name not in hints:
            raise ConfigError(f"{where} has no type hint; annotate it (str, int, float, bool, list[...], "
                              f"dict, Literal[...] or Optional[...])")
        schema, nullable = _schema_of(hints[parameter.name], where)
        if parameter.name in arg_docs:
            schema = {**schema, "description": arg_docs[parameter.name]}
        properties[parameter.name] = schema
        if parameter.default is parameter.empty and not nullable:
            required.append(parameter.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return ToolSpec(name=name, description=description, parameters=parameters, function=function)


def _label(function: Any) -> str:
    module = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", None) or getattr(function, "__name__", None)
    if module and qualname:
        return f"{module}:{qualname}"
    return repr(function)


def _schema_of(hint: Any, where: str) -> tuple[dict, bool]:
    """(JSON schema of `hint`, whether None is allowed)."""
    origin = typing.get_origin(hint)
    if origin is Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(members) == 1 and len(typing.get_args(hint)) == 2:
            return _schema_of(members[0], where)[0], True
        raise ConfigError(f"{where}: the union {hint!r} is not supported (only Optional[X] / X | None)")
    return _plain_schema(hint, where), False


def _plain_schema(hint: Any, where: str) -> dict:
    simple = {str: "string", bool: "boolean", int: "integer", float: "number"}
    if hint in simple:
        return {"type": simple[hint]}
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is list or origin is list:
        if not args:
            return {"type": "array"}
        schema, nullable = _schema_of(args[0], where)
        if nullable:
            raise ConfigError(f"{where}: list items may not be Optional ({hint!r})")
        return {"type": "array", "items": schema}
    if hint is dict or origin is dict:
        if not args:
            return {"type": "object"}
        if args[0] is not str:
            raise ConfigError(f"{where}: dict keys must be str in JSON ({hint!r})")
        if args[1] is Any:
            return {"type": "object"}
        schema, nullable = _schema_of(args[1], where)
        if nullable:
            raise ConfigError(f"{where}: dict values may not be Optional ({hint!r})")
        return {"type": "object", "additionalProperties": schema}
    if origin is Literal:
        values = list(args)
        kinds = {type(value) for value in values}
        if not values or not kinds <= {str, int, float, bool} or len(kinds) != 1:
            raise ConfigError(f"{where}: Literal values must all be str, or all int / float / bool ({hint!r})")
        return {"type": simple[kinds.pop()], "enum": values}
    raise ConfigError(f"{where}: type {hint!r} is not supported; use str, int, float, bool, list[...], "
                      f"dict, Literal[...] or Optional[...]")


_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Return|Yields|Raises|Examples?|Notes?|"
                      r"Attributes|See Also|Warnings?|Todo)\s*:\s*$")
_ARG_LINE = re.compile(r"^\*{0,2}(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*(?:\([^)]*\))?\s*:\s*(?P<text>.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description: the first paragraph, {parameter: description} from a Google-style Args: section)."""
    lines = doc.expandtabs().splitlines()
    paragraph: list[str] = []
    for line in lines:
        if _SECTION.match(line.strip()):
            break
        if not line.strip():
            if paragraph:
                break
            continue
        paragraph.append(line.strip())
    description = " ".join(paragraph)
    arg_docs: dict[str, str] = {}
    in_args = False
    args_indent = 0
    entry_indent: int | None = None
    current: str | None = None
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if _SECTION.match(stripped):
            in_args = stripped.split(":")[0].strip() in ("Args", "Arguments", "Parameters")
            args_indent, entry_indent, current = indent, None, None
            continue
        if not in_args or not stripped:
            continue
        if indent <= args_indent:  # text back at the section's level ends the section
            in_args, current = False, None
            continue
        if entry_indent is None:
            entry_indent = indent
        match = _ARG_LINE.match(stripped)
        if indent == entry_indent and match:
            current = match.group("name")
            arg_docs[current] = match.group("text").strip()
        elif current is not None and indent > entry_indent:
            arg_docs[current] = (arg_docs[current] + " " + stripped).strip()
    return description, arg_docs


# -------------------------------------------------------------------------------- registry


class ToolRegistry:
    """The tools offered to the model, by name. Built from functions (`ToolRegistry(specs)`) or
    from a config's import paths (`ToolRegistry.from_paths`)."""

    def __init__(self, specs: list[ToolSpec] | None = None):
        self.specs: list[ToolSpec] = []
        self._by_name: dict[str, ToolSpec] = {}
        for spec in specs or []:
            if not isinstance(spec, ToolSpec):
                spec = tool_spec(spec)
            if spec.name in self._by_name:
                raise ConfigError(f"two tools are named {spec.name!r} ({_label(self._by_name[spec.name].function)} "
                                  f"and {_label(spec.function)}); tool names must be unique")
            self.specs.append(spec)
            self._by_name[spec.name] = spec

    @classmethod
    def from_paths(cls, paths: list[str], where: str = "rollout.tools") -> "ToolRegistry":
        """Tools from "pkg.module:function" entries, or built-in short names ("calculator").
        Imports each module and checks each function's schema; calls nothing."""
        if isinstance(paths, str) or not isinstance(paths, (list, tuple)):
            raise ConfigError(f"{where} must be a list of 'pkg.module:function' (or built-in names), got {paths!r}")
        specs: list[ToolSpec] = []
        origin: dict[str, str] = {}
        for index, entry in enumerate(paths):
            at = f"{where}[{index}]={entry!r}"
            function = _load_function(entry, at)
            try:
                spec = tool_spec(function)
            except ConfigError as exc:
                raise ConfigError(f"{at}: {exc}") from exc
            if spec.name in origin:
                raise ConfigError(f"{at}: a tool named {spec.name!r} is already given by {origin[spec.name]!r}; "
                                  f"tool names must be unique: remove one entry or rename one function")
            origin[spec.name] = entry
            specs.append(spec)
        return cls(specs)

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    def __len__(self) -> int:
        return len(self.specs)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str) -> ToolSpec | None:
        return self._by_name.get(name)

    def schemas(self) -> list[dict]:
        """The tools in the OpenAI format chat templates take (`tools=` of apply_chat_template)."""
        return [{"type": "function",
                 "function": {"name": spec.name, "description": spec.description,
                              "parameters": json.loads(json.dumps(spec.parameters))}}
                for spec in self.specs]

    def call(self, call: ToolCall) -> str:
        """Validate `call` against its tool's schema, run it and return the result as text.
        ToolError (its message: the observation for the model) when it cannot run or fails.
        An async tool runs with asyncio.run in this thread (RuntimeError inside an event loop)."""
        spec = self._by_name.get(call.name)
        if spec is None:
            available = ", ".join(self.names) or "none"
            raise ToolError(_cut(f"error: unknown tool {call.name!r}; available tools: {available}"))
        kwargs = self._arguments(spec, call.arguments)
        if inspect.iscoroutinefunction(spec.function):
            _no_running_loop(spec.name)
        try:
            result = spec.function(**kwargs)
            if inspect.isawaitable(result):
                _no_running_loop(spec.name)
                result = asyncio.run(_awaited(result))
        except ToolError as exc:
            message = str(exc) if str(exc).startswith("error:") else f"error: {spec.name}: {exc}"
            raise ToolError(_cut(message)) from exc
        except Exception as exc:  # noqa: BLE001 - a failing tool is an observation, not a crash
            raise ToolError(_cut(f"error: {spec.name}: {_describe(exc)}")) from exc
        return _as_text(result)

    def _arguments(self, spec: ToolSpec, arguments: Any) -> dict:
        """The keyword arguments for `spec.function`, or ToolError saying what is wrong."""
        properties: dict = spec.parameters["properties"]
        required: list = spec.parameters["required"]
        expected = _expected(spec)
        if not isinstance(arguments, dict):
            raise ToolError(_cut(f"error: {spec.name}: arguments must be an object; expected: {expected}"))
        unknown = [key for key in arguments if key not in properties]
        if unknown:
            names = ", ".join(repr(key) for key in unknown)
            word = "argument" if len(unknown) == 1 else "arguments"
            raise ToolError(_cut(f"error: {spec.name}: unknown {word} {names}; expected: {expected}"))
        missing = [key for key in required if arguments.get(key) is None]
        if missing:
            names = ", ".join(repr(key) for key in missing)
            word = "argument" if len(missing) == 1 else "arguments"
            raise ToolError(_cut(f"error: {spec.name}: missing {word} {names}; expected: {expected}"))
        signature = inspect.signature(spec.function)
        kwargs = {}
        for key, schema in properties.items():
            if key not in arguments or arguments[key] is None:
                if signature.parameters[key].default is inspect.Parameter.empty:
                    kwargs[key] = None  # Optional without a default
                continue
            problem, value = _check(arguments[key], schema, key)
            if problem:
                raise ToolError(_cut(f"error: {spec.name}: {problem}"))
            kwargs[key] = value
        return kwargs


def _load_function(entry: Any, at: str) -> Callable:
    if not isinstance(entry, str) or not entry.strip():
        raise ConfigError(f"{at}: each entry must be 'pkg.module:function' or a built-in name "
                          f"({', '.join(BUILTIN_TOOLS)})")
    path = BUILTIN_TOOLS.get(entry.strip(), entry.strip())
    module_name, colon, attribute = path.partition(":")
    if not colon or not module_name or not attribute:
        raise ConfigError(f"{at} is neither a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor an import path: "
                          f"write 'pkg.module:function', e.g. 'my_pkg.tools:search'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise ConfigError(f"{at}: cannot import {module_name!r} ({type(exc).__name__}: {exc}); "
                          f"is its package installed or on PYTHONPATH?") from exc
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{at}: module {module_name!r} has no {attribute!r}; check the function's name")
        target = getattr(target, part)
    if not callable(target) or inspect.isclass(target):
        raise ConfigError(f"{at}: {attribute!r} is a {type(target).__name__}, not a function; point the entry at "
                          f"the function to call")
    return target


def _expected(spec: ToolSpec) -> str:
    properties = spec.parameters["properties"]
    if not properties:
        return "no arguments"
    required = set(spec.parameters["required"])
    parts = []
    for key, schema in properties.items():
        kind = _type_name(schema)
        parts.append(f"{key} ({kind})" if key in required else f"{key} ({kind}, optional)")
    return ", ".join(parts)


def _type_name(schema: dict) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(value) for value in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array" and "items" in schema:
        return f"array of {_type_name(schema['items'])}"
    return kind


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _check(value: Any, schema: dict, path: str) -> tuple[str | None, Any]:
    """(problem or None, the value to pass: integral floats for integer parameters become ints)."""
    kind = schema.get("type")
    ok = True
    if kind == "string":
        ok = isinstance(value, str)
    elif kind == "boolean":
        ok = isinstance(value, bool)
    elif kind == "integer":
        if isinstance(value, float) and not isinstance(value, bool) and value.is_integer():
            value = int(value)
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value \
            and value not in (float("inf"), float("-inf"))
    elif kind == "array":
        ok = isinstance(value, list)
    elif kind == "object":
        ok = isinstance(value, dict)
    if not ok:
        shown = json.dumps(value, ensure_ascii=False, default=str)
        if len(shown) > 40:
            shown = shown[:37] + "..."
        return f"argument {path!r} must be {_TYPE_WORDS.get(kind, kind)}, got {_json_type(value)} {shown}", value
    if "enum" in schema and value not in schema["enum"]:
        choices = ", ".join(json.dumps(choice) for choice in schema["enum"])
        return f"argument {path!r} must be one of {choices}, got {json.dumps(value, default=str)}", value
    if kind == "array" and "items" in schema:
        checked = []
        for index, item in enumerate(value):
            problem, item = _check(item, schema["items"], f"{path}[{index}]")
            if problem:
                return problem, value
            checked.append(item)
        value = checked
    if kind == "object" and "additionalProperties" in schema:
        checked_map = {}
        for key, item in value.items():
            problem, item = _check(item, schema["additionalProperties"], f"{path}[{key!r}]")
            if problem:
                return problem, value
            checked_map[key] = item
        value = checked_map
    return None, value


def _describe(exc: BaseException) -> str:
    message = str(exc).strip()
    if isinstance(exc, ValueError) and message:
        return message
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _cut(message: str) -> str:
    message = " ".join(message.split()) if "\n" in message else message
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS - 3] + "..."


def _as_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list)):
        try:
            return json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


def _no_running_loop(name: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"tool {name!r} is async and ToolRegistry.call runs it with asyncio.run: call it from a "
                       f"worker thread (no running event loop), e.g. loop.run_in_executor(None, registry.call, call)")


async def _awaited(awaitable):
    return await awaitable
