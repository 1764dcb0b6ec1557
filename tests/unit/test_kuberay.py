"""configs/kuberay/rayservice.yaml is a RayService the KubeRay release it targets accepts, running
serve_config.yaml's application.

There is no Kubernetes cluster here, so what ``kubectl apply`` and the operator would check is
checked against their own definitions, kept in the repository:

* **The CRD's schema.** Every RayService document is validated against the ``openAPIV3Schema``
  of ``configs/kuberay/crd/ray.io_rayservices.<version>.yaml`` (copied unchanged from the KubeRay
  release), read the way the API server reads it: defaults are applied before validation (so a
  required field with a default, such as ``minReplicas``, may be left out); an unknown field is
  an error, as with ``kubectl apply``'s default strict field validation (the server would
  otherwise drop it silently, and a misspelled field would do nothing); ``nullable`` admits
  null; ``x-kubernetes-int-or-string`` is its ``anyOf`` integer or string, the quantity pattern
  applying to strings; ``format: int32``/``int64`` bound integers; ``x-kubernetes-list-type``
  ``set`` and ``map`` reject duplicates (by the list-map keys); ``x-kubernetes-preserve-unknown-fields``
  lets unknown fields through. CEL rules (``x-kubernetes-validations``) are not evaluated here:
  a field carrying one is reported as an error when set, so a manifest cannot pass on a rule
  nobody checked. The ``metadata`` of a custom resource is checked by the API server itself, not
  this schema: its name is checked below with KubeRay's rule.
* **KubeRay's own checks** that the operator makes when it reconciles (``utils/validation.go``
  of that release): the ones this manifest could break.
* **The application.** ``serveConfigV2`` passes Ray Serve's own ``ServeDeploySchema``, names the
  same application, import path and args as serve_config.yaml (the keys Kubernetes must change
  are listed, with why, in `K8S_ARGS`; every other value must be equal), names every deployment
  the builder really binds (the graph is built here, without a cluster), keeps the CPUs the code
  gives each (Serve takes ``ray_actor_options`` from the config whole) and asks for a GPU for the
  model; the ConfigMap's policy parses with `policies.config.load_policy` and is the deployed one.
* **Negative cases.** Broken manifests (a misspelled field under ``spec``, wrong types, a bad
  quantity, a missing required field...) are rejected with the field named, so the check can fail.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml
from jsonschema import Draft4Validator, ValidationError
from ray.serve.schema import DeploymentSchema, RayActorOptionsSchema, ServeDeploySchema

from policies.config import DEFAULT_POLICY_PATH, load_policy, parse_policy
from policies.slo import fit_policy

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "configs" / "kuberay"
MANIFEST = KUBERAY / "rayservice.yaml"
PODMONITOR = KUBERAY / "podmonitor.yaml"
DOCKERFILE = KUBERAY / "Dockerfile"
KUBERAY_VERSION = "v1.7.0"
CRD_FILE = KUBERAY / "crd" / f"ray.io_rayservices.{KUBERAY_VERSION}.yaml"
SERVE_CONFIG = ROOT / "serve_config.yaml"
MODEL = "VLLMModel"

# The builder args that Kubernetes changes, and why; every other arg must equal serve_config.yaml's.
K8S_ARGS: Mapping[str, str] = {
    "model.source": "a Hugging Face id downloaded on the GPU worker (or a mounted model folder); "
    "embedded:tiny is the CPU demo model",
    "model.served_model_name": "the API's name of that model",
    "enrichments.data_dir": "the head's state volume (audit log, deferred spool, SQLite)",
    "auth.keys_file": "the brownout-auth Secret, mounted on the head",
    "auth.admin_token_file": "the brownout-auth Secret, mounted on the head",
}

# Builder args only the RayService has (every key under them), and why.
K8S_ADDED_ARGS: Mapping[str, str] = {
    "model.autoscaling": "model replicas follow the load; KubeRay's autoscaler adds a GPU pod for each "
    "(the local demo has one CPU engine)",
}

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# --- the CRD's schema, read as the API server reads it ----------------------------------------

@functools.cache
def crd() -> dict[str, Any]:
    return yaml.load(CRD_FILE.read_text(encoding="utf-8"), Loader=_Loader)


def served_versions() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in crd()["spec"]["versions"] if v.get("served")}


def to_json_schema(node: Any) -> Any:
    """A Kubernetes structural schema node as JSON Schema (draft 4) with the rules the module
    docstring lists; the ``x-kubernetes-*`` keys are kept for `_list_type` and `_cel`."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if k != "properties"}
    if "properties" in node:
        out["properties"] = {name: to_json_schema(sub) for name, sub in node["properties"].items()}
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if node.get("x-kubernetes-int-or-string") and "type" not in node and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and isinstance(node.get("type"), str):
        out["type"] = [node["type"], "null"]
    return out


