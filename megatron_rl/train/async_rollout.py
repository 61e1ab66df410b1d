"""Asynchronous rollout: later steps' samples are generated while the trainer trains (rl.max_staleness >= 1).

Policy versions. Version v is the policy after v RL steps (0: the weights the run starts RL
from); step s updates version s - 1 into version s, and the engines receive version s in the
push that ends step s. A sample token produced by version w, trained on at step s, is
s - 1 - w versions stale. Every token records its version (`Trajectory.versions`).

The schedule, with k = rl.max_staleness:

    batch s (the groups step s trains on) starts generating once the engines hold a version
    >= s - 1 - k, so no token is more than k versions older than the policy it updates;
    the push of version v happens between trainer steps and, without partial rollouts, only
    after every batch due at an older version (batches up to v + k) is complete, so whole
    sequences come from one version and batch s is generated from exactly version
    max(0, s - 1 - k): the samples, and so the run, do not depend on timing.

    step:      1          2          3          4
    trainer:   [train 1 ] [train 2 ] [train 3 ] ...
    engines:   [gen 1][gen 2 (v0)  ][gen 3 (v1)][gen 4 (v2)]      (k = 1; push v between)

With rollout.partial, a push happens as soon as a step ends: the engines abort their in-flight
requests (each returns what it has), take the new weights, and every unfinished sequence
continues from its last token on the new weights (re-prefilled, so no KV the old weights
computed is reused); its tokens carry two versions and the loss uses each token's own
behaviour logprob. Before the weights change, every request sent at the old version has
returned (`_drain`), so the recorded versions are exact. Which token lands on which side of an
update depends on timing, so partial runs are not bit-reproducible.

Streaming groups and active sampling. One request per prompt group, at most
`wanted + overgeneration` groups in flight. Groups are scored and (dynamic sampling) filtered one
by one in the order their prompts were drawn, and the batch is complete once `wanted` useful
groups exist or `max_groups` were scored. Groups generated beyond that are dropped and their
prompts go back to the sampler (its state is rewound to just after the last group used), so the
prompt stream, and each prompt's seed (from its position in the stream), do not depend on how far
ahead the producer ran.

Everything here runs on the driver (global rank 0), in one producer thread plus a pool of
request threads; the trainer takes a finished batch and broadcasts it to every rank, or the
producer's error: engines that all died (or refused a request) stop every rank with
`RolloutFailed` at the step that needed them (rollout/pool.py). Checkpoints
carry the finished batches not yet trained on and the sampler state from which the next one
starts (`state_dict`), so a resumed run trains on exactly what the uninterrupted one would have
(without partial rollouts).
"""

from __future__ import annotations

import copy
import hashlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from megatron_rl.train.experience import Trajectory
from megatron_rl.train.scoring import keeps_group
from megatron_rl.rollout.protocol import Sample, SamplingParams

_STATE_VERSION = 1
_POLL_S = 1.0  # how often blocked waits look for an error or a shutdown


@dataclass
class Batch:
    """What one RL step trains on, complete."""

    step: int
    groups: list[list[Trajectory]]  # the kept groups, in stream order
    generated: list[list[Trajectory]]  # every group scored for this batch (kept or filtered)
    reward_metrics: list[tuple[int, dict]]  # the scorer's metrics of each scored group, with its sample count
    prompts: list[int]  # the prompt index of each scored group
    overgenerated: int = 0  # groups generated ahead of need and dropped unused
    sampler_metrics: dict = field(default_factory=dict)  # e.g. a curriculum's band shares of the kept groups


@dataclass
class _Slot:
    """One prompt group in flight: its place in the prompt stream and its request."""

    position: int
    prompt: int
    cursor: dict  # the sampler state just before this prompt was drawn
    future: Future
    dropped: threading.Event = field(default_factory=threading.Event)


