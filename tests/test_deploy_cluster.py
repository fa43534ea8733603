"""deploy/ray, deploy/kuberay, deploy/systemd, the compose file and the image: checked with the tools at hand
(Ray's own cluster-config validation, the real `onestream serve` argument parser, systemd-analyze)."""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def kuberay_objects() -> dict[str, dict[str, Any]]:
    """kind -> object, over every manifest of deploy/kuberay/."""
    objects: dict[str, dict[str, Any]] = {}
    for path in sorted((DEPLOY / "kuberay").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            assert document["kind"] not in objects, f"two {document['kind']} objects"
            assert K8S_NAME.fullmatch(document["metadata"]["name"]), path
            objects[document["kind"]] = document
    return objects


def serve_arguments(command: str) -> list[str]:
    """The arguments after `onestream serve` in a shell command line."""
    words = shlex.split(command)
    start = next(i for i, w in enumerate(words) if w.endswith("onestream") and words[i + 1] == "serve")
    arguments = []
    for word in words[start + 2 :]:
        if word in {">", "2>&1", "<", "&", "&&", ";"} or word.startswith(("$", ">")):
            break
        arguments.append(word)
    return arguments


def parse_serve(arguments: list[str]) -> Any:
    """Parse with the real `onestream serve` parser: the deploy files must name flags it has."""
    from onestream.cli import build_parser

    return build_parser(only="serve").parse_args(["serve", *arguments])


def serve_would_start(args: Any, tmp_path: Path) -> None:
    """`serve`'s own checks pass with these arguments, the key file they name stood in for by a valid one:
    a pool open to its agents (HTTP and gRPC beyond loopback) that asks them for keys."""
    from onestream.commands.serve import users_problem

    assert args.api_keys, "a deployed router listens beyond loopback, so it needs --api-keys"
    keys = tmp_path / "api-keys"
    keys.write_text("0123456789abcdef0123 alice\n")
    args.api_keys = str(keys)
    assert users_problem(args) is None
    for listener in (args.listen, args.http):
        assert listener.startswith("0.0.0.0:"), "agents reach the router from other machines"


# ---- Ray cluster launcher -------------------------------------------------------------------------


def test_ray_cluster_config_passes_rays_own_validation() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    assert config["provider"]["type"] == "local"
    assert config["provider"]["head_ip"] and len(config["provider"]["worker_ips"]) == 2
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    (node_type,) = prepared["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == 2  # every listed box stays


def test_ray_cluster_starts_the_pool_on_the_head(tmp_path: Path) -> None:
    config = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    (serve,) = [c for c in config["head_start_ray_commands"] if "onestream serve" in c]
    args = parse_serve(serve_arguments(serve))
    assert args.address == "auto" and args.metrics == "0.0.0.0:9400"
    assert args.api_keys in config["file_mounts"], "the key file is copied to the head"
    serve_would_start(args, tmp_path)
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c for c in config["worker_start_ray_commands"])
    assert any("pip install" in c and "[gpu]" in c for c in config["setup_commands"])


# ---- KubeRay --------------------------------------------------------------------------------------


def test_raycluster_has_a_cpu_head_and_a_gpu_worker_group() -> None:
    cluster = kuberay_objects()["RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1"
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    (worker,) = group["template"]["spec"]["containers"]
    gpus = worker["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) >= 1 and worker["resources"]["requests"]["nvidia.com/gpu"] == gpus
    for spec in (head["template"]["spec"], group["template"]["spec"]):
        for container in spec["containers"]:
            names = [p["name"] for p in container.get("ports", [])]
            assert len(names) == len(set(names)) and all(
                len(n) <= 15 and K8S_NAME.fullmatch(n) for n in names
            )


def test_router_container_runs_onestream_serve(tmp_path: Path) -> None:
    head = kuberay_objects()["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]
    (router,) = [c for c in head["containers"] if c["name"] == "router"]
    assert router["command"] == ["onestream", "serve"]
    args = parse_serve(router["args"])
    assert args.address == "127.0.0.1:6379"
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert args.listen.endswith(f":{ports['grpc']}")
    assert args.http.endswith(f":{ports['http']}")
    assert args.metrics.endswith(f":{ports['router-metrics']}")
    mounts = {m["name"]: m["mountPath"] for m in router["volumeMounts"]}
    assert mounts["ray-tmp"] == "/tmp/ray", "the router needs the head's Ray session sockets"
    assert Path(args.api_keys).parent == Path(mounts["api-keys"])
    volumes = {v["name"]: v for v in head["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "onestream-api-keys"
    serve_would_start(args, tmp_path)


def test_service_podmonitor_and_scrapeconfig_meet_the_pods() -> None:
    objects = kuberay_objects()
    cluster, service = objects["RayCluster"], objects["Service"]
    head = cluster["spec"]["headGroupSpec"]["template"]
    head_ports = {p["name"] for c in head["spec"]["containers"] for p in c.get("ports", [])}
    assert service["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= head_ports

    monitor = objects["PodMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"
    for group in [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]:
        ports = {
            p["name"]: p["containerPort"]
            for c in group["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        }
        assert str(ports["metrics"]) == group["rayStartParams"]["metrics-export-port"]

    scrape = objects["ScrapeConfig"]
    (sd,) = scrape["spec"]["httpSDConfigs"]
    metrics_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "metrics")
    assert sd["url"] == f"http://{service['metadata']['name']}:{metrics_port}/sd"


def test_scrapeconfig_relabels_like_prometheus_yml() -> None:
    """Kubernetes and plain Prometheus must produce the same labels: the alert rules rely on them."""
    scrape = kuberay_objects()["ScrapeConfig"]["spec"]
    (job,) = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    assert scrape["honorLabels"] is job["honor_labels"] is True

    def snake(rule: dict[str, Any]) -> dict[str, Any]:
        return {re.sub(r"([A-Z])", r"_\1", k).lower(): v for k, v in rule.items()}

    job_label, *rest = map(snake, scrape["relabelings"])
    assert job_label == {"target_label": "job", "replacement": job["job_name"]}
    assert rest == job["relabel_configs"]


def test_image_ray_version_is_the_clusters() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    (version,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", dockerfile, flags=re.MULTILINE)
    assert kuberay_objects()["RayCluster"]["spec"]["rayVersion"] == version
    for source in re.findall(r"^COPY --chown=\S+ (\S+) ", dockerfile, flags=re.MULTILINE):
        assert (ROOT / source).exists(), source


# ---- systemd --------------------------------------------------------------------------------------

UNITS = sorted((DEPLOY / "systemd").glob("*.service"))


def test_serve_unit_runs_onestream_serve(tmp_path: Path) -> None:
    text = (DEPLOY / "systemd" / "onestream-serve.service").read_text()
    (exec_start,) = re.findall(r"^ExecStart=(.+)$", text, flags=re.MULTILINE)
    args = parse_serve(serve_arguments(exec_start))
    assert args.address == "auto" and args.metrics == "0.0.0.0:9400"
    assert "Requires=onestream-ray-head.service" in text
    assert "ExecReload=/bin/kill -HUP $MAINPID" in text, "a reload re-reads the key file"
    serve_would_start(args, tmp_path)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_units_pass_systemd_analyze() -> None:
    result = subprocess.run(
        ["systemd-analyze", "verify", *map(str, UNITS)], capture_output=True, text=True, timeout=60
    )
    # The binaries live in the pool's venv on the real boxes, not here; anything else is a defect.
    problems = [
        line for line in (result.stdout + result.stderr).splitlines() if "is not executable" not in line
    ]
    assert not problems, problems