def apply_defaults(instance: Any, schema: Mapping[str, Any]) -> Any:
    """Fill in missing fields that have a ``default``, at every level, as the API server does
    before it validates."""
    if isinstance(instance, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in instance and "default" in sub:
                instance[name] = copy.deepcopy(sub["default"])
            if name in instance:
                apply_defaults(instance[name], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, value in instance.items():
                if name not in schema.get("properties", {}):
                    apply_defaults(value, extra)
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for item in instance:
            apply_defaults(item, schema["items"])
    return instance


def _list_type(validator: Any, kind: str, instance: Any, schema: Mapping[str, Any]) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "array"):
        return
    if kind == "set":
        seen: list[Any] = []
        for item in instance:
            if item in seen:
                yield ValidationError(f"duplicate entry {item!r} in a list of type set")
            seen.append(item)
    elif kind == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen_keys: set[tuple[Any, ...]] = set()
        for item in instance:
            key = tuple(repr(item.get(k)) for k in keys) if isinstance(item, dict) else (repr(item),)
            if key in seen_keys:
                yield ValidationError(f"duplicate entry for map keys {keys}: {dict(zip(keys, key))}")
            seen_keys.add(key)


def _cel(validator: Any, rules: list[dict[str, Any]], instance: Any, schema: Mapping[str, Any]) -> Iterator[ValidationError]:
    yield ValidationError(
        f"this field has CEL rules that are not evaluated here ({[r.get('rule') for r in rules]}): "
        "leave it unset or check the manifest against a cluster")


def _int_format(bits: int) -> Any:
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return lambda value: not isinstance(value, int) or isinstance(value, bool) or lo <= value <= hi


KubeValidator = jsonschema.validators.extend(
    Draft4Validator, {"x-kubernetes-list-type": _list_type, "x-kubernetes-validations": _cel})
FORMATS = jsonschema.FormatChecker(formats=())
FORMATS.checks("int32")(_int_format(32))
FORMATS.checks("int64")(_int_format(64))


@functools.cache
def schema(version: str = "v1") -> dict[str, Any]:
    converted = to_json_schema(served_versions()[version]["schema"]["openAPIV3Schema"])
    KubeValidator.check_schema(converted)
    return converted


def schema_errors(doc: Mapping[str, Any]) -> list[str]:
    """Every way ``doc`` fails the CRD's schema, as ``path: message``; [] when valid."""
    if doc.get("kind") != crd()["spec"]["names"]["kind"]:
        return [f"kind: {doc.get('kind')!r} is not {crd()['spec']['names']['kind']!r}"]
    group, _, version = str(doc.get("apiVersion", "")).partition("/")
    if group != crd()["spec"]["group"] or version not in served_versions():
        return [f"apiVersion: {doc.get('apiVersion')!r} is not served by this CRD "
                f"({[crd()['spec']['group'] + '/' + v for v in served_versions()]})"]
    s = schema(version)
    instance = apply_defaults(copy.deepcopy(dict(doc)), s)
    errors = KubeValidator(s, format_checker=FORMATS).iter_errors(instance)
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors)


# --- KubeRay's own checks at reconcile (v1.7.0 utils/validation.go, the ones that apply) ---------

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
QUALIFIED_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                            r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
MAX_RAYSERVICE_NAME = 47  # MaxRayClusterNameLength (53) - 6
RAY_START_RESOURCES = ("num-cpus", "num-gpus", "memory", "resources")


