/* A kvtierd client written from docs/protocol.md alone (no other source read).
 *
 * One file, C11 + POSIX, its own MessagePack encoder and decoder. It checks
 * every answer against the page (section numbers in the comments), prints
 * "ok ..." / "FAIL ..." lines and exits with the number of failures (0 = the
 * page held). Usage: doc_client SOCKET_PATH
 *
 * Run as root: a forked child drops to uid/gid 65534 for the "someone else's
 * region" checks (section 4, owner access), so the socket and its directory
 * must be reachable by that uid. "doc_client SOCKET limits" runs the checks
 * of limits_mode() instead, against a daemon with the small limits named
 * there. tests/host/test_c_client.py builds it with gcc and runs both.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <grp.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int failures;
static const char *sock_path;

#define CHECK(cond, ...) check_((cond), __LINE__, __VA_ARGS__)
static void check_(bool ok, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (ok) printf("ok   ");
    else printf("FAIL (line %d) ", line);
    vprintf(fmt, ap);
    printf("\n");
    fflush(stdout);
    va_end(ap);
    if (!ok) failures++;
}

static void die(const char *what) {
    printf("FAIL fatal: %s: %s\n", what, strerror(errno));
    exit(100);
}

/* ---------------------------------------------------------------- encoder */

typedef struct { uint8_t *p; size_t n, cap; } buf_t;

static void put(buf_t *b, const void *d, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (!b->p) die("realloc");
    }
    if (n) memcpy(b->p + b->n, d, n);
    b->n += n;
}
static void put8(buf_t *b, uint8_t v) { put(b, &v, 1); }
static void putbe(buf_t *b, uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; i--) put8(b, (uint8_t)(v >> (8 * i)));
}
static void mp_map(buf_t *b, uint32_t n) {
    if (n < 16) put8(b, 0x80 | n);
    else if (n < 65536) { put8(b, 0xde); putbe(b, n, 2); }
    else { put8(b, 0xdf); putbe(b, n, 4); }
}
static void mp_arr(buf_t *b, uint32_t n) {
    if (n < 16) put8(b, 0x90 | n);
    else if (n < 65536) { put8(b, 0xdc); putbe(b, n, 2); }
    else { put8(b, 0xdd); putbe(b, n, 4); }
}
static void mp_strn(buf_t *b, const char *s, size_t n) {
    if (n < 32) put8(b, 0xa0 | n);
    else if (n < 256) { put8(b, 0xd9); putbe(b, n, 1); }
    else if (n < 65536) { put8(b, 0xda); putbe(b, n, 2); }
    else { put8(b, 0xdb); putbe(b, n, 4); }
    put(b, s, n);
}
static void mp_str(buf_t *b, const char *s) { mp_strn(b, s, strlen(s)); }
static void mp_uint(buf_t *b, uint64_t v) {
    if (v < 128) put8(b, v);
    else if (v < 256) { put8(b, 0xcc); putbe(b, v, 1); }
    else if (v < 65536) { put8(b, 0xcd); putbe(b, v, 2); }
    else if (v <= 0xffffffffu) { put8(b, 0xce); putbe(b, v, 4); }
    else { put8(b, 0xcf); putbe(b, v, 8); }
}
static void mp_int(buf_t *b, int64_t v) {
    if (v >= 0) mp_uint(b, (uint64_t)v);
    else if (v >= -32) put8(b, (uint8_t)(int8_t)v);
    else { put8(b, 0xd3); putbe(b, (uint64_t)v, 8); } /* int64: any width is fine (section 2) */
}
static void mp_bool(buf_t *b, bool v) { put8(b, v ? 0xc3 : 0xc2); }
static void mp_nil(buf_t *b) { put8(b, 0xc0); }
static void mp_bin(buf_t *b, const void *d, size_t n) {
    if (n < 256) { put8(b, 0xc4); putbe(b, n, 1); }
    else if (n < 65536) { put8(b, 0xc5); putbe(b, n, 2); }
    else { put8(b, 0xc6); putbe(b, n, 4); }
    put(b, d, n);
}
/* "key": op, the first pair of most requests */
static void req(buf_t *b, uint32_t pairs, const char *op, uint64_t id) {
    b->n = 0;
    mp_map(b, pairs + 2);
    mp_str(b, "op"); mp_str(b, op);
    mp_str(b, "id"); mp_uint(b, id);
}

/* ---------------------------------------------------------------- decoder */

enum { T_NIL, T_BOOL, T_UINT, T_INT, T_FLOAT, T_STR, T_BIN, T_ARR, T_MAP, T_EXT };
typedef struct {
    int t;
    uint64_t u;   /* uint, bool */
    int64_t i;    /* int (negative) */
    double f;
    const uint8_t *s; /* str, bin */
    uint32_t len;     /* str/bin bytes, array items, map pairs */
    uint32_t kids;    /* index of first child in the arena */
} node;

static int key_order_bad, not_shortest, float32_seen;
static bool streq(node *x, const char *s);
static node *arena;
static size_t arena_n, arena_cap;
static uint8_t *rxbuf;

static uint32_t alloc_nodes(uint32_t n) {
    if (arena_n + n > arena_cap) {
        arena_cap = (arena_n + n) * 2 + 1024;
        arena = realloc(arena, arena_cap * sizeof(node));
        if (!arena) die("realloc");
    }
    uint32_t at = (uint32_t)arena_n;
    arena_n += n;
    return at;
}

typedef struct { const uint8_t *p, *end; int err; } rd_t;
static uint64_t rdbe(rd_t *r, int n) {
    if (r->end - r->p < n) { r->err = 1; return 0; }
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | *r->p++;
    return v;
}
static void parse(rd_t *r, uint32_t at, int depth);
static void parse_seq(rd_t *r, uint32_t at, uint32_t items, int depth) {
    if (depth > 64 || items > (uint32_t)(r->end - r->p)) { r->err = 1; return; }
    uint32_t k = alloc_nodes(items);
    arena[at].kids = k;
    for (uint32_t i = 0; i < items && !r->err; i++) parse(r, k + i, depth + 1);
}
static void parse_raw(rd_t *r, uint32_t at, int t, uint64_t n) {
    if ((uint64_t)(r->end - r->p) < n) { r->err = 1; return; }
    arena[at].t = t; arena[at].s = r->p; arena[at].len = (uint32_t)n; r->p += n;
}
static void parse(rd_t *r, uint32_t at, int depth) {
    if (r->p >= r->end) { r->err = 1; return; }
    uint8_t c = *r->p++;
    node *x = &arena[at];
    memset(x, 0, sizeof *x);
    if (c <= 0x7f) { x->t = T_UINT; x->u = c; return; }
    if (c >= 0xe0) { x->t = T_INT; x->i = (int8_t)c; return; }
    if ((c & 0xf0) == 0x80) { x->t = T_MAP; x->len = c & 15; parse_seq(r, at, 2 * x->len, depth); return; }
    if ((c & 0xf0) == 0x90) { x->t = T_ARR; x->len = c & 15; parse_seq(r, at, x->len, depth); return; }
    if ((c & 0xe0) == 0xa0) { parse_raw(r, at, T_STR, c & 31); return; }
    switch (c) {
    case 0xc0: x->t = T_NIL; return;
    case 0xc2: case 0xc3: x->t = T_BOOL; x->u = c & 1; return;
    case 0xc4: parse_raw(r, at, T_BIN, rdbe(r, 1)); return;
    case 0xc5: parse_raw(r, at, T_BIN, rdbe(r, 2)); return;
    case 0xc6: parse_raw(r, at, T_BIN, rdbe(r, 4)); return;
    case 0xd9: parse_raw(r, at, T_STR, rdbe(r, 1)); return;
    case 0xda: parse_raw(r, at, T_STR, rdbe(r, 2)); return;
    case 0xdb: parse_raw(r, at, T_STR, rdbe(r, 4)); return;
    case 0xcc: x->t = T_UINT; x->u = rdbe(r, 1); if (x->u < 128) not_shortest++; return;
    case 0xcd: x->t = T_UINT; x->u = rdbe(r, 2); if (x->u < 256) not_shortest++; return;
    case 0xce: x->t = T_UINT; x->u = rdbe(r, 4); if (x->u < 65536) not_shortest++; return;
    case 0xcf: x->t = T_UINT; x->u = rdbe(r, 8); if (x->u < 4294967296ull) not_shortest++; return;
    case 0xd0: x->t = T_INT; x->i = (int8_t)rdbe(r, 1); break;
    case 0xd1: x->t = T_INT; x->i = (int16_t)rdbe(r, 2); break;
    case 0xd2: x->t = T_INT; x->i = (int32_t)rdbe(r, 4); break;
    case 0xd3: x->t = T_INT; x->i = (int64_t)rdbe(r, 8); break;
    case 0xca: { uint32_t w = (uint32_t)rdbe(r, 4); float f; memcpy(&f, &w, 4); x->t = T_FLOAT; x->f = f; float32_seen++; return; }
    case 0xcb: { uint64_t w = rdbe(r, 8); double d; memcpy(&d, &w, 8); x->t = T_FLOAT; x->f = d; return; }
    case 0xdc: x->t = T_ARR; x->len = (uint32_t)rdbe(r, 2); parse_seq(r, at, x->len, depth); return;
    case 0xdd: x->t = T_ARR; x->len = (uint32_t)rdbe(r, 4); parse_seq(r, at, x->len, depth); return;
    case 0xde: x->t = T_MAP; x->len = (uint32_t)rdbe(r, 2); parse_seq(r, at, 2 * x->len, depth); return;
    case 0xdf: x->t = T_MAP; x->len = (uint32_t)rdbe(r, 4); parse_seq(r, at, 2 * x->len, depth); return;
    default: x->t = T_EXT; r->err = 1; return; /* section 2: the daemon never sends an ext type */
    }
    if (x->t == T_INT && x->i >= -32) not_shortest++; /* section 2: the shortest, negative in a negative format */
    if (x->t == T_INT && x->i >= 0) not_shortest++;
    /* a signed format holding a non-negative value: fold into uint */
    if (x->i >= 0) { x->t = T_UINT; x->u = (uint64_t)x->i; }
}
static node *N(uint32_t i) { return &arena[i]; }
static node *get(node *m, const char *key) {
    if (!m || m->t != T_MAP) return NULL;
    size_t kl = strlen(key);
    for (uint32_t i = 0; i < m->len; i++) {
        node *k = N(m->kids + 2 * i);
        if (k->t == T_STR && k->len == kl && !memcmp(k->s, key, kl)) return N(m->kids + 2 * i + 1);
    }
    return NULL;
}
static node *item(node *a, uint32_t i) { return N(a->kids + i); }
static bool is_uint(node *x) { return x && x->t == T_UINT; }
static uint64_t U(node *x) { return x && x->t == T_UINT ? x->u : (uint64_t)-1; }
static int64_t I(node *x) { return !x ? INT64_MIN : x->t == T_UINT ? (int64_t)x->u : x->t == T_INT ? x->i : INT64_MIN; }
static bool streq(node *x, const char *s) {
    return x && x->t == T_STR && x->len == strlen(s) && !memcmp(x->s, s, x->len);
}
static char *cstr(node *x) { /* for messages; static ring of buffers */
    static char bufs[4][512];
    static int k;
    char *o = bufs[k++ & 3];
    if (!x || x->t != T_STR) { snprintf(o, 512, "<%s>", x ? "not a str" : "absent"); return o; }
    snprintf(o, 512, "%.*s", (int)(x->len < 500 ? x->len : 500), (const char *)x->s);
    return o;
}
static bool arr_has_str(node *a, const char *s) {
    if (!a || a->t != T_ARR) return false;
    for (uint32_t i = 0; i < a->len; i++) if (streq(item(a, i), s)) return true;
    return false;
}

