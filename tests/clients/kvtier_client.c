/* kvtier_client.c: a kvtierd client in C, written from docs/protocol.md
 * alone (no third-party library: the minimal MessagePack encoder and
 * decoder below cover the types section 2 lists).
 *
 * It is the proof that the protocol page is enough to write a client, and
 * the host test tests/host/test_c_client.py runs it against a real kvtierd.
 * It walks one registration's whole life and checks every answer against
 * what the page says:
 *
 *   hello; mmap a page-aligned buffer of NBLOCKS blocks and touch it;
 *   register it (and again: the same region comes back `existing`);
 *   an overlapping register -> `overlap`; HINT_FRAMES hints sent in one
 *   go without reading (one of them bad -> `invalid_argument`, the others
 *   answered in order); a hint ring (hint_ring: the memfd by SCM_RIGHTS,
 *   sealed; hints published across the wrap, one of them bad, counted);
 *   phase; query until measured, and a short page;
 *   blocks; stats; tiers; migrate with wait (to swap and back when the
 *   daemon has a swap tier, else to tier 0); with a swap tier, an
 *   engine-mode region: migrate, the `move` event, move_done; regions
 *   paged one by one;
 *   malformed payloads (unknown op, not a map, trailing bytes) on a
 *   connection that stays usable; unregister; query -> `not_found`;
 *   a zero-length frame and an oversized header, each closing its
 *   connection.
 *
 * Usage: kvtier_client [--pause] [SOCKET]
 *   SOCKET defaults to $KVTIER_SOCKET, then /run/kvtierd/kvtierd.sock.
 *   --pause: before unregistering, print "PAUSE region=R hinted=N" and wait
 *   for a line on stdin (the test checks the daemon's view meanwhile).
 * Prints "key value" lines; exits 0 when every check held, 1 otherwise.
 *
 * Build: cc -std=c11 -Wall -Wextra -O2 -o kvtier_client kvtier_client.c
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define NBLOCKS 8
#define HINT_FRAMES 40
#define BAD_HINT_AT 17 /* the pipelined hint frame that names a block past the end */
#define RING_ENTRIES 256 /* the hint ring asked for, in words */
#define RING_FIRST 200   /* hints published before the first drain; then RING_SECOND, across the wrap */
#define RING_SECOND 100

static int failures;

static void vreport(const char *tag, const char *fmt, va_list ap)
{
    fprintf(stderr, "%s: ", tag);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
}

/* a broken promise of docs/protocol.md: counted, the walk goes on */
static void fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vreport("FAIL", fmt, ap);
    va_end(ap);
    failures++;
}

/* nothing sensible can follow (no answer, undecodable frame) */
static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vreport("FATAL", fmt, ap);
    va_end(ap);
    exit(2);
}

#define CHECK(cond, ...) do { if (!(cond)) fail(__VA_ARGS__); } while (0)

/* ---------------------------------------------------------------- encoder */

typedef struct {
    uint8_t *p;
    size_t n, cap;
} buf_t;

static void put(buf_t *b, const void *src, size_t n)
{
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        while (cap < b->n + n)
            cap *= 2;
        b->p = realloc(b->p, cap);
        if (!b->p)
            die("out of memory");
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void put1(buf_t *b, uint8_t v) { put(b, &v, 1); }

static void put_be(buf_t *b, uint64_t v, int bytes)
{
    uint8_t t[8];
    for (int i = 0; i < bytes; i++)
        t[i] = (uint8_t)(v >> (8 * (bytes - 1 - i)));
    put(b, t, (size_t)bytes);
}

/* MessagePack is big-endian throughout; only the contents of packed `bin`
 * arrays are little-endian (section 5). */
static void mp_uint(buf_t *b, uint64_t v)
{
    if (v < 0x80) put1(b, (uint8_t)v);
    else if (v <= 0xff) { put1(b, 0xcc); put_be(b, v, 1); }
    else if (v <= 0xffff) { put1(b, 0xcd); put_be(b, v, 2); }
    else if (v <= 0xffffffffu) { put1(b, 0xce); put_be(b, v, 4); }
    else { put1(b, 0xcf); put_be(b, v, 8); }
}

static void mp_int(buf_t *b, int64_t v)
{
    if (v >= 0) mp_uint(b, (uint64_t)v);
    else if (v >= -32) put1(b, (uint8_t)(int8_t)v);
    else if (v >= INT8_MIN) { put1(b, 0xd0); put_be(b, (uint64_t)v, 1); }
    else if (v >= INT16_MIN) { put1(b, 0xd1); put_be(b, (uint64_t)v, 2); }
    else if (v >= INT32_MIN) { put1(b, 0xd2); put_be(b, (uint64_t)v, 4); }
    else { put1(b, 0xd3); put_be(b, (uint64_t)v, 8); }
}

static void mp_hdr(buf_t *b, uint32_t n, uint8_t fix, uint8_t fixmax, uint8_t c8, uint8_t c16, uint8_t c32)
{
    if (n <= fixmax) put1(b, (uint8_t)(fix | n));
    else if (c8 && n <= 0xff) { put1(b, c8); put_be(b, n, 1); }
    else if (n <= 0xffff) { put1(b, c16); put_be(b, n, 2); }
    else { put1(b, c32); put_be(b, n, 4); }
}

static void mp_map(buf_t *b, uint32_t n) { mp_hdr(b, n, 0x80, 15, 0, 0xde, 0xdf); }
static void mp_arr(buf_t *b, uint32_t n) { mp_hdr(b, n, 0x90, 15, 0, 0xdc, 0xdd); }

static void mp_str(buf_t *b, const char *s)
{
    size_t n = strlen(s);
    mp_hdr(b, (uint32_t)n, 0xa0, 31, 0xd9, 0xda, 0xdb);
    put(b, s, n);
}

static void mp_bin(buf_t *b, const void *p, uint32_t n)
{
    if (n <= 0xff) { put1(b, 0xc4); put_be(b, n, 1); }
    else if (n <= 0xffff) { put1(b, 0xc5); put_be(b, n, 2); }
    else { put1(b, 0xc6); put_be(b, n, 4); }
    put(b, p, n);
}

static void mp_bool(buf_t *b, int v) { put1(b, v ? 0xc3 : 0xc2); }

/* packed u32 little-endian (section 5), whatever the host's order */
static void mp_u32s(buf_t *b, const uint32_t *v, uint32_t n)
{
    uint8_t *t = malloc((size_t)n * 4 + 1);
    if (!t)
        die("out of memory");
    for (uint32_t i = 0; i < n; i++) {
        t[4 * i] = (uint8_t)v[i];
        t[4 * i + 1] = (uint8_t)(v[i] >> 8);
        t[4 * i + 2] = (uint8_t)(v[i] >> 16);
        t[4 * i + 3] = (uint8_t)(v[i] >> 24);
    }
    mp_bin(b, t, n * 4);
    free(t);
}

/* ---------------------------------------------------------------- decoder */

enum { T_NIL, T_BOOL, T_UINT, T_INT, T_FLOAT, T_STR, T_BIN, T_ARR, T_MAP };

typedef struct node {
    int type;
    union {
        int b;
        uint64_t u; /* T_UINT: a value >= 0 */
        int64_t i;  /* T_INT: a value < 0 */
        double f;
        struct { const uint8_t *p; uint32_t n; } s;      /* str, bin */
        struct { struct node *v; uint32_t n; } a;       /* array: n items; map: 2n (key, value) */
    };
} node;

typedef struct {
    const uint8_t *p, *end;
    node *pool;
    size_t used, cap;
    const char *err;
} dec_t;

#define MAX_DEPTH 64

static node *alloc_nodes(dec_t *d, uint64_t n)
{
    /* every node takes at least one byte of input: refuse counts the
     * payload cannot hold before allocating */
    if (n > (uint64_t)(d->end - d->p)) {
        d->err = "container count exceeds the payload";
        return NULL;
    }
    if (d->used + n > d->cap) {
        d->err = "node pool exhausted";
        return NULL;
    }
    node *r = d->pool + d->used;
    d->used += n;
    return r;
}

static int need(dec_t *d, size_t n)
{
    if ((size_t)(d->end - d->p) < n) {
        d->err = "truncated";
        return 0;
    }
    return 1;
}

static uint64_t get_be(dec_t *d, int bytes)
{
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++)
        v = (v << 8) | d->p[i];
    d->p += bytes;
    return v;
}

