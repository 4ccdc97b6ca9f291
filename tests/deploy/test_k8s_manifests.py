"""deploy/k8s/: every manifest passes the strict JSON schemas (unknown fields fail) of named
Kubernetes versions, offline (kubernetes-validate carries them), and the cross-references
no schema sees hold: Service selectors and ports, probes, flags, environment variable names,
volumes, GPUs against slots, the kustomization's file list, and checkpoints without a shared
filesystem: the store's root on its own ReadWriteOnce claim, streamed to (SURGE_STORE_TRANSFER
=stream), no other pod mounting it; the S3 overlay (deploy/k8s-s3) passes the same checks.

Every cross-check is a function returning its findings, run on the real manifests (none)
and on broken copies (each finds its break), so that none of them passes by construction."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import ValidationError

from tests.conftest import REPO

K8S = REPO / "deploy" / "k8s"
K8S_S3 = REPO / "deploy" / "k8s-s3"  # the S3 variant: an overlay of K8S (not inside it: kustomize refuses a cycle)
# The oldest and the newest Kubernetes whose schemas the pinned kubernetes-validate carries
# that we claim: the manifests use nothing newer than 1.30's API.
KUBERNETES_VERSIONS = ("1.30", "1.37")
OPTIONAL = {"servicemonitor.yaml", "prometheusrule.yaml"}  # CRDs' kinds: not in the default kustomization
COMPONENTS = {"control": 50051, "store": 50052, "data": 50053, "worker": 50060}
METRICS_PORT = 9100
# Variables the manifests set that are not Surge's own (each read by a library Surge uses).
FOREIGN_ENV = {
    "PROMETHEUS_DISABLE_CREATED_SERIES",  # prometheus_client; deploy/Dockerfile sets it too
    "AWS_ENDPOINT_URL",  # botocore's; the data service takes it as its --s3-endpoint default
}


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def core_docs() -> list[dict]:
    return [d for p in manifest_files() if p.name not in OPTIONAL for d in load(p)]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in {"StatefulSet", "Deployment", "DaemonSet"}]


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def component(workload: dict) -> str:
    return workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def quantity(text: str | int) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    m = re.fullmatch(r"(\d+)([KMGT]i?)?", str(text))
    assert m, f"not a whole quantity: {text!r}"
    return int(m.group(1)) * units.get(m.group(2) or "", 1)


def container_ports(c: dict) -> dict:
    """A container's ports by name and by number (both are what a targetPort may say)."""
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
    ports.update({p["containerPort"]: p["containerPort"] for p in c.get("ports", [])})
    return ports


def surge_source() -> str:
    return "\n".join(p.read_text() for p in (REPO / "services").rglob("*.py"))


# --- the cross-checks ------------------------------------------------------------------------


