"""Multi-turn rollouts on a real vLLM CPU server, against an environment defined only here.

The server serves the tiny Qwen3-MoE with weights pushed from a transformers model (the weight
push the trainer's files transport does). Three-turn trajectories with observations between the
turns are checked, every token of every trajectory:

* the sequence is exactly prompt | the engine's ids of turn 1 | the observation rendered once |
  turn 2 ... (the engine's ids as it returned them, recorded by a wrapper around `generate`), and
  the loss mask is 0 on exactly the observation positions;
* on every model token of every turn, the engine's logprob equals transformers' logprob of the
  same token in the whole sequence within 1e-4 (the same check through Megatron, the trainer, is
  the `mismatch/` metric of tests/agents/test_agent_training.py);
* broken on purpose, each check fails: the model's text re-tokenized between turns, the mask
  shifted by one;
* long seeded prompts whose prefill vLLM splits over steps sample what they sample alone (a
  vLLM-CPU crash the agentic prompts ran into, repaired in runtime/cpu/vllm_repairs.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from megatron_rl.agents.chat_format import ChatFormat  # noqa: E402
from megatron_rl.agents.environment import Environment, Observation  # noqa: E402
from megatron_rl.agents.rollout import AgentRollout, AgentSettings  # noqa: E402
from megatron_rl.data.chat import to_messages  # noqa: E402
from megatron_rl.data.records import PromptRecord  # noqa: E402
from megatron_rl.rollout.engines.vllm_server import VllmServerEngine  # noqa: E402
from megatron_rl.rollout.protocol import SamplingParams  # noqa: E402

pytestmark = pytest.mark.engine

TOLERANCE = 1e-4


class Countdown(Environment):
    """Three turns: each answered with a tool message that quotes the turn's length; the third ends it."""

    def reset(self, record):
        self.turn = 0
        return Observation()

    def step(self, response_text, response_ids):
        self.turn += 1
        if self.turn == 3:
            return Observation(reward=1.0, done=True)
        return Observation(messages=[{"role": "tool", "content": f"turn {self.turn}: {len(response_ids)} tokens"}])


