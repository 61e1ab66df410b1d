"""A multi-turn environment with a bug on every trajectory (test_training_faults.py): its reset
looks up a field the dataset records do not have."""

from megatron_rl.agents import Environment


class MissingField(Environment):
    def reset(self, record):
        self.target = record.metadata["expected_tool_output"]  # KeyError: no record has it
        return super().reset(record)

    def step(self, response_text, response_ids):
        raise AssertionError("never reached: every reset fails")
