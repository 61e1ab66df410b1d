"""The multi-turn loop (agents/rollout.py) against a scripted engine (mock: the engine only has to
return given token ids; the real vLLM engine runs in test_agent_vllm.py): token layout and masks,
budgets and finish reasons, failures kept out of the groups, rewards, seeds.

The scripted engine answers every request from a script keyed by the turn, with ids encoded by the
tiny tokenizer plus the `<|im_end|>` stop id, and records every request it saw."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from megatron_rl.agents.chat_format import ChatFormat
from megatron_rl.agents.environment import Environment, Observation
from megatron_rl.agents.rollout import AgentRollout, AgentSettings
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.data import build_char_tokenizer
from megatron_rl.data.chat import to_messages
from megatron_rl.data.records import PromptRecord
from megatron_rl.rollout.protocol import Sample, SamplingParams
from megatron_rl.errors import TrainingStopped
from megatron_rl.train.agent_failures import check_agent_failures, describe_source
from megatron_rl.train.experience import StepRollout, Trajectory
from megatron_rl.train.scoring import assemble_step, keeps_group, to_trajectories

TOKENIZER = build_char_tokenizer()
CHAT = ChatFormat.for_tokenizer(TOKENIZER)
IM_END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")


class ScriptedEngine:
    """Turn t of every trajectory answers `script[t]` (text, then <|im_end|> unless cut)."""

    def __init__(self, script: list[str], cut: set[int] = frozenset()):
        self.script, self.cut, self.requests = script, cut, []

    def __call__(self, prompts, params: SamplingParams):
        self.requests.append((prompts, params))
        groups = []
        for index, prompt in enumerate(prompts):
            turn = sum(1 for token in prompt if token == IM_END) // 2  # im_end count: system/user + turns + obs
            text = self.script[min(turn, len(self.script) - 1)]
            ids = TOKENIZER(text, add_special_tokens=False)["input_ids"]
            budget = params.max_tokens_of(index)
            reason = "stop"
            if turn in self.cut or len(ids) + 1 > budget:
                ids, reason = (ids + [IM_END])[:budget], "length"
            else:
                ids = ids + [IM_END]
            groups.append([Sample(index, 0, list(prompt), ids, [-0.5] * len(ids), reason)])
        return groups


class Echo(Environment):
    """Answers each turn with 'got <text>'; done after `turns` steps with reward = turns seen."""

    def __init__(self, turns: int = 2, fail_at: int | None = None, hang_at: int | None = None,
                 garbage_at: int | None = None):
        self.turns, self.fail_at, self.hang_at, self.garbage_at, self.seen = turns, fail_at, hang_at, garbage_at, 0
        self.texts = []

    def step(self, response_text, response_ids):
        self.seen += 1
        self.texts.append(response_text)
        if self.seen == self.fail_at:
            raise RuntimeError("sandbox crashed")  # ECHO_RAISES_AT
        if self.seen == self.hang_at:
            time.sleep(5)
        if self.seen == self.garbage_at:
            return {"not": "an observation"}
        if self.seen >= self.turns:
            return Observation(reward=float(self.seen), done=True, info={"steps": 1})
        return Observation(messages=[{"role": "tool", "content": f"got {self.seen}"}], info={"steps": 1})


def agent(environment, *, max_turns=4, max_total=None, timeout=2.0, turn_reward="last"):
    def encode(record, messages):
        return CHAT.prompt_ids(messages if messages is not None else to_messages(record.prompt))

    return AgentRollout(environment=environment, chat_format=CHAT, tokenizer=TOKENIZER,
                        settings=AgentSettings(max_turns, max_total, 1024, turn_reward, timeout),
                        encode_record=encode, workers=8)


ECHO_RAISES_AT = next(number for number, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                      if line.endswith("# ECHO_RAISES_AT"))

RECORDS = [PromptRecord("1+1=", "2", {}, "test"), PromptRecord("2+2=", "4", {}, "test")]
PARAMS = SamplingParams(n=2, max_tokens=16, seed=7)


def test_observations_are_rendered_once_masked_and_the_model_tokens_kept_as_sampled():
    engine = ScriptedEngine(["abc", "de", "f"])
    groups = agent(lambda: Echo(turns=3)).run(RECORDS, PARAMS, engine)
    sample = groups[0][0]
    turn = lambda text: TOKENIZER(text, add_special_tokens=False)["input_ids"] + [IM_END]  # noqa: E731
    obs = [CHAT.observation_ids([{"role": "tool", "content": f"got {k}"}], IM_END) for k in (1, 2)]
    assert sample.response_token_ids == turn("abc") + obs[0] + turn("de") + obs[1] + turn("f")
    assert sample.extras["loss_mask"] == [1] * 4 + [0] * len(obs[0]) + [1] * 3 + [0] * len(obs[1]) + [1] * 2
    assert sample.logprobs == [-0.5] * 4 + [0.0] * len(obs[0]) + [-0.5] * 3 + [0.0] * len(obs[1]) + [-0.5] * 2
    # every turn's prompt extends the previous one (prefix reuse), the last one holds everything
    prompts = [request[0][0] for request in engine.requests]
    for before, after in zip(prompts, prompts[1:]):
        assert after[: len(before)] == before
    assert prompts[-1] == sample.prompt_token_ids + sample.response_token_ids[: -len(turn("f"))]
    assert sample.extras["agent"] == {"turns": 3, "finish": "stop", "status": "ok", "reward": 3.0,
                                      "info": {"steps": 3.0}, "env_time_s": sample.extras["agent"]["env_time_s"],
                                      "error": None, "model_tokens": 9}
    assert sample.extras["final_response_ids"] == turn("f")
    # an observation's separator after <|im_end|> is the template's "\n": not lost between turns
    assert TOKENIZER.decode(obs[0]).startswith("\n<|im_start|>")


def test_turn_seeds_do_not_depend_on_which_trajectories_are_still_running():
    engine = ScriptedEngine(["a", "b", "c"])
    agent(lambda: Echo(turns=3)).run(RECORDS, PARAMS, engine)
    first = engine.requests[1][1].prompt_seeds
    engine2 = ScriptedEngine(["a", "b", "c"])
    agent(lambda: Echo(turns=3)).run(RECORDS[:1], PARAMS, engine2)
    assert engine2.requests[1][1].prompt_seeds == first[:2]  # group 0's two trajectories, turn 2
    assert len(set(first)) == 4


def test_budgets_end_trajectories_with_truncation_reasons():
    # a turn cut by the per-turn budget
    (cut,), = [g[:1] for g in agent(lambda: Echo(turns=3)).run(RECORDS[:1], PARAMS, ScriptedEngine(["a" * 40]))]
    assert cut.finish_reason == "length" and cut.extras["agent"]["finish"] == "length"
    assert cut.extras["agent"]["turns"] == 1 and len(cut.response_token_ids) == 16
    # max_turns: the last turn is still stepped (its reward), then the trajectory ends
    (capped, _), = agent(lambda: Echo(turns=9), max_turns=2).run(RECORDS[:1], PARAMS, ScriptedEngine(["ab"]))
    assert capped.extras["agent"]["finish"] == "max_turns" and capped.extras["agent"]["turns"] == 2
    assert capped.finish_reason == "length"  # a truncation for rl.mask_truncated
    # an observation that would overflow max_total_tokens is not appended: the trajectory ends
    (full, _), = agent(lambda: Echo(turns=9), max_total=12).run(RECORDS[:1], PARAMS, ScriptedEngine(["abcde"]))
    assert full.extras["agent"]["finish"] == "length" and len(full.response_token_ids) == 6
    assert full.extras["loss_mask"] == [1] * 6


@pytest.mark.parametrize("failure", ["fail_at", "hang_at", "garbage_at"])
def test_environment_failures_fail_the_trajectory_and_drop_its_group(failure):
    made = []

    def environment():
        made.append(Echo(turns=3, **({failure: 2} if len(made) == 1 else {})))
        return made[-1]

    started = time.perf_counter()
    groups = agent(environment, timeout=1.0).run(RECORDS, PARAMS, ScriptedEngine(["a", "b", "c"]))
    assert time.perf_counter() - started < 4  # a hung environment costs its timeout, not its sleep
    statuses = [[s.extras["agent"]["status"] for s in group] for group in groups]
    assert statuses == [["ok", "failed"], ["ok", "ok"]]
    error = groups[0][1].extras["agent"]["error"]
    assert {"fail_at": "sandbox crashed", "hang_at": "env_timeout_s", "garbage_at": "not an Observation"}[failure] in error
    if failure == "fail_at":  # where the environment raised, not where the rollout caught it
        assert error == f"step() raised RuntimeError: sandbox crashed (at {__file__}:{ECHO_RAISES_AT})", error
    scored = to_trajectories(groups, [1.0, 0.0, 1.0, 0.0])
    assert [keeps_group(g, dynamic_sampling=False) for g in scored] == [False, True]


def step_of(groups) -> StepRollout:
    """The StepRollout a collector would make of these generated groups (trained on: the kept ones)."""
    scored = to_trajectories(groups, [0.0] * sum(len(g) for g in groups))
    kept = [g for g in scored if keeps_group(g, dynamic_sampling=False)]
    return assemble_step(kept, scored, [], {}, {})


def test_a_step_whose_trajectories_all_failed_stops_the_run_with_the_first_error():
    """The reward functions' rule (train/agent_failures.py): it used to train on nothing and exit 0,
    `agent/failed` in metrics.jsonl the only trace."""
    groups = agent(lambda: Echo(turns=3, fail_at=1)).run(RECORDS, PARAMS, ScriptedEngine(["a", "b", "c"]))
    step = step_of(groups)
    assert step.groups == [] and step.metrics["agent/failed"] == 4
    lines = []
    with pytest.raises(TrainingStopped) as stopped:
        check_agent_failures(3, step.agent_failures, "rollout.environment=pkg.env:Echo", notify=lines.append)
    assert str(stopped.value).startswith(
        "step 3: all 4 trajectories failed in rollout.environment=pkg.env:Echo; first: group 0, trajectory 0: "
        f"step() raised RuntimeError: sandbox crashed (at {__file__}:{ECHO_RAISES_AT}). Nothing was trained"), \
        str(stopped.value)
    assert lines == []


def test_a_step_with_some_failed_trajectories_says_so_in_one_line():
    made = []

    def environment():  # the third trajectory (group 1, trajectory 0) fails at its first step
        made.append(Echo(turns=3, fail_at=1 if len(made) == 2 else None))
        return made[-1]

    groups = agent(environment).run(RECORDS, PARAMS, ScriptedEngine(["a", "b", "c"]))
    lines = []
    check_agent_failures(2, step_of(groups).agent_failures, describe_source(RolloutConfig(tools=["calculator"])),
                         notify=lines.append)
    assert lines == ["step 2: 1 of 4 trajectories failed in the tool environment of rollout.tools=['calculator'], "
                     "their 1 of 2 groups dropped from training; first: group 1, trajectory 0: step() raised "
                     f"RuntimeError: sandbox crashed (at {__file__}:{ECHO_RAISES_AT})"]
    # none failed, and a single-turn step (no agent records): nothing to say
    check_agent_failures(2, step_of(agent(lambda: Echo(turns=2)).run(RECORDS, PARAMS, ScriptedEngine(["a"])))
                         .agent_failures, "x", notify=lines.append)
    single = [[Sample(0, i, [1, 2], [3], [-0.5], "stop") for i in range(2)]]
    assert step_of(single).agent_failures is None and len(lines) == 1


def test_turn_rewards_combine_last_or_sum():
    class Rewarding(Echo):
        def step(self, response_text, response_ids):
            observation = super().step(response_text, response_ids)
            observation.reward = 0.25 * self.seen
            return observation

    last = agent(lambda: Rewarding(turns=3)).run(RECORDS[:1], PARAMS, ScriptedEngine(["a"]))[0][0]
    total = agent(lambda: Rewarding(turns=3), turn_reward="sum").run(RECORDS[:1], PARAMS, ScriptedEngine(["a"]))[0][0]
    assert last.extras["agent"]["reward"] == 0.75 and total.extras["agent"]["reward"] == 1.5


def test_trajectory_turn_index_and_model_length():
    t = Trajectory(0, [1], list(range(9)), [0.0] * 9, False, 0.0, loss_mask=[1, 1, 0, 0, 1, 0, 1, 1, 1])
    assert t.turn_index().tolist() == [1, 1, 0, 0, 2, 0, 3, 3, 3] and t.model_length == 6


def test_the_example_environment_plays_to_the_end():
    """megatron_rl/agents/examples/guess_number.py, the file users copy: hints, then a solved episode."""
    from megatron_rl.agents.environment import load_environment_factory

    factory = load_environment_factory("megatron_rl.agents.examples.guess_number:GuessNumber", {"reward_decay": 0.5})
    groups = agent(factory).run([PromptRecord("1+1=", "2", {}, "test")], SamplingParams(n=1, max_tokens=8, seed=1),
                                ScriptedEngine(["0", "5", "2"]))
    sample = groups[0][0]
    assert sample.extras["agent"]["turns"] == 3 and sample.extras["agent"]["finish"] == "stop"
    assert sample.extras["agent"]["reward"] == 0.25  # solved at the third guess
    hints = [TOKENIZER.decode(sample.response_token_ids)]
    assert "higher" in hints[0] and "lower" in hints[0]


def test_environment_configuration_errors_name_the_key_before_any_model_is_built():
    from megatron_rl.agents.environment import load_environment_factory
    from megatron_rl.config import load_config
    from megatron_rl.errors import ConfigError
    from megatron_rl.train.preflight import check_agents

    with pytest.raises(ConfigError, match="rollout.environment='no_such_pkg.envs:Env': cannot import"):
        load_environment_factory("no_such_pkg.envs:Env", {})
    with pytest.raises(ConfigError, match="has no 'Missing'"):
        load_environment_factory("megatron_rl.agents.examples.guess_number:Missing", {})
    with pytest.raises(ConfigError, match="environment_args do not fit"):
        load_environment_factory("megatron_rl.agents.examples.guess_number:GuessNumber", {"decay": 1})
    with pytest.raises(ConfigError, match="data.prompt_format=chat"):
        check_agents(load_config(None, ["rollout.tools=[calculator]"]))
    with pytest.raises(ConfigError, match=r"rollout.tools\[0\]"):
        check_agents(load_config(None, ["rollout.tools=[no_such_pkg:fn]", "data.prompt_format=chat"]))
    with pytest.raises(ConfigError, match="max_total_tokens"):
        load_config(None, ["rollout.tools=[calculator]", "rollout.max_total_tokens=5000"])


def test_warm_start_on_a_demonstration_scores_exactly_the_assistant_tokens():
    """`megatron-rl sft` / the warm start on a multi-turn demonstration: the packed loss mask is 1
    at exactly the positions that predict an assistant token (end-of-turn included), 0 on the
    prompt and the tool result, whatever the record's place in the micro-batch."""
    from megatron_rl.agents.demonstrations import demonstration_ids
    from megatron_rl.agents.tools import ToolRegistry
    from megatron_rl.rewards.synthetic import SyntheticTask, TaskConfig
    from megatron_rl.train.warm_start import _mask_observations, _pack

    rows = SyntheticTask(TaskConfig(task="mul", digits=3)).generate(3, seed=0, split="train")
    records = [PromptRecord(r["prompt"], r["answer"], {"demonstration": r["demonstration"]}, "test") for r in rows]
    tools = ToolRegistry.from_paths(["calculator"]).schemas()
    encoded = [demonstration_ids(CHAT, record, system_prompt=None, tools=tools) for record in records]
    sequences = [ids for ids, _ in encoded]
    prompts = [mask.index(1) for _, mask in encoded]
    batches = _pack(sequences, prompts, token_budget=2 * len(sequences[0]), pad=1)
    _mask_observations(batches, [mask[p:] for (_, mask), p in zip(encoded, prompts)])
    seen = 0
    for batch in batches:
        for (start, prompt, length), sample_id in zip(batch.spans, batch.sample_ids):
            ids, mask = encoded[sample_id]
            scored = batch.loss_mask[0, start: start + length - 1].tolist()
            assert scored == [float(m) for m in mask[1:]]  # position p predicts token p + 1
            answer = "".join(TOKENIZER.decode([ids[p + 1]]) for p, s in enumerate(scored) if s)
            assert answer.startswith("<tool_call>") and rows[sample_id]["answer"] + "<|im_end|>" in answer
            assert rows[sample_id]["answer"] + "<|im_end|>\n<|im_start|>assistant" not in answer  # the result: 0
            seen += 1
    assert seen == 3