static int dec(dec_t *d, node *out, int depth);

static int dec_raw(dec_t *d, node *out, int type, uint64_t n)
{
    if (!need(d, n))
        return 0;
    out->type = type;
    out->s.p = d->p;
    out->s.n = (uint32_t)n;
    d->p += n;
    return 1;
}

static int dec_cont(dec_t *d, node *out, int type, uint64_t n, int depth)
{
    if (depth >= MAX_DEPTH) {
        d->err = "nesting too deep";
        return 0;
    }
    uint64_t items = type == T_MAP ? 2 * n : n;
    node *v = alloc_nodes(d, items);
    if (!v)
        return 0;
    out->type = type;
    out->a.v = v;
    out->a.n = (uint32_t)n;
    for (uint64_t i = 0; i < items; i++)
        if (!dec(d, &v[i], depth + 1))
            return 0;
    return 1;
}

static int dec(dec_t *d, node *out, int depth)
{
    if (!need(d, 1))
        return 0;
    uint8_t c = *d->p++;
    if (c <= 0x7f) { out->type = T_UINT; out->u = c; return 1; }
    if (c >= 0xe0) { out->type = T_INT; out->i = (int8_t)c; return 1; }
    if ((c & 0xf0) == 0x80) return dec_cont(d, out, T_MAP, c & 0x0f, depth);
    if ((c & 0xf0) == 0x90) return dec_cont(d, out, T_ARR, c & 0x0f, depth);
    if ((c & 0xe0) == 0xa0) return dec_raw(d, out, T_STR, c & 0x1f);
    switch (c) {
    case 0xc0: out->type = T_NIL; return 1;
    case 0xc2: case 0xc3: out->type = T_BOOL; out->b = c == 0xc3; return 1;
    case 0xc4: case 0xc5: case 0xc6: {
        int w = c == 0xc4 ? 1 : c == 0xc5 ? 2 : 4;
        if (!need(d, (size_t)w)) return 0;
        return dec_raw(d, out, T_BIN, get_be(d, w));
    }
    case 0xd9: case 0xda: case 0xdb: {
        int w = c == 0xd9 ? 1 : c == 0xda ? 2 : 4;
        if (!need(d, (size_t)w)) return 0;
        return dec_raw(d, out, T_STR, get_be(d, w));
    }
    case 0xca: {
        if (!need(d, 4)) return 0;
        uint32_t v = (uint32_t)get_be(d, 4);
        float f;
        memcpy(&f, &v, 4);
        out->type = T_FLOAT; out->f = f;
        return 1;
    }
    case 0xcb: {
        if (!need(d, 8)) return 0;
        uint64_t v = get_be(d, 8);
        memcpy(&out->f, &v, 8);
        out->type = T_FLOAT;
        return 1;
    }
    case 0xcc: case 0xcd: case 0xce: case 0xcf: {
        int w = 1 << (c - 0xcc);
        if (!need(d, (size_t)w)) return 0;
        out->type = T_UINT; out->u = get_be(d, w);
        return 1;
    }
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        int w = 1 << (c - 0xd0);
        if (!need(d, (size_t)w)) return 0;
        uint64_t v = get_be(d, w);
        int64_t s;
        if (w < 8) { /* sign-extend */
            uint64_t m = 1ull << (8 * w - 1);
            s = (int64_t)((v ^ m) - m);
        } else {
            s = (int64_t)v;
        }
        /* section 2: any width may carry any value; a signed format
         * holding a value >= 0 is still a plain uint to us */
        if (s >= 0) { out->type = T_UINT; out->u = (uint64_t)s; }
        else { out->type = T_INT; out->i = s; }
        return 1;
    }
    case 0xdc: case 0xdd: {
        int w = c == 0xdc ? 2 : 4;
        if (!need(d, (size_t)w)) return 0;
        return dec_cont(d, out, T_ARR, get_be(d, w), depth);
    }
    case 0xde: case 0xdf: {
        int w = c == 0xde ? 2 : 4;
        if (!need(d, (size_t)w)) return 0;
        return dec_cont(d, out, T_MAP, get_be(d, w), depth);
    }
    default:
        /* ext types (0xc7-0xc9, 0xd4-0xd8) and 0xc1 are not in the
         * protocol's type table */
        d->err = "type not used by the protocol";
        return 0;
    }
}

/* ---------------------------------------------------------------- lookups */

static const node *get(const node *m, const char *key)
{
    if (!m || m->type != T_MAP)
        return NULL;
    size_t kl = strlen(key);
    const node *found = NULL;
    for (uint32_t i = 0; i < m->a.n; i++) {
        const node *k = &m->a.v[2 * i];
        /* a repeated key: the last one wins (section 6.1) */
        if (k->type == T_STR && k->s.n == kl && memcmp(k->s.p, key, kl) == 0)
            found = &m->a.v[2 * i + 1];
    }
    return found;
}

static int is_uint(const node *n) { return n && n->type == T_UINT; }

static uint64_t uget(const node *m, const char *key, uint64_t dflt)
{
    const node *n = get(m, key);
    return is_uint(n) ? n->u : dflt;
}

static int str_eq(const node *n, const char *s)
{
    return n && n->type == T_STR && n->s.n == strlen(s) && memcmp(n->s.p, s, n->s.n) == 0;
}

static void str_copy(const node *n, char *out, size_t cap)
{
    size_t k = 0;
    if (n && n->type == T_STR) {
        k = n->s.n < cap - 1 ? n->s.n : cap - 1;
        memcpy(out, n->s.p, k);
    }
    out[k] = 0;
}

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static float lef32(const uint8_t *p)
{
    uint32_t v = le32(p);
    float f;
    memcpy(&f, &v, 4);
    return f;
}

/* ---------------------------------------------------------------- framing */

typedef struct {
    int fd;
    uint64_t max_message_bytes;
    uint8_t *rx;    /* the last frame's payload */
    uint32_t rx_n;
    node *pool;
    size_t pool_cap;
    node root;      /* the last frame, decoded */
    uint8_t *ev;    /* an event that came while waiting for an answer */
    uint32_t ev_n;
} conn_t;

