"""The interfaces the trainer's rollout client sees for every rollout engine: one core protocol,
and small capabilities only some engines have.

    engine.generate(prompts, SamplingParams(n=8, max_tokens=512, seed=step_seed), timeout_s=600)
        -> one list per prompt, n Samples each, in prompt order and sample order
    engine.pause(); <weights arrive through a transport>; engine.reset_prefix_cache(); engine.resume()
    engine.health(); engine.shutdown()

Data-parallel rollout (rollout/pool.py) survives engines dying: a dead engine (`EngineDied`) is
named in a warning and its unfinished prompts are generated again, with the same seeds, on the
live ones.

Every engine (`RolloutEngine`) generates, takes a whole push in process (`update_weights`), says
what it serves (`fingerprint`), drops its prefix cache, pauses and resumes, answers a health check
and shuts down; the trainer never branches on which engine it holds. Engines differ in where they
run (inside the trainer processes, behind HTTP) and so in what else they can do, each a capability
the caller asks for (`supports(engine, FileWeights)`) instead of a method an engine implements only
to refuse it:

    FileWeights         load_weight_files(directory)   files: an HF-style safetensors directory on a
                                                       shared filesystem (vLLM and SGLang servers)
    CollectiveWeights   weight_receivers()             collective: the engine's world size (ranks)
                        join_weight_group(spec, offset)  every engine rank joins the stage groups
                        receive_weights()              receive one push and load it (vLLM servers)
    Sleeps              sleep(level); wake_up(tags)    vLLM's sleep mode around training: memory
                                                       released and restored (colocated vLLM, GPU)

A configuration that asks for a capability its engine lacks (a transport, rollout.sleep_level) is
refused by name before the engine starts (rollout/factory.py, check_engine_capabilities). Errors an
engine raises are `EngineError` subclasses and name the engine, so a dead server among eight is
identifiable.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Literal, Protocol, runtime_checkable

import torch

from megatron_rl.errors import TrainingStopped

FinishReason = Literal["stop", "length", "abort"]  # abort: only with SamplingParams.partial
WeightStream = Iterable[tuple[str, torch.Tensor]]


class EngineError(RuntimeError):
    """A rollout engine failed; the message starts with the engine's name."""


class WeightsNotServed(TrainingStopped):
    """An engine does not serve the weights the trainer pushed (rollout/weights/digest.py): the
    run stops rather than train on its samples. Not an EngineError: no failover hides it."""


class EngineUnauthorized(EngineError):
    """The server refused our rollout token (rollout/auth.py): a configuration error, never retried."""


class EngineTimeout(EngineError):
    """A request did not finish within its timeout (after any retries)."""


class EngineUnavailable(EngineError):
    """The engine is dead or unreachable (process exited, connection refused, health check failed)."""


class EngineDied(EngineUnavailable):
    """An engine stopped answering for good (its process exited, connections refused or reset after
    every retry, or a failed request followed by a failed health check). EnginePool records one per
    dead engine (`pool.cause(name)`), warns, and moves the engine's unfinished prompts to the live
    engines; a weight transport told to `drop` the engine stops pushing to it."""