/* ---------------------------------------------------------------- transport */

static int conn(void) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0) die("socket");
    struct sockaddr_un a = { .sun_family = AF_UNIX };
    snprintf(a.sun_path, sizeof a.sun_path, "%s", sock_path);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) die("connect");
    struct timeval tv = { .tv_sec = 30 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}
/* 0 = all sent, -1 = the daemon closed the connection first (EPIPE/ECONNRESET) */
static int write_until_closed(int fd, const void *p, size_t n) {
    const uint8_t *q = p;
    while (n) {
        ssize_t w = send(fd, q, n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EPIPE || errno == ECONNRESET) return -1;
            die("send");
        }
        q += w; n -= (size_t)w;
    }
    return 0;
}
static void write_all(int fd, const void *p, size_t n) {
    if (write_until_closed(fd, p, n) < 0) die("send");
}
/* 0 = all read, 1 = EOF before the first byte, -1 = EOF/error midway */
static int read_all(int fd, void *p, size_t n) {
    uint8_t *q = p;
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, q + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return got == 0 ? 1 : -1;
        got += (size_t)r;
    }
    return 0;
}
static void send_frame(int fd, const buf_t *b) { /* section 2 */
    uint32_t be = htonl((uint32_t)b->n);
    write_all(fd, &be, 4);
    write_all(fd, b->p, b->n);
}
static void send_raw(int fd, const void *payload, uint32_t n) {
    uint32_t be = htonl(n);
    write_all(fd, &be, 4);
    if (n) write_all(fd, payload, n);
}
/* Reads one frame; *fdp (if given) gets an SCM_RIGHTS fd riding on it. */
static node *recv_frame_fd(int fd, int *fdp) {
    uint32_t be;
    if (fdp) {
        *fdp = -1;
        char cbuf[CMSG_SPACE(sizeof(int))];
        struct iovec iov = { &be, 4 };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf };
        ssize_t got = recvmsg(fd, &mh, MSG_WAITALL);
        if (got != 4) return NULL;
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
            if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) memcpy(fdp, CMSG_DATA(cm), sizeof(int));
    } else if (read_all(fd, &be, 4) != 0) {
        return NULL;
    }
    uint32_t len = ntohl(be);
    if (len == 0 || len > (1u << 24)) { printf("FAIL frame length %u from the daemon\n", len); failures++; return NULL; }
    rxbuf = realloc(rxbuf, len);
    if (read_all(fd, rxbuf, len) != 0) return NULL;
    arena_n = 0;
    uint32_t root = alloc_nodes(1);
    rd_t r = { rxbuf, rxbuf + len, 0 };
    parse(&r, root, 0);
    if (r.err || r.p != r.end) { printf("FAIL undecodable answer (%u bytes)\n", len); failures++; return NULL; }
    node *m = N(root);
    if (m->t != T_MAP) { printf("FAIL answer is not a map\n"); failures++; return NULL; }
    /* section 2: the daemon writes id, ok, then result or error, an event's `event` last */
    node *k0 = m->len > 0 ? N(m->kids) : NULL, *k1 = m->len > 1 ? N(m->kids + 2) : NULL;
    node *k2 = m->len > 2 ? N(m->kids + 4) : NULL;
    if (!(m->len >= 3 && streq(k0, "id") && streq(k1, "ok") && (streq(k2, "result") || streq(k2, "error"))))
        key_order_bad++;
    return m;
}
static node *recv_frame(int fd) { return recv_frame_fd(fd, NULL); }
static node *rpc(int fd, const buf_t *b) { send_frame(fd, b); return recv_frame(fd); }

