/* The drain state machine: RUNNING -> DRAINING -> DRAINED (exit 0). A notice, SIGTERM, a
 * rebalance or ASG change (as configured), `rolloutctl drain` or the EP group begins it;
 * the earliest deadline wins. Claims stop; each unit whose longest remaining sample cannot
 * finish by the deadline, at the step rate measured now, is checkpointed and requeued at
 * once so that other workers take it while this one finishes the rest. The deadline and
 * the hard deadline (deadline + drain margin) are timers of the loop: at the hard one the
 * agent exits whatever Redis did with its writes (their leases expire and the reaper hands
 * the units on with their last checkpoints). */
#include <stdio.h>
#include <string.h>
#include <systemd/sd-daemon.h>

#include "agent/agent.h"
#include "agent/log.h"

const char *ro_state_name(enum ro_state s)
{
	return s == RO_RUNNING ? "running" : s == RO_DRAINING ? "draining" : "drained";
}

void ro_drain_notify(const struct ro_agent *a)
{
	char s[96];
	int64_t left = a->hard_wall_ms - ro_wall_ms();

	(void)snprintf(s, sizeof(s), "STOPPING=1\nEXTEND_TIMEOUT_USEC=%lld",
		       (long long)((left > 0 ? left : 0) + 5000) * 1000);
	(void)sd_notify(0, s);
}

void ro_drain_begin(struct ro_agent *a, int64_t deadline, const char *reason)
{
	uint32_t held = 0, seqs;

	if (a->state == RO_DRAINED)
		return;
	if (a->state == RO_DRAINING && deadline >= a->deadline_wall_ms)
		return;
	pthread_mutex_lock(&a->mu);
	if (a->state == RO_RUNNING) {
		a->drain_start_ms = ro_now_ms();
		a->n.drains++;
	}
	a->state = RO_DRAINING;
	a->deadline_wall_ms = deadline;
	a->hard_wall_ms = deadline + a->cfg.drain_margin_ms;
	/* a notice whose time has passed still gets a moment for its requeues to land */
	if (a->hard_wall_ms < ro_wall_ms() + 500)
		a->hard_wall_ms = ro_wall_ms() + 500;
	for (const struct unit_rt *u = a->units; u; u = u->next)
		held += u->cp != CP_GONE;
	seqs = ro_units_active(a);
	ro_engine_kick(a);
	pthread_mutex_unlock(&a->mu);
	(void)snprintf(a->drain_reason, sizeof(a->drain_reason), "%s", reason);
	ro_log(LOG_NOTICE, "draining (%s): deadline in %.1f s, %u units and %u sequences in flight",
	       reason, (double)(deadline - ro_wall_ms()) / 1000.0, held, seqs);
	ro_loop_arm_deadlines(a);
	ro_drain_notify(a); /* at once: the stop may take until the hard deadline */
	ro_notify_status(a);
	ro_drain_triage(a);
}

void ro_drain_triage(struct ro_agent *a)
{
	int64_t now = ro_wall_ms();
	bool left = false;
	double step;

	if (a->state != RO_DRAINING)
		return;
	pthread_mutex_lock(&a->mu);
	/* before the first measured step, assume a slow one: requeueing early costs nothing */
	step = a->step_ms > 0 ? a->step_ms : 200.0;
	for (struct unit_rt *u = a->units; u; u = u->next) {
		uint32_t rest = 0;

		if (u->cp == CP_GONE)
			continue;
		left = true;
		if (u->cp != CP_HELD)
			continue;
		for (uint32_t i = 0; i < u->n_s; i++)
			if (u->s[i] && !u->s[i]->finished &&
			    u->u.max_new_tokens - u->s[i]->len > rest)
				rest = u->u.max_new_tokens - u->s[i]->len;
		/* a unit still in prefill has all of its tokens ahead of it */
		if (u->phase < 2)
			rest = u->u.max_new_tokens;
		/* keep a unit only if its longest remaining sample fits, at the step rate
		 * measured now, with a 25% cushion */
		if (now >= a->deadline_wall_ms ||
		    now + (int64_t)(rest * step * 1.25) > a->deadline_wall_ms)
			ro_unit_end(a, u, END_REQUEUE, NULL);
	}
	/* What a claim may have leased here is requeued, not left to expire and charge an
	 * attempt, so before leaving (not past the deadline): a claim in flight is answered,
	 * and after one that never was (it may run on the server later, or did) the held
	 * rescan (on the tick) looks for what it took. Running, the next claim takes that up
	 * itself: it carries the same request id. */
	if (now < a->deadline_wall_ms) {
		const uint64_t unsure = ro_queue_claim_unsure(a->q);

		if (unsure && a->held_for != unsure) {
			left = true;
			a->held_done = false;
		}
		if (a->claim_busy)
			left = true;
	}
	if (!left)
		a->state = RO_DRAINED;
	pthread_mutex_unlock(&a->mu);
	if (!left) {
		a->last_drain_s = (double)(ro_now_ms() - a->drain_start_ms) / 1000.0;
		ro_log(LOG_NOTICE, "drained in %.2f s (%s)", a->last_drain_s, a->drain_reason);
		ro_notify_status(a);
	}
}
