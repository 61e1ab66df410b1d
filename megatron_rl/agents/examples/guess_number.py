"""An example environment to copy: the model guesses a record's integer answer, told "higher" or
"lower" after each wrong guess.

    rollout:
      environment: megatron_rl.agents.examples.guess_number:GuessNumber
      environment_args: {reward_decay: 0.8}
      max_turns: 4
    data:
      prompt_format: chat
      synthetic: {task: add, max_operand: 30}     # any data whose answer is an integer

What it shows (docs/agents.md has the contract):
- `reset(record)` keeps what the episode needs from the dataset row and returns an empty
  Observation: the first turn is the record's prompt, encoded as for single-turn training;
- `step(response_text, response_ids)` gets the model's turn as text (for parsing) and as the
  engine's ids (never needed here: the rollout keeps the tokens itself); it answers with a user
  message, a turn reward only when the episode ends (so `rollout.turn_reward: last` and `sum`
  agree), `done`, and `info` numbers that become `agent/info/<key>` metrics;
- garbage from the model is the model's problem (a reward of 0), never an exception: an exception
  marks the trajectory `failed`, which is for the environment's own faults.
"""

from __future__ import annotations

import re

from megatron_rl.agents.environment import Environment, Observation

_INTEGER = re.compile(r"-?\d+")


class GuessNumber(Environment):
    def __init__(self, reward_decay: float = 0.8):
        if not 0 < reward_decay <= 1:
            raise ValueError(f"reward_decay must be in (0, 1], got {reward_decay}")
        self.reward_decay = reward_decay

    def reset(self, record) -> Observation:
        self.target, self.guesses = int(record.answer), 0
        return Observation()

    def step(self, response_text: str, response_ids: list[int]) -> Observation:
        self.guesses += 1
        found = _INTEGER.findall(response_text)
        if not found:
            return Observation(messages=[{"role": "user", "content": "answer with a number"}],
                               info={"unparsed": 1.0})
        guess = int(found[-1])
        if guess == self.target:
            # earlier is better: 1, then reward_decay, reward_decay**2, ...
            return Observation(reward=self.reward_decay ** (self.guesses - 1), done=True,
                               info={"solved": 1.0, "guesses": float(self.guesses)})
        hint = "higher" if guess < self.target else "lower"
        return Observation(messages=[{"role": "user", "content": hint}], info={"unparsed": 0.0})
