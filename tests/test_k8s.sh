#!/usr/bin/env bash
# units/k8s/: every YAML file parses; the Kustomize base and the gpu-efa overlay render
# (kubectl kustomize, offline; skipped with a message where kubectl is missing) and keep
# what a drain needs (grace > notice, preStop drain --wait, probes whose timeoutSeconds
# exceed rolloutctl's own wait, system-node-critical, out-of-service tolerations), both
# Spot affinity terms (managed node groups and Karpenter, ORed), the security context, the
# Redis password as a mounted file; every ROLLOUTD_ name and value is one the built
# rolloutd accepts.
set -euo pipefail
src=${RO_SRCDIR:?}
daemon=${RO_ROLLOUTD:?}
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
pass=0 fail=0
ok() { echo "PASS: $1"; pass=$((pass + 1)); }
ko() { echo "FAIL: $1"; fail=$((fail + 1)); }
k8s=$src/units/k8s

py=python3
python3 -c 'import yaml' 2>/dev/null || py=/usr/bin/python3
if ! $py -c 'import yaml' 2>/dev/null; then
	ko "python3 with yaml (Debian package python3-yaml) is needed"
	echo "$pass passed, $fail failed"
	exit 1
fi

# how long `rolloutctl status --local` waits for the daemon's answer: the poll timeout in
# agent/ctl_local.c's ask(), in ms (README "EKS" states the same bound)
bound_ms=$(sed -n 's/^#define ASK_MS \([0-9]*\)$/\1/p' "$src/agent/ctl_local.c" | head -1)
[ -n "$bound_ms" ] && ok "rolloutctl status --local waits at most $bound_ms ms for an answer" ||
	ko "cannot find the control-socket poll timeout in agent/ctl_local.c"

if out=$($py - "$k8s" <<'PY' 2>&1
import pathlib, sys, yaml
n = 0
for p in sorted(pathlib.Path(sys.argv[1]).rglob("*.yaml")):
    list(yaml.safe_load_all(p.read_text()))
    n += 1
print(n)
PY
); then ok "all $out YAML files under units/k8s parse"; else ko "YAML: $out"; fi