class AsyncRollout:
    def __init__(self, *, pool, sampler, encode: Callable[[int], list[int]],
                 score_group: Callable[[int, list[Sample]], tuple[list[Trajectory], dict]],
                 params: SamplingParams, wanted: int, max_staleness: int, partial: bool, dynamic_sampling: bool,
                 max_groups: int, overgeneration: int, timeout_s: float, last_step: int,
                 generate_group: Callable[[int, SamplingParams, Callable], list[Sample]] | None = None):
        """`pool`: the servers (rollout.pool.EnginePool). `sampler`: the prompt sampler, used by
        this object only from now on. `encode(prompt_index)`: its token ids. `score_group(prompt_index,
        samples)`: the group's trajectories with rewards (and `versions` from the samples), and
        the scorer's metrics. `params`: the group request (n = G, seed = the run's base seed).
        `generate_group(prompt_index, params, request)`: multi-turn, the group's trajectories, each
        engine request sent through `request` (None: one request of the encoded prompt)."""
        if max_staleness < 1:
            raise ValueError("AsyncRollout needs max_staleness >= 1 (0 is the synchronous loop)")
        self.pool, self.sampler, self.encode, self.score_group = pool, sampler, encode, score_group
        self.generate_group = generate_group
        self.params, self.wanted, self.max_staleness, self.partial = params, wanted, max_staleness, partial
        self.dynamic_sampling, self.max_groups, self.timeout_s = dynamic_sampling, max_groups, timeout_s
        self.overgeneration = overgeneration if dynamic_sampling else 0
        self.last_step = last_step
        self._cond = threading.Condition()
        self._ready: dict[int, Batch] = {}
        self._version = 0  # the version the engines hold
        self._pushing = False
        self._outstanding = 0  # requests sent and not yet returned
        self._generated_through = 0  # every batch up to this step is complete
        self._drawn = 0  # prompts drawn from the stream so far (each group's seed is its position)
        self._cursor: dict | None = None  # (sampler state, drawn) where the next batch starts
        self._error: BaseException | None = None
        self.notices: list[str] = []  # the sampler's messages, for the trainer to log
        self._closing = False
        self._thread: threading.Thread | None = None
        self._requests = ThreadPoolExecutor(max_workers=wanted + self.overgeneration, thread_name_prefix="rollout")

    # ---- the trainer's side (driver) ------------------------------------------------------------

    def start(self, next_step: int, version: int, state: dict | None = None) -> None:
        """Begin generating from batch `next_step`, the engines holding `version`; `state`: what
        `state_dict` returned at the checkpoint this run resumes from."""
        with self._cond:
            self._version = version
            self._generated_through = next_step - 1
            if state is not None:
                self._load_state(state, next_step)
            self._cursor = {"sampler": self.sampler.state_dict(), "drawn": self._drawn}
        self._thread = threading.Thread(target=self._produce, name="async-rollout", daemon=True)
        self._thread.start()

    def take(self, step: int) -> Batch:
        """The batch of step `step`, waiting for it to be complete."""
        with self._cond:
            while step not in self._ready:
                self._check()
                self._cond.wait(_POLL_S)
            return self._ready.pop(step)

    def before_push(self, version: int) -> None:
        """The trainer is about to push `version`. Without partial rollouts, wait until every
        batch due at an older version is complete; then hold new requests until `pushed`."""
        with self._cond:
            due = min(self.last_step, version + self.max_staleness)
            while not self.partial and self._generated_through < due:
                self._check()
                self._cond.wait(_POLL_S)
            self._pushing = True
        if self.partial:
            self._drain()

    def pushed(self, version: int) -> None:
        with self._cond:
            self._version, self._pushing = version, False
            self._cond.notify_all()

    def state_dict(self) -> dict:
        """JSON-safe: the finished batches not yet trained on and where the next batch starts.
        Take it between steps (after the push), when no batch is being handed over."""
        with self._cond:
            return {"version": _STATE_VERSION,
                    "ready": {str(step): _batch_to_json(batch) for step, batch in sorted(self._ready.items())},
                    "cursor": copy.deepcopy(self._cursor)}

    def sampler_state(self) -> dict:
        """The sampler state a checkpoint records: where the next batch to generate starts."""
        with self._cond:
            return copy.deepcopy(self._cursor["sampler"])

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._requests.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None:
            self._thread.join(timeout=5 * _POLL_S)

    # ---- the producer thread ------------------------------------------------------------------

    def _produce(self) -> None:
        try:
            step = self._generated_through + 1
            while step <= self.last_step:
                with self._cond:
                    while step in self._ready:  # restored from a checkpoint
                        step += 1
                    if step > self.last_step:
                        break
                    start_version = max(0, step - 1 - self.max_staleness)
                    while self._version < start_version or self._pushing:
                        if self._closing:
                            return
                        self._cond.wait(_POLL_S)
                    self._cursor = {"sampler": self.sampler.state_dict(), "drawn": self._drawn}
                batch = self._generate_batch(step)
                with self._cond:
                    self._ready[step] = batch
                    self._generated_through = step
                    self._cursor = {"sampler": self.sampler.state_dict(), "drawn": self._drawn}
                    self._cond.notify_all()
                step += 1
        except BaseException as exc:  # handed to the trainer's thread by _check
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _generate_batch(self, step: int) -> Batch:
        in_flight: list[_Slot] = []
        kept, generated, reward_metrics, prompts, kept_prompts = [], [], [], [], []
        scored = 0
        while len(kept) < self.wanted:
            room = self.wanted - len(kept) + self.overgeneration
            while len(in_flight) < room and scored + len(in_flight) < self.max_groups:
                in_flight.append(self._submit())
            if not in_flight:
                break  # max_groups scored without enough useful groups: train on what there is
            slot = in_flight.pop(0)
            trajectories, metrics = self.score_group(slot.prompt, self._result(slot))
            scored += 1
            generated.append(trajectories)
            reward_metrics.append((len(trajectories), metrics))
            prompts.append(slot.prompt)
            if keeps_group(trajectories, self.dynamic_sampling):
                kept.append(trajectories)
                kept_prompts.append(slot.prompt)
        if in_flight:  # generated ahead and not needed: their prompts go back to the stream
            with self._cond:
                self.sampler.load_state_dict(in_flight[0].cursor)
                self._drawn = in_flight[0].position
            for slot in in_flight:
                slot.dropped.set()
        # The sampler learns the batch's outcomes after the rewind (a curriculum's draws within a
        # batch do not depend on that batch's own groups, so they do not depend on timing).
        with self._cond:
            for prompt, trajectories in zip(prompts, generated):
                self.sampler.observe(prompt, [t.reward for t in trajectories])
            sampler_metrics = self.sampler.band_metrics(kept_prompts)
            self.notices.extend(self.sampler.pop_notices())
            self.sampler.step()  # one batch is one step of the sampler's clock
        return Batch(step, kept, generated, reward_metrics, prompts, overgenerated=len(in_flight),
                     sampler_metrics=sampler_metrics)

    def _submit(self) -> _Slot:
        with self._cond:
            cursor = self.sampler.state_dict()
            prompt = self.sampler.take(1)[0]
            position = self._drawn
            self._drawn += 1
        slot = _Slot(position, prompt, cursor, Future())
        slot.future = self._requests.submit(self._generate_group, slot)
        return slot

    def _result(self, slot: _Slot) -> list[Sample]:
        while True:
            self._check()
            try:
                return slot.future.result(timeout=_POLL_S)
            except TimeoutError:
                continue

    def _generate_group(self, slot: _Slot) -> list[Sample]:
        """One prompt's G samples (multi-turn: G trajectories, each turn one request)."""
        params = self.params.offset(slot.position)

        def request(prompts: list[list[int]], request_params: SamplingParams) -> list[list[Sample]]:
            return self._sampled(prompts, request_params, slot)

        if self.generate_group is not None:
            return self.generate_group(slot.prompt, params, request)
        return request([self.encode(slot.prompt)], params)[0]

    def _sampled(self, prompts: list[list[int]], params: SamplingParams, slot: _Slot) -> list[list[Sample]]:
        """One request's samples, each token's version in extras["versions"]; with partial
        rollouts each aborted sample is continued on the weights that replaced the ones it
        started with."""
        version, groups = self._request(prompts, params)
        out = []
        for index, (prompt, group) in enumerate(zip(prompts, groups)):
            samples = []
            for sample in group:
                versions = [version] * len(sample.response_token_ids)
                continued, last = 0, version
                while sample.finish_reason == "abort" and not slot.dropped.is_set():
                    sample, versions, last = self._continue(prompt, index, sample, versions, last, params, continued)
                    continued += 1
                sample.extras["versions"] = versions
                samples.append(sample)
            out.append(samples)
        return out

    def _continue(self, prompt, index: int, sample: Sample, versions: list[int], last: int, params: SamplingParams,
                  continued: int) -> tuple[Sample, list[int], int]:
        """A sample aborted while version `last` generated it, continued on the weights that
        replace it: prompt + its tokens so far, re-prefilled."""
        remaining = params.max_tokens_of(index) - len(sample.response_token_ids)
        if remaining <= 0:
            return replace(sample, finish_reason="length"), versions, last
        seed = _continuation_seed(params.prompt_seed(index), sample.sample_index, continued)
        more = replace(params, n=1, max_tokens=remaining, seed=seed, seed_offset=0, prompt_seeds=(),
                       prompt_max_tokens=())
        version, tail = self._request([prompt + sample.response_token_ids], more, newer_than=last)
        tail = tail[0][0]
        joined = Sample(sample.prompt_index, sample.sample_index, list(prompt),
                        sample.response_token_ids + tail.response_token_ids, sample.logprobs + tail.logprobs,
                        tail.finish_reason, dict(sample.extras))
        return joined, versions + [version] * len(tail.response_token_ids), version

    def _request(self, prompts, params: SamplingParams, newer_than: int | None = None):
        """(the version that generates it, the engines' answer) for a request sent now: never
        during a push, and a continuation only once the update that aborted it has landed. It
        counts as outstanding until it returns, which `_drain` waits for."""
        with self._cond:
            while self._pushing or (newer_than is not None and self._version <= newer_than):
                if self._closing:
                    raise RuntimeError("asynchronous rollout closed while a request waited for a weight update")
                self._cond.wait(_POLL_S)
            version = self._version
            self._outstanding += 1
        try:
            return version, self.pool.generate(prompts, params, self.timeout_s)
        finally:
            with self._cond:
                self._outstanding -= 1
                self._cond.notify_all()

    def _drain(self) -> None:
        """Partial rollouts, before the weights change: every request sent at the old version
        returns first, finished or aborted with the tokens it has, so each token's recorded
        version is the one that produced it. A request still travelling when the engines paused
        waits in their queue, and would otherwise run on the new weights under the old version:
        resuming and aborting again admits it and returns it (with any tokens the old weights
        gave it), until nothing sent before the push is left."""
        self.pool.pause("abort")
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._outstanding == 0 or self._error is not None, timeout=0.2)
                if self._outstanding == 0 or self._error is not None:
                    return
            self.pool.resume()
            self.pool.pause("abort")

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"asynchronous rollout failed: {self._error}") from self._error
        if self._closing:
            raise RuntimeError("asynchronous rollout closed")

    # ---- checkpoint state ---------------------------------------------------------------------

    def _load_state(self, state: dict, next_step: int) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"asynchronous rollout state version {state.get('version')!r} is not {_STATE_VERSION}")
        self._ready = {int(step): _batch_from_json(batch) for step, batch in state["ready"].items()
                       if int(step) >= next_step}
        self.sampler.load_state_dict(state["cursor"]["sampler"])
        self._drawn = int(state["cursor"]["drawn"])
        if self._ready:
            self._generated_through = max(self._ready)



