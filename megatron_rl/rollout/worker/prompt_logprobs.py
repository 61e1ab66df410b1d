"""Prompt logprobs of a whole engine step at once, in vLLM's workers (the served teacher's scoring).

vLLM (0.32) computes `prompt_logprobs` one request at a time (GPUModelRunner._get_prompt_logprobs_dict,
"a rare feature", its comment says): per request the LM head, a log-softmax, a top-k, a gather and a
rank count, each a small kernel call. The teacher sends every sampled sequence of a step as its own
request, so that loop ran 100-256 times per engine step: on 2 CPU cores it was 54% of the engine's
time while scoring (py-spy), more than the model's forward (22%).

`batch_prompt_logprobs()` replaces it with the same computation over the rows of every request of
the step together, grouped by how many alternatives each asks for: the same logits rows, the same
row-wise log-softmax, gather and rank, copied into each request's tensors exactly where the loop
copied them (chunked prefill included). Idempotent; returns False where vLLM has no such runner.
"""

from __future__ import annotations

import torch


def batch_prompt_logprobs() -> bool:
    try:
        from vllm.v1.outputs import LogprobsTensors
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    if getattr(GPUModelRunner._get_prompt_logprobs_dict, "_batched", False):
        return True
    original = GPUModelRunner._get_prompt_logprobs_dict

    def _get_prompt_logprobs_dict(self, hidden_states: torch.Tensor, num_scheduled_tokens: dict[str, int]):
        wanted = self.num_prompt_logprobs
        if not wanted:
            return {}
        if any(self.requests[req_id].prompt_token_ids is None for req_id in wanted):
            return original(self, hidden_states, num_scheduled_tokens)  # prompt embeddings: vLLM's own way
        result, completed = {}, []
        parts: dict[int, list] = {}  # alternatives asked for -> [(tensors, chunk, rows, targets)]
        for req_id, alternatives in wanted.items():
            count = num_scheduled_tokens.get(req_id)
            if count is None:  # preempted in its prefill
                continue
            request = self.requests[req_id]
            prompt = request.prompt_token_ids
            tensors = request.in_progress_prompt_logprobs_cpu
            if tensors is None:
                tensors = LogprobsTensors.empty_cpu(len(prompt) - 1, alternatives + 1)
                request.in_progress_prompt_logprobs_cpu = tensors
            start = request.num_computed_tokens
            remaining = len(prompt) - (start + 1)
            if count <= remaining:
                logits_rows = count
            else:
                logits_rows = remaining
                completed.append(req_id)
                result[req_id] = tensors
            if logits_rows <= 0:
                continue
            offset = self.query_start_loc.np[self.input_batch.req_id_to_index[req_id]].item()
            parts.setdefault(alternatives, []).append(
                (tensors, slice(start, start + logits_rows), range(offset, offset + logits_rows),
                 prompt[start + 1: start + 1 + logits_rows]))
        for alternatives, group in parts.items():
            rows = torch.tensor([row for _, _, span, _ in group for row in span], device=hidden_states.device)
            targets = torch.tensor([token for *_, tokens in group for token in tokens], dtype=torch.int64,
                                   device=hidden_states.device)
            logits = self.model.compute_logits(hidden_states.index_select(0, rows))
            if self.model_config.logprobs_mode in ("raw_logits", "processed_logits"):
                scores = logits.to(torch.float32)
            else:
                scores = self.sampler.compute_logprobs(logits)
            token_ids, logprobs, ranks, *_ = self.sampler.gather_logprobs(scores, alternatives, targets)
            start = 0
            for tensors, chunk, span, _ in group:
                end = start + len(span)
                tensors.logprob_token_ids[chunk].copy_(token_ids[start:end], non_blocking=True)
                tensors.logprobs[chunk].copy_(logprobs[start:end], non_blocking=True)
                tensors.selected_token_ranks[chunk].copy_(ranks[start:end], non_blocking=True)
                start = end
        for req_id in completed:
            del wanted[req_id]
            self.requests[req_id].in_progress_prompt_logprobs_cpu = None
        if result:
            self._sync_device()
        return result

    _get_prompt_logprobs_dict._batched = True
    GPUModelRunner._get_prompt_logprobs_dict = _get_prompt_logprobs_dict
    return True
