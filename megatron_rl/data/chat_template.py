"""A tokenizer's chat template rendered with bounds on what it may build and how long it may run.

A chat template is code that comes with a model (tokenizer_config.json, chat_template.jinja),
often a stranger's. transformers renders it in jinja2's ImmutableSandboxedEnvironment, which
stops attribute escapes but not size or time: `{{ 'x' * 10**8 }}` builds 100 MB (at compile
time: jinja folds constant expressions), `'x'|center(10**10)` 10 GB, `{% set ns.s = ns.s ~ ns.s %}`
doubles a string each loop, and two nested `range(100000)` loops run for hours. The preflight's
prompt check and every rollout render the template, so a run (or `megatron-rl eval` of a
downloaded model) stalled or was killed by the kernel.

Here the template is compiled and rendered as transformers does (the same environment options,
globals, filters and variables: `messages`, `tools`, `documents`, `add_generation_prompt`, the
tokenizer's special tokens, the caller's kwargs), in a sandbox that also bounds:

- size: no value it builds (a string, a list, their nesting through shared references) and not
  its output may exceed MAX_TEXT characters (items count one each). Operations that can multiply
  a size in one step (`*`, `**`, `%` and str.format widths, str.center / ljust / rjust / zfill /
  replace / join / expandtabs, the filters center, indent, wordwrap, replace, join, format, batch,
  tojson) are checked before they run; every other result, filter, list or dict built, and `~`,
  right after (so nothing grows past twice the bound);
- work: every loop iteration and call counts one step; a render may take MAX_STEPS of them and
  MAX_SECONDS of time.

A bound reached is a TemplateLimit (a ConfigError) naming the limit; the render is abandoned.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from datetime import datetime
from typing import Any

from megatron_rl.errors import ConfigError

MAX_TEXT = 64 << 20  # characters: 4 times data.max_line_bytes' default, for a conversation of several turns
MAX_STEPS = 1_000_000  # loop iterations and calls of one render: real templates take hundreds to thousands
MAX_SECONDS = 10.0
MAX_ITEMS = 1_000_000  # items of one value (a list of lists ...): a conversation's messages are hundreds
MAX_INT_BITS = 1 << 16  # `**` results: a 65536-bit integer is already far beyond any template's arithmetic
_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)
# A `%` conversion's width and precision, after its mapping key if any (`%(name)9s`: keyed by a dict)
_FORMAT_WIDTH = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_WIDTH = re.compile(r"\{[^{}]*:[^{}]*(\{|\d{8,})")


class TemplateLimit(ConfigError):
    """A chat template reached one of this module's bounds."""


class _Budget:
    def __init__(self):
        self.steps, self.started = 0, time.monotonic()

    def _charge(self, steps: int = 1) -> None:
        self.steps += steps
        if self.steps > MAX_STEPS:
            raise TemplateLimit(f"the chat template took more than {MAX_STEPS} steps (loop iterations and calls) to "
                                "render one conversation: refused, as a template that would not end")
        if time.monotonic() - self.started > MAX_SECONDS:
            raise TemplateLimit(f"the chat template took more than {MAX_SECONDS:g} s to render one conversation: "
                                "refused, as a template that would not end")


def _charge(steps: int = 1) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget._charge(steps)


def weight(value: Any, limit: int = MAX_TEXT) -> int:
    """Characters of its strings plus one per item, shared parts counted each time they occur (as
    str() would write them); stops counting once over `limit`, or at more than MAX_ITEMS items
    (then over `limit` too: walking a structure of shared references costs its items' count)."""
    total, stack, visited = 0, [value], 0
    while stack and total <= limit:
        visited += 1
        if visited > MAX_ITEMS:
            return limit + 1
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, dict):
            total += len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += len(item)
            stack.extend(item)
        else:
            total += 1
    if visited >= 1024:  # walking a large value is work too: a step per 1024 items
        _charge(visited >> 10)
    return total


def _within(size: int, what: str) -> None:
    if size > MAX_TEXT:
        raise TemplateLimit(f"the chat template would build {what} of more than {MAX_TEXT} characters: refused")