@pytest.fixture(scope="module")
def served(tiny_vllm_server, tmp_path_factory):
    """(engine, transformers model, tokenizer) with the model's weights pushed into the server."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    url, model_dir = tiny_vllm_server
    torch.manual_seed(11)
    config = AutoConfig.from_pretrained(model_dir)
    config.initializer_range = 0.1
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    engine = VllmServerEngine(url, name="vllm-0", staging_dir=tmp_path_factory.mktemp("staging"))
    engine.update_weights(model.state_dict().items())  # a full reload: tiny_vllm_server dropped the last plan
    yield engine, model, AutoTokenizer.from_pretrained(model_dir)


def rollout(served, agent_class=AgentRollout):
    engine, _, tokenizer = served
    chat = ChatFormat.for_tokenizer(tokenizer)
    recorded = []  # every request's (prompt, the engine's ids, the engine's logprobs)

    def generate(prompts, params):
        groups = engine.generate(prompts, params, timeout_s=300)
        recorded.extend((p, g[0].response_token_ids, g[0].logprobs) for p, g in zip(prompts, groups))
        return groups

    agent = agent_class(environment=Countdown, chat_format=chat, tokenizer=tokenizer,
                        settings=AgentSettings(max_turns=4, max_total_tokens=400, max_model_len=1024,
                                               turn_reward="last", env_timeout_s=30),
                        encode_record=lambda record, messages: chat.prompt_ids(to_messages(record.prompt)))
    records = [PromptRecord("12+7=", "19", {}, "test"), PromptRecord("sort 3142=", "1234", {}, "test")]
    # The random-weight model seldom samples <|im_end|>: every 4th id also ends a turn (such a turn
    # then gets the whole end-of-turn separator from the adapter, as a cut turn does).
    params = SamplingParams(n=2, temperature=1.0, max_tokens=24, seed=5, stop_token_ids=tuple(range(3, 512, 4)))
    try:
        groups = agent.run(records, params, generate)
    finally:
        agent.close()
    return [s for g in groups for s in g], recorded, chat


def check(samples, recorded, chat, model, tokenizer):
    """Every trajectory: layout and mask position by position, then logprobs on every model token."""
    for sample in samples:
        assert sample.extras["agent"]["turns"] == 3 and sample.extras["agent"]["status"] == "ok"
        expected, mask, engine_logprobs = list(sample.prompt_token_ids), [], []
        sequence = sample.prompt_token_ids + sample.response_token_ids
        for turn in range(3):
            # this trajectory's request of this turn: its prompt is the sequence so far, and the
            # engine's answer is what follows in the trajectory (the two samples of a record share
            # their first prompt)
            requests = [r for r in recorded if r[0] == expected and sequence[len(expected):][: len(r[1])] == r[1]]
            assert requests, "the sequence is not the engine's ids"
            prompt, ids, logprobs = requests[0]
            expected += ids
            mask += [1] * len(ids)
            engine_logprobs += logprobs
            if turn < 2:
                observation = chat.observation_ids(
                    [{"role": "tool", "content": f"turn {turn + 1}: {len(ids)} tokens"}], ids[-1])
                expected += observation
                mask += [0] * len(observation)
                engine_logprobs += [0.0] * len(observation)
        assert sample.prompt_token_ids + sample.response_token_ids == expected, "the sequence is not the engine's ids"
        assert sample.extras["loss_mask"] == mask, "the mask is not 0 exactly on the observations"
        ids = torch.tensor([sample.prompt_token_ids + sample.response_token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(sample.prompt_token_ids) - 1: -1].double()
        reference = torch.log_softmax(logits, -1).gather(-1, ids[0, len(sample.prompt_token_ids):, None])[:, 0]
        scored = torch.tensor(sample.extras["loss_mask"], dtype=torch.bool)
        diff = (reference - torch.tensor(sample.logprobs, dtype=torch.float64))[scored].abs()
        assert diff.max() <= TOLERANCE, f"engine vs transformers logprob differs by {diff.max():.2e} on a model token"
        assert torch.equal(torch.tensor(sample.logprobs)[~scored], torch.zeros(int((~scored).sum())))


def test_multi_turn_tokens_masks_and_logprobs_match_transformers(served):
    samples, recorded, chat = rollout(served)
    check(samples, recorded, chat, served[1], served[2])
    assert len(recorded) == 4 * 3  # one request per trajectory and turn: token ids in, never text


def test_checks_fail_when_the_model_text_is_retokenized(served):
    class Retokenizing(AgentRollout):
        """verl #3720 / TRL #5224's bug: each turn decoded and encoded again (stop token lost)."""

        def _model_turn(self, active, params, generate):
            def through_text(prompts, request):
                groups = generate(prompts, request)
                for (sample,) in groups:
                    text = self.tokenizer.decode(sample.response_token_ids, skip_special_tokens=True)
                    sample.response_token_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                    sample.logprobs = sample.logprobs[: len(sample.response_token_ids)]
                return groups

            super()._model_turn(active, params, through_text)

    samples, recorded, chat = rollout(served, Retokenizing)
    with pytest.raises(AssertionError, match="the sequence is not the engine's ids"):
        check(samples, recorded, chat, served[1], served[2])


def test_checks_fail_when_the_mask_is_off_by_one(served):
    samples, recorded, chat = rollout(served)
    for sample in samples:
        sample.extras["loss_mask"] = [0] + sample.extras["loss_mask"][:-1]
    with pytest.raises(AssertionError, match="the mask is not 0 exactly on the observations"):
        check(samples, recorded, chat, served[1], served[2])


def test_seeded_long_prompts_whose_prefill_is_split_sample_as_they_do_alone(served):
    """vLLM's CPU build died on a seeded request whose prompt prefill was split over engine steps
    (it rewound the request's generator with the CUDA-only `set_offset`): the first multi-turn run
    with tool schemas in its prompts hit it. Ten ~900-token prompts exceed one step's token budget,
    so some are prefilled in pieces; with runtime/cpu/vllm_repairs.py `fix_cpu_seeded_chunked_prefill`
    each samples exactly what it samples alone (prefix-cached, in one piece)."""
    engine = served[0]
    prompts = [[1] + [6 + (index * 13 + position) % 80 for position in range(899)] for index in range(10)]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=9)
    together = engine.generate(prompts, params, timeout_s=300)
    for index in (0, 4, 9):
        (alone,) = engine.generate([prompts[index]], params.offset(index), timeout_s=300)
        assert [s.response_token_ids for s in alone] == [s.response_token_ids for s in together[index]], index
    assert len({tuple(s.response_token_ids) for group in together for s in group}) > 10  # seeds differ
