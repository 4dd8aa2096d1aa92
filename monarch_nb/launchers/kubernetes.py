"""Kubernetes: the manifest of a mesh's host agents. There is no cluster client here:
``k8s_manifest`` writes an indexed Job (one pod per node, each a host agent that
forks ``ranks_per_node`` ranks, its block of ranks its completion index) and a
headless Service (stable pod names for the ranks' own connections), and the key
comes from a Secret made from the mesh's connection file, which ``connect_mesh``
writes and ``kubectl create secret`` uploads. Pure: it builds dicts, and YAML.
"""

from __future__ import annotations

import re

MOUNT = "/etc/monarch-nb"  # where the Secret's connection file is mounted in each pod
FILE_KEY = "connection.json"  # the Secret's key that holds it
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?$")  # a DNS label, room for suffixes


def _positive(what: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"k8s_manifest: {what} must be a positive int, got {n!r}")
    return n


def manifest_objects(
    nodes, ranks_per_node, image, name, namespace, secret, gpus, cpus, env, heartbeat_timeout
) -> list[dict]:
    """The Service and the Job, as dicts (``k8s_manifest`` documents the arguments)."""
    _positive("nodes", nodes)
    _positive("ranks_per_node", ranks_per_node)
    if gpus is not None:
        _positive("gpus", gpus)
        if gpus < ranks_per_node:
            raise ValueError(
                f"k8s_manifest: ranks_per_node={ranks_per_node} is more than the "
                f"gpus={gpus} each node gets (a rank per GPU)"
            )
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"k8s_manifest: name {name!r} is not a DNS label (lowercase letters, digits "
            "and '-', at most 52 characters, a letter or digit at each end)"
        )
    if not isinstance(image, str) or not image.strip():
        raise ValueError("k8s_manifest: image names the container image with monarch_nb and torch")
    secret = secret or f"{name}-connection"
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    labels = {"app.kubernetes.io/name": "monarch-nb", "monarch-nb/mesh": name}
    command = [
        "monarch-nb-host", "--connection-file", f"{MOUNT}/{FILE_KEY}",
        "--local-ranks", str(ranks_per_node), "--node-rank", "$(JOB_COMPLETION_INDEX)",
    ]  # fmt: skip
    if heartbeat_timeout is not None:
        command += ["--heartbeat-timeout", str(heartbeat_timeout)]
    # the index as a variable of the container itself, so that $(...) in the command
    # expands on every Kubernetes version (the Job controller adds it on recent ones)
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    variables = [{"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"fieldPath": index}}}]
    variables += [{"name": str(k), "value": str(v)} for k, v in (env or {}).items()]
    resources: dict = {"requests": {"cpu": str(cpus or ranks_per_node)}}
    if gpus:
        resources["limits"] = {"nvidia.com/gpu": str(gpus)}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {**meta, "labels": labels},
        "spec": {"clusterIP": "None", "selector": {"monarch-nb/mesh": name}},
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {**meta, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": nodes,
            "parallelism": nodes,
            "backoffLimit": 0,  # a lost node fails its ranks; the mesh says which
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "subdomain": name,  # pods are NAME-I.NAME: the headless Service
                    "restartPolicy": "Never",
                    "containers": [{
                        "name": "host-agent",
                        "image": image,
                        "command": command,
                        "env": variables,
                        "resources": resources,
                        "volumeMounts": [{"name": "connection", "mountPath": MOUNT, "readOnly": True}],
                    }],
                    "volumes": [{
                        "name": "connection",
                        "secret": {"secretName": secret, "defaultMode": 0o400},
                    }],
                },
            },
        },
    }  # fmt: skip
    return [service, job]


def secret_command(secret: str, connection_file: str, namespace: str | None = None) -> str:
    """The kubectl line that makes the Secret from the mesh's connection file."""
    ns = f" -n {namespace}" if namespace else ""
    return f"kubectl{ns} create secret generic {secret} --from-file={FILE_KEY}={connection_file}"


def k8s_manifest(
    path: str | None = None,
    *,
    nodes: int,
    ranks_per_node: int,
    image: str,
    name: str = "monarch-nb",
    namespace: str | None = None,
    secret: str | None = None,
    gpus: int | None = None,
    cpus: int | None = None,
    env: dict | None = None,
    heartbeat_timeout: float | None = None,
) -> str:
    """The Kubernetes manifest of a mesh's host agents, as YAML (written to ``path``
    too when given): a headless Service ``name`` and an indexed Job ``name`` of
    ``nodes`` pods, each running ``monarch-nb-host --connection-file ...
    --local-ranks ranks_per_node --node-rank $(JOB_COMPLETION_INDEX)`` in ``image``
    (which has this monarch_nb release and torch), with ``gpus`` GPUs (a rank each)
    and ``cpus`` CPUs (default ``ranks_per_node``) per pod and ``env`` set. The
    mesh's connection file (its address and key) comes from the Secret ``secret``
    (default ``NAME-connection``), mounted read-only: make it from the file that
    ``connect_mesh(world=nodes * ranks_per_node, interface="0.0.0.0",
    connection_file=F)`` writes with ``kubectl create secret generic SECRET
    --from-file=connection.json=F``, then ``kubectl apply -f`` the manifest."""
    options = {k: v for k, v in locals().items() if k != "path"}  # the keywords, as given
    import yaml

    objects = manifest_objects(**options)
    text = yaml.safe_dump_all(objects, sort_keys=False)
    if path is not None:
        with open(path, "w") as f:
            f.write(text)
    return text
