"""The chat-format adapter (agents/chat_format.py) against the real chat templates of each family.

The templates are the public ones, stored under chat_templates/<family>.jinja (first line: where
each was copied from; the loader strips it). No tokenizer can be downloaded here, so each family
gets a byte-level `PreTrainedTokenizerFast` with no merges whose added tokens are the family's
special tokens (so <|im_end|>, <|eot_id|>, <｜end▁of▁sentence｜>, <|observation|> ... are one id
each, as in the real vocabularies): the real template logic with real special-token boundaries.

A rollout is simulated as the engine would run it: the prompt from `prompt_ids`, each model turn
the ids of the text the model writes plus the stop id it samples, each observation from
`observation_ids`. Checked, per family, on a 3-turn tool conversation (call, result, call,
result, answer; Qwen3 and GLM-4.5 with reasoning): every turn's prompt extends the previous ids
exactly, and equals the template's own rendering of the history so far (generation prompt
included); the whole trajectory equals the template's render of the conversation; the warm
start's `conversation_ids` gives the same ids and mask. Then each family's quirks, the turn cut
by the token budget, the "\\n" after <|im_end|>, the places where a template's re-render of the
history differs from the trajectory (and what the adapter does there), and adapters broken on
purpose, which the same checks catch.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from megatron_rl.agents.chat_format import ChatFormat, family_of, hermes_tools_block
from megatron_rl.data.tokenizer import PLAIN_CHAT_TEMPLATE, build_char_tokenizer
from megatron_rl.errors import ConfigError

TEMPLATES = Path(__file__).parent / "chat_templates"


def load_template(family: str) -> str:
    """The template as published: the fixture without its `{# source: ... #}` first line."""
    first, _, template = (TEMPLATES / f"{family}.jinja").read_text().partition("\n")
    assert first.startswith("{# source: ") and first.endswith(" #}"), f"{family}.jinja: first line names its source"
    return template


def byte_tokenizer(special: list[str], added: list[str], template: str, **named) -> PreTrainedTokenizerFast:
    """Byte-level, no merges (every ordinary byte is a token); `special` and `added` (not special,
    as Qwen's <tool_call> / <think>) are single ids."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={char: index for index, char in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    core.add_tokens([AddedToken(token, special=False, normalized=False) for token in added])
    return PreTrainedTokenizerFast(tokenizer_object=core, chat_template=template, clean_up_tokenization_spaces=False,
                                   **named)


QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
DS = {name: f"<｜{name}｜>" for name in ("begin▁of▁sentence", "end▁of▁sentence", "User", "Assistant",
                                        "tool▁calls▁begin", "tool▁calls▁end", "tool▁call▁begin", "tool▁call▁end",
                                        "tool▁outputs▁begin", "tool▁outputs▁end", "tool▁output▁begin",
                                        "tool▁output▁end", "tool▁sep")}
VOCABULARIES = {  # (special, added, named tokens) as in each family's tokenizer_config.json
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], QWEN_ADDED,
              dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")),
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], QWEN_ADDED,
              dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|eom_id|>", "<|python_tag|>"], [], dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")),
    "deepseek_v3": ([DS["begin▁of▁sentence"], DS["end▁of▁sentence"]],
                    [token for name, token in DS.items() if "sentence" not in name],
                    dict(bos_token=DS["begin▁of▁sentence"], eos_token=DS["end▁of▁sentence"])),
    "glm45": (["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
              ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
               "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
              dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>")),
}
MODEL_TYPES = {"chatml": "qwen3_moe", "qwen3": "qwen3_moe", "qwen2": "qwen2", "llama3": "llama",
               "deepseek_v3": "deepseek_v3", "glm45": "glm4_moe"}
# Llama's template writes today's date (strftime_now): pinned so renders compare across midnight.
TEMPLATE_KWARGS = {"llama3": {"date_string": "26 Jul 2024"}}
FAMILIES = list(MODEL_TYPES)


@functools.cache
def tokenizer_for(family: str):
    if family == "chatml":
        return build_char_tokenizer()  # the tiny tokenizer (its ChatML template, the Hermes tool tags)
    special, added, named = VOCABULARIES[family]
    return byte_tokenizer(special, added, load_template(family), **named)


@functools.cache
def chat_for(family: str) -> ChatFormat:
    return ChatFormat.for_tokenizer(tokenizer_for(family), MODEL_TYPES[family],
                                    chat_template_kwargs=TEMPLATE_KWARGS.get(family))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def token_id(tokenizer, token: str) -> int:
    ids = encode(tokenizer, token)
    assert len(ids) == 1, f"{token!r} is not one token"
    return ids[0]


# ---- the scripted conversation -------------------------------------------------------------------

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
TOOLS = [CALCULATOR]
PROMPT = [{"role": "system", "content": "you are a careful calculator user"},
          {"role": "user", "content": "what is 12*34+1?"}]
EXPRESSIONS, RESULTS, ANSWER = ("12*34", "408+1"), ("408", "409"), "409"
REASONS = ("multiply first", "then add one", "so 409")


def structured_call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


def call_text(family: str, expression: str) -> str:
    """A tool call as the family's model writes it (as its template renders an assistant tool call)."""
    if family == "llama3":
        return '{"name": "calculator", "parameters": {"expression": "%s"}}' % expression
    if family == "deepseek_v3":
        return (f"{DS['tool▁calls▁begin']}{DS['tool▁call▁begin']}function{DS['tool▁sep']}calculator\n"
                f'```json\n{{"expression": "{expression}"}}\n```{DS["tool▁call▁end"]}{DS["tool▁calls▁end"]}')
    if family == "glm45":
        return (f"<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>{expression}</arg_value>\n"
                "</tool_call>")
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expression


@dataclass
class Turn:
    text: str  # what the model writes (its sampled ids: encode(text) + [stop])
    stop: str  # the stop token it samples
    message: dict  # the turn as an OpenAI-style message, for the template's own render
    observation: list[dict] = field(default_factory=list)  # the environment's answer (none after the last)


def tool_conversation(family: str) -> list[Turn]:
    """Two tool calls and the answer, as the family's model writes them."""
    ends = {"llama3": "<|eot_id|>", "deepseek_v3": DS["end▁of▁sentence"], "glm45": "<|user|>"}
    end = ends.get(family, "<|im_end|>")
    turns = []
    for index in range(3):
        last = index == 2
        observation = [] if last else [{"role": "tool", "content": RESULTS[index]}]
        body = ANSWER if last else call_text(family, EXPRESSIONS[index])
        calls = {} if last else {"tool_calls": [structured_call(EXPRESSIONS[index])]}
        if family == "qwen3":  # thinking mode: every turn reasons first
            text = f"<think>\n{REASONS[index]}\n</think>\n\n{body}"
            message = {"role": "assistant", "content": ANSWER if last else "", "reasoning_content": REASONS[index],
                       **calls}
        elif family == "glm45":  # the model writes "\n<think>...</think>\n" after <|assistant|>
            text = f"\n<think>{REASONS[index]}</think>\n{body}"
            message = {"role": "assistant", "content": ANSWER if last else "", "reasoning_content": REASONS[index],
                       **calls}
        elif family == "chatml":  # the tiny template has no tool support: calls stay in the content
            text, message = body, {"role": "assistant", "content": body}
        else:
            text = body
            message = {"role": "assistant", "content": ANSWER if last else ("" if family != "deepseek_v3" else None),
                       **calls}
        stop = "<|observation|>" if family == "glm45" and not last else end
        turns.append(Turn(text, stop, message, observation))
    return turns


# What each template writes after the final assistant turn's content when it renders the whole
# conversation (the trajectory ends with the stop id the model sampled instead).
FINAL_TAIL = {"chatml": "<|im_end|>\n", "qwen3": "<|im_end|>\n", "qwen2": "<|im_end|>\n", "llama3": "<|eot_id|>",
              "deepseek_v3": DS["end▁of▁sentence"] + "\n", "glm45": ""}


def render(family: str, messages: list[dict], *, generation_prompt: bool) -> str:
    """The template's own rendering of a history, with the tools."""
    tokenizer = tokenizer_for(family)
    return tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=generation_prompt,
                                         tokenize=False, **TEMPLATE_KWARGS.get(family, {}))


