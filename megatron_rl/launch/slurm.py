"""`megatron-rl launch slurm`: render an sbatch script from a template and the run's config, submit it.

    megatron-rl launch slurm --config configs/qwen3_30b_a3b.yaml --nodes 4 --rollout-nodes 2 \
        --gpus-per-node 8 --partition gpu --account proj --time 04:00:00 --output-dir runs/qwen3 [key=value ...]

Before anything is submitted: the config (with the overrides) is validated and the parallel layout
checked against the job's world size (training nodes x processes per node), so a node count that
does not fit is refused naming the key. The resolved config is written to OUTPUT_DIR/config.yaml
and the job (and every requeue of it) trains from that copy. Templates: `megatron_rl/launch/templates/`
(package data, so an installed copy finds them; the repository's `slurm/` links to them), or --template.

With --rollout-nodes R (disaggregated) the job has R more nodes running vLLM servers of
rollout.server_tp GPUs each (--gpus-per-node / server_tp per node; one per node on CPU), started
by megatron_rl.launch.rollout_node. The config copy is the one the job runs: rollout.mode=server
and the weight transport resolved (auto -> collective: a broadcast from the trainer to every
server worker, NCCL on GPU; files needs a filesystem all nodes share). The servers' URLs are known
only inside the job, which passes them to the trainer.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import yaml

from megatron_rl.config import RunConfig, load_config, to_dict
from megatron_rl.errors import ConfigError

TEMPLATES = Path(__file__).resolve().parent / "templates"
PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)\}\}")


class LaunchError(RuntimeError):
    """SLURM is missing or refused the job; the message says what happened and what to try."""


@dataclasses.dataclass
class SlurmOptions:
    nodes: int = 1  # training nodes
    rollout_nodes: int = 0  # > 0: disaggregated, one vLLM server per rollout node
    gpus_per_node: int = 0  # 0: CPU (gloo), procs_per_node processes per node
    procs_per_node: int | None = None  # default: gpus_per_node, or 1 on CPU
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    job_name: str = "megatron-rl"
    signal_lead_seconds: int = 120
    container_image: str | None = None  # pyxis/enroot: srun --container-image
    container_mounts: str | None = None
    modules: list[str] = dataclasses.field(default_factory=list)  # `module load` each
    setup: list[str] = dataclasses.field(default_factory=list)  # further shell lines before the job
    network_interface: str | None = None  # NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME
    python: str | None = None  # default: the interpreter running this launcher
    sbatch_args: list[str] = dataclasses.field(default_factory=list)  # passed to sbatch as they are
    template: str | None = None
    server_timeout_s: int = 900

    @property
    def nproc_per_node(self) -> int:
        if self.procs_per_node is not None:
            return self.procs_per_node
        return self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def validate(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {self.nodes}")
        if self.rollout_nodes < 0 or self.gpus_per_node < 0 or self.nproc_per_node < 1:
            raise ConfigError("--rollout-nodes and --gpus-per-node must be >= 0, --procs-per-node >= 1")
        if self.signal_lead_seconds < 1:
            raise ConfigError("--signal-lead-seconds must be >= 1")
        limit = time_limit_seconds(self.time) if self.time is not None else None
        if limit is not None and limit <= self.signal_lead_seconds:
            # USR1 at the start: every start would checkpoint and requeue at once, without end
            raise ConfigError(f"--time {self.time} ({limit} s) leaves no time before the preemption warning "
                              f"--signal-lead-seconds {self.signal_lead_seconds}: give a longer --time or a "
                              "shorter lead")
        if self.gpus_per_node and self.nproc_per_node > self.gpus_per_node:
            # each trainer rank takes a GPU of its own: NCCL refuses two ranks on one, on the cluster
            raise ConfigError(f"--procs-per-node {self.nproc_per_node} is more than --gpus-per-node "
                              f"{self.gpus_per_node}: each trainer process needs a GPU of its own")
        if self.container_mounts and not self.container_image:
            raise ConfigError("--container-mounts mounts into the --container-image, which is not given: pass "
                              "--container-image too, or drop --container-mounts")


def time_limit_seconds(text: str) -> int | None:
    """sbatch --time in seconds (None: UNLIMITED / INFINITE, and a limit of zero, which sbatch
    takes as no limit), in SLURM's forms: MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
    Anything else is refused here, before anything is written (sbatch would refuse it only at
    submission, `4h` among them)."""
    if text.strip().lower() in ("unlimited", "infinite"):
        return None
    with_days = re.fullmatch(r"(\d+)-(\d+)(?::(\d+))?(?::(\d+))?", text)  # D-HH[:MM[:SS]]
    if with_days:
        days, hours, minutes, seconds = (int(part or 0) for part in with_days.groups())
        return ((days * 24 + hours) * 60 + minutes) * 60 + seconds or None
    plain = re.fullmatch(r"(\d+)(?::(\d+))?(?::(\d+))?", text)  # MINUTES, MM:SS, HH:MM:SS
    if not plain:
        raise ConfigError(f"--time {text!r} is not a SLURM time limit: give MINUTES, MM:SS, HH:MM:SS, D-HH, "
                          "D-HH:MM or D-HH:MM:SS (e.g. 04:00:00 or 1-12:00:00)")
    numbers = [int(part) for part in plain.groups() if part is not None]
    if len(numbers) == 3:
        return (numbers[0] * 60 + numbers[1]) * 60 + numbers[2] or None
    return numbers[0] * 60 + (numbers[1] if len(numbers) == 2 else 0) or None


@dataclasses.dataclass
class PreparedJob:
    script: str
    script_path: Path
    config_path: Path
    output_dir: Path


def disaggregated_transport(config: RunConfig) -> str:
    """The weight transport of a job whose servers run on rollout nodes of their own."""
    chosen = config.rollout.weight_transport
    return "collective" if chosen == "auto" else chosen


def resolve_config(config_path: str | None, overrides: list[str], world_size: int, *, disaggregated: bool) -> RunConfig:
    """Load and check the config for a job of `world_size` trainer ranks (no torch import).
    Disaggregated: the config as the job runs it (servers, the weight transport resolved)."""
    from megatron_rl.data.prompts import check_sources_exist
    from megatron_rl.train.preflight import check_layout_and_paths

    if disaggregated:
        overrides = overrides + ["rollout.mode=server"]
    config = checked = load_config(config_path, overrides)
    if disaggregated:
        if config.rollout.engine != "vllm":
            raise ConfigError(f"rollout.engine={config.rollout.engine}: --rollout-nodes starts vLLM servers only; "
                              "start other servers yourself and set rollout.server_urls")
        overrides = overrides + ["rollout.server_urls=[]", f"rollout.weight_transport={disaggregated_transport(config)}"]
        config = load_config(config_path, overrides)
        # The server URLs are known only inside the job (which passes them to the trainer): check
        # the config as the job runs it, with servers it does not start itself (and `nccl` as
        # `collective`: this machine need not have the job's GPUs).
        checked = load_config(config_path, overrides + ["rollout.server_urls=[http://rollout-node:1]"]
                              + (["rollout.weight_transport=collective"] if config.rollout.weight_transport == "nccl"
                                 else []))
    saved = os.environ.get("WORLD_SIZE"), os.environ.get("RANK")
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world_size), "0"
    try:
        check_layout_and_paths(checked)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (the job has {world_size} trainer process(es): nodes x processes per node)") from None
    finally:
        for key, value in zip(("WORLD_SIZE", "RANK"), saved):
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    check_sources_exist(checked.data)  # a missing prompt file, named before the job waits in a queue
    return config


def template_path(options: SlurmOptions) -> Path:
    if options.template:
        path = Path(options.template)
        if not path.is_file():
            raise ConfigError(f"--template {path} does not exist")
        return path
    name = "train_disaggregated.sbatch.tmpl" if options.rollout_nodes else "train_colocated.sbatch.tmpl"
    path = TEMPLATES / name
    if not path.is_file():
        raise ConfigError(f"sbatch template {path} not found: the package is incomplete (reinstall it), or pass "
                          f"--template with a copy of the repository's slurm/{name}")
    return path


def fill(template: str, values: dict[str, str]) -> str:
    missing = sorted(set(PLACEHOLDER.findall(template)) - set(values))
    if missing:
        raise ConfigError(f"the sbatch template has placeholders with no value: {', '.join(missing)}")
    return PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


def render(options: SlurmOptions, config: RunConfig, config_path: Path) -> str:
    out = Path(config.output_dir)
    sbatch = []
    if options.partition:
        sbatch.append(f"#SBATCH --partition={options.partition}")
    if options.account:
        sbatch.append(f"#SBATCH --account={options.account}")
    if options.time:
        sbatch.append(f"#SBATCH --time={options.time}")
    if options.gpus_per_node:
        sbatch.append(f"#SBATCH --gpus-per-node={options.gpus_per_node}")
    sbatch += [f"#SBATCH {arg}" for arg in options.sbatch_args]

    setup = [f"module load {shlex.quote(module)}" for module in options.modules]
    package_root = Path(__file__).resolve().parents[2]
    if not _inside_site_packages(package_root):
        # A source checkout: make sure the job imports this copy of megatron_rl.
        setup.append(f"export PYTHONPATH={shlex.quote(str(package_root))}${{PYTHONPATH:+:$PYTHONPATH}}")
    if options.network_interface:
        interface = shlex.quote(options.network_interface)
        setup.append(f"export NCCL_SOCKET_IFNAME={interface} GLOO_SOCKET_IFNAME={interface}")
    setup += options.setup
    if not options.gpus_per_node:
        setup.append("export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}")

    srun = []
    if options.container_image:
        srun.append(f"--container-image={shlex.quote(options.container_image)}")
        if options.container_mounts:
            srun.append(f"--container-mounts={shlex.quote(options.container_mounts)}")

    tp, servers_per_node = rollout_layout(config, options) if options.rollout_nodes else (1, 1)
    values = {
        "JOB_NAME": options.job_name,
        "NODES": str(options.nodes + options.rollout_nodes),
        "OUTPUT_DIR": _script_path(out),
        "SIGNAL_LEAD": str(options.signal_lead_seconds),
        "SBATCH_EXTRA": "\n".join(sbatch),
        "SETUP": "\n".join(setup) or ":",
        "PYTHON": shlex.quote(options.python or sys.executable),
        "SRUN_EXTRA": " ".join(srun),
        "NPROC_PER_NODE": str(options.nproc_per_node),
        "CONFIG": shlex.quote(str(config_path)),
        "TRAIN_NODES": str(options.nodes),
        "ROLLOUT_NODES": str(options.rollout_nodes),
        "ROLLOUT_TP": str(tp),
        "SERVERS_PER_NODE": str(servers_per_node),
        "WEIGHT_TRANSPORT": config.rollout.weight_transport,
        "SERVER_TIMEOUT": str(options.server_timeout_s),
    }
    return fill(template_path(options).read_text(), values)


def _script_path(out: Path) -> str:
    """The run directory as the job script writes it: shell-quoted (sbatch reads the same quotes in
    its #SBATCH lines), so a space or a '#' in it is part of the path. A line break cannot be
    written into one line of a script: refused."""
    text = str(out)
    if any(char in text for char in "\n\r\0"):
        raise ConfigError(f"output_dir: {text!r} holds a line break, which the job script cannot hold in one line; "
                          "choose a directory name without one")
    return shlex.quote(text)


def rollout_layout(config: RunConfig, options: SlurmOptions) -> tuple[int, int]:
    """(tensor parallel size of each rollout server, servers per rollout node): rollout.server_tp,
    and as many servers as the node's GPUs hold (one on CPU). Refused, naming the key or option,
    where the GPUs or the model's attention heads do not divide."""
    from megatron_rl.model.hf_config import load_hf_config, parse_hf_config

    sizes = config.rollout.server_tp if isinstance(config.rollout.server_tp, list) else [config.rollout.server_tp]
    if len(set(sizes)) != 1:
        raise ConfigError(f"rollout.server_tp={config.rollout.server_tp}: the servers --rollout-nodes starts all "
                          "have one size; give one value")
    tp = sizes[0]
    gpus = options.gpus_per_node
    if gpus and gpus % tp:
        raise ConfigError(f"rollout.server_tp={tp} must divide --gpus-per-node={gpus} (each rollout node runs "
                          f"--gpus-per-node / server_tp servers of server_tp GPUs each)")
    heads = parse_hf_config(*load_hf_config(config.model.hf_config)).num_attention_heads
    if heads % tp:
        raise ConfigError(f"rollout.server_tp={tp} must divide the model's {heads} attention heads "
                          "(vLLM splits them over a server's tensor-parallel workers)")
    return tp, (gpus // tp if gpus else 1)


def prepare(config_path: str | None, overrides: list[str], options: SlurmOptions, *, write: bool) -> PreparedJob:
    """Validate, then (write=True) copy the resolved config and the script into the run directory."""
    options.validate()
    config = resolve_config(config_path, overrides, options.world_size, disaggregated=options.rollout_nodes > 0)
    if (options.gpus_per_node and not options.rollout_nodes and config.rollout.mode == "server"
            and not config.rollout.server_urls):
        # The trainer would start rollout.num_servers servers itself, on the GPUs of its own node.
        raise ConfigError("rollout.mode=server with no rollout.server_urls and no --rollout-nodes: on a GPU "
                          "cluster give --rollout-nodes R (servers the job starts) or rollout.server_urls=[...] "
                          "(servers you started)")
    out = Path(config.output_dir).resolve()
    config.output_dir = str(out)  # the job may start in another directory
    copied = out / "config.yaml"
    script = render(options, config, copied)
    script_path = out / "logs" / "job.sbatch"
    if write:
        refuse_a_directory_in_use(out)  # its job requeues from config.yaml: not to be rewritten under it
        (out / "logs").mkdir(parents=True, exist_ok=True)
        copied.write_text("# Resolved config of the submitted job (megatron-rl launch slurm); requeues use it too.\n"
                          + yaml.safe_dump(to_dict(config), sort_keys=False))
        script_path.write_text(script)
    return PreparedJob(script, script_path, copied, out)


def refuse_a_directory_in_use(out: Path, squeue: str = "squeue") -> None:
    """ConfigError when a run holds `out` (train/run_lock.py) and may still run: its SLURM job is
    still queued or running (squeue knows it), or, without a job, its process on this host lives."""
    from megatron_rl.train import run_lock

    holder = run_lock.holder_of(out)
    if holder is None:
        return
    if holder.slurm_job_id:
        if not _job_active(holder.slurm_job_id, squeue):
            return
    elif run_lock.stale_reason(holder, run_lock.this_process()) is not None:
        return
    raise ConfigError(f"output directory {out} is in use by a run: {holder.describe()} holds {out / run_lock.LOCK}; "
                      "a second job there would rewrite the config.yaml the first one requeues from. Wait for it "
                      "to end, cancel it, or pass another --output-dir (if that run is gone, delete the lock)")


def _job_active(job_id: str, squeue: str) -> bool:
    """Whether SLURM still has the job queued or running; True when squeue cannot tell."""
    try:
        result = subprocess.run([squeue, "--noheader", "--jobs", job_id, "--format=%T"], capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True
    if result.returncode != 0:
        # squeue fails for a job id it no longer knows (purged after the job ended)
        return "Invalid job id" not in result.stderr
    return bool(result.stdout.strip())


def submit(job: PreparedJob, sbatch: str = "sbatch") -> str:
    """Submit with sbatch; returns the job id."""
    if shutil.which(sbatch) is None:
        raise LaunchError("sbatch not found: run on a SLURM login node (with sbatch on PATH) "
                          "or use `megatron-rl launch local` on this machine")
    result = subprocess.run([sbatch, "--parsable", str(job.script_path)], capture_output=True, text=True,
                            cwd=job.output_dir)
    if result.returncode != 0:
        raise LaunchError(
            f"sbatch rejected the job (exit {result.returncode}):\n{result.stderr.strip() or result.stdout.strip()}\n"
            "hint: check --partition (sinfo lists them), --account (sacctmgr show assoc user=$USER), --time "
            "against the partition's limit, and --nodes/--gpus-per-node against what the partition has. "
            f"The script is {job.script_path}"
        )
    return result.stdout.strip().split(";")[0]


def log_path(job: PreparedJob, job_id: str) -> Path:
    return job.output_dir / "logs" / f"slurm-{job_id}.out"


def _inside_site_packages(path: Path) -> bool:
    roots = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    return any(str(path).startswith(str(Path(root).resolve())) for root in roots)
