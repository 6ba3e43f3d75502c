/*
 * dblock's fair queue on PostgreSQL (the line of waiters and its hand-off walk): a model for
 * Spin (see model/README.md).
 *
 * Three clients share one name. Each wait is for the exclusive lock (a writer), a reader's
 * lease (no limit) or a semaphore slot with a limit of 1 or 2 (callers may disagree). A wait
 * joins the line (enqueue, share_enqueue), looks again, may hear that a release handed it the
 * lease, leaves the line (cancel: its timeout), or its process freezes or crashes (its entry
 * dies); a holder releases. The name's row, the holders table and the line (the waiters
 * table, in arrival order) change only in atomic steps, one per statement: each PL/pgSQL
 * function takes the name's row lock first and runs whole. The walk (locks_admit) is an
 * inline called by the steps whose function calls it, as the functions do.
 *
 * Each step names what it models, in parentheses after "models:": a statement of
 * dblock.backends.base.Statements / QueueStatements, or a function of
 * dblock/backends/postgresql.sql (locks_...).
 *
 * Properties (assertions, checked with -DSAFETY):
 *   CHECK    no writer relies on its lease beside anyone; no more clients rely on shared leases
 *            than the smallest limit among them (as shared.pml)
 *   TRUST    a client starts to rely on a lease only while the database holds it for it at
 *            least as long (G5)
 *   FIFO     a grant leaves no entry that joined before the grantee in the line ("ahead == 0")
 *   HANDOFF  a release or a cancel never leaves the first live waiter in line able to take the
 *            name, unless only a lease that ran out unreleased stands in its way ("!(fits)")
 *   INV      the row's waiting counter is the length of the line; a live holder row means the
 *            row shows SHARED until at least that holder's expiry; a granted waiter has left
 *            the line
 * Progress (with -DLIVENESS, without -DSAFETY, pan -a -f): no waiter stays in line for ever
 * while the name is free (ltl "never_stuck", for client 1; the clients are alike).
 *
 * A bug it found (model/README.md, fixed by migration 0010): share_enqueue answered a holder
 * row of the caller's that ran out long ago, unswept, as a fresh grant (TRUST, then CHECK: a
 * reader beside a writer). -DMUTANT_STALE_HOLDER_GRANTED puts 0008's text back; its
 * counterexample needs -DMAXCLOCK=4 -DMAXJOIN=4 -DMAXSTALE=0 (the default clock, 3, is one
 * tick too short to reach it).
 * With -DWITH_TRY an idle client may also try_acquire the exclusive lock (the acquire
 * statement, which never queues): it takes a lease that ran out unreleased ahead of the line
 * (FIFO breaks; see model/README.md).
 *
 * Mutants (spin -DMUTANT_...), each must yield a counterexample (tests/test_model.py):
 *   MUTANT_WALK_IGNORES_LIMITS   the walk counts only its own grants against the limits, not
 *                                the live holders (nor their limits)
 *   MUTANT_WALK_PAST_WRITER      the walk goes on past a writer it cannot grant, admitting the
 *                                readers behind it
 *   MUTANT_CANCEL_NO_WALK        cancel takes the waiter out of the line, never walks it
 *   MUTANT_EXPIRED_LEASE_HOLDS   a waiter's look and its cancel take an exclusive lease that ran
 *                                out unreleased for a held one: only a release moves the line
 *                                past it (a progress mutant: check it with -DLIVENESS)
 */

#define N 3          /* clients: pids 0..2, ids 1..3 */
#ifndef MAXCLOCK
#define MAXCLOCK 3   /* the database clock runs 0..MAXCLOCK */
#endif
#define TTL 2        /* every lease's ttl */
#ifndef MAXJOIN
#ifdef LIVENESS
#define MAXJOIN 4    /* waits per run, all clients together: fewer for the dearer liveness check */
#else
#define MAXJOIN 5    /* waits per run, all clients together (each wait joins or is granted at once) */
#endif
#endif
#ifndef MAXCRASH
#define MAXCRASH 1   /* crashes per run: a crashed client is gone for good */
#endif
#ifndef MAXSTALE
#define MAXSTALE 1   /* entries that die with their deadline or their listener session, per run */
#endif
#ifndef MAXFREEZE
#define MAXFREEZE 1  /* freezes per run: a frozen process's heartbeat row goes stale */
#endif
#define SHARED 9     /* the owner the row shows while shared leases hold it ('*shared') */
#define NOLIMIT 9    /* a reader: no limit (lim NULL) */
#define NONE 255     /* admit's n IS NULL: a writer holds, nobody in line can be granted */