def sized(value: Any, what: str = "a value") -> Any:
    _within(weight(value), what)
    return value


def _format_widths(text: str, args: Any) -> None:
    """Refuses a `%` format whose widths or precisions would make more than MAX_TEXT."""
    for match in _FORMAT_WIDTH.finditer(text):
        for width in match.groups():
            if width == "*":
                raise TemplateLimit("the chat template formats with a '*' width: refused (widths must be written)")
            if width is not None:
                _within(int(width), "a formatted string")
    _within(len(text) + weight(args), "a formatted string")


def _str_method(method: Any, args: tuple, kwargs: dict) -> tuple:
    """Pre-checks the str methods that can multiply a size in one call; returns the arguments to
    call it with (join's iterable, read here, as a list)."""
    text, name = method.__self__, method.__name__
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        _within(args[0], f"a str.{name} result")
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        _within(len(text) + text.count("\t") * (tab if isinstance(tab, int) else 8), "an expandtabs result")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _within(_replaced(text, args[0], args[1]), "a str.replace result")
    elif name == "join" and args:
        items = list(args[0])
        _within(weight(items) + len(text) * len(items), "a str.join result")
        return (items, *args[1:])
    return args


def _replaced(text: str, old: str, new: str) -> int:
    occurrences = text.count(old) if old else len(text) + 1
    return len(text) + occurrences * max(0, len(new) - len(old))


