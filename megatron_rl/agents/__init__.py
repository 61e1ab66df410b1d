"""Multi-turn agents: environments, tools, chat formats (docs/agents.md).

    environment.py    the Environment contract (reset / step -> Observation), loading by import path
    rollout.py        the multi-turn loop: engine turns, environment steps, masked observations
    chat_format.py    per-family chat templates as token layouts (observations rendered once)
    tools.py          tool registry: JSON schemas from type hints, validated calls
    tool_parsers.py   tool calls in each family's format (Hermes, Llama 3 JSON, DeepSeek-V3, GLM-4.5)
    tool_env.py       the built-in environment that runs the model's tool calls
    calculator.py     the built-in `calculator` tool (exact arithmetic)
    demonstrations.py multi-turn demonstrations for the supervised warm start
    metrics.py        agent/* metrics of a step
"""

from megatron_rl.agents.environment import Environment, Observation

__all__ = ["Environment", "Observation"]
