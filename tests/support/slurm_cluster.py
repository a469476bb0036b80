"""A real, throwaway Slurm cluster on this host for the tests: munged, slurmctld and two slurmd ("nodes" n1 and n2
on one machine), Debian's slurm-wlm packages (../shared/notes/real-slurm.md). Everything lives under one folder with
ports of its own, so each pytest worker can run its own cluster; nothing under /etc is used (SLURM_CONF names the
config). Stopped by the PIDs the daemons write.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")


def missing() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, root: Path, nodes: int = 2):
        self.root, self.nodes = root, [f"n{i}" for i in range(1, nodes + 1)]
        self.conf = root / "etc" / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> "SlurmCluster":
        r = self.root
        for sub in ("etc", "log", "pid", "state/ctld", "state/d", "munge"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o711)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        socket_path = r / "munge" / "munge.socket"
        munge = r / "munge"
        subprocess.run(
            [
                _binary("munged"),
                "-S",
                socket_path,
                f"--key-file={key}",
                f"--log-file={munge}/munged.log",
                f"--pid-file={munge}/munged.pid",
                f"--seed-file={munge}/munged.seed",
            ],
            check=True,
        )
        host = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=trainer-tests",
            f"SlurmctldHost={host}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={_free_port()}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={socket_path}",
            "CredType=cred/munge",
            f"StateSaveLocation={r}/state/ctld",
            f"SlurmdSpoolDir={r}/state/d/%n",
            f"SlurmctldPidFile={r}/pid/slurmctld.pid",
            f"SlurmdPidFile={r}/pid/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "ReturnToService=2",
            "InactiveLimit=0",
            "KillWait=30",
            "MailProg=/bin/true",
            "MinJobAge=600",
        ]
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} "
                f"CPUs={os.cpu_count()} RealMemory=4000 State=UNKNOWN"
            )
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        subprocess.run([_binary("slurmctld"), "-f", self.conf, "-i"], check=True, env=self.env)
        for node in self.nodes:
            subprocess.run([_binary("slurmd"), "-f", self.conf, "-N", node], check=True, env=self.env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-o", "%T", check=False).stdout.split()
            if states and set(states) == {"idle"}:
                return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"Slurm did not come up; see {r}/log")

    def run(self, *command: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            [_binary(command[0]), *map(str, command[1:])],
            env=self.env,
            capture_output=True,
            text=True,
            check=check,
            **kw,
        )

    def job_state(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode...)."""
        text = self.run("scontrol", "show", "job", job_id, "-o").stdout
        return dict(field.split("=", 1) for field in text.split() if "=" in field)

    def wait_for(self, job_id: str, states: set[str], timeout: float = 300) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state.get("JobState") in states:
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {self.job_state(job_id).get('JobState')} after {timeout} s")

    def stop(self) -> None:
        pids = sorted((self.root / "pid").glob("slurmd-*.pid")) + [
            self.root / "pid" / "slurmctld.pid",
            self.root / "munge" / "munged.pid",
        ]
        for pid_file in pids:
            if not pid_file.is_file():
                continue
            pid = int(pid_file.read_text().strip())
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(40):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.25)
