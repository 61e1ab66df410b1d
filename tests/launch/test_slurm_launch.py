"""`megatron-rl launch slurm|local`.

Without SLURM (fast): the rendered scripts (both templates) are valid bash with the knobs in place;
a node count that does not fit the layout is refused before anything is written; a missing or
failing sbatch gives a clear message (fake sbatch scripts, because a real rejection needs a
cluster configured to reject).

Against a real SLURM (slurmctld + four slurmd on this host, see conftest.py; skipped with the
reason where it cannot start): the tiny default, shortened, runs to completion through
`megatron-rl launch slurm` on two nodes; the disaggregated template (one training node, two
rollout nodes running a vLLM server each) trains with every weight push reaching both servers
(both jobs' launchers, torchrun, ranks, rollout nodes and vLLM servers forked from the tests'
pre-imported Python, tests/_support/zygote.py). One job, in fresh processes all tracked and
signalled by SLURM, is interrupted twice: requeued mid-run (`scontrol requeue`: SIGTERM to every
process of the job, wandb's helper included, as at preemption) it writes its stop checkpoint and
resumes from it; then the preemption warning (USR1 to the batch script) makes the trainer
checkpoint and the job requeue itself, resume and finish. The other two jobs run beside it, each
submitted once one of its interrupted runs has stopped: its processes exiting and SLURM's hold of
a requeued job left a core idle for ~12 s each time.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from _support.processes import REPO, cli_command

pytestmark = pytest.mark.slurm

SHORT = ["rl.prompts_per_step=8", "rl.group_size=4", "rl.max_response_tokens=6", "warm_start.steps=20",
         "data.num_heldout=16", "rl.eval_every=0", "checkpoint.every_steps=2", "logging.wandb_mode=disabled"]


# The interrupted run: long enough that each interruption lands mid-run. Measured (a step takes
# 0.3-1.2 s here; the test polls 4 times a second): the requeue seen after step 1 stops the first
# run after step 2 or 3, the warning seen after the resumed run's first step stops it one or two
# steps later (after step 5); a warning that came too late fails at once, naming LONG. The warning
# travels through the test's poll, two scancel calls and the batch script's trap (0.5-2.5 s), so the
# resumed run keeps about 15 steps ahead of it: at 0.2-0.3 s a step on a fast, idle machine that is
# 3-4.5 s (at LONG = 12 it was 1.6-2.4 s). Each step more costs its time in the last run.
LONG = 18


def cli(*args: str, env: dict | None = None, timeout: float = 120, children: bool = False) -> subprocess.CompletedProcess:
    """`megatron-rl ARGS...`, forked from the pre-imported server. children=True: the job it submits
    runs its launcher, torchrun and ranks forked from that server too (its script's interpreter is
    the server's stand-in for python), outside SLURM's process tracking: only for a job whose
    claim does not depend on what SLURM signals (not the requeue and preemption tests)."""
    environment = dict(env or os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(cli_command(*args, preloaded=True, children=children), env=environment, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


# ---- without SLURM ------------------------------------------------------------------------------


def test_dry_run_renders_valid_scripts_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    colocated = cli("launch", "slurm", "--nodes", "2", "--output-dir", str(out), "--partition", "gpu",
                    "--account", "proj", "--time", "01:00:00", "--module", "cuda/12.4", "--container-image",
                    "nvcr.io#nvidia/pytorch", "--network-interface", "ib0", "--signal-lead-seconds", "300",
                    "--dry-run", "rl.steps=3")
    assert colocated.returncode == 0, colocated.stderr
    script = colocated.stdout
    for line in ("#SBATCH --nodes=2", "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --time=01:00:00",
                 "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue", "module load cuda/12.4",
                 "--container-image='nvcr.io#nvidia/pytorch'", "NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0",
                 f"{out}/config.yaml", "megatron_rl.launch.node --nproc-per-node 1"):
        assert line in script, line
    assert "{{" not in script
    disaggregated = cli("launch", "slurm", "--nodes", "1", "--rollout-nodes", "2", "--gpus-per-node", "2",
                        "--procs-per-node", "1", "--output-dir", str(out), "--dry-run")
    assert disaggregated.returncode == 0, disaggregated.stderr
    assert "#SBATCH --nodes=3" in disaggregated.stdout and "#SBATCH --gpus-per-node=2" in disaggregated.stdout
    assert "megatron_rl.launch.rollout_node" in disaggregated.stdout and "rollout.mode=server" in disaggregated.stdout
    for text in (script, disaggregated.stdout):
        path = tmp_path / "job.sh"
        path.write_text(text)
        check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    assert not out.exists(), "a dry run must not write anything"


def test_node_count_that_does_not_fit_is_refused_before_submitting(tmp_path):
    # 3 ranks cannot shard the colocated engine over the tiny model's 2 KV heads; ep=2 needs even DP.
    result = cli("launch", "slurm", "--nodes", "3", "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert "rollout.mode=colocated" in result.stderr and "3 trainer process" in result.stderr, result.stderr
    result = cli("launch", "slurm", "--nodes", "1", "--procs-per-node", "1", "parallel.tp=2",
                 "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and "parallel" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_fake_sbatch_missing_gives_clear_message(tmp_path):
    """PATH without sbatch: stands in for a machine that is not a SLURM login node."""
    env = dict(os.environ, PATH=str(tmp_path / "empty-bin"))
    result = cli("launch", "slurm", "--nodes", "1", "--output-dir", str(tmp_path / "run"), env=env)
    assert result.returncode == 1
    assert "sbatch not found" in result.stderr and "megatron-rl launch local" in result.stderr


def test_fake_sbatch_rejection_shows_its_error_and_a_hint(tmp_path):
    """A fake sbatch that rejects the job the way a real one does for a bad partition (a real
    rejection would need a cluster configured to reject)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"
    fake.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: nope' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    result = cli("launch", "slurm", "--nodes", "1", "--partition", "nope", "--output-dir", str(tmp_path / "run"),
                 env=env)
    assert result.returncode == 1
    assert "invalid partition specified: nope" in result.stderr
    assert "hint:" in result.stderr and "--partition" in result.stderr