def staleness(batch: Batch, policy_version: int) -> list[int]:
    """Per sample: how many versions its oldest token is older than `policy_version`."""
    return [policy_version - min(t.versions, default=policy_version) for group in batch.groups for t in group]


def _continuation_seed(seed: int | None, sample_index: int, continued: int) -> int | None:
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{sample_index}:{continued}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


def _trajectory_to_json(t: Trajectory) -> dict[str, Any]:
    return {"group": t.group, "prompt_ids": t.prompt_ids, "response_ids": t.response_ids,
            "rollout_logprobs": t.rollout_logprobs, "truncated": t.truncated, "reward": t.reward,
            "versions": t.versions, "loss_mask": t.loss_mask, "agent": t.agent,
            "routed_experts": None if t.routed_experts is None else t.routed_experts.tolist(),
            "segments": [_trajectory_to_json(segment) for segment in t.segments]}


def _trajectory_from_json(d: dict[str, Any]) -> Trajectory:
    routes = d["routed_experts"]
    return Trajectory(d["group"], d["prompt_ids"], d["response_ids"], d["rollout_logprobs"], d["truncated"],
                      d["reward"], routed_experts=None if routes is None else torch.tensor(routes, dtype=torch.int32),
                      versions=d["versions"], loss_mask=d.get("loss_mask"), agent=d.get("agent"),
                      segments=[_trajectory_from_json(segment) for segment in d.get("segments", ())])


def _batch_to_json(batch: Batch) -> dict[str, Any]:
    groups = [[_trajectory_to_json(t) for t in g] for g in batch.generated]
    kept = [next(i for i, g in enumerate(batch.generated) if g is group) for group in batch.groups]
    return {"step": batch.step, "generated": groups, "kept": kept, "reward_metrics": batch.reward_metrics,
            "prompts": batch.prompts, "overgenerated": batch.overgenerated, "sampler_metrics": batch.sampler_metrics}


def _batch_from_json(d: dict[str, Any]) -> Batch:
    generated = [[_trajectory_from_json(t) for t in g] for g in d["generated"]]
    return Batch(d["step"], [generated[i] for i in d["kept"]], generated,
                 [(int(count), metrics) for count, metrics in d["reward_metrics"]], d["prompts"], d["overgenerated"],
                 d["sampler_metrics"])
