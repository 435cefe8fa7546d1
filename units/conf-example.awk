# Turns `rolloutd --help` into the example config file (units/rolloutd.conf.example): every
# setting as a commented "name = default" line under its help, so the file cannot name a
# setting that does not exist. Input lines come in pairs:
#   "  --NAME   HELP"  then  "      (default "VALUE")"
BEGIN {
	print "# rolloutd.conf: one \"name = value\" per line; '#' starts a comment."
}
# "... config file (default /etc/rolloutd/rolloutd.conf)." in the usage text: the configured
# path, said at the top
/config file \(default / && !said {
	path = $0
	sub(/.*config file \(default /, "", path)
	sub(/\).*/, "", path)
	print "# rolloutd reads " path " (or --config FILE, ROLLOUTD_CONFIG);"
	print "# ROLLOUTD_<NAME> in the environment beats the file, a --name flag beats both."
	print "# Every setting is below with its default, commented out; generated from"
	print "# `rolloutd --help` at build time."
	said = 1
}
/^  --[a-z0-9-]+ / {
	name = $1
	sub(/^--/, "", name)
	help = $0
	sub(/^  --[a-z0-9-]+ +/, "", help)
	next
}
/^ +\(default "/ && name != "" {
	def = $0
	sub(/^ +\(default "/, "", def)
	sub(/"\)$/, "", def)
	printf "\n# %s\n#%s =%s\n", help, name, def == "" ? "" : " " def
	name = ""
}