/* a client's phase */
#define IDLE 0
#define WAIT 1       /* waiting: in line, or about to join it again at its next look */
#define HOLD 2       /* it believes it holds a lease (of the kind it waited for) */
#define GONE 3       /* crashed */

byte clock = 0;

/* the name's row (the lock table) */
byte owner = 0;      /* 0: NULL (free); 1..N: a writer; SHARED */
byte expires = 0;    /* expires_at; 0 also for NULL and, canonically, for any past expiry */
byte waiting = 0;    /* the row's waiting column: the walk and the functions keep it */

/* the holders table: one row per shared holder */
bool holds[N + 1];
byte hlimit[N + 1];  /* lim: NOLIMIT for a reader */
byte hexp[N + 1];    /* its expires_at (0: past) */

/* the waiters table: the line, by seq (arrival order); a client has at most one entry */
byte line[N];
byte qlen = 0;
bool lapsed[N + 1];  /* its process's row in locks_procs is stale: its entries are dead until it beats */
bool stale[N + 1];   /* its entry's own until has passed, or names a listener session that is gone
                        (pg_stat_get_activity): dead until it leaves the line, whatever the client does */

/* each client's own view */
byte phase[N + 1];
byte want[N + 1];    /* its wait: 0 the exclusive lock; else its limit (NOLIMIT: a reader) */
byte trust[N + 1];   /* it relies on its lease while clock < trust (0: not at all) */

byte joins = 0;
byte crashes = 0;
byte freezes = 0;
byte stales = 0;

/* Temporaries of the atomic steps, not part of the state. */
hidden byte n, m, k, v, e, j, h, given, dropped, ahead, g, gm, rows, rmin, wasowner, wasexp;
hidden byte swept, fits, queued, granted, stop;  /* booleans (a hidden bit is not allowed) */

#define live(i) (holds[i] && hexp[i] > clock)
#define dead(i) (lapsed[i] || stale[i])  /* as the walk judges an entry */
#define inq(c) (line[0] == (c) || line[1] == (c) || line[2] == (c))  /* c has an entry (N = 3) */
#define writer(o) ((o) >= 1 && (o) <= N)
#define trusting(i) (phase[i] == HOLD && clock < trust[i])
#define excl(i) (trusting(i) && want[i] == 0)
#define shr(i) (trusting(i) && want[i] != 0)

/* CHECK: no writer beside anyone; no more shared holders than the smallest limit among them. */
#define CHECK \
    assert(!(excl(1) && (trusting(2) || trusting(3)))); \
    assert(!(excl(2) && (trusting(1) || trusting(3)))); \
    assert(!(excl(3) && (trusting(1) || trusting(2)))); \
    assert(!(shr(1) && shr(2) && (want[1] < 2 || want[2] < 2))); \
    assert(!(shr(1) && shr(3) && (want[1] < 2 || want[3] < 2))); \
    assert(!(shr(2) && shr(3) && (want[2] < 2 || want[3] < 2))); \
    assert(!(shr(1) && shr(2) && shr(3) && (want[1] < 3 || want[2] < 3 || want[3] < 3)))

/* INV, at the end of every statement: the code's bookkeeping. */
#define INV \
    assert(waiting == qlen); \
    assert(!live(1) || (owner == SHARED && expires >= hexp[1])); \
    assert(!live(2) || (owner == SHARED && expires >= hexp[2])); \
    assert(!live(3) || (owner == SHARED && expires >= hexp[3]))

/* TRUST, as a client starts to rely on its lease: the database holds that lease for it at
 * least as long (G5), whatever the reply or the notification said. */
