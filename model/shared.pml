/*
 * dblock's shared leases beside the exclusive lock: a model for Spin (see model/README.md).
 *
 * Three clients share one name. Each attempt is the exclusive lock (a writer), a
 * reader's lease (no limit), or a semaphore slot with a limit of 1 or 2, the caller's
 * choice: callers may disagree about the limit, and are held to the smallest of the
 * live holders' and their own. The name's row (owner, token, expiry) and the holders
 * table (one row per shared holder) change only in atomic steps, one per statement.
 *
 * Each step names the statement it models, in parentheses after "models:".
 *
 * Mutants:
 *   MUTANT_WRITER_BESIDE_READERS  the exclusive acquire ignores live shared holders
 *   MUTANT_IGNORE_LIMIT           share_acquire admits past the limit
 *   MUTANT_OWN_LIMIT              share_acquire counts against the caller's limit only
 */

#define N 3          /* clients: pids 0..2, ids 1..3 */
#define MAXCLOCK 3
#define TTL 2
#define MAXTOKEN 3
#define SHARED 9     /* the owner the row shows while shared leases hold it */
#define NOLIMIT 9    /* a reader: no limit */

byte clock = 0;
byte seq = 0;

/* the name's row */
byte owner = 0;
byte expires = 0;

/* the holders table: a live row per shared holder */
bool holds[N + 1];
byte hlimit[N + 1];
byte hexp[N + 1];

/* each client's view */
byte kind[N + 1];    /* what it holds: 0 nothing, 1 exclusive, 2 shared */
byte lim[N + 1];     /* a shared holder's limit (NOLIMIT: a reader) */
byte trust[N + 1];

#define live(i) (holds[i] && hexp[i] > clock)
#define trusting(i) (kind[i] != 0 && clock < trust[i])
#define excl(i) (trusting(i) && kind[i] == 1)
#define shr(i) (trusting(i) && kind[i] == 2)

/* No writer beside anyone; no more shared holders than the smallest limit among them. */
#define CHECK \
    assert(!(excl(1) && (trusting(2) || trusting(3)))); \
    assert(!(excl(2) && (trusting(1) || trusting(3)))); \
    assert(!(excl(3) && (trusting(1) || trusting(2)))); \
    assert(!(shr(1) && shr(2) && (lim[1] < 2 || lim[2] < 2))); \
    assert(!(shr(1) && shr(3) && (lim[1] < 2 || lim[3] < 2))); \
    assert(!(shr(2) && shr(3) && (lim[2] < 2 || lim[3] < 2))); \
    assert(!(shr(1) && shr(2) && shr(3) && (lim[1] < 3 || lim[2] < 3 || lim[3] < 3)))

active [N] proctype Client() {
    byte me = _pid + 1;
    byte sent;
    byte want;       /* 0: the exclusive lock; else the shared lease's limit (NOLIMIT: a reader) */
    byte count;      /* live shared holders */
    byte least;      /* the smallest limit among them and the caller's */
    byte i;
    bool granted;
end:
    do
    :: kind[me] == 0 && seq < MAXTOKEN ->
        atomic { if :: want = 0 :: want = 1 :: want = 2 :: want = NOLIMIT fi; sent = clock };
        if
        :: want == 0 ->
            /* the exclusive lock (models: acquire) */
            atomic {
#ifdef MUTANT_WRITER_BESIDE_READERS
                if :: owner == 0 || owner == SHARED || expires <= clock ->
#else
                if :: owner == 0 || expires <= clock ->
#endif
                    seq++; owner = me; expires = clock + TTL; granted = true
                :: else -> granted = false
                fi
            }
        :: else ->
            /* a shared lease (models: share_acquire) */
            atomic {
                count = 0; least = want; i = 1;
                do
                :: i <= N -> if :: live(i) -> count++; if :: hlimit[i] < least -> least = hlimit[i] :: else -> skip fi :: else -> skip fi; i++
                :: else -> break
                od;
#ifdef MUTANT_IGNORE_LIMIT
                least = NOLIMIT;
#endif
#ifdef MUTANT_OWN_LIMIT
                least = want;
#endif
                if
                :: (owner == 0 || owner == SHARED || expires <= clock) && count < least ->
                    seq++; owner = SHARED; holds[me] = true; hlimit[me] = want; hexp[me] = clock + TTL;
                    if :: expires < clock + TTL -> expires = clock + TTL :: else -> skip fi;
                    granted = true
                :: else -> granted = false
                fi;
                i = 0; count = 0; least = 0
            }
        fi;
        atomic {
            if
            :: granted ->
                kind[me] = (want == 0 -> 1 : 2); lim[me] = (want == 0 -> 0 : want);
                trust[me] = sent + TTL;
                CHECK
            :: else -> skip
            fi;
            sent = 0; want = 0; granted = false
        }
    :: kind[me] == 1 ->
        /* release (models: release) */
        atomic { if :: owner == me -> owner = 0 :: else -> skip fi; kind[me] = 0; lim[me] = 0; trust[me] = 0 }
    :: kind[me] == 2 ->
        /* a shared release (models: share_release) */
        atomic {
            if
            :: holds[me] && owner == SHARED ->
                holds[me] = false; hexp[me] = 0;
                /* the row keeps the latest live holder's expiry, or is free when none is left */
                expires = 0; i = 1;
                do
                :: i <= N -> if :: live(i) && hexp[i] > expires -> expires = hexp[i] :: else -> skip fi; i++
                :: else -> break
                od;
                if :: expires == 0 -> owner = 0 :: else -> skip fi;
                i = 0
            :: else -> skip  /* forgotten after it ran out, or a writer took over */
            fi;
            hlimit[me] = 0; kind[me] = 0; lim[me] = 0; trust[me] = 0
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
