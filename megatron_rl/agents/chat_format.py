"""Chat-template adapters for multi-turn rollouts: token in, token out.

    chat = ChatFormat.for_tokenizer(tokenizer, model_type)       # model_type: the HF config's
    ids = chat.prompt_ids(messages, tools=schemas)              # first prompt, generation prompt included
    ids += sampled                                              # the engine's ids, never re-tokenized
    ids += chat.observation_ids(tool_messages, sampled[-1])     # the observation, rendered once
    ids += sampled_2 ...
    ids, mask = chat.conversation_ids(demonstration)            # the same path, for the warm start

A trajectory is token ids. The conversation is never re-rendered from text between turns: each
observation (tool results, user messages) is rendered once by the model's own chat template and
its ids appended after the model's sampled ids, so every turn's prompt extends the previous one
token for token and the trainer sees exactly what the engine was given and sampled. That avoids
the known failures of re-rendering: the "\\n" after Qwen's <|im_end|> lost between turns (verl
#3720), a separator token dropped at the assistant -> tool boundary (verl #6501), decoding and
re-encoding the model's tokens every turn (TRL #5224), and Qwen3 / GLM-4.5 templates that strip
earlier <think> blocks, so that a re-rendered prompt no longer extends the tokens trained on.

How an observation is rendered (template-driven, no per-family string tables): a probe
conversation [user, assistant "<marker>", *observation] is rendered with the generation prompt,
and the text after the marker is the delta: the template's end of the assistant turn (its
end-of-turn token and whatever it writes after it, Qwen's "\\n"), the observation messages as the
template writes them (Qwen's <tool_response> wrappers in a user turn, consecutive tool results
merged; Llama's ipython header; DeepSeek's tool-outputs block; GLM's <|observation|>), and the
next assistant turn's generation prompt. The delta is tokenized alone (add_special_tokens=False);
it starts with a special token, so its tokenization does not depend on what came before. The
template's end-of-turn token is dropped when the model's turn ended with it (or an equivalent:
Llama's <|eom_id|> for <|eot_id|>): the sampled id stands in its place; a turn cut by the token
budget (no stop id) gets the whole delta. Each message-role pattern is probed once (cached) with
marker contents: a template that drops a role, or whose delta does not start with an
end-of-turn token, is a ConfigError naming the family and what the template wrote.

Only the text *after* the probe assistant's content is used, so what a template does to earlier
turns (Qwen3 and GLM-4.5 put an empty <think></think> on the last assistant turn, or strip the
reasoning of turns before the last user query) does not leak in: the sampled reasoning stays in
the sequence as it was sampled. A template's full re-render of a conversation can therefore differ
from the trajectory where the template rewrites history (tests/agents/test_chat_format.py shows
where, per family); the trajectory is what the model saw.

Families (`model_type` from the HF config.json; a tokenizer whose chat template is the tiny
tokenizer's (data/tokenizer.py CHAT_TEMPLATE, or PLAIN_CHAT_TEMPLATE before it took tools) is
"chatml" whatever the model_type, since the tiny presets name real architectures):

    family        model_type              tool_call_format  end-of-turn (stop ids, with the eos)
    chatml        (the tiny template)     hermes            <|im_end|>
    qwen3         qwen3, qwen3_moe        hermes            <|im_end|>
    qwen2         qwen2, qwen2_moe        hermes            <|im_end|>
    llama3        llama                   llama3_json       <|eot_id|>, <|eom_id|>
    deepseek_v3   deepseek_v3             deepseek_v3       <｜end▁of▁sentence｜>
    glm45         glm4_moe                glm45             <|user|>, <|observation|> (GLM ends a
                                                            turn with the next role's token)

`tools` (OpenAI-style function schemas) go to templates that render them through
`apply_chat_template(tools=...)` (the tiny ChatML template does, compactly: one instruction line
and one schema per line); a template that ignores them is a ConfigError (the model would never
see its tools), except a plain ChatML one (the tiny tokenizer's before it took tools, saved with
older checkpoints), which gets a Hermes-style block (Qwen2.5 / Qwen3 wording) prepended to the
system message, or as one.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Mapping, Sequence

from megatron_rl.errors import ConfigError

__all__ = ["ChatFormat", "FAMILIES", "TOOL_CALL_FORMATS", "family_of", "hermes_tools_block"]

FAMILIES = ("chatml", "qwen3", "qwen2", "llama3", "deepseek_v3", "glm45")

MODEL_TYPES = {
    "qwen3": "qwen3", "qwen3_moe": "qwen3",
    "qwen2": "qwen2", "qwen2_moe": "qwen2",
    "llama": "llama3",
    "deepseek_v3": "deepseek_v3",
    "glm4_moe": "glm45",
}

TOOL_CALL_FORMATS = {
    "chatml": "hermes", "qwen3": "hermes", "qwen2": "hermes",
    "llama3": "llama3_json", "deepseek_v3": "deepseek_v3", "glm45": "glm45",
}

# Tokens that end an assistant turn (those the vocabulary has become stop ids, with its eos).
END_OF_TURN = {
    "chatml": ("<|im_end|>",),
    "qwen3": ("<|im_end|>",),
    "qwen2": ("<|im_end|>",),
    "llama3": ("<|eot_id|>", "<|eom_id|>"),
    "deepseek_v3": ("<｜end▁of▁sentence｜>",),
    "glm45": ("<|user|>", "<|observation|>"),
}
# A sampled token that may stand in for the template's end-of-turn token at the start of a delta
# (Llama 3.1 ends a turn that expects a tool result with <|eom_id|>; templates write <|eot_id|>).
# GLM's <|user|> and <|observation|> are not interchangeable: each names the next role.
INTERCHANGEABLE = {"llama3": ("<|eot_id|>", "<|eom_id|>")}

# model_type None: the family from what the template writes (first match wins).
_TEMPLATE_SIGNS = (
    ("<|start_header_id|>", "llama3"),
    ("<｜User｜>", "deepseek_v3"),
    ("<|observation|>", "glm45"),
    ("[gMASK]", "glm45"),
)

# Hermes tools block, as the Qwen2.5 / Qwen3 templates write it into the system message.
HERMES_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                     "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
HERMES_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                     "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                     '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

# Probe contents: plain lowercase text (no surrounding space, so `| trim` keeps it), unlikely in data.
_PROBE_USER = "probe question zq7"
_PROBE_ASSISTANT = "probe answer zq7k4"
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_zq7", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


def family_of(tokenizer, model_type: str | None = None) -> str:
    """The chat-format family of a tokenizer (see the module docstring); ConfigError if none."""
    template = _template_text(tokenizer)
    if template is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(
            f"multi-turn rollouts need a chat template, but the tokenizer {name!r} has none: use the "
            "model's instruct tokenizer (its tokenizer_config.json or chat_template.jinja carries the "
            "template) or set tokenizer.chat_template before building the ChatFormat")
    from megatron_rl.data.tokenizer import CHAT_TEMPLATE, PLAIN_CHAT_TEMPLATE

    if template in (CHAT_TEMPLATE, PLAIN_CHAT_TEMPLATE):  # the tiny tokenizer's, now and before
        return "chatml"
    if model_type is not None:
        family = MODEL_TYPES.get(model_type, model_type if model_type in FAMILIES else None)
        if family is None:
            raise ConfigError(
                f"no multi-turn chat format for model_type {model_type!r}; supported: "
                f"{', '.join(sorted(MODEL_TYPES))} (families {', '.join(FAMILIES)})")
        return family
    for sign, family in _TEMPLATE_SIGNS:
        if sign in template:
            return family
    if "<|im_start|>" in template:
        return "qwen3" if "<think>" in template else "qwen2"
    raise ConfigError(
        "cannot tell the chat-format family from this tokenizer's chat template; pass model_type "
        f"(the model's config.json 'model_type', one of {', '.join(sorted(MODEL_TYPES))})")


def hermes_tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools block Qwen2.5 / Qwen3 templates put in the system message (one JSON per line,
    `tojson` as transformers renders it: ensure_ascii=False, default separators)."""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return HERMES_TOOLS_HEAD + lines + HERMES_TOOLS_TAIL