#define TRUST(i) \
    assert(trust[i] == 0 || (want[i] == 0 -> (owner == i && expires >= trust[i]) \
                                           : (owner == SHARED && holds[i] && hexp[i] >= trust[i])))

/* FIFO, at every grant: "ahead" entries that joined before the grantee are left in line. */
#define FIFO assert(ahead == 0)

inline remove(at) {  /* DELETE FROM locks_waiters ... (the entry at position at) */
    stale[line[at]] = false;  /* the flag is the entry's: gone with it */
    j = at;
    do
    :: j + 1 < qlen -> line[j] = line[j + 1]; j++
    :: else -> break
    od;
    qlen--; line[qlen] = 0
}

inline position(c) {  /* j: the position of c's entry, qlen if it has none */
    j = 0;
    do
    :: j < qlen && line[j] != c -> j++
    :: else -> break
    od
}

inline sweep() {  /* DELETE FROM locks_holders WHERE expires_at <= now(): holders that ran out are forgotten */
    j = 1;
    do
    :: j <= N -> if :: holds[j] && hexp[j] <= clock -> holds[j] = false; hlimit[j] = 0; hexp[j] = 0 :: else -> skip fi; j++
    :: else -> break
    od
}

inline count() {  /* SELECT count(*), min(lim) FROM locks_holders (m: NOLIMIT for NULL) */
    n = 0; m = NOLIMIT; j = 1;
    do
    :: j <= N -> if :: holds[j] -> n++; if :: hlimit[j] < m -> m = hlimit[j] :: else -> skip fi :: else -> skip fi; j++
    :: else -> break
    od
}

/* The walk (models: locks_admit). pself: p_self (0: NULL); pfree: p_free; the caller sets
 * dropped (p_dropped). Every entry it passes is taken out of the line: a dead one skipped, a
 * granted one; it stops at the first live entry it cannot grant. */
inline admit(pself, pfree) {
    given = 0; swept = false; k = 0; g = 0; gm = NOLIMIT;
    if
    :: !pfree && writer(owner) && expires > clock -> n = NONE  /* a writer holds */
    :: else ->
        if
        :: owner == SHARED && expires > clock -> sweep(); swept = true; count()
        :: else -> n = 0; m = NOLIMIT  /* no live holder */
        fi
    fi;
    if
    :: n != NONE ->
        do
        :: k >= qlen -> break
        :: else ->
            v = line[k];
            if
            :: v != pself && dead(v) ->
                remove(k); dropped++  /* dead: skipped and removed */
            :: else ->
                if
                :: want[v] == 0 ->
                    /* a writer: granted when nothing is held; either way the walk ends here */
                    if
                    :: n == 0 ->
                        ahead = k; FIFO;
                        remove(k);
                        owner = v; expires = clock + TTL;
                        waiting = waiting - dropped - 1; dropped = 0; given++;
                        break
                    :: else ->
#ifdef MUTANT_WALK_PAST_WRITER
                        k++  /* on past the writer */
#else
                        break
#endif
                    fi
                :: else ->
                    /* a reader or a semaphore waiter: the smallest limit of it and every live holder binds */
#ifdef MUTANT_WALK_IGNORES_LIMITS
                    if :: g >= want[v] || g >= gm -> break :: else -> skip fi;
#else
                    if :: n >= want[v] || n >= m -> break :: else -> skip fi;
#endif
                    ahead = k; FIFO;
                    remove(k);
                    if :: !swept -> sweep(); swept = true :: else -> skip fi;
                    e = clock + TTL;
                    /* the row's expiry covers the live holders (n of them): with none, a released holder's is stale */
                    if
                    :: n > 0 && owner == SHARED && expires > clock -> if :: e > expires -> expires = e :: else -> skip fi
                    :: else -> expires = e
                    fi;
                    owner = SHARED;
                    waiting = waiting - dropped - 1;
                    holds[v] = true; hlimit[v] = want[v]; hexp[v] = e;
                    dropped = 0; n++;
                    if :: want[v] < m -> m = want[v] :: else -> skip fi;
                    g++; if :: want[v] < gm -> gm = want[v] :: else -> skip fi;
                    given++
                fi
            fi
        od
    :: else -> skip
    fi;
    if
    :: pfree && given == 0 -> owner = 0; expires = 0
    :: else -> skip
    fi;
    waiting = waiting - dropped; dropped = 0
}

