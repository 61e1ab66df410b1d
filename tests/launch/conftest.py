"""A real SLURM (Debian's slurm-wlm + munge) started for the tests: one slurmctld and N slurmd on
this host (SLURM supports several slurmd per host: NodeAddr 127.0.0.1, one port each).

`start_cluster(directory, nodes)` returns a SlurmCluster; it raises ClusterUnavailable with the
reason where SLURM cannot run here (packages missing and not installable, not root), which the
fixture turns into a visible pytest skip, and ClusterFailed where SLURM is there but does not start
(munge or a daemon failing, nodes never idle), which is an error like any other exception."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]


class ClusterUnavailable(RuntimeError):
    """SLURM cannot run on this machine: a skip (a failure under CI, see tests/conftest.py)."""


class ClusterFailed(RuntimeError):
    """SLURM is installed but does not start: an error, never a skip."""


@dataclass
class SlurmCluster:
    directory: Path
    nodes: list[str]
    env: dict
    pids: list[int] = field(default_factory=list)

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        result = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr}{result.stdout}")
        return result

    def job_fields(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s NAME=VALUE fields ({} once slurmctld forgot the job): one call
        for all of them, since the tests poll it several times a second."""
        result = self.run("scontrol", "show", "job", job_id, "-o", check=False)
        if result.returncode != 0:
            return {}
        return dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)

    def job_state(self, job_id: str) -> str | None:
        """The job's state (PENDING, RUNNING, COMPLETED, ...) or None once slurmctld forgot it."""
        return self.job_fields(job_id).get("JobState")

    def job_field(self, job_id: str, name: str) -> str | None:
        return self.job_fields(job_id).get(name)

    def logs(self) -> str:
        text = []
        for path in sorted(self.directory.glob("*.log")):
            text.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(text)

    def stop(self) -> None:
        for pid in reversed(self.pids):  # slurmd(s), then slurmctld, then munged
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(50):
                try:
                    os.kill(pid, 0)
                    waited = os.waitpid(pid, os.WNOHANG)
                    if waited[0] == pid:
                        break
                except (ProcessLookupError, ChildProcessError):
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _have_binaries() -> bool:
    return all(shutil.which(name) or Path(f"/usr/sbin/{name}").exists() for name in ("slurmctld", "slurmd", "munged")) \
        and shutil.which("sbatch") is not None


def ensure_installed() -> None:
    if _have_binaries():
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable("SLURM is not installed and installing it needs root")
    if shutil.which("apt-get") is None:
        raise ClusterUnavailable("SLURM is not installed and there is no apt-get to install it")
    result = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES],
                            env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"), capture_output=True, text=True,
                            timeout=600)
    if result.returncode != 0 or not _have_binaries():
        raise ClusterUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {result.stderr.strip()[-500:]}")


def _free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in sockets:
        sock.close()
    return ports


def start_cluster(directory: Path, nodes: int = 2) -> SlurmCluster:
    if os.geteuid() != 0:
        raise ClusterUnavailable("starting slurmctld/slurmd/munged as configured here needs root")
    ensure_installed()
    directory.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool"):
        (directory / sub).mkdir(exist_ok=True)
    host = socket.gethostname().split(".")[0]
    ctld_port, *node_ports = _free_ports(1 + nodes)
    names = [f"n{index + 1}" for index in range(nodes)]
    cpus = os.cpu_count() or 2
    node_lines = [f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} State=UNKNOWN"
                  for name, port in zip(names, node_ports)]
    (directory / "slurm.conf").write_text("\n".join([
        "ClusterName=megatronrltest", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={ctld_port}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        # SLURM holds a requeued job back for cred_expire + 1 s (its old credential must expire
        # first); 5 is the least it accepts, and the interrupted-job test waits it out twice.
        "AuthInfo=cred_expire=5",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SwitchType=switch/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "ReturnToService=2", "JobRequeue=1", "MailProg=/bin/true",
        "SchedulerParameters=bf_interval=1,sched_interval=1", "SlurmctldParameters=preempt_send_user_signal",
        f"StateSaveLocation={directory / 'state'}", f"SlurmdSpoolDir={directory / 'spool'}/%n",
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}", f"SlurmdPidFile={directory / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={directory / 'slurmctld.log'}", f"SlurmdLogFile={directory / 'slurmd-%n.log'}",
        "KillWait=5", "MinJobAge=300",
        *node_lines,
        f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP",
    ]) + "\n")
    env = dict(os.environ, SLURM_CONF=str(directory / "slurm.conf"))
    cluster = SlurmCluster(directory, names, env)
    try:
        _start_munge(cluster)
        daemons = [_spawn(["slurmctld", "-D", "-i"], env, directory / "slurmctld.out")]
        daemons += [_spawn(["slurmd", "-D", "-N", name], env, directory / f"slurmd-{name}.out") for name in names]
        cluster.pids += [process.pid for process, _ in daemons]
        # No pause after each start: a daemon that exits at start is found while the nodes come up
        # (0.5 s after each daemon was 2 s of the 3-node cluster's 2.1 s of bring-up).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for process, log in daemons:
                if process.poll() is not None:
                    raise ClusterFailed(f"{Path(process.args[0]).name} exited at start with code {process.returncode}: "
                                        f"{log.read_text(errors='replace')[-800:]}")
            idle = cluster.run("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False).stdout.split()
            if set(names) <= set(idle):
                return cluster
            time.sleep(0.1)
        raise ClusterFailed(f"SLURM nodes {names} did not become idle in 60 s:\n{cluster.logs()}")
    except BaseException:
        cluster.stop()
        raise


def _start_munge(cluster: SlurmCluster) -> None:
    check = subprocess.run(["munge", "-n"], capture_output=True, text=True)
    if check.returncode == 0:
        return  # a munged is already running
    if not Path("/etc/munge/munge.key").exists():
        raise ClusterFailed("munge has no key (/etc/munge/munge.key)")
    subprocess.run(["install", "-d", "-o", "munge", "-g", "munge", "-m", "0755", "/run/munge"], check=False)
    result = subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], capture_output=True, text=True)
    if result.returncode != 0:
        raise ClusterFailed(f"munged failed to start: {result.stderr.strip()}")
    pid_file = Path("/run/munge/munged.pid")
    for _ in range(50):
        if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            if pid_file.exists():
                cluster.pids.insert(0, int(pid_file.read_text().strip()))
            return
        time.sleep(0.1)
    raise ClusterFailed("munged started but `munge -n` keeps failing")


def _spawn(command: list[str], env: dict, log: Path) -> tuple[subprocess.Popen, Path]:
    binary = shutil.which(command[0]) or f"/usr/sbin/{command[0]}"
    with open(log, "ab") as out:
        process = subprocess.Popen([binary, *command[1:]], env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    return process, log


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """Four SLURM nodes on this host: the disaggregated job takes three (one training node, two
    rollout nodes) while the interrupted job runs on the fourth (test_slurm_launch.py runs jobs
    side by side); skipped, with the reason, where SLURM is not installed (and cannot be) or we
    are not root; under CI, where it is installed, tests/conftest.py turns that skip into a
    failure. Any other error starting it (ClusterFailed, an OSError, a command failing) is an
    error of the tests, not a skip."""
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("slurm"), nodes=4)
    except ClusterUnavailable as exc:
        pytest.skip(f"no SLURM on this machine: {exc}")
    yield cluster
    cluster.stop()
