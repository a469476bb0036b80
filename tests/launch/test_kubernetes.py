"""Kubernetes: examples/kubernetes/ (a Kubeflow Trainer TrainJob and its ClusterTrainingRuntime, and a plain JobSet).
No cluster here: each manifest is checked offline against the fields its CRD defines (tests/fixtures/crds: the
openAPIV3Schema of TrainJob and ClusterTrainingRuntime v1alpha1, kubeflow/trainer 8c0f5059b, field for field those of
the v2.3.0 release, whose API v2.2 is not compatible with (re-read 2026-11-28; v2.2.0's differ), and of JobSet
v1alpha2, kubernetes-sigs/jobset 08dfbdfd, descriptions dropped), and its command runs as Kubernetes runs it: one
torchrun per pod (two agents on loopback) with the PET_* variables the runtime sets, evicted by SIGTERM then SIGKILL
after the grace period, restarted, and ending bit-identical to a run never evicted."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from test_checkpoint import assert_bit_identical, final_weights, reference  # noqa: F401

from conftest import ROOT, SCENARIOS, clean_env, free_port, run

EXAMPLES = ROOT / "examples" / "kubernetes"
CRDS = ROOT / "tests" / "fixtures" / "crds"
GRACE_S = 60  # the eviction's grace period in the test (the manifests' is 300 s)
SCHEMAS = {"TrainJob": "trainjobs", "ClusterTrainingRuntime": "clustertrainingruntimes", "JobSet": "jobsets"}


def undefined(node, schema: dict, path: str = "") -> list[str]:
    """The paths in ``node`` that ``schema`` (an openAPIV3Schema, pruned) does not define, or gives another type."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    kind = schema.get("type")
    if isinstance(node, dict):
        if kind not in (None, "object"):
            return [f"{path}: an object where the CRD has {kind}"]
        fields, more = schema.get("properties", {}), schema.get("additionalProperties")
        if not fields and more is None:  # an object the CRD leaves open (metadata: Kubernetes' ObjectMeta)
            return []
        missing = [f"{path}.{name}: required" for name in schema.get("required", []) if name not in node]
        for key, value in node.items():
            if key in fields:
                missing += undefined(value, fields[key], f"{path}.{key}")
            elif isinstance(more, dict):
                missing += undefined(value, more, f"{path}.{key}")
            elif not more:
                missing.append(f"{path}.{key}: not a field")
        return missing
    if isinstance(node, list):
        if kind != "array":
            return [f"{path}: a list where the CRD has {kind}"]
        return [p for i, item in enumerate(node) for p in undefined(item, schema.get("items", {}), f"{path}[{i}]")]
    # int-or-string fields have no type; a quantity or a port may be either.
    types = {"string": str, "integer": int, "boolean": bool, "number": (int, float), "array": list, "object": dict}
    if kind in types and not isinstance(node, types[kind]):
        return [f"{path}: {type(node).__name__} where the CRD has {kind}"]
    return []


def manifest(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())


def test_each_manifest_holds_only_fields_its_crd_defines_and_they_agree_with_each_other():
    checked = {}
    for name in ("runtime", "trainjob", "jobset"):
        document = manifest(name)
        crd = json.loads(gzip.decompress((CRDS / f"{SCHEMAS[document['kind']]}.json.gz").read_bytes()))
        assert document["apiVersion"] == f"{crd['group']}/{crd['version']}", name
        assert undefined(document, crd["schema"]) == [], name
        checked[name] = document
    # The checker finds what it should: a misspelt field, a wrong type.
    broken = json.loads(json.dumps(checked["trainjob"]))
    broken["spec"]["trainer"]["numNode"] = broken["spec"]["trainer"].pop("numNodes")
    broken["spec"]["trainer"]["command"] = "torchrun examples/gpt2.py"
    crd = json.loads(gzip.decompress((CRDS / "trainjobs.json.gz").read_bytes()))
    assert sorted(undefined(broken, crd["schema"])) == [
        ".spec.trainer.command: str where the CRD has array",
        ".spec.trainer.numNode: not a field",
    ]
    runtime, job, jobset = checked["runtime"], checked["trainjob"], checked["jobset"]
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == job["spec"]["trainer"]["command"]
    # SIGKILL comes terminationGracePeriodSeconds after SIGTERM: the trainer's own grace ends before it.
    command = container["command"]
    grace = float(command[command.index("--preemption-grace-s") + 1])
    runtime_pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert grace < pod["terminationGracePeriodSeconds"] == runtime_pod["terminationGracePeriodSeconds"]
    assert "/outputs" in {mount["mountPath"] for mount in container["volumeMounts"]}
    assert {var["name"] for var in container["env"]} >= {f"PET_{v}" for v in ("NNODES", "NPROC_PER_NODE", "NODE_RANK")}


