"""A tokenizer's chat template (a model's code, often a stranger's) is rendered with bounds on the
size of what it builds and on its work (data/chat_template.py). Before, prompts were rendered by
transformers' apply_chat_template, whose jinja sandbox bounds neither: `{{ 'x' * 10**8 }}` made a
100 MB prompt (built when the template was compiled), `'x'|center(10**10)` 10 GB, and nested loops
ran for hours, in the preflight's prompt check and in every rollout. The limits on steps and items
are lowered here so that each case ends in milliseconds."""

from __future__ import annotations

import time

import pytest

from megatron_rl.data import chat_template
from megatron_rl.data.chat import render_prompt
from megatron_rl.data.chat_template import TemplateLimit, render_chat_template
from megatron_rl.data.tokenizer import build_char_tokenizer
from megatron_rl.errors import ConfigError

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}]
HOSTILE = {
    "repeated string": ("{{ 'x' * 10**8 }}", "would build a repeated sequence of more than 67108864 characters"),
    "centered": ("{{ 'x'|center(10**10) }}", "would build a center result of more than"),
    "ljust": ("{{ 'x'.ljust(10**10) }}", "would build a str.ljust result of more than"),
    "percent width": ("{{ '%1000000000s' % 'x' }}", "would build a formatted string of more than"),
    "keyed percent width": ("{{ '%(a)100000000s' % {'a': 'x'} }}", "would build a formatted string of more than"),
    "keyed percent precision": ("{{ '%(a).100000000f'|format(a=1.5) }}", "would build a formatted string of more"),
    "format width": ("{{ '{:>{}}'.format('x', 10**9) }}", "formats with a width of 8 digits or one taken from"),
    "replace": ("{{ ('ab' * 1000)|replace('', 'y' * 100000) }}", "would build a replace result of more than"),
    "power": ("{{ 2 ** (10 ** 9) }}", "computes 2 ** 1000000000, an integer of more than 65536 bits"),
    "squaring": ("{% set ns = namespace(n=3**20000) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
                 "multiplies two integers into one of more than 65536 bits"),
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 "would build a value of more than 67108864 characters"),
    "shared lists": ("{% set ns = namespace(l=[1]) %}{% for i in range(60) %}{% set ns.l = [ns.l, ns.l] %}"
                     "{% endfor %}{{ ns.l }}", "would build a value of more than"),
    "nested ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      "took more than 20000 steps (loop iterations and calls) to render one conversation"),
    "exponential macro": ("{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                          "took more than 20000 steps"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_template_is_refused_by_its_bound_within_a_second(monkeypatch, case):
    monkeypatch.setattr(chat_template, "MAX_STEPS", 20_000)
    monkeypatch.setattr(chat_template, "MAX_ITEMS", 20_000)
    template, named = HOSTILE[case]
    tokenizer = build_char_tokenizer(chat_template=template)
    tick = time.perf_counter()
    with pytest.raises(ConfigError, match="the chat template ") as refused:  # the prompt check's path
        render_prompt(tokenizer, "1+1=", prompt_format="chat", system_prompt="be brief")
    assert isinstance(refused.value, TemplateLimit) and named in str(refused.value), str(refused.value)
    assert str(refused.value).endswith("fix it in the model's tokenizer_config.json or chat_template.jinja)")
    assert time.perf_counter() - tick < 1.0


@pytest.mark.parametrize("template", ["{% set s = 'x' * 1000000 %}{{ range(100)|map('string')|join(s) }}",
                                      "{% set s = 'x' * 1000000 %}{{ ('abc' * 40)|join(s) }}",
                                      "{{ '%(a)100000000s' % {'a': 'x'} }}"])
def test_a_multiplying_filter_or_format_is_refused_before_its_result_is_built(template):
    """The join filter's separator times its items and a keyed `%` width are checked before they
    run: traced, the render allocates a small part of the 100 MB result it refuses (before, the
    result was built whole and refused after; a 60 MB separator over 100000 items was 6 TB)."""
    import tracemalloc

    tokenizer = build_char_tokenizer(chat_template=template)
    tracemalloc.start()
    try:
        with pytest.raises(TemplateLimit, match="would build a (join result|formatted string) of more than"):
            render_chat_template(tokenizer, MESSAGES, add_generation_prompt=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20, f"{peak / 2**20:.0f} MiB allocated while refusing"


def test_the_projects_template_renders_as_transformers_renders_it():
    """The tiny ChatML template with a system prompt, tools and without: the same text as
    apply_chat_template (the families' published templates: tests/agents/test_chat_format.py)."""
    tokenizer = build_char_tokenizer()
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    for extra in ({}, {"tools": tools}):
        for generation in (True, False):
            assert render_chat_template(tokenizer, MESSAGES, add_generation_prompt=generation, **extra) == \
                tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation, **extra)


def test_a_long_agent_conversation_costs_work_in_proportion_to_its_turns(monkeypatch):
    """Qwen3's published template asks `messages|length` once per message: the filter's input was
    measured (every message walked) at each call, so the work grew with the square of the turns
    (256 tool rounds: 4.2 s, 60 times transformers' 0.07 s; 512 refused at the 10 s bound). The
    work of 256 rounds is about twice that of 128 (steps: loop iterations, calls and walked items),
    and the text is transformers'."""
    from pathlib import Path

    template = (Path(__file__).parents[1] / "agents" / "chat_templates" / "qwen3.jinja").read_text()
    tokenizer = build_char_tokenizer(chat_template=template)
    budgets = []

    class Recorded(chat_template._Budget):
        def __init__(self):
            super().__init__()
            budgets.append(self)

    monkeypatch.setattr(chat_template, "_Budget", Recorded)

    def steps(rounds: int) -> int:
        messages = [{"role": "system", "content": "s"}]
        for i in range(rounds):
            call = {"type": "function", "function": {"name": "calc", "arguments": {"a": i}}}
            messages += [{"role": "user", "content": f"q{i}"},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "content": f"r{i}"}, {"role": "assistant", "content": f"a{i}"}]
        text = render_chat_template(tokenizer, messages, add_generation_prompt=True)
        assert text == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return budgets[-1].steps

    steps(1)  # compiled (its own budget)
    small, large = steps(128), steps(256)
    assert large < 2.5 * small, (small, large)
