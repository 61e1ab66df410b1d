"""Everything a run can check before a process group or a model exists.

`check_layout_and_paths` makes a bad run fail in well under a second: the parallel layout
against the model and the world size, and the paths the run reads or must not overwrite. It
imports no torch (that alone takes seconds), so `megatron-rl train` runs it before anything else.
`preflight` then runs the slower checks (the recipe, the run directory, the engine and wandb
installed, every reward function resolved, the datasets read, every prompt's length in tokens)
and returns the datasets it read.

Prompt lengths: the engine refuses a prompt longer than its context, and only when that prompt is
first sampled (minutes or hours into a run, and again after every resume); a prompt that fits but
leaves less than rl.max_response_tokens cuts every answer short. So every prompt, train and
held-out, is rendered and tokenized as the trainer will give it to the engine (data.prompt_format,
the run's tokenizer: data/chat.py's encode_prompt) and counted against rollout.max_model_len -
rl.max_response_tokens, in batches through the tokenizer's batch call. data.overlong_prompts says
what happens to those over: "error" refuses the run naming them, "drop" leaves them out.

The functions import what they check inside them, so that importing this module stays instant.
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.errors import ConfigError


def check_layout_and_paths(config, *, rl: bool = True) -> None:
    """`config`: a loaded RunConfig. Raises ConfigError naming the key and the reason.
    `rl=False` (`megatron-rl sft`): no rollout engine, so not its check. The run directory and
    its checkpoints are checked by megatron_rl.checkpoint.manager.check_run_directory."""
    from megatron_rl.model.hf_config import load_hf_config, parse_hf_config
    from megatron_rl.model.layout_checks import check_layout
    from megatron_rl.runtime.launch_env import read_launch_env

    raw, source = load_hf_config(config.model.hf_config)
    arch = parse_hf_config(raw, source)
    check_layout(config, arch, read_launch_env().world_size, rl=rl, source=source)
    if rl:
        check_engine_context(config, raw, source)
    if rl and config.rollout.weight_transport == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("rollout.weight_transport=nccl needs CUDA GPUs on the trainer and the servers; "
                              "on CPU use collective (the same transport over gloo) or files")
    if rl and config.rollout.lora_push == "adapters":
        from megatron_rl.rollout.engines.vllm_lora import check_adapter_push

        check_adapter_push(config, arch)  # the targets and family vLLM's own LoRA serves here
    if config.model.lora is not None:
        check_lora_rank(config.model.lora, arch, source)
    if rl:
        check_fp8_rollout(config)
        if engines_on_cpu(config):
            from megatron_rl.runtime.cpu.vllm_kernels import refuse_unrunnable

            refuse_unrunnable(raw, source)
    if config.checkpoint.init_from and not Path(config.checkpoint.init_from).exists():
        raise ConfigError(f"checkpoint.init_from: {config.checkpoint.init_from} does not exist")


def lora_layer_widths(arch, target: str) -> dict[str, tuple[int, int]]:
    """{linear: (in features, out features)} of the layers LoRA target `target` adapts
    (config/model.py: LoraConfig.targets; model/lora.py builds them)."""
    hidden, heads = arch.hidden_size, arch.num_attention_heads
    if target == "qkv" and arch.mla is not None:
        mla = arch.mla
        layers = {"linear_kv_down_proj": (hidden, mla.kv_lora_rank + mla.qk_rope_head_dim),
                  "linear_kv_up_proj": (mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim))}
        if mla.q_lora_rank is None:
            return {"linear_q_proj": (hidden, heads * mla.qk_head_dim), **layers}
        return {"linear_q_down_proj": (hidden, mla.q_lora_rank),
                "linear_q_up_proj": (mla.q_lora_rank, heads * mla.qk_head_dim), **layers}
    if target == "qkv":
        return {"linear_qkv": (hidden, (heads + 2 * arch.num_key_value_heads) * arch.head_dim)}
    if target == "proj":
        value_dim = arch.mla.v_head_dim if arch.mla is not None else arch.head_dim
        return {"linear_proj": (heads * value_dim, hidden)}
    if target in ("fc1", "fc2"):
        widths = []
        if not arch.is_moe or not all(arch.moe_layer_pattern):
            widths.append(("mlp", arch.ffn_hidden_size))
        if arch.moe_shared_ffn_hidden_size:
            widths.append(("shared_experts", arch.moe_shared_ffn_hidden_size))
        return {f"{where}.linear_{target}": (hidden, 2 * ffn) if target == "fc1" else (ffn, hidden)
                for where, ffn in widths}
    if target == "experts":
        return {"experts.linear_fc1": (hidden, 2 * arch.moe_ffn_hidden_size),
                "experts.linear_fc2": (arch.moe_ffn_hidden_size, hidden)}
    return {"router": (hidden, arch.num_experts)}


def check_lora_rank(lora, arch, source: str) -> None:
    """model.lora.rank at most the width of the narrowest layer it adapts: B A has rank at most
    min(in, out) of its layer, so a larger rank adds memory and nothing else (rank 2,000,000 on the
    tiny model held 6.15 GB after 10 s; 10^9 died in the allocator)."""
    from megatron_rl.model.layout_checks import lora_targets

    layers = {f"{target}: {name}": shape for target in lora_targets(lora, arch)
              for name, shape in lora_layer_widths(arch, target).items()}
    name, (fan_in, fan_out) = min(layers.items(), key=lambda item: min(item[1]))
    width = min(fan_in, fan_out)
    if lora.rank > width:
        raise ConfigError(f"model.lora.rank={lora.rank} is above the width of the narrowest layer it adapts, "
                          f"{name} ({fan_in} in, {fan_out} out, in {source}): an adapter B A has rank at most "
                          f"min(in, out), so a larger rank only costs memory. Use model.lora.rank={width} or lower, "
                          f"or leave that layer out of model.lora.targets")


def check_engine_context(config, raw: dict, source: str) -> None:
    """rollout.max_model_len within the model's context (model/context_length.py: what vLLM derives
    from config.json). Beyond it every engine refuses to start (vLLM's pydantic check, after the
    warm start has run), and positions past the model's make no sense to train on either."""
    from megatron_rl.model.context_length import engine_context

    context, key = engine_context(raw)
    wanted = config.rollout.max_model_len
    if wanted <= context:
        return
    where = _context_words(context, key, source)
    room = context - config.rl.max_response_tokens
    then = (f"prompts then get up to {room} tokens next to rl.max_response_tokens={config.rl.max_response_tokens}"
            if room >= 1 else f"and lower rl.max_response_tokens={config.rl.max_response_tokens} below it")
    raise ConfigError(f"rollout.max_model_len={wanted} is longer than the model's context: {where}. The rollout "
                      f"engine refuses a context beyond the model's when it starts (after the warm start). Set "
                      f"rollout.max_model_len={context} or lower ({then}), or use a model with a longer context")