def pods(command: list[str], output_dir: Path, port: str, log) -> list[subprocess.Popen]:
    """The manifest's command in two "pods" on loopback, with the PET_* variables Kubeflow's torch runtime sets:
    its script swapped for tests/jobs/scenarios.py's `resume` job (2 processes in all, 18 steps, 0.3 s each)."""
    assert command[:2] == ["torchrun", "examples/gpt2.py"]
    job = ["torchrun", str(SCENARIOS), "resume", "--output_dir", str(output_dir), "--step_sleep", "0.3"]
    started = []
    for rank in (0, 1):
        pet = dict(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(rank), PET_MASTER_ADDR="127.0.0.1")
        env = clean_env(**pet, PET_MASTER_PORT=port, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
        started.append(subprocess.Popen(job, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    return started


def test_the_jobs_command_under_pet_variables_is_evicted_and_restarted_bit_identically(tmp_path, reference):  # noqa: F811
    """Eviction as Kubernetes does it: SIGTERM to each pod's first process (torchrun's agent), SIGKILL to whatever
    is left after the grace period (60 s here, a margin a busy machine cannot use up); the agents' workers
    checkpoint the step they agreed on and exit 75. The restarted pods resume there, and the job ends with the
    weights of the run never evicted."""
    command = manifest("trainjob")["spec"]["trainer"]["command"]
    log = tempfile.TemporaryFile("w+")
    agents = pods(command, tmp_path, str(free_port()), log)
    deadline = time.monotonic() + 300
    while "step 6/" not in (log.seek(0) or log.read()) and time.monotonic() < deadline:
        assert all(agent.poll() is None for agent in agents), log.read()[-3000:]
        time.sleep(0.2)
    for agent in agents:
        agent.send_signal(signal.SIGTERM)
    evicted = time.monotonic()
    for agent in agents:
        try:
            agent.wait(timeout=max(0.1, GRACE_S - (time.monotonic() - evicted)))
        except subprocess.TimeoutExpired:
            agent.kill()  # the grace period is over
            agent.wait()
    seconds = time.monotonic() - evicted
    log.seek(0)
    output = log.read()
    assert "trainer: preempted (SIGTERM) at step " in output, output[-3000:]
    step = int(output.split("trainer: preempted (SIGTERM) at step ")[1].split()[0])
    assert (tmp_path / "checkpoints" / "latest").read_text() == f"step-{step:08d}"
    assert seconds < GRACE_S, f"{seconds:.1f} s: the pods outlived their grace period"
    print(f"evicted: preempted at step {step}, the pods gone {seconds:.1f} s after SIGTERM")
    log = tempfile.TemporaryFile("w+")
    restarted = pods(command, tmp_path, str(free_port()), log)
    assert [agent.wait(timeout=300) for agent in restarted] == [0, 0], (log.seek(0) or log.read())[-3000:]
    log.seek(0)
    assert f"step {step}" in log.read()
    assert_bit_identical(final_weights(reference), final_weights(tmp_path))


def test_a_checkpoint_slower_than_the_grace_is_said_once(tmp_path):
    """A pod's SIGKILL comes terminationGracePeriodSeconds after SIGTERM, and the trainer exits preemption_grace_s
    after it: a checkpoint that takes longer than that grace would be cut off in a preemption. Said at the first
    such save, once."""
    script = f"""
import time, torch, trainer as t
from trainer.checkpoint import store
commit = store.commit
store.commit = lambda *a, **kw: (time.sleep(1.2), commit(*a, **kw))[1]  # a slow disk: 1.2 s a commit
config = t.TrainConfig(output_dir=r"{tmp_path}", batch_size=2, max_steps=3, save_every=1, preemption_grace_s=1)
t.Trainer(torch.nn.Linear(2, 1), config, [{{"x": torch.ones(2), "y": torch.ones(1)}}] * 8,
          loss_fn=lambda model, batch: ((model(batch["x"]) - batch["y"]) ** 2).mean()).fit()
"""
    result = run([sys.executable, "-c", script], env=clean_env())
    said = [line for line in result.stderr.splitlines() if "longer than preemption_grace_s (1 s)" in line]
    assert len(said) == 1 and said[0].startswith("trainer: a checkpoint took "), result.stderr[-2000:]
    assert "terminationGracePeriodSeconds" in said[0]