/* HANDOFF, after a release or a cancel: the first live entry (h) could not take the name,
 * counting as held every lease the rows still show, run out or not. */
inline handoff_check() {
    j = 0; h = 0;
    do
    :: j < qlen && h == 0 -> if :: !dead(line[j]) -> h = line[j] :: else -> skip fi; j++
    :: else -> break
    od;
    if
    :: h != 0 ->
        rows = 0; rmin = NOLIMIT; j = 1;
        do
        :: j <= N -> if :: holds[j] -> rows++; if :: hlimit[j] < rmin -> rmin = hlimit[j] :: else -> skip fi :: else -> skip fi; j++
        :: else -> break
        od;
        fits = (!writer(owner) && (want[h] == 0 -> rows == 0 : (rows < want[h] && rows < rmin)));
        assert(!fits)
    :: else -> skip
    fi
}

/* share_acquire as share_enqueue calls it for a newcomer (models: share_acquire). */
inline share_acquire(me) {
    if
    :: writer(owner) && expires > clock -> skip  /* the look first: a writer holds */
    :: else ->
        if
        :: owner == SHARED && holds[me] ->
            /* ours already (G6): the token kept, the expiry renewed */
            if :: hexp[me] < clock + TTL -> hexp[me] = clock + TTL :: else -> skip fi;
            if :: expires < hexp[me] -> expires = hexp[me] :: else -> skip fi;
            granted = true
        :: else ->
            stop = false;
            if
            :: waiting > 0 ->
                /* the line goes first; while anyone is left in it, a newcomer waits too */
                dropped = 0; admit(0, false);
                if :: qlen > 0 || (writer(owner) && expires > clock) -> stop = true :: else -> skip fi
            :: else -> skip
            fi;
            if
            :: !stop ->
                sweep(); count();
                if
                :: n >= want[me] || n >= m -> skip  /* full */
                :: else ->
                    ahead = qlen; FIFO;
                    e = clock + TTL;
                    holds[me] = true; hlimit[me] = want[me]; hexp[me] = e;
                    if
                    :: owner == SHARED -> if :: e > expires -> expires = e :: else -> skip fi
                    :: else -> expires = e
                    fi;
                    owner = SHARED;
                    granted = true
                fi
            :: else -> skip
            fi
        fi
    fi
}

/* A shared wait's call (models: share_enqueue: locks_share_enqueue): its first, or a look. */
inline share_enqueue(me) {
    position(me); queued = (j < qlen); granted = false; stop = false;
    if
    :: !queued -> share_acquire(me); stop = granted
    :: else ->
#ifdef MUTANT_EXPIRED_LEASE_HOLDS
        if :: writer(owner) -> stop = true :: else -> skip fi
#else
        if :: writer(owner) && expires > clock -> stop = true :: else -> skip fi  /* a writer holds: writes nothing */
#endif
    fi;
    if
    :: !stop ->
        if
        :: owner == SHARED && holds[me] ->
            /* handed to us by a release we have not heard of yet: the expiry renewed */
            if :: hexp[me] < clock + TTL -> hexp[me] = clock + TTL :: else -> skip fi;
            if :: expires < hexp[me] -> expires = hexp[me] :: else -> skip fi;
            granted = true
        :: else ->
            lapsed[me] = false;  /* its process's heartbeat row, upserted */
            if :: !queued -> line[qlen] = me; qlen++; waiting++; stale[me] = false :: else -> skip fi;
#ifdef MUTANT_EXPIRED_LEASE_HOLDS
            if :: owner == 0 || owner == SHARED || (!queued && expires <= clock) ->
#else
            if :: owner == 0 || owner == SHARED || expires <= clock ->
#endif
                dropped = 0; admit(me, false);
#ifdef MUTANT_STALE_HOLDER_GRANTED
                granted = holds[me]  /* 0008's text: any holder row of the caller's, even one that ran out */
#else
                granted = live(me)  /* the walk admitted it: a live holder row (migration 0010) */
#endif
            :: else -> skip
            fi
        fi
    :: else -> skip
    fi;
    if :: granted -> trust[me] = clock + TTL :: else -> skip fi  /* a reply's grant: trusted from its send (G5) */
}

