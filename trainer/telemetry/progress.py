"""Progress to the scheduler: the main process tells the job's scheduler how far training is, how long is left and the
step's figures, at its logs (docs/clusters.md#progress-to-the-scheduler):

- Kubeflow Trainer (v2.2 and later, ``TrainJobRuntimeStatus``): where its controller injects
  ``KUBEFLOW_TRAINER_SERVER_URL``, ``KUBEFLOW_TRAINER_SERVER_CA_CERT`` and ``KUBEFLOW_TRAINER_SERVER_TOKEN``, the
  TrainJob's status is POSTed in the payload transformers' ``KubeflowCallback`` sends, at most once per 5 s;
- Slurm: the job's comment (``squeue -o %k``, ``scontrol show job``) says ``trainer: 42% (step 420 of 1000), 1h02m
  left``, at most once a minute, unless the job was given a comment of its own.

A thread of its own sends, so that a slow or absent server never holds a step; a failed send is said once and
training goes on. 100% is sent when fit() finishes.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Optional

from trainer.console import warn

URL, CA_CERT, TOKEN = "KUBEFLOW_TRAINER_SERVER_URL", "KUBEFLOW_TRAINER_SERVER_CA_CERT", "KUBEFLOW_TRAINER_SERVER_TOKEN"
# How long a send may take.
TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Status:
    percent: int
    left_s: Optional[float]
    figures: dict
    step: int
    total: int


class Kubeflow:
    """The TrainJob's status, POSTed with the service account's token (transformers' ``KubeflowCallback``'s rate)."""

    every_s = 5.0

    def __init__(self, url: str):
        self.url = url

    @classmethod
    def from_env(cls) -> Optional["Kubeflow"]:
        return cls(os.environ[URL]) if os.environ.get(URL) else None

    def send(self, status: Status) -> None:
        body: dict[str, Any] = {"progressPercentage": status.percent, "lastUpdatedTime": _now()}
        if status.left_s is not None:
            body["estimatedRemainingSeconds"] = max(0, int(status.left_s))
        if status.figures:
            body["metrics"] = [{"name": str(k), "value": str(v)} for k, v in status.figures.items()]
        with open(os.environ[TOKEN], encoding="utf-8") as file:
            token = file.read().strip()
        ca = os.environ.get(CA_CERT)
        context = ssl.create_default_context(cafile=ca) if ca else None
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        data = json.dumps({"trainerStatus": body}).encode()
        request = urllib.request.Request(self.url, data, headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context):
            pass


class SlurmComment:
    """The Slurm job's comment, through ``scontrol update`` (a minute apart: each is a call to slurmctld)."""

    every_s = 60.0

    def __init__(self, job: str):
        self.job = job

    @classmethod
    def from_env(cls) -> Optional["SlurmComment"]:
        """Inside a Slurm job whose comment is empty or ours; a comment the user gave the job is left alone."""
        job = os.environ.get("SLURM_JOB_ID")
        if not job or shutil.which("scontrol") is None or shutil.which("squeue") is None:
            return None
        try:
            done = subprocess.run(["squeue", "-h", "-j", job, "-o", "%k"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        comment = done.stdout.strip()
        ours = comment in ("", "(null)") or comment.startswith("trainer:")
        return cls(job) if done.returncode == 0 and ours else None

    def send(self, status: Status) -> None:
        text = f"trainer: {status.percent}% (step {status.step} of {status.total})"
        text += ", done" if status.percent == 100 else f", {_duration(status.left_s)} left" if status.left_s else ""
        command = ["scontrol", "update", f"JobId={self.job}", f"Comment={text}"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
        if done.returncode:
            raise OSError(done.stderr.strip() or f"scontrol exited {done.returncode}")


class Progress:
    """The main process's reporter to each scheduler found; ``update`` at each log, ``finish`` as fit() ends."""

    def __init__(self, destinations: list, *, step: int):
        self.destinations, self.started, self.first_step = destinations, time.monotonic(), step
        # When each was last given a status (absent: never, the first goes at once); what the thread has to send.
        self.last: dict[int, float] = {}
        self.pending: dict[int, Status] = {}
        self.wake, self.lock = threading.Event(), threading.Lock()
        self.failed: set[int] = set()
        # The last log's (step, total steps): where a finished run ended.
        self.position, self.closed = (step, step), False
        self.thread = threading.Thread(target=self._send_loop, name="progress", daemon=True)
        self.thread.start()

    @classmethod
    def from_env(cls, *, main: bool, step: int) -> Optional["Progress"]:
        """A reporter on the main process of a job whose scheduler listens; None elsewhere."""
        found = [d for d in (Kubeflow.from_env(), SlurmComment.from_env()) if d is not None] if main else []
        return cls(found, step=step) if found else None

    def update(self, step: int, total: int, metrics: dict[str, Any]) -> None:
        """This log's status for each destination due one (those between are dropped, as transformers' callback
        drops them): progress up to 99% until ``finish``."""
        now, self.position = time.monotonic(), (step, total)
        due = [i for i, d in enumerate(self.destinations) if now - self.last.get(i, -d.every_s) >= d.every_s]
        if not due:
            return
        figures = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        figures.update(current_step=step, total_steps=total)
        done = step - self.first_step
        left = (now - self.started) / done * (total - step) if done > 0 else None
        status = Status(min(99, int(100 * step / max(total, 1))), left, figures, step, total)
        for i in due:
            self.last[i] = now
        self._queue(dict.fromkeys(due, status))

    def finish(self, outcome: str) -> None:
        """100% to every destination when the run finished (waiting for the sends, at most their timeout each), then
        let the thread end."""
        if outcome == "finished":
            step, total = self.position
            self._queue(dict.fromkeys(range(len(self.destinations)), Status(100, 0, {}, step, total)))
        with self.lock:
            self.closed = True
        self.wake.set()
        self.thread.join(timeout=TIMEOUT_S * len(self.destinations) + 1)

    def _queue(self, statuses: dict[int, Status]) -> None:
        with self.lock:
            # A status not sent yet is replaced: the newest is what the scheduler wants.
            self.pending.update(statuses)
        self.wake.set()

    def _send_loop(self) -> None:
        while True:
            self.wake.wait()
            with self.lock:
                pending, closed = self.pending, self.closed
                self.pending = {}
                self.wake.clear()
            for i, status in pending.items():
                destination = self.destinations[i]
                try:
                    destination.send(status)
                # Whatever a server or scontrol does (http.client's errors are not OSErrors): a line, never the run.
                except Exception as err:
                    if i not in self.failed:
                        self.failed.add(i)
                        warn(f"progress to {_named(destination)} not sent, training goes on: {err}")
            if closed:
                return


def _named(destination: Any) -> str:
    if isinstance(destination, Kubeflow):
        return f"Kubeflow Trainer ({destination.url})"
    return f"Slurm job {destination.job}'s comment"


def _duration(seconds: float) -> str:
    minutes = int(seconds // 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{int(seconds % 60):02d}s"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()