def selector_problems(docs: list[dict]) -> list[str]:
    """Every Service selects exactly one workload's pods, and its ports reach their ports;
    every workload's selector selects its own template; every serviceName exists."""
    found = []
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for name, svc in services.items():
        selector = svc["spec"].get("selector") or {}
        chosen = [w for w in workloads(docs) if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        if len(chosen) != 1 or not selector:
            found.append(f"Service {name}: selector {selector} selects {len(chosen)} workloads")
            continue
        ports = {k: v for c in containers(chosen[0]) for k, v in container_ports(c).items()}
        for p in svc["spec"]["ports"]:
            if p.get("targetPort", p["port"]) not in ports:
                found.append(f"Service {name}: targetPort {p.get('targetPort')} is no container port")
    for w in workloads(docs):
        name = w["metadata"]["name"]
        match = w["spec"]["selector"]["matchLabels"]
        if not match.items() <= w["spec"]["template"]["metadata"]["labels"].items():
            found.append(f"{name}: selector {match} does not select its own pods")
        if w["kind"] == "StatefulSet" and w["spec"]["serviceName"] not in services:
            found.append(f"{name}: serviceName {w['spec']['serviceName']} is no Service")
    return found


def container_problems(docs: list[dict]) -> list[str]:
    """Image, entry point and flags as docker-compose.yml; probes and /metrics annotations on
    the container's own ports; no Service links (SURGE_CONTROL_PORT=tcp://... would be read
    as a port)."""
    found = []
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    for w in workloads(docs):
        comp, pod = component(w), w["spec"]["template"]
        if pod["spec"].get("enableServiceLinks") is not False:
            found.append(f"{comp}: enableServiceLinks is not false")
        annotations = pod["metadata"].get("annotations", {})
        for c in containers(w):
            where = f"{comp}/{c['name']}"
            if c["image"] != compose["x-surge"]["image"]:
                found.append(f"{where}: image {c['image']}, compose builds {compose['x-surge']['image']}")
            cmd = c["command"]
            if cmd[:3] != ["python", "-m", f"services.{comp}"]:
                found.append(f"{where}: command {cmd[:3]}")
                continue
            flags = dict(zip(cmd[3::2], cmd[4::2]))
            parser = (REPO / "services" / comp / "__main__.py").read_text()
            for flag in flags:
                if f'"{flag}"' not in parser:
                    found.append(f"{where}: services.{comp} has no {flag}")
            ports = container_ports(c)
            if int(flags.get("--port", -1)) != ports.get("grpc") or ports.get("grpc") != COMPONENTS.get(comp):
                found.append(f"{where}: --port {flags.get('--port')}, grpc port {ports.get('grpc')}")
            metrics = int(flags.get("--metrics-port", -1))
            if not metrics == ports.get("metrics") == METRICS_PORT == int(annotations.get("prometheus.io/port", -2)):
                found.append(f"{where}: --metrics-port {metrics}, metrics port {ports.get('metrics')}, {annotations}")
            if annotations.get("prometheus.io/scrape") != "true" or annotations.get("prometheus.io/path") != "/metrics":
                found.append(f"{where}: scrape annotations {annotations}")
            for kind in ("readinessProbe", "livenessProbe"):
                probe = c.get(kind, {}).get("exec", {}).get("command")
                want = ["python", "-m", "services.common.healthcheck", f"127.0.0.1:{ports.get('grpc')}"]
                if probe != want:
                    found.append(f"{where}: {kind} {probe}, want {want}")
    return found


def env_problems(docs: list[dict], source: str) -> list[str]:
    """Every variable set is one Surge's code reads (or a named library's); every $(VAR) is
    one set before it in the same container (Kubernetes leaves an unknown one as it is);
    every service address names a Service port, or this container's own."""
    found = []
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for w in workloads(docs):
        for c in containers(w):
            where = f"{component(w)}/{c['name']}"
            seen: list[str] = []
            for e in c.get("env", []):
                name = e["name"]
                if name not in FOREIGN_ENV and not (name.startswith("SURGE_") and re.search(rf"\b{name}\b", source)):
                    found.append(f"{where}: {name} is read nowhere in services/")
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", e.get("value", "")):
                    if ref not in seen:
                        found.append(f"{where}: {name} uses $({ref}), not set before it")
                seen.append(name)
            for arg in c["command"]:
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    if ref not in seen:
                        found.append(f"{where}: the command uses $({ref}), which is not set")
            for name, e in env_of(c).items():
                if not name.endswith("_ADDRESS"):
                    continue
                host, _, port = e["value"].rpartition(":")
                if host == "127.0.0.1":
                    ok = int(port) in container_ports(c).values()
                else:
                    ok = host in services and int(port) in {p["port"] for p in services[host]["spec"]["ports"]}
                if not ok:
                    found.append(f"{where}: {name}={e['value']} is no Service port")
    return found


def volume_problems(docs: list[dict]) -> list[str]:
    """Mounts name volumes; claims exist (a PersistentVolumeClaim, or one a StatefulSet's
    volumeClaimTemplate makes: <template>-<statefulset>-<ordinal>); control's SURGE_HOME,
    data's root and the store's root are each on their own pod's ReadWriteOnce
    volumeClaimTemplate; no other pod mounts the store's volume, nor anything at its root
    (ranks stream their shards to the store: nothing of it is shared)."""
    found = []
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    templates: dict[str, dict] = {}  # "template:<component>/<name>" -> the template
    made: dict[str, str] = {}  # claim name prefix "<template>-<statefulset>-" -> its template's key
    for w in workloads(docs):
        for t in w["spec"].get("volumeClaimTemplates", []):
            key = f"template:{component(w)}/{t['metadata']['name']}"
            templates[key] = t
            made[f"{t['metadata']['name']}-{w['metadata']['name']}-"] = key

    def claim_source(name: str) -> str | None:
        for prefix, key in made.items():
            if name.startswith(prefix) and name.removeprefix(prefix).isdigit():
                return key
        return f"claim:{name}" if name in claims else None

    mounts: dict[str, dict[str, str]] = {}  # component -> mount path -> where from
    for w in workloads(docs):
        comp, spec = component(w), w["spec"]
        volumes = {v["name"]: v for v in spec["template"]["spec"].get("volumes", [])}
        own = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
        for v in volumes.values():
            if "persistentVolumeClaim" in v and claim_source(v["persistentVolumeClaim"]["claimName"]) is None:
                found.append(f"{comp}: claim {v['persistentVolumeClaim']['claimName']} does not exist")
        for c in spec["template"]["spec"]["containers"]:
            for m in c.get("volumeMounts", []):
                if m["name"] in own:
                    source = f"template:{comp}/{m['name']}"
                elif m["name"] in volumes:
                    v = volumes[m["name"]]
                    pvc = v.get("persistentVolumeClaim")
                    source = (claim_source(pvc["claimName"]) or "missing") if pvc else "pod"
                else:
                    found.append(f"{comp}: mount {m['name']} names no volume")
                    continue
                mounts.setdefault(comp, {})[m["mountPath"]] = source

    def env(comp: str, name: str) -> str | None:
        for w in workloads(docs):
            if component(w) == comp:
                return env_of(containers(w)[0]).get(name, {}).get("value")
        return None

    for comp, var in (("control", "SURGE_HOME"), ("data", "SURGE_DATA_ROOT"), ("store", "SURGE_STORE_ROOT")):
        source = mounts.get(comp, {}).get(env(comp, var) or "", "")
        if not source.startswith(f"template:{comp}/"):
            found.append(
                f"{comp}: {var}={env(comp, var)} is not on its own volumeClaimTemplate ({source or 'not mounted'})"
            )
        elif (modes := templates[source]["spec"]["accessModes"]) != ["ReadWriteOnce"]:
            found.append(f"{comp}: {source} is {modes}, not ReadWriteOnce")
    root = env("store", "SURGE_STORE_ROOT")
    store_source = mounts.get("store", {}).get(root or "")
    for comp, paths in mounts.items():
        if comp == "store":
            continue
        for path, source in paths.items():
            if (store_source and source == store_source) or path == root:
                found.append(f"{comp}: mounts the store's volume ({source}) at {path}")
    return found


def store_setting(c: dict, flag: str, var: str, default: str) -> str:
    """A store option as the store reads it: its flag, else its variable, else the default."""
    if flag in c["command"]:
        return c["command"][c["command"].index(flag) + 1]
    return env_of(c).get(var, {}).get("value", default)


def secrets_of(c: dict) -> set[str]:
    return {e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e}


def checkpoint_problems(docs: list[dict]) -> list[str]:
    """Checkpoints need no shared filesystem: the local backend streams (SURGE_STORE_TRANSFER
    =stream; path would make ranks write the store's root themselves), or the s3 backend has
    a bucket URL and the node agents read every Secret the store reads (the ranks write the
    chunks with their pod's own AWS_* credentials)."""
    found = []
    (store,) = [containers(w)[0] for w in workloads(docs) if component(w) == "store"]
    backend = store_setting(store, "--backend", "SURGE_STORE_BACKEND", "local")
    if backend == "local":
        transfer = store_setting(store, "--transfer", "SURGE_STORE_TRANSFER", "path")
        if transfer != "stream":
            found.append(f"store: transfer {transfer}, not stream: ranks would need the store's root mounted")
    elif backend == "s3":
        url = store_setting(store, "--s3-url", "SURGE_STORE_S3_URL", "")
        if not re.fullmatch(r"s3://[^/]+(/.*)?", url):
            found.append(f"store: backend s3 without a bucket URL (SURGE_STORE_S3_URL={url!r})")
        for w in workloads(docs):
            if component(w) == "worker" and (missing := secrets_of(store) - secrets_of(containers(w)[0])):
                found.append(
                    f"worker: no envFrom of the store's Secret(s) {sorted(missing)}: ranks need the credentials"
                )
    else:
        found.append(f"store: backend {backend!r} is neither local nor s3")
    return found


def worker_problems(docs: list[dict]) -> list[str]:
    """Stable ids (pod name), the headless Service's DNS name advertised, GPUs = slots, and
    /dev/shm a memory volume large enough for the in-memory checkpoint copies."""
    found = []
    (w,) = [w for w in workloads(docs) if component(w) == "worker"]
    c = containers(w)[0]
    env = env_of(c)
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == w["spec"]["serviceName"])
    if service["spec"].get("clusterIP") != "None":
        found.append(f"worker: Service {service['metadata']['name']} is not headless")
    if env.get("SURGE_WORKER_ID", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "metadata.name":
        found.append(f"worker: SURGE_WORKER_ID is not the pod's name: {env.get('SURGE_WORKER_ID')}")
    want = f"$(SURGE_WORKER_ID).{service['metadata']['name']}"
    if env.get("SURGE_WORKER_ADVERTISE", {}).get("value") != want:
        found.append(f"worker: SURGE_WORKER_ADVERTISE is not {want}")
    resources = c.get("resources", {})
    gpus = {resources.get(k, {}).get("nvidia.com/gpu") for k in ("requests", "limits")}
    slots = env.get("SURGE_WORKER_SLOTS", {}).get("value")
    if len(gpus) != 1 or None in gpus or gpus != {slots}:
        found.append(f"worker: nvidia.com/gpu {resources} against SURGE_WORKER_SLOTS={slots}")
    volumes = {v["name"]: v for v in w["spec"]["template"]["spec"].get("volumes", [])}
    shm = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    empty = volumes.get(shm[0]["name"], {}).get("emptyDir", {}) if shm else {}
    if empty.get("medium") != "Memory" or "sizeLimit" not in empty:
        found.append(f"worker: /dev/shm is not a sized memory emptyDir: {empty}")
    else:
        copies = int(env.get("SURGE_WORKER_MEMORY_COPY_BYTES", {}).get("value", "-1"))
        if not 0 < copies < quantity(empty["sizeLimit"]):
            found.append(
                f"worker: SURGE_WORKER_MEMORY_COPY_BYTES={copies} does not fit /dev/shm ({empty['sizeLimit']})"
            )
    return found


def all_problems(docs: list[dict]) -> list[str]:
    source = surge_source()
    return [
        *selector_problems(docs),
        *container_problems(docs),
        *env_problems(docs, source),
        *volume_problems(docs),
        *checkpoint_problems(docs),
        *worker_problems(docs),
    ]


def merge(base, patch):
    """A strategic-merge patch as kustomize applies these: maps merge; a list of named maps
    (containers, env, volumes...) merges by name, new ones added; any other list (envFrom)
    is replaced whole."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: merge(base[k], v) if k in base else copy.deepcopy(v) for k, v in patch.items()}}
    named = isinstance(base, list) and isinstance(patch, list)
    if named and all(isinstance(x, dict) and "name" in x for x in base + patch):
        by_name = {x["name"]: x for x in patch}
        out = [merge(x, by_name.pop(x["name"])) if x["name"] in by_name else x for x in base]
        return out + [copy.deepcopy(x) for x in patch if x["name"] in by_name]
    return copy.deepcopy(patch)


def s3_kustomization() -> dict:
    return yaml.safe_load((K8S_S3 / "kustomization.yaml").read_text())


def s3_docs() -> list[dict]:
    """deploy/k8s with deploy/k8s-s3's patches applied (each targets a kind and name)."""
    docs = copy.deepcopy(core_docs())
    for entry in s3_kustomization()["patches"]:
        for patch in load(K8S_S3 / entry["path"]):
            (i,) = [
                i
                for i, d in enumerate(docs)
                if (d["kind"], d["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])
            ]
            docs[i] = merge(docs[i], patch)
    return docs


# --- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_passes_the_strict_schemas(version):
    checked = []
    for path in manifest_files():
        for doc in load(path):
            if path.name in OPTIONAL:
                continue  # the ServiceMonitor, the PrometheusRule: no schema for a CRD here (tests below)
            kubernetes_validate.validate(doc, version, strict=True)  # raises on the first error
            checked.append(f"{doc['kind']}/{doc['metadata']['name']}")
    kinds = {c.split("/")[0] for c in checked}
    assert kinds == {"StatefulSet", "Service"}, checked  # every volume is a StatefulSet's own claim
    assert len(checked) == 8, checked


def test_the_validator_fails_a_broken_manifest(tmp_path):
    """A misspelled field fails the strict schema (and only the strict one: that is what
    strict adds); a wrong type fails either; so the test above can fail."""
    (sts,) = [d for d in load(K8S / "worker.yaml") if d["kind"] == "StatefulSet"]
    version = KUBERNETES_VERSIONS[-1]
    kubernetes_validate.validate(sts, version, strict=True)  # the copy itself is fine

    text = (K8S / "worker.yaml").read_text()
    assert text.count("volumeMounts:") == 1
    broken = tmp_path / "worker.yaml"
    broken.write_text(text.replace("volumeMounts:", "volumeMount:"))  # one letter short
    (bad,) = [d for d in load(broken) if d["kind"] == "StatefulSet"]
    kubernetes_validate.validate(bad, version, strict=False)  # lax: unknown fields pass
    with pytest.raises(ValidationError, match="volumeMount"):
        kubernetes_validate.validate(bad, version, strict=True)

    wrong = copy.deepcopy(sts)
    wrong["spec"]["replicas"] = "two"
    with pytest.raises(ValidationError, match="two"):
        kubernetes_validate.validate(wrong, version, strict=False)


def test_the_cross_references_hold():
    assert all_problems(core_docs()) == []


def break_env_name(docs):
    containers(workloads(docs)[0])[0]["env"].append({"name": "SURGE_NOT_A_VARIABLE", "value": "1"})


def break_selector(docs):
    svc = next(d for d in docs if d["kind"] == "Service")
    svc["spec"]["selector"]["app.kubernetes.io/component"] = "nothing"


def break_target_port(docs):
    svc = next(d for d in docs if d["kind"] == "Service")
    svc["spec"]["ports"][0]["targetPort"] = "grcp"


def break_probe(docs):
    containers(workloads(docs)[0])[0]["livenessProbe"]["exec"]["command"][-1] = "127.0.0.1:1"


def break_flag(docs):
    containers(workloads(docs)[0])[0]["command"] += ["--no-such-flag", "1"]


def break_slots(docs):
    (w,) = [w for w in workloads(docs) if component(w) == "worker"]
    env_of(containers(w)[0])["SURGE_WORKER_SLOTS"]["value"] = "2"


def break_advertise(docs):
    (w,) = [w for w in workloads(docs) if component(w) == "worker"]
    env = containers(w)[0]["env"]
    env.insert(0, env.pop(next(i for i, e in enumerate(env) if e["name"] == "SURGE_WORKER_ADVERTISE")))


def the(docs, comp):
    (w,) = [w for w in workloads(docs) if component(w) == comp]
    return w


def break_worker_mounts_store(docs):
    """The layout before streaming: the store's claim (surge-store-0's) in the agents' pods."""
    spec = the(docs, "worker")["spec"]["template"]["spec"]
    spec["volumes"].append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": "checkpoints-surge-store-0"}})
    containers(the(docs, "worker"))[0]["volumeMounts"].append({"name": "checkpoints", "mountPath": "/mnt/ckpt"})


def break_worker_mounts_store_root(docs):
    spec = the(docs, "worker")["spec"]["template"]["spec"]
    spec["volumes"].append({"name": "scratch", "emptyDir": {}})
    containers(the(docs, "worker"))[0]["volumeMounts"].append({"name": "scratch", "mountPath": "/var/lib/surge/store"})


def break_store_claim_shared(docs):
    (template,) = the(docs, "store")["spec"]["volumeClaimTemplates"]
    template["spec"]["accessModes"] = ["ReadWriteMany"]


def break_store_root_off_claim(docs):
    env_of(containers(the(docs, "store"))[0])["SURGE_STORE_ROOT"]["value"] = "/var/lib/surge/elsewhere"


def break_store_on_a_standalone_claim(docs):
    """The store's root on a PersistentVolumeClaim of its own making, not its template."""
    w = the(docs, "store")
    (template,) = w["spec"].pop("volumeClaimTemplates")
    docs.append(
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "ckpt"}, "spec": template["spec"]}
    )
    w["spec"]["template"]["spec"]["volumes"] = [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}}]