/* An exclusive wait's call (models: enqueue: locks_enqueue): its first, or a look. */
inline enqueue(me) {
    position(me); queued = (j < qlen); granted = false;
#ifdef MUTANT_EXPIRED_LEASE_HOLDS
    if :: queued && owner != 0 && owner != me -> skip
#else
    if :: queued && owner != 0 && owner != me && expires > clock -> skip  /* held, and we are in line: writes nothing */
#endif
    :: else ->
        if
        :: owner == me ->
            /* handed to us by a release we have not heard of yet: the expiry renewed */
            if :: expires < clock + TTL -> expires = clock + TTL :: else -> skip fi;
            granted = true
        :: else ->
#ifdef MUTANT_EXPIRED_LEASE_HOLDS
            if :: owner == 0 || owner == SHARED || (!queued && expires <= clock) ->
#else
            if :: owner == 0 || owner == SHARED || expires <= clock ->
#endif
                /* free, run out unreleased, or held by readers: the line goes first */
                if :: waiting > 0 -> dropped = 0; admit(me, false) :: else -> skip fi;
                if
                :: owner == me -> granted = true
                :: !queued && (owner == 0 || expires <= clock) && waiting == 0 ->
                    /* free and nobody waits: ours */
                    ahead = qlen; FIFO;
                    owner = me; expires = clock + TTL; granted = true
                :: else -> skip
                fi
            :: else -> skip
            fi;
            if
            :: !granted ->
                if :: !queued -> line[qlen] = me; qlen++; waiting++; stale[me] = false :: else -> skip fi;
                lapsed[me] = false  /* its process's heartbeat row, upserted */
            :: else -> skip
            fi
        fi
    fi;
    if :: granted -> trust[me] = clock + TTL :: else -> skip fi  /* a reply's grant: trusted from its send (G5) */
}

/* Leave the line (models: cancel: locks_cancel): the wait's timeout, or giving up. */
inline cancel(me) {
    position(me); dropped = 0;
    if :: j < qlen -> remove(j); dropped = 1 :: else -> skip fi;
    wasowner = owner; wasexp = expires;
#ifdef MUTANT_CANCEL_NO_WALK
    if :: false ->
#else
#ifdef MUTANT_EXPIRED_LEASE_HOLDS
    if :: owner != me && (owner == 0 || owner == SHARED) ->
#else
    if :: owner != me && (owner == 0 || owner == SHARED || expires <= clock) ->
#endif
#endif
        /* the line may move: the lease ran out unreleased, or the waiter that left held up those behind it */
        admit(0, false)
    :: else -> waiting = waiting - dropped; dropped = 0
    fi;
    /* a release handed us the lease first: the caller keeps it */
    if
    :: wasowner == SHARED && holds[me] -> granted = true
    :: wasowner == me -> granted = true
    :: else -> granted = false
    fi;
    handoff_check();
    if :: granted -> refresh(me) :: else -> skip fi
}

/* The client is done with its owner id: a later wait is another attempt, with another id. The
 * code never reads a finished attempt's rows again; one left in the holders table (a release
 * that found the row no longer shared) has run out and is never counted. */
inline retire(me) {
    assert(owner != me);
    if :: holds[me] -> assert(hexp[me] <= clock); holds[me] = false; hlimit[me] = 0; hexp[me] = 0 :: else -> skip fi;
    phase[me] = IDLE; want[me] = 0; trust[me] = 0; lapsed[me] = false
}

/* A lease handed to the client (heard of, or reported by its cancel): trusted until its expiry,
 * or, when little of it is left (core.needs_refresh; here: it has run out by the database
 * clock), extended once first. The extend fails if the lease is no longer the client's (then it
 * is not granted: granted = false). (models: extend, share_extend) */
