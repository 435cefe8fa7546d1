/* The control socket's protocol without the socket: line framing (a command may arrive in
 * pieces, several may arrive in one read) and the exact command words "status", "drain"
 * and "drain <seconds>". Kept apart from control.c so the fuzz target reaches it alone. */
#include "agent/control.h"

#include <stdlib.h>
#include <string.h>

void ro_control_parse(const char *line, struct ro_control_req *ret)
{
	char *end;
	double s;

	memset(ret, 0, sizeof(*ret));
	if (!strcmp(line, "status")) {
		ret->cmd = RO_CONTROL_STATUS;
	} else if (!strcmp(line, "drain")) {
		ret->cmd = RO_CONTROL_DRAIN;
	} else if (!strncmp(line, "drain ", 6)) {
		s = strtod(line + 6, &end);
		if (end == line + 6 || *end || !(s >= 0) || s > 86400) {
			ret->cmd = RO_CONTROL_BAD_DRAIN;
			return;
		}
		ret->cmd = RO_CONTROL_DRAIN;
		ret->has_seconds = true;
		ret->seconds = s;
	} else {
		ret->cmd = RO_CONTROL_UNKNOWN;
	}
}

bool ro_control_lines(char *buf, size_t *len, size_t cap, void (*fn)(void *arg, const char *line),
		      void *arg)
{
	char *nl;

	while ((nl = memchr(buf, '\n', *len))) {
		size_t l = (size_t)(nl - buf);

		*nl = '\0';
		if (l && buf[l - 1] == '\r')
			buf[l - 1] = '\0';
		fn(arg, buf);
		memmove(buf, nl + 1, *len - l - 1);
		*len -= l + 1;
	}
	return *len < cap - 1;
}