def check_teacher_context(config) -> None:
    """A teacher server started here (rl.teacher, mode: server, no server_url) gets a context of
    rl.teacher.max_model_len (null: rollout.max_model_len + 1); vLLM refuses one beyond the teacher
    model's own (model/context_length.py), as it does the student's."""
    from megatron_rl.model.context_length import engine_context
    from megatron_rl.train.teacher import TeacherSource, server_context

    teacher = config.rl.teacher
    if teacher is None or teacher.mode != "server" or teacher.server_url is not None:
        return
    source = TeacherSource.resolve(teacher)
    context, key = engine_context(source.raw_config())
    served = server_context(config)
    if served <= context:
        return
    named = (f"rl.teacher.max_model_len={served}" if teacher.max_model_len is not None else
             f"rl.teacher.max_model_len=null serves rollout.max_model_len + 1 = {served} tokens (the student's "
             f"longest sequence plus the token a prompt-logprobs request needs), which")
    needed = config.rollout.max_model_len + 1
    fix = (f"set rl.teacher.max_model_len={context} (or null)" if needed <= context else
           f"lower rollout.max_model_len to {context - 1} or less, or use a teacher with a longer context")
    where = _context_words(context, key, str(source.config_dir / "config.json"))
    raise ConfigError(f"{named} is longer than the teacher's context: {where}; the teacher's engine would refuse "
                      f"to start. {fix}")


def _context_words(context: int, key: str, source: str) -> str:
    if key == "family default":
        return (f"{context}, the default of its family ({source} names none of max_position_embeddings, "
                f"max_seq_len, seq_length, ...)")
    return f"{key}={context} in {source}"


