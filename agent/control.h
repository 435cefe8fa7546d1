/* The control socket's protocol apart from its I/O (agent/control_proto.c): a client's
 * bytes cut into lines, and a line read as a command. control.c serves it on the socket;
 * tests/fuzz/fuzz_control.c feeds it arbitrary bytes. */
#pragma once

#include <stdbool.h>
#include <stddef.h>

#define RO_CONTROL_LINE_MAX 512 /* bytes a client may have buffered, NUL included */

enum ro_control_cmd {
	RO_CONTROL_STATUS,    /* "status" */
	RO_CONTROL_DRAIN,     /* "drain" or "drain <seconds>" */
	RO_CONTROL_BAD_DRAIN, /* "drain <not seconds from 0 to 86400>" */
	RO_CONTROL_UNKNOWN,
};

struct ro_control_req {
	enum ro_control_cmd cmd;
	bool has_seconds; /* drain: seconds given (else the caller's default) */
	double seconds;	  /* drain: finite, in [0, 86400] */
};

/* One line (newline and a trailing CR already gone) as a command. */
void ro_control_parse(const char *line, struct ro_control_req *ret);

/* buf holds *len bytes of a client's input (cap bytes of room, one kept for a NUL). Each
 * complete line goes to fn, NUL-terminated without its "\n" or "\r\n"; what follows the
 * last newline moves to the front. false when the buffer is full and holds no newline: a
 * line too long, not a client. */
bool ro_control_lines(char *buf, size_t *len, size_t cap, void (*fn)(void *arg, const char *line),
		      void *arg);