def comparable(family: str, ids: list[int]):
    """Ids as compared with a template render. vLLM's DeepSeek-V3 tool template leaks its jinja
    indentation: runs of spaces and newlines around its special tokens that differ between the
    generation-prompt rendering and the message rendering (e.g. 20 spaces after <｜Assistant｜>
    when an assistant tool call is re-rendered, a newline when the generation prompt is). No model
    output can match both, so for that family whitespace touching a <｜...｜> token is ignored;
    every other family is compared id for id."""
    if family != "deepseek_v3":
        return ids
    text = tokenizer_for(family).decode(ids)
    return re.sub(r"\s+(?=<｜)|(?<=｜>)\s+", "", text)


def simulate_rollout(chat: ChatFormat, family: str, turns: list[Turn], *, prompt=PROMPT, cut: int | None = None):
    """(ids, mask, prompts): the trajectory as the multi-turn loop builds it, and each turn's prompt.
    `cut`: that turn hit the token budget (no stop id sampled)."""
    tokenizer = chat.tokenizer
    ids = chat.prompt_ids(prompt, tools=TOOLS)
    mask, prompts = [0] * len(ids), [list(ids)]
    for index, turn in enumerate(turns):
        sampled = encode(tokenizer, turn.text)
        if index != cut:
            sampled.append(token_id(tokenizer, turn.stop))
        ids += sampled
        mask += [1] * len(sampled)
        if turn.observation:
            observation = chat.observation_ids(turn.observation, sampled[-1])
            ids += observation
            mask += [0] * len(observation)
            prompts.append(list(ids))
    return ids, mask, prompts