def break_transfer(docs):
    env_of(containers(the(docs, "store"))[0])["SURGE_STORE_TRANSFER"]["value"] = "path"


def break_transfer_unset(docs):
    env = containers(the(docs, "store"))[0]["env"]
    env[:] = [e for e in env if e["name"] != "SURGE_STORE_TRANSFER"]


def break_address(docs):
    (w,) = [w for w in workloads(docs) if component(w) == "worker"]
    env_of(containers(w)[0])["SURGE_CONTROL_ADDRESS"]["value"] = "surge-control:50052"


def break_service_links(docs):
    del workloads(docs)[0]["spec"]["template"]["spec"]["enableServiceLinks"]


@pytest.mark.parametrize(
    ("breakage", "finding"),
    [
        (break_env_name, "SURGE_NOT_A_VARIABLE is read nowhere"),
        (break_selector, "selects 0 workloads"),
        (break_target_port, "targetPort grcp is no container port"),
        (break_probe, "livenessProbe"),
        (break_flag, "has no --no-such-flag"),
        (break_slots, "SURGE_WORKER_SLOTS=2"),
        (break_advertise, "uses $(SURGE_WORKER_ID), not set before it"),
        (break_worker_mounts_store, "worker: mounts the store's volume (template:store/checkpoints) at /mnt/ckpt"),
        (break_worker_mounts_store_root, "worker: mounts the store's volume (pod) at /var/lib/surge/store"),
        (break_store_claim_shared, "store: template:store/checkpoints is ['ReadWriteMany'], not ReadWriteOnce"),
        (break_store_root_off_claim, "SURGE_STORE_ROOT=/var/lib/surge/elsewhere is not on its own volumeClaimTemplate"),
        (
            break_store_on_a_standalone_claim,
            "SURGE_STORE_ROOT=/var/lib/surge/store is not on its own volumeClaimTemplate (claim:ckpt)",
        ),
        (break_transfer, "store: transfer path, not stream"),
        (break_transfer_unset, "store: transfer path, not stream"),
        (break_address, "surge-control:50052 is no Service port"),
        (break_service_links, "enableServiceLinks is not false"),
    ],
)
def test_each_cross_check_finds_its_break(breakage, finding):
    docs = copy.deepcopy(core_docs())
    breakage(docs)
    found = all_problems(docs)
    assert len(found) == 1 and finding in found[0], found


