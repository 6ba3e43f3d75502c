/*
 * dblock's upgradeable read lock: a model for Spin (see model/README.md).
 *
 * Three clients share one name, as in shared.pml (less the semaphores, which shared.pml
 * covers). Clients 1 and 2 take a reader's lease or the upgradeable reader's; client 3 a
 * reader's lease or the exclusive lock. At most one upgradeable reader lives at a time,
 * beside any number of readers. Its lease becomes the name's write lease once it holds
 * alone (upgrade); while others hold, that look marks it 2, and no shared lease is granted
 * beside it until it upgrades, withdraws its ask, or ends. The write lease goes back to the
 * upgradeable reader's (downgrade). The name's row (owner, expiry) and the holders table
 * change only in atomic steps, one per statement; a client trusts a lease from when it sent
 * the statement, for its ttl.
 *
 * Each step names the statement it models, in parentheses after "models:".
 *
 * Mutants:
 *   MUTANT_UPGRADE_BESIDE_READERS  upgrade does not wait for the other holders to leave
 *   MUTANT_TWO_UPGRADEABLE         share_acquire grants an upgradeable reader beside another
 *   MUTANT_WRITER_BESIDE_READERS   the exclusive acquire ignores live shared holders
 */

#define N 3          /* clients: pids 0..2, ids 1..3 */
#define MAXCLOCK 3
#define TTL 2
#define MAXTOKEN 3
#define SHARED 9     /* the owner the row shows while shared leases hold it */
#define READ 1       /* what a client asks for: a reader's lease */
#define UPG 2        /* the upgradeable reader's lease */

byte clock = 0;
byte seq = 0;

/* the name's row */
byte owner = 0;
byte expires = 0;

/* the holders table: a row per shared holder */
bool holds[N + 1];
byte hexp[N + 1];
byte hup[N + 1];     /* upgradeable: 0 a reader, 1 the upgradeable reader, 2 it asks to upgrade */

/* each client's view */
byte kind[N + 1];    /* what it holds: 0 nothing, 1 the write lease, 2 a shared lease */
bool up[N + 1];      /* the upgradeable reader's lease, or the write lease made from it */
byte trust[N + 1];

#define live(i) (holds[i] && hexp[i] > clock)
#define trusting(i) (kind[i] != 0 && clock < trust[i])
#define excl(i) (trusting(i) && kind[i] == 1)
#define upr(i) (trusting(i) && kind[i] == 2 && up[i])

/* No writer beside anyone; never two upgradeable readers. */
#define CHECK \
    assert(!(excl(1) && (trusting(2) || trusting(3)))); \
    assert(!(excl(2) && (trusting(1) || trusting(3)))); \
    assert(!(excl(3) && (trusting(1) || trusting(2)))); \
    assert(!(upr(1) && upr(2)))

active [N] proctype Client() {
    byte me = _pid + 1;
    byte sent;
    byte want;       /* 0: the exclusive lock; READ; UPG */
    byte count;      /* live shared holders (other than the caller) */
    byte i;
    bool granted;
end:
    do
    :: kind[me] == 0 && seq < MAXTOKEN ->
        atomic {
            if
            :: me < N -> if :: want = READ :: want = UPG fi
            :: else -> if :: want = 0 :: want = READ fi
            fi;
            sent = clock
        };
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
            /* a reader's or the upgradeable reader's lease (models: share_acquire) */
            atomic {
                granted = owner == 0 || owner == SHARED || expires <= clock;
                i = 1;
                do
                :: i <= N ->
                    /* nobody beside an upgradeable reader that asks to upgrade; one upgradeable at a time */
#ifdef MUTANT_TWO_UPGRADEABLE
                    if :: live(i) && hup[i] == 2 -> granted = false :: else -> skip fi;
#else
                    if :: live(i) && (hup[i] == 2 || (hup[i] == 1 && want == UPG)) -> granted = false :: else -> skip fi;
#endif
                    i++
                :: else -> break
                od;
                if
                :: granted ->
                    seq++; owner = SHARED; holds[me] = true; hexp[me] = clock + TTL;
                    hup[me] = (want == UPG -> 1 : 0);
                    if :: expires < clock + TTL -> expires = clock + TTL :: else -> skip fi
                :: else -> skip
                fi;
                i = 0
            }
        fi;
        atomic {
            if
            :: granted ->
                kind[me] = (want == 0 -> 1 : 2); up[me] = (want == UPG); trust[me] = sent + TTL;
                CHECK
            :: else -> skip
            fi;
            sent = 0; want = 0; granted = false
        }
    :: kind[me] == 1 ->
        /* release (models: release) */
        atomic { if :: owner == me -> owner = 0 :: else -> skip fi; kind[me] = 0; up[me] = false; trust[me] = 0 }
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
            hup[me] = 0; kind[me] = 0; up[me] = false; trust[me] = 0
        }
    :: kind[me] == 2 && up[me] && seq < MAXTOKEN ->
        /* the upgradeable reader becomes the writer once it holds alone (models: upgrade) */
        sent = clock;
        atomic {
            if
            :: live(me) && hup[me] > 0 && owner == SHARED ->
                count = 0; i = 1;
                do
                :: i <= N -> if :: i != me && live(i) -> count++ :: else -> skip fi; i++
                :: else -> break
                od;
#ifdef MUTANT_UPGRADE_BESIDE_READERS
                count = 0;
#endif
                if
                :: count == 0 ->
                    seq++; owner = me; expires = clock + TTL;
                    holds[me] = false; hexp[me] = 0; hup[me] = 0;
                    kind[me] = 1; trust[me] = sent + TTL;
                    CHECK
                :: else -> hup[me] = 2  /* it asks: no shared grant beside it from now on */
                fi
            :: else -> kind[me] = 0; up[me] = false; trust[me] = 0  /* it ended: LeaseLost */
            fi;
            sent = 0; count = 0; i = 0
        }
    :: kind[me] == 2 && up[me] && hup[me] == 2 ->
        /* the ask withdrawn, at the wait's timeout (models: downgrade) */
        atomic { if :: live(me) -> hup[me] = 1 :: else -> skip fi }
    :: kind[me] == 1 && up[me] && seq < MAXTOKEN ->
        /* the write lease back to the upgradeable reader's (models: downgrade) */
        sent = clock;
        atomic {
            if
            :: owner == me ->
                seq++; owner = SHARED; holds[me] = true; hup[me] = 1; hexp[me] = clock + TTL; expires = clock + TTL;
                kind[me] = 2; trust[me] = sent + TTL;
                CHECK
            :: else -> kind[me] = 0; up[me] = false; trust[me] = 0  /* taken over: LeaseLost */
            fi;
            sent = 0
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
