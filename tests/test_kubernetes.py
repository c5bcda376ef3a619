"""deploy/kubernetes validated offline (issue 37 item 3): core objects (Service, Deployment, ... and the pod
templates inside the custom resources) with kubernetes-validate's bundled schemas in strict mode; LeaderWorkerSet and
JobSet against their CRDs' OpenAPI schemas kept in deploy/kubernetes/schemas (each names its source), made strict as
an API server with strict field validation reads them (an unknown field is an error, not pruned); every hsdp
command line they hold parses with hsdp's own parser. The Helm chart needs helm to render, which is not installed
here: its templates are not checked (docs/clusters.md says so)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(FOLDER.glob("*.yaml"))
KUBERNETES = "1.33.0"
"""The Kubernetes version whose schemas the core objects are checked against (LWS and JobSet need >= 1.27)."""


def _crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the CRD's openAPIV3Schema, strict."""
    schemas = {}
    for path in (FOLDER / "schemas").glob("*.json"):
        crd = json.loads(path.read_text())
        assert crd["source"].startswith("https://github.com/kubernetes-sigs/"), path
        schemas[(f"{crd['group']}/{crd['version']}", crd["kind"])] = _strict(crd["openAPIV3Schema"])
    return schemas


def _strict(node):
    """Unknown fields refused wherever the schema lists an object's fields (and keeps no unknown ones on purpose)."""
    if isinstance(node, list):
        return [_strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def _pod_templates(node, path=""):
    """Every pod template (a mapping with a ``spec.containers`` list) inside a custom resource, with its path."""
    if isinstance(node, dict):
        if isinstance(node.get("spec"), dict) and "containers" in node["spec"]:
            yield path, node
            return
        for key, value in node.items():
            yield from _pod_templates(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _pod_templates(value, f"{path}[{i}]")


def _problems(doc: dict, crds: dict) -> list[str]:
    key = (doc["apiVersion"], doc["kind"])
    if key in crds:
        validator = jsonschema.Draft7Validator(crds[key])
        found = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
        for where, template in _pod_templates(doc.get("spec", {}), "spec"):
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
            found += [f"{where}: {p}" for p in _problems(wrapped, crds)]
        return found
    try:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(map(str, exc.path))}: {exc.message}"]
    return []


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_is_valid_against_its_schemas(path):
    crds = _crd_schemas()
    docs = _documents(path)
    assert docs
    for doc in docs:
        assert _problems(doc, crds) == [], f"{path.name}: {doc['kind']} {doc['metadata']['name']}"


def test_a_misspelt_field_is_refused_in_a_custom_resource_and_in_its_pod_template():
    """The checks can fail: a field the schema does not list, at the resource's level and in a container; a core
    object's field of the wrong type."""
    crds = _crd_schemas()
    (lws, service) = _documents(FOLDER / "leaderworkerset-serve.yaml")
    lws["spec"]["leaderWorkerTemplate"]["restartPolicys"] = "None"
    assert any("restartPolicys" in p for p in _problems(lws, crds))
    service["spec"]["ports"][0]["port"] = "eight thousand"
    assert _problems(service, crds)
    (jobset,) = _documents(FOLDER / "jobset-train.yaml")
    container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    container["comand"] = ["x"]
    assert any("comand" in p for p in _problems(jobset, crds))


def _hsdp_commands(doc: dict):
    """The hsdp argument lists inside a manifest's shell command lines (after ``-m hsdp.cli``)."""
    for _, template in _pod_templates(doc.get("spec", {})):
        for container in template["spec"]["containers"]:
            line = " ".join(container.get("command", []) + container.get("args", []))
            if "hsdp.cli" in line:
                words = shlex.split(line.split("-m hsdp.cli", 1)[1])
                yield [w if not w.startswith("$") else "0" for w in words]


@pytest.mark.parametrize("name", ["leaderworkerset-serve.yaml", "jobset-train.yaml"])
def test_the_hsdp_command_lines_parse(name):
    from hsdp.cli import build_parser

    commands = [argv for doc in _documents(FOLDER / name) for argv in _hsdp_commands(doc)]
    assert commands
    for argv in commands:
        build_parser(argv[0]).parse_args(argv)  # a misspelt or unknown flag exits 2
    with pytest.raises(SystemExit):
        build_parser(commands[0][0]).parse_args([*commands[0], "--no-such-flag"])
