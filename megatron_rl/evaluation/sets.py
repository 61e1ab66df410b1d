"""The prompt sets of `megatron-rl eval`: what the command line names, checked and read before any
model or engine exists.

    --set gsm8k=data/gsm8k_test.jsonl --set hard=data/hard.parquet     NAME=PATH, repeatable
    set.hard.reward=math  set.hard.n=16  set.hard.k=1,16  set.hard.columns.level=difficulty   per-set options
    --sets sets.yaml                                                    the same as a YAML mapping:

        gsm8k: {path: data/gsm8k_test.jsonl, reward: math, n: 16, k: [1, 4, 16], temperature: 0.6}
        quick: {path: data/quick.jsonl, n: 1, k: [1]}                  one sample a prompt, whatever --k asks
        mbpp:  {path: data/mbpp, split: test, reward: code_tests, columns: {test_list: tests}}

A PATH is what `data.train` takes: a .jsonl or .parquet file, a .json / .csv / .arrow file or a
`datasets` save_to_disk directory (its `split`), read with the run's data section (prompt_key,
answer_key, columns, other_columns, loader) unless the set says otherwise. Every option a set
leaves out comes from the command's flags (--n, --k, --temperature, --top-p, --max-tokens,
--prompts, --no-greedy) or, for the reward and the prompt format, from the checkpoint's run.

The PATH `heldout` names the held-out set of the checkpoint's run (data.load_heldout, as training
builds the set its eval/accuracy measures: data.heldout's file or the synthetic task's held-out
split), read as that run reads it.

A set in a format the generic reader does not know (HumanEval's prompt / test / entry_point rows)
is read by its own loader in FORMAT_LOADERS, which also says which reward scores it.

The same reading and checks, and the reward resolution of evaluation/set_rewards.py, serve
rl.eval's sets during training (train/eval_sets.py): a SetNaming says in whose words the errors
name the set and what to set.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from megatron_rl.config.evaluation import HELDOUT, MAX_SAMPLES, is_set_name
from megatron_rl.errors import ConfigError

# Options whose value is text as written (a path, a name, a prompt), never YAML-parsed.
TEXT_OPTIONS = ("path", "reward", "split", "prompt_key", "answer_key", "system_prompt", "loader", "other_columns",
                "prompt_format")
# Options that say how a set's rows are read (the run's data.* keys of the same names by default).
READ_OPTIONS = ("split", "prompt_key", "answer_key", "columns", "other_columns", "loader")
# A set's answer_key that reads no reference answers (data.answer_key: null). A set's None is
# "the run's data.answer_key", so a null is this word: set.NAME.answer_key=null as typed, and a
# --sets file's `answer_key: null` (or ~), are turned into it.
NO_ANSWERS = "null"
NULL_WORDS = ("null", "Null", "NULL", "~")


@dataclass(frozen=True)
class SetNaming:
    """In whose words an error names a set and the key that fixes it: `megatron-rl eval`'s
    `set 'NAME'` with its per-set options (set.NAME.OPTION=VALUE), or training's rl.eval.sets.NAME,
    whose sets have no options of their own and are read with the run's data section."""

    where: str  # what the error starts with
    options: str | None  # the per-set options' prefix ("set.NAME."); None: none (rl.eval)
    budget: str  # the key of the response budget
    fewer: str  # how to evaluate fewer prompts

    @classmethod
    def command(cls, name: str) -> SetNaming:
        return cls(f"set {name!r}", f"set.{name}.", f"--max-tokens or set.{name}.max_tokens",
                   f"--prompts or set.{name}.prompts")

    @classmethod
    def training(cls, name: str) -> SetNaming:
        return cls(f"rl.eval.sets.{name}", None, "rl.eval.max_tokens", "rl.eval.prompts")

    def key(self, option: str) -> str:
        """The key that sets a reading option for this set: its own, or the run's data.* (rl.eval)."""
        return f"{self.options or 'data.'}{option}"

    def fix(self, option: str, value: str) -> str:
        """The key=value that changes how the set is read, and how every set is."""
        if self.options is not None:
            return f"{self.key(option)}={value} (data.{option.split('.')[0]} for every set)"
        return f"{self.key(option)}={value} (rl.eval's sets are read with the run's data section)"

    def sandbox_opt_out(self, name: str, path: str) -> str:
        """How to score a set's code_tests outside the namespace sandbox: its reward's params
        (set.NAME.reward_params); rl.eval's sets have none, so the set is evaluated by the command."""
        option = f"set.{name}.reward_params.isolation=none"
        if self.options is not None:
            return option
        return (f"take the set out of rl.eval.sets and evaluate the run's checkpoints on it with "
                f"`megatron-rl eval --ckpt RUN --set {name}={path} {option}`")