def check_tool_conversation(chat: ChatFormat, family: str) -> None:
    """The main per-family check (assertions); reused against broken adapters below."""
    tokenizer = chat.tokenizer
    turns = tool_conversation(family)
    ids, mask, prompts = simulate_rollout(chat, family, turns)
    history = list(PROMPT)
    for step, prompt in enumerate(prompts):
        if step:  # each turn's prompt extends the previous tokens exactly (vLLM's prefix cache reuses them)
            assert prompt[:len(prompts[step - 1])] == prompts[step - 1], f"{family}: turn {step + 1} rewrote its prompt"
            history += [turns[step - 1].message, *turns[step - 1].observation]
        expected = encode(tokenizer, render(family, history, generation_prompt=True))
        assert comparable(family, prompt) == comparable(family, expected), (
            f"{family}: turn {step + 1}'s prompt is not the template's own render of the history\n"
            f"  ours:     {tokenizer.decode(prompt)!r}\n  template: {tokenizer.decode(expected)!r}")
    history.append(turns[-1].message)
    full = encode(tokenizer, render(family, history, generation_prompt=False))
    ours = ids[:-1] + encode(tokenizer, FINAL_TAIL[family])  # the final stop id -> what the template writes there
    assert comparable(family, ours) == comparable(family, full), (
        f"{family}: the trajectory is not the template's render of the conversation\n"
        f"  ours:     {tokenizer.decode(ours)!r}\n  template: {tokenizer.decode(full)!r}")
    # the warm start's path: the same ids and mask from the conversation's messages
    conversation = list(PROMPT)
    for turn in turns:
        conversation += [{"role": "assistant", "content": turn.text}, *turn.observation]
    assert chat.conversation_ids(conversation, tools=TOOLS) == (ids, mask), f"{family}: conversation_ids differs"


# ---- the checks, per family ----------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_three_turn_tool_conversation_matches_the_template(family):
    chat = chat_for(family)
    assert chat.family == family
    check_tool_conversation(chat, family)


