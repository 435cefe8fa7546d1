#!/usr/bin/env bash
# units/: `make install DESTDIR=` puts the unit, the sysusers/tmpfiles entries, the config
# examples and the GPU/EFA drop-in where they belong, and nothing installed names the build
# tree; systemd-analyze verify is clean and the security exposure is at most 2.5 (CPU unit,
# and with the GPU/EFA drop-in); every setting the examples name is a real one. Then, where
# systemd-nspawn can boot a real systemd (root, systemd-container installed), the installed
# unit runs under it: it starts as the rolloutd user with no capabilities under its seccomp
# filter, is ready, finishes work, and stops by draining with status 0 (with the drop-in
# too). Without nspawn that part is skipped, and says so.
set -euo pipefail
src=${RO_SRCDIR:?}
build=${RO_BUILDDIR:-$(dirname "${RO_ROLLOUTD:?}")}
d=$(mktemp -d)
[ -n "${RO_KEEP_TMP:-}" ] && echo "keeping $d" || trap 'rm -rf "$d"' EXIT
pass=0 fail=0
ok() { echo "PASS: $1"; pass=$((pass + 1)); }
ko() { echo "FAIL: $1"; fail=$((fail + 1)); }
skip() { echo "SKIP: $1"; }
max_exposure=2.5

# ---- make install DESTDIR= ------------------------------------------------------------
dest=$d/dest
if env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -C "$build" -s install DESTDIR="$dest" \
	>"$d/install.log" 2>&1; then
	ok "make install DESTDIR="
else
	ko "make install DESTDIR=: $(tail -5 "$d/install.log")"
	echo "$pass passed, $fail failed"
	exit 1
fi
find_one() { find "$dest" -path "$1" -type f | head -1; }
daemon=$(find_one '*/bin/rolloutd')
ctl=$(find_one '*/bin/rolloutctl')
unit=$(find_one '*/systemd/system/rolloutd.service')
sysusers=$(find_one '*/sysusers.d/rolloutd.conf')
tmpfiles=$(find_one '*/tmpfiles.d/rolloutd.conf')
conf=$(find_one '*/rolloutd/rolloutd.conf.example')
envex=$(find_one '*/rolloutd/rolloutd.env.example')
dropin=$(find_one '*/rolloutd/rolloutd-gpu-efa.conf')
mock=$(find_one '*/rolloutd/mock_imds.py')
man8=$(find_one '*/man/man8/rolloutd.8')
man5=$(find_one '*/man/man5/rolloutd.conf.5')
man1=$(find_one '*/man/man1/rolloutctl.1')
for f in daemon ctl conf envex dropin mock man8 man5 man1; do
	[ -n "${!f}" ] && ok "installed: ${!f#"$dest"}" || ko "not installed: $f"
done
for f in unit sysusers tmpfiles; do
	if [ -n "${!f}" ]; then
		ok "installed: ${!f#"$dest"}"
	else
		skip "$f not installed (configured --with-...dir=no?): checking the build's copy"
	fi
done
[ -n "$unit" ] || unit=$build/units/rolloutd.service
[ -n "$sysusers" ] || sysusers=$src/units/sysusers.d/rolloutd.conf
[ -n "$tmpfiles" ] || tmpfiles=$src/units/tmpfiles.d/rolloutd.conf
[ -n "$daemon" ] && [ -n "$ctl" ] && [ -n "$dropin" ] && [ -n "$conf" ] || {
	echo "$pass passed, $fail failed"
	exit 1
}
bindir=$(dirname "${daemon#"$dest"}")
prefix=$(dirname "$bindir")

# the unit runs the installed daemon, not one of the build tree or a fixed /usr/bin
exec_start=$(sed -n 's/^ExecStart=//p' "$unit")
[ "$exec_start" = "$bindir/rolloutd" ] && ok "ExecStart=$exec_start" ||
	ko "ExecStart=$exec_start, want $bindir/rolloutd"
grep -q '^Type=notify' "$unit" && ok "Type=notify" || ko "Type=notify"
grep -q '@[a-z]*@' "$unit" && ko "unsubstituted @...@ in $unit" || ok "unit fully substituted"