def check_fp8_rollout(config) -> None:
    """model.export_fp8 (engines serve block-wise FP8 weights) where the engines we start would run
    on CPU: with device: cpu a colocated engine, or servers from vLLM's CPU build; with device: auto
    any engine from vLLM's CPU build. device: cuda is taken at its word (the trainer needs a GPU,
    and so a GPU build of vLLM; recipes for GPU clusters are validated on CPU machines too).

    vLLM's CPU build (0.32) has block-FP8 kernels only for CPUs with Intel AMX (Sapphire Rapids
    or newer; without AMX no kernel is found and the engine fails at start), and they repack the
    weights on load in a layout our in-place weight updates were never checked against (the CPU
    MoE repair in rollout/worker/extension.py knows the unquantized experts only). Engines at
    rollout.server_urls are not checked here: they run wherever they were started."""
    if not config.model.export_fp8:
        return
    rollout = config.rollout
    if rollout.server_urls or rollout.engine != "vllm":
        return
    if config.device == "cuda":
        return
    cpu_build = _vllm_cpu_build()
    on_cpu = config.device == "cpu" and rollout.mode == "colocated"
    if on_cpu or cpu_build:
        where = f"the installed vLLM, {cpu_build}, is its CPU build" if cpu_build else "device: cpu"
        raise ConfigError(
            f"model.export_fp8=true serves block-wise FP8 weights, which a CPU rollout engine cannot run here "
            f"({where}): vLLM's CPU build has block-FP8 kernels only for CPUs with Intel AMX, and weight "
            f"updates into them are unverified. Leave model.export_fp8 off on CPU (the engines get the "
            f"rollout dtype), or use GPU engines"
        )


def engines_on_cpu(config) -> bool:
    """Whether the vLLM engines this run starts run vLLM's CPU build: a colocated engine with
    device: cpu, or any engine we start from an installed CPU build (servers at
    rollout.server_urls run wherever they were started)."""
    rollout = config.rollout
    if rollout.server_urls or rollout.engine != "vllm" or config.device == "cuda":
        return False
    return (config.device == "cpu" and rollout.mode == "colocated") or _vllm_cpu_build() is not None


def _vllm_cpu_build() -> str | None:
    """'vllm-cpu X' / 'vllm X+cpu' when the vLLM installed here is the CPU build, else None
    (read from the package metadata: importing vLLM takes seconds)."""
    from importlib import metadata

    for name in ("vllm-cpu", "vllm"):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if name == "vllm-cpu" or "cpu" in version:
            return f"{name} {version}"
    return None


def preflight(config):
    """Every check before the runtime starts: the fast ones first, then the slower ones (imports,
    files, reward functions). Returns the (train, held-out) prompt datasets it read, so that the
    trainer does not read them a second time."""
    from megatron_rl.algorithms.from_config import recipe_for
    from megatron_rl.checkpoint.manager import check_run_directory
    from megatron_rl.data import load_datasets
    from megatron_rl.observability.metrics_log import check_wandb_available
    from megatron_rl.rewards import build_scorer
    from megatron_rl.rollout.factory import check_engine_capabilities, check_engine_installed
    from megatron_rl.train.output_paths import check_writable
    from megatron_rl.train.teacher import check_teacher
    from megatron_rl.train.warm_start import check_targets

    check_engine_capabilities(config)  # a transport or sleep mode the engine lacks, named
    check_layout_and_paths(config)
    try:
        recipe_for(config.rl, config.response_budget)
    except ValueError as exc:
        raise ConfigError(f"rl: {exc}") from None
    check_run_directory(config)
    check_writable(config)  # every directory and file the run writes, tried as it will write them
    check_engine_installed(config)
    if config.rl.teacher is not None:  # its source, vocabulary and context, before any model or engine
        check_teacher(config, run_tokenizer(config))
        check_teacher_context(config)  # the context its server gets here, as the engine will read it
    check_wandb_available(config.logging.wandb_mode)
    build_scorer(config.rewards).close()  # resolves every reward function now
    check_agents(config)
    datasets = check_prompt_lengths(config, load_datasets(config.data))
    if config.warm_start.steps:
        check_targets(datasets[0])
    return datasets