def check_cut_turn(chat: ChatFormat, family: str) -> None:
    """A turn cut by the token budget (no stop id sampled): the template's end-of-turn token is
    appended with the observation (the #6501 bug drops it at every assistant -> tool boundary), and
    the next prompt is the template's render of the cut text as the assistant's content."""
    tokenizer = chat.tokenizer
    turns = tool_conversation(family)
    partial = turns[0].text[: len(turns[0].text) // 2].rstrip()  # cut mid-call (templates trim/strip content)
    turns[0] = Turn(partial, turns[0].stop, {"role": "assistant", "content": partial}, turns[0].observation)
    ids, mask, prompts = simulate_rollout(chat, family, turns[:2], cut=0)
    expected = encode(tokenizer, render(family, [*PROMPT, turns[0].message, *turns[0].observation],
                                        generation_prompt=True))
    assert comparable(family, prompts[1]) == comparable(family, expected), (
        f"{family}: the prompt after a cut turn is not the template's render\n"
        f"  ours:     {tokenizer.decode(prompts[1])!r}\n  template: {tokenizer.decode(expected)!r}")
    # the cut turn's tokens are all the model's; the separator (the first observation id) is not
    cut_at = len(prompts[0]) + len(encode(tokenizer, partial))
    assert ids[cut_at] in chat.stop_token_ids and mask[cut_at] == 0, f"{family}: no separator after the cut turn"
    assert set(mask[len(prompts[0]):cut_at]) == {1}


@pytest.mark.parametrize("family", FAMILIES)
def test_turn_cut_by_the_budget_gets_the_whole_separator(family):
    check_cut_turn(chat_for(family), family)
    observation = [{"role": "tool", "content": "408"}]
    assert chat_for(family).observation_ids(observation, None)[0] in chat_for(family).stop_token_ids


@pytest.mark.parametrize("family", ["chatml", "qwen2", "qwen3"])
def test_newline_after_im_end_is_kept(family):
    """verl #3720: the template writes "<|im_end|>\\n"; the model samples <|im_end|> and stops, so
    the "\\n" must come with the observation, else every later turn's prompt differs from what the
    model saw after a single-turn render."""
    chat, tokenizer = chat_for(family), tokenizer_for(family)
    im_end = token_id(tokenizer, "<|im_end|>")
    observation = chat.observation_ids([{"role": "tool", "content": "408"}], im_end)
    assert tokenizer.decode(observation[:1]) == "\n" and observation[0] not in chat.stop_token_ids
    assert tokenizer.decode(observation).startswith("\n<|im_start|>")
    # and the final turn of a conversation: <|im_end|> only (the "\n" belongs to the next turn)
    ids, mask = chat.conversation_ids([*PROMPT, {"role": "assistant", "content": "409"}])
    assert ids[-1] == im_end and mask[-1] == 1


# ---- family quirks -------------------------------------------------------------------------------


def test_families_stop_ids_and_tool_call_formats():
    expected = {
        "chatml": ("hermes", ["<|im_end|>", "<|eos|>"], "<|im_end|>"),
        "qwen3": ("hermes", ["<|im_end|>"], "<|im_end|>"),
        "qwen2": ("hermes", ["<|im_end|>"], "<|im_end|>"),
        "llama3": ("llama3_json", ["<|eot_id|>", "<|eom_id|>"], "<|eot_id|>"),
        "deepseek_v3": ("deepseek_v3", [DS["end▁of▁sentence"]], DS["end▁of▁sentence"]),
        "glm45": ("glm45", ["<|user|>", "<|observation|>", "<|endoftext|>"], "<|user|>"),
    }
    for family, (fmt, stops, end) in expected.items():
        chat, tokenizer = chat_for(family), tokenizer_for(family)
        assert chat.tool_call_format == fmt
        assert list(chat.stop_token_ids) == [token_id(tokenizer, token) for token in stops], family
        assert chat.end_of_turn_id == token_id(tokenizer, end), family


def test_family_from_model_type_template_or_the_tiny_tokenizer():
    for family in ("qwen3", "qwen2", "llama3", "deepseek_v3", "glm45"):
        assert family_of(tokenizer_for(family), MODEL_TYPES[family]) == family
        assert family_of(tokenizer_for(family)) == family  # no model_type: told by the template
    assert family_of(tokenizer_for("qwen3"), "qwen3") == "qwen3"
    assert family_of(tokenizer_for("qwen2"), "qwen2_moe") == "qwen2"
    tiny = build_char_tokenizer()
    for model_type in (None, "qwen3_moe", "llama", "deepseek_v3", "glm4_moe", "gpt2"):
        assert ChatFormat.for_tokenizer(tiny, model_type).family == "chatml"  # the tiny presets name real models
    with pytest.raises(ConfigError, match="need a chat template.*has none"):
        ChatFormat.for_tokenizer(build_char_tokenizer(chat_template=None), "qwen3")
    with pytest.raises(ConfigError, match="no multi-turn chat format for model_type 'mistral'"):
        ChatFormat.for_tokenizer(tokenizer_for("qwen2"), "mistral")
    with pytest.raises(ConfigError, match="end-of-turn tokens"):  # model_type naming another family's vocabulary
        ChatFormat.for_tokenizer(tokenizer_for("qwen2"), "llama")


def test_qwen_renders_tool_results_as_one_user_turn_and_merges_consecutive_ones():
    chat, tokenizer = chat_for("qwen3"), tokenizer_for("qwen3")
    im_end = token_id(tokenizer, "<|im_end|>")
    observation = chat.observation_ids([{"role": "tool", "content": "408"}, {"role": "tool", "content": "7"}], im_end)
    assert tokenizer.decode(observation) == ("\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n"
                                             "<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # a tool result then a user message: two turns
    mixed = chat.observation_ids([{"role": "tool", "content": "408"}, {"role": "user", "content": "and?"}], im_end)
    assert tokenizer.decode(mixed).endswith("</tool_response><|im_end|>\n<|im_start|>user\nand?<|im_end|>\n"
                                            "<|im_start|>assistant\n")


def test_qwen3_without_thinking_puts_the_empty_think_block_in_every_generation_prompt():
    tokenizer = tokenizer_for("qwen3")
    chat = ChatFormat.for_tokenizer(tokenizer, "qwen3", chat_template_kwargs={"enable_thinking": False})
    observation = chat.observation_ids([{"role": "tool", "content": "408"}], token_id(tokenizer, "<|im_end|>"))
    assert tokenizer.decode(observation).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_llama_tool_results_are_ipython_turns_and_eom_stands_in_for_eot():
    chat, tokenizer = chat_for("llama3"), tokenizer_for("llama3")
    eot, eom = token_id(tokenizer, "<|eot_id|>"), token_id(tokenizer, "<|eom_id|>")
    after_eot = chat.observation_ids([{"role": "tool", "content": "408"}], eot)
    # the 3.1 template writes a string result with tojson (a string is iterable in jinja)
    assert tokenizer.decode(after_eot) == ('<|start_header_id|>ipython<|end_header_id|>\n\n"408"<|eot_id|>'
                                           "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert chat.observation_ids([{"role": "tool", "content": "408"}], eom) == after_eot  # <|eom_id|> ends it too
    assert chat.observation_ids([{"role": "ipython", "content": "408"}], eot) == after_eot


def test_deepseek_tool_results_are_an_outputs_block_without_a_generation_prompt():
    chat, tokenizer = chat_for("deepseek_v3"), tokenizer_for("deepseek_v3")
    eos = token_id(tokenizer, DS["end▁of▁sentence"])
    text = tokenizer.decode(chat.observation_ids([{"role": "tool", "content": "408"}, {"role": "tool", "content": "7"}],
                                                 eos))
    assert comparable("deepseek_v3", encode(tokenizer, text)) == (
        f"{DS['tool▁outputs▁begin']}{DS['tool▁output▁begin']}408{DS['tool▁output▁end']}"
        f"{DS['tool▁output▁begin']}7{DS['tool▁output▁end']}{DS['tool▁outputs▁end']}")
    # after a user message the template writes <｜Assistant｜> itself
    user = tokenizer.decode(chat.observation_ids([{"role": "user", "content": "and?"}], eos))
    assert user.startswith(DS["User"] + "and?" + DS["Assistant"])


def test_glm_ends_a_turn_with_the_next_roles_token():
    chat, tokenizer = chat_for("glm45"), tokenizer_for("glm45")
    observation_id, user_id = token_id(tokenizer, "<|observation|>"), token_id(tokenizer, "<|user|>")
    tool = [{"role": "tool", "content": "408"}]
    assert tokenizer.decode(chat.observation_ids(tool, observation_id)) == (
        "\n<tool_response>\n408\n</tool_response><|assistant|>")
    assert tokenizer.decode(chat.observation_ids([{"role": "user", "content": "and?"}], user_id)) == (
        "\nand?<|assistant|>")
    # stopped with <|user|> but the environment answers with a tool result: the sampled token
    # stays (it was sampled), and the template's <|observation|> follows it
    assert chat.observation_ids(tool, user_id) == chat.observation_ids(tool, None)
    assert tokenizer.decode(chat.observation_ids(tool, user_id)[:1]) == "<|observation|>"


# ---- where a template's re-render differs from the trajectory ------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "glm45"])
def test_reasoning_before_a_new_user_query_stays_as_sampled(family):
    """Qwen3 and GLM-4.5 render the reasoning only of assistant turns after the last user query:
    once a new user message arrives, a re-render strips every earlier <think> block (GLM leaves
    "<think></think>"), so the re-rendered prompt no longer extends the tokens the model sampled
    and trained on. The adapter never re-renders: the next prompt is the trajectory so far plus
    the user turn, the reasoning kept. It differs from the template's render of the history by
    exactly the stripped reasoning."""
    chat, tokenizer = chat_for(family), tokenizer_for(family)
    turn = tool_conversation(family)[2]  # a reasoned answer
    follow_up = [{"role": "user", "content": "and times 2?"}]
    turn = Turn(turn.text, turn.stop, turn.message, follow_up)
    ids, _, prompts = simulate_rollout(chat, family, [turn])
    assert prompts[1][:len(prompts[0])] == prompts[0]  # the sampled tokens are all still there
    rerendered = render(family, [*PROMPT, turn.message, *follow_up], generation_prompt=True)
    ours = tokenizer.decode(prompts[1])
    if family == "qwen3":
        stripped = ours.replace(f"<think>\n{REASONS[2]}\n</think>\n\n", "")
    else:
        stripped = ours.replace(f"<think>{REASONS[2]}</think>", "<think></think>")
    assert stripped != ours and stripped == rerendered
    # a loop that re-renders the history from the messages (TRL #5224-style) breaks the prefix:
    assert encode(tokenizer, rerendered)[:len(prompts[0]) + len(encode(tokenizer, turn.text))] != \
        prompts[1][:len(prompts[0]) + len(encode(tokenizer, turn.text))]


def test_qwen3_keeps_an_empty_think_block_the_template_drops_from_earlier_turns():
    """Within one query (tool results are not user queries for Qwen3) reasoned turns keep their
    <think> blocks in a re-render, which is why the 3-turn check above matches the template exactly.
    An *empty* reasoning block ("<think>\\n\\n</think>\\n\\n", as the model writes when it skips
    thinking) is rendered only on the last turn: re-rendered later, that turn loses it. The
    adapter keeps the block the model wrote."""
    chat, tokenizer = chat_for("qwen3"), tokenizer_for("qwen3")
    first = tool_conversation("qwen3")[0]
    empty = "<think>\n\n</think>\n\n"
    text = empty + call_text("qwen3", EXPRESSIONS[0])
    first = Turn(text, first.stop, {"role": "assistant", "content": text}, first.observation)
    _, _, prompts = simulate_rollout(chat, "qwen3", [first])
    rerendered = render("qwen3", [*PROMPT, first.message, *first.observation], generation_prompt=True)
    ours = tokenizer.decode(prompts[1])
    assert ours != rerendered and ours.replace(empty, "", 1) == rerendered


# ---- prompts and tools ---------------------------------------------------------------------------


def test_tiny_template_renders_tools_compactly():
    """The tiny ChatML template takes tools itself: a one-line instruction and one schema per line
    in the system turn (a system message is kept in front), no <|unk|>."""
    chat, tokenizer = chat_for("chatml"), tokenizer_for("chatml")
    ids = chat.prompt_ids([{"role": "user", "content": "1+2="}], tools=TOOLS)
    text = tokenizer.decode(ids)
    schemas = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in TOOLS)
    assert text == ('<|bos|><|im_start|>system\ntools, called as <tool_call>{"name": ..., "arguments": {...}}'
                    f"</tool_call>:{schemas}<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.unk_token_id not in ids
    with_system = tokenizer.decode(chat.prompt_ids(PROMPT, tools=TOOLS))
    assert with_system.startswith(f"<|bos|><|im_start|>system\n{PROMPT[0]['content']}\ntools, called as")
    assert with_system.count("<|im_start|>system") == 1


def test_hermes_tools_block_for_a_plain_chatml_template_is_qwens():
    """A ChatML template that takes no tools gets Qwen's block written into the system message:
    the same text the Qwen3 template renders for the same tools."""
    block = hermes_tools_block(TOOLS)
    qwen = tokenizer_for("qwen3").apply_chat_template([{"role": "user", "content": "q"}], tools=TOOLS, tokenize=False)
    assert f"<|im_start|>system\n{block}<|im_end|>" in qwen
    tokenizer = build_char_tokenizer(chat_template=PLAIN_CHAT_TEMPLATE)
    chat = ChatFormat.for_tokenizer(tokenizer, "qwen3_moe")
    assert chat.family == "chatml"
    alone = chat.prompt_ids([{"role": "user", "content": "1+2="}], tools=TOOLS)
    assert alone == encode(tokenizer, f"<|bos|><|im_start|>system\n{block}<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>"
                                      "\n<|im_start|>assistant\n")
    with_system = chat.prompt_ids(PROMPT, tools=TOOLS)
    head = encode(tokenizer, f"<|bos|><|im_start|>system\n{block}\n\n{PROMPT[0]['content']}<|im_end|>")
    assert with_system[:len(head)] == head and token_id(tokenizer, "<tool_call>") in with_system
    # no tools: the plain prompt, exactly as single-turn chat prompts are encoded
    assert tokenizer.decode(chat.prompt_ids(PROMPT)) == tokenizer.apply_chat_template(
        PROMPT, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama3", "deepseek_v3", "glm45"])
def test_templates_that_take_tools_get_them(family):
    text = tokenizer_for(family).decode(chat_for(family).prompt_ids(PROMPT, tools=TOOLS))
    assert '"name": "calculator"' in text and "evaluate an arithmetic expression" in text


def test_a_template_that_ignores_tools_is_a_config_error():
    plain = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    special, added, named = VOCABULARIES["qwen2"]
    chat = ChatFormat.for_tokenizer(byte_tokenizer(special, added, plain, **named), "qwen2")
    assert chat.prompt_ids(PROMPT)  # fine without tools
    with pytest.raises(ConfigError, match="'qwen2'.*ignores `tools`"):
        chat.prompt_ids(PROMPT, tools=TOOLS)


def test_a_role_the_template_drops_is_a_config_error():
    # Qwen's templates render system / user / assistant / tool and silently skip anything else
    chat, tokenizer = chat_for("qwen3"), tokenizer_for("qwen3")
    with pytest.raises(ConfigError, match=r"'qwen3'.*drops observation messages with role\(s\) \['ipython'\]"):
        chat.observation_ids([{"role": "ipython", "content": "408"}], token_id(tokenizer, "<|im_end|>"))


def test_a_template_whose_turns_do_not_end_with_a_stop_token_is_a_config_error():
    odd = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
           "{% if add_generation_prompt %}[assistant] {% endif %}")
    special, added, named = VOCABULARIES["qwen2"]
    with pytest.raises(ConfigError, match=r"'qwen2'.*writes '\\n\[user\] '.*end-of-turn token"):
        ChatFormat.for_tokenizer(byte_tokenizer(special, added, odd, **named), "qwen2")


def test_conversation_ids_takes_tool_calls_written_in_the_content_only():
    chat = chat_for("qwen2")
    with pytest.raises(ValueError, match="'tool_calls'.*write it into the content"):
        chat.conversation_ids([*PROMPT, {"role": "assistant", "content": "", "tool_calls": [structured_call("1")]}])
    with pytest.raises(ValueError, match="starts with the prompt"):
        chat.conversation_ids([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match="consecutive assistant turns"):
        chat.conversation_ids([*PROMPT, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}])
    with pytest.raises(ValueError, match="not the assistant's"):
        chat.observation_ids([{"role": "assistant", "content": "x"}], None)


def test_tiny_tokenizer_demonstration_of_the_mul_task():
    """The built-in agentic task's shape on the tiny tokenizer: one call, its result, the answer;
    every character inside the vocabulary (no <|unk|>), the tool tags single ids."""
    chat, tokenizer = chat_for("chatml"), tokenizer_for("chatml")
    conversation = [{"role": "user", "content": "123*456="},
                    {"role": "assistant", "content": call_text("chatml", "123*456")},
                    {"role": "tool", "content": "56088"},
                    {"role": "assistant", "content": "56088"}]
    ids, mask = chat.conversation_ids(conversation)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == (
        '<|bos|><|im_start|>user\n123*456=<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "calculator", '
        '"arguments": {"expression": "123*456"}}\n</tool_call><|im_end|>\n<|im_start|>tool\n56088<|im_end|>\n'
        "<|im_start|>assistant\n56088<|im_end|>")
    model = [token for token, bit in zip(ids, mask) if bit]
    assert tokenizer.decode(model) == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}'
                                       "\n</tool_call><|im_end|>56088<|im_end|>")


# ---- the checks catch broken adapters -----------------------------------------------------------


class DropsNewline(ChatFormat):
    """verl #3720: the "\\n" after <|im_end|> lost between turns."""

    def _after_turn(self, delta, last_token_id):
        out = super()._after_turn(delta, last_token_id)
        return out[1:] if self.tokenizer.decode(out[:1]) == "\n" else out


class DropsSeparator(ChatFormat):
    """verl #6501: the template's end-of-turn token dropped whatever the model sampled."""

    def _after_turn(self, delta, last_token_id):
        return delta[1:]


class RepeatsStop(ChatFormat):
    """The end-of-turn token written again after the sampled one."""

    def _after_turn(self, delta, last_token_id):
        return list(delta)


def test_the_checks_fail_on_broken_adapters():
    qwen = tokenizer_for("qwen2")
    with pytest.raises(AssertionError, match="qwen2: turn 2's prompt"):
        check_tool_conversation(DropsNewline(qwen, "qwen2"), "qwen2")
    for family in ("qwen3", "llama3", "glm45"):
        with pytest.raises(AssertionError, match=f"{family}: turn 2's prompt"):
            check_tool_conversation(RepeatsStop(tokenizer_for(family), family,
                                                chat_template_kwargs=TEMPLATE_KWARGS.get(family)), family)
    # a turn cut by the budget: dropping the separator is caught there (and only there: after a
    # sampled stop id the observation rightly starts after it)
    for family in ("qwen2", "deepseek_v3", "glm45"):
        broken = DropsSeparator(tokenizer_for(family), family)
        check_tool_conversation(broken, family)
        with pytest.raises(AssertionError, match=f"{family}: the prompt after a cut turn"):
            check_cut_turn(broken, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_bounded_renderer_writes_what_transformers_writes_for_every_family(family):
    """ChatFormat renders through data/chat_template.py (bounds on size and work); for each
    family's published template, the whole tool conversation and its prompt, with and without the
    generation prompt, are the text apply_chat_template writes."""
    from megatron_rl.data.chat_template import render_chat_template

    conversation = [*PROMPT]
    for turn in tool_conversation(family):
        conversation += [turn.message, *turn.observation]
    for messages in (PROMPT, conversation):
        for generation in (True, False):
            ours = render_chat_template(tokenizer_for(family), messages, add_generation_prompt=generation,
                                        tools=TOOLS, **TEMPLATE_KWARGS.get(family, {}))
            assert ours == render(family, messages, generation_prompt=generation), (family, len(messages), generation)
