"""The engine protocol's split: what every engine does (RolloutEngine) and what only some do
(FileWeights, CollectiveWeights, Sleeps), asked for by the trainer's side instead of refused by
the engines; and the configuration's refusals of a capability the engine lacks, before it starts.

Read from the engine classes themselves (no engine starts): which capabilities each implements,
and that none carries a method whose whole body is a refusal.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.engines.sglang import SglangServerEngine
from megatron_rl.rollout.engines.vllm_colocated import VllmColocatedEngine
from megatron_rl.rollout.engines.vllm_server import VllmServerEngine
from megatron_rl.rollout import protocol
from megatron_rl.rollout.factory import check_engine_capabilities, engine_class

CAPABILITIES = {"FileWeights": protocol.FileWeights, "CollectiveWeights": protocol.CollectiveWeights,
                "Sleeps": protocol.Sleeps}
# What each engine really does: colocated vLLM takes weights by reference only and sleeps on GPU;
# vLLM servers load files and join the collective; SGLang servers load files only.
EXPECTED = {
    VllmColocatedEngine: {"Sleeps"},
    VllmServerEngine: {"FileWeights", "CollectiveWeights"},
    SglangServerEngine: {"FileWeights"},
}


def protocol_methods(capability) -> set[str]:
    return {name for name, value in vars(capability).items() if callable(value) and not name.startswith("_")}


def refusing_methods(cls) -> set[str]:
    """Public methods whose body (less its docstring) is only `raise ...`, or only a call of
    another such method of self (the `return self.load_weight_files("")` idiom)."""
    bodies = {}
    for name, member in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("_") and member.__qualname__.split(".")[0] == cls.__name__:
            function = ast.parse(textwrap.dedent(inspect.getsource(member))).body[0]
            statements = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            bodies[name] = statements
    refusing = {name for name, body in bodies.items() if len(body) == 1 and isinstance(body[0], ast.Raise)}
    changed = True
    while changed:  # methods that only delegate to a refusing one refuse too
        changed = False
        for name, body in bodies.items():
            if name in refusing or len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr)):
                continue
            call = body[0].value
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "self"
                    and call.func.attr in refusing):
                refusing.add(name)
                changed = True
    return refusing


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda cls: cls.__name__)
def test_each_engine_implements_exactly_its_capabilities_and_refuses_nothing(cls):
    missing = {method for method in protocol_methods(protocol.RolloutEngine) if not callable(getattr(cls, method, None))}
    assert not missing, f"{cls.__name__} lacks part of the core protocol: {missing}"
    held = {name for name, capability in CAPABILITIES.items() if protocol.supports(cls, capability)}
    assert held == EXPECTED[cls]
    for name, capability in CAPABILITIES.items():  # a capability is all its methods or none of them
        present = {method for method in protocol_methods(capability) if callable(getattr(cls, method, None))}
        assert present in (set(), protocol_methods(capability)), f"{cls.__name__} has part of {name}: {present}"
    assert refusing_methods(cls) == set(), f"{cls.__name__} implements methods only to refuse them"


def test_the_core_protocol_holds_what_every_engine_does():
    """No capability method is part of the core, and the core is what all three engines do."""
    core = protocol_methods(protocol.RolloutEngine)
    assert core == {"generate", "update_weights", "fingerprint", "reset_prefix_cache", "pause", "resume",
                    "health", "shutdown"}
    for capability in CAPABILITIES.values():
        assert not core & protocol_methods(capability)


SLEEPING = ["rollout.sleep_level=1"]


def test_sleep_level_is_refused_on_cpu_by_name_before_any_engine_starts():
    """This machine has no GPU: vLLM's CPU platform has no sleep mode (vLLM refuses
    enable_sleep_mode there and its CPU worker ignores sleep()), so the check refuses it first."""
    config = load_config(None, SLEEPING)
    with pytest.raises(ConfigError, match=r"rollout.sleep_level=1 .*GPU.*set rollout.sleep_level: 0"):
        check_engine_capabilities(config)
    check_engine_capabilities(load_config(None, []))  # off: nothing to refuse


@pytest.mark.parametrize("overrides, match", [
    (["rollout.sleep_level=3"], r"rollout.sleep_level must be 0 \(off\), 1 or 2, got 3"),
    (["rollout.sleep_level=1", "rollout.mode=server"], r"rollout.sleep_level=1 .*colocated engine"),
    (["rollout.sleep_level=2", "rollout.lora_push=adapters", "model.lora.rank=4"],
     r"rollout.sleep_level=2 .*lora_push=adapters"),
])
def test_sleep_settings_the_config_refuses(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


class FakeEngineWithoutFiles:
    """A fake engine class: the core protocol only."""

    name = "fake"

    def generate(self, prompts, params, timeout_s=None): ...
    def update_weights(self, weights): ...
    def fingerprint(self): ...
    def reset_prefix_cache(self): ...
    def pause(self): ...
    def resume(self): ...
    def health(self): ...
    def shutdown(self): ...


def test_a_transport_the_engine_cannot_take_is_refused_by_name_with_a_fake_engine_class():
    """The config refuses today's impossible pairs first; the capability check is what stands
    behind it for any engine class: here a fake one without FileWeights, asked for files."""
    config = load_config(None, ["rollout.mode=server", "rollout.weight_transport=files"])
    assert engine_class(config) is VllmServerEngine
    check_engine_capabilities(config)
    with pytest.raises(ConfigError, match=r"rollout.weight_transport=files needs an engine that loads weight "
                                          r"files \(load_weight_files\); FakeEngineWithoutFiles \(rollout.engine=vllm, "
                                          r"mode=server\) does not"):
        check_engine_capabilities(config, engine=FakeEngineWithoutFiles)