def test_a_directory_whose_job_still_runs_is_refused_before_its_config_is_rewritten(tmp_path):
    """run.lock names SLURM job 77 (train/run_lock.py); a fake squeue says whether it still runs."""
    out, bin_dir = tmp_path / "run", tmp_path / "bin"
    out.mkdir()
    bin_dir.mkdir()
    (out / "config.yaml").write_text("# the running job's config\n")
    (out / "run.lock").write_text(json.dumps({"host": "node-a", "pid": 4242, "started": "2026-01-01 00:00:00 +0000",
                                              "pid_start": 1, "boot_id": "b", "slurm_job_id": "77"}))
    for name, body in (("squeue", "echo RUNNING"), ("sbatch", "echo 78")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    result = cli("launch", "slurm", "--nodes", "1", "--output-dir", str(out), env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"output directory {out} is in use by a run: pid 4242 on node-a, SLURM job 77" in result.stderr
    assert (out / "config.yaml").read_text() == "# the running job's config\n"
    (bin_dir / "squeue").write_text("#!/bin/sh\n")  # the job has ended: nothing listed
    result = cli("launch", "slurm", "--nodes", "1", "--output-dir", str(out), env=env)
    assert result.returncode == 0 and "submitted job 78" in result.stdout, result.stdout + result.stderr
    assert "Resolved config of the submitted job" in (out / "config.yaml").read_text()


def test_launch_local_dry_run_and_layout_check(tmp_path):
    result = cli("launch", "local", "--nproc-per-node", "2", "--dry-run", "--output-dir", str(tmp_path), "rl.steps=2")
    assert result.returncode == 0, result.stderr
    # torchrun's rendezvous on loopback only (runtime/torchrun.py; tests/runtime/test_rendezvous.py)
    assert re.search(r"-m megatron_rl\.runtime\.torchrun --master-addr=127\.0\.0\.1 --master-port=\d+ "
                     r"--nproc-per-node=2 -m megatron_rl\.cli train", result.stdout), result.stdout
    assert f"output_dir={tmp_path}" in result.stdout
    refused = cli("launch", "local", "--nproc-per-node", "3", "--dry-run")
    assert refused.returncode == 2 and "KV heads" in refused.stderr


# ---- against a real SLURM -----------------------------------------------------------------------


def submit(cluster, out: Path, nodes: int, *overrides: str, extra: tuple[str, ...] = (),
           children: bool = False, env: dict | None = None) -> tuple[str, Path]:
    """`env`: variables added to the submitting environment (sbatch passes them to the job)."""
    result = cli("launch", "slurm", "--nodes", str(nodes), "--output-dir", str(out), "--job-name", out.name,
                 *extra, *SHORT, *overrides, env={**cluster.env, **(env or {})}, children=children)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
    log = out / "logs" / f"slurm-{job_id}.out"
    assert str(log) in result.stdout
    return job_id, log


def free_port_block(count: int) -> int:
    """A port p such that p .. p + count - 1 are all free on this host now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count > 65535:
            continue
        held = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no block of {count} free ports found")


def wait_until(predicate, timeout: float, what: str, cluster, log: Path, job_id: str):
    """`predicate()`'s first true value, polled 4 times a second (a poll is one `scontrol` or a file
    read, a few ms): the requeue, the warning and the next job wait for the test to notice, 0.125 s
    on average instead of 0.5 s at one poll a second."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    state = cluster.job_state(job_id)
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"
    subprocess.run(["scancel", job_id], env=cluster.env, capture_output=True)
    pytest.fail(f"timed out waiting for {what}; job {job_id} state {state}\n{tail}\n{cluster.logs()}")


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def finished(cluster, job_id: str, out: Path) -> bool:
    state = cluster.job_state(job_id)
    return state in ENDED or state is None


def steps_logged(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def checkpointed(out: Path) -> bool:
    return (out / "checkpoints" / "latest").is_file()


def submit_two_node_job(cluster, out: Path) -> tuple[str, Path, Path]:
    job_id, log = submit(cluster, out, 2, "rl.steps=3", children=True)
    return job_id, log, out


def submit_disaggregated_job(cluster, out: Path) -> tuple[str, Path, Path]:
    # The servers listen on MASTER_PORT + 1 and + 2. The port the job derives from its id can be one
    # the suite's other servers were given by the OS (the job then refuses, naming the port):
    # here the job takes a block that is free now, through the documented override.
    job_id, log = submit(cluster, out, 1, *DISAGGREGATED, extra=("--rollout-nodes", "2"), children=True,
                         env={"MEGATRON_RL_MASTER_PORT": str(free_port_block(3))})
    return job_id, log, out


@pytest.fixture(scope="module")
def submitted_early():
    """The other jobs, by name, as (job id, log, output directory) or the error submitting them:
    `interrupted_job` submits each while its own job only waits on SLURM (~12 s after each
    interruption: the stopped run's processes exiting, then SLURM's hold of a requeued job), so
    that it runs on the core that job leaves idle. A test whose job is not there submits it."""
    return {}


def take_job(submitted_early: dict, name: str, submit_job):
    job = submitted_early.pop(name, None)
    if isinstance(job, BaseException):
        raise job
    return job or submit_job()


@pytest.fixture(scope="module")
def interrupted_job(slurm_cluster, submitted_early, tmp_path_factory):
    """One job interrupted twice, as SLURM interrupts jobs (one job instead of one per interruption:
    each start imports torch and trains the warm start again): `scontrol requeue` after its first
    RL step, then, once the requeued run has resumed and taken a step, the preemption warning (USR1
    to the batch script). Returns the job id, its output directory and its whole log.

    Once each interrupted run has written its stop checkpoint (never while it writes it: that must
    fit in KillWait), it submits one of the other jobs (`submitted_early`). It runs on the last
    node, so that those get the first ones."""
    out = tmp_path_factory.mktemp("interrupted") / "requeue"
    # No warm start and no HF export: what the test asserts is the interruptions and the resumes.
    job_id, log = submit(slurm_cluster, out, 1, f"rl.steps={LONG}", "logging.wandb_mode=offline", "warm_start.steps=0",
                         "checkpoint.export_hf=false", extra=(f"--sbatch-arg=--nodelist={slurm_cluster.nodes[-1]}",))

    def logged(*lines: str):
        return lambda: log.exists() and any(line in log.read_text(errors="replace") for line in lines)

    def submit_early(name: str, submit_job) -> None:
        try:
            submitted_early[name] = submit_job(slurm_cluster, tmp_path_factory.mktemp(name) / name)
        except Exception as exc:  # its test reports it, not this job's
            submitted_early[name] = exc

    wait_until(lambda: max(steps_logged(out), default=0) >= 1, 240, "the first RL step", slurm_cluster, log, job_id)
    slurm_cluster.run("scontrol", "requeue", job_id)
    wait_until(logged("stopped by SIGTERM", "restart 1:"), 120, "the requeued run to stop", slurm_cluster, log, job_id)
    submit_early("two-nodes", submit_two_node_job)

    def stepped_after_restart() -> bool:
        text = log.read_text(errors="replace") if log.exists() else ""
        after = text.split("restart 1:", 1)[1] if "restart 1:" in text else ""
        return "resumed from" in after and re.search(rf"^step \d+/{LONG}", after.split("resumed from", 1)[1],
                                                     re.MULTILINE) is not None

    wait_until(stepped_after_restart, 300, "the requeued run's first step", slurm_cluster, log, job_id)
    # What SLURM does --signal-lead-seconds before the time limit: USR1 to the batch script.
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", job_id)
    wait_until(logged("requeueing job", "restart 2:", "training finished"), 120, "the warned run to stop",
               slurm_cluster, log, job_id)
    submit_early("disaggregated", submit_disaggregated_job)

    def ended_after_a_second_requeue() -> bool:
        fields = slurm_cluster.job_fields(job_id)
        ended = fields.get("JobState") in ENDED
        if ended and fields.get("Restarts") in ("0", "1"):
            pytest.fail(f"job {job_id} ended without requeueing itself after the warning (the last run finished "
                        f"before the warning reached it? raise LONG={LONG}):\n"
                        f"{log.read_text(errors='replace')[-4000:]}")
        return ended or not fields

    wait_until(ended_after_a_second_requeue, 300, "the job to end after the warning", slurm_cluster, log, job_id)
    return job_id, out, log.read_text(errors="replace")


def test_requeued_job_stops_with_a_checkpoint_and_resumes_from_it(slurm_cluster, interrupted_job):
    """`scontrol requeue` is what SLURM does to a job it preempts (PreemptMode=REQUEUE): SIGTERM to
    every process of the job, not only the trainer (SLURM's process tracking reaches wandb's helper
    process, which has its own session), SIGKILL KillWait later, then the job runs again. With wandb
    offline, as by default, the trainer still finishes its step and writes the stop checkpoint, and
    the requeued job resumes from that one, not from the older periodic checkpoint."""
    job_id, out, whole = interrupted_job
    assert slurm_cluster.job_state(job_id) == "COMPLETED", whole[-4000:]
    assert "restart 1:" in whole
    text = whole[:whole.index("restart 2:")] if "restart 2:" in whole else whole  # until the warning's requeue
    stopped = re.search(r"stopped by SIGTERM after step (\d+); checkpoint \S+step_0*(\d+)\.", text)
    assert stopped and stopped.group(1) == stopped.group(2), f"no stop checkpoint:\n{text[-6000:]}"
    stop_step = int(stopped.group(1))
    # wandb's helper died of the same SIGTERM: one line says so instead of the run failing.
    first_run = text[:text.index("restart 1:")]
    assert re.search(r"^wandb (log|finish) failed \(.*metrics continue in \S+metrics\.jsonl$", first_run,
                     re.MULTILINE), first_run[-6000:]
    resumed = re.search(r"resumed from \S+ at step (\d+)", text)
    assert resumed, f"the requeued run did not resume:\n{text[-4000:]}"
    assert int(resumed.group(1)) == stop_step, text[-4000:]
    after = text[resumed.end():]
    first = re.search(rf"^step (\d+)/{LONG}", after, re.MULTILINE)
    assert first and int(first.group(1)) == stop_step + 1, after[:2000]
    assert "warm start" not in after.lower() or "step 0/" not in after
    assert sorted(steps_logged(out)) == list(range(LONG + 1)), "every step once in the final metrics"
    assert json.loads((out / "run_state.json").read_text()) == {"step": LONG, "finished": True}


def test_preemption_warning_checkpoints_and_requeues(slurm_cluster, interrupted_job):
    """The preemption warning, to the job requeued once already: the batch script asks the trainer
    to stop (USR1 to the job's steps), which checkpoints after its step; the script requeues the
    job, which resumes from that checkpoint and finishes."""
    job_id, out, whole = interrupted_job
    assert slurm_cluster.job_state(job_id) == "COMPLETED", whole[-4000:]
    assert "restart 2:" in whole, whole[-4000:]
    warned = whole[whole.index("restart 1:"):whole.index("restart 2:")]
    stopped = re.search(r"stopped by SIGUSR1 after step (\d+); checkpoint \S+step_0*(\d+)\.", warned)
    assert stopped and stopped.group(1) == stopped.group(2), warned[-4000:]
    assert "requeueing job" in warned
    text = whole[whole.index("restart 2:"):]
    assert re.search(rf"resumed from \S+ at step {stopped.group(1)}", text), text[-4000:]
    assert sorted(steps_logged(out)) == list(range(LONG + 1))


def test_job_completes_on_two_nodes(slurm_cluster, submitted_early, tmp_path):
    job_id, log, out = take_job(submitted_early, "two-nodes",
                                lambda: submit_two_node_job(slurm_cluster, tmp_path / "two-nodes"))
    wait_until(lambda: finished(slurm_cluster, job_id, out), 240, "the job to end", slurm_cluster, log, job_id)
    text = log.read_text(errors="replace")
    assert slurm_cluster.job_state(job_id) == "COMPLETED", text[-4000:]
    assert "2 node(s), rendezvous 127.0.0.1:" in text and "node 1 (" in text
    assert sorted(steps_logged(out)) == [0, 1, 2, 3]
    assert json.loads((out / "run_state.json").read_text()) == {"step": 3, "finished": True}
    assert checkpointed(out)
    assert (out / "config.yaml").is_file() and "training finished (exit 0)" in text


# The disaggregated job, as short as it gets: no warm start (the weights need not be good, only
# identical on both sides), GRPO (no group is dropped, so every step trains on both servers'
# samples) with an entropy bonus (a gradient even where all rewards are equal, so every update
# changes the weights the next push must deliver).
# R3 too: the servers' own routes (captured in their workers) replayed in every forward.
DISAGGREGATED = ["rl.steps=2", "warm_start.steps=0", "rl.recipe=grpo", "rl.entropy_coef=0.01", "data.num_heldout=2",
                 "checkpoint.every_steps=0", "checkpoint.export_hf=false", "rl.routing_replay=rollout"]


def server_requests(log: Path) -> dict[str, int]:
    """How often each HTTP endpoint was called, from the server's access log."""
    return dict(Counter(re.findall(r'"POST (/[\w/]+)', log.read_text(errors="replace"))))


def test_disaggregated_job_pushes_every_step_to_both_servers(slurm_cluster, submitted_early, tmp_path):
    """One training node and two rollout nodes of `slurm/train_disaggregated.sbatch.tmpl`: the
    servers start from the config, the trainer finds them from the URLs the job passes it, and
    the collective transport (gloo here) delivers every push to both of them."""
    job_id, log, out = take_job(submitted_early, "disaggregated",
                                lambda: submit_disaggregated_job(slurm_cluster, tmp_path / "disaggregated"))
    wait_until(lambda: finished(slurm_cluster, job_id, out), 300, "the job to end", slurm_cluster, log, job_id)
    text = log.read_text(errors="replace")
    assert slurm_cluster.job_state(job_id) == "COMPLETED", text[-4000:]
    assert "train on n1, rollout on n2 n3 (1 vLLM server(s) per node, tensor parallel 1), weights by collective" in text
    assert "rollout.weight_transport=collective" in text and "training finished (exit 0)" in text
    for index in (0, 1):
        assert f"rollout server vllm-{index} at http://127.0.0.1:" in text, text[-4000:]
    steps = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]] = record
    assert sorted(steps) == [0, 1, 2]
    # Every step trains on samples of both servers (the pool splits each step's prompts between
    # them): the engines' logprobs are the trainer's, to float32 rounding. Step 1 generated with
    # the first push (the initial weights), step 2 with the push of the weights step 1's updates
    # changed; one update moves these logprobs by up to ~0.2 (measured: ratios 0.82 to 1.29), so a
    # server that missed a push would be off by far more than the bound.
    for step in (1, 2):
        record = steps[step]
        assert record["rollout/groups_kept"] == 8 and record["count/sequences"] == 32, record
        assert record["mismatch/logp_abs_diff_max"] <= 1e-4, (step, record["mismatch/logp_abs_diff_max"])
        assert record["train/grad_norm"] > 0, record
        assert record["rollout/weights_loaded"] > 0, record
        # R3 on the servers' routes: holding the weights the servers sampled with (fp32), the
        # trainer's own routing agrees with theirs on every (token, layer).
        assert record["moe/rollout_routing_drift"] == 0.0, record
    # Each server took every push, the first one and one after each step, each bracketed by pause /
    # prefix-cache reset / resume (its access log); collective_rpc: the worker count, the group
    # join, one receive per push, and (R3) the route fetches.
    pushes = 1 + 2
    for index in (0, 1):
        requests = server_requests(out / "logs" / f"vllm-{index}.log")
        assert requests.get("/pause") == requests.get("/resume") == pushes, (index, requests)
        # One more cache reset: R3's route capture starts with an empty prefix cache.
        assert requests.get("/reset_prefix_cache") == pushes + 1, (index, requests)
        assert requests.get("/collective_rpc") > 2 + pushes, (index, requests)
        assert requests.get("/v1/completions", 0) > 0, (index, requests)
    assert json.loads((out / "run_state.json").read_text()) == {"step": 2, "finished": True}