def check_agents(config) -> None:
    """Multi-turn runs: the environment and tools import and fit their arguments; prompts go
    through the chat template (its adapter renders every observation)."""
    rollout = config.rollout
    if not rollout.multi_turn:
        return
    if config.data.prompt_format != "chat":
        raise ConfigError("rollout.environment / agent / tools: multi-turn rollouts render observations with the "
                          f"chat template; set data.prompt_format=chat (it is {config.data.prompt_format!r})")
    if rollout.environment is not None:
        from megatron_rl.agents.environment import load_environment_factory

        load_environment_factory(rollout.environment, rollout.environment_args)
    if rollout.agent is not None:
        from megatron_rl.agents.openai_agent import load_agent

        load_agent(rollout.agent, rollout.agent_args)
    if rollout.tools:
        from megatron_rl.agents.tools import ToolRegistry

        ToolRegistry.from_paths(rollout.tools)
        if any(entry.strip() == "python" for entry in rollout.tools):
            from megatron_rl.sandbox import namespaces_available

            why = namespaces_available()
            if why is not None:
                raise ConfigError(f"rollout.tools: the built-in 'python' tool runs the model's code in a sandbox, which "
                                  f"this machine cannot build: {why}. Allow user namespaces, or offer a tool of your "
                                  "own (see megatron_rl/agents/python_tool.py) after weighing what running it "
                                  "unsandboxed opens")


# --------------------------------------------------------------------------- prompt lengths

# Prompts rendered and counted per batch call: enough for the tokenizer's Rust side (on every
# core) to dominate the call, few enough that a million prompts never hold their encodings at once.
LENGTH_BATCH = 4096
# Overlong prompts named in the error besides the first; the rest are counted.
NAMED_OVERLONG = 5
DATASET_KEYS = ("data.train", "data.heldout")


def prompt_token_limit(config) -> int:
    """The most tokens a prompt may have and still leave room for a full response in the engine's
    context. Raises ConfigError when the response alone fills it."""
    limit = config.rollout.max_model_len - config.rl.max_response_tokens
    if limit < 1:
        raise ConfigError(f"rollout.max_model_len={config.rollout.max_model_len} leaves no room for a prompt next to "
                          f"rl.max_response_tokens={config.rl.max_response_tokens}; raise rollout.max_model_len")
    return limit


def _limit_terms(config) -> str:
    return f"rollout.max_model_len={config.rollout.max_model_len} - rl.max_response_tokens={config.rl.max_response_tokens}"


def _tokenizer_source(config) -> str:
    # Where checkpoint.format.write_run_tokenizer takes the run's tokenizer from, for messages.
    if config.data.train == "synthetic":
        return "the built-in character tokenizer"
    return f"the tokenizer files of {config.checkpoint.init_from or config.model.hf_config}"


def run_tokenizer(config):
    """The tokenizer the engines and the trainer will load, from the same files: written into a
    scratch directory as the engine's model directory gets them (rollout/engine_model.py)."""
    import tempfile

    from megatron_rl.checkpoint.format import write_run_tokenizer
    from megatron_rl.rollout.engine_model import load_engine_tokenizer

    with tempfile.TemporaryDirectory(prefix="megatron-rl-tokenizer-") as directory:
        write_run_tokenizer(config, directory)
        return load_engine_tokenizer(directory)


