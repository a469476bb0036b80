"""Progress to Kubeflow Trainer: where its controller (v2.2 and later, ``TrainJobRuntimeStatus``) injects
``KUBEFLOW_TRAINER_SERVER_URL``, ``KUBEFLOW_TRAINER_SERVER_CA_CERT`` and ``KUBEFLOW_TRAINER_SERVER_TOKEN``, the main
process POSTs the TrainJob's status at its logs: progress, the time left, the step's figures, in the payload
transformers' ``KubeflowCallback`` sends (docs/clusters.md#progress-to-kubeflow-trainer).

A thread of its own posts, at most one status per 5 s (the first at once), so that a slow or absent server never
holds a step; a failed post is said once and training goes on. 100% is posted when fit() finishes.
"""

from __future__ import annotations

import json
import os
import ssl
import threading
import time
import urllib.request
from datetime import datetime, timezone
from typing import Any, Optional

from trainer.console import warn

URL, CA_CERT, TOKEN = "KUBEFLOW_TRAINER_SERVER_URL", "KUBEFLOW_TRAINER_SERVER_CA_CERT", "KUBEFLOW_TRAINER_SERVER_TOKEN"
# transformers' KubeflowCallback's: the controller's rate, and how long a post may take.
EVERY_S, TIMEOUT_S = 5.0, 5.0


class KubeflowProgress:
    """The main process's reporter; ``update`` at each log, ``finish`` as fit() ends."""

    def __init__(self, url: str, *, step: int):
        self.url, self.started, self.first_step = url, time.monotonic(), step
        # When the last status was queued (None: none yet, the first goes at once).
        self.last: Optional[float] = None
        self.pending: Optional[dict[str, Any]] = None
        self.wake, self.lock = threading.Event(), threading.Lock()
        self.said, self.closed = False, False
        self.thread = threading.Thread(target=self._post_loop, name="kubeflow-progress", daemon=True)
        self.thread.start()

    @classmethod
    def from_env(cls, *, main: bool, step: int) -> Optional["KubeflowProgress"]:
        """A reporter on the main process of a TrainJob whose controller asks for status; None elsewhere."""
        url = os.environ.get(URL)
        return cls(url, step=step) if main and url else None

    def update(self, step: int, total: int, metrics: dict[str, Any]) -> None:
        """This log's status for the thread to post (one a 5 s at most: those between are dropped, as transformers'
        callback drops them): progress up to 99% until ``finish``."""
        now = time.monotonic()
        if self.last is not None and now - self.last < EVERY_S:
            return
        self.last = now
        figures = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        figures.update(current_step=step, total_steps=total)
        done = step - self.first_step
        left = (now - self.started) / done * (total - step) if done > 0 else None
        self._queue(min(99, int(100 * step / max(total, 1))), left, figures)

    def finish(self, status: str) -> None:
        """Post 100% when the run finished (waiting for it, at most its timeout), then let the thread end."""
        if status == "finished":
            self._queue(100, 0, {})
        with self.lock:
            self.closed = True
        self.wake.set()
        self.thread.join(timeout=TIMEOUT_S + 1)

    def _queue(self, percent: int, left: Optional[float], figures: dict[str, Any]) -> None:
        status: dict[str, Any] = {"progressPercentage": percent, "lastUpdatedTime": _now()}
        if left is not None:
            status["estimatedRemainingSeconds"] = max(0, int(left))
        if figures:
            status["metrics"] = [{"name": str(k), "value": str(v)} for k, v in figures.items()]
        with self.lock:
            # A status the thread has not sent yet is replaced: the newest is what the controller wants.
            self.pending = {"trainerStatus": status}
        self.wake.set()

    def _post_loop(self) -> None:
        while True:
            self.wake.wait()
            with self.lock:
                payload, closed = self.pending, self.closed
                self.pending = None
                self.wake.clear()
            if payload is not None:
                self._post(payload)
            if closed:
                return

    def _post(self, payload: dict[str, Any]) -> None:
        try:
            with open(os.environ[TOKEN], encoding="utf-8") as file:
                token = file.read().strip()
            ca = os.environ.get(CA_CERT)
            context = ssl.create_default_context(cafile=ca) if ca else None
            headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
            request = urllib.request.Request(self.url, json.dumps(payload).encode(), headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context):
                pass
        except (OSError, KeyError, ValueError) as err:
            if not self.said:
                self.said = True
                warn(f"progress to Kubeflow Trainer ({self.url}) not posted, training goes on: {err}")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()
