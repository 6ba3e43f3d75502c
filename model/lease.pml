/*
 * dblock's exclusive lease, fenced: a model for Spin (see model/README.md).
 *
 * Two clients share one name. The lock row is a few globals changed only by
 * atomic steps, one per statement (the database runs each statement under the
 * row lock). The database clock advances on its own, up to MAXCLOCK. A client
 * may be paused between any two of its steps for as long as the clock runs:
 * Spin explores every interleaving, and every pause is one.
 *
 * Each step names the statement (a field of dblock.backends.base.Statements)
 * or the function it models, in a comment "models: ...".
 *
 * Mutants (spin -DMUTANT_...) are the bug classes the races found; each must
 * yield a counterexample (see tests/test_model.py):
 *   MUTANT_TOKEN_BEFORE_LOCK  the token is drawn before the row lock is taken
 *   MUTANT_EXTEND_SHORTENS    an extend sets now + ttl even where that is earlier
 *   MUTANT_RELEASE_BY_NAME    release clears the name without comparing owner and token
 *   MUTANT_TRUST_FROM_REPLY   the client trusts a lease from the reply, not the send
 *   MUTANT_NO_FENCE           a fenced write does not compare tokens
 */

#define N 2          /* clients: pids 0 and 1 are Client, their ids 1 and 2 */
#define MAXCLOCK 4   /* the database clock runs 0..MAXCLOCK */
#define LONG 2       /* the two ttls a caller may ask for */
#define SHORT 1
#define MAXTOKEN 3   /* grants per run: the sequence stops here (bounds the state space) */

byte clock = 0;      /* database time */

/* the lock row: Statements.acquire / release / extend read and write these */
byte owner = 0;      /* 0: free; else the owner id that holds it */
byte token = 0;      /* the last grant's token */
byte expires = 0;    /* expires_at */
byte seq = 0;        /* the token sequence (nextval) */

/* the fenced resource (fencing.fenced_update): the newest token whose write was accepted */
byte wrote = 0;

/* each client's own view (index: owner id) */
bool held[N + 1];    /* it believes it holds the lease */
byte mine[N + 1];    /* its lease's token */
byte trust[N + 1];   /* it relies on the lease while clock < trust */

#define trusting(i) (held[i] && clock < trust[i])
/* At most one client relies on the lease at any time (the lock's promise). A client starts
 * to rely on it only when a reply arrives (a grant, an extend) and stops as the clock runs:
 * checking there covers every state. */
#define MUTEX assert(!(trusting(1) && trusting(2)))

active [N] proctype Client() {
    byte me = _pid + 1;
    byte sent;       /* database time when the statement was sent */
    byte ttl;
    byte t;
    bool replied;
end:  /* a client may stop anywhere in this loop: a valid end state */
    do
    :: !held[me] && seq < MAXTOKEN ->
        /* acquire (models: acquire; retry by the same owner after a lost reply) */
        atomic { if :: ttl = LONG :: ttl = SHORT fi; sent = clock };  /* sent; it may wait before it runs */
#ifdef MUTANT_TOKEN_BEFORE_LOCK
        atomic { seq++; t = seq };  /* drawn first, written later */
#endif
        atomic {
            if
            :: owner == 0 || expires <= clock || owner == me ->
                if
                :: owner == me -> skip  /* a retry by the same owner keeps its token */
                :: else ->
#ifdef MUTANT_TOKEN_BEFORE_LOCK
                    token = t;
#else
                    seq++; token = seq;  /* drawn under the row lock */
#endif
                    assert(token == seq)  /* each grant's token is larger than every earlier one */
                fi;
                /* a retry by the owner never shortens its lease; a new owner's lease is clock + ttl */
                if :: owner != me || expires < clock + ttl -> expires = clock + ttl :: else -> skip fi;
                owner = me;
                t = token;  /* the reply carries the row's token as this statement left it */
                replied = true
            :: else -> replied = false  /* a miss: held by another, unexpired */
            fi
        };
        atomic {
        if
        :: replied ->
            if
            :: /* the reply arrives */
                mine[me] = t;
#ifdef MUTANT_TRUST_FROM_REPLY
                trust[me] = clock + ttl;
#else
                trust[me] = sent + ttl;  /* from the send: never past the database's expiry */
#endif
                held[me] = true;
                MUTEX
            :: skip  /* the reply is lost: the next attempt (same owner) takes the lease up */
            fi
        :: else -> skip
        fi;
        sent = 0; ttl = 0; t = 0; replied = false  /* locals forgotten: fewer states */
        }

    :: held[me] ->
        /* extend (models: extend, extend_many: renewal) */
        atomic { if :: ttl = LONG :: ttl = SHORT fi; sent = clock };
        atomic {
            if
            :: owner == me && token == mine[me] ->
#ifdef MUTANT_EXTEND_SHORTENS
                expires = clock + ttl;
#else
                if :: expires < clock + ttl -> expires = clock + ttl :: else -> skip fi;  /* never shorter */
#endif
                replied = true
            :: else -> replied = false  /* released or taken over: lost */
            fi
        };
        atomic {
        if
        :: replied -> if :: trust[me] < sent + ttl -> trust[me] = sent + ttl :: else -> skip fi; MUTEX
        :: else -> held[me] = false
        fi;
        sent = 0; ttl = 0; replied = false
        }

    :: held[me] ->
        /* release (models: release, released) */
        atomic {
#ifdef MUTANT_RELEASE_BY_NAME
            owner = 0;
#else
            if :: owner == me && token == mine[me] -> owner = 0; expires = 0 :: else -> skip fi;  /* the lease is cleared */
#endif
            held[me] = false
        }

    :: mine[me] > 0 ->
        /* a fenced write with this client's token, trusted or stale (models: fencing.fenced_update) */
        atomic {
#ifdef MUTANT_NO_FENCE
            if :: true ->
#else
            if :: mine[me] >= wrote ->
#endif
                assert(mine[me] >= wrote);  /* no write older than one accepted */
                wrote = mine[me]
            :: else -> skip  /* refused: FencedOut, nothing written */
            fi
        }
    od
}

/* The database clock: time passes, leases expire (models: expiry by the database clock). */
active proctype Clock() {
end:
    do
    :: clock < MAXCLOCK -> clock++
    od
}