def _checked_filter(name: str, function):
    """`function` (a jinja filter) with its input's size and, for those that multiply it, its
    arguments checked before it runs, and its result after."""
    offset = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(function)
    def checked(*args, **kwargs):
        _charge()
        value, params = (args[offset] if len(args) > offset else None), args[offset + 1:]
        # The input is measured only where the check below needs its size: it was measured when it
        # was built (or is the caller's), and `messages|length` in a loop over the messages had
        # made the work grow with the square of the conversation's turns.
        size = weight(value) if name in ("indent", "wordwrap", "tojson") else 0
        _within(size, f"the input of the {name} filter")
        width = params[0] if params else kwargs.get("width", kwargs.get("linecount"))
        if name in ("center", "batch") and isinstance(width, int):
            _within(width, f"a {name} result")
        elif name == "indent":
            width = 4 if width is None else width
            _within(size + (str(value).count("\n") + 1) * (width if isinstance(width, int) else len(str(width))),
                    "an indent result")
        elif name == "wordwrap":
            wrap = kwargs.get("wrapstring", params[2] if len(params) > 2 else None) or "\n"
            every = width if isinstance(width, int) and width > 0 else 1
            _within(size + (size // every + 1) * len(str(wrap)), "a wordwrap result")
        elif name == "replace" and len(params) >= 2:
            _within(_replaced(str(value), str(params[0]), str(params[1])), "a replace result")
        elif name == "format" and isinstance(value, str):
            _format_widths(value, (params, kwargs))
        elif name == "tojson":
            indent = kwargs.get("indent", params[1] if len(params) > 1 else None)
            _within(size * (1 + (indent if isinstance(indent, int) else len(str(indent or "")))), "a tojson result")
        elif name == "join" and value is not None:  # the separator once per item: read here, as a list
            items = list(value)
            separator = kwargs.get("d", params[0] if params else "")
            _within(weight(items) + len(str(separator)) * len(items), "a join result")
            args = (*args[:offset], items, *args[offset + 1:])
        result = function(*args, **kwargs)
        return result if result is value else sized(result, f"a {name} result")  # `default` hands its input back

    return checked


def _environment():
    """transformers' chat template environment (utils/chat_template_utils.py), bounded."""
    import jinja2.ext
    from jinja2 import nodes, pass_context
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        # Intercepted, these are also never folded at compile time (jinja's constant folding).
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def __init__(self):
            super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
            self.concat = self._bounded_concat
            self.finalize = lambda value: sized(value, "an output")

        def _bounded_concat(self, parts) -> str:
            out, total = [], 0
            for part in parts:
                total += len(part)
                _within(total, "an output")
                out.append(part)
            return "".join(out)

        def call_binop(self, context, operator, left, right):
            _charge()
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
                if abs(left) > 1 and right * abs(left).bit_length() > MAX_INT_BITS:
                    raise TemplateLimit(f"the chat template computes {left} ** {right}, an integer of more than "
                                        f"{MAX_INT_BITS} bits: refused")
            elif operator == "*":
                if isinstance(left, int) and isinstance(right, int) and \
                        abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:  # squared again and again
                    raise TemplateLimit(f"the chat template multiplies two integers into one of more than "
                                        f"{MAX_INT_BITS} bits: refused")
                sequence, times = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(times, int) and isinstance(sequence, (str, bytes, list, tuple)):
                    _within(weight(sequence) * max(times, 0), "a repeated sequence")
            elif operator == "%" and isinstance(left, str):
                _format_widths(left, right)
            return sized(super().call_binop(context, operator, left, right), "a value")

        def wrap_str_format(self, value):
            text = getattr(value, "__self__", None)
            if getattr(value, "__name__", None) in ("format", "format_map") and isinstance(text, str) \
                    and _BRACE_WIDTH.search(text):
                raise TemplateLimit("the chat template formats with a width of 8 digits or one taken from an "
                                    "argument: refused")
            return super().wrap_str_format(value)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            _charge()
            if isinstance(getattr(__obj, "__self__", None), str):
                args = _str_method(__obj, args, kwargs)
            return sized(super().call(__context, __obj, *args, **kwargs), "a call's result")

        def _parse(self, source, name, filename):
            return Guard().visit(super()._parse(source, name, filename))

    class Guard(NodeTransformer):
        """Loops count their iterations; `~`, list, dict and tuple literals have their size checked."""

        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = nodes.Filter(node.iter, "megatron_rl_counted", [], [], None, None, lineno=node.lineno)
            return node

        def visit_built(self, node):
            node = self.generic_visit(node)
            if getattr(node, "ctx", "load") != "load":  # an assignment's target (`{% set a, b = ... %}`)
                return node
            return nodes.Filter(node, "megatron_rl_sized", [], [], None, None, lineno=node.lineno)

        visit_Concat = visit_List = visit_Dict = visit_Tuple = visit_built

    @pass_context
    def counted(context, iterable):
        for item in iterable:
            _charge()
            yield item

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = BoundedSandbox()
    environment.filters["tojson"] = tojson
    environment.filters = {name: _checked_filter(name, function) for name, function in environment.filters.items()}
    environment.filters["megatron_rl_counted"] = counted
    environment.filters["megatron_rl_sized"] = pass_context(lambda context, value: sized(value))
    environment.globals.pop("lipsum", None)  # lipsum(n=10**9) writes that many paragraphs
    # range stays jinja's sandbox's (at most 100000 items, as transformers renders it): `range(N)|list`
    environment.globals.update(raise_exception=raise_exception,
                               strftime_now=lambda format: datetime.now().strftime(format))
    return environment


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    token = _BUDGET.set(_Budget())  # compiling folds constant expressions: bounded too
    try:
        return _environment().from_string(template)
    finally:
        _BUDGET.reset(token)


def render_chat_template(tokenizer, messages: list[dict], *, add_generation_prompt: bool, tools=None,
                         **kwargs: Any) -> str:
    """What `tokenizer.apply_chat_template(messages, tokenize=False, ...)` returns, rendered within
    this module's bounds (TemplateLimit otherwise)."""
    template = tokenizer.get_chat_template(None, tools)
    token = _BUDGET.set(_Budget())
    try:
        compiled = _compiled(template)
        variables = {**tokenizer.special_tokens_map, **kwargs}
        return compiled.render(messages=messages, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **variables)
    except TemplateLimit as exc:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise TemplateLimit(f"{exc} (the chat template of the tokenizer {name!r}: fix it in the model's "
                            "tokenizer_config.json or chat_template.jinja)") from None
    finally:
        _BUDGET.reset(token)
