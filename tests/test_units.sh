#!/usr/bin/env bash
# units/: systemd-analyze verify is clean on rolloutd.service (ExecStart pointed at the
# built binary), and the DaemonSet manifest parses and keeps the properties a drain needs.
set -euo pipefail
src=${RO_SRCDIR:?}
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
pass=0 fail=0
ok() { echo "PASS: $1"; pass=$((pass + 1)); }
ko() { echo "FAIL: $1"; fail=$((fail + 1)); }

if command -v systemd-analyze >/dev/null; then
	sed "s|^ExecStart=.*|ExecStart=${RO_ROLLOUTD:?}|" "$src/units/rolloutd.service" >"$d/rolloutd.service"
	if out=$(SYSTEMD_LOG_LEVEL=warning systemd-analyze verify --man=no "$d/rolloutd.service" 2>&1) && [ -z "$out" ]; then
		ok "systemd-analyze verify rolloutd.service"
	else
		ko "systemd-analyze verify rolloutd.service: $out"
	fi
else
	ko "systemd-analyze not installed (scripts/deps installs systemd)"
fi
grep -q '^Type=notify' "$src/units/rolloutd.service" && ok "Type=notify" || ko "Type=notify"

py=python3
python3 -c 'import yaml' 2>/dev/null || py=/usr/bin/python3
if $py - "$src/units/k8s/rolloutd-daemonset.yaml" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
ds = next(d for d in docs if d["kind"] == "DaemonSet")
spec = ds["spec"]["template"]["spec"]
c = spec["containers"][0]
assert spec["terminationGracePeriodSeconds"] > 120, "grace must exceed the 2-minute notice"
assert spec["priorityClassName"] == "system-node-critical"
assert spec.get("hostNetwork") is True
pre = c["lifecycle"]["preStop"]["exec"]["command"]
assert "drain" in pre and "--wait" in pre, pre
assert "--ready" in c["readinessProbe"]["exec"]["command"]
assert "--live" in c["livenessProbe"]["exec"]["command"]
assert "vpc.amazonaws.com/efa" in c["resources"]["limits"]
assert "nvidia.com/gpu" in c["resources"]["limits"]
keys = {t.get("key") for t in spec["tolerations"]}
assert "node.kubernetes.io/out-of-service" in keys
cm = next(d for d in docs if d["kind"] == "ConfigMap")
assert all(k.startswith("ROLLOUTD_") for k in cm["data"])
PY
then ok "DaemonSet manifest parses and keeps drain properties"; else ko "DaemonSet manifest"; fi
# every ROLLOUTD_ variable in the units is a real setting
for v in $(grep -ho 'ROLLOUTD_[A-Z0-9_]*' "$src/units/rolloutd.env" "$src/units/k8s/rolloutd-daemonset.yaml" | sort -u); do
	if env -i "$v=x" "${RO_ROLLOUTD}" --model /nonexistent --print-config 2>&1 | grep -q 'unknown setting'; then
		ko "$v is not a rolloutd setting"
	fi
done
ok "unit environment names are settings"
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
