#!/usr/bin/env python3
"""Strict validation of rendered Kubernetes manifests (multi-document YAML files).

Built-in kinds are checked by kubernetes-validate against the Kubernetes 1.30 OpenAPI schemas in
strict mode (unknown fields, wrong types and missing required fields are errors): the same check
as `kubernetes-validate --strict -k 1.30`, called as a library so that custom resources can be
routed elsewhere instead of ending in a "no schema" warning.

Custom resources (ServiceMonitor of the Prometheus Operator, ScaledObject of KEDA) have no schema
there. They are checked against their own CRDs' schemas, as generated into the pydantic models of
the cloudcoil-models-prometheus-operator and cloudcoil-models-keda packages: the model must
accept the document (types, required fields, enums), and every field of the document must
survive a round trip through the model, which drops what the CRD does not define; so an unknown
field is an error here too, as with `kubectl apply --validate=strict`.

Any other kind fails: nothing passes unchecked. `--self-test` first proves that both paths reject
an unknown field.

Usage: validate.py [--self-test] RENDERED.yaml...
"""

import copy
import sys

import kubernetes_validate
import yaml
from cloudcoil.models.keda import v1alpha1 as keda
from cloudcoil.models.prometheus_operator import v1 as monitoring

KUBERNETES_VERSION = "1.30"

# (apiVersion, kind) of each custom resource Tern's manifests use, and the model of its CRD.
CUSTOM = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): monitoring.ServiceMonitor,
    ("keda.sh/v1alpha1", "ScaledObject"): keda.ScaledObject,
}


def unknown_fields(given, kept, path):
    """Paths of `given` that the model's dump `kept` lost: fields the schema does not define."""
    if isinstance(given, dict):
        if not isinstance(kept, dict):
            return [path or "."]
        lost = []
        for key, value in given.items():
            if key not in kept:
                lost.append(f"{path}.{key}")
            else:
                lost.extend(unknown_fields(value, kept[key], f"{path}.{key}"))
        return lost
    if isinstance(given, list):
        if not isinstance(kept, list) or len(kept) != len(given):
            return [path]
        lost = []
        for i, (g, k) in enumerate(zip(given, kept)):
            lost.extend(unknown_fields(g, k, f"{path}[{i}]"))
        return lost
    return []


def check(doc):
    """An error message for one document, or None when it is valid."""
    if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
        return "not a Kubernetes object (no apiVersion or kind)"
    model = CUSTOM.get((doc["apiVersion"], doc["kind"]))
    if model is not None:
        try:
            parsed = model.model_validate(doc)
        except Exception as e:  # pydantic's ValidationError, said in full
            return f"invalid against the {doc['kind']} CRD schema: {e}"
        kept = parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)
        lost = unknown_fields(doc, kept, "")
        if lost:
            return f"unknown field(s) for the {doc['kind']} CRD schema: {', '.join(lost)}"
        return None
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError as e:
        return f"no schema to check it against ({e.message}); add its CRD model to CUSTOM"
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path) or "."
        return f"invalid against Kubernetes {KUBERNETES_VERSION} (strict) at {where}: {e.message}"
    return None


def name_of(doc):
    if isinstance(doc, dict):
        return f"{doc.get('kind', '?')}/{(doc.get('metadata') or {}).get('name', '?')}"
    return "?"


def self_test():
    """Both paths must refuse a misspelt field, or the check proves nothing."""
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "t"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
        },
    }
    monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "t"},
        "spec": {"selector": {"matchLabels": {"a": "b"}}, "endpoints": [{"port": "admin"}]},
    }
    scaled = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "t"},
        "spec": {"scaleTargetRef": {"name": "d"}, "triggers": [{"type": "prometheus", "metadata": {"query": "1"}}]},
    }
    failures = []
    for good, field_path in [
        (deployment, ["spec", "template", "spec", "containers", 0]),
        (monitor, ["spec", "endpoints", 0]),
        (scaled, ["spec", "scaleTargetRef"]),
    ]:
        if check(good) is not None:
            failures.append(f"self-test: a valid {good['kind']} was refused: {check(good)}")
        bad = copy.deepcopy(good)
        node = bad
        for step in field_path:
            node = node[step]
        node["imagePullPolicyy"] = "Always"
        if check(bad) is None:
            failures.append(f"self-test: a {good['kind']} with an unknown field passed")
    if check({"apiVersion": "example.com/v1", "kind": "Unknown", "metadata": {"name": "t"}}) is None:
        failures.append("self-test: a kind with no schema passed")
    return failures


def main(argv):
    files = [a for a in argv if a != "--self-test"]
    failures = self_test() if "--self-test" in argv else []
    checked = 0
    for path in files:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
        if not docs:
            failures.append(f"{path}: no objects rendered")
        for doc in docs:
            checked += 1
            error = check(doc)
            if error:
                failures.append(f"{path}: {name_of(doc)}: {error}")
    for failure in failures:
        print(failure, file=sys.stderr)
    print(f"validated {checked} objects in {len(files)} file(s): {len(failures)} problem(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