/* section 3: {id, ok, result} / {id, ok: false, error} */
static node *ok_result(node *m, uint64_t id, const char *what) {
    node *ok = get(m, "ok");
    bool good = m && ok && ok->t == T_BOOL && ok->u == 1 && U(get(m, "id")) == id && get(m, "result")
                && get(m, "result")->t == T_MAP && !get(m, "error");
    if (!good && m && get(m, "error"))
        CHECK(false, "%s: ok answer with id %llu (got error %s: %s)", what, (unsigned long long)id,
              cstr(get(get(m, "error"), "code")), cstr(get(get(m, "error"), "message")));
    else
        CHECK(good, "%s: ok answer with id %llu", what, (unsigned long long)id);
    return good ? get(m, "result") : NULL;
}
static node *expect_error(node *m, uint64_t id, const char *code, const char *what) {
    node *e = m ? get(m, "error") : NULL;
    node *ok = m ? get(m, "ok") : NULL;
    bool good = e && e->t == T_MAP && ok && ok->t == T_BOOL && ok->u == 0 && U(get(m, "id")) == id
                && streq(get(e, "code"), code) && get(get(e, "message"), "") == NULL
                && get(e, "message") && get(e, "message")->t == T_STR && !get(m, "result");
    CHECK(good, "%s: error %s, id %llu (got %s, id %lld: %s)", what, code, (unsigned long long)id,
          m ? (e ? cstr(get(e, "code")) : "ok") : "no answer", m ? (long long)I(get(m, "id")) : -1LL,
          e ? cstr(get(e, "message")) : "");
    return e;
}
/* after a closing error (section 6.1) the daemon closes the connection */
static bool closed_by_daemon(int fd) {
    uint8_t c;
    struct timeval tv = { .tv_sec = 5 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ssize_t r = read(fd, &c, 1);
    return r == 0 || (r < 0 && errno == ECONNRESET);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---------------------------------------------------------------- the run */

#define BS 65536u         /* block size */
#define NB 32u            /* blocks of the main region */
#define BIG_BS 4096u
#define BIG_NB 300000u    /* > 258,048: query must page (section 4, query) */

static buf_t b;
static uint64_t my_page_size;

static node *hello(int fd, uint64_t id, const uint64_t *versions, int nv) {
    req(&b, nv >= 0 ? 2 : 1, "hello", id);
    mp_str(&b, "client"); mp_str(&b, "doc_client.c");
    if (nv >= 0) {
        mp_str(&b, "versions"); mp_arr(&b, (uint32_t)nv);
        for (int i = 0; i < nv; i++) mp_uint(&b, versions[i]);
    }
    return rpc(fd, &b);
}

static void check_hello(int fd) {
    /* section 4, hello */
    uint64_t v1[] = { 1 };
    node *r = ok_result(hello(fd, 1, v1, 1), 1, "hello [1]");
    if (!r) return;
    CHECK(U(get(r, "version")) == 1, "hello: version 1");
    node *vs = get(r, "versions");
    bool has1 = false;
    for (uint32_t i = 0; vs && vs->t == T_ARR && i < vs->len; i++) has1 |= U(item(vs, i)) == 1;
    CHECK(has1, "hello: versions holds 1");
    CHECK(streq(get(r, "server"), "kvtierd"), "hello: server kvtierd");
    CHECK(get(r, "server_version") && get(r, "server_version")->t == T_STR, "hello: server_version str");
    node *caps = get(r, "capabilities");
    const char *ops[] = { "hello", "register", "allocate", "register_engine", "attach", "move_done", "prefetch",
                          "release", "unregister", "hint", "hint_ring", "phase", "query", "stats", "status",
                          "tiers", "regions", "blocks", "migrate", "measure", "pin", "unpin", "explain", "ages",
                          "pidfd-lifetime", "persist", "engine-moves" };
    for (size_t i = 0; i < sizeof ops / sizeof *ops; i++)
        CHECK(arr_has_str(caps, ops[i]), "hello: capabilities holds %s", ops[i]);
    CHECK(U(get(r, "max_message_bytes")) == 16777216, "hello: max_message_bytes 16 MiB (default)");
    CHECK(U(get(r, "page_size")) == my_page_size, "hello: page_size %llu", (unsigned long long)my_page_size);
    CHECK(U(get(r, "pid")) == (uint64_t)getpid(), "hello: pid is mine");
    CHECK(U(get(r, "uid")) == (uint64_t)getuid(), "hello: uid is mine");
    node *pv = get(r, "privileged");
    CHECK(pv && pv->t == T_BOOL && pv->u == (getuid() == 0), "hello: privileged %d", getuid() == 0);

    /* versions this daemon does not offer: unsupported_version, connection kept */
    uint64_t v2[] = { 2, 7 };
    node *e = expect_error(hello(fd, 2, v2, 2), 2, "unsupported_version", "hello [2,7]");
    if (e) {
        char *msg = cstr(get(e, "message"));
        CHECK(strstr(msg, "2") && strstr(msg, "1"), "hello [2,7]: message names both sides' versions (%s)", msg);
    }
    expect_error(hello(fd, 3, NULL, 0), 3, "unsupported_version", "hello []");
    /* "the client may send another hello": and anything else, the connection still speaks 1 */
    uint64_t v12[] = { 2, 1 };
    r = ok_result(hello(fd, 4, v12, 2), 4, "hello [2,1] after a refused one");
    CHECK(r && U(get(r, "version")) == 1, "hello [2,1]: version 1");
    req(&b, 0, "status", 5);
    ok_result(rpc(fd, &b), 5, "status after refused hellos");
    /* out of range / over-long versions: invalid_request (uint 0..65535, at most 16) */
    uint64_t vbig[] = { 65536 };
    expect_error(hello(fd, 6, vbig, 1), 6, "invalid_request", "hello [65536]");
    uint64_t v17[17] = { 1 };
    expect_error(hello(fd, 7, v17, 17), 7, "invalid_request", "hello with 17 versions");
    /* a connection that never sent hello speaks version 1 (checked by the other connections below) */
}

static uint64_t reg(int fd, uint64_t id, void *p, uint64_t len, uint64_t bs, const char *name, node **res) {
    req(&b, 6, "register", id);
    mp_str(&b, "start"); mp_uint(&b, (uint64_t)(uintptr_t)p);
    mp_str(&b, "length"); mp_uint(&b, len);
    mp_str(&b, "block_size"); mp_uint(&b, bs);
    mp_str(&b, "name"); mp_str(&b, name);
    mp_str(&b, "priority"); mp_int(&b, -5);
    mp_str(&b, "pid"); mp_nil(&b); /* nil = the caller (section 2) */
    node *m = rpc(fd, &b);
    if (res) *res = m;
    return m && get(m, "result") ? U(get(get(m, "result"), "region")) : 0;
}

static node *query(int fd, uint64_t id, uint64_t region, uint64_t first, int64_t count, const char *op) {
    req(&b, count >= 0 ? 3 : 2, op, id);
    mp_str(&b, "region"); mp_uint(&b, region);
    mp_str(&b, "first"); mp_uint(&b, first);
    if (count >= 0) { mp_str(&b, "count"); mp_uint(&b, (uint64_t)count); }
    return rpc(fd, &b);
}

static node *hint(int fd, uint64_t id, uint64_t region, const uint32_t *idx, size_t n, const uint32_t *counts) {
    req(&b, counts ? 3 : 2, "hint", id);
    mp_str(&b, "region"); mp_uint(&b, region);
    mp_str(&b, "blocks"); mp_bin(&b, idx, n * 4); /* little-endian u32 = host order on x86-64/arm64 */
    if (counts) { mp_str(&b, "counts"); mp_bin(&b, counts, n * 4); }
    return rpc(fd, &b);
}

static node *simple(int fd, const char *op, uint64_t id, uint64_t region) {
    req(&b, 1, op, id);
    mp_str(&b, "region"); mp_uint(&b, region);
    return rpc(fd, &b);
}

/* Follows `next` from `first` to the end; returns the blocks seen, checks they are contiguous. */
static uint64_t page_through(int fd, const char *op, uint64_t region, uint64_t total, uint64_t per_page) {
    uint64_t first = 0, seen = 0, pages = 0;
    for (;;) {
        node *m = query(fd, 100 + pages, region, first, -1, op);
        node *e = m ? get(m, "error") : NULL;
        if (e && streq(get(e, "code"), "rate_limited")) { /* section 3: retry after retry_after_ms */
            usleep((useconds_t)U(get(e, "retry_after_ms")) * 1000 + 1000);
            continue;
        }
        node *r = ok_result(m, 100 + pages, op);
        if (!r) return seen;
        uint64_t cnt = U(get(r, "count"));
        node *t = get(r, "tiers");
        CHECK(U(get(r, "first")) == first && t && t->t == T_BIN && t->len == cnt,
              "%s page %llu: first %llu, tiers bin of count=%llu bytes", op, (unsigned long long)pages,
              (unsigned long long)first, (unsigned long long)cnt);
        seen += cnt;
        pages++;
        node *nx = get(r, "next");
        if (!nx) break;
        CHECK(U(nx) == first + cnt && cnt == per_page, "%s: next %llu = first + count, page of %llu blocks",
              op, (unsigned long long)U(nx), (unsigned long long)per_page);
        if (U(nx) != first + cnt || pages > 64) break;
        first = U(nx);
    }
    CHECK(seen == total, "%s: paged through %llu of %llu blocks in %llu pages", op, (unsigned long long)seen,
          (unsigned long long)total, (unsigned long long)pages);
    return seen;
}

static void check_hint_ring(int fd, uint64_t region, uint64_t nblocks) {
    /* section 4, hint_ring: the fd rides on the answer's first bytes */
    req(&b, 1, "hint_ring", 300);
    mp_str(&b, "entries"); mp_uint(&b, 100); /* rounded down to a power of two, at least 64: 64 */
    send_frame(fd, &b);
    int rfd = -1;
    node *r = ok_result(recv_frame_fd(fd, &rfd), 300, "hint_ring (first)");
    CHECK(rfd >= 0, "hint_ring: SCM_RIGHTS fd on the first answer");
    if (!r || rfd < 0) return;
    node *nw = get(r, "new");
    CHECK(nw && nw->t == T_BOOL && nw->u == 1, "hint_ring: new true");
    uint64_t cap = U(get(r, "entries")), bytes = U(get(r, "bytes"));
    CHECK(cap == 64, "hint_ring: entries 100 -> 64 (got %llu)", (unsigned long long)cap);
    CHECK(bytes == 4096 + 4 * cap, "hint_ring: bytes = 4096 + 4 * entries");
    CHECK(U(get(r, "word_size")) == 4 && U(get(r, "words_offset")) == 4096, "hint_ring: word_size 4, words_offset 4096");
    CHECK(U(get(r, "tail")) == 0 && U(get(r, "accepted")) == 0, "hint_ring: tail 0, accepted 0");
    CHECK(ftruncate(rfd, 0) < 0 && errno == EPERM, "hint_ring: memfd sealed, ftruncate fails with EPERM");
    uint8_t *ring = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, rfd, 0);
    close(rfd);
    if (ring == MAP_FAILED) { CHECK(false, "hint_ring: mmap"); return; }
    uint32_t ver, wsz, rcap, woff;
    memcpy(&ver, ring + 8, 4); memcpy(&wsz, ring + 12, 4); memcpy(&rcap, ring + 16, 4); memcpy(&woff, ring + 20, 4);
    CHECK(!memcmp(ring, "KVTRING1", 8) && ver == 1 && wsz == 4 && rcap == cap && woff == 4096,
          "hint_ring: header KVTRING1 v1, word 4, capacity %u, words at %u", rcap, woff);
    uint64_t *head = (uint64_t *)(ring + 64), *tail = (uint64_t *)(ring + 128);
    uint32_t *words = (uint32_t *)(ring + 4096);
    uint64_t h = 0;
    /* publish: a block before any region word (bad_region), then region + 3 good + 1 bad block */
    uint32_t batch[] = { 0, 0x80000000u | (uint32_t)region, 1, 2, 3, (uint32_t)nblocks };
    uint32_t n = sizeof batch / 4;
    CHECK(h + n - __atomic_load_n(tail, __ATOMIC_ACQUIRE) <= cap, "hint_ring: room");
    for (uint32_t i = 0; i < n; i++) words[(h + i) & (cap - 1)] = batch[i];
    __atomic_store_n(head, h += n, __ATOMIC_RELEASE);
    /* a later hint_ring drains first and answers the counters, no fd */
    req(&b, 0, "hint_ring", 301);
    send_frame(fd, &b);
    r = ok_result(recv_frame_fd(fd, &rfd), 301, "hint_ring (second)");
    CHECK(rfd < 0, "hint_ring (second): no fd");
    if (r) {
        CHECK(get(r, "new") && get(r, "new")->u == 0, "hint_ring (second): new false");
        CHECK(U(get(r, "accepted")) == 3 && U(get(r, "bad_region")) == 1 && U(get(r, "bad_block")) == 1
                  && U(get(r, "bad_head")) == 0 && U(get(r, "tail")) == n,
              "hint_ring: accepted 3, bad_region 1, bad_block 1, bad_head 0, tail %u (got %llu %llu %llu %llu %llu)",
              n, (unsigned long long)U(get(r, "accepted")), (unsigned long long)U(get(r, "bad_region")),
              (unsigned long long)U(get(r, "bad_block")), (unsigned long long)U(get(r, "bad_head")),
              (unsigned long long)U(get(r, "tail")));
        CHECK(__atomic_load_n(tail, __ATOMIC_ACQUIRE) == n, "hint_ring: tail word in the mapping = %u", n);
    }
    /* wrap around: the current region holds across drains; fill the ring a few times */
    for (int round = 0; round < 5; round++) {
        uint32_t k = (uint32_t)cap - 1;
        while (h + k - __atomic_load_n(tail, __ATOMIC_ACQUIRE) > cap) usleep(1000);
        for (uint32_t i = 0; i < k; i++) words[(h + i) & (cap - 1)] = i % (uint32_t)nblocks;
        __atomic_store_n(head, h += k, __ATOMIC_RELEASE);
    }
    double t0 = now();
    while (__atomic_load_n(tail, __ATOMIC_ACQUIRE) != h && now() - t0 < 5) usleep(2000); /* timer drains */
    CHECK(__atomic_load_n(tail, __ATOMIC_ACQUIRE) == h, "hint_ring: the daemon's timer drains without a request");
    req(&b, 0, "hint_ring", 302);
    r = ok_result(rpc(fd, &b), 302, "hint_ring (third)");
    CHECK(r && U(get(r, "accepted")) == 3 + 5 * (cap - 1), "hint_ring: accepted %llu across wrap-around",
          (unsigned long long)(3 + 5 * (cap - 1)));
    /* a head more than capacity ahead: one bad_head, tail jumps to it */
    __atomic_store_n(head, h += 10 * cap, __ATOMIC_RELEASE);
    req(&b, 0, "hint_ring", 303);
    r = ok_result(rpc(fd, &b), 303, "hint_ring (bad head)");
    CHECK(r && U(get(r, "bad_head")) == 1 && U(get(r, "tail")) == h, "hint_ring: bad_head 1, tail jumped to head");
    munmap(ring, bytes);
}

static void check_errors(void) {
    /* section 6.1, rows that keep the connection */
    int fd = conn();
    uint8_t arr[] = { 0x92, 0x01, 0x02 }; /* [1, 2]: valid, not a map */
    send_raw(fd, arr, sizeof arr);
    node *e = expect_error(recv_frame(fd), 0, "invalid_request", "array payload");
    CHECK(e && strstr(cstr(get(e, "message")), "Expected `object`"), "array payload: message Expected `object`");
    uint8_t trunc[] = { 0x82, 0xa2, 'o', 'p' }; /* map of 2, cut short */
    send_raw(fd, trunc, sizeof trunc);
    e = expect_error(recv_frame(fd), 0, "invalid_request", "truncated map");
    CHECK(e && strstr(cstr(get(e, "message")), "malformed msgpack"), "truncated map: malformed msgpack");
    /* a good map with trailing bytes; it carries id 9, which must not be read */
    uint8_t trail[] = { 0x82, 0xa2, 'o', 'p', 0xa5, 's', 't', 'a', 't', 's', 0xa2, 'i', 'd', 0x09, 0xc0 };
    send_raw(fd, trail, sizeof trail);
    expect_error(recv_frame(fd), 0, "invalid_request", "map + trailing byte");
    /* a map that would fail validation (no `region`), then trailing bytes: still id 0 */
    req(&b, 0, "unregister", 9);
    put8(&b, 0xc0);
    expect_error(rpc(fd, &b), 0, "invalid_request", "invalid map + trailing byte");
    uint8_t badutf[] = { 0x81, 0xa2, 'o', 'p', 0xa2, 0xc3, 0x28 };
    send_raw(fd, badutf, sizeof badutf);
    expect_error(recv_frame(fd), 0, "invalid_request", "str not UTF-8");
    uint8_t ext[] = { 0x82, 0xa2, 'o', 'p', 0xa5, 's', 't', 'a', 't', 's', 0xa1, 'x', 0xd4, 0x01, 0x00 };
    send_raw(fd, ext, sizeof ext);
    /* ext under an unknown key: unknown keys are ignored "whatever their value" */
    node *m = recv_frame(fd);
    CHECK(m && get(m, "ok") && get(m, "ok")->u == 1, "ext value under an unknown key is ignored (ok)");
    /* unknown op: the id is read (valid map, str keys) */
    req(&b, 0, "frobnicate", 42);
    expect_error(rpc(fd, &b), 42, "invalid_request", "unknown op");
    /* a key that is not a str: id 0 */
    b.n = 0; mp_map(&b, 3); mp_str(&b, "op"); mp_str(&b, "stats"); mp_str(&b, "id"); mp_uint(&b, 43);
    mp_uint(&b, 1); mp_uint(&b, 2);
    expect_error(rpc(fd, &b), 0, "invalid_request", "int key");
    /* id as bool / nil: invalid_request, id 0 */
    b.n = 0; mp_map(&b, 2); mp_str(&b, "op"); mp_str(&b, "stats"); mp_str(&b, "id"); mp_bool(&b, true);
    expect_error(rpc(fd, &b), 0, "invalid_request", "id true");
    b.n = 0; mp_map(&b, 2); mp_str(&b, "op"); mp_str(&b, "stats"); mp_str(&b, "id"); mp_nil(&b);
    expect_error(rpc(fd, &b), 0, "invalid_request", "id nil");
    /* id 2^63: out of range; id 2^63-1: echoed */
    b.n = 0; mp_map(&b, 2); mp_str(&b, "op"); mp_str(&b, "stats"); mp_str(&b, "id"); mp_uint(&b, 1ull << 63);
    expect_error(rpc(fd, &b), 0, "invalid_request", "id 2^63");
    req(&b, 0, "stats", (1ull << 63) - 1);
    m = rpc(fd, &b);
    CHECK(m && U(get(m, "id")) == (1ull << 63) - 1, "id 2^63-1 echoed");
    /* id as int64 (a uint may come in any width, section 2) */
    b.n = 0; mp_map(&b, 2); mp_str(&b, "op"); mp_str(&b, "stats"); mp_str(&b, "id"); put8(&b, 0xd3); putbe(&b, 44, 8);
    ok_result(rpc(fd, &b), 44, "id sent as int64");
    /* repeated key: the last value wins; a repeated op with another value is invalid_request */
    b.n = 0; mp_map(&b, 3); mp_str(&b, "op"); mp_str(&b, "stats"); mp_str(&b, "id"); mp_uint(&b, 45);
    mp_str(&b, "id"); mp_uint(&b, 46);
    ok_result(rpc(fd, &b), 46, "repeated id: the last wins");
    b.n = 0; mp_map(&b, 3); mp_str(&b, "op"); mp_str(&b, "stats"); mp_str(&b, "id"); mp_uint(&b, 47);
    mp_str(&b, "op"); mp_str(&b, "status");
    expect_error(rpc(fd, &b), 47, "invalid_request", "repeated op with another value");
    b.n = 0; mp_map(&b, 3); mp_str(&b, "op"); mp_str(&b, "stats"); mp_str(&b, "id"); mp_uint(&b, 48);
    mp_str(&b, "op"); mp_str(&b, "stats");
    ok_result(rpc(fd, &b), 48, "repeated op with the same value");
    /* no op at all */
    b.n = 0; mp_map(&b, 1); mp_str(&b, "id"); mp_uint(&b, 49);
    expect_error(rpc(fd, &b), 49, "invalid_request", "no op");
    /* wrong types: region as str, a bool field as 1, a bin field as an array */
    req(&b, 1, "unregister", 50); mp_str(&b, "region"); mp_str(&b, "1");
    expect_error(rpc(fd, &b), 50, "invalid_request", "region as str");
    req(&b, 1, "unregister", 51); mp_str(&b, "region"); mp_uint(&b, 0);
    expect_error(rpc(fd, &b), 51, "invalid_request", "region 0 (region is 1..2^31-1)");
    req(&b, 1, "unregister", 52); mp_str(&b, "region"); mp_uint(&b, 1ull << 31);
    expect_error(rpc(fd, &b), 52, "invalid_request", "region 2^31");
    req(&b, 1, "unregister", 53); mp_str(&b, "region"); mp_uint(&b, 2147483000);
    e = expect_error(rpc(fd, &b), 53, "not_found", "unregister of an unknown region");
    CHECK(e && !strncmp(cstr(get(e, "message")), "no region 2147483000", 20), "not_found message 'no region N' (%s)",
          cstr(get(e, "message")));
    CHECK(e && !get(e, "errno"), "not_found: errno absent");
    req(&b, 3, "migrate", 54); mp_str(&b, "region"); mp_uint(&b, 2147483000); mp_str(&b, "tier"); mp_uint(&b, 0);
    mp_str(&b, "wait"); mp_uint(&b, 1);
    expect_error(rpc(fd, &b), 54, "invalid_request", "wait: 1 (a bool field refuses 1)");
    req(&b, 1, "status", 55); mp_str(&b, "nested"); /* 300 levels under an unknown key */
    for (int i = 0; i < 300; i++) mp_arr(&b, 1);
    mp_uint(&b, 0);
    m = rpc(fd, &b);
    CHECK(m && (get(m, "ok")->u == 1 || (U(get(m, "id")) == 0 && streq(get(get(m, "error"), "code"), "invalid_request"))),
          "300 levels under an unknown key: ok or invalid_request id 0");
    req(&b, 1, "status", 56); mp_str(&b, "nested");
    for (int i = 0; i < 250; i++) mp_arr(&b, 1);
    mp_uint(&b, 0);
    ok_result(rpc(fd, &b), 56, "250 levels under an unknown key (256 always allowed)");
    req(&b, 0, "status", 57);
    ok_result(rpc(fd, &b), 57, "connection still usable after every kept error");
    /* pipelining: write N frames, read N answers in order */
    buf_t all = { 0 };
    for (uint64_t i = 0; i < 20; i++) {
        req(&b, 0, i % 2 ? "status" : "nope", 1000 + i);
        uint32_t be = htonl((uint32_t)b.n);
        put(&all, &be, 4);
        put(&all, b.p, b.n);
    }
    write_all(fd, all.p, all.n);
    free(all.p);
    bool inorder = true;
    for (uint64_t i = 0; i < 20; i++) {
        m = recv_frame(fd);
        inorder &= m && U(get(m, "id")) == 1000 + i && get(m, "ok")->u == (i % 2);
    }
    CHECK(inorder, "20 pipelined requests answered in order");
    close(fd);

    /* rows that close the connection */
    fd = conn();
    send_raw(fd, NULL, 0);
    expect_error(recv_frame(fd), 0, "bad_frame", "zero-length frame");
    CHECK(closed_by_daemon(fd), "zero-length frame: connection closed");
    close(fd);
    fd = conn();
    uint32_t be = htonl(16777217u);
    write_all(fd, &be, 4); /* the body is never read */
    expect_error(recv_frame(fd), 0, "message_too_large", "frame of 16 MiB + 1");
    CHECK(closed_by_daemon(fd), "oversized frame: connection closed");
    close(fd);
    fd = conn();
    be = htonl(0xffffffffu);
    write_all(fd, &be, 4);
    write_all(fd, "garbage", 7);
    expect_error(recv_frame(fd), 0, "message_too_large", "frame of 4 GiB - 1");
    CHECK(closed_by_daemon(fd), "4 GiB frame: connection closed");
    close(fd);
}


/* edge cases of section 4's field tables */
static void check_fields(int fd, uint64_t region) {
    node *r;
    /* hello: versions nil is refused (not in the nil list); client over 128 characters */
    req(&b, 1, "hello", 200); mp_str(&b, "versions"); mp_nil(&b);
    expect_error(rpc(fd, &b), 200, "invalid_request", "hello versions nil");
    char txt[300];
    memset(txt, 'c', 129); txt[129] = 0;
    req(&b, 1, "hello", 201); mp_str(&b, "client"); mp_str(&b, txt);
    expect_error(rpc(fd, &b), 201, "invalid_request", "hello client of 129 characters");
    uint64_t v0[] = { 0 };
    expect_error(hello(fd, 202, v0, 1), 202, "unsupported_version", "hello [0]");
    /* 128 characters of 2 bytes each: within `str <= 128` (characters, not bytes) */
    for (int i = 0; i < 128; i++) { txt[2 * i] = (char)0xc3; txt[2 * i + 1] = (char)0xa9; }
    txt[256] = 0;
    req(&b, 1, "hello", 203); mp_str(&b, "client"); mp_str(&b, txt);
    ok_result(rpc(fd, &b), 203, "hello client of 128 two-byte characters");

    uint8_t *p = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    struct { const char *what, *key; int kind; int64_t v; const char *code; } cases[] = {
        { "register pid 0", "pid", 0, 0, "invalid_request" },
        { "register pid 2^22+1", "pid", 0, (1 << 22) + 1, "invalid_request" },
        { "register priority 101", "priority", 0, 101, "invalid_request" },
        { "register priority -101", "priority", 0, -101, "invalid_request" },
        { "register tenant of 65 characters", "tenant", 1, 65, "invalid_request" },
        { "register constraints: 9", "constraints", 2, 9, "invalid_request" },
        { "register constraints: unknown", "constraints", 3, 1, "invalid_request" },
        { "register priority true", "priority", 4, 1, "invalid_request" },
        { "register priority 1.0", "priority", 5, 1, "invalid_request" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        req(&b, 4, "register", 210 + i);
        mp_str(&b, "start"); mp_uint(&b, (uintptr_t)p); mp_str(&b, "length"); mp_uint(&b, 1 << 20);
        mp_str(&b, "block_size"); mp_uint(&b, 1 << 16);
        mp_str(&b, cases[i].key);
        switch (cases[i].kind) {
        case 0: mp_int(&b, cases[i].v); break;
        case 1: memset(txt, 't', cases[i].v); txt[cases[i].v] = 0; mp_str(&b, txt); break;
        case 2: mp_arr(&b, 9); for (int k = 0; k < 9; k++) mp_str(&b, "keep_dram"); break;
        case 3: mp_arr(&b, 1); mp_str(&b, "keep_warm"); break;
        case 4: mp_bool(&b, true); break;
        case 5: put8(&b, 0xcb); putbe(&b, 0x3ff0000000000000ull, 8); break;
        }
        expect_error(rpc(fd, &b), 210 + i, cases[i].code, cases[i].what);
    }
    req(&b, 3, "register", 230);
    mp_str(&b, "start"); mp_uint(&b, (uintptr_t)p); mp_str(&b, "length"); mp_uint(&b, 0);
    mp_str(&b, "block_size"); mp_uint(&b, 4096);
    expect_error(rpc(fd, &b), 230, "invalid_request", "register length 0");
    req(&b, 3, "register", 231);
    mp_str(&b, "start"); mp_uint(&b, 1ull << 63); mp_str(&b, "length"); mp_uint(&b, 4096);
    mp_str(&b, "block_size"); mp_uint(&b, 4096);
    expect_error(rpc(fd, &b), 231, "invalid_request", "register start 2^63");
    /* checked in order: sizes before mappings */
    req(&b, 3, "register", 232);
    mp_str(&b, "start"); mp_uint(&b, 4096); mp_str(&b, "length"); mp_uint(&b, 8192);
    mp_str(&b, "block_size"); mp_uint(&b, 2048);
    expect_error(rpc(fd, &b), 232, "invalid_argument", "register block_size 2048 of unmapped memory: sizes first");
    /* start need not be page-aligned; the last block may be shorter */
    req(&b, 5, "register", 233);
    mp_str(&b, "start"); mp_uint(&b, (uintptr_t)p + 100); mp_str(&b, "length"); mp_uint(&b, 3 * 4096 + 5);
    mp_str(&b, "block_size"); mp_uint(&b, 4096);
    mp_str(&b, "constraints"); mp_arr(&b, 2); mp_str(&b, "keep_dram"); mp_str(&b, "never_swap");
    mp_str(&b, "tenant"); mp_str(&b, "team-c");
    r = ok_result(rpc(fd, &b), 233, "register unaligned start, short last block");
    CHECK(r && U(get(r, "blocks")) == 4, "register 3*4096+5 bytes in 4096: 4 blocks");
    uint64_t unal = r ? U(get(r, "region")) : 0;
    if (unal) {
        r = ok_result(query(fd, 234, unal, 0, -1, "blocks"), 234, "blocks of the constrained region");
        node *fl = r ? get(r, "flags") : NULL;
        CHECK(fl && fl->t == T_BIN && fl->len == 4 && (fl->s[0] & 0x06) == 0x06, "blocks: flags bits 1 keep_dram, 2 never_swap");
        ok_result(simple(fd, "unregister", 235, unal), 235, "unregister it");
    }
    munmap(p, 1 << 20);

    /* explain / pin of things that do not exist */
    req(&b, 2, "explain", 240); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "block"); mp_uint(&b, NB);
    expect_error(rpc(fd, &b), 240, "invalid_argument", "explain a block past the end");
    req(&b, 2, "pin", 241); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "tier"); mp_uint(&b, 63);
    expect_error(rpc(fd, &b), 241, "invalid_argument", "pin to an unknown tier");
    /* move_done for a move nobody sent */
    uint8_t one = 1;
    req(&b, 2, "move_done", 242); mp_str(&b, "move"); mp_uint(&b, 12345); mp_str(&b, "ok"); mp_bin(&b, &one, 1);
    expect_error(rpc(fd, &b), 242, "invalid_argument", "move_done of an unknown move");
    /* register_engine: tiers must have one entry per block */
    int8_t et[4] = { 0, 0, -1, 0 };
    req(&b, 3, "register_engine", 243); mp_str(&b, "blocks"); mp_uint(&b, 4); mp_str(&b, "block_size"); mp_uint(&b, 4096);
    mp_str(&b, "tiers"); mp_bin(&b, et, 3);
    expect_error(rpc(fd, &b), 243, "invalid_argument", "register_engine with 3 tiers for 4 blocks");
    req(&b, 4, "register_engine", 244); mp_str(&b, "blocks"); mp_uint(&b, 4); mp_str(&b, "block_size"); mp_uint(&b, 4096);
    mp_str(&b, "tiers"); mp_bin(&b, et, 4); mp_str(&b, "name"); mp_str(&b, "engine-c");
    r = ok_result(rpc(fd, &b), 244, "register_engine");
    uint64_t er = r ? U(get(r, "region")) : 0;
    CHECK(r && U(get(r, "blocks")) == 4 && U(get(r, "block_size")) == 4096 && U(get(r, "pid")) == (uint64_t)getpid(),
          "register_engine: region, blocks, block_size, pid");
    if (er) {
        r = ok_result(query(fd, 245, er, 0, -1, "query"), 245, "query the engine region");
        node *t = r ? get(r, "tiers") : NULL;
        CHECK(t && t->t == T_BIN && t->len == 4 && !memcmp(t->s, et, 4), "query engine region: the tiers it was given");
        req(&b, 0, "regions", 246);
        r = ok_result(rpc(fd, &b), 246, "regions");
        node *rs = r ? get(r, "regions") : NULL;
        bool found = false;
        for (uint32_t i = 0; rs && i < rs->len; i++)
            if (U(get(item(rs, i), "id")) == er) found = streq(get(item(rs, i), "mode"), "engine");
        CHECK(found, "regions: the engine region has mode engine");
        ok_result(simple(fd, "unregister", 247, er), 247, "unregister the engine region");
    }

    /* stats counts the errors by op:code, `?` for undecodable, `frame` for framing */
    req(&b, 0, "stats", 250);
    r = ok_result(rpc(fd, &b), 250, "stats");
    node *errs = r ? get(r, "errors") : NULL;
    CHECK(errs && U(get(errs, "register:invalid_request")) >= 1 && U(get(errs, "?:invalid_request")) >= 1,
          "stats errors: register:invalid_request and ?:invalid_request counted");
}