def test_the_kustomization_lists_every_manifest_but_the_optional_one():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed))
    assert set(listed) == {p.name for p in manifest_files()} - OPTIONAL


def test_the_service_monitor_scrapes_every_surge_service_with_honored_labels():
    (monitor,) = load(K8S / "servicemonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "ServiceMonitor"
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [d for d in core_docs() if d["kind"] == "Service"]
    selected = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in selected} == {f"surge-{c}" for c in COMPONENTS}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["honorLabels"] is True  # Surge's own `job` label is the training job
        for s in selected:
            assert endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}, s["metadata"]["name"]


def test_the_prometheus_rule_holds_the_same_alert_rules_as_the_compose_prometheus():
    # One set of rules (deploy/rules/surge-alerts.yml, loaded by deploy/prometheus.yml); the
    # operator's copy must not drift from it.
    (rule,) = load(K8S / "prometheusrule.yaml")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    compose_rules = yaml.safe_load((REPO / "deploy" / "rules" / "surge-alerts.yml").read_text())
    assert rule["spec"] == compose_rules
    assert rule["metadata"]["labels"]["app.kubernetes.io/part-of"] == "surge"


def test_kubectl_kustomize_builds_the_listed_resources():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the schema tests above do not need it)")
    r = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    built = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(r.stdout) if d}
    assert built == {(d["kind"], d["metadata"]["name"]) for d in core_docs()}