# nothing installed refers to the build tree (binaries checked stripped: debug info names
# the compile directory by design); the source tree's files are named, not its path, as a
# distcheck prefix lies inside the source tree
leaks=
while IFS= read -r f; do
	g=$f
	if command -v strip >/dev/null && [ "$(head -c 4 "$f" | tail -c 3)" = ELF ]; then
		# a sanitized build keeps its source file names for its reports, by design: what
		# ships is the normal build, which this same test checks
		[ "${RO_SANITIZED:-0}" = 1 ] && continue
		strip -o "$d/stripped" "$f" && g=$d/stripped
	fi
	if grep -aqF -e "$build/" -e "$src/imds/" -e "$src/agent/" -e "$src/units/" "$g"; then
		leaks="$leaks ${f#"$dest"}"
	fi
done < <(find "$dest" -type f)
[ -z "$leaks" ] && ok "nothing installed names the build or source tree" ||
	ko "installed files naming the build or source tree:$leaks"

# ---- settings: the config example and every ROLLOUTD_ name of the units ----------------
sed 's/^#\([a-z][a-z0-9-]* =\)/\1/' "$conf" >"$d/all.conf"
n_conf=$(grep -c '^[a-z]' "$d/all.conf")
if out=$(env -i "$daemon" --config "$d/all.conf" --print-config 2>&1); then
	n_all=$(printf '%s\n' "$out" | grep -c ' =')
	[ "$n_conf" -eq "$n_all" ] && ok "rolloutd.conf.example: all $n_conf settings, each real" ||
		ko "rolloutd.conf.example names $n_conf settings, rolloutd has $n_all"
else
	ko "rolloutd --config rolloutd.conf.example (every line uncommented): $out"
fi
bad=
for v in $(grep -ho 'ROLLOUTD_[A-Z0-9_]*' "$envex" "$unit" "$dropin" "$src/units/rolloutd.service.in" | sort -u); do
	[ "$v" = ROLLOUTD_CONFIG ] && continue
	if env -i "$v=x" "$daemon" --config /dev/null --print-config 2>&1 | grep -q 'unknown setting'; then
		bad="$bad $v"
	fi
done
[ -z "$bad" ] && ok "every ROLLOUTD_ name in the unit, drop-in and env example is a setting" ||
	ko "not settings:$bad"

# ---- sysusers.d and tmpfiles.d, applied to a scratch root -----------------------------
if command -v systemd-sysusers >/dev/null && command -v systemd-tmpfiles >/dev/null; then
	r=$d/sysroot
	mkdir -p "$r/etc" "$r/run" "$r/var/cache"
	if systemd-sysusers --root="$r" "$sysusers" >"$d/sysusers.log" 2>&1 &&
		grep -q '^rolloutd:' "$r/etc/passwd" && grep -q '^rolloutd:' "$r/etc/group"; then
		ok "sysusers.d creates the rolloutd system user and group"
	else
		ko "sysusers.d: $(cat "$d/sysusers.log")"
	fi
	uid=$(awk -F: '$1 == "rolloutd" { print $3 }' "$r/etc/passwd")
	if systemd-tmpfiles --root="$r" --create "$tmpfiles" >"$d/tmpfiles.log" 2>&1 &&
		[ "$(stat -c '%a %u' "$r/run/rolloutd")" = "750 $uid" ] &&
		[ "$(stat -c '%a %u' "$r/var/cache/rolloutd")" = "750 $uid" ]; then
		ok "tmpfiles.d creates /run/rolloutd and /var/cache/rolloutd (0750 rolloutd)"
	else
		ko "tmpfiles.d: $(cat "$d/tmpfiles.log") $(stat -c '%n %a %u' "$r/run/rolloutd" "$r/var/cache/rolloutd" 2>&1)"
	fi
else
	skip "systemd-sysusers/systemd-tmpfiles not installed (scripts/deps installs systemd)"
fi