def operator_errors(doc: Mapping[str, Any]) -> list[str]:
    """What KubeRay v1.7.0's ValidateRayServiceMetadata / ValidateRayServiceSpec /
    ValidateRayClusterSpec would refuse in this manifest ([] when nothing)."""
    errors = []
    name = doc.get("metadata", {}).get("name", "")
    if len(name) > MAX_RAYSERVICE_NAME or not DNS1035.match(name):
        errors.append(f"metadata.name {name!r}: a DNS-1035 label of at most {MAX_RAYSERVICE_NAME} characters")
    spec = doc.get("spec", {})
    if spec.get("upgradeStrategy", {}).get("type") not in (None, "NewCluster", "NewClusterWithIncrementalUpgrade", "None"):
        errors.append(f"spec.upgradeStrategy.type {spec['upgradeStrategy']['type']!r} is not valid")
    cluster = spec.get("rayClusterConfig", {})
    head = cluster.get("headGroupSpec", {})
    if head.get("headService", {}).get("metadata", {}).get("name"):
        errors.append("headGroupSpec.headService.metadata.name should not be set")
    autoscaling = bool(cluster.get("enableInTreeAutoscaling"))
    groups = [("Head", head)] + [(g.get("groupName", "?"), g) for g in cluster.get("workerGroupSpecs", [])]
    for group, g in groups:
        if not g.get("template", {}).get("spec", {}).get("containers"):
            errors.append(f"{group}: the pod template needs at least one container")
        params = g.get("rayStartParams", {})
        if any(params.get(k) for k in RAY_START_RESOURCES) and g.get("resources"):
            errors.append(f"{group}: resources set both in rayStartParams and in resources")
        if "labels" in params:
            errors.append(f"{group}: rayStartParams['labels'] is not supported; use the labels field")
        for key, value in g.get("labels", {}).items():
            if not QUALIFIED_NAME.match(key) or len(key.rpartition("/")[2]) > 63:
                errors.append(f"{group}: invalid Ray label key {key!r}")
            if len(value) > 63 or not LABEL_VALUE.match(value):
                errors.append(f"{group}: invalid Ray label value {value!r} for {key!r}")
        if group == "Head":
            continue
        lo, hi = g.get("minReplicas"), g.get("maxReplicas")
        if not autoscaling and (lo is None or hi is None):
            errors.append(f"worker group {group}: minReplicas and maxReplicas must be set without autoscaling")
        if lo is not None and hi is not None and not 0 <= lo <= hi:
            errors.append(f"worker group {group}: needs 0 <= minReplicas ({lo}) <= maxReplicas ({hi})")
    return errors


# --- the manifests -------------------------------------------------------------------------

def manifest_documents(path: Path = MANIFEST) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def rayservices() -> list[dict[str, Any]]:
    return [d for d in manifest_documents() if d.get("kind") == "RayService"]


def the_rayservice() -> dict[str, Any]:
    (doc,) = rayservices()
    return doc