# Rendered manifests, or (no kubectl) the base's files as they are.
rendered=()
kubectl=${KUBECTL-kubectl} # KUBECTL= : as on a machine without it
if [ -n "$kubectl" ] && command -v "$kubectl" >/dev/null; then
	for k in base:"$k8s" gpu-efa:"$k8s/overlays/gpu-efa"; do
		name=${k%%:*} dir=${k#*:}
		if "$kubectl" kustomize "$dir" >"$d/$name.yaml" 2>"$d/$name.err"; then
			ok "kubectl kustomize ${dir#"$src"/} renders"
			rendered+=("$name")
		else
			ko "kubectl kustomize ${dir#"$src"/}: $(cat "$d/$name.err")"
		fi
	done
else
	echo "SKIP: kubectl not installed: the base's files are checked as they are, the overlay is not rendered"
	cat "$k8s"/base/{namespace,serviceaccount,configmap,secret,daemonset}.yaml |
		sed 's/^apiVersion:/---\napiVersion:/' >"$d/base.yaml"
	rendered+=(base)
fi

for name in "${rendered[@]}"; do
	if out=$($py - "$d/$name.yaml" "$name" "$bound_ms" <<'PY' 2>&1
import sys, yaml
path, name, bound_ms = sys.argv[1], sys.argv[2], int(sys.argv[3] or 10000)
docs = [d for d in yaml.safe_load_all(open(path)) if d]
kinds = {d["kind"] for d in docs}
for k in ("Namespace", "ServiceAccount", "ConfigMap", "Secret", "DaemonSet"):
    assert k in kinds, f"no {k}"
ds = next(d for d in docs if d["kind"] == "DaemonSet")
sa = next(d for d in docs if d["kind"] == "ServiceAccount")
spec = ds["spec"]["template"]["spec"]
c = next(c for c in spec["containers"] if c["name"] == "rolloutd")
# drain
assert spec["terminationGracePeriodSeconds"] > 120, "grace must exceed the 2-minute notice"
assert spec["priorityClassName"] == "system-node-critical"
assert spec.get("hostNetwork") is True
pre = c["lifecycle"]["preStop"]["exec"]["command"]
assert "drain" in pre and "--wait" in pre, pre
tkeys = {t.get("key") for t in spec["tolerations"]}
assert "node.kubernetes.io/out-of-service" in tkeys and "nvidia.com/gpu" in tkeys, tkeys
# probes: the exec must be allowed longer than rolloutctl's own wait
for probe, flag in (("readinessProbe", "--ready"), ("livenessProbe", "--live")):
    p = c[probe]
    assert flag in p["exec"]["command"], (probe, p["exec"]["command"])
    t = p.get("timeoutSeconds", 1)
    assert t * 1000 > bound_ms, f"{probe}.timeoutSeconds {t} s <= rolloutctl's {bound_ms} ms"
# Spot affinity: one term per provisioner (terms are ORed)
terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
def has(term, key, value):
    return any(e["key"] == key and e["operator"] == "In" and value in e["values"]
               for e in term.get("matchExpressions", []))
eks = [t for t in terms if has(t, "eks.amazonaws.com/capacityType", "SPOT")]
kar = [t for t in terms if has(t, "karpenter.sh/capacity-type", "spot")]
assert eks and kar, "want a SPOT term for managed node groups and one for Karpenter"
assert not any(t in kar for t in eks), "the two capacity labels must be in separate (ORed) terms"
assert "nodeSelector" not in spec or not any(
    k in spec["nodeSelector"] for k in ("eks.amazonaws.com/capacityType", "karpenter.sh/capacity-type")), \
    "a nodeSelector on one capacity label would AND it with the affinity"
# security context
psc, csc = spec.get("securityContext", {}), c.get("securityContext", {})
assert psc.get("runAsNonRoot") is True or csc.get("runAsNonRoot") is True, "runAsNonRoot"
assert (psc.get("seccompProfile") or csc.get("seccompProfile", {})).get("type") == "RuntimeDefault"
assert csc.get("readOnlyRootFilesystem") is True, "readOnlyRootFilesystem"
assert csc.get("allowPrivilegeEscalation") is False, "allowPrivilegeEscalation"
assert csc.get("capabilities", {}).get("drop") == ["ALL"], "drop ALL capabilities"
assert not csc.get("capabilities", {}).get("add"), "no capability added"
assert not csc.get("privileged"), "not privileged"
# no API token
assert sa.get("automountServiceAccountToken") is False and spec.get("automountServiceAccountToken") is False
assert spec.get("serviceAccountName") == sa["metadata"]["name"]
# the Redis password: a Secret mounted as a file, named by redis-password-file
cm = next(d for d in docs if d["kind"] == "ConfigMap")
env = dict(cm["data"])
env.update({e["name"]: e.get("value") for e in c.get("env", [])})
assert "ROLLOUTD_REDIS_PASSWORD" not in env, "the password must not be an environment variable"
pwfile = env["ROLLOUTD_REDIS_PASSWORD_FILE"]
vols = {v["name"]: v for v in spec["volumes"]}
mounted = False
for m in c["volumeMounts"]:
    v = vols[m["name"]]
    if "secret" in v and pwfile.startswith(m["mountPath"].rstrip("/") + "/"):
        rel = pwfile[len(m["mountPath"].rstrip("/")) + 1:]
        items = v["secret"].get("items")
        secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == v["secret"]["secretName"])
        keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
        mounted = any(i["path"] == rel and i["key"] in keys for i in items) if items else rel in keys
assert mounted, f"{pwfile} is not a key of a mounted Secret"
if name == "gpu-efa":
    lim = c["resources"]["limits"]
    for r in ("nvidia.com/gpu", "vpc.amazonaws.com/efa", "hugepages-2Mi"):
        assert r in lim, f"no {r} limit"
    assert any(t.get("key") == "vpc.amazonaws.com/efa" for t in spec["tolerations"]), "no EFA toleration"
# the environment for the settings check: NAME=value lines
with open(path + ".env", "w") as f:
    for k, v in sorted(env.items()):
        if k.startswith("ROLLOUTD_"):
            f.write(f"{k}={'' if v is None else v}\n")
PY
); then
		ok "$name: drain properties, probes (timeoutSeconds > ${bound_ms} ms), Spot affinity (managed node groups | Karpenter), security context, password file"
	else
		ko "$name: $out"
	fi
	# every ROLLOUTD_ name is a setting, every value one rolloutd accepts (files that exist
	# only in the pod are checked by name only; valueFrom entries have no value here)
	[ -f "$d/$name.yaml.env" ] || continue
	bad=
	args=()
	while IFS= read -r kv; do
		k=${kv%%=*} v=${kv#*=}
		if env -i "$k=x" "$daemon" --config /dev/null --print-config 2>&1 | grep -q 'unknown setting'; then
			bad="$bad $k"
		elif [ -n "$v" ] && [[ $k != *_FILE ]]; then
			args+=("$kv")
		fi
	done <"$d/$name.yaml.env"
	if [ -z "$bad" ] && out=$(env -i "${args[@]}" "$daemon" --config /dev/null --print-config 2>&1); then
		ok "$name: every ROLLOUTD_ name is a setting and every value is accepted ($(wc -l <"$d/$name.yaml.env") names)"
	else
		ko "$name: not settings:${bad:- none}; rolloutd said: ${out:-}"
	fi
done

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