@dataclass
class SetSpec:
    """One set as the command line and --sets describe it; None: the command's default (or, for
    reward, prompt_format and system_prompt, the checkpoint's run)."""

    name: str
    path: str
    reward: str | None = None  # a reward name ("math", "code_tests", "synthetic", "module:fn", "file.py:fn")
    reward_params: dict[str, Any] = field(default_factory=dict)
    n: int | None = None
    k: list[int] | None = None  # the ks of pass@k and maj@k, each 1..n (None here and in --k: default_ks(n))
    temperature: float | None = None
    top_p: float | None = None
    greedy: bool | None = None
    max_tokens: int | None = None
    prompts: int | None = None  # the first this many records only
    threshold: float = 0.5  # reward >= threshold: correct
    split: str | None = None  # a save_to_disk DatasetDict's split (default: data.heldout_split)
    prompt_key: str | None = None
    answer_key: str | None = None
    columns: dict[str, str] | None = None
    other_columns: str | None = None
    loader: str | None = None
    prompt_format: str | None = None
    system_prompt: str | None = None

    @classmethod
    def options(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "name"]


@dataclass
class SamplingDefaults:
    """The command's flags every set takes unless it sets its own."""

    n: int = 8
    k: list[int] | None = None  # the ks of pass@k and maj@k of every set without its own (None: default_ks(n))
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = True
    max_tokens: int | None = None  # None: the run's rl.max_response_tokens
    prompts: int | None = None


@dataclass
class LoadedSet:
    """A set read: its records and the reward terms that score it (None: the reward the set's
    spec or the checkpoint's run names). What a FORMAT_LOADERS entry returns too."""

    spec: SetSpec
    records: list
    rewards: Any = None  # a rewards.RewardConfig chosen by the set's format (e.g. HumanEval's tests)
    source: str = ""  # what the records were read from, for messages and the report ("": spec.path)

    def __post_init__(self):
        self.source = self.source or self.spec.path


def _humaneval_set(spec: SetSpec, data) -> LoadedSet | None:
    """HumanEval-format rows (prompt, test, entry_point; evaluation/humaneval.py), scored by
    code_tests in the sandbox; None when the file is not in that format."""
    from megatron_rl.evaluation.humaneval import humaneval_rewards, is_humaneval_set, load_humaneval

    if not is_humaneval_set(spec.path, data.max_line_bytes):
        return None
    return LoadedSet(spec, list(load_humaneval(spec.path, data.max_line_bytes)), humaneval_rewards())


# Loaders of set formats the generic reader does not know, tried in order: each takes
# (spec, data_config) and returns a LoadedSet, or None when the file is not its format.
FORMAT_LOADERS: tuple[Callable[[SetSpec, Any], LoadedSet | None], ...] = (_humaneval_set,)


# --------------------------------------------------------------------------- parsing


def parse_sets(set_args: list[str], sets_file: str | None, option_items: list[str],
               defaults: SamplingDefaults) -> list[SetSpec]:
    """The sets the command line names: `--set NAME=PATH` items, the `--sets` YAML file's, then
    `set.NAME.OPTION=VALUE` items over either. Refuses (ConfigError, naming the set): a NAME or
    PATH missing, two sets with one name, an unknown option, an option for no set, a value of the
    wrong type, n < 1, a k outside 1..n (the set's own, else --k), a temperature < 0, a top_p
    outside (0, 1]."""
    raw: dict[str, dict[str, Any]] = {}
    for item in set_args:
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ConfigError(f"--set {item!r} must look like NAME=PATH (e.g. --set gsm8k=data/gsm8k_test.jsonl)")
        _add(raw, name, {"path": path}, f"--set {item}")
    if sets_file is not None:
        for name, options in _read_sets_file(sets_file).items():
            _add(raw, name, options, f"--sets {sets_file}")
    if not raw:
        raise ConfigError("no prompt set to evaluate: name one with --set NAME=PATH (or --sets FILE)")
    for item in option_items:
        _apply_option(raw, item)
    return [_spec(name, options, defaults) for name, options in raw.items()]


