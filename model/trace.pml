/*
 * A trace recorded from a real run of dblock, checked against the steps of lease.pml and
 * shared.pml: a trace model for Spin (see model/README.md and tools/model_trace.py).
 *
 * tools/model_trace.py records every change of one name's lock row and of its holders,
 * in commit order, with the database clock; it turns each transaction's changes into the
 * models' steps, one event each, and writes the events as a C array, TRACE, which this
 * model reads one event at a time. So Spin follows a single path, the recorded one: for
 * each event it asserts that the models allow the step in the state the trace has reached
 * (the step's guard), takes the step as the model does, and asserts that the database
 * wrote what the step writes. The first assertion that fails names the first recorded
 * step the models do not allow; `nev` is its index in the trace (`./pan -r` prints it).
 *
 * The state is lease.pml's row, token sequence and clock, shared.pml's holders table, and
 * each client's view of what it holds (lease.pml's held and mine). A client is one owner
 * id (dblock draws one per attempt); the generator gives each a slot, and gives a slot
 * again once its client no longer appears, with a HELLO that checks it was left clean.
 * Times are integers: microseconds since just before the trace began.
 *
 * The includer (the generated file) defines:
 *   LEN               the number of events
 *   SLOTS             the size of the client arrays: slots 2..SLOTS-1 are clients
 *   TTL_FITS(lo, hi)  whether a ttl the clients ask for lies in [lo, hi] (lease.pml's LONG
 *                     and SHORT are the two ttls a client may ask for; a race asks for its own)
 * and the C array TRACE[LEN][9]: kind, who, tok, exp, at, began, a, b (see the K_ codes),
 * and the recorded change the event comes from.
 *
 * What each event carries: `at` is the database clock when the row changed (the trigger's
 * clock_timestamp()); `began` when the statement's transaction began (now()), the time the
 * statements' checks read. dblock computes a new expiry from clock_timestamp() after it
 * takes the row lock, so an expiry exp with the ttl T was computed in [began, at]: T lies
 * in [exp - at, exp - began]. The guards read the clock at `at`: a statement's checks ran
 * at `began` <= `at`, and every guard below that held at an earlier clock holds at a later
 * one (a lease that ran out stays run out), so a step the code took is one the model
 * allows at `at`.
 *
 * Each step says which step of lease.pml or shared.pml it mirrors, and, as those do, the
 * statements it models ("models: ..."). Checking real traces found two places where those
 * models left out steps the code takes (a release clears the expiry, and a shared release
 * shortens the row's expiry or frees the row); both models now take them.
 *
 * Kept in step with tools/model_trace.py, which reads the K_ codes from this file.
 */

#define FREE 0       /* the row's owner: nobody (NULL) */
#define SHARED 1     /* the row's owner while shared leases hold the name ('*shared') */
#define FIRST 2      /* the first client slot */
#define NOLIMIT 255  /* a reader's limit: none */

/* The events (the first column of TRACE). */
#define K_SYNC 1           /* the row as recorded at a transaction's start or end: who, tok, exp */
#define K_HELLO 2          /* a new client takes slot who */
#define K_GRANT 3          /* the exclusive lease to who: token tok, expiry exp */
#define K_RENEW 4          /* who's exclusive lease tok now expires at exp */
#define K_RELEASE 5        /* who ends its exclusive lease tok */
#define K_SHARE_GRANT 6    /* a shared lease to who: token tok, expiry exp, limit a; the row's expiry b */
#define K_SHARE_RENEW 7    /* who's shared lease tok now expires at exp; the row's expiry b */
#define K_SHARE_RELEASE 8  /* who ends its shared lease tok; the row's owner is then a, its expiry b */
#define K_FORGET 9         /* who's shared lease tok, run out, is deleted from the holders */
#define K_UNKNOWN 10       /* a change no step of the models makes (model_trace.py says which) */

int clock;           /* the database clock (lease.pml: Clock) */

/* the lock row (lease.pml) */
byte owner = FREE;
int token;           /* the last grant's token */
int expires;         /* expires_at */
int seq;             /* the token sequence: the largest token a grant that committed drew */

/* the holders table (shared.pml): a row per shared lease, by client slot */
bool holds[SLOTS];
int htoken[SLOTS];
int hexp[SLOTS];
byte hlim[SLOTS];