# ---- systemd-analyze: verify and security exposure, CPU unit and with the drop-in ------
# Both look units up by name in $SYSTEMD_UNIT_PATH, so the drop-in is found as
# rolloutd.service.d/gpu-efa.conf; ExecStart points at the installed binary.
exposure() { # prints the "Overall exposure level" number
	SYSTEMD_UNIT_PATH=$1: systemd-analyze security --offline=yes rolloutd.service 2>&1 |
		sed -n 's/.*Overall exposure level for rolloutd.service: \([0-9.]*\).*/\1/p'
}
if command -v systemd-analyze >/dev/null; then
	u=$d/unitpath
	mkdir -p "$u"
	sed "s|^ExecStart=.*|ExecStart=$daemon|" "$unit" >"$u/rolloutd.service"
	for variant in cpu gpu-efa; do
		if [ $variant = gpu-efa ]; then
			mkdir -p "$u/rolloutd.service.d"
			cp "$dropin" "$u/rolloutd.service.d/gpu-efa.conf"
		fi
		if out=$(SYSTEMD_UNIT_PATH=$u: SYSTEMD_LOG_LEVEL=warning systemd-analyze verify --man=no rolloutd.service 2>&1) &&
			[ -z "$out" ]; then
			ok "systemd-analyze verify rolloutd.service ($variant)"
		else
			ko "systemd-analyze verify rolloutd.service ($variant): $out"
		fi
		e=$(exposure "$u")
		if [ -n "$e" ] && awk -v e="$e" -v m="$max_exposure" 'BEGIN { exit !(e <= m) }'; then
			ok "systemd-analyze security --offline=yes ($variant): exposure $e <= $max_exposure"
		else
			ko "systemd-analyze security --offline=yes ($variant): exposure '${e:-?}' > $max_exposure"
		fi
	done
else
	ko "systemd-analyze not installed (scripts/deps installs systemd)"
fi

# ---- the installed unit under a real systemd (systemd-nspawn) -------------------------
# A throwaway OS tree: a copy of /etc, the host's /usr read-only, the install prefix bound
# over itself; systemd boots into rolloutd-test.service, which runs the scenario below and
# powers off. nspawn runs in a private mount namespace with its own /run, so the host's
# /run is left as it was.
nspawn_why=
if [ "${RO_SANITIZED:-0}" = 1 ]; then
	# ASan's runtime (its leak check at exit, its shadow mappings) under the unit's syscall
	# filter and W^X is not what ships: the normal build's run of this test boots it
	nspawn_why="a sanitized build (the normal build's run of this test does it)"
elif [ "$(id -u)" != 0 ]; then
	nspawn_why="not root"
elif ! command -v systemd-nspawn >/dev/null || ! command -v unshare >/dev/null; then
	nspawn_why="systemd-nspawn not installed (Debian package systemd-container)"
elif [ "$prefix" = /usr ] || [ "$prefix" = / ]; then
	nspawn_why="installed under $prefix, which the container takes from the host"
elif [[ $prefix =~ ^/(tmp|var/tmp|home|root|run/user)(/|$) ]]; then
	# distcheck's prefix lies in the build tree, often under /tmp
	nspawn_why="installed under $prefix, which the unit's PrivateTmp=/ProtectHome= hide from it"
elif ! command -v redis-server >/dev/null; then
	nspawn_why="no redis-server"
fi
if [ -n "$nspawn_why" ]; then
	skip "no real systemd run of the unit: $nspawn_why; verified offline only (above)"
else
	root=$d/os
	mkdir -p "$root"/{usr/lib,etc,var,tmp,root,proc,sys,dev,run,nsp,srv}
	for l in bin sbin lib lib64; do [ -L /$l ] && ln -s "$(readlink /$l)" "$root/$l"; done
	cp /usr/lib/os-release "$root/usr/lib/"
	cp -a /etc/. "$root/etc/" 2>/dev/null || true
	rm -f "$root/etc/machine-id"
	mkdir -p "$root/etc/systemd/system" "$root/etc/sysusers.d" "$root/etc/tmpfiles.d"
	# the container waits for no network: rolloutd wants network-online.target
	for w in systemd-networkd-wait-online NetworkManager-wait-online; do
		ln -sf /dev/null "$root/etc/systemd/system/$w.service"
	done
	cp "$unit" "$root/etc/systemd/system/rolloutd.service"
	cp "$sysusers" "$root/etc/sysusers.d/rolloutd.conf"
	cp "$tmpfiles" "$root/etc/tmpfiles.d/rolloutd.conf"
	cp "$dropin" "$root/nsp/gpu-efa.conf"
	cat >"$root/etc/systemd/system/rolloutd-test.service" <<EOF
[Unit]
Description=rolloutd unit test
[Service]
Type=oneshot
TimeoutStartSec=200
Environment=PATH=$bindir:/usr/sbin:/usr/bin:/sbin:/bin
ExecStart=/bin/bash /nsp/inside.sh
ExecStopPost=/bin/systemctl --no-block poweroff
EOF
	cat >"$root/nsp/inside.sh" <<'EOF'