def token_counts(tokenizer, texts: list[str], add_special_tokens: bool) -> list[int]:
    """len(tokenizer(text, add_special_tokens=...)["input_ids"]) of every text, in one batch call.

    A fast tokenizer's Rust backend is called directly when that is the same computation (no
    truncation or padding set on it, special tokens in the text handled as the tokenizer handles
    them): the tokenizer's own call would turn every token id into a Python int only for us to
    count them, which takes longer than the tokenization itself with a byte-level BPE.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if (backend is not None and backend.truncation is None and backend.padding is None
            and getattr(backend, "encode_special_tokens", False) == getattr(tokenizer, "split_special_tokens", False)):
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: no offsets (tokenizers >= 0.21)
        return [len(encoding) for encoding in encode(texts, add_special_tokens=add_special_tokens)]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


# A prompt is never handed to the tokenizer whole when its length alone says it is over the limit
# (a 50 MB prompt took 6 GB and 30 s in the tokenizer, then was refused). Text is 1 to 5 characters
# a token, so a prompt over PREFIX_CHARS_PER_TOKEN x (limit + CUT_MARGIN + 1) characters is first
# counted on a prefix of that many (doubled while the count stays within the limit) and is over
# when the prefix is over by more than CUT_MARGIN: the text after a cut changes how the prefix's
# last pre-tokens (a word, a run of spaces) are split, not the rest. A prompt longer than limit x
# the longest token's characters x NORMALIZATION_SHRINK is not tokenized at all: no token stands
# for more characters of it, unless the tokenizer drops or fuses characters (whitespace-splitting
# pre-tokenizers, fused unknown tokens; no model family served here), and such a prompt is
# refused either way. The tokenizer so sees at most that many characters of any one prompt.
PREFIX_CHARS_PER_TOKEN = 8
CUT_MARGIN = 16
# Characters Unicode normalization (NFC / NFKC, as Qwen's tokenizers apply) folds into one at most:
# 3 (a Hangul syllable from its jamo), rounded up.
NORMALIZATION_SHRINK = 4


class AtLeast(int):
    """A token count known from below only (the prompt was not tokenized whole): compares as the
    number, reads "at least N" in messages."""

    def __format__(self, spec: str) -> str:
        return f"at least {int(self):{spec}}"


def longest_token_chars(tokenizer) -> int | None:
    """Characters of the vocabulary's longest entry, added tokens included (a byte-level BPE's
    entries have a character per byte, sentencepiece's one per character): the most of a prompt one
    token stands for. None when the tokenizer does not list its vocabulary."""
    try:
        return max(map(len, tokenizer.get_vocab()), default=0) or None
    except (AttributeError, NotImplementedError, TypeError):
        return None


def bounded_token_counts(tokenizer, texts: list[str], add_special_tokens: bool, limit: int) -> list[int]:
    """token_counts of `texts`, exact for every text that can fit in `limit` tokens; a text too
    long for that gets an AtLeast over `limit` from a prefix or from its length alone (see
    PREFIX_CHARS_PER_TOKEN), so the tokenizer sees a bounded number of characters per prompt."""
    short = PREFIX_CHARS_PER_TOKEN * (limit + CUT_MARGIN + 1)
    if max(map(len, texts), default=0) <= short:  # every ordinary batch: one call, as before
        return token_counts(tokenizer, texts, add_special_tokens)
    ordinary = [index for index, text in enumerate(texts) if len(text) <= short]
    counts: list[int] = [0] * len(texts)
    if ordinary:
        for index, count in zip(ordinary, token_counts(tokenizer, [texts[i] for i in ordinary], add_special_tokens)):
            counts[index] = count
    longest = longest_token_chars(tokenizer)
    for index, text in enumerate(texts):
        if len(text) <= short:
            continue
        if longest is not None and len(text) > limit * longest * NORMALIZATION_SHRINK:
            counts[index] = AtLeast(-(-len(text) // (longest * NORMALIZATION_SHRINK)))
            continue
        size, count = short, None
        while size < len(text):
            prefix = token_counts(tokenizer, [text[:size]], add_special_tokens)[0]
            if prefix > limit + CUT_MARGIN:
                count = AtLeast(prefix - CUT_MARGIN)
                break
            size *= 2
        counts[index] = count if count is not None else token_counts(tokenizer, [text], add_special_tokens)[0]
    return counts


def _prompt_texts(records, tokenizer, data) -> list[str]:
    """The prompts of `records` as text, rendered as encode_prompt renders them."""
    from megatron_rl.data import render_prompt

    if data.prompt_format == "raw":
        texts = [record.prompt for record in records]
        if all(isinstance(text, str) for text in texts):  # raw text is used as it is: no call per prompt
            return texts
    rendered = []
    for record in records:
        try:
            rendered.append(render_prompt(tokenizer, record.prompt, prompt_format=data.prompt_format,
                                          system_prompt=data.system_prompt))
        except ConfigError as exc:  # e.g. chat messages with prompt_format=raw: say which record
            raise ConfigError(f"{record.location}: {exc}") from None
    return rendered


def overlong_prompts(dataset, tokenizer, data, limit: int) -> list[tuple[int, int]]:
    """(index, tokens) of every prompt of `dataset` longer than `limit` tokens, as encode_prompt
    encodes it (`data`: the DataConfig), counted LENGTH_BATCH prompts at a time (a prompt too long
    to fit, on a prefix or by its length: bounded_token_counts; its count is then an AtLeast)."""
    add_special_tokens = data.prompt_format == "raw"  # chat templates write their own (data/chat.py)
    over = []
    for start in range(0, len(dataset), LENGTH_BATCH):
        texts = _prompt_texts(dataset[start:start + LENGTH_BATCH], tokenizer, data)
        counts = bounded_token_counts(tokenizer, texts, add_special_tokens, limit)
        over.extend((start + offset, count) for offset, count in enumerate(counts) if count > limit)
    return over


def _overlong_error(over: dict, datasets: dict, limit: int, config) -> ConfigError:
    """The first overlong prompt with its numbers, how many others there are and a few of them."""
    found = [(datasets[key][index].location, tokens) for key in over for index, tokens in over[key][:NAMED_OVERLONG + 1]]
    (first, tokens), others = found[0], found[1:NAMED_OVERLONG + 1]
    total = sum(len(indices) for indices in over.values())
    text = (f"{first}: the prompt is {tokens} tokens, over the limit of {limit} ({_limit_terms(config)}; counted "
            f"with the run's tokenizer, data.prompt_format={config.data.prompt_format})")
    if total > 1:
        counts = ", ".join(f"{key}: {len(over[key])} of {len(datasets[key])}" for key in over if over[key])
        named = ", ".join(f"{where} ({count} tokens)" for where, count in others)
        more = f" and {total - 1 - len(others)} more" if total - 1 > len(others) else ""
        text += f". {total} prompts are over it in all ({counts}); besides this one: {named}{more}"
    return ConfigError(
        f"{text}. Over the limit the engine refuses a prompt when it is first sampled (and again on every "
        f"resume) or cuts its responses short: shorten or remove it, raise rollout.max_model_len, or set "
        f"data.overlong_prompts=drop to leave such prompts out"
    )


def _drop_overlong(key: str, dataset, over: list[tuple[int, int]], limit: int, config):
    """`dataset` without the prompts in `over`, announced in one line (on the first rank only)."""
    from megatron_rl.data import PromptDataset
    from megatron_rl.runtime.launch_env import read_launch_env

    if not over:
        return dataset
    if len(over) == len(dataset):
        raise ConfigError(
            f"{key}: every one of the {len(dataset)} prompts of {dataset.source} is over the limit of {limit} tokens "
            f"({_limit_terms(config)}); data.overlong_prompts=drop would leave nothing: raise "
            f"rollout.max_model_len or shorten the prompts"
        )
    dropped = {index for index, _ in over}
    kept = [record for index, record in enumerate(dataset) if index not in dropped]
    if read_launch_env().rank == 0:  # every rank runs preflight; one line is enough
        print(f"megatron-rl: data.overlong_prompts=drop: dropped {len(over)} of {len(dataset)} prompts of "
              f"{dataset.source} ({key}), longer than {limit} tokens ({_limit_terms(config)}); "
              f"{len(kept)} left", flush=True)
    return PromptDataset(kept, dataset.source)


def check_prompt_lengths(config, datasets):
    """(train, held-out) with every prompt within prompt_token_limit: the same datasets when all
    are, else data.overlong_prompts decides (error: ConfigError; drop: the datasets without them)."""
    limit = prompt_token_limit(config)
    tokenizer = run_tokenizer(config)
    if config.data.prompt_format == "chat" and getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"data.prompt_format=chat needs a chat template, and the run's tokenizer "
                          f"({_tokenizer_source(config)}) has none; use data.prompt_format=raw or a tokenizer "
                          "that ships one")
    named = {key: dataset for key, dataset in zip(DATASET_KEYS, datasets) if dataset is not None}
    over = {key: overlong_prompts(dataset, tokenizer, config.data, limit) for key, dataset in named.items()}
    if not any(over.values()):
        return datasets
    if config.data.overlong_prompts == "error":
        raise _overlong_error(over, named, limit, config)
    return tuple(_drop_overlong(key, dataset, over[key], limit, config) if dataset is not None else None
                 for key, dataset in zip(DATASET_KEYS, datasets))
