"""The rollout engines: where they run, how weights reach them, how requests are bounded."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.errors import ConfigError

# Upper bounds of counts and sizes that start processes, threads or allocations before anything
# could report a better error; each is far beyond a real setting, so only a typo meets it.
LIMITS = {
    "max_model_len": (1 << 28, "tokens of context; preflight also holds it within the model's own"),
    "num_servers": (1 << 10, "vLLM or SGLang server processes started on this node"),
    "weight_bucket_mb": (1 << 20, "each bucket of the weight push is held in memory"),
    "max_retries": (1 << 10, "retries of one request"),
    "max_turns": (1 << 10, "model turns of one trajectory"),
    "env_workers": (1 << 10, "threads running environment calls"),
    "score_chunks": (1 << 16, "requests one generate round is split into"),
    "overgeneration_groups": (1 << 16, "groups generated ahead of need, in flight at once"),
}
MAX_SERVER_TP = 1 << 10  # GPUs of one server
MAX_CPU_KV_CACHE_GIB = 1 << 14  # a CPU engine allocates its KV cache up front


@dataclass
class RolloutConfig:
    """The rollout engine: where it runs, how weights reach it, and how requests are bounded."""

    engine: Literal["vllm", "sglang"] = "vllm"
    # colocated: an engine inside the trainer processes, its tensor parallelism spanning the
    # trainer's ranks (vLLM only; the default on CPU). server: OpenAI-compatible HTTP servers,
    # started by us on this node (server_urls empty) or already running elsewhere.
    mode: Literal["colocated", "server"] = "colocated"
    server_urls: list[str] = field(default_factory=list)
    num_servers: int = 1  # servers to start when server_urls is empty
    # Tensor parallel size of each server we start: one value for all, or one per server (servers
    # at server_urls report their own size to the collective transport).
    server_tp: int | list[int] = 1
    # Engine dtype; "auto" follows model.precision (fp32 -> float32, bf16 -> bfloat16).
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    max_model_len: int = 1024
    gpu_memory_utilization: float = 0.5
    cpu_kv_cache_gib: float = 1.0
    # vLLM's sleep mode around training (colocated engine, GPU only): after each step's generation
    # the engine releases its GPU memory while the policy trains, and takes it back for the next
    # push. 0: off. 1: weights offloaded to host memory, KV cache freed. 2: weights discarded too
    # (the push restores them; less host memory, nothing copied back). Level 2 is not yet verified
    # on a GPU (the engine stage checks both levels: benchmarks/gpu_engine_sync.py), and vLLM has
    # served wrong outputs after a level-2 wake: the discard frees state the weight push does not
    # restore (the rotary cache, until vLLM kept named buffers across it), and vLLM's report "sleep
    # level 2 causes gibberish outputs" is still open. OpenRLHF uses level 1 only, for this reason.
    sleep_level: int = 0
    # How weights travel after each step (rollout/weights/transport.py). stream: by reference into a
    # colocated engine. files: safetensors on a filesystem the servers share. collective: a
    # broadcast from each pipeline stage's leader to every rank of every server (vLLM), gloo on
    # CPU and NCCL on GPU; nccl: the same, requiring NCCL. auto: stream when colocated, collective
    # to vLLM servers, files to SGLang servers.
    weight_transport: Literal["auto", "stream", "files", "collective", "nccl"] = "auto"
    weight_bucket_mb: int = 512
    # A LoRA run's push (model.lora; docs/lora.md). merged: every push carries the whole model
    # W + (alpha / rank) B A. adapters: the base weights once, then only the adapters, served by
    # vLLM's own LoRA (rollout/engines/vllm_lora.py says what it takes and refuses).
    lora_push: Literal["merged", "adapters"] = "merged"
    # Where the files transport stages buckets; must be visible to the servers. None = OUTPUT_DIR/.weights
    staging_dir: str | None = None
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 900.0
    max_retries: int = 2  # per request, for transient HTTP failures; then the engine is reported dead
    # Asynchronous RL (rl.max_staleness >= 1, servers only; megatron_rl/train/async_rollout.py).
    # partial: a weight update lands mid-generation: the engines abort their in-flight requests,
    # take the new weights, and every unfinished sequence continues from its last token on the
    # new weights (re-prefilled: no KV computed by the old weights is reused); its tokens record
    # which policy version produced them. false: an update waits until the engines are idle.
    partial: bool = False
    # Active sampling with dynamic sampling: groups are generated ahead of need so the engines
    # stay busy while zero-spread groups are dropped. At most this many groups beyond those still
    # needed are in flight; the unused ones are dropped when the step's batch is complete (the
    # bound on over-generation). None = a quarter of rl.prompts_per_step.
    overgeneration_groups: int | None = None
    # Multi-turn agents (megatron_rl/agents, docs/agents.md). An environment by import path
    # ("pkg.module:Class", built with environment_args) takes each model turn and answers with
    # the next observation; tools by import path ("pkg.module:function", or a built-in name:
    # "calculator") are offered to the model in its chat template's format. Tools without an
    # environment: the built-in tool environment runs the model's calls until it answers, and the
    # reward functions score its last turn. Neither: single-turn (one completion per prompt).
    environment: str | None = None
    environment_args: dict = field(default_factory=dict)
    # An agent written against the OpenAI client ("pkg.module:async_function", called as
    # fn(base_url, record, **agent_args)) instead of an environment: it talks to a chat-completions
    # endpoint the rollout serves, which records every call's exact tokens (agents/openai_agent.py).
    # With an agent, `tools` only names the tools the warm start's demonstrations show; the agent
    # offers its own in each request.
    agent: str | None = None
    agent_args: dict = field(default_factory=dict)
    tools: list[str] = field(default_factory=list)
    max_turns: int = 4  # model turns per trajectory
    # Tokens per trajectory after the prompt (model turns and observations); rl.max_response_tokens
    # bounds each model turn. None: rollout.max_model_len minus the prompt.
    max_total_tokens: int | None = None
    # How per-turn environment rewards combine: the last one given, or their sum.
    turn_reward: Literal["last", "sum"] = "last"
    # An environment call (reset / step) or tool call slower than this fails its trajectory.
    env_timeout_s: float = 60.0
    env_workers: int = 32  # threads that run environment calls concurrently
    # Scoring beside generation (synchronous loop): each generate round is sent as this many
    # requests of whole groups, and the driver scores one while the next generates, so a slow
    # reward (code_tests runs a sandbox per test case) hides behind generation. 1: generate the
    # round in one request, then score it. Seeds do not depend on it. (Asynchronous RL scores
    # each group as it completes, beside the others' generation, whatever this is.)
    score_chunks: int = 1

    @property
    def multi_turn(self) -> bool:
        return self.environment is not None or self.agent is not None or bool(self.tools)

    def tp_of_server(self, index: int) -> int:
        """The tensor parallel size of the `index`-th server we start."""
        sizes = self.server_tp if isinstance(self.server_tp, list) else [self.server_tp]
        return sizes[index] if len(sizes) > 1 else sizes[0]

    def validate(self, where: str) -> None:
        if self.engine == "sglang" and self.mode == "colocated":
            raise ConfigError(f"{where}.mode=colocated is vLLM only; SGLang runs as servers (mode: server)")
        if self.weight_transport == "stream" and self.mode == "server":
            raise ConfigError(f"{where}.weight_transport=stream needs mode=colocated; servers take files or collective")
        if self.weight_transport in ("files", "collective", "nccl") and self.mode == "colocated":
            raise ConfigError(f"{where}.weight_transport={self.weight_transport} is for servers; colocated engines use stream")
        self._validate_sleep(where)
        if self.weight_transport in ("collective", "nccl") and self.engine == "sglang":
            raise ConfigError(f"{where}.weight_transport={self.weight_transport}: SGLang servers take weights through "
                              f"files (weight_transport: files, with staging_dir on a filesystem they share)")
        sizes = self.server_tp if isinstance(self.server_tp, list) else [self.server_tp]
        if not sizes or any(size < 1 for size in sizes):
            raise ConfigError(f"{where}.server_tp must be >= 1 (one value, or one per server), got {self.server_tp}")
        if isinstance(self.server_tp, list) and len(sizes) not in (1, self.num_servers):
            raise ConfigError(f"{where}.server_tp lists {len(sizes)} sizes for num_servers={self.num_servers}; "
                              f"give one value for all servers or one per server")
        for name in ("num_servers", "max_model_len", "weight_bucket_mb"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ConfigError(f"{where}.max_retries must be >= 0")
        for name in ("startup_timeout_s", "request_timeout_s", "cpu_kv_cache_gib"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):  # NaN compares False
                raise ConfigError(f"{where}.{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.cpu_kv_cache_gib > MAX_CPU_KV_CACHE_GIB:
            raise ConfigError(f"{where}.cpu_kv_cache_gib must be at most {MAX_CPU_KV_CACHE_GIB} (a CPU engine "
                              f"allocates its KV cache when it starts), got {self.cpu_kv_cache_gib}")
        if any(size > MAX_SERVER_TP for size in sizes):
            raise ConfigError(f"{where}.server_tp must be at most {MAX_SERVER_TP} (GPUs of one server), got "
                              f"{self.server_tp}")
        for name, (limit, what) in LIMITS.items():
            value = getattr(self, name)
            if value is not None and value > limit:
                raise ConfigError(f"{where}.{name} must be at most {limit} ({what}), got {value}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"{where}.gpu_memory_utilization must be in (0, 1]")
        for url in self.server_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"{where}.server_urls: {url!r} must start with http:// or https://")
        self._validate_agents(where)
        if self.overgeneration_groups is not None and self.overgeneration_groups < 0:
            raise ConfigError(f"{where}.overgeneration_groups must be >= 0 (or null), got {self.overgeneration_groups}")

    def _validate_sleep(self, where: str) -> None:
        """rollout.sleep_level; that the engines run on a GPU is preflight's (factory.check_engine_capabilities)."""
        if self.sleep_level not in (0, 1, 2):
            raise ConfigError(f"{where}.sleep_level must be 0 (off), 1 or 2, got {self.sleep_level!r}")
        if self.sleep_level and self.mode != "colocated":
            raise ConfigError(f"{where}.sleep_level={self.sleep_level} is for the colocated engine, which shares the "
                              f"trainer's GPUs; servers (mode={self.mode}) keep their own memory: set sleep_level: 0")
        if self.sleep_level == 2 and self.lora_push == "adapters":
            raise ConfigError(f"{where}.sleep_level=2 discards the engine's base weights at every step, but with "
                              f"lora_push=adapters they are pushed once; use sleep_level: 1 or lora_push: merged")

    def _validate_agents(self, where: str) -> None:
        if self.environment is not None and (not isinstance(self.environment, str) or ":" not in self.environment):
            raise ConfigError(f"{where}.environment must be 'pkg.module:Class', got {self.environment!r}")
        if self.environment_args and self.environment is None:
            raise ConfigError(f"{where}.environment_args is set but rollout.environment is not")
        if self.agent is not None and (not isinstance(self.agent, str) or ":" not in self.agent):
            raise ConfigError(f"{where}.agent must be 'pkg.module:function', got {self.agent!r}")
        if self.agent is not None and self.environment is not None:
            raise ConfigError(f"{where}: set rollout.agent (an OpenAI-client agent) or rollout.environment, not both")
        if self.agent_args and self.agent is None:
            raise ConfigError(f"{where}.agent_args is set but rollout.agent is not")
        if not isinstance(self.agent_args, dict):
            raise ConfigError(f"{where}.agent_args must be a mapping (keyword arguments of the agent)")
        if not isinstance(self.environment_args, dict):
            raise ConfigError(f"{where}.environment_args must be a mapping (keyword arguments of the environment)")
        if not isinstance(self.tools, list) or not all(isinstance(t, str) and t for t in self.tools):
            raise ConfigError(f"{where}.tools must be a list of 'pkg.module:function' (or built-in names), "
                              f"got {self.tools!r}")
        if self.score_chunks < 1:
            raise ConfigError(f"{where}.score_chunks must be >= 1, got {self.score_chunks}")
        if self.max_turns < 1 or self.env_workers < 1:
            raise ConfigError(f"{where}: max_turns and env_workers must be >= 1")
        if self.max_total_tokens is not None and not 1 <= self.max_total_tokens < self.max_model_len:
            raise ConfigError(f"{where}.max_total_tokens={self.max_total_tokens} must be in [1, max_model_len="
                              f"{self.max_model_len}) (the prompt needs room too)")
        if self.turn_reward not in ("last", "sum"):
            raise ConfigError(f"{where}.turn_reward must be 'last' or 'sum', got {self.turn_reward!r}")
        if not (self.env_timeout_s > 0 and math.isfinite(self.env_timeout_s)):
            raise ConfigError(f"{where}.env_timeout_s must be a finite number > 0, got {self.env_timeout_s}")