# runs inside the container, as root, under systemd as PID 1
exec >/nsp/inside.log 2>&1
set -x
res() { echo "$1" >>/nsp/result; echo "$(date +%T) $1" >>/nsp/timeline; }
echo "pid1=$(cat /proc/1/comm)" >>/nsp/result
systemd-sysusers && id rolloutd && res "PASS sysusers.d: systemd-sysusers made the rolloutd user" ||
	res "FAIL sysusers.d: no rolloutd user"
redis-server --port 6391 --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
	--logfile /nsp/redis.log
rolloutctl make-model --arch qwen3_moe --layers 2 --hidden 64 --heads 2 --kv-heads 1 \
	--head-dim 32 --experts 4 --top-k 2 --expert-ffn 64 --vocab 128 /srv/model
chmod -R a+rX /srv/model
mkdir -p /var/lib/node_exporter/textfile_collector /etc/systemd/system/rolloutd.service.d
chown rolloutd /var/lib/node_exporter/textfile_collector
cat >/etc/systemd/system/rolloutd.service.d/test.conf <<'CONF'
[Service]
Environment=ROLLOUTD_MODEL=/srv/model ROLLOUTD_REDIS=redis://127.0.0.1:6391/0
Environment=ROLLOUTD_QUEUE=nsp ROLLOUTD_IMDS=false ROLLOUTD_METRICS_INTERVAL_MS=200
Environment=ROLLOUTD_METRICS_FILE=/var/lib/node_exporter/textfile_collector/rolloutd.prom
Environment=ROLLOUTD_SIGTERM_GRACE_S=20
CONF
export ROLLOUTD_REDIS=redis://127.0.0.1:6391/0 ROLLOUTD_QUEUE=nsp
run() { # $1: variant; start, check, work, stop
	local v=$1 pid st n cursor
	cursor=$(journalctl -q -n 0 --show-cursor | sed -n 's/^-- cursor: //p')
	systemctl daemon-reload
	if timeout 60 systemctl start rolloutd; then
		res "PASS $v: systemctl start (READY=1 within 60 s)"
	else
		res "FAIL $v: systemctl start: $(systemctl status rolloutd --no-pager -l | tail -5 | tr '\n' ' ')"
		timeout 20 systemctl stop rolloutd
		return
	fi
	pid=$(systemctl show -P MainPID rolloutd)
	st=/proc/$pid/status
	[ "$(awk '/^Uid:/ { print $2 }' $st)" = "$(id -u rolloutd)" ] && res "PASS $v: runs as rolloutd" ||
		res "FAIL $v: uid $(awk '/^Uid:/ { print $2 }' $st)"
	[ "$(awk '/^CapEff:/ { print $2 }' $st)" = 0000000000000000 ] &&
		[ "$(awk '/^CapBnd:/ { print $2 }' $st)" = 0000000000000000 ] &&
		res "PASS $v: no capabilities (effective, bounding)" || res "FAIL $v: $(grep ^Cap $st | tr '\n' ' ')"
	[ "$(awk '/^Seccomp:/ { print $2 }' $st)" = 2 ] && [ "$(awk '/^NoNewPrivs:/ { print $2 }' $st)" = 1 ] &&
		res "PASS $v: seccomp filter, no_new_privs" || res "FAIL $v: $(grep -e ^Seccomp -e ^NoNewPrivs $st | tr '\n' ' ')"
	rolloutctl status --local --ready >/dev/null && res "PASS $v: status --local --ready through /run/rolloutd/control.sock" ||
		res "FAIL $v: status --local --ready"
	printf '{"id":"%s-%d","prompt":[1,2,3],"n":2,"max_new_tokens":16,"sampling":{"temperature":1.0,"seed":%d}}\n' \
		"$v" 1 1 "$v" 2 2 | rolloutctl enqueue -
	for _ in $(seq 300); do
		n=$(rolloutctl status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["done"])')
		[ "${n:-0}" -ge "$want" ] && break
		sleep 0.1
	done
	[ "${n:-0}" -ge "$want" ] && res "PASS $v: units generated and completed under the filter ($n done)" ||
		res "FAIL $v: $n units done, want $want"
	sleep 0.5
	[ -s /var/lib/node_exporter/textfile_collector/rolloutd.prom ] &&
		res "PASS $v: metrics textfile written (ReadWritePaths)" || res "FAIL $v: no metrics textfile"
	[ "$(stat -c %a /var/lib/node_exporter/textfile_collector/rolloutd.prom)" = 644 ] &&
		res "PASS $v: metrics textfile 0644 under UMask=0077 (the collector reads it)" ||
		res "FAIL $v: metrics textfile mode $(stat -c %a /var/lib/node_exporter/textfile_collector/rolloutd.prom)"
	[ -S /run/rolloutd/control.sock ] && [ "$(stat -c %a /run/rolloutd/control.sock)" = 600 ] &&
		res "PASS $v: control socket 0600 in RuntimeDirectory" || res "FAIL $v: control socket"
	[ "$(stat -c %U /var/cache/rolloutd)" = rolloutd ] && res "PASS $v: /var/cache/rolloutd is rolloutd's" ||
		res "FAIL $v: /var/cache/rolloutd $(stat -c %U /var/cache/rolloutd)"
	t0=$(date +%s)
	# SIGTERM -> drain -> exit 0, well inside sigterm-grace-s (20 s here): a lost SIGTERM
	# would leave it running until TimeoutStopSec kills it
	timeout 15 systemctl stop rolloutd
	[ "$(systemctl is-active rolloutd)" = inactive ] && [ "$(systemctl show -P Result rolloutd)" = success ] &&
		[ "$(systemctl show -P ExecMainStatus rolloutd)" = 0 ] &&
		res "PASS $v: systemctl stop: drained, exit 0 in $(( $(date +%s) - t0 )) s" ||
		res "FAIL $v: stop: $(systemctl is-active rolloutd) Result=$(systemctl show -P Result rolloutd) status=$(systemctl show -P ExecMainStatus rolloutd) after $(( $(date +%s) - t0 )) s"
	timeout 20 systemctl kill -s KILL rolloutd 2>/dev/null
	journalctl -u rolloutd --no-pager -o cat --after-cursor="$cursor" >/nsp/journal-$v.log 2>&1
	grep -q '^drained in' /nsp/journal-$v.log && res "PASS $v: the journal shows the drain" ||
		res "FAIL $v: no drain in the journal"
}
want=2
run cpu
cp /nsp/gpu-efa.conf /etc/systemd/system/rolloutd.service.d/gpu-efa.conf
want=4
run gpu-efa
# an expert-parallel group of two local ranks over libfabric shm: memfd regions mapped
# through /proc/<pid>/fd under ProtectProc=invisible, the seccomp filter and PrivateUsers
rm /etc/systemd/system/rolloutd.service.d/gpu-efa.conf
printf '[Service]\nEnvironment=ROLLOUTD_EP_LOCAL_RANKS=2\n' >/etc/systemd/system/rolloutd.service.d/ep.conf
want=6
run ep2
grep -q 'expert parallelism: rank 1 of 2 .* over shm' /nsp/journal-ep2.log &&
	res "PASS ep2: two ranks over shm under the hardened unit" || res "FAIL ep2: no EP group over shm in the journal"
echo done >>/nsp/result
redis-cli -p 6391 shutdown nosave
systemctl --no-block poweroff
EOF
	if timeout 300 unshare -m --propagation private sh -c '
		mount -t tmpfs tmpfs /run && exec systemd-nspawn -q -D "$1" --keep-unit --register=no \
			--link-journal=no --bind-ro=/usr --bind-ro="$2$3:$3" --bind="$1/nsp:/nsp" \
			-b systemd.unit=rolloutd-test.service' sh "$root" "$dest" "$prefix" \
		>"$d/nspawn.log" 2>&1 && grep -q '^pid1=systemd' "$root/nsp/result" 2>/dev/null; then
		ok "a real systemd (252, PID 1 in systemd-nspawn) ran the installed unit:"
		while read -r w rest; do
			case $w in
			PASS) ok "  $rest" ;;
			FAIL) ko "  $rest" ;;
			esac
		done <"$root/nsp/result"
		grep -qx done "$root/nsp/result" || ko "the scenario in the container did not finish: $(tail -5 "$root/nsp/inside.log")"
	else
		skip "systemd-nspawn could not boot a systemd here: $(tail -3 "$d/nspawn.log" | tr '\n' ' '); verified offline only (above)"
	fi
fi

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
