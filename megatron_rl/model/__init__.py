"""The policy model: HF config -> Megatron GPTModel, packed batches, logprobs, training step.

Import the pieces from their modules (`megatron_rl.model.policy.Policy`, ...): importing this
package does not import Megatron-Core, so pure pieces (packing, logprobs, hf_config) stay light.
"""