def serve_config_v2(doc: Mapping[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(doc["spec"]["serveConfigV2"])


def shipped() -> dict[str, Any]:
    return yaml.safe_load(SERVE_CONFIG.read_text(encoding="utf-8"))


def the_app(config: Mapping[str, Any]) -> dict[str, Any]:
    (app,) = config["applications"]
    return app


def deployments(app: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in app.get("deployments", [])}


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def groups(doc: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    cluster = doc["spec"]["rayClusterConfig"]
    return cluster["headGroupSpec"], cluster.get("workerGroupSpecs", [])


def ray_container(group: Mapping[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]  # KubeRay's Ray container is the first


def gpus(container: Mapping[str, Any]) -> dict[str, Any]:
    res = container.get("resources", {})
    return {kind: res.get(kind, {}).get("nvidia.com/gpu") for kind in ("requests", "limits")}


def mounts(group: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume mounted there, for the group's Ray container."""
    volumes = {v["name"]: v for v in group["template"]["spec"].get("volumes", [])}
    out = {}
    for m in ray_container(group).get("volumeMounts", []):
        # the Pod would be refused (KubeRay could not create it): the CRD's schema cannot see this
        assert m["name"] in volumes, f"volumeMount {m['mountPath']} names no volume {m['name']!r} of its pod"
        out[m["mountPath"]] = {**volumes[m["name"]], "mount": m}
    return out


def mount_holding(group: Mapping[str, Any], path: str) -> dict[str, Any] | None:
    for mount_path, volume in mounts(group).items():
        if path == mount_path or path.startswith(mount_path.rstrip("/") + "/"):
            return volume
    return None


def dockerfile_workdir() -> str:
    (workdir,) = re.findall(r"^WORKDIR\s+(\S+)", DOCKERFILE.read_text(encoding="utf-8"), re.M)
    return workdir


def built_graph(args: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Deployment name -> the ray_actor_options the code gives it, for the graph that
    serve_app.app.build_app binds from ``args``; built the way Serve builds it, with no cluster."""
    from ray.serve._private.build_app import build_app as serve_build

    from serve_app.app import build_app

    built = serve_build(build_app(dict(args)), name="brownout")
    return {d.name: dict(d.ray_actor_options or {}) for d in built.deployments}


# --- tests: the CRD and the schema check ---------------------------------------------------------

def test_the_crd_is_kubrays_rayservice_crd_of_the_release_named_in_its_file_and_readme() -> None:
    doc = crd()
    assert doc["kind"] == "CustomResourceDefinition" and doc["metadata"]["name"] == "rayservices.ray.io"
    assert "v1" in served_versions() and served_versions()["v1"].get("storage")
    readme = (CRD_FILE.parent / "README.md").read_text(encoding="utf-8")
    assert CRD_FILE.name in readme and KUBERAY_VERSION in readme and "ray-project/kuberay" in readme


def test_every_rayservice_in_the_manifest_is_valid_against_the_crd() -> None:
    docs = rayservices()
    assert docs, "rayservice.yaml holds no RayService"
    for doc in docs:
        assert schema_errors(doc) == [], doc["metadata"]["name"]
        assert operator_errors(doc) == [], doc["metadata"]["name"]


def _rename(d: dict[str, Any], old: str, new: str) -> None:
    d[new] = d.pop(old)


def _worker(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


def _head(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["rayClusterConfig"]["headGroupSpec"]


BROKEN: list[tuple[str, Any, str]] = [
    ("misspelled field under spec", lambda d: _rename(d["spec"], "serveConfigV2", "serveConfigv2"),
     r"^spec: .*'serveConfigv2' was unexpected"),
    ("misspelled field in the cluster config", lambda d: _rename(d["spec"]["rayClusterConfig"], "rayVersion", "rayversion"),
     r"^spec\.rayClusterConfig: .*'rayversion' was unexpected"),
    ("misspelled field in a container", lambda d: _rename(ray_container(_worker(d)), "imagePullPolicy", "imagePullPolicyy"),
     r"workerGroupSpecs\.0\.template\.spec\.containers\.0: .*'imagePullPolicyy' was unexpected"),
    ("replicas as a word", lambda d: _worker(d).update(replicas="one"),
     r"workerGroupSpecs\.0\.replicas: 'one' is not of type 'integer'"),
    ("a rayStartParams value that is not a string", lambda d: _head(d)["rayStartParams"].update({"num-gpus": 0}),
     r"headGroupSpec\.rayStartParams\.num-gpus: 0 is not of type 'string'"),
    ("serveConfigV2 as a mapping, not YAML text", lambda d: d["spec"].update(serveConfigV2=serve_config_v2(d)),
     r"^spec\.serveConfigV2: .* is not of type 'string'"),
    ("a GPU count that is not a quantity", lambda d: ray_container(_worker(d))["resources"]["limits"].update({"nvidia.com/gpu": "one"}),
     r"limits\.nvidia\.com/gpu: 'one' does not match"),
    ("a float where Kubernetes wants an int or a string", lambda d: ray_container(_head(d))["resources"]["limits"].update(cpu=0.5),
     r"limits\.cpu: 0\.5 is not valid under any of the given schemas"),
    ("the head's pod template left out", lambda d: _head(d).pop("template"),
     r"headGroupSpec: 'template' is a required property"),
    ("a worker group without a name", lambda d: _worker(d).pop("groupName"),
     r"workerGroupSpecs\.0: 'groupName' is a required property"),
    ("maxReplicas beyond int32", lambda d: _worker(d).update(maxReplicas=2 ** 31),
     r"workerGroupSpecs\.0\.maxReplicas: 2147483648 is not a 'int32'"),
    ("the same container port twice", lambda d: ray_container(_head(d))["ports"].append({"containerPort": 8000, "name": "serve2"}),
     r"containers\.0\.ports: duplicate entry for map keys \['containerPort', 'protocol'\]"),
    ("a field whose CEL rule is not evaluated here", lambda d: d["spec"].update(managedBy="someone"),
     r"^spec\.managedBy: this field has CEL rules that are not evaluated here"),
    ("apiVersion of another group", lambda d: d.update(apiVersion="ray.example.com/v1"),
     r"^apiVersion: 'ray\.example\.com/v1' is not served"),
]


@pytest.mark.parametrize(("change", "error"), [(c, e) for _, c, e in BROKEN], ids=[n for n, _, _ in BROKEN])
def test_a_broken_rayservice_is_rejected_naming_the_field(change: Any, error: str) -> None:
    doc = copy.deepcopy(the_rayservice())
    change(doc)
    errors = schema_errors(doc)
    assert any(re.search(error, e) for e in errors), errors


VALID_VARIANTS: list[tuple[str, Any]] = [
    ("cpu as an integer (int-or-string)", lambda d: ray_container(_head(d))["resources"]["limits"].update(cpu=4)),
    ("a GPU count as a string quantity", lambda d: ray_container(_worker(d))["resources"]["limits"].update({"nvidia.com/gpu": "1"})),
    ("min/max replicas left to their defaults", lambda d: [_worker(d).pop(k) for k in ("minReplicas", "maxReplicas")]),
    ("an empty rayStartParams", lambda d: _head(d).update(rayStartParams={})),
]


@pytest.mark.parametrize("change", [c for _, c in VALID_VARIANTS], ids=[n for n, _ in VALID_VARIANTS])
def test_spellings_kubernetes_accepts_pass_the_schema_check(change: Any) -> None:
    doc = copy.deepcopy(the_rayservice())
    change(doc)
    assert schema_errors(doc) == []


@pytest.mark.parametrize(("change", "error"), [
    (lambda d: d["metadata"].update(name="Brownout"), r"metadata\.name 'Brownout'"),
    (lambda d: d["metadata"].update(name="b" * 48), r"at most 47 characters"),
    (lambda d: _head(d)["rayStartParams"].update(labels="a=b"), r"rayStartParams\['labels'\] is not supported"),
    (lambda d: _worker(d).update(resources={"GPU": "1"}, rayStartParams={"num-gpus": "1"}), r"resources set both"),
    (lambda d: _worker(d).update(minReplicas=2, maxReplicas=1), r"minReplicas \(2\) <= maxReplicas \(1\)"),
    (lambda d: _head(d)["labels"].update({"brownout.io/node": "cpu head"}), r"invalid Ray label value"),
])
def test_what_kuberay_refuses_at_reconcile_is_caught(change: Any, error: str) -> None:
    doc = copy.deepcopy(the_rayservice())
    change(doc)
    assert any(re.search(error, e) for e in operator_errors(doc)), operator_errors(doc)


# --- tests: the application -------------------------------------------------------------------

def test_serve_config_v2_is_serve_config_yamls_application_with_only_the_kubernetes_changes() -> None:
    config, local = serve_config_v2(the_rayservice()), shipped()
    ServeDeploySchema.model_validate(config)  # Ray Serve's own check of a deploy config
    app, local_app = the_app(config), the_app(local)
    for key in ("name", "route_prefix", "import_path"):
        assert app[key] == local_app[key], key
    assert config["proxy_location"] == local["proxy_location"]
    assert config["http_options"]["port"] == local["http_options"]["port"]
    assert config["http_options"]["host"] == "0.0.0.0", "the proxy must listen on the pod's address"
    ours, theirs = flatten(app["args"]), flatten(local_app["args"])
    added = {k for k in set(ours) - set(theirs) if any(k.startswith(a + ".") for a in K8S_ADDED_ARGS)}
    assert set(ours) - added == set(theirs), sorted((set(ours) - added) ^ set(theirs))
    changed = {k for k in ours if k not in added and ours[k] != theirs[k]}
    assert changed <= set(K8S_ARGS), sorted(changed - set(K8S_ARGS))
    # the whole args still pass the builder's validation (unknown keys and bad values fail)
    from serve_app.app import BrownoutArgs
    BrownoutArgs.model_validate(app["args"])


def test_the_model_comes_from_hugging_face_or_a_folder_mounted_on_the_gpu_worker() -> None:
    doc = the_rayservice()
    source = the_app(serve_config_v2(doc))["args"]["model"]["source"]
    if source.startswith("/"):
        (gpu_group,) = [g for g in groups(doc)[1] if gpus(ray_container(g))["limits"]]
        assert mount_holding(gpu_group, source) is not None, f"{source} is not mounted on the GPU worker"
    else:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", source), f"{source!r} is neither a folder nor a Hugging Face id"


def test_every_deployment_the_builder_binds_is_placed_and_keeps_the_codes_options() -> None:
    doc = the_rayservice()
    app = the_app(serve_config_v2(doc))
    was_up = ray.is_initialized()  # integration tests that ran before in this process leave Ray up
    graph = built_graph(app["args"])
    assert was_up or not ray.is_initialized(), "building the graph must not start Ray"
    overrides = deployments(app)
    assert set(overrides) == set(graph), f"config {sorted(overrides)} vs bound {sorted(graph)}"
    for name, override in overrides.items():
        unknown = set(override) - set(DeploymentSchema.model_fields)
        assert not unknown, f"{name}: unknown deployment option(s) {sorted(unknown)}"
        options = override.get("ray_actor_options", {})
        unknown = set(options) - set(RayActorOptionsSchema.model_fields)
        assert not unknown, f"{name}: unknown ray_actor_options {sorted(unknown)}"
        # Serve takes ray_actor_options from the config whole: what the code sets must be kept
        for key, value in graph[name].items():
            assert options.get(key) == value, f"{name}: ray_actor_options.{key} {options.get(key)!r} != code's {value!r}"


def test_the_model_gets_a_gpu_on_the_gpu_worker_and_everything_else_stays_on_the_cpu_head() -> None:
    doc = the_rayservice()
    head, workers = groups(doc)
    overrides = deployments(the_app(serve_config_v2(doc)))
    # the head: no GPU, in Kubernetes or in Ray
    assert gpus(ray_container(head)) == {"requests": None, "limits": None}
    assert head.get("rayStartParams", {}).get("num-gpus") == "0"
    # one GPU worker group, one GPU per pod
    gpu_groups = [g for g in workers if gpus(ray_container(g))["limits"] is not None]
    assert len(gpu_groups) == 1 and str(gpus(ray_container(gpu_groups[0]))["limits"]) == "1"
    model = overrides[MODEL]["ray_actor_options"]
    assert model.get("num_gpus", 0) >= 1, "the model deployment must ask Ray for a GPU"
    assert not model.get("label_selector"), "the GPU request alone places the model"
    head_labels = head.get("labels", {})
    for name, override in overrides.items():
        if name == MODEL:
            continue
        options = override["ray_actor_options"]
        assert not options.get("num_gpus"), name
        selector = options.get("label_selector") or {}
        assert selector and selector.items() <= head_labels.items(), f"{name}: {selector} does not select the head {head_labels}"
        for g in workers:
            assert not selector.items() <= g.get("labels", {}).items(), f"{name}: also selects worker group {g['groupName']}"


def test_the_ray_version_is_the_installed_one_everywhere() -> None:
    doc = the_rayservice()
    version = ray.__version__
    assert doc["spec"]["rayClusterConfig"]["rayVersion"] == version
    head, workers = groups(doc)
    for group in [head, *workers]:
        image = ray_container(group)["image"]
        assert image.endswith(f"-ray{version}"), image
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert re.search(rf"^ARG RAY_VERSION={re.escape(version)}$", text, re.M)
    assert re.search(r"^FROM rayproject/ray-llm:\$\{RAY_VERSION\}-py3\d+-cu\d+$", text, re.M)


def test_serve_port_and_metrics_port_are_declared_where_kuberay_and_prometheus_look() -> None:
    doc = the_rayservice()
    head, workers = groups(doc)
    for group in [head, *workers]:
        ports = {p["name"]: p["containerPort"] for p in ray_container(group).get("ports", [])}
        # KubeRay's Serve Service and the workers' injected readiness probe use the port named "serve"
        assert ports.get("serve") == shipped()["http_options"]["port"]
        annotations = group["template"].get("metadata", {}).get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true"
        assert int(annotations["prometheus.io/port"]) == ports["metrics"]
        # probes are left to KubeRay, which knows Ray's and Serve's health endpoints
        assert "readinessProbe" not in ray_container(group) and "livenessProbe" not in ray_container(group)
    assert ray_container(head)["ports"] and {p["name"] for p in ray_container(head)["ports"]} >= {"dashboard", "gcs-server"}


def test_the_podmonitor_selects_both_pod_templates_on_the_metrics_port() -> None:
    (monitor,) = manifest_documents(PODMONITOR)
    assert monitor["kind"] == "PodMonitor" and monitor["apiVersion"] == "monitoring.coreos.com/v1"
    wanted = monitor["spec"]["selector"]["matchLabels"].items()
    head, workers = groups(the_rayservice())
    for group in [head, *workers]:
        assert wanted <= group["template"]["metadata"]["labels"].items()
        ports = {p["name"] for p in ray_container(group)["ports"]}
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports


# --- tests: the policy ConfigMap and the Secret -------------------------------------------------

def test_the_policy_configmap_parses_with_the_policy_loader_and_is_the_deployed_policy(tmp_path: Path) -> None:
    docs = manifest_documents()
    doc = the_rayservice()
    head, workers = groups(doc)
    target = dockerfile_workdir() + "/" + DEFAULT_POLICY_PATH.relative_to(ROOT).as_posix()
    names = set()
    for group in [head, *workers]:
        volume = mounts(group).get(target)
        assert volume is not None and "configMap" in volume, f"{group.get('groupName', 'head')}: no ConfigMap at {target}"
        names.add((volume["configMap"]["name"], volume["mount"]["subPath"]))
    ((name, key),) = names
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
    text = configmap["data"][key]
    (tmp_path / key).write_text(text, encoding="utf-8")
    policy = load_policy(tmp_path / key)  # the project's own loader: every key and value checked
    document = yaml.safe_load(text)
    assert document == yaml.safe_load(DEFAULT_POLICY_PATH.read_text(encoding="utf-8"))
    app = the_app(serve_config_v2(doc))
    deployed = deployments(app)["Ingress"]["user_config"]["policy"]
    assert deployed == document, "the ConfigMap and the Ingress user_config must hold the same policy"
    assert deployed == deployments(the_app(shipped()))["Ingress"]["user_config"]["policy"]
    # and it can fire on this engine's batch, as the builder checks at deploy time
    fit_policy(parse_policy(deployed), app["args"]["model"]["max_num_seqs"])
    assert policy == parse_policy(deployed)


def test_the_auth_files_are_the_secret_mounted_on_the_head_only() -> None:
    doc = the_rayservice()
    head, workers = groups(doc)
    auth = the_app(serve_config_v2(doc))["args"]["auth"]
    assert auth["api_keys"] == "required"
    secrets = set()
    for key in ("keys_file", "admin_token_file"):
        volume = mount_holding(head, auth[key])
        assert volume is not None and "secret" in volume, f"auth.{key} {auth[key]} is not in a Secret mount"
        assert volume["mount"].get("readOnly") and "subPath" not in volume["mount"], "a subPath mount never sees a rotation"
        secrets.add(volume["secret"]["secretName"])
        for g in workers:
            assert mount_holding(g, auth[key]) is None, f"{g['groupName']} mounts the auth Secret; only the head needs it"
    (secret,) = secrets
    # the README's command creates that Secret with the two file names the app reads
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(rf"kubectl create secret generic {secret}\b[^\n]*(?:\\\n[^\n]*)*", readme)
    assert command, f"README.md does not show how to create Secret {secret}"
    for key in ("keys_file", "admin_token_file"):
        assert f"--from-file={Path(auth[key]).name}=" in command.group(0)


def test_the_state_directory_is_a_volume_on_the_head() -> None:
    doc = the_rayservice()
    head, _ = groups(doc)
    data_dir = the_app(serve_config_v2(doc))["args"]["enrichments"]["data_dir"]
    volume = mount_holding(head, data_dir)
    assert volume is not None and not volume["mount"].get("readOnly"), data_dir


def test_an_autoscaled_model_has_gpu_pods_to_scale_into() -> None:
    """Each model replica asks for a GPU: the GPU group must be allowed one pod per replica, and
    KubeRay's autoscaler must be on to add them while Brownout degrades."""
    doc = the_rayservice()
    autoscaling = the_app(serve_config_v2(doc))["args"]["model"].get("autoscaling")
    assert autoscaling, "the RayService's model autoscales (README: Autoscaling the model)"
    assert doc["spec"]["rayClusterConfig"].get("enableInTreeAutoscaling") is True
    (gpu_group,) = [g for g in groups(doc)[1] if gpus(ray_container(g))["limits"]]
    assert gpu_group["maxReplicas"] >= autoscaling["max_replicas"]
    assert gpu_group["minReplicas"] <= autoscaling.get("min_replicas", 1) <= gpu_group["replicas"]
