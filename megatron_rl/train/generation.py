"""Dataset records -> groups of samples, single-turn or multi-turn: what every collector calls.

    generation = Generation.build(config, tokenizer, model_dir, runtime, rollout, encode)
    groups = generation.groups(records, params)                 # collective: the same on every rank
    group = generation.group_on_driver(record, params, request)  # the async producer's, one group
    generation.close()

Single-turn (no `rollout.environment`, no `rollout.tools`): each record's prompt, encoded once,
is one engine request of n samples. Multi-turn: agents/rollout.py runs the turns, the
environments on the driver; with `rollout.agent`, agents/openai_agent.py serves an OpenAI-client
agent's calls. The collectors, the held-out evaluation and the scorer see Samples
either way; a multi-turn Sample carries its `loss_mask` and `agent` summary in `extras`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from megatron_rl.rollout.protocol import Sample, SamplingParams


class Generation:
    def __init__(self, rollout, encode: Callable, runtime, agent=None):
        self.rollout, self.encode, self.runtime, self.agent = rollout, encode, runtime, agent

    @classmethod
    def build(cls, config, tokenizer, model_dir: Path, runtime, rollout, encode: Callable) -> Generation:
        """`encode(prompt)`: a single-turn prompt's ids; `model_dir`: the engine's model directory
        (its config.json names the family whose chat format multi-turn rollouts use)."""
        if not config.rollout.multi_turn:
            return cls(rollout, encode, runtime)
        from megatron_rl.agents.chat_format import ChatFormat
        from megatron_rl.agents.rollout import AgentRollout
        from megatron_rl.agents.tools import ToolRegistry
        from megatron_rl.data.chat import to_messages

        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
        chat = ChatFormat.for_tokenizer(tokenizer, model_type)
        schemas = ToolRegistry.from_paths(config.rollout.tools).schemas() if config.rollout.tools else None
        system_prompt = config.data.system_prompt

        def encode_record(record, messages):
            if messages is None:
                messages = to_messages(record.prompt, system_prompt)
            return chat.prompt_ids(messages, tools=schemas)

        if config.rollout.agent is not None:
            from megatron_rl.agents.openai_agent import OpenAIAgentRollout

            return cls(rollout, encode, runtime, OpenAIAgentRollout.from_config(config, tokenizer, chat))
        return cls(rollout, encode, runtime, AgentRollout.from_config(config, tokenizer, chat, encode_record))

    @property
    def multi_turn(self) -> bool:
        return self.agent is not None

    @property
    def env_seconds(self) -> float:
        """Wall-clock seconds this rank has spent waiting on environments so far (the driver's;
        0 elsewhere and for single-turn runs)."""
        return self.agent.env_wall_s if self.agent is not None else 0.0

    def groups(self, records, params: SamplingParams) -> list[list[Sample]]:
        """Collective: params.n samples per record, the same on every rank."""
        if self.agent is None:
            return self.rollout.generate([self.encode(record.prompt) for record in records], params)
        return self.agent.run(records, params, self.rollout.generate, share=self.runtime.from_driver,
                              is_driver=self.runtime.is_driver)

    def group_on_driver(self, record, params: SamplingParams,
                        request: Callable[[list[list[int]], SamplingParams], list[list[Sample]]]) -> list[Sample]:
        """The driver alone (the asynchronous producer): one record's group, each engine request
        sent through `request`."""
        if self.agent is None:
            return request([self.encode(record.prompt)], params)[0]
        return self.agent.run([record], params, request)[0]

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
