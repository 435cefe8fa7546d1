/* Fuzz target: the control-socket protocol (agent/control_proto.c): a client's bytes,
 * arriving in reads of any size, cut into lines and read as commands. The first byte sets
 * the largest read (0: as much as fits). Each line handed on must be exactly the bytes
 * between two newlines (a CR before the newline dropped), and a drain's seconds must be a
 * number from 0 to 86400. */
#include "tests/fuzz/fuzz.h"

#include <math.h>

#include "agent/control.h"

struct feed {
	const uint8_t *data;
	size_t size, pos; /* where the next line starts in data */
	size_t lines;
};

static void check_req(const char *line)
{
	struct ro_control_req q;

	ro_control_parse(line, &q);
	switch (q.cmd) {
	case RO_CONTROL_STATUS:
		FUZZ_ASSERT(!strcmp(line, "status"));
		break;
	case RO_CONTROL_DRAIN:
		FUZZ_ASSERT(!strncmp(line, "drain", 5));
		FUZZ_ASSERT(!q.has_seconds ||
			    (isfinite(q.seconds) && q.seconds >= 0 && q.seconds <= 86400));
		break;
	case RO_CONTROL_BAD_DRAIN:
		FUZZ_ASSERT(!strncmp(line, "drain ", 6));
		break;
	case RO_CONTROL_UNKNOWN:
		FUZZ_ASSERT(strcmp(line, "status") && strcmp(line, "drain"));
		break;
	default:
		FUZZ_ASSERT(!"a command outside the enum");
	}
}

static void on_line(void *arg, const char *line)
{
	struct feed *f = arg;
	const uint8_t *nl = memchr(f->data + f->pos, '\n', f->size - f->pos);
	size_t seg, n = strlen(line);

	FUZZ_ASSERT(nl); /* a line only ends at a newline */
	seg = (size_t)(nl - (f->data + f->pos));
	if (seg && f->data[f->pos + seg - 1] == '\r')
		seg--;
	/* an embedded NUL shortens the C string; the bytes before it are the line's */
	FUZZ_ASSERT(n <= seg && !memcmp(line, f->data + f->pos, n));
	FUZZ_ASSERT(n == seg || memchr(f->data + f->pos, '\0', seg));
	FUZZ_ASSERT(n < RO_CONTROL_LINE_MAX);
	f->pos = (size_t)(nl - f->data) + 1;
	f->lines++;
	check_req(line);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char in[RO_CONTROL_LINE_MAX];
	struct feed f;
	size_t len = 0, off = 0, most;

	if (!size)
		return 0;
	most = data[0] ? data[0] : sizeof(in);
	f = (struct feed){.data = data + 1, .size = size - 1};
	while (off < f.size) {
		size_t n = f.size - off;

		if (n > most)
			n = most;
		if (n > sizeof(in) - 1 - len)
			n = sizeof(in) - 1 - len;
		memcpy(in + len, f.data + off, n);
		len += n;
		off += n;
		if (!ro_control_lines(in, &len, sizeof(in), on_line, &f)) {
			/* a line too long: the client is dropped with this much unread */
			FUZZ_ASSERT(len == sizeof(in) - 1 && !memchr(in, '\n', len));
			return 0;
		}
		FUZZ_ASSERT(len < sizeof(in) - 1 && !memchr(in, '\n', len));
		FUZZ_ASSERT(f.pos + len == off);
	}
	if (len) { /* end of input: the last line needs no newline */
		in[len] = '\0';
		check_req(in);
	}
	return 0;
}
