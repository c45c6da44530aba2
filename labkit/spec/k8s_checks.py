"""Problems with spec.job.k8s, each naming its field and the fix: what Kubernetes' API server would refuse after
submission (names, paths, tolerations) is refused here first. What depends on the rest of the spec (the GPUs, the
env preset's devices) is checked where the manifest is built (labkit.jobs.k8s.k8s_errors).
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from labkit.spec.errors import CONTROL_CHARS, quote

if TYPE_CHECKING:
    from labkit.spec.schema import RunSpec

KINDS = ("TrainJob", "PyTorchJob")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
"""RFC 1123 label: volume names (https://kubernetes.io/docs/concepts/overview/working-with-objects/names/)."""
DNS_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
"""RFC 1123 subdomain: claims, secrets, runtimes and a resource's or label key's prefix."""
LABEL_NAME = re.compile(r"^(?=.{1,63}$)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
"""A label key's name part, and a label value when not empty
(https://kubernetes.io/docs/concepts/overview/working-with-objects/labels/#syntax-and-character-set)."""
TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")
OPERATORS = ("Exists", "Equal")
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
"""A toleration's operator and effect (https://kubernetes.io/docs/concepts/scheduling-eviction/taint-and-toleration/):
an empty effect matches every effect; Exists takes no value; an empty key needs Exists; tolerationSeconds is
NoExecute's."""
RESERVED_VOLUMES = "dshm"
"""The volume labkit gives /dev/shm; job.container.mounts take mount-0, mount-1, ..."""


def qualified_name(text: str) -> bool:
    """A label key or resource name: NAME or PREFIX/NAME, PREFIX a DNS subdomain."""
    prefix, _, name = text.rpartition("/")
    return bool(LABEL_NAME.match(name)) and (not prefix or bool(DNS_SUBDOMAIN.match(prefix)))


def _name_problem(field: str, value, pattern: re.Pattern, what: str) -> list[str]:
    if isinstance(value, str) and pattern.match(value):
        return []
    dots = " (and '.' between labels)" if pattern is DNS_SUBDOMAIN else ""
    return [f"{field}: {quote(value)} is not {what}; use lower-case letters, digits and '-'{dots}, starting and "
            "ending with a letter or digit"]


def _volume_errors(spec: RunSpec) -> list[str]:
    mounts = len(spec.job.container.mounts) if spec.job.container else 0
    taken = {RESERVED_VOLUMES, *(f"mount-{i}" for i in range(mounts))}
    errors, names, paths = [], set(), set()
    for i, volume in enumerate(spec.job.k8s.volumes):
        where = f"job.k8s.volumes[{i}]"
        problems = _name_problem(f"{where}.name", volume.name, DNS_LABEL, "a DNS label of at most 63 characters")
        if not problems and volume.name in taken:
            problems = [f"{where}.name: {quote(volume.name)} is the name of a volume labkit adds (/dev/shm, or a "
                        "job.container.mounts entry); choose another"]
        elif not problems and volume.name in names:
            problems = [f"{where}.name: {quote(volume.name)} names an earlier volume too; give each its own name"]
        errors += problems
        names.add(volume.name)
        if not volume.mount_path.startswith("/") or CONTROL_CHARS.search(volume.mount_path):
            errors.append(f"{where}.mount_path: {quote(volume.mount_path)} is not an absolute path; write where the "
                          "container sees the volume, e.g. /data")
        elif volume.mount_path in paths:
            errors.append(f"{where}.mount_path: {quote(volume.mount_path)} is an earlier volume's mount_path; mount "
                          "each volume at its own path")
        paths.add(volume.mount_path)
        if (volume.pvc is None) == (volume.host_path is None):
            errors.append(f"{where}: give exactly one of pvc (a PersistentVolumeClaim's name) or host_path (a "
                          f"directory of every node), got {'both' if volume.pvc is not None else 'neither'}")
        elif volume.pvc is not None:
            errors += _name_problem(f"{where}.pvc", volume.pvc, DNS_SUBDOMAIN, "a PersistentVolumeClaim's name")
        elif not volume.host_path.startswith("/") or CONTROL_CHARS.search(volume.host_path):
            errors.append(f"{where}.host_path: {quote(volume.host_path)} is not an absolute path of the nodes; write "
                          "it from /, e.g. /fsx")
    return errors


def _toleration_errors(tolerations: list) -> list[str]:
    errors = []
    for i, toleration in enumerate(tolerations):
        where = f"job.k8s.tolerations[{i}]"
        if not isinstance(toleration, dict):
            errors.append(f"{where}: {quote(toleration)} is not a toleration; write a mapping such as "
                          "{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}")
            continue
        unknown = [k for k in toleration if k not in TOLERATION_KEYS]
        if unknown:
            errors.append(f"{where}: unknown key(s) {', '.join(map(quote, unknown))}; a toleration has "
                          f"{', '.join(TOLERATION_KEYS)}")
        key, operator = toleration.get("key", ""), toleration.get("operator", "Equal")
        effect, value = toleration.get("effect", ""), toleration.get("value", "")
        if operator not in OPERATORS:
            errors.append(f"{where}.operator: {quote(operator)} is not one of {', '.join(OPERATORS)}")
        if effect not in ("", *EFFECTS):
            errors.append(f"{where}.effect: {quote(effect)} is not one of {', '.join(EFFECTS)} (or leave it out to "
                          "match every effect)")
        if not isinstance(key, str) or (key and not qualified_name(key)):
            errors.append(f"{where}.key: {quote(key)} is not a taint key (NAME or PREFIX/NAME, e.g. nvidia.com/gpu)")
        elif not key and operator != "Exists":
            errors.append(f"{where}.key: an empty key matches every taint only with operator Exists; give the "
                          "taint's key or set operator: Exists")
        if not isinstance(value, str) or (value and not LABEL_NAME.match(value)):
            errors.append(f"{where}.value: {quote(value)} is not a taint value; write it as text (quoted in YAML if "
                          "it looks like a number), at most 63 letters, digits, '-', '_' or '.'")
        elif value and operator == "Exists":
            errors.append(f"{where}.value: operator Exists matches any value; leave value out, or use operator Equal")
        if "tolerationSeconds" in toleration:
            seconds = toleration["tolerationSeconds"]
            if isinstance(seconds, bool) or not isinstance(seconds, int):
                errors.append(f"{where}.tolerationSeconds: {quote(seconds)} is not a whole number of seconds")
            elif effect != "NoExecute":
                errors.append(f"{where}.tolerationSeconds: only a NoExecute toleration has one; set effect: "
                              "NoExecute or leave tolerationSeconds out")
    return errors


def k8s_spec_errors(spec: RunSpec) -> list[str]:
    """Every problem with spec.job.k8s, each 'job.k8s.FIELD: what is wrong; how to fix it'."""
    k8s, errors = spec.job.k8s, []
    if k8s.kind not in KINDS:
        errors.append(f"job.k8s.kind: {quote(k8s.kind)} is not one of {', '.join(KINDS)} (Kubeflow Trainer v2's "
                      "TrainJob, or the training operator v1's PyTorchJob)")
    errors += _name_problem("job.k8s.runtime", k8s.runtime, DNS_SUBDOMAIN, "a ClusterTrainingRuntime's name")
    errors += _volume_errors(spec)
    for key, value in k8s.node_selector.items():
        if not qualified_name(key):
            errors.append(f"job.k8s.node_selector.{key}: not a label key; write NAME or PREFIX/NAME, e.g. "
                          "node.kubernetes.io/instance-type")
        if value and not LABEL_NAME.match(value):
            errors.append(f"job.k8s.node_selector.{key}: {quote(value)} is not a label value (at most 63 letters, "
                          "digits, '-', '_' or '.')")
    errors += _toleration_errors(k8s.tolerations)
    for i, secret in enumerate(k8s.image_pull_secrets):
        errors += _name_problem(f"job.k8s.image_pull_secrets[{i}]", secret, DNS_SUBDOMAIN, "a Secret's name")
    if k8s.queue is not None and not LABEL_NAME.match(k8s.queue):
        errors.append(f"job.k8s.queue: {quote(k8s.queue)} is not a Kueue LocalQueue's name as a label value holds it "
                      "(at most 63 letters, digits, '-', '_' or '.')")
    for resource, count in k8s.devices.items():
        if "/" not in resource or not qualified_name(resource):
            errors.append(f"job.k8s.devices.{resource}: not an extended resource's name; write DOMAIN/NAME as the "
                          "device plugin advertises it, e.g. vpc.amazonaws.com/efa")
        if count < 0:
            errors.append(f"job.k8s.devices.{resource}: {count} is not a count; give 0 or more (0 asks for none)")
    if k8s.patch is not None and not isinstance(k8s.patch, dict):
        errors.append(f"job.k8s.patch: {quote(k8s.patch)} is not a mapping; write the part of the manifest to change, "
                      "e.g. {metadata: {annotations: {team: nlp}}}")
    return errors
