"""mnb.k8s_manifest: the indexed Job and headless Service of a mesh's host agents.
No cluster here: the objects are checked offline against the Kubernetes API schema
(kubernetes-validate), and each pod's command runs as written, with the completion
index and the Secret's mount a kubelet would give it, against a real connect_mesh."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from connect_helpers import TESTS_ENV, Waiting, wait_file

import monarch_nb as mnb
from monarch_nb.launchers.kubernetes import FILE_KEY, MOUNT, secret_command


def _kubernetes_validate():
    """The module, imported by the one test that uses it (1.5 s: not at every collection)."""
    return pytest.importorskip("kubernetes_validate")


@pytest.mark.unit
def test_the_manifest_is_valid_for_the_kubernetes_api(tmp_path):
    path = tmp_path / "mesh.yaml"
    text = mnb.k8s_manifest(
        str(path), nodes=4, ranks_per_node=8, image="ghcr.io/me/train:1", name="llm",
        namespace="ml", gpus=8, env={"NCCL_DEBUG": "WARN"}, heartbeat_timeout=30,
    )  # fmt: skip
    assert path.read_text() == text
    service, job = yaml.safe_load_all(text)
    kv = _kubernetes_validate()
    for obj in (service, job):
        for version in ["1.27.0", "1.30.0", kv.utils.latest_version()]:
            kv.validate(obj, version, strict=True)  # raises on any schema error
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 4, 4)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "llm" and service["metadata"]["name"] == "llm"
    (c,) = pod["containers"]
    assert c["command"] == [
        "monarch-nb-host", "--connection-file", f"{MOUNT}/{FILE_KEY}", "--local-ranks", "8",
        "--node-rank", "$(JOB_COMPLETION_INDEX)", "--heartbeat-timeout", "30",
    ]  # fmt: skip
    assert c["resources"] == {"requests": {"cpu": "8"}, "limits": {"nvidia.com/gpu": "8"}}
    assert pod["volumes"][0]["secret"]["secretName"] == "llm-connection"
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in c["env"]


@pytest.mark.unit
def test_bad_arguments_are_named():
    ok = {"nodes": 2, "ranks_per_node": 2, "image": "img"}
    for bad, pattern in [
        ({"nodes": 0}, "nodes must be a positive int"),
        ({"ranks_per_node": True}, "ranks_per_node must be a positive int"),
        ({"name": "My_Mesh"}, "is not a DNS label"),
        ({"image": " "}, "image names the container image"),
        ({"gpus": 1}, "ranks_per_node=2 is more than the gpus=1"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            mnb.k8s_manifest(**{**ok, **bad})


def test_each_pods_command_joins_a_real_mesh_as_written(tmp_path):
    # the pods' command, run as a kubelet would: $(JOB_COMPLETION_INDEX) expanded from
    # the pod's index, the Secret's connection file at the mount path (here: its dir)
    conn = tmp_path / "secret" / FILE_KEY
    conn.parent.mkdir()
    text = mnb.k8s_manifest(nodes=2, ranks_per_node=2, image="img", name="kube-test")
    (c,) = list(yaml.safe_load_all(text))[1]["spec"]["template"]["spec"]["containers"]
    waiting = Waiting(world=4, connection_file=str(conn), name="kube-test", hosts=2, gpus=2)
    wait_file(conn)
    assert secret_command("kube-test-connection", str(conn)) == (
        f"kubectl create secret generic kube-test-connection --from-file={FILE_KEY}={conn}"
    )
    pods = []
    try:
        for index in (1, 0):
            args = [a.replace("$(JOB_COMPLETION_INDEX)", str(index)) for a in c["command"]]
            args = [a.replace(MOUNT, str(conn.parent)) for a in args]
            assert args[0] == "monarch-nb-host"  # the console script; here through this Python
            cmd = [sys.executable, "-m", "monarch_nb.host", *args[1:]]
            pods.append(subprocess.Popen(cmd, env=TESTS_ENV, stderr=subprocess.PIPE, text=True))
        mesh = waiting.mesh(timeout=180)
        try:
            hosts = mnb.remote(_where)(mesh=mesh).fetch(timeout=60)
            # pod I forks ranks 2I and 2I+1: the node rank is the completion index
            assert [h[0] for h in hosts] == [0, 1, 2, 3]
            assert hosts[0][1] == hosts[1][1] != hosts[2][1] == hosts[3][1]
            assert _parent_chain(hosts[2][2], pods[0].pid) and _parent_chain(hosts[0][2], pods[1].pid)
        finally:
            mesh.shutdown()
    finally:
        for p in pods:
            p.kill()
            p.wait(30)


def _where():
    import os

    return int(os.environ["RANK"]), os.getppid(), os.getpid()


def _parent_chain(pid: int, ancestor: int) -> bool:
    import psutil

    try:
        return any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False