static int write_all(int fd, const void *p, size_t n)
{
    const uint8_t *c = p;
    while (n) {
        ssize_t k = send(fd, c, n, MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        c += k;
        n -= (size_t)k;
    }
    return 0;
}

/* 1: n bytes read; 0: EOF before the first byte; -1: error or EOF midway */
static int read_all(int fd, void *p, size_t n)
{
    uint8_t *c = p;
    size_t got = 0;
    while (got < n) {
        ssize_t k = recv(fd, c + got, n - got, 0);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (k == 0)
            return got ? -1 : 0;
        got += (size_t)k;
    }
    return 1;
}

static int conn_open(conn_t *c, const char *path)
{
    memset(c, 0, sizeof *c);
    c->max_message_bytes = 16777216; /* section 2's default until hello says */
    c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (c->fd < 0)
        die("socket: %s", strerror(errno));
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof a.sun_path)
        die("socket path too long: %s", path);
    strcpy(a.sun_path, path);
    if (connect(c->fd, (struct sockaddr *)&a, sizeof a) < 0)
        die("connect %s: %s", path, strerror(errno));
    /* an answer that never comes is a failure, not a hang */
    struct timeval tv = {.tv_sec = 30};
    setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return 0;
}

static void conn_close(conn_t *c)
{
    close(c->fd);
    free(c->ev);
    free(c->rx);
    free(c->pool);
    c->rx = NULL;
    c->pool = NULL;
}

static void send_raw(conn_t *c, const void *payload, uint32_t n)
{
    uint32_t be = htonl(n);
    if (write_all(c->fd, &be, 4) < 0 || write_all(c->fd, payload, n) < 0)
        die("send: %s", strerror(errno));
}

static void send_frame(conn_t *c, buf_t *b)
{
    send_raw(c, b->p, (uint32_t)b->n);
    b->n = 0;
}

static void decode_rx(conn_t *c, uint32_t n);

static void recv_body(conn_t *c, uint32_t be);

/* Read one frame and decode it into c->root. Returns 1, or 0 on EOF. */
static int recv_frame(conn_t *c)
{
    uint32_t be;
    int r = read_all(c->fd, &be, 4);
    if (r == 0)
        return 0;
    if (r < 0)
        die("recv header: %s", errno ? strerror(errno) : "EOF inside a header");
    recv_body(c, be);
    return 1;
}

/* Read one frame that carries a file descriptor (SCM_RIGHTS on its first
 * bytes: section 4, hint_ring) with recvmsg; *fd gets it (-1: none came). */
static void recv_frame_fd(conn_t *c, int *fd)
{
    uint8_t hdr[4];
    size_t got = 0;
    *fd = -1;
    while (got < 4) {
        union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } cbuf;
        struct iovec iov = {hdr + got, 4 - got};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf.buf,
                            .msg_controllen = sizeof cbuf.buf};
        ssize_t k = recvmsg(c->fd, &mh, MSG_CMSG_CLOEXEC);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            die("recvmsg: %s", k ? strerror(errno) : "EOF");
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
            if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS && *fd < 0)
                memcpy(fd, CMSG_DATA(cm), sizeof(int));
        got += (size_t)k;
    }
    uint32_t be;
    memcpy(&be, hdr, 4);
    recv_body(c, be);
}

/* The rest of a frame whose header (big-endian length) was read. */
static void recv_body(conn_t *c, uint32_t be)
{
    uint32_t n = ntohl(be);
    if (n == 0 || n > c->max_message_bytes)
        die("daemon sent a frame of %u bytes (limit %llu)", n, (unsigned long long)c->max_message_bytes);
    free(c->rx);
    c->rx = malloc(n);
    if (!c->rx)
        die("out of memory");
    if (read_all(c->fd, c->rx, n) != 1)
        die("EOF inside a frame of %u bytes", n);
    c->rx_n = n;
    decode_rx(c, n);
}

/* The next event: one kept by answer(), else the next frame read. */
static int next_event(conn_t *c)
{
    if (!c->ev)
        return recv_frame(c);
    free(c->rx);
    c->rx = c->ev;
    c->rx_n = c->ev_n;
    c->ev = NULL;
    decode_rx(c, c->rx_n);
    return 1;
}

/* decode c->rx (n bytes) into c->root */
static void decode_rx(conn_t *c, uint32_t n)
{
    /* at most one node per payload byte */
    if (c->pool_cap < n) {
        free(c->pool);
        c->pool = malloc((size_t)n * sizeof(node));
        if (!c->pool)
            die("out of memory");
        c->pool_cap = n;
    }
    dec_t d = {.p = c->rx, .end = c->rx + n, .pool = c->pool, .cap = c->pool_cap};
    if (!dec(&d, &c->root, 0))
        die("undecodable answer: %s", d.err);
    if (d.p != d.end)
        die("answer has %ld trailing bytes", (long)(d.end - d.p));
    if (c->root.type != T_MAP)
        die("answer is not a map");
}

/* Read the answer to request `id`: skips events (id 0 with an `event` key,
 * only sent to engine-mode connections). Returns the answer map; *ok tells
 * result from error. */
static const node *answer(conn_t *c, uint64_t id, int *ok)
{
    for (;;) {
        if (!recv_frame(c))
            die("connection closed waiting for the answer to id %llu", (unsigned long long)id);
        const node *m = &c->root;
        if (get(m, "event")) {
            /* section 3: an event may come between a request and its
             * answer; keep it for whoever waits for it (one is enough here) */
            if (c->ev)
                die("a second event before it was taken");
            c->ev = c->rx;
            c->ev_n = c->rx_n;
            c->rx = NULL;
            continue;
        }
        const node *rid = get(m, "id");
        const node *okn = get(m, "ok");
        if (!is_uint(rid) || !okn || okn->type != T_BOOL)
            die("answer without a uint id and a bool ok");
        if (rid->u != id)
            die("answer for id %llu while waiting for %llu", (unsigned long long)rid->u, (unsigned long long)id);
        *ok = okn->b;
        const node *body = get(m, *ok ? "result" : "error");
        if (!body || body->type != T_MAP)
            die("answer id %llu without its %s map", (unsigned long long)id, *ok ? "result" : "error");
        return body;
    }
}

static const node *expect_ok(conn_t *c, uint64_t id, const char *what)
{
    int ok;
    const node *r = answer(c, id, &ok);
    if (!ok) {
        char code[64], msg[512];
        str_copy(get(r, "code"), code, sizeof code);
        str_copy(get(r, "message"), msg, sizeof msg);
        die("%s failed: %s: %s", what, code, msg);
    }
    return r;
}

/* An error answer with `code`; returns the error map. */
static const node *expect_err(conn_t *c, uint64_t id, const char *code, const char *what)
{
    int ok;
    const node *r = answer(c, id, &ok);
    if (ok) {
        fail("%s: succeeded, expected error %s", what, code);
        return NULL;
    }
    char got[64], msg[512];
    str_copy(get(r, "code"), got, sizeof got);
    str_copy(get(r, "message"), msg, sizeof msg);
    CHECK(strcmp(got, code) == 0, "%s: error %s (%s), expected %s", what, got, msg, code);
    const node *m = get(r, "message");
    CHECK(m && m->type == T_STR && m->s.n > 0, "%s: error without a message", what);
    printf("error %s %s: %s\n", what, got, msg);
    return r;
}

/* --------------------------------------------------------------- requests */

static uint64_t next_id = 1;

/* begin a request map of `nfields` fields besides op and id */
static uint64_t req(buf_t *b, const char *op, uint32_t nfields)
{
    uint64_t id = next_id++;
    mp_map(b, nfields + 2);
    mp_str(b, "op");
    mp_str(b, op);
    mp_str(b, "id");
    mp_uint(b, id);
    return id;
}