/* each client's view (lease.pml): it believes it holds a lease, and that lease's token */
bool held[SLOTS];
int mine[SLOTS];

/* the event being checked, and its index */
int nev;
byte ev;
byte who;
int tok;
int exp;
int at;
int began;
int a;
int b;

/* scratch of a step (zeroed after it: fewer states) */
byte i;
byte count;
byte least;
int need;

#define live(j) (holds[j] && hexp[j] > clock)

/* count: the live shared leases; least: the smallest of `least` and their limits */
#define COUNT_LIVE \
    count = 0; i = FIRST; \
    do \
    :: i < SLOTS -> \
        if \
        :: live(i) -> count++; if :: hlim[i] < least -> least = hlim[i] :: else -> skip fi \
        :: else -> skip \
        fi; \
        i++ \
    :: else -> break \
    od

/*
 * The database's side of the models' properties, after every step. The models assert
 * them on what clients rely on, which a recording of the database cannot show; these are
 * what the database must keep for the clients' trust to be safe:
 *   shared.pml: no live writer's lease beside a live shared lease;
 *   shared.pml: no more live shared leases than the smallest limit among them;
 *   while shared leases hold the name, the row's expiry is no earlier than any of theirs
 *   (the acquire statement counts no holders: a writer it serves waits for the row).
 */
#define SAFE \
    least = NOLIMIT; COUNT_LIVE; \
    assert(count <= least); \
    i = FIRST; \
    do \
    :: i < SLOTS -> \
        if \
        :: live(i) -> \
            assert(!(owner >= FIRST && expires > clock)); \
            assert(owner == SHARED && expires >= hexp[i]) \
        :: else -> skip \
        fi; \
        i++ \
    :: else -> break \
    od; \
    i = 0; count = 0; least = 0

#define HOLDER (who >= FIRST && held[who] && mine[who] == tok)  /* a client, with the token of its lease */