# vLLM's pause modes: "wait" lets in-flight requests finish, "abort" returns them aborted, "keep"
# freezes them until resume. Engines whose pause() takes no mode support "wait" only.
PAUSE_MODES = ("wait", "abort", "keep")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # samples per prompt (the GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()  # stop strings (need the engine's tokenizer)
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS
    ignore_eos: bool = False  # generate max_tokens whatever is sampled (benchmarks, tests of long sequences)
    # Base seed of the request. Prompt i gets its own seed derived from (seed, i), so results do
    # not depend on how prompts are split across engines or batched, and a resumed run that
    # replays the same seed regenerates the same samples.
    seed: int | None = None
    # Index of this request's first prompt in a larger request that was split (data-parallel
    # rollout), so every prompt keeps the seed it would have had unsplit.
    seed_offset: int = 0
    # R3 (rl.routing_replay: rollout): each Sample carries the engine's MoE routes of every token
    # it ran, extras["routed_experts"], int [prompt + response - 1, MoE layers, k] (vLLM engines).
    return_routed_experts: bool = False
    # Partial rollouts: a request an engine pause aborts (pause(mode="abort"), around a weight
    # update) returns the tokens generated so far with finish_reason "abort", for the caller to
    # continue, instead of failing.
    partial: bool = False
    # Per-prompt overrides, indexed like the seeds (prompt index + seed_offset), so a split
    # request keeps them: multi-turn rollouts send each trajectory's next turn with its own seed
    # (independent of which other trajectories are still running) and its own token budget.
    prompt_seeds: tuple[int, ...] = ()
    prompt_max_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "prompt_seeds", tuple(int(s) for s in self.prompt_seeds))
        object.__setattr__(self, "prompt_max_tokens", tuple(int(t) for t in self.prompt_max_tokens))
        if any(t < 1 for t in self.prompt_max_tokens):
            raise ValueError(f"SamplingParams.prompt_max_tokens must be >= 1, got {self.prompt_max_tokens}")

    def prompt_seed(self, prompt_index: int) -> int | None:
        """The seed of prompt `prompt_index` in the request (stable across processes and splits)."""
        if self.prompt_seeds:
            return self.prompt_seeds[prompt_index + self.seed_offset]
        if self.seed is None:
            return None
        digest = hashlib.blake2b(f"{self.seed}:{prompt_index + self.seed_offset}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & 0x7FFF_FFFF

    def max_tokens_of(self, prompt_index: int) -> int:
        """The token budget of prompt `prompt_index` in the request."""
        if self.prompt_max_tokens:
            return self.prompt_max_tokens[prompt_index + self.seed_offset]
        return self.max_tokens

    def for_prompt(self, prompt_index: int) -> SamplingParams:
        """The parameters of one prompt: its own seed and budget (engines that sample each of the
        n responses as a separate request derive their seeds from this one)."""
        return replace(self, seed=self.prompt_seed(prompt_index), max_tokens=self.max_tokens_of(prompt_index),
                       seed_offset=0, prompt_seeds=(), prompt_max_tokens=())

    def offset(self, start: int) -> SamplingParams:
        """The parameters for the slice of prompts starting at global index `start`."""
        return replace(self, seed_offset=self.seed_offset + start)


@dataclass
class Sample:
    """One generated response. `logprobs[t]` is the engine's log-probability of `response_token_ids[t]`."""

    prompt_index: int  # position of the prompt in the generate() call
    sample_index: int  # 0..n-1 within the prompt's group
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    # Engine-specific additions carried on the same object (e.g. "routed_experts").
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if len(self.logprobs) != len(self.response_token_ids):
            raise ValueError(
                f"sample {self.prompt_index}/{self.sample_index}: {len(self.logprobs)} logprobs for "
                f"{len(self.response_token_ids)} response tokens"
            )


@runtime_checkable
class RolloutEngine(Protocol):
    """What every engine does."""

    name: str

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, timeout_s: float | None = None
    ) -> list[list[Sample]]:
        """n samples per prompt, grouped by prompt, in prompt order then sample order."""

    def update_weights(self, weights: WeightStream) -> int:
        """Load a full set of HF-named weights; returns the number of tensors loaded. In process
        colocated; a server engine stages them as files first (a push to one engine by hand).

        Afterwards every cached prefix is dropped, so no request reuses KV computed with the old
        weights."""

    def fingerprint(self) -> dict | None:
        """What the last push delivered and whether the served weights moved since
        (rollout/weights/digest.py); None where the engine cannot tell (unchecked)."""

    def reset_prefix_cache(self) -> None:
        """Drop cached prefixes (their KV was computed with the previous weights)."""

    def pause(self) -> None:
        """Around a weight sync: hold new generation (in-flight requests finish first). Servers
        also take pause(mode="abort"): in-flight requests end at once, returning what they have
        generated (finish_reason "abort" when they asked for SamplingParams.partial)."""

    def resume(self) -> None:
        ...

    def health(self) -> None:
        """Return if the engine serves requests; raise EngineUnavailable naming it otherwise."""

    def shutdown(self) -> None:
        """Release the engine (idempotent)."""


@runtime_checkable
class FileWeights(Protocol):
    """The files transport: the engine loads a push an HF-style directory holds."""

    def load_weight_files(self, directory: str) -> int:
        """Load the full model from a safetensors directory (model.safetensors.index.json + files)."""


@runtime_checkable
class CollectiveWeights(Protocol):
    """The collective transport (gloo on CPU, NCCL on GPU): every engine rank joins the stage
    leaders' groups and receives their broadcasts (rollout/worker/receiver.py)."""

    def weight_receivers(self) -> int:
        """How many ranks of this engine join a collective weight group."""

    def join_weight_group(self, spec_json: str, rank_offset: int) -> None:
        """Every rank joins each stage's group as rank_offset + its rank; blocks until all joined."""

    def receive_weights(self) -> int:
        """Receive one collective push and load it; returns the number of tensors loaded."""


# wake_up's tags (vLLM's): the weights' memory, the KV cache's; None wakes both.
WAKE_WEIGHTS = ("weights",)
WAKE_KV_CACHE = ("kv_cache",)


@runtime_checkable
class Sleeps(Protocol):
    """vLLM's sleep mode (rollout.sleep_level): the engine releases its device memory while the
    policy trains and takes it back before the next push."""

    def sleep(self, level: int) -> None:
        """Release memory: level 1 offloads the weights to host memory and discards the KV cache;
        level 2 discards the weights too (the next push restores them). Generation is refused
        until the engine is awake again."""

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """Take memory back: `WAKE_WEIGHTS` (before a push), `WAKE_KV_CACHE` (after it), None both.
        The engine generates again once every part is awake."""


def supports(engine: object, capability: type) -> bool:
    """Whether `engine` (an engine or its class: preflight asks before any engine starts) has
    `capability` (FileWeights, CollectiveWeights, Sleeps): every one of its methods."""
    return isinstance(engine, capability) if not isinstance(engine, type) else issubclass(engine, capability)


def check_grouping(name: str, prompts: list[list[int]], params: SamplingParams, groups: list[list[Sample]]) -> None:
    """Engines call this on their result: a wrong count or order would silently misalign rewards."""
    if len(groups) != len(prompts):
        raise EngineError(f"{name}: returned {len(groups)} groups for {len(prompts)} prompts")
    for index, group in enumerate(groups):
        if len(group) != params.n:
            raise EngineError(f"{name}: prompt {index} got {len(group)} samples, asked for {params.n}")
        for position, sample in enumerate(group):
            if sample.prompt_index != index or sample.sample_index != position:
                raise EngineError(f"{name}: sample out of order at prompt {index}, position {position}")