/* hint_ring details: a pipelined ask, entries 0, a head behind the tail */
static void check_hint_ring_more(uint64_t region) {
    int fd = conn();
    node *r;
    /* an earlier answer not read yet: unavailable, nothing created */
    buf_t two = { 0 };
    req(&b, 0, "status", 400);
    uint32_t be = htonl((uint32_t)b.n);
    put(&two, &be, 4); put(&two, b.p, b.n);
    req(&b, 0, "hint_ring", 401);
    be = htonl((uint32_t)b.n);
    put(&two, &be, 4); put(&two, b.p, b.n);
    write_all(fd, two.p, two.n);
    free(two.p);
    usleep(200000);
    int rfd = -1;
    ok_result(recv_frame_fd(fd, &rfd), 400, "status pipelined before hint_ring");
    if (rfd >= 0) { close(rfd); rfd = -1; }
    r = recv_frame_fd(fd, &rfd);
    expect_error(r, 401, "unavailable", "hint_ring with an earlier answer unread");
    CHECK(rfd < 0, "hint_ring refused: no fd");
    /* asked again with nothing unread: the ring, default size */
    req(&b, 1, "hint_ring", 402); mp_str(&b, "entries"); mp_uint(&b, 0);
    send_frame(fd, &b);
    r = ok_result(recv_frame_fd(fd, &rfd), 402, "hint_ring entries 0");
    CHECK(r && U(get(r, "entries")) == 131072 && U(get(r, "bytes")) == 4096 + 4 * 131072 && rfd >= 0,
          "hint_ring entries 0: the default 131072, fd attached");
    if (rfd >= 0) {
        uint8_t *ring = mmap(NULL, 4096 + 4 * 131072, PROT_READ | PROT_WRITE, MAP_SHARED, rfd, 0);
        close(rfd);
        uint64_t *head = (uint64_t *)(ring + 64);
        uint32_t *words = (uint32_t *)(ring + 4096);
        words[0] = 0x80000000u | (uint32_t)region;
        words[1] = 7;
        /* an index >= 2^31 cannot be written: it reads as a region word (here: region 7 | bit 31 -> region 7 of nobody) */
        __atomic_store_n(head, 2, __ATOMIC_RELEASE);
        req(&b, 0, "hint_ring", 403);
        r = ok_result(rpc(fd, &b), 403, "hint_ring after 2 words");
        CHECK(r && U(get(r, "accepted")) == 1 && U(get(r, "tail")) == 2, "hint_ring: 1 accepted, tail 2");
        /* head behind the tail */
        __atomic_store_n(head, 1, __ATOMIC_RELEASE);
        req(&b, 0, "hint_ring", 404);
        r = ok_result(rpc(fd, &b), 404, "hint_ring head behind tail");
        CHECK(r && U(get(r, "bad_head")) == 1 && U(get(r, "tail")) == 1, "hint_ring: head behind the tail: bad_head 1, tail = head");
        munmap(ring, 4096 + 4 * 131072);
    }
    req(&b, 1, "hint_ring", 405); mp_str(&b, "entries"); mp_uint(&b, (1u << 30) + 1);
    expect_error(rpc(fd, &b), 405, "invalid_request", "hint_ring entries 2^30+1");
    close(fd);
}


