#!/usr/bin/env bash
# The man pages say what the binaries do: every setting of `rolloutd --help` is in
# rolloutd(8) and rolloutd.conf(5) and nothing else is, every command of `rolloutctl
# --help` is in rolloutctl(1), no page names the build tree, and groff formats each
# without a warning (but "can't break line": an installed path can be longer than a line).
set -euo pipefail
man=${RO_MANDIR:-man}
pass=0 fail=0
ok() { echo "PASS: $1"; pass=$((pass + 1)); }
ko() { echo "FAIL: $1"; fail=$((fail + 1)); }
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT

# the settings, as --help prints them ("  --name  help")
"${RO_ROLLOUTD:?}" --help | sed -n 's/^  --\([a-z0-9-]*\) .*/\1/p' | sort -u >"$d/help"
[ "$(wc -l <"$d/help")" -gt 30 ] && ok "--help lists $(wc -l <"$d/help") settings" || ko "--help lists too few settings"
# in the page: ".B \-\-name \fIvalue\fR" (flags) and ".B name = \fIvalue\fR" (config file)
sed -n 's/^\.B \\-\\-\([a-z0-9\\-]*\) \\fIvalue\\fR$/\1/p' "$man/rolloutd.8" | sed 's/\\-/-/g' | sort -u >"$d/page8"
sed -n 's/^\.B \([a-z0-9\\-]*\) = \\fIvalue\\fR$/\1/p' "$man/rolloutd.conf.5" | sed 's/\\-/-/g' | sort -u >"$d/page5"
if diff -u "$d/help" "$d/page8"; then ok "rolloutd(8) has exactly the settings of --help"; else ko "rolloutd(8) and --help differ"; fi
if diff -u "$d/help" "$d/page5"; then ok "rolloutd.conf(5) has exactly the settings of --help"; else ko "rolloutd.conf(5) and --help differ"; fi
# the defaults: a setting's default in --help is the page's
def=$("${RO_ROLLOUTD}" --help | awk '/^  --drain-margin-ms /{getline; print}' | sed -n 's/.*(default "\(.*\)")/\1/p')
grep -q "Default: \\\\(lq${def}\\\\(rq" <(sed -n '/drain\\-margin\\-ms \\fIvalue/,/^\.TP/p' "$man/rolloutd.8") &&
	ok "defaults come from the table (drain-margin-ms $def)" || ko "drain-margin-ms default $def not in the page"

# rolloutctl: every command word of its --help ("  word ...") is a .B entry of the page
"${RO_ROLLOUTCTL:?}" --help | sed -n '/^commands:/,/^options/p' | sed -n 's/^  \([a-z][a-z-]*\).*/\1/p' | sort -u >"$d/cmds"
missing=""
while read -r c; do
	grep -q "^\.B[IR]* $(sed 's/-/\\\\-/g' <<<"$c")\b" "$man/rolloutctl.1" || missing="$missing $c"
done <"$d/cmds"
[ -z "$missing" ] && ok "rolloutctl(1) describes its $(wc -l <"$d/cmds") commands" || ko "rolloutctl(1) lacks:$missing"

# nothing refers to the build tree
abs=$(cd "$(dirname "$RO_ROLLOUTD")" && pwd)
if grep -l -e "$abs" -e '@[A-Z_]*@' "$man"/rolloutd.8 "$man"/rolloutd.conf.5 "$man"/rolloutctl.1; then
	ko "a page names the build tree or an unreplaced @WORD@"
else
	ok "no page names the build tree"
fi

# groff formats each page without warnings
if command -v groff >/dev/null; then
	for p in rolloutd.8 rolloutd.conf.5 rolloutctl.1; do
		w=$(LC_ALL=C.UTF-8 groff -man -Tutf8 -ww -Wbreak -z "$man/$p" 2>&1 || true)
		[ -z "$w" ] && ok "groff: $p" || ko "groff: $p: $w"
	done
	LC_ALL=C.UTF-8 groff -man -Tutf8 -P-cbou "$man/rolloutd.8" 2>/dev/null | grep -q 'drain-margin-ms' &&
		ok "rolloutd(8) renders the settings" || ko "rolloutd(8) does not render the settings"
else
	ko "groff is not installed (scripts/deps installs groff-base)"
fi
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
