"""Progress to the scheduler, Kubeflow Trainer's (tests/launch/test_slurm.py: Slurm's): a loopback HTTPS server with
a self-signed CA stands in for the controller (its URL, CA and token file given as the controller injects them); a job
on 2 processes posts the TrainJob's status from its main process alone, with the bearer token, in transformers'
``KubeflowCallback`` payload, 100 at the end; a server that is not there costs a line, not the run."""

from __future__ import annotations

import http.server
import json
import shutil
import ssl
import subprocess
import threading

import pytest

from conftest import accelerate_launch, clean_env, free_port

JOB = """
import sys
import torch
from trainer import TrainConfig, Trainer

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return {"loss": ((self.linear(x) - y) ** 2).mean()}

torch.manual_seed(0)
data = [{"x": torch.randn(4), "y": torch.randn(1)} for _ in range(64)]
Trainer(Net(), TrainConfig(output_dir=sys.argv[1], max_steps=4, batch_size=4, log_every=1), train_data=data).fit()
"""


def certificates(folder):
    """A CA of our own and a certificate it signed for 127.0.0.1, as files."""

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
    )
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"
    )
    (folder / "names.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "1",
        "-extfile",
        "names.ext",
    )
    return folder / "ca.crt", folder / "server.crt", folder / "server.key"


@pytest.fixture
def controller(tmp_path):
    """The HTTPS server: every POST's path, Authorization header and JSON body, in order."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl makes the test's certificates")
    ca, cert, key = certificates(tmp_path)
    posts = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            posts.append((self.path, self.headers["Authorization"], json.loads(body)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "token").write_text("the-token\n")
    env = {
        "KUBEFLOW_TRAINER_SERVER_URL": f"https://127.0.0.1:{server.server_address[1]}/status/job-1",
        "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(ca),
        "KUBEFLOW_TRAINER_SERVER_TOKEN": str(tmp_path / "token"),
    }
    yield env, posts
    server.shutdown()


def test_the_main_process_posts_progress_with_the_token_and_100_at_the_end(tmp_path, controller):
    env, posts = controller
    script = tmp_path / "job.py"
    script.write_text(JOB)
    accelerate_launch(script, str(tmp_path / "out"), num_processes=2, env=clean_env(**env))
    assert posts, "no status reached the server"
    assert {(path, token) for path, token, _ in posts} == {("/status/job-1", "Bearer the-token")}
    statuses = [body["trainerStatus"] for _, _, body in posts]
    # The first log's at once (step 1 of 4); those within 5 s of it dropped; one 100, the last, from one process.
    first, last = statuses[0], statuses[-1]
    assert first["progressPercentage"] == 25
    figures = {m["name"]: m["value"] for m in first["metrics"]}
    assert figures["current_step"] == "1" and figures["total_steps"] == "4" and "train_loss" in figures
    assert last["progressPercentage"] == 100 and last["estimatedRemainingSeconds"] == 0
    assert [s["progressPercentage"] for s in statuses].count(100) == 1
    assert all("lastUpdatedTime" in s for s in statuses)


def test_a_server_that_is_not_there_costs_a_line_not_the_run(tmp_path, controller):
    env, posts = controller
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**env, "KUBEFLOW_TRAINER_SERVER_URL": f"https://127.0.0.1:{free_port()}/status"}
    done = accelerate_launch(script, str(tmp_path / "out"), num_processes=1, env=clean_env(**env))
    said = done.stdout + done.stderr
    assert said.count("progress to Kubeflow Trainer") == 1 and "training goes on" in said
    assert (tmp_path / "out" / "final").exists()
