/* rolloutctl's subcommands that live in files of their own (agent/ctl_*.c). Each takes the
 * words after its name and returns the process exit code: 0 ok, 1 failure, 2 usage. */
#pragma once

#include <signal.h>
#include <stdbool.h>

struct ro_queue;

enum { EXIT_USAGE = 2 };

/* imds watch|get|mock */
int ro_ctl_imds(int argc, char **argv);

/* make-model [options] DIR: a random Qwen3-MoE or Mixtral model in Hugging Face layout */
int ro_ctl_make_model(int argc, char **argv);
/* generate --model DIR --prompt IDS [...]: run the model with no queue */
int ro_ctl_generate(int argc, char **argv);

/* drain [--deadline S] [--wait] [--socket PATH]: through the daemon's control socket */
int ro_ctl_drain(int argc, char **argv);
/* status --local [--ready|--live]: the daemon's own view, for probes */
int ro_ctl_status_local(int argc, char **argv);
/* top: a live view of the queue q every interval ms; plain lines when asked or when stdout
 * is not a terminal. Ends on 'q', *stop, or after iterations refreshes (< 0: no limit). */
int ro_ctl_top(struct ro_queue *q, const char *queue, long interval, long iterations, bool plain,
	       volatile sig_atomic_t *stop);
