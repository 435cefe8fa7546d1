/* gen_man: writes a man page from its template (man/<page>.in), replacing @SETTINGS_FLAGS@ and
 * @SETTINGS_CONF@ lines with the settings table of agent/config.c, and @VERSION@ and
 * @SYSCONFDIR@ / @PKGDATADIR@ words with the build's. Run at build time, so the pages say
 * what the binary does. */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent/settings.h"

static void put_line(const char *line, const char *const *subst)
{
	for (const char *p = line; *p;) {
		bool done = false;

		for (size_t i = 0; subst[i]; i += 2) {
			size_t n = strlen(subst[i]);

			if (!strncmp(p, subst[i], n)) {
				(void)fputs(subst[i + 1], stdout);
				p += n;
				done = true;
				break;
			}
		}
		if (!done)
			(void)putchar(*p++);
	}
}

int main(int argc, char **argv)
{
	const char *subst[] = {"@VERSION@",    PACKAGE_VERSION,
			       "@SYSCONFDIR@", argc > 2 ? argv[2] : "/etc",
			       "@PKGDATADIR@", argc > 3 ? argv[3] : "/usr/share/rolloutd",
			       NULL};
	char line[4096];
	FILE *f;

	if (argc < 2) {
		(void)fprintf(stderr, "usage: gen_man TEMPLATE [SYSCONFDIR [PKGDATADIR]]\n");
		return 2;
	}
	f = fopen(argv[1], "r");
	if (!f) {
		perror(argv[1]);
		return 1;
	}
	while (fgets(line, sizeof(line), f)) {
		if (!strcmp(line, "@SETTINGS_FLAGS@\n"))
			ro_config_man(stdout, false);
		else if (!strcmp(line, "@SETTINGS_CONF@\n"))
			ro_config_man(stdout, true);
		else
			put_line(line, subst);
	}
	(void)fclose(f);
	return ferror(stdout) ? 1 : 0;
}