def test_the_s3_overlay_patches_store_and_agents_with_the_stores_own_variables():
    kustomization = s3_kustomization()
    assert kustomization["kind"] == "Kustomization" and kustomization["resources"] == ["../k8s"]
    patched = [e["path"] for e in kustomization["patches"]]
    assert sorted(patched) == sorted(p.name for p in K8S_S3.glob("*.yaml") if p.name != "kustomization.yaml")
    docs = s3_docs()
    (store,) = [containers(w)[0] for w in workloads(docs) if component(w) == "store"]
    env = env_of(store)
    assert env["SURGE_STORE_BACKEND"]["value"] == "s3" and env["SURGE_STORE_S3_URL"]["value"].startswith("s3://")
    assert "SURGE_STORE_S3_ENDPOINT" in env
    (data,) = [containers(w)[0] for w in workloads(docs) if component(w) == "data"]
    assert env_of(data)["SURGE_DATA_REMOTE"]["value"].startswith("s3://")
    # Every variable a patch sets is one its own service's entry point reads (not merely some service).
    for entry in kustomization["patches"]:
        for patch in load(K8S_S3 / entry["path"]):
            for c in patch["spec"]["template"]["spec"]["containers"]:
                parser = (REPO / "services" / c["name"] / "__main__.py").read_text()
                for e in c.get("env", []):
                    assert f'"{e["name"]}"' in parser, (c["name"], e["name"])
    # The credentials: one Secret, not optional, in the store's, the data service's and the
    # agents' pods, beside the surge-env every pod reads (envFrom is replaced whole by a patch).
    (worker,) = [containers(w)[0] for w in workloads(docs) if component(w) == "worker"]
    for c in (store, data, worker):
        assert {"name": "surge-s3"} in [e["secretRef"] for e in c["envFrom"]], c["name"]
        assert {"name": "surge-env", "optional": True} in [e["secretRef"] for e in c["envFrom"]], c["name"]
    assert all_problems(docs) == []
    for doc in docs:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_s3_cross_checks_find_their_breaks():
    docs = s3_docs()
    (w,) = [w for w in workloads(docs) if component(w) == "worker"]
    containers(w)[0]["envFrom"] = [e for e in containers(w)[0]["envFrom"] if e["secretRef"]["name"] != "surge-s3"]
    found = all_problems(docs)
    assert len(found) == 1 and "no envFrom of the store's Secret(s) ['surge-s3']" in found[0], found
    docs = s3_docs()
    (s,) = [w for w in workloads(docs) if component(w) == "store"]
    env_of(containers(s)[0])["SURGE_STORE_S3_URL"]["value"] = "surge-checkpoints"
    found = all_problems(docs)
    assert len(found) == 1 and "backend s3 without a bucket URL" in found[0], found


def test_kubectl_kustomize_builds_the_s3_overlay_as_merged_here():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the merge above stands in for it)")
    r = subprocess.run([kubectl, "kustomize", str(K8S_S3)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr

    def normal(docs):  # by kind and name; env in name order (kustomize puts a patch's new ones first)
        out = {}
        for d in copy.deepcopy(docs):
            if d["kind"] == "StatefulSet":
                for c in containers(d):
                    c["env"] = sorted(c.get("env", []), key=lambda e: e["name"])
            out[(d["kind"], d["metadata"]["name"])] = d
        return out

    assert normal([d for d in yaml.safe_load_all(r.stdout) if d]) == normal(s3_docs())