class ChatFormat:
    """One tokenizer's chat template as a multi-turn token layout (see the module docstring).

    `chat_template_kwargs` go to every `apply_chat_template` call (e.g. Qwen3's
    enable_thinking=False, Llama's date_string)."""

    family: str
    tool_call_format: str
    stop_token_ids: tuple[int, ...]

    def __init__(self, tokenizer, family: str, *, chat_template_kwargs: Mapping[str, Any] | None = None):
        if family not in FAMILIES:
            raise ConfigError(f"unknown chat-format family {family!r}; one of {', '.join(FAMILIES)}")
        if _template_text(tokenizer) is None:
            family_of(tokenizer)  # raises the no-template ConfigError
        self.tokenizer, self.family = tokenizer, family
        self.tool_call_format = TOOL_CALL_FORMATS[family]
        self.template_kwargs = dict(chat_template_kwargs or {})
        vocab = tokenizer.get_vocab()
        ends = [vocab[token] for token in END_OF_TURN[family] if token in vocab]
        if not ends:
            raise ConfigError(
                f"chat format {family!r}: the tokenizer has none of its end-of-turn tokens "
                f"{END_OF_TURN[family]} as a single token; is model_type right for this tokenizer?")
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_ids = tuple(dict.fromkeys([*ends, *([eos] if isinstance(eos, int) else [])]))
        self._stop = frozenset(self.stop_token_ids)
        same = [vocab[token] for token in INTERCHANGEABLE.get(family, ()) if token in vocab]
        self._same = {token: frozenset(same) for token in same}
        self._lock = threading.Lock()  # fast tokenizers: one encode at a time (environment threads)
        self._probed: set[tuple[str, ...]] = set()
        self._takes_tools: bool | None = None
        # The end of a final assistant turn (no observation after it): what the template writes
        # before a user message. Probing here also checks the template at construction.
        self.end_of_turn_id = self._delta_ids([{"role": "user", "content": "probe follow-up zq7"}])[0]

    @classmethod
    def for_tokenizer(cls, tokenizer, model_type: str | None = None, *,
                      chat_template_kwargs: Mapping[str, Any] | None = None) -> ChatFormat:
        """The adapter for `tokenizer`; `model_type`: the HF config's (None: told by the template)."""
        return cls(tokenizer, family_of(tokenizer, model_type), chat_template_kwargs=chat_template_kwargs)

    def __repr__(self) -> str:
        return (f"ChatFormat(family={self.family!r}, tool_call_format={self.tool_call_format!r}, "
                f"stop_token_ids={self.stop_token_ids})")

    # ---- the three layouts ------------------------------------------------------------------

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The first prompt, generation prompt included (the template writes its own BOS)."""
        messages = _checked_messages(messages, "prompt_ids")
        if not messages:
            raise ValueError("prompt_ids: the prompt needs at least one message")
        tools = _checked_tools(tools) if tools else None
        if tools and self.family == "chatml" and not self._template_takes_tools():
            # a plain ChatML template: Qwen's Hermes block in the system message, as Qwen writes it
            messages, tools = self._with_hermes_system(messages, tools), None
        elif tools:
            self._check_template_takes_tools()
        text = self._render(messages, tools=tools, add_generation_prompt=True)
        return self._encode(text)

    def observation_ids(self, messages: list[dict], last_token_id: int | None) -> list[int]:
        """The ids to append after a model turn's sampled ids (see the module docstring).

        `messages`: the observation (role "tool" with the result text, and/or "user"), rendered as
        the template renders them after that assistant turn, with the next generation prompt.
        `last_token_id`: the turn's last sampled id; when it is the end-of-turn token the template
        writes first, it is not repeated. None (or any other id: a turn cut by the budget) gets
        the whole end-of-turn separator."""
        messages = _checked_messages(messages, "observation_ids")
        if not messages:
            raise ValueError("observation_ids: an observation needs at least one message")
        for message in messages:
            if message["role"] == "assistant":
                raise ValueError("observation_ids: an observation holds tool / user messages, not the "
                                 "assistant's (its tokens are the engine's sampled ids)")
        return self._after_turn(self._delta_ids(messages), last_token_id)

    def conversation_ids(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        """(ids, mask) of a whole conversation as a multi-turn rollout produces it: prompt_ids of
        the messages before the first assistant, then each assistant content tokenized
        (add_special_tokens=False: write it as the model emits it, tool calls and <think> blocks
        included) + its end-of-turn id (mask 1), then each observation's observation_ids (mask 0).
        An assistant turn followed by an observation ends with the token the template writes
        first after it (GLM: <|observation|> before tool results, <|user|> before a user); the
        last one with `end_of_turn_id`."""
        messages = _checked_messages(messages, "conversation_ids")
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if not first:
            raise ValueError("conversation_ids: a conversation starts with the prompt (system / user "
                             "messages), then an assistant turn")
        ids = self.prompt_ids(messages[:first], tools)
        mask = [0] * len(ids)
        index = first
        while index < len(messages):
            message = messages[index]
            if message["role"] != "assistant":
                raise ValueError(f"conversation_ids: message {index} should be an assistant turn")
            for key in ("tool_calls", "reasoning_content"):
                if message.get(key):
                    raise ValueError(
                        f"conversation_ids: message {index} has {key!r}; write it into the content as the "
                        "model emits it (agents/tool_parsers.format_tool_calls, <think>...</think>): the "
                        "content's tokens are what the model is trained to sample")
            turn = self._encode(message["content"])
            end = index + 1
            while end < len(messages) and messages[end]["role"] != "assistant":
                end += 1
            if end == index + 1 and end < len(messages):
                raise ValueError(f"conversation_ids: messages {index} and {end} are consecutive assistant turns")
            if end > index + 1:
                delta = self._delta_ids(messages[index + 1:end])
                stop, observation = delta[0], self._after_turn(delta, delta[0])
            else:
                stop, observation = self.end_of_turn_id, []
            ids += turn + [stop] + observation
            mask += [1] * (len(turn) + 1) + [0] * len(observation)
            index = end
        return ids, mask

    # ---- internals ----------------------------------------------------------------------------

    def _render(self, messages: list[dict], *, tools=None, add_generation_prompt: bool) -> str:
        kwargs = dict(self.template_kwargs)
        if tools:
            kwargs["tools"] = tools
        from megatron_rl.data.chat_template import TemplateLimit, render_chat_template

        try:  # apply_chat_template's text, rendered with bounds on size and time (data/chat_template.py)
            text = render_chat_template(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                        **kwargs)
        except TemplateLimit:
            raise
        except Exception as exc:  # jinja errors, raise_exception() in templates
            roles = [m.get("role") for m in messages]
            raise ValueError(f"chat format {self.family!r}: the chat template failed on roles {roles}: "
                             f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str):
            raise ConfigError(f"chat format {self.family!r}: apply_chat_template(tokenize=False) returned "
                              f"{type(text).__name__}, not text")
        return text

    def _encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _probe_messages(self, observation: list[dict]) -> list[dict]:
        return [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT},
                *observation]

    def _delta_text(self, observation: list[dict]) -> str:
        """The template's text after the probe assistant's content, generation prompt included."""
        text = self._render(self._probe_messages(observation), add_generation_prompt=True)
        at = text.find(_PROBE_ASSISTANT)
        if at < 0:
            raise ConfigError(f"chat format {self.family!r}: the chat template does not write an assistant "
                              f"message's content as given (probe {_PROBE_ASSISTANT!r} not found in {text!r})")
        return text[at + len(_PROBE_ASSISTANT):]

    def _delta_ids(self, observation: list[dict]) -> list[int]:
        """The delta's ids, the template's end-of-turn token first (checked)."""
        roles = tuple(message["role"] for message in observation)
        if roles not in self._probed:
            self._probe(roles)
        ids = self._encode(self._delta_text(observation))
        if not ids or ids[0] not in self._stop:
            raise ValueError(self._no_stop_message(roles, ids))
        return ids

    def _probe(self, roles: tuple[str, ...]) -> None:
        """Once per role pattern: the template renders every message of the pattern (a marker
        content per message is found in the delta) and starts the delta with an end-of-turn token."""
        markers = [f"probe {role} content zq7m{index}" for index, role in enumerate(roles)]
        delta = self._delta_text([{"role": role, "content": marker} for role, marker in zip(roles, markers)])
        missing = [role for role, marker in zip(roles, markers) if marker not in delta]
        if missing:
            raise ConfigError(
                f"chat format {self.family!r}: the chat template drops observation messages with role(s) "
                f"{sorted(set(missing))} (it rendered {delta!r} after the assistant turn for roles {list(roles)}); "
                "use the roles the template knows (tool / user)")
        ids = self._encode(delta)
        if not ids or ids[0] not in self._stop:
            raise ConfigError(self._no_stop_message(roles, ids))
        self._probed.add(roles)

    def _no_stop_message(self, roles, ids) -> str:
        with self._lock:
            shown = self.tokenizer.decode(ids[:8]) if ids else ""
        return (f"chat format {self.family!r}: after an assistant turn, the chat template writes {shown!r}... "
                f"for roles {list(roles)}, which does not start with an end-of-turn token "
                f"({', '.join(END_OF_TURN[self.family])}, ids {self.stop_token_ids}); the engine's stop ids "
                "would not end turns where the template does")

    def _after_turn(self, delta: list[int], last_token_id: int | None) -> list[int]:
        """The delta after a turn that ended with `last_token_id`: the template's end-of-turn token
        dropped when the model sampled it (or its equivalent), kept otherwise (a cut turn)."""
        first = delta[0]
        if last_token_id is not None and (last_token_id == first or last_token_id in self._same.get(first, ())):
            return delta[1:]
        return list(delta)

    def _with_hermes_system(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        block = hermes_tools_block(tools)
        if messages[0]["role"] == "system":
            return [{**messages[0], "content": block + "\n\n" + messages[0]["content"]}, *messages[1:]]
        return [{"role": "system", "content": block}, *messages]

    def _template_takes_tools(self) -> bool:
        if self._takes_tools is None:
            probe = [{"role": "user", "content": _PROBE_USER}]
            with_tools = self._render(probe, tools=[_PROBE_TOOL], add_generation_prompt=True)
            self._takes_tools = with_tools != self._render(probe, add_generation_prompt=True)
        return self._takes_tools

    def _check_template_takes_tools(self) -> None:
        if not self._template_takes_tools():
            raise ConfigError(
                f"chat format {self.family!r}: the tokenizer's chat template ignores `tools`, so the model "
                "would never see its tool schemas; use a template that renders them (the model's tool-use "
                "template, e.g. vLLM's examples/tool_chat_template_*.jinja) as tokenizer.chat_template")


def _template_text(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def _checked_messages(messages, where: str) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"{where}: messages must be a list of {{'role', 'content'}} dicts, "
                         f"got {type(messages).__name__}")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: message {index} must be a dict with a 'role'; got {message!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {index} ({message['role']}) needs text 'content'; "
                             f"got {type(message.get('content')).__name__}")
        checked.append(dict(message))
    return checked


def _checked_tools(tools) -> list[dict]:
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ValueError(f"tools must be a list of OpenAI-style function schemas, got {type(tools).__name__}")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"tools[{index}] must be {{'type': 'function', 'function': {{'name', 'description', "
                             f"'parameters'}}}}; got {tool!r}")
    return [dict(tool) for tool in tools]