static void check_keys(node *r, const char *what, const char **keys) {
    for (; *keys; keys++) CHECK(r && get(r, *keys), "%s: key %s", what, *keys);
}

/* result schemas, regions that go away, allocate, a socket outliving its process */
static void check_lifetime(int fd) {
    node *r, *e;
    req(&b, 0, "status", 500);
    r = ok_result(rpc(fd, &b), 500, "status");
    const char *st[] = { "server", "server_version", "pid", "uptime_s", "regions", "processes", "blocks",
                         "registered_bytes", "connections", "engine", NULL };
    check_keys(r, "status", st);
    const char *se[] = { "dry_run", "dry_run_planned", "tiers", "last_tick_age_s", "job_running", "plan_settled_age_s",
                         "workers", "manual_moves_pending", "scheduled_moves_pending", "engine_moves_pending",
                         "engine_regions_attached", "stale_blocks", "source_cpu_budget", "sources", "warnings", NULL };
    check_keys(r ? get(r, "engine") : NULL, "status.engine", se);
    req(&b, 0, "tiers", 501);
    r = ok_result(rpc(fd, &b), 501, "tiers");
    const char *tk[] = { "index", "name", "kind", "nodes", "total", "free", "capacity", "kvtier_bytes", "kvtier_blocks",
                         "read_latency_ns", "notes", NULL };
    check_keys(r && get(r, "tiers") && get(r, "tiers")->len ? item(get(r, "tiers"), 0) : NULL, "tiers[0]", tk);
    req(&b, 0, "stats", 502);
    r = ok_result(rpc(fd, &b), 502, "stats");
    const char *sk[] = { "requests", "errors", "bytes_in", "bytes_out", "connections_total", "regions_registered_total",
                         "regions_unregistered_total", "regions_dropped_exit_total", "regions_dropped_unmapped_total",
                         "regions_dropped_uid_total", "regions_adopted_total", "block_hints_total", "migrations",
                         "migration_failed_pages", "ticks_total", "tick_seconds_hist", "uptime_s", NULL };
    check_keys(r, "stats", sk);

    /* partly unmapped: migrate names the unmapped blocks; wholly unmapped: not_found, dropped */
    uint8_t *p = mmap(NULL, 8 * BS, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    memset(p, 1, 8 * BS);
    uint64_t region = reg(fd, 510, p, 8 * BS, BS, "unmapped", &r);
    ok_result(r, 510, "register 8 blocks to unmap");
    const char *rk[] = { "id", "pid", "start_time", "start", "length", "block_size", "nblocks", "name", "tenant",
                         "tenant_id", "priority", "constraints", "owner_uid", "registered_at", "block_hints",
                         "adopted_by", "mode", "placement", "pinned", "unmapped_blocks", "placement_lost",
                         "blocks_by_tier", "temp_sum", NULL };
    req(&b, 2, "regions", 511); mp_str(&b, "after"); mp_uint(&b, region - 1); mp_str(&b, "limit"); mp_uint(&b, 1);
    r = ok_result(rpc(fd, &b), 511, "regions");
    check_keys(r && get(r, "regions") && get(r, "regions")->len ? item(get(r, "regions"), 0) : NULL, "regions[0]", rk);
    munmap(p + 2 * BS, 2 * BS);
    req(&b, 2, "migrate", 512); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "tier"); mp_uint(&b, 0);
    r = ok_result(rpc(fd, &b), 512, "migrate a partly unmapped region");
    node *ub = r ? get(r, "unmapped_blocks") : NULL;
    CHECK(r && U(get(r, "unmapped")) == 2 && U(get(r, "queued")) == 6 && ub && ub->t == T_ARR && ub->len == 1
              && item(ub, 0)->len == 2 && U(item(item(ub, 0), 0)) == 2 && U(item(item(ub, 0), 1)) == 3,
          "migrate: queued 6, unmapped 2, unmapped_blocks [[2, 3]] (queued %llu unmapped %llu)",
          (unsigned long long)U(get(r, "queued")), (unsigned long long)U(get(r, "unmapped")));
    munmap(p, 8 * BS);
    req(&b, 2, "migrate", 513); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "tier"); mp_uint(&b, 0);
    e = expect_error(rpc(fd, &b), 513, "not_found", "migrate a wholly unmapped region");
    char want[64];
    snprintf(want, sizeof want, "no region %llu: dropped at ", (unsigned long long)region);
    CHECK(e && !strncmp(cstr(get(e, "message")), want, strlen(want)) && strstr(cstr(get(e, "message")), "no longer mapped"),
          "not_found says dropped, no longer mapped (%s)", e ? cstr(get(e, "message")) : "");
    e = expect_error(query(fd, 514, region, 0, -1, "query"), 514, "not_found", "query the dropped region");
    CHECK(e && strstr(cstr(get(e, "message")), "no longer mapped"), "query: the reason is remembered");

    /* a process that exits: its region is dropped at once */
    int pfd[2];
    if (pipe(pfd) < 0) die("pipe");
    pid_t child = fork();
    if (child == 0) {
        int c = conn();
        void *q = mmap(NULL, 4 * BS, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        node *cr;
        uint64_t id = reg(c, 1, q, 4 * BS, BS, "child", &cr);
        if (write(pfd[1], &id, sizeof id) != sizeof id) _exit(1);
        _exit(0);
    }
    uint64_t cid = 0;
    if (read(pfd[0], &cid, sizeof cid) != sizeof cid) cid = 0;
    waitpid(child, NULL, 0);
    CHECK(cid > 0, "child registered region %llu", (unsigned long long)cid);
    double t0 = now();
    char *msg = "";
    while (now() - t0 < 5) {
        node *m = query(fd, 520, cid, 0, -1, "query");
        node *er = m ? get(m, "error") : NULL;
        if (er) { msg = cstr(get(er, "message")); break; }
        usleep(20000);
    }
    char exited[64];
    snprintf(exited, sizeof exited, "its process %d exited", (int)child);
    CHECK(strstr(msg, exited) != NULL, "region of an exited process: not_found '%s' (%s)", exited, msg);

    /* the connecting process exits, its child carries on with the socket: register -> process_gone */
    child = fork();
    if (child == 0) {
        int c = conn();
        pid_t g = fork();
        if (g != 0) _exit(0); /* the process that connected */
        usleep(300000);
        void *q = mmap(NULL, 4 * BS, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        node *cr;
        reg(c, 7, q, 4 * BS, BS, "orphan", &cr);
        node *ce = cr ? get(cr, "error") : NULL;
        bool good = ce && streq(get(ce, "code"), "process_gone") && U(get(cr, "id")) == 7;
        if (write(pfd[1], &good, sizeof good) != sizeof good) _exit(1);
        _exit(0);
    }
    waitpid(child, NULL, 0);
    bool good = false;
    if (read(pfd[0], &good, sizeof good) != sizeof good) good = false;
    CHECK(good, "register on a socket whose connecting process exited: process_gone");
    close(pfd[0]);
    close(pfd[1]);

    /* allocate: mapped, untouched memory; the daemon picks tier and node */
    void *a = mmap(NULL, 16 * BS, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    req(&b, 3, "allocate", 530);
    mp_str(&b, "start"); mp_uint(&b, (uintptr_t)a); mp_str(&b, "length"); mp_uint(&b, 16 * BS);
    mp_str(&b, "block_size"); mp_uint(&b, BS);
    r = ok_result(rpc(fd, &b), 530, "allocate auto");
    CHECK(r && U(get(r, "tier")) == 0 && is_uint(get(r, "node")) && get(r, "reason") && get(r, "reason")->t == T_STR
              && get(r, "tier_name") && get(r, "pinned") && get(r, "pinned")->u == 0 && U(get(r, "blocks")) == 16,
          "allocate: tier 0, node, tier_name, reason, pinned false, blocks 16");
    if (r) ok_result(simple(fd, "unregister", 531, U(get(r, "region"))), 531, "unregister the allocated region");
    req(&b, 4, "allocate", 532);
    mp_str(&b, "start"); mp_uint(&b, (uintptr_t)a); mp_str(&b, "length"); mp_uint(&b, 16 * BS);
    mp_str(&b, "block_size"); mp_uint(&b, BS); mp_str(&b, "tier"); mp_str(&b, "cxl7");
    expect_error(rpc(fd, &b), 532, "invalid_argument", "allocate in an unknown tier");
    req(&b, 4, "allocate", 533);
    mp_str(&b, "start"); mp_uint(&b, (uintptr_t)a); mp_str(&b, "length"); mp_uint(&b, 16 * BS);
    mp_str(&b, "block_size"); mp_uint(&b, BS); mp_str(&b, "tier"); mp_str(&b, "");
    expect_error(rpc(fd, &b), 533, "invalid_request", "allocate tier \"\" (str 1..64)");
    munmap(a, 16 * BS);
}

/* the forked child, as uid 65534: someone else's regions (section 4, owner access) */
static int as_other_user(uint64_t root_region) {
    if (setgroups(0, NULL) < 0 || setgid(65534) < 0 || setuid(65534) < 0) die("setuid");
    failures = 0;
    int fd = conn();
    node *r = ok_result(hello(fd, 1, (uint64_t[]){ 1 }, 1), 1, "other uid: hello");
    CHECK(r && U(get(r, "uid")) == 65534 && get(r, "privileged") && get(r, "privileged")->u == 0,
          "other uid: hello says uid 65534, not privileged");
    node *e = expect_error(simple(fd, "unregister", 2, root_region), 2, "permission_denied", "other uid: unregister root's region");
    CHECK(e && I(get(e, "errno")) == EPERM, "other uid: permission_denied errno EPERM (%lld)", (long long)I(get(e, "errno")));
    expect_error(query(fd, 3, root_region, 0, -1, "query"), 3, "permission_denied", "other uid: query root's region");
    uint32_t i0 = 0;
    expect_error(hint(fd, 4, root_region, &i0, 1, NULL), 4, "permission_denied", "other uid: hint root's region");
    req(&b, 2, "migrate", 5); mp_str(&b, "region"); mp_uint(&b, root_region); mp_str(&b, "tier"); mp_uint(&b, 0);
    expect_error(rpc(fd, &b), 5, "permission_denied", "other uid: migrate root's region");
    /* register root's memory (the parent's pid): permission_denied */
    req(&b, 4, "register", 6);
    mp_str(&b, "start"); mp_uint(&b, 1 << 20); mp_str(&b, "length"); mp_uint(&b, 1 << 16);
    mp_str(&b, "block_size"); mp_uint(&b, 4096); mp_str(&b, "pid"); mp_uint(&b, (uint64_t)getppid());
    expect_error(rpc(fd, &b), 6, "permission_denied", "other uid: register root's process memory");
    /* regions: only its own uid's */
    req(&b, 0, "regions", 7);
    r = ok_result(rpc(fd, &b), 7, "other uid: regions");
    bool none = true;
    node *rs = r ? get(r, "regions") : NULL;
    for (uint32_t i = 0; rs && i < rs->len; i++) none &= U(get(item(rs, i), "owner_uid")) == 65534;
    CHECK(rs && none, "other uid: regions lists only uid 65534's");
    /* unknown region stays not_found for it */
    expect_error(simple(fd, "unregister", 8, 2147483001), 8, "not_found", "other uid: unregister of an unknown id");
    /* its own region: register, then unregister */
    void *p = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint64_t mine = reg(fd, 9, p, 1 << 20, 1 << 16, "other", &r);
    ok_result(r, 9, "other uid: register its own memory");
    ok_result(simple(fd, "unregister", 10, mine), 10, "other uid: unregister its own region");
    close(fd);
    return failures;
}


/* Against a daemon started with: limits.max_message_bytes = 8192, request_burst = 3,
 * requests_per_second = 20, frame_timeout = 0.5, idle_timeout = 3, max_connections_per_uid = 4 */
static int limits_mode(void) {
    int fd = conn();
    node *r;
    req(&b, 0, "hello", 1);
    r = ok_result(rpc(fd, &b), 1, "limits: hello");
    uint64_t mmb = r ? U(get(r, "max_message_bytes")) : 0;
    CHECK(mmb == 8192, "limits: hello says max_message_bytes 8192");
    /* the burst is 3 (hello took one): two more, then rate_limited with the request's id */
    buf_t all = { 0 };
    for (uint64_t i = 0; i < 4; i++) {
        req(&b, 0, "status", 10 + i);
        uint32_t be = htonl((uint32_t)b.n);
        put(&all, &be, 4); put(&all, b.p, b.n);
    }
    write_all(fd, all.p, all.n);
    free(all.p);
    ok_result(recv_frame(fd), 10, "limits: 2nd request of the burst");
    ok_result(recv_frame(fd), 11, "limits: 3rd request of the burst");
    node *e = expect_error(recv_frame(fd), 12, "rate_limited", "limits: 4th request");
    CHECK(e && is_uint(get(e, "retry_after_ms")), "rate_limited: retry_after_ms uint");
    uint64_t wait_ms = e ? U(get(e, "retry_after_ms")) : 1000;
    expect_error(recv_frame(fd), 13, "rate_limited", "limits: 5th request");
    usleep((useconds_t)(wait_ms + 100) * 1000);
    req(&b, 0, "status", 14);
    ok_result(rpc(fd, &b), 14, "limits: after retry_after_ms, kept connection answers");
    /* a frame of exactly max_message_bytes is read; one byte more is message_too_large */
    sleep(1);
    req(&b, 1, "status", 15); mp_str(&b, "pad");
    size_t padlen = mmb - b.n - 3;
    char *pad = malloc(padlen + 1);
    memset(pad, 'p', padlen + 1);
    mp_strn(&b, pad, padlen);
    CHECK(b.n == mmb, "limits: built a frame of %zu bytes", b.n);
    ok_result(rpc(fd, &b), 15, "limits: frame of exactly max_message_bytes");
    req(&b, 1, "status", 16); mp_str(&b, "pad"); mp_strn(&b, pad, padlen + 1);
    free(pad);
    /* the daemon answers from the length prefix and closes, maybe before
     * the rest of the frame is written: a failed write here is expected */
    uint32_t be16 = htonl((uint32_t)b.n);
    if (write_until_closed(fd, &be16, 4) == 0)
        write_until_closed(fd, b.p, b.n);
    expect_error(recv_frame(fd), 0, "message_too_large", "limits: frame of max_message_bytes + 1");
    CHECK(closed_by_daemon(fd), "limits: closed after message_too_large");
    close(fd);

    /* a frame stalled midway past frame_timeout: bad_frame "incomplete frame", closed */
    fd = conn();
    uint8_t part[] = { 0, 0, 0, 20, 0x81 };
    write_all(fd, part, sizeof part);
    double t0 = now();
    e = expect_error(recv_frame(fd), 0, "bad_frame", "limits: stalled frame");
    CHECK(e && strstr(cstr(get(e, "message")), "incomplete frame"), "limits: message says incomplete frame (%s)",
          e ? cstr(get(e, "message")) : "");
    CHECK(now() - t0 < 2.5, "limits: within a few frame_timeouts (%.2f s)", now() - t0);
    CHECK(closed_by_daemon(fd), "limits: closed after the stalled frame");
    close(fd);

    /* idle: no request for idle_timeout -> limit_exceeded, id 0, closed */
    fd = conn();
    t0 = now();
    e = expect_error(recv_frame(fd), 0, "limit_exceeded", "limits: idle connection");
    CHECK(e && strstr(cstr(get(e, "message")), "no request for"), "limits: idle message (%s)", e ? cstr(get(e, "message")) : "");
    CHECK(now() - t0 > 2 && now() - t0 < 10, "limits: after about idle_timeout (%.2f s)", now() - t0);
    CHECK(closed_by_daemon(fd), "limits: closed when idle");
    close(fd);

    /* query pages within max_message_bytes: min(8192, 256 KiB) - 4096 = 4096 blocks per answer */
    fd = conn();
    uint8_t *p = mmap(NULL, 10000 * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint64_t region = reg(fd, 30, p, 10000 * 4096, 4096, "limits", &r);
    ok_result(r, 30, "limits: register 10000 blocks");
    page_through(fd, "query", region, 10000, 4096);
    page_through(fd, "blocks", region, 10000, 273);
    sleep(1);
    ok_result(simple(fd, "unregister", 31, region), 31, "limits: unregister");

    /* connections per uid: 4 open, the 5th refused with limit_exceeded, id 0, closed (root too) */
    int more[4];
    for (int i = 0; i < 3; i++) more[i] = conn();
    int fifth = conn();
    e = expect_error(recv_frame(fifth), 0, "limit_exceeded", "limits: 5th connection of the uid");
    CHECK(closed_by_daemon(fifth), "limits: 5th connection closed");
    close(fifth);
    for (int i = 0; i < 3; i++) close(more[i]);
    close(fd);
    printf("%d failure%s\n", failures, failures == 1 ? "" : "s");
    return failures;
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: %s SOCKET\n", argv[0]); return 2; }
    sock_path = argv[1];
    my_page_size = (uint64_t)sysconf(_SC_PAGESIZE);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc > 2 && !strcmp(argv[2], "limits")) return limits_mode();

    int fd = conn();
    check_hello(fd);

    /* register: 32 blocks of 64 KiB of my own anonymous memory; the first half written */
    uint8_t *pool = mmap(NULL, NB * BS, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (pool == MAP_FAILED) die("mmap");
    memset(pool, 0x5a, NB / 2 * BS);
    node *m;
    uint64_t region = reg(fd, 10, pool, NB * BS, BS, "doc-c", &m);
    node *r = ok_result(m, 10, "register");
    CHECK(r && region >= 1 && U(get(r, "blocks")) == NB && U(get(r, "block_size")) == BS
              && U(get(r, "pid")) == (uint64_t)getpid() && !get(r, "existing"),
          "register: region, blocks %u, block_size, pid, no existing", NB);
    /* the same range again: existing, same id */
    uint64_t again = reg(fd, 11, pool, NB * BS, BS, "doc-c", &m);
    r = ok_result(m, 11, "register again");
    CHECK(again == region && r && get(r, "existing") && get(r, "existing")->u == 1, "register again: existing true, same id");
    /* overlapping, different: overlap */
    reg(fd, 12, pool + BS, 4 * BS, BS, "x", &m);
    expect_error(m, 12, "overlap", "register overlapping");
    /* block_size below 4096 */
    uint8_t *other = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    reg(fd, 13, other, 1 << 20, 2048, "x", &m);
    expect_error(m, 13, "invalid_argument", "register block_size 2048");
    reg(fd, 14, other, 4096, 8192, "x", &m);
    expect_error(m, 14, "invalid_argument", "register length < block_size");
    /* not mapped: a hole */
    munmap(other + (512 << 10), 4096);
    reg(fd, 15, other, 1 << 20, 4096, "x", &m);
    expect_error(m, 15, "range_not_mapped", "register over an unmapped page");
    /* file-backed, not anonymous: range_not_mapped */
    FILE *tf = tmpfile();
    if (tf && ftruncate(fileno(tf), 1 << 16) == 0) {
        void *fm = mmap(NULL, 1 << 16, PROT_READ | PROT_WRITE, MAP_PRIVATE, fileno(tf), 0);
        reg(fd, 16, fm, 1 << 16, 4096, "x", &m);
        expect_error(m, 16, "range_not_mapped", "register a private file mapping");
    }
    /* name longer than 128 characters */
    char longname[140];
    memset(longname, 'n', 129); longname[129] = 0;
    reg(fd, 17, other, 4096, 4096, longname, &m);
    expect_error(m, 17, "invalid_request", "register name of 129 characters");
    /* name nil: invalid_request (only the listed fields take nil) */
    req(&b, 4, "register", 18);
    mp_str(&b, "start"); mp_uint(&b, (uintptr_t)other); mp_str(&b, "length"); mp_uint(&b, 4096);
    mp_str(&b, "block_size"); mp_uint(&b, 4096); mp_str(&b, "name"); mp_nil(&b);
    expect_error(rpc(fd, &b), 18, "invalid_request", "register name nil");
    /* start as a negative int: invalid_request naming $.start */
    req(&b, 3, "register", 19);
    mp_str(&b, "start"); mp_int(&b, -4096); mp_str(&b, "length"); mp_uint(&b, 4096);
    mp_str(&b, "block_size"); mp_uint(&b, 4096);
    node *e = expect_error(rpc(fd, &b), 19, "invalid_request", "register start -4096");
    CHECK(e && strstr(cstr(get(e, "message")), "$.start"), "invalid_request names $.start (%s)", cstr(get(e, "message")));

    /* hint (section 4 and the example of section 8) */
    uint32_t idx[] = { 0, 5, NB - 1 }, cnt[] = { 1, 2, 1 };
    r = ok_result(hint(fd, 20, region, idx, 3, cnt), 20, "hint with counts");
    CHECK(r && U(get(r, "accepted")) == 3, "hint: accepted 3");
    uint32_t rep[] = { 1, 1, 1, 2 };
    r = ok_result(hint(fd, 21, region, rep, 4, NULL), 21, "hint, repeats, no counts");
    CHECK(r && U(get(r, "accepted")) == 4, "hint: accepted 4 (repeats count)");
    r = ok_result(hint(fd, 22, region, NULL, 0, NULL), 22, "empty hint");
    CHECK(r && U(get(r, "accepted")) == 0, "empty hint: accepted 0");
    uint32_t past[] = { 1, NB };
    expect_error(hint(fd, 23, region, past, 2, NULL), 23, "invalid_argument", "hint past the end");
    req(&b, 2, "hint", 24); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "blocks"); mp_bin(&b, idx, 5);
    expect_error(rpc(fd, &b), 24, "invalid_argument", "hint blocks of 5 bytes");
    req(&b, 3, "hint", 26); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "blocks"); mp_bin(&b, idx, 12);
    mp_str(&b, "counts"); mp_bin(&b, cnt, 8);
    expect_error(rpc(fd, &b), 26, "invalid_argument", "hint counts of another length");
    req(&b, 2, "hint", 27); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "blocks"); mp_arr(&b, 1); mp_uint(&b, 0);
    expect_error(rpc(fd, &b), 27, "invalid_request", "hint blocks as an array");
    req(&b, 3, "hint", 28); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "blocks"); mp_bin(&b, idx, 12);
    mp_str(&b, "counts"); mp_nil(&b);
    r = ok_result(rpc(fd, &b), 28, "hint counts nil");
    CHECK(r && U(get(r, "accepted")) == 3, "hint counts nil: accepted 3");

    /* phase */
    req(&b, 2, "phase", 30); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "phase"); mp_str(&b, "prefill_done");
    r = ok_result(rpc(fd, &b), 30, "phase prefill_done, all");
    CHECK(r && U(get(r, "blocks")) == NB, "phase all: blocks = region's block count");
    req(&b, 3, "phase", 31); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "phase"); mp_str(&b, "active");
    mp_str(&b, "blocks"); mp_bin(&b, rep, 16);
    r = ok_result(rpc(fd, &b), 31, "phase active, 4 entries");
    CHECK(r && U(get(r, "blocks")) == 4, "phase: blocks 4 (repeats included)");
    req(&b, 2, "phase", 32); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "phase"); mp_str(&b, "sleepy");
    expect_error(rpc(fd, &b), 32, "invalid_request", "phase of an unknown name");

    /* query: wait until the written half is measured (a tick or two), the rest reads -1 (never touched) */
    int8_t tiers[NB];
    double t0 = now();
    bool measured = false;
    node *tn = NULL;
    req(&b, 1, "measure", 39); mp_str(&b, "region"); mp_uint(&b, region);
    r = ok_result(rpc(fd, &b), 39, "measure");
    CHECK(r && is_uint(get(r, "queued")), "measure: queued");
    while (!measured && now() - t0 < 20) {
        r = ok_result(query(fd, 40, region, 0, -1, "query"), 40, "query");
        if (!r) break;
        node *t = get(r, "tiers");
        if (!t || t->t != T_BIN || t->len != NB) { CHECK(false, "query: tiers bin of %u", NB); break; }
        memcpy(tiers, t->s, NB);
        measured = true;
        for (unsigned i = 0; i < NB / 2; i++) measured &= tiers[i] >= 0;
        if (measured) {
            CHECK(U(get(r, "region")) == region && U(get(r, "first")) == 0 && U(get(r, "count")) == NB && !get(r, "next"),
                  "query: region, first 0, count %u, no next", NB);
            tn = get(r, "tier_names");
            CHECK(tn && tn->t == T_ARR && tn->len >= 1, "query: tier_names array");
        } else {
            usleep(50000);
        }
    }
    CHECK(measured, "query: written blocks measured within 20 s");
    bool untouched = true;
    for (unsigned i = NB / 2; i < NB; i++) untouched &= tiers[i] == -1;
    CHECK(untouched, "query: never-written blocks read -1");
    r = ok_result(query(fd, 41, region, NB, -1, "query"), 41, "query first = block count");
    CHECK(r && U(get(r, "count")) == 0 && get(r, "tiers") && get(r, "tiers")->len == 0, "query at the end: empty answer");
    expect_error(query(fd, 42, region, NB + 1, -1, "query"), 42, "invalid_argument", "query first past the end");
    r = ok_result(query(fd, 43, region, 3, 0, "query"), 43, "query count 0");
    CHECK(r && U(get(r, "count")) == 0, "query count 0: empty");
    r = ok_result(query(fd, 44, region, NB - 2, 100, "query"), 44, "query count past the end");
    CHECK(r && U(get(r, "count")) == 2 && !get(r, "next"), "query count past the end: stops at the end, no next");
    req(&b, 2, "query", 45); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "count"); mp_nil(&b);
    r = ok_result(rpc(fd, &b), 45, "query count nil");
    CHECK(r && U(get(r, "count")) == NB, "query count nil: to the end");
    req(&b, 2, "query", 46); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "first"); mp_nil(&b);
    expect_error(rpc(fd, &b), 46, "invalid_request", "query first nil");

    /* blocks: flags bit 5 = never touched, ages +inf if never accessed */
    r = ok_result(query(fd, 50, region, 0, -1, "blocks"), 50, "blocks");
    if (r) {
        node *fl = get(r, "flags"), *tm = get(r, "temps"), *st = get(r, "stuck"), *ag = get(r, "last_access_age");
        bool shapes = fl && fl->t == T_BIN && fl->len == NB && tm && tm->t == T_BIN && tm->len == 4 * NB && st
                      && st->t == T_BIN && st->len == NB && ag && ag->t == T_BIN && ag->len == 8 * NB
                      && get(r, "tier_names") && get(r, "stuck_names");
        CHECK(shapes, "blocks: flags u8, temps f32, stuck u8, last_access_age f64, names");
        if (shapes) {
            CHECK((fl->s[NB - 2] & 0x20) && !(fl->s[0] & 0x20), "blocks: flag bit 5 on an unwritten block only");
            double a0, an;
            memcpy(&a0, ag->s, 8);
            memcpy(&an, ag->s + 8 * (NB - 2), 8);
            CHECK(a0 >= 0 && a0 < 60 && isinf(an), "blocks: age of hinted block 0 %.3f s, of never-hinted block %u +inf (%g)",
                  a0, NB - 2, an);
            float t5, t3;
            memcpy(&t5, tm->s + 20, 4);
            memcpy(&t3, tm->s + 12, 4);
            CHECK(t5 > t3, "blocks: temperature of block 5 (hinted twice) %.3f > block 3 (never) %.3f", t5, t3);
            node *sn = get(r, "stuck_names");
            CHECK(sn->t == T_ARR && sn->len == 5 && streq(item(sn, 0), "none") && streq(item(sn, 4), "failing"),
                  "blocks: stuck_names none..failing");
        }
    }

    /* tiers */
    req(&b, 0, "tiers", 60);
    r = ok_result(rpc(fd, &b), 60, "tiers");
    uint64_t ntiers = 0;
    if (r && get(r, "tiers") && get(r, "tiers")->t == T_ARR) {
        node *ts = get(r, "tiers");
        ntiers = ts->len;
        bool idx_ok = true;
        for (uint32_t i = 0; i < ts->len; i++) idx_ok &= U(get(item(ts, i), "index")) == i;
        CHECK(idx_ok && streq(get(item(ts, 0), "kind"), "dram"), "tiers: index = position, tier 0 is dram");
    }

    /* migrate: to tier 0 (where it is), with wait; to a tier that does not exist */
    req(&b, 2, "migrate", 70); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "tier"); mp_uint(&b, 0);
    r = ok_result(rpc(fd, &b), 70, "migrate to tier 0");
    CHECK(r && is_uint(get(r, "queued")) && is_uint(get(r, "unmapped")) && get(r, "unmapped_blocks")
              && get(r, "unmapped_blocks")->t == T_ARR,
          "migrate: queued, unmapped, unmapped_blocks");
    req(&b, 3, "migrate", 71); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "tier"); mp_uint(&b, 0);
    mp_str(&b, "wait"); mp_bool(&b, true);
    r = ok_result(rpc(fd, &b), 71, "migrate to tier 0, wait");
    if (r) {
        const char *keys[] = { "region", "tier", "blocks", "moved", "failed", "already", "unmapped", "gone",
                               "engine", "attempts", "retried", "pages_moved", "planned", "untouched" };
        for (size_t i = 0; i < sizeof keys / sizeof *keys; i++)
            CHECK(is_uint(get(r, keys[i])), "migrate wait: %s uint", keys[i]);
        CHECK(get(r, "failed_pages") && get(r, "failed_pages")->t == T_MAP, "migrate wait: failed_pages map");
        CHECK(get(r, "dry_run") && get(r, "dry_run")->t == T_BOOL, "migrate wait: dry_run bool");
        CHECK(get(r, "seconds") && get(r, "seconds")->t == T_FLOAT, "migrate wait: seconds float");
        CHECK(U(get(r, "failed")) == 0 && U(get(r, "untouched")) == NB / 2
                  && U(get(r, "already")) + U(get(r, "moved")) == NB / 2,
              "migrate wait: %u untouched, the written half already/moved, none failed (already %llu moved %llu untouched %llu)",
              NB / 2, (unsigned long long)U(get(r, "already")), (unsigned long long)U(get(r, "moved")),
              (unsigned long long)U(get(r, "untouched")));
    }
    req(&b, 2, "migrate", 72); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "tier"); mp_uint(&b, ntiers);
    expect_error(rpc(fd, &b), 72, "invalid_argument", "migrate to the tier past the last (no such tier)");
    req(&b, 2, "migrate", 73); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "tier"); mp_uint(&b, 64);
    expect_error(rpc(fd, &b), 73, "invalid_request", "migrate to tier 64 (tier is 0..63)");
    req(&b, 3, "migrate", 74); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "tier"); mp_uint(&b, 0);
    mp_str(&b, "blocks"); mp_bin(&b, past, 8);
    expect_error(rpc(fd, &b), 74, "invalid_argument", "migrate a block past the end");

    /* explain, pin/unpin, prefetch/release, ages, stats, status */
    req(&b, 2, "explain", 80); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "block"); mp_uint(&b, 0);
    r = ok_result(rpc(fd, &b), 80, "explain");
    CHECK(r && get(r, "text") && get(r, "text")->t == T_STR, "explain: text");
    req(&b, 2, "pin", 81); mp_str(&b, "region"); mp_uint(&b, region); mp_str(&b, "tier"); mp_nil(&b);
    r = ok_result(rpc(fd, &b), 81, "pin, tier nil, all");
    CHECK(r && U(get(r, "blocks")) == NB, "pin: blocks %u", NB);
    r = ok_result(simple(fd, "unpin", 82, region), 82, "unpin all");
    CHECK(r && U(get(r, "blocks")) == NB, "unpin: blocks %u", NB);
    r = ok_result(simple(fd, "prefetch", 83, region), 83, "prefetch all");
    CHECK(r && U(get(r, "queued")) + U(get(r, "already")) + U(get(r, "skipped"))
                       + (get(r, "deferred") ? U(get(r, "deferred")) : 0) == NB,
          "prefetch: queued + already + skipped + deferred = %u", NB);
    r = ok_result(simple(fd, "release", 84, region), 84, "release all");
    CHECK(r && U(get(r, "queued")) + U(get(r, "already")) + U(get(r, "skipped")) == NB && !get(r, "deferred"),
          "release: queued + already + skipped = %u, no deferred", NB);
    req(&b, 0, "ages", 85);
    r = ok_result(rpc(fd, &b), 85, "ages");
    CHECK(r && get(r, "buckets") && get(r, "buckets")->len == 6 && get(r, "edges_s") && get(r, "edges_s")->len == 5,
          "ages: 6 buckets, 5 edges");
    req(&b, 0, "stats", 86);
    r = ok_result(rpc(fd, &b), 86, "stats");
    CHECK(r && get(r, "requests") && get(r, "requests")->t == T_MAP && get(r, "errors") && get(r, "uptime_s"),
          "stats: requests, errors, uptime_s");
    CHECK(r && U(get(get(r, "requests"), "hint")) >= 4, "stats: requests.hint counted");

    /* regions: paging with after/limit/next; three regions of mine */
    uint8_t *big = mmap(NULL, (size_t)BIG_NB * BIG_BS, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (big == MAP_FAILED) die("mmap big");
    uint64_t bigr = reg(fd, 90, big, (uint64_t)BIG_NB * BIG_BS, BIG_BS, "doc-c-big", &m);
    r = ok_result(m, 90, "register 300,000 blocks");
    uint8_t *mid = mmap(NULL, 20000 * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint64_t midr = reg(fd, 91, mid, 20000 * 4096, 4096, "doc-c-mid", &m);
    ok_result(m, 91, "register 20,000 blocks");
    uint64_t want[3] = { region, bigr, midr }, got[8];
    int ngot = 0;
    uint64_t after = 0;
    for (int page = 0; page < 8; page++) {
        req(&b, 3, "regions", 92); mp_str(&b, "pid"); mp_uint(&b, (uint64_t)getpid());
        mp_str(&b, "after"); mp_uint(&b, after); mp_str(&b, "limit"); mp_uint(&b, 1);
        r = ok_result(rpc(fd, &b), 92, "regions limit 1");
        if (!r) break;
        node *rs = get(r, "regions");
        if (!rs || rs->t != T_ARR) { CHECK(false, "regions: array"); break; }
        for (uint32_t i = 0; i < rs->len && ngot < 8; i++) got[ngot++] = U(get(item(rs, i), "id"));
        if (rs->len == 1) {
            node *x = item(rs, 0);
            CHECK(U(get(x, "pid")) == (uint64_t)getpid() && is_uint(get(x, "nblocks")) && get(x, "mode")
                      && streq(get(x, "mode"), "kernel") && get(x, "blocks_by_tier")
                      && get(x, "blocks_by_tier")->t == T_MAP && get(x, "registered_at")
                      && get(x, "registered_at")->t == T_FLOAT,
                  "regions: entry fields (pid, nblocks, mode kernel, blocks_by_tier, registered_at)");
        }
        node *nx = get(r, "next");
        if (!nx) break;
        CHECK(rs->len == 1 && U(nx) == got[ngot - 1], "regions: next = this page's last id");
        after = U(nx);
    }
    CHECK(ngot == 3 && got[0] == want[0] && got[1] == want[1] && got[2] == want[2] && want[0] < want[1] && want[1] < want[2],
          "regions: my 3 regions by ascending id in 3 pages, the last without next (%d)", ngot);
    req(&b, 1, "regions", 93); mp_str(&b, "limit"); mp_uint(&b, 0);
    expect_error(rpc(fd, &b), 93, "invalid_request", "regions limit 0 (1..4096)");
    req(&b, 1, "regions", 94); mp_str(&b, "limit"); mp_nil(&b);
    ok_result(rpc(fd, &b), 94, "regions limit nil");

    /* query and blocks page: 258,048 / 17,203 blocks per answer at the defaults (section 4, query) */
    page_through(fd, "query", bigr, BIG_NB, 258048);
    page_through(fd, "blocks", midr, 20000, 17203);
    ok_result(simple(fd, "unregister", 95, bigr), 95, "unregister the big region");
    ok_result(simple(fd, "unregister", 96, midr), 96, "unregister the 20,000-block region");
    munmap(big, (size_t)BIG_NB * BIG_BS);
    munmap(mid, 20000 * 4096);

    /* the shared-memory hint ring, on a connection that has no unread answers */
    check_hint_ring(fd, region, NB);

    check_fields(fd, region);
    check_hint_ring_more(region);
    check_lifetime(fd);

    /* a second connection of the same process: registrations belong to the process (section 1) */
    int fd2 = conn();
    r = ok_result(query(fd2, 110, region, 0, 1, "query"), 110, "query from a second connection (no hello)");
    close(fd2);

    /* someone else: a child as uid 65534 */
    if (getuid() == 0) {
        pid_t child = fork();
        if (child == 0) _exit(as_other_user(region) ? 1 : 0);
        int st = 0;
        waitpid(child, &st, 0);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the other uid's checks (above) passed");
    } else {
        printf("skip other-uid checks: not root\n");
    }

    check_errors();

    /* unregister, then the region is gone */
    r = ok_result(simple(fd, "unregister", 120, region), 120, "unregister");
    CHECK(r && r->len == 0, "unregister: result {}");
    e = expect_error(query(fd, 121, region, 0, -1, "query"), 121, "not_found", "query after unregister");
    expect_error(simple(fd, "unregister", 122, region), 122, "not_found", "unregister twice");
    close(fd);
    CHECK(!key_order_bad, "every answer: keys id, ok, result|error in that order (%d not)", key_order_bad);
    CHECK(!not_shortest, "every answer: integers in their shortest format (%d not)", not_shortest);
    CHECK(!float32_seen, "every answer: floats as float64 (%d float32)", float32_seen);
    printf("%d failure%s\n", failures, failures == 1 ? "" : "s");
    return failures > 99 ? 99 : failures;
}
