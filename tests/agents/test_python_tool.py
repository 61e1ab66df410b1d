"""The built-in `python` tool: the model's program in the real sandbox, its output as the
observation; programs that fail or misbehave come back as counted tool errors, never a crash."""

from __future__ import annotations

import json

from megatron_rl.agents.tool_env import ToolEnvironment
from megatron_rl.agents.tools import ToolRegistry


def call(code: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


def test_python_tool_schema_and_a_program_that_prints():
    registry = ToolRegistry.from_paths(["python"])
    (schema,) = registry.schemas()
    assert schema["function"]["name"] == "python"
    assert schema["function"]["parameters"]["required"] == ["code"]
    assert "sandbox" in schema["function"]["description"]
    environment = ToolEnvironment(registry, "hermes")
    environment.reset({"prompt": "x"})
    observation = environment.step(call("print(sum(range(10)))"), [])
    assert [m["content"] for m in observation.messages] == ["45\n"]
    assert observation.info["tool_calls"] == 1 and observation.info["tool_errors"] == 0


def test_failing_and_hostile_programs_are_counted_tool_errors():
    environment = ToolEnvironment(ToolRegistry.from_paths(["python"]), "hermes")
    environment.reset({"prompt": "x"})
    cases = {"1 / 0": "ZeroDivisionError", "import time\ntime.sleep(60)": "ran past 10 s",
             "x = bytearray(10 * 1024**3)": "ran out of memory",
             "for i in range(5):\n    open(f'f{i}', 'wb').write(b'x' * (16 << 20))": "ran out of disk (64 MB",
             "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)": "Network is unreachable"}
    for code, expected in cases.items():
        observation = environment.step(call(code), [])
        (message,) = observation.messages
        assert message["content"].startswith("error: python:") and expected in message["content"], message
        assert observation.info["tool_errors"] == 1, observation.info
