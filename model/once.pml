/*
 * dblock's minimum hold (min_hold, "once per period"): a model for Spin (see model/README.md).
 *
 * Two clients run the same job once per period: each acquires the name with a
 * hold of HOLD, does its work and releases at once. A release within the hold
 * keeps the lease until its grant + HOLD (database time), so no other grant
 * comes sooner, however late the clients' statements run. Each step names the
 * statement it models, in parentheses after "models:".
 *
 * Mutant:
 *   MUTANT_HOLD_FROM_RELEASE  the release counts the hold from the times its client
 *                             knows (its acquire's send and its release's send),
 *                             not from the grant's database time
 */

#define N 2
#define MAXCLOCK 6
#define HOLD 3
#define TTL 4        /* longer than the hold: a lease ends early only by a release (renewal would keep it) */
#define MAXGRANTS 3

byte clock = 0;
byte owner = 0;
byte expires = 0;
byte acquired = 0;   /* acquired_at: the grant's database time */
byte grants = 0;
byte last = 0;       /* the last grant's database time, for the property */

active [N] proctype Client() {
    byte me = _pid + 1;
    byte sent;       /* when this client sent its acquire */
    byte rsent;      /* when it sent its release */
    bool held;
end:
    do
    :: !held && grants < MAXGRANTS ->
        sent = clock;  /* sent; it may run later */
        /* acquire with min_hold (models: acquire) */
        atomic {
            if
            :: owner == 0 || expires <= clock ->
                /* Once per period: no two grants less than HOLD apart. */
                assert(grants == 0 || clock >= last + HOLD);
                grants++; last = clock; acquired = clock;
                owner = me; expires = clock + TTL; held = true
            :: else -> skip
            fi
        }
    :: held ->
        rsent = clock;
        /* release within the hold: kept until grant + HOLD (models: release_held) */
        atomic {
            if
            :: owner == me ->
#ifdef MUTANT_HOLD_FROM_RELEASE
                /* the hold left, as the client counts it: from its acquire's send to its release's */
                if :: rsent - sent < HOLD -> expires = rsent + (HOLD - (rsent - sent)) :: else -> owner = 0 fi
#else
                if :: clock < acquired + HOLD -> expires = acquired + HOLD :: else -> owner = 0 fi
#endif
            :: else -> skip
            fi;
            held = false; sent = 0; rsent = 0
        }
    od
}

/* The database clock (models: expiry by the database clock). */
active proctype Clock() {
end:
    do
    :: clock < MAXCLOCK -> clock++
    od
}