def is_set_option(item: str) -> bool:
    """A `set.NAME.OPTION=VALUE` item (the other key=value items are the run config's overrides)."""
    return item.split("=", 1)[0].strip().startswith("set.")


def _add(raw: dict, name: str, options: dict, where: str) -> None:
    if not is_set_name(name):
        raise ConfigError(f"{where}: set name {name!r} must be letters, digits, '_' or '-' (it names the set in "
                          "set.NAME.OPTION=VALUE and in the report)")
    if name in raw:
        raise ConfigError(f"{where}: a set named {name!r} is given twice ({raw[name].get('path')} and "
                          f"{options.get('path')}); give each set its own name")
    raw[name] = dict(options)


def _read_sets_file(path: str) -> dict[str, dict]:
    from megatron_rl.config.loader import load_yaml
    from megatron_rl.errors import not_a_file

    if not Path(path).is_file():
        raise ConfigError(f"--sets {path}: " + (not_a_file(Path(path)) or "does not exist or is not a file"))
    loaded = load_yaml(Path(path).read_text(), f"--sets {path}")
    if not isinstance(loaded, dict) or not all(isinstance(v, dict) for v in loaded.values()):
        raise ConfigError(f"--sets {path}: the top level must map each set's name to its options, e.g. "
                          "`gsm8k: {path: data/gsm8k_test.jsonl, reward: math}`")
    for name, options in loaded.items():
        if "path" not in options:
            raise ConfigError(f"--sets {path}: set {name!r} has no path")
    return {str(name): options for name, options in loaded.items()}