inline refresh(me) {
    if
    :: want[me] == 0 && owner == me ->
        if :: expires <= clock -> expires = clock + TTL :: else -> skip fi;
        trust[me] = expires
    :: want[me] != 0 && owner == SHARED && holds[me] ->
        if :: hexp[me] <= clock -> hexp[me] = clock + TTL :: else -> skip fi;
        if :: expires < hexp[me] -> expires = hexp[me] :: else -> skip fi;
        trust[me] = hexp[me]
    :: else -> granted = false  /* run out and taken over: the extend finds nothing */
    fi
}

/* Granted: it holds and relies on its lease until trust (at most the database's expiry, which
 * the trust of a handed lease, core.handed_trust, never exceeds). */
inline hold(me) {
    phase[me] = HOLD; lapsed[me] = false;
    if :: trust[me] <= clock -> trust[me] = 0 :: else -> skip fi;
    CHECK;
    TRUST(me);
    position(me); assert(j == qlen)  /* a granted waiter has left the line */
}

inline join(me, kind) {
    joins++; want[me] = kind; phase[me] = WAIT;
    if :: kind == 0 -> enqueue(me) :: else -> share_enqueue(me) fi;
    if :: granted -> hold(me) :: else -> skip fi;
    INV
}

active [N] proctype Client() {
    byte me = _pid + 1;
end:
    do
    /* a wait begins: its first call tries and, if it must wait, joins the line */
    :: d_step { phase[me] == IDLE && joins < MAXJOIN; join(me, 0) }        /* (models: enqueue) */
    :: d_step { phase[me] == IDLE && joins < MAXJOIN; join(me, NOLIMIT) }  /* (models: share_enqueue: a reader) */
    :: d_step { phase[me] == IDLE && joins < MAXJOIN; join(me, 1) }        /* (models: share_enqueue: a semaphore of 1) */
    :: d_step { phase[me] == IDLE && joins < MAXJOIN; join(me, 2) }        /* (models: share_enqueue: a semaphore of 2) */

    /* a look: woken by a notification that may be lost, or polling (models: enqueue, share_enqueue) */
    :: d_step {
        phase[me] == WAIT;
        if :: want[me] == 0 -> enqueue(me) :: else -> share_enqueue(me) fi;
        if :: granted -> hold(me) :: else -> skip fi;
        INV
       }

    /* it hears a hand-off's NOTIFY, out of the line already (models: locks_admit: pg_notify) */
    :: d_step {
        phase[me] == WAIT && !inq(me) && ((want[me] == 0 && owner == me) || (want[me] != 0 && owner == SHARED && holds[me]));
        granted = true; refresh(me);
        hold(me);
        INV
       }

    /* its timeout: it leaves the line, or keeps a lease a release handed it first (models: cancel) */
    :: d_step {
        phase[me] == WAIT;
        cancel(me);
        if :: granted -> hold(me) :: else -> retire(me) fi;
        INV
       }

    /* its process freezes: the heartbeat row goes stale, its entries are dead (models: expiry of its heartbeat row) */
    :: d_step { phase[me] == WAIT && !lapsed[me] && freezes < MAXFREEZE; freezes++; lapsed[me] = true }
    /* it wakes: the heartbeat again (models: beat) */
    :: d_step { phase[me] == WAIT && lapsed[me]; lapsed[me] = false }
    /* its entry dies for good: its own until passes, or its listener's session ends while it
     * waits on; a look never renews either (models: locks_admit: its until and session checks) */
    :: d_step { phase[me] == WAIT && inq(me) && !stale[me] && stales < MAXSTALE; stales++; stale[me] = true }

    /* renewal: the holder extends its lease, or learns it lost it (models: extend, share_extend) */
    :: d_step {
        phase[me] == HOLD;
        if
        :: want[me] == 0 && owner == me ->
            if :: expires < clock + TTL -> expires = clock + TTL :: else -> skip fi;  /* never shorter */
            trust[me] = clock + TTL
        :: want[me] != 0 && owner == SHARED && holds[me] ->
            if :: hexp[me] < clock + TTL -> hexp[me] = clock + TTL :: else -> skip fi;
            if :: expires < hexp[me] -> expires = hexp[me] :: else -> skip fi;
            trust[me] = clock + TTL
        :: else -> trust[me] = 0  /* zero rows: released, or run out and taken over (LeaseLost) */
        fi;
        CHECK;
        TRUST(me);
        INV
       }

#ifdef WITH_TRY
    /* try_acquire of the exclusive lock: one attempt, never queued (models: acquire) */
    :: d_step {
        phase[me] == IDLE && joins < MAXJOIN;
        joins++;
        if
        :: owner == 0 || expires <= clock ->
            ahead = qlen; FIFO;
            want[me] = 0; owner = me; expires = clock + TTL; trust[me] = clock + TTL;
            hold(me)
        :: else -> skip  /* held: a miss, nothing written */
        fi;
        INV
       }
#endif

    /* release (models: release: locks_handoff, locks_admit with p_free) */
    :: d_step {
        phase[me] == HOLD && want[me] == 0;
        if
        :: owner == me ->
            if
            :: waiting == 0 -> owner = 0; expires = 0  /* nobody waits: one UPDATE */
            :: else -> dropped = 0; admit(0, true)
            fi;
            handoff_check()
        :: else -> skip  /* zero rows: taken over after it ran out */
        fi;
        retire(me);
        INV
       }

    /* a shared release (models: share_release: locks_share_release) */
    :: d_step {
        phase[me] == HOLD && want[me] != 0;
        if
        :: owner == SHARED && holds[me] ->
            holds[me] = false; hlimit[me] = 0; hexp[me] = 0;
            e = 0; j = 1;
            do
            :: j <= N -> if :: live(j) && hexp[j] > e -> e = hexp[j] :: else -> skip fi; j++
            :: else -> break
            od;
            if
            :: e != 0 ->
                expires = e;
                if :: waiting > 0 -> dropped = 0; admit(0, false) :: else -> skip fi  /* a slot came free */
            :: else ->
                if
                :: waiting > 0 -> dropped = 0; admit(0, true)  /* the last holder out: the line's head takes the name */
                :: else -> owner = 0; expires = 0
                fi
            fi;
            handoff_check()
        :: else -> skip  /* zero rows: it ran out and was forgotten, or taken over */
        fi;
        retire(me);
        INV
       }

    /* a crash: it relies on nothing, its lease runs out by the clock (models: beat: no more) */
    :: d_step {
        phase[me] != GONE && crashes < MAXCRASH;
        crashes++; phase[me] = GONE; trust[me] = 0;
        position(me); if :: j == qlen -> lapsed[me] = true :: else -> skip fi  /* no entry: nothing to die */
       }
    /* its listener session is gone, or its heartbeat row goes stale: its entry is dead (models: expiry of its heartbeat row) */
    :: d_step { phase[me] == GONE && !lapsed[me]; lapsed[me] = true }
    od
}

/* The database clock: leases expire (models: expiry by the database clock). Past values are
 * kept as 0: every statement compares them with now() alone. */
active proctype Clock() {
end:
    do
    :: d_step {
        clock < MAXCLOCK;
        clock++;
        if :: writer(owner) || owner == SHARED -> if :: expires <= clock -> expires = 0 :: else -> skip fi :: else -> skip fi;
        j = 1;
        do
        :: j <= N ->
            if :: holds[j] && hexp[j] <= clock -> hexp[j] = 0 :: else -> skip fi;
            if :: trust[j] <= clock -> trust[j] = 0 :: else -> skip fi;
            j++
        :: else -> break
        od
       }
    od
}

#ifdef LIVENESS
/* No waiter stays in line for ever while the name is free: no live writer, no live holder. */
#define FREE (!(writer(owner) && expires > clock) && !live(1) && !live(2) && !live(3))
ltl never_stuck { [] <> !(phase[1] == WAIT && FREE) }
#endif