static const node *call_region(conn_t *c, buf_t *b, const char *op, uint64_t region)
{
    uint64_t id = req(b, op, 1);
    mp_str(b, "region");
    mp_uint(b, region);
    send_frame(c, b);
    return expect_ok(c, id, op);
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* query the whole region into tiers[NBLOCKS], following `next` */
static void query_all(conn_t *c, buf_t *b, uint64_t region, int8_t *tiers)
{
    uint64_t first = 0;
    for (;;) {
        uint64_t id = req(b, "query", 2);
        mp_str(b, "region"); mp_uint(b, region);
        mp_str(b, "first"); mp_uint(b, first);
        send_frame(c, b);
        const node *r = expect_ok(c, id, "query");
        const node *t = get(r, "tiers");
        uint64_t count = uget(r, "count", 0);
        if (!t || t->type != T_BIN || t->s.n != count || uget(r, "first", 99) != first || first + count > NBLOCKS)
            die("query answer malformed");
        memcpy(tiers + first, t->s.p, count);
        const node *nx = get(r, "next");
        if (!nx || nx->type == T_NIL)
            break;
        first = nx->u;
    }
}

/* migrate `block` to `tier`, waiting for the outcome */
static const node *migrate_wait(conn_t *c, buf_t *b, uint64_t region, uint32_t block, uint64_t tier)
{
    uint64_t id = req(b, "migrate", 4);
    mp_str(b, "region"); mp_uint(b, region);
    mp_str(b, "tier"); mp_uint(b, tier);
    mp_str(b, "blocks"); mp_u32s(b, &block, 1);
    mp_str(b, "wait"); mp_bool(b, 1);
    send_frame(c, b);
    const node *r = expect_ok(c, id, "migrate");
    printf("migrate block %u to tier %llu: moved %llu already %llu failed %llu unmapped %llu\n", block,
           (unsigned long long)tier, (unsigned long long)uget(r, "moved", 99),
           (unsigned long long)uget(r, "already", 99), (unsigned long long)uget(r, "failed", 99),
           (unsigned long long)uget(r, "unmapped", 99));
    CHECK(uget(r, "blocks", 0) == 1, "migrate: blocks %llu, expected 1", (unsigned long long)uget(r, "blocks", 0));
    CHECK(uget(r, "region", 0) == region && uget(r, "tier", 99) == tier, "migrate: region/tier not echoed");
    return r;
}

/* register_engine 4 blocks (tiers 0, 0, 0, -1); migrate block 1 to `dst`;
 * the `move` event names it; move_done; query shows it in `dst`. */
static void engine_moves(conn_t *c, buf_t *b, uint64_t dst)
{
    int8_t tiers[4] = {0, 0, 0, -1};
    uint64_t id = req(b, "register_engine", 4);
    mp_str(b, "blocks"); mp_uint(b, 4);
    mp_str(b, "block_size"); mp_uint(b, 65536);
    mp_str(b, "tiers"); mp_bin(b, tiers, 4);
    mp_str(b, "name"); mp_str(b, "c-engine");
    send_frame(c, b);
    const node *r = expect_ok(c, id, "register_engine");
    uint64_t region = uget(r, "region", 0);
    CHECK(region >= 1 && uget(r, "blocks", 0) == 4 && uget(r, "block_size", 0) == 65536, "register_engine: answer");

    /* with wait, from the owner's own connection: the wait ends when the
     * block is handed over (`engine`), not at move_done */
    uint32_t blk = 1;
    id = req(b, "migrate", 4);
    mp_str(b, "region"); mp_uint(b, region);
    mp_str(b, "tier"); mp_uint(b, dst);
    mp_str(b, "blocks"); mp_u32s(b, &blk, 1);
    mp_str(b, "wait"); mp_bool(b, 1);
    send_frame(c, b);
    r = expect_ok(c, id, "migrate engine block");
    CHECK(uget(r, "blocks", 0) == 1 && uget(r, "engine", 0) == 1, "migrate engine block: blocks %llu engine %llu",
          (unsigned long long)uget(r, "blocks", 0), (unsigned long long)uget(r, "engine", 0));

    /* the event (before or after that answer): id 0, ok true, event
     * "move", body in result */
    if (!next_event(c))
        die("connection closed waiting for the move event");
    const node *m = &c->root;
    CHECK(str_eq(get(m, "event"), "move"), "expected a move event");
    CHECK(uget(m, "id", 99) == 0, "event id is not 0");
    const node *okn = get(m, "ok");
    CHECK(okn && okn->type == T_BOOL && okn->b, "event ok is not true");
    const node *ev = get(m, "result");
    if (!ev || ev->type != T_MAP)
        die("move event without a result map");
    const node *eb = get(ev, "blocks");
    uint64_t move = uget(ev, "move", 0);
    CHECK(move >= 1, "move event: no move id");
    CHECK(uget(ev, "region", 0) == region, "move event: region");
    CHECK(eb && eb->type == T_BIN && eb->s.n == 4 && le32(eb->s.p) == 1, "move event: blocks is not [1]");
    CHECK(uget(ev, "src", 99) == 0 && uget(ev, "dst", 99) == dst, "move event: src %llu dst %llu",
          (unsigned long long)uget(ev, "src", 99), (unsigned long long)uget(ev, "dst", 99));
    printf("move event %llu: region %llu block 1 tier 0 -> %llu\n", (unsigned long long)move,
           (unsigned long long)region, (unsigned long long)dst);

    /* the engine "copies" the block, then says so */
    uint8_t moved = 1;
    id = req(b, "move_done", 2);
    mp_str(b, "move"); mp_uint(b, move);
    mp_str(b, "ok"); mp_bin(b, &moved, 1);
    send_frame(c, b);
    r = expect_ok(c, id, "move_done");
    CHECK(uget(r, "moved", 0) == 1 && uget(r, "failed", 99) == 0, "move_done: moved %llu failed %llu",
          (unsigned long long)uget(r, "moved", 0), (unsigned long long)uget(r, "failed", 99));
    /* a second answer for the same move: invalid_argument */
    id = req(b, "move_done", 2);
    mp_str(b, "move"); mp_uint(b, move);
    mp_str(b, "ok"); mp_bin(b, &moved, 1);
    send_frame(c, b);
    expect_err(c, id, "invalid_argument", "move_done-twice");

    id = req(b, "query", 1);
    mp_str(b, "region"); mp_uint(b, region);
    send_frame(c, b);
    r = expect_ok(c, id, "query engine region");
    const node *t = get(r, "tiers");
    CHECK(t && t->type == T_BIN && t->s.n == 4 && (int8_t)t->s.p[0] == 0 && (int8_t)t->s.p[1] == (int8_t)dst &&
              (int8_t)t->s.p[3] == -1,
          "query engine region: tiers not 0, dst, 0, -1");
    call_region(c, b, "unregister", region);
    printf("engine region %llu: block 1 moved by its owner\n", (unsigned long long)region);
}

/* A connection gets `payload` as one frame (or a bare header announcing
 * `announce` bytes when payload is NULL) and must answer `code` with id 0,
 * then close. */
static void expect_closing_error(const char *path, uint32_t announce, const char *code)
{
    conn_t c;
    conn_open(&c, path);
    /* no hello: the connection speaks version 1 */
    buf_t b = {0};
    uint64_t id = req(&b, "status", 0);
    send_frame(&c, &b);
    const node *st = expect_ok(&c, id, "status without hello");
    CHECK(str_eq(get(st, "server"), "kvtierd"), "status: server is not kvtierd");
    free(b.p);
    uint32_t be = htonl(announce);
    if (write_all(c.fd, &be, 4) < 0)
        die("send: %s", strerror(errno));
    int ok;
    const node *e = answer(&c, 0, &ok);
    char got[64], msg[256];
    str_copy(get(e, "code"), got, sizeof got);
    str_copy(get(e, "message"), msg, sizeof msg);
    CHECK(!ok && strcmp(got, code) == 0, "header of %u: got %s, expected %s", announce, got, code);
    printf("error header-%u %s: %s\n", announce, got, msg);
    /* then the daemon closes: EOF, not another frame */
    CHECK(recv_frame(&c) == 0, "header of %u: connection not closed after %s", announce, code);
    conn_close(&c);
}

int main(int argc, char **argv)
{
    int pause = 0;
    const char *path = getenv("KVTIER_SOCKET");
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--pause") == 0) pause = 1;
        else path = argv[i];
    }
    if (!path || !*path)
        path = "/run/kvtierd/kvtierd.sock";
    setvbuf(stdout, NULL, _IOLBF, 0);

    conn_t c;
    buf_t b = {0};
    conn_open(&c, path);

    /* ---- hello */
    uint64_t id = req(&b, "hello", 2);
    mp_str(&b, "versions"); mp_arr(&b, 1); mp_uint(&b, 1);
    mp_str(&b, "client"); mp_str(&b, "kvtier_client.c");
    send_frame(&c, &b);
    const node *r = expect_ok(&c, id, "hello");
    CHECK(uget(r, "version", 0) == 1, "hello: version %llu", (unsigned long long)uget(r, "version", 0));
    CHECK(str_eq(get(r, "server"), "kvtierd"), "hello: server is not kvtierd");
    CHECK(uget(r, "pid", 0) == (uint64_t)getpid(), "hello: pid %llu, I am %d", (unsigned long long)uget(r, "pid", 0), getpid());
    CHECK(uget(r, "uid", 99999) == (uint64_t)getuid(), "hello: uid differs");
    long page = sysconf(_SC_PAGESIZE);
    CHECK(uget(r, "page_size", 0) == (uint64_t)page, "hello: page_size differs from sysconf");
    c.max_message_bytes = uget(r, "max_message_bytes", 0);
    CHECK(c.max_message_bytes >= 4096, "hello: max_message_bytes %llu", (unsigned long long)c.max_message_bytes);
    /* capabilities name every op the daemon accepts: check those we use */
    const node *caps = get(r, "capabilities");
    CHECK(caps && caps->type == T_ARR, "hello: no capabilities array");
    static const char *const used[] = {"hello", "register", "unregister", "hint", "phase", "query", "blocks",
                                       "stats", "tiers", "migrate", "regions", "hint_ring"};
    for (size_t u = 0; u < sizeof used / sizeof used[0]; u++) {
        int found = 0;
        for (uint32_t i = 0; caps && caps->type == T_ARR && i < caps->a.n; i++)
            found |= str_eq(&caps->a.v[i], used[u]);
        CHECK(found, "hello: capabilities do not list %s", used[u]);
    }
    /* str limits count characters: 128 two-byte characters pass, 129 do not */
    {
        char name[2 * 129 + 1];
        for (int i = 0; i < 129; i++)
            memcpy(name + 2 * i, "\xc3\xa9", 2); /* U+00E9 */
        name[2 * 128] = 0;
        id = req(&b, "hello", 1);
        mp_str(&b, "client"); mp_str(&b, name);
        send_frame(&c, &b);
        expect_ok(&c, id, "hello with a 128-character client");
        name[2 * 128] = (char)0xc3;
        name[2 * 128 + 1] = (char)0xa9;
        name[2 * 129] = 0;
        id = req(&b, "hello", 1);
        mp_str(&b, "client"); mp_str(&b, name);
        send_frame(&c, &b);
        expect_err(&c, id, "invalid_request", "hello-129-characters");
    }
    printf("hello version 1 max_message_bytes %llu page_size %ld\n", (unsigned long long)c.max_message_bytes, page);

    /* ---- a page-aligned buffer of NBLOCKS blocks, every page written
     * (a never-written block is "never touched", tier -1) */
    uint64_t block_size = 4 * (uint64_t)page;
    size_t length = NBLOCKS * block_size;
    uint8_t *kv = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (kv == MAP_FAILED)
        die("mmap: %s", strerror(errno));
    memset(kv, 0x5a, length);

    /* ---- register */
    id = req(&b, "register", 5);
    mp_str(&b, "start"); mp_uint(&b, (uint64_t)(uintptr_t)kv);
    mp_str(&b, "length"); mp_uint(&b, length);
    mp_str(&b, "block_size"); mp_uint(&b, block_size);
    mp_str(&b, "name"); mp_str(&b, "c-client");
    mp_str(&b, "priority"); mp_int(&b, -5);
    send_frame(&c, &b);
    r = expect_ok(&c, id, "register");
    uint64_t region = uget(r, "region", 0);
    CHECK(region >= 1 && region < (1ull << 31), "register: region %llu", (unsigned long long)region);
    CHECK(uget(r, "blocks", 0) == NBLOCKS, "register: blocks %llu", (unsigned long long)uget(r, "blocks", 0));
    CHECK(uget(r, "block_size", 0) == block_size, "register: block_size differs");
    CHECK(uget(r, "pid", 0) == (uint64_t)getpid(), "register: pid differs");
    const node *ex = get(r, "existing");
    CHECK(!ex || (ex->type == T_BOOL && !ex->b), "register: a new region says existing");
    printf("region %llu blocks %d block_size %llu start 0x%llx\n", (unsigned long long)region, NBLOCKS,
           (unsigned long long)block_size, (unsigned long long)(uintptr_t)kv);

    /* the same range again: handed back, existing */
    id = req(&b, "register", 3);
    mp_str(&b, "start"); mp_uint(&b, (uint64_t)(uintptr_t)kv);
    mp_str(&b, "length"); mp_uint(&b, length);
    mp_str(&b, "block_size"); mp_uint(&b, block_size);
    send_frame(&c, &b);
    r = expect_ok(&c, id, "register again");
    ex = get(r, "existing");
    CHECK(uget(r, "region", 0) == region && ex && ex->type == T_BOOL && ex->b,
          "register again: not handed back as existing");

    /* an overlapping range (blocks 2..3 of ours, other size) -> overlap */
    id = req(&b, "register", 3);
    mp_str(&b, "start"); mp_uint(&b, (uint64_t)(uintptr_t)(kv + 2 * block_size));
    mp_str(&b, "length"); mp_uint(&b, 2 * block_size);
    mp_str(&b, "block_size"); mp_uint(&b, block_size);
    send_frame(&c, &b);
    expect_err(&c, id, "overlap", "register-overlap");

    /* ---- hints, pipelined: HINT_FRAMES frames written before reading any
     * answer. Frame k hints blocks {k%N, (k+1)%N, (k+3)%N} with counts
     * {1, 2, 1}, except frame BAD_HINT_AT, which names block N (past the
     * end) and so is rejected whole. Then read every answer in order. */
    uint64_t first_hint_id = next_id;
    uint64_t hinted = 0;             /* entries accepted */
    uint64_t per_block[NBLOCKS] = {0};
    {
        buf_t stream = {0};          /* every frame, then one write */
        buf_t one = {0};
        for (int k = 0; k < HINT_FRAMES; k++) {
            uint32_t idx[3] = {(uint32_t)(k % NBLOCKS), (uint32_t)((k + 1) % NBLOCKS), (uint32_t)((k + 3) % NBLOCKS)};
            uint32_t cnt[3] = {1, 2, 1};
            if (k == BAD_HINT_AT) {
                idx[1] = NBLOCKS;
            } else {
                hinted += 3;
                for (int j = 0; j < 3; j++)
                    per_block[idx[j]]++;
            }
            req(&one, "hint", 3);
            mp_str(&one, "region"); mp_uint(&one, region);
            mp_str(&one, "blocks"); mp_u32s(&one, idx, 3);
            mp_str(&one, "counts"); mp_u32s(&one, cnt, 3);
            put_be(&stream, one.n, 4);
            put(&stream, one.p, one.n);
            one.n = 0;
        }
        if (write_all(c.fd, stream.p, stream.n) < 0)
            die("send hints: %s", strerror(errno));
        free(stream.p);
        free(one.p);
    }
    uint64_t accepted = 0;
    for (int k = 0; k < HINT_FRAMES; k++) {
        uint64_t hid = first_hint_id + (uint64_t)k;
        if (k == BAD_HINT_AT) {
            expect_err(&c, hid, "invalid_argument", "hint-past-end");
            continue;
        }
        r = expect_ok(&c, hid, "hint");
        CHECK(uget(r, "accepted", 0) == 3, "hint %d: accepted %llu", k, (unsigned long long)uget(r, "accepted", 0));
        accepted += uget(r, "accepted", 0);
    }
    CHECK(accepted == hinted, "hints: accepted %llu of %llu", (unsigned long long)accepted, (unsigned long long)hinted);
    printf("hinted %llu entries in %d pipelined frames\n", (unsigned long long)hinted, HINT_FRAMES);

    /* an empty hint is allowed ("may be empty"): accepted 0 */
    {
        id = req(&b, "hint", 2);
        mp_str(&b, "region"); mp_uint(&b, region);
        mp_str(&b, "blocks"); mp_bin(&b, "", 0);
        send_frame(&c, &b);
        r = expect_ok(&c, id, "empty hint");
        CHECK(uget(r, "accepted", 99) == 0, "empty hint: accepted %llu", (unsigned long long)uget(r, "accepted", 99));
    }
    /* counts of another length than blocks -> invalid_argument */
    {
        uint32_t idx[2] = {0, 1}, cnt[1] = {1};
        id = req(&b, "hint", 3);
        mp_str(&b, "region"); mp_uint(&b, region);
        mp_str(&b, "blocks"); mp_u32s(&b, idx, 2);
        mp_str(&b, "counts"); mp_u32s(&b, cnt, 1);
        send_frame(&c, &b);
        expect_err(&c, id, "invalid_argument", "hint-counts-length");
        /* a bin that is not a multiple of 4 bytes -> invalid_argument */
        id = req(&b, "hint", 2);
        mp_str(&b, "region"); mp_uint(&b, region);
        mp_str(&b, "blocks"); mp_bin(&b, "\x01\x00\x00", 3);
        send_frame(&c, &b);
        expect_err(&c, id, "invalid_argument", "hint-bin-length");
    }

    /* ---- the hint ring (section 4, hint_ring): every earlier answer is
     * read, so the daemon may pass the fd now */
    {
        id = req(&b, "hint_ring", 1);
        mp_str(&b, "entries"); mp_uint(&b, RING_ENTRIES);
        send_frame(&c, &b);
        int ring_fd;
        recv_frame_fd(&c, &ring_fd);
        const node *ok = get(&c.root, "ok");
        CHECK(uget(&c.root, "id", 0) == id && ok && ok->type == T_BOOL && ok->b, "hint_ring: not an ok answer");
        r = get(&c.root, "result");
        CHECK(r && r->type == T_MAP, "hint_ring: no result");
        const node *isnew = get(r, "new");
        CHECK(isnew && isnew->type == T_BOOL && isnew->b, "hint_ring: the first answer is not new");
        CHECK(uget(r, "entries", 0) == RING_ENTRIES && uget(r, "word_size", 0) == 4 &&
              uget(r, "words_offset", 0) == 4096 && uget(r, "bytes", 0) == 4096 + 4 * RING_ENTRIES,
              "hint_ring: layout entries %llu bytes %llu", (unsigned long long)uget(r, "entries", 0),
              (unsigned long long)uget(r, "bytes", 0));
        CHECK(ring_fd >= 0, "hint_ring: the answer carried no fd");
        if (ring_fd < 0)
            die("no ring fd");
        size_t ring_bytes = (size_t)uget(r, "bytes", 0);
        uint8_t *ring = mmap(NULL, ring_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, ring_fd, 0);
        if (ring == MAP_FAILED)
            die("mmap ring: %s", strerror(errno));
        /* sealed: the daemon's mapping cannot be cut short */
        CHECK(ftruncate(ring_fd, 0) < 0 && errno == EPERM, "hint ring: ftruncate to 0 was not refused (EPERM)");
        close(ring_fd);
        CHECK(memcmp(ring, "KVTRING1", 8) == 0, "hint ring: magic");
        CHECK(le32(ring + 8) == 1 && le32(ring + 12) == 4 && le32(ring + 16) == RING_ENTRIES && le32(ring + 20) == 4096,
              "hint ring: header version %u word_size %u capacity %u offset %u", le32(ring + 8), le32(ring + 12),
              le32(ring + 16), le32(ring + 20));
        uint64_t *head = (uint64_t *)(ring + 64), *tail = (uint64_t *)(ring + 128);
        uint32_t *words = (uint32_t *)(ring + 4096);
        uint64_t h = 0; /* our head */
        int rounds[2] = {RING_FIRST, RING_SECOND};
        for (int round = 0; round < 2; round++) {
            /* a region word, then one word per hint; the second round adds one bad hint */
            int n = 1 + rounds[round] + round;
            CHECK(h + (uint64_t)n - __atomic_load_n(tail, __ATOMIC_ACQUIRE) <= RING_ENTRIES,
                  "hint ring: no room for %d words", n);
            for (int i = 0; i < n; i++) {
                uint32_t w = (uint32_t)(i % NBLOCKS);
                if (i == 0) {
                    w = 0x80000000u | (uint32_t)region; /* bit 31: the region of the words after it */
                } else if (round == 1 && i == n - 1) {
                    w = NBLOCKS; /* past the end: counted as bad_block, not applied */
                } else {
                    hinted++;
                    per_block[w]++;
                }
                words[(h + (uint64_t)i) & (RING_ENTRIES - 1)] = w;
            }
            h += (uint64_t)n;
            __atomic_store_n(head, h, __ATOMIC_RELEASE);
            /* asking again drains the ring and answers its counters, no fd */
            id = req(&b, "hint_ring", 0);
            send_frame(&c, &b);
            r = expect_ok(&c, id, "hint_ring again");
            isnew = get(r, "new");
            CHECK(isnew && isnew->type == T_BOOL && !isnew->b, "hint_ring again: says new");
            uint64_t want = RING_FIRST + (round ? RING_SECOND : 0);
            CHECK(uget(r, "accepted", 0) == want && uget(r, "bad_block", 99) == (uint64_t)round &&
                  uget(r, "bad_region", 99) == 0 && uget(r, "bad_head", 99) == 0 && uget(r, "tail", 0) == h,
                  "hint ring round %d: accepted %llu bad_block %llu tail %llu", round,
                  (unsigned long long)uget(r, "accepted", 0), (unsigned long long)uget(r, "bad_block", 99),
                  (unsigned long long)uget(r, "tail", 0));
            CHECK(__atomic_load_n(tail, __ATOMIC_ACQUIRE) == h, "hint ring: tail not advanced to head");
        }
        munmap(ring, ring_bytes);
        printf("hint ring of %d entries: %d hints published across the wrap\n", RING_ENTRIES,
               RING_FIRST + RING_SECOND);
    }

    /* ---- phase: blocks 6 and 7 are prefilled */
    {
        uint32_t idx[2] = {6, 7};
        id = req(&b, "phase", 3);
        mp_str(&b, "region"); mp_uint(&b, region);
        mp_str(&b, "phase"); mp_str(&b, "prefill_done");
        mp_str(&b, "blocks"); mp_u32s(&b, idx, 2);
        send_frame(&c, &b);
        r = expect_ok(&c, id, "phase");
        CHECK(uget(r, "blocks", 0) == 2, "phase: blocks %llu", (unsigned long long)uget(r, "blocks", 0));
        /* repeats count as entries: "active" on block 0 twice answers 2 */
        uint32_t twice[2] = {0, 0};
        id = req(&b, "phase", 3);
        mp_str(&b, "region"); mp_uint(&b, region);
        mp_str(&b, "phase"); mp_str(&b, "active");
        mp_str(&b, "blocks"); mp_u32s(&b, twice, 2);
        send_frame(&c, &b);
        r = expect_ok(&c, id, "phase repeated");
        CHECK(uget(r, "blocks", 0) == 2, "phase repeated: blocks %llu", (unsigned long long)uget(r, "blocks", 0));
    }

    /* ---- query until every block is measured (written memory: tier >= 0) */
    int8_t tiers[NBLOCKS];
    double t0 = now_s();
    for (;;) {
        query_all(&c, &b, region, tiers);
        int placed = 0;
        for (int i = 0; i < NBLOCKS; i++)
            placed += tiers[i] >= 0;
        if (placed == NBLOCKS)
            break;
        if (now_s() - t0 > 20) {
            fail("query: %d of %d blocks measured after 20 s", placed, NBLOCKS);
            break;
        }
        usleep(20000);
    }
    printf("query tiers");
    for (int i = 0; i < NBLOCKS; i++)
        printf(" %d", tiers[i]);
    printf(" after %.2f s\n", now_s() - t0);

    /* a short page: first 2, count 3 */
    id = req(&b, "query", 3);
    mp_str(&b, "region"); mp_uint(&b, region);
    mp_str(&b, "first"); mp_uint(&b, 2);
    mp_str(&b, "count"); mp_uint(&b, 3);
    send_frame(&c, &b);
    r = expect_ok(&c, id, "query page");
    {
        const node *t = get(r, "tiers");
        const node *names = get(r, "tier_names");
        CHECK(uget(r, "first", 0) == 2 && uget(r, "count", 0) == 3 && t && t->type == T_BIN && t->s.n == 3,
              "query page: first %llu count %llu", (unsigned long long)uget(r, "first", 0),
              (unsigned long long)uget(r, "count", 0));
        CHECK(names && names->type == T_ARR && names->a.n >= 1, "query: no tier_names");
        /* next only when the daemon cut the page short of what was asked */
        CHECK(!get(r, "next"), "query first 2 count 3: next present");
    }
    /* a block index past the end -> invalid_argument */
    id = req(&b, "query", 2);
    mp_str(&b, "region"); mp_uint(&b, region);
    mp_str(&b, "first"); mp_uint(&b, NBLOCKS + 1);
    send_frame(&c, &b);
    expect_err(&c, id, "invalid_argument", "query-past-end");

    /* ---- blocks: temperatures follow the hints, flags bit 3 = prefill done */
    id = req(&b, "blocks", 1);
    mp_str(&b, "region"); mp_uint(&b, region);
    send_frame(&c, &b);
    r = expect_ok(&c, id, "blocks");
    {
        const node *temps = get(r, "temps"), *flags = get(r, "flags"), *age = get(r, "last_access_age");
        if (!temps || temps->type != T_BIN || temps->s.n != 4 * NBLOCKS || !flags || flags->type != T_BIN ||
            flags->s.n != NBLOCKS || !age || age->type != T_BIN || age->s.n != 8 * NBLOCKS)
            die("blocks: packed arrays of the wrong size");
        for (int i = 0; i < NBLOCKS; i++) {
            float t = lef32(temps->s.p + 4 * i);
            CHECK(per_block[i] == 0 || t > 0, "blocks: block %d hinted but temperature %g", i, t);
            int prefill = (flags->s.p[i] >> 3) & 1;
            CHECK(prefill == (i >= 6), "blocks: block %d prefill flag %d", i, prefill);
        }
        printf("blocks temps");
        for (int i = 0; i < NBLOCKS; i++)
            printf(" %.2f", lef32(temps->s.p + 4 * i));
        printf("\n");
    }

    /* ---- stats: a map of counters */
    id = req(&b, "stats", 0);
    send_frame(&c, &b);
    r = expect_ok(&c, id, "stats");
    CHECK(is_uint(get(r, "block_hints_total")), "stats: no block_hints_total");
    printf("stats keys %u block_hints_total %llu\n", r->a.n, (unsigned long long)uget(r, "block_hints_total", 0));

    /* ---- tiers: pick swap if the daemon has a swap tier with room */
    id = req(&b, "tiers", 0);
    send_frame(&c, &b);
    r = expect_ok(&c, id, "tiers");
    int64_t swap_tier = -1;
    {
        const node *ts = get(r, "tiers");
        if (!ts || ts->type != T_ARR || ts->a.n < 1)
            die("tiers: no tiers array");
        for (uint32_t i = 0; i < ts->a.n; i++) {
            const node *t = &ts->a.v[i];
            char name[64], kind[16];
            str_copy(get(t, "name"), name, sizeof name);
            str_copy(get(t, "kind"), kind, sizeof kind);
            printf("tier %llu %s %s free %llu\n", (unsigned long long)uget(t, "index", 99), name, kind,
                   (unsigned long long)uget(t, "free", 0));
            if (strcmp(kind, "swap") == 0 && uget(t, "free", 0) > length)
                swap_tier = (int64_t)uget(t, "index", 0);
        }
    }

    /* ---- migrate (owner access covers it): block 3 to swap and back, or
     * to tier 0 where it already is */
    if (swap_tier >= 0) {
        r = migrate_wait(&c, &b, region, 3, (uint64_t)swap_tier);
        CHECK(uget(r, "moved", 0) == 1, "migrate to swap: not moved");
        query_all(&c, &b, region, tiers);
        CHECK(tiers[3] == swap_tier, "after migrate to swap: block 3 in tier %d", tiers[3]);
        r = migrate_wait(&c, &b, region, 3, 0);
        CHECK(uget(r, "moved", 0) == 1, "migrate back to tier 0: not moved");
        printf("migrated block 3 to swap tier %lld and back\n", (long long)swap_tier);
    } else {
        r = migrate_wait(&c, &b, region, 3, 0);
        CHECK(uget(r, "already", 0) + uget(r, "moved", 0) == 1, "migrate to tier 0: neither moved nor already");
        printf("migrated block 3 to tier 0 (no swap tier)\n");
    }
    /* an unknown tier -> invalid_argument */
    {
        uint32_t blk = 0;
        id = req(&b, "migrate", 3);
        mp_str(&b, "region"); mp_uint(&b, region);
        mp_str(&b, "tier"); mp_uint(&b, 63);
        mp_str(&b, "blocks"); mp_u32s(&b, &blk, 1);
        send_frame(&c, &b);
        expect_err(&c, id, "invalid_argument", "migrate-unknown-tier");
    }

    /* ---- an engine-mode region: the daemon asks this connection to move
     * blocks (a `move` event), the client answers `move_done` */
    if (swap_tier >= 0)
        engine_moves(&c, &b, (uint64_t)swap_tier);

    /* ---- regions, one per page (limit 1), following next */
    {
        uint64_t after = 0, pages = 0, seen = 0;
        for (;;) {
            id = req(&b, "regions", 2);
            mp_str(&b, "after"); mp_uint(&b, after);
            mp_str(&b, "limit"); mp_uint(&b, 1);
            send_frame(&c, &b);
            r = expect_ok(&c, id, "regions");
            pages++;
            const node *rs = get(r, "regions");
            if (!rs || rs->type != T_ARR || rs->a.n > 1)
                die("regions: not an array of at most 1");
            for (uint32_t i = 0; i < rs->a.n; i++) {
                const node *g = &rs->a.v[i];
                CHECK(uget(g, "id", 0) > after, "regions: id %llu not above after %llu",
                      (unsigned long long)uget(g, "id", 0), (unsigned long long)after);
                if (uget(g, "id", 0) == region) {
                    seen = 1;
                    CHECK(uget(g, "block_hints", 0) == hinted, "regions: block_hints %llu, hinted %llu",
                          (unsigned long long)uget(g, "block_hints", 0), (unsigned long long)hinted);
                    CHECK(uget(g, "nblocks", 0) == NBLOCKS, "regions: nblocks");
                    CHECK(uget(g, "start", 0) == (uint64_t)(uintptr_t)kv, "regions: start");
                    CHECK(str_eq(get(g, "name"), "c-client"), "regions: name");
                    const node *pr = get(g, "priority");
                    CHECK(pr && pr->type == T_INT && pr->i == -5, "regions: priority is not -5");
                }
            }
            const node *nx = get(r, "next");
            if (!nx || nx->type == T_NIL)
                break;
            CHECK(rs->a.n == 1 && nx->u == uget(&rs->a.v[0], "id", 0), "regions: next is not the page's last id");
            after = nx->u;
            if (pages > 10000)
                die("regions: endless pages");
        }
        CHECK(seen, "regions: region %llu not listed", (unsigned long long)region);
        printf("regions pages %llu\n", (unsigned long long)pages);
    }

    /* ---- malformed payloads: each answered, the connection stays usable */
    {
        /* an unknown op: invalid_request, our id */
        id = req(&b, "no_such_op", 0);
        send_frame(&c, &b);
        expect_err(&c, id, "invalid_request", "unknown-op");
        /* a required field missing: invalid_request naming it */
        id = req(&b, "query", 0);
        send_frame(&c, &b);
        r = expect_err(&c, id, "invalid_request", "missing-region");
        if (r) {
            char msg[256];
            str_copy(get(r, "message"), msg, sizeof msg);
            CHECK(strstr(msg, "region") != NULL, "missing-region: message does not name the field: %s", msg);
        }
        /* a wrongly typed field: a str where a uint goes */
        id = req(&b, "query", 1);
        mp_str(&b, "region"); mp_str(&b, "7");
        send_frame(&c, &b);
        expect_err(&c, id, "invalid_request", "str-region");
        /* nil only where the default is nil: count takes it, first does not */
        id = req(&b, "query", 2);
        mp_str(&b, "region"); mp_uint(&b, region);
        mp_str(&b, "count"); put1(&b, 0xc0);
        send_frame(&c, &b);
        r = expect_ok(&c, id, "query count nil");
        CHECK(uget(r, "count", 0) == NBLOCKS, "query count nil: not to the end");
        id = req(&b, "query", 2);
        mp_str(&b, "region"); mp_uint(&b, region);
        mp_str(&b, "first"); put1(&b, 0xc0);
        send_frame(&c, &b);
        expect_err(&c, id, "invalid_request", "query-first-nil");
        /* a repeated op of another value */
        id = req(&b, "stats", 1);
        mp_str(&b, "op"); mp_str(&b, "tiers");
        send_frame(&c, &b);
        expect_err(&c, id, "invalid_request", "repeated-op");
        /* an unknown key holding 256 levels of arrays: ignored */
        id = req(&b, "stats", 1);
        mp_str(&b, "x-nested");
        for (int i = 0; i < 256; i++)
            mp_arr(&b, 1);
        put1(&b, 0xc0);
        send_frame(&c, &b);
        expect_ok(&c, id, "stats with 256 levels under an unknown key");
        /* an array, not a map: invalid_request, id 0 */
        mp_arr(&b, 1); mp_str(&b, "hello");
        send_frame(&c, &b);
        expect_err(&c, 0, "invalid_request", "not-a-map");
        /* a map followed by trailing bytes: invalid_request, id 0 */
        req(&b, "stats", 0);
        put1(&b, 0xc0);
        send_frame(&c, &b);
        expect_err(&c, 0, "invalid_request", "trailing-bytes");
        /* a truncated map: invalid_request, id 0 */
        mp_map(&b, 2); mp_str(&b, "op");
        send_frame(&c, &b);
        expect_err(&c, 0, "invalid_request", "truncated-map");
        /* hello with no version in common */
        id = req(&b, "hello", 1);
        mp_str(&b, "versions"); mp_arr(&b, 1); mp_uint(&b, 9999);
        send_frame(&c, &b);
        expect_err(&c, id, "unsupported_version", "hello-9999");
        /* still usable */
        id = req(&b, "stats", 0);
        send_frame(&c, &b);
        expect_ok(&c, id, "stats after malformed");
    }

    if (pause) {
        printf("PAUSE region=%llu hinted=%llu\n", (unsigned long long)region, (unsigned long long)hinted);
        char line[16];
        if (!fgets(line, sizeof line, stdin))
            die("stdin closed while paused");
    }

    /* ---- unregister, then the region is not_found */
    r = call_region(&c, &b, "unregister", region);
    CHECK(r->a.n == 0, "unregister: result not {}");
    id = req(&b, "query", 1);
    mp_str(&b, "region"); mp_uint(&b, region);
    send_frame(&c, &b);
    expect_err(&c, id, "not_found", "query-after-unregister");
    id = req(&b, "unregister", 1);
    mp_str(&b, "region"); mp_uint(&b, region);
    send_frame(&c, &b);
    expect_err(&c, id, "not_found", "unregister-again");
    printf("unregistered region %llu\n", (unsigned long long)region);
    conn_close(&c);

    /* ---- frames that close the connection */
    expect_closing_error(path, 0, "bad_frame");
    expect_closing_error(path, 0x7fffffffu, "message_too_large");

    munmap(kv, length);
    free(b.p);
    if (failures) {
        printf("FAILED %d checks\n", failures);
        return 1;
    }
    printf("OK\n");
    return 0;
}