def _apply_option(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 3:
        raise ConfigError(f"{item!r}: a set option looks like set.NAME.OPTION=VALUE (e.g. set.gsm8k.n=16)")
    name, option = parts[1], parts[2]
    if name not in raw:
        raise ConfigError(f"{item!r}: there is no set named {name!r} (sets: {', '.join(raw)}); name it with "
                          f"--set {name}=PATH first")
    known = SetSpec.options()
    if option not in known:
        raise ConfigError(f"{item!r}: set {name!r} has no option {option!r} (options: {', '.join(known)})")
    nested = option in ("columns", "reward_params")
    if nested != (len(parts) == 4) or len(parts) > 4:
        form = f"set.{name}.{option}.FIELD=VALUE" if nested else f"set.{name}.{option}=VALUE"
        raise ConfigError(f"{item!r}: write it as {form}")
    if option in TEXT_OPTIONS:
        value: Any = text
    else:
        from megatron_rl.config.loader import load_yaml

        value = load_yaml(text, item)
    if nested:
        raw[name].setdefault(option, {})[parts[3]] = value
    else:
        raw[name][option] = value


def _spec(name: str, options: dict, defaults: SamplingDefaults) -> SetSpec:
    where = f"set {name!r}"
    known = SetSpec.options()
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown option {unknown[0]!r} (options: {', '.join(known)})")
    for option in TEXT_OPTIONS:  # a --sets file's YAML can give any type (path: 5 was a TypeError)
        if options.get(option) is not None and not isinstance(options[option], str):
            raise ConfigError(f"{where}: {option} must be text, got {options[option]!r}")
    spec = SetSpec(name=name, **options)
    if "answer_key" in options and (spec.answer_key is None or spec.answer_key in NULL_WORDS):
        spec.answer_key = NO_ANSWERS  # given as null: no reference answers, not the run's field
    spec.k = _set_ks(spec.k, where)
    for option, kind in (("n", int), ("max_tokens", int), ("prompts", int)):
        value = getattr(spec, option)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{where}: {option} must be an integer >= 1, got {value!r}")
    for option in ("temperature", "top_p", "threshold"):
        value = getattr(spec, option)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{where}: {option} must be a number, got {value!r}")
    if not -math.inf < spec.threshold < math.inf:  # NaN or infinite: no sample correct, and no eval.json
        raise ConfigError(f"{where}: threshold must be a finite number (reward >= threshold: correct), got "
                          f"{spec.threshold}")
    if spec.n is not None and spec.n > MAX_SAMPLES:
        raise ConfigError(f"{where}: n must be at most {MAX_SAMPLES} samples per prompt (rl.eval.n's bound), got "
                          f"{spec.n}")
    if spec.greedy is not None and not isinstance(spec.greedy, bool):
        raise ConfigError(f"{where}: greedy must be true or false, got {spec.greedy!r}")
    for option in ("columns", "reward_params"):
        if getattr(spec, option) is not None and not isinstance(getattr(spec, option), dict):
            raise ConfigError(f"{where}: {option} must be a mapping, got {getattr(spec, option)!r}")
    spec.reward_params = spec.reward_params or {}
    # The command's defaults where the set has none: the spec then holds what it will run with.
    k_key = "--k" if spec.k is None else f"set.{name}.k"
    for option in ("n", "k", "temperature", "top_p", "greedy", "max_tokens", "prompts"):
        if getattr(spec, option) is None:
            setattr(spec, option, getattr(defaults, option))
    check_sampling(spec, k_key)
    return spec


def _set_ks(value: Any, where: str) -> list[int] | None:
    """A set's own k as given (a list, one integer, or "1,4,16" as set.NAME.k=1,4,16 reads),
    sorted and deduplicated; the range against n is check_sampling's."""
    if value is None:
        return None
    items = [part.strip() for part in value.split(",")] if isinstance(value, str) else value
    items = items if isinstance(items, list) else [items]
    try:
        ks = [int(k) if isinstance(k, str) else k for k in items]
    except ValueError:
        ks = []
    if not ks or not all(isinstance(k, int) and not isinstance(k, bool) for k in ks):
        raise ConfigError(f"{where}: k must be integers from 1 to n, e.g. [1, 4, 16] (set.NAME.k=1,4,16), "
                          f"got {value!r}")
    return sorted(set(ks))


def check_sampling(spec: SetSpec, k_key: str = "--k") -> None:
    """n >= 1, every k in 1..n, temperature >= 0, top_p in (0, 1]: ConfigError naming the set, and
    `k_key`, where its ks came from (the set's own set.NAME.k, or --k)."""
    where = f"set {spec.name!r}"
    if spec.n < 1:
        raise ConfigError(f"{where}: n (samples per prompt) must be >= 1, got {spec.n}")
    # Where the fix goes: the set's own keys, and for --k's ks also the command's flags.
    k_keys, n_keys = ((k_key, f"set.{spec.name}.n") if k_key != "--k" else
                      (f"--k for every set, set.{spec.name}.k for this one", f"--n, or set.{spec.name}.n"))
    for k in spec.k or ():
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= spec.n:
            raise ConfigError(f"{where}: {k_key} {k} is more than n={spec.n}, the samples per prompt it draws from "
                              f"(pass@k and maj@k use k of the n samples): ask for k <= {spec.n} ({k_keys}), or "
                              f"more samples ({n_keys})" if isinstance(k, int) and k > spec.n else
                              f"{where}: {k_key} {k!r} must be an integer from 1 to n={spec.n}")
    if not 0 <= spec.temperature < float("inf"):
        raise ConfigError(f"{where}: temperature must be a finite number >= 0 (0: greedy), got {spec.temperature}")
    if not 0 < spec.top_p <= 1:
        raise ConfigError(f"{where}: top_p must be in (0, 1], got {spec.top_p}")


# --------------------------------------------------------------------------- reading


def set_data_config(spec: SetSpec, data, naming: SetNaming | None = None) -> Any:
    """The run's data section (`data`: a DataConfig) with the set's own fields: how the set's file
    is read and its prompts shown to the model."""
    naming = naming or SetNaming.command(spec.name)
    changes = {"train": spec.path, "train_split": spec.split or data.heldout_split}
    for option in [o for o in READ_OPTIONS if o != "split"] + ["prompt_format", "system_prompt"]:  # split: above
        if getattr(spec, option) is not None:
            changes[option] = getattr(spec, option)
    if spec.answer_key == NO_ANSWERS:
        changes["answer_key"] = None
    config = dataclasses.replace(data, **changes)
    try:
        return config.validate(naming.where)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace(f"{naming.where}.", naming.options or "data.")) from None