active proctype Check() {
end:
    do
    :: nev < LEN ->
        d_step {
            c_code {
                now.ev = TRACE[now.nev][0]; now.who = TRACE[now.nev][1]; now.tok = TRACE[now.nev][2];
                now.exp = TRACE[now.nev][3]; now.at = TRACE[now.nev][4]; now.began = TRACE[now.nev][5];
                now.a = TRACE[now.nev][6]; now.b = TRACE[now.nev][7];
            };
            printf("event %d\n", nev);  /* shown only when the trail is replayed */
            /* The database clock only runs forward (lease.pml: Clock); a statement began before it wrote. */
            assert(began <= at && at >= clock);
            clock = at;
            if
            :: ev == K_SYNC ->
                /* The row as the database had it at a transaction's start (nothing changed it
                 * unrecorded since the last transaction) or end (the steps wrote what the
                 * database did). A free row's expiry means nothing (NULL in the table). */
                assert(owner == who && token == tok && (owner == FREE || expires == exp))

            :: ev == K_HELLO ->
                /* A slot given again: its last client left nothing in the row or the holders. */
                assert(who >= FIRST && owner != who && !holds[who]);
                held[who] = false; mine[who] = 0

            :: ev == K_GRANT ->
                /* Mirrors lease.pml's acquire, a grant to a new owner (the same owner's retry keeps
                 * its token: K_RENEW), and shared.pml's exclusive acquire, whose guard is lease.pml's
                 * (models: acquire; enqueue, release and cancel: the fair queue's grants). */
                assert(who >= FIRST && owner != who);
                /* Free, or the lease ran out; or no shared lease is live: shared.pml's last live
                 * holder's release frees the row, and the fair queue hands the name on in that
                 * same statement, before the row's expiry (perhaps the released lease's) passed. */
                least = NOLIMIT; COUNT_LIVE;
                assert(owner == FREE || expires <= clock || (owner == SHARED && count == 0));
                i = 0; count = 0; least = 0;
                assert(tok > seq);  /* drawn under the row lock: larger than every earlier grant's */
                assert(TTL_FITS(exp - at, exp - began));  /* clock + a ttl the client asked for */
                seq = tok; token = tok; owner = who;
                expires = exp;  /* a new owner's lease: clock + ttl (lease.pml, shared.pml) */
                held[who] = true; mine[who] = tok

            :: ev == K_RENEW ->
                /* Mirrors lease.pml's extend, and its acquire's retry by the same owner, which keeps
                 * the token: by the holder, with its token, never shorter (models: extend; acquire:
                 * a retry; enqueue: the renewal of a lease a release handed the caller). */
                assert(HOLDER && owner == who && token == tok);
                assert(exp == expires || (exp > expires && TTL_FITS(exp - at, exp - began)));
                expires = exp

            :: ev == K_RELEASE ->
                /* Mirrors lease.pml's release, comparing owner and token (models: release). */
                assert(HOLDER && owner == who && token == tok);
                owner = FREE;
                expires = 0;  /* the lease is cleared (expires_at NULL) */
                held[who] = false

            :: ev == K_SHARE_GRANT ->
                /* Mirrors shared.pml's share_acquire grant: no live writer, and fewer live holders
                 * than the smallest of their limits and the caller's, a (NOLIMIT: a reader)
                 * (models: share_acquire; share_enqueue, release, share_release and cancel: the
                 * fair queue's grants). */
                assert(who >= FIRST && !holds[who]);
                assert(owner == FREE || owner == SHARED || expires <= clock);
                least = a; COUNT_LIVE;
                assert(count < least);
                assert(tok > seq);
                assert(TTL_FITS(exp - at, exp - began));
                seq = tok; token = tok; owner = SHARED;
                holds[who] = true; htoken[who] = tok; hexp[who] = exp; hlim[who] = a;
                /* the later of the row's and clock + ttl; with no live holder, clock + ttl (migration 0010:
                 * a released holder's expiry is not kept) */
                if :: count == 0 || expires < exp -> expires = exp :: else -> skip fi;
                assert(b == expires);
                held[who] = true; mine[who] = tok;
                i = 0; count = 0; least = 0

            :: ev == K_SHARE_RENEW ->
                /* Not in shared.pml, which has no extend of a shared lease: mirrors lease.pml's
                 * extend, on the holder's row, while shared leases hold the name; the row's expiry
                 * follows (models: share_extend; share_acquire and share_enqueue: a retry). */
                assert(HOLDER && owner == SHARED && holds[who] && htoken[who] == tok);
                assert(exp == hexp[who] || (exp > hexp[who] && TTL_FITS(exp - at, exp - began)));
                hexp[who] = exp;
                if :: expires < exp -> expires = exp :: else -> skip fi;
                assert(b == expires)

            :: ev == K_SHARE_RELEASE ->
                /* Mirrors shared.pml's share_release, by the holder with its token (models: share_release). */
                assert(HOLDER && owner == SHARED && holds[who] && htoken[who] == tok);
                holds[who] = false; htoken[who] = 0; hexp[who] = 0; hlim[who] = 0;
                held[who] = false;
                /* As shared.pml's: the row's expiry becomes the latest of the live holders' (live
                 * when the statement began: those live at the clock, perhaps more), or the row is
                 * freed when none is live and nobody waits; when someone waits, the row is left
                 * as it was and the name goes to the line's head in the same statement (K_GRANT).
                 * Never later than it was, never earlier than a live holder's. */
                need = 0; i = FIRST;
                do
                :: i < SLOTS -> if :: live(i) && hexp[i] > need -> need = hexp[i] :: else -> skip fi; i++
                :: else -> break
                od;
                if
                :: a == FREE -> assert(need == 0); owner = FREE; expires = 0
                :: a == SHARED -> assert(need <= b && b <= expires); expires = b
                :: else -> assert(a == FREE || a == SHARED)
                fi;
                i = 0; need = 0

            :: ev == K_FORGET ->
                /* Not in shared.pml, where a holder whose lease ran out stays, never live again,
                 * which no guard tells from gone: dblock deletes it before it counts the holders
                 * (models: share_acquire; share_enqueue, release, share_release and cancel: the
                 * fair queue's sweep). Only a lease that ran out. */
                assert(who >= FIRST && holds[who] && htoken[who] == tok && hexp[who] <= clock);
                holds[who] = false; htoken[who] = 0; hexp[who] = 0; hlim[who] = 0

            :: ev == K_UNKNOWN ->
                /* The database changed the row in a way no step of the models does. */
                assert(ev != K_UNKNOWN)

            :: else -> assert(ev >= K_SYNC && ev <= K_UNKNOWN)  /* not an event: the generator's bug */
            fi;
            SAFE;
            nev++
        }
    :: else -> break
    od
}