def load_set(spec: SetSpec, data, naming: SetNaming | None = None,
             read_heldout: Callable[[], Any] | None = None) -> LoadedSet:
    """The set's records (the first spec.prompts of them), read as the run's data section says
    with the set's own fields over it; for the PATH `heldout`, the run's held-out set
    (`read_heldout()`, default data.load_heldout(data); a run that has it already passes it in).
    ConfigError naming the set (in `naming`'s words: the command's by default), the file and what
    to set."""
    from megatron_rl.data.prompts import load_source

    naming = naming or SetNaming.command(spec.name)
    if spec.path == HELDOUT:
        return _first(heldout_set(spec, data, naming, read_heldout))
    path = Path(spec.path)
    if not path.exists():
        raise ConfigError(f"{naming.where}: {spec.path} does not exist; it must be a .jsonl / .parquet / .json / "
                          f".csv / .arrow file, a directory written by `datasets` save_to_disk, or {HELDOUT!r} (the "
                          "run's held-out set)")
    config = set_data_config(spec, data, naming)
    for loader in FORMAT_LOADERS:
        loaded = loader(spec, config)
        if loaded is not None:
            return _first(loaded)
    try:
        records = list(load_source(config, "train"))
    except ConfigError as exc:
        raise ConfigError(_explained(spec, str(exc), naming)) from None
    return _first(LoadedSet(spec, records))


def heldout_set(spec: SetSpec, data, naming: SetNaming, read_heldout: Callable[[], Any] | None = None) -> LoadedSet:
    """The run's held-out set (`data`: the run's DataConfig) as training builds it for its
    eval/accuracy (data.load_heldout): data.heldout's prompts or the synthetic task's held-out
    split, read with the run's fields (by `read_heldout()` where given); ConfigError where the run
    has none."""
    from megatron_rl.data.prompts import load_heldout

    own = [option for option in READ_OPTIONS if getattr(spec, option) is not None]
    if own:
        raise ConfigError(f"{naming.where}: {HELDOUT!r} is the run's held-out set, read as the run reads it; "
                          f"{naming.key(own[0])} does not apply to it (data.{own[0]} changes how the run reads it)")
    try:
        heldout = read_heldout() if read_heldout is not None else load_heldout(data)
    except ConfigError as exc:
        raise ConfigError(f"{naming.where}: the run's held-out set: {exc}") from None
    if heldout is None or len(heldout) == 0:
        raise ConfigError(f"{naming.where}: {HELDOUT!r} names the run's held-out set, and this run has none; set "
                          "data.heldout (a prompt file) or give the set's own path")
    return LoadedSet(spec, list(heldout), source=heldout.source)


def _first(loaded: LoadedSet) -> LoadedSet:
    if loaded.spec.prompts is not None:
        loaded.records = loaded.records[: loaded.spec.prompts]
    return loaded


def _explained(spec: SetSpec, message: str, naming: SetNaming) -> str:
    """A reader's error with the set's name and the key that fixes it."""
    split = naming.key("split") if naming.options else "data.heldout_split"
    message = message.replace("data.train:", f"{spec.path}:").replace("data.train_split", split)
    if "prompt key '" in message:
        hint = f"name the set's prompt field with {naming.fix('prompt_key', 'FIELD')}"
    elif "answer key '" in message:
        hint = (f"name the set's answer field with {naming.fix('answer_key', 'FIELD')}, or "
                f"{naming.key('answer_key')}=null for a set without answers")
    elif "data.columns key '" in message:
        hint = f"map an existing field with {naming.fix('columns.FIELD', 'KEYWORD')}"
    else:
        hint = ""
    return f"{naming.where}: {message}" + (f"; {hint}" if hint else "")


def check_prompt_lengths(loaded: LoadedSet, tokenizer, data, context: int, budget: int, naming: SetNaming) -> None:
    """Every prompt of the set, encoded as `data` (prompt format, system prompt) says, leaves room
    for the response budget in the engine's context (rollout.max_model_len): the engine would
    refuse it in the middle of the evaluation. ConfigError naming the set, file, line and tokens."""
    from megatron_rl.train.preflight import overlong_prompts

    limit = context - budget
    if limit < 1:
        raise ConfigError(f"{naming.where}: a response budget of {budget} tokens leaves no room for a prompt in the "
                          f"engine's context (rollout.max_model_len={context}); raise rollout.max_model_len or lower "
                          f"{naming.budget}")
    records = loaded.records
    over = overlong_prompts(records, tokenizer, data, limit)
    if over:
        index, tokens = over[0]
        raise ConfigError(f"{naming.where}: {records[index].location or loaded.source}: the prompt is {tokens} tokens "
                          f"({data.prompt_format} format), over the limit of {limit} (rollout.max_model_len={context} "
                          f"- a response budget of {budget}); {len(over)} of the set's {len(records)} prompts are "
                          f"over it. Raise rollout.max_model_len, lower {naming.budget}, or evaluate fewer prompts "
                          f"({naming.fewer})")
