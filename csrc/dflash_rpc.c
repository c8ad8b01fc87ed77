// llama.cpp's RPC backend without its process aborts: a guard between ggml-rpc and each rpc-server.
//
// ggml-rpc aborts the whole process (GGML_ABORT) when a server disconnects or answers malformed,
// and blocks for ever on a server that stops answering.  So the client never talks to a server
// directly: it is registered with the endpoint of a local guard (127.0.0.1, an ephemeral port),
// a thread that forwards every message to the server and back.  When the server disconnects, or
// does not answer within the timeout, the guard counts a failure and from then on answers every
// request of that connection itself, with well-formed empty responses (zeros; an allocation
// answers "no memory"), so ggml-rpc carries on without aborting; the caller reads the failure
// count after each decode and discards what that decode produced (docs/architecture.md §14).
// A new connection (a model loaded again) reaches the server afresh.
//
// Read-ahead: ggml-rpc's client sends one request at a time and waits for its answer, so the
// tensors llama.cpp reads after a decode (the logits, the tapped layers' rows) cost one round trip
// each.  The guard remembers, per connection, which GET_TENSORs followed the first one of a run (a
// run: GETs with no other command between) and, when that first GET comes again, sends the rest
// right behind it.  A request read ahead is answered only if the client then asks for exactly it
// (the same bytes) before any other command; anything else first drains the answers read ahead.
// The server runs one connection's commands in order, so such an answer is the one the server
// would have given at the client's request: nothing ran on it between (an rpc-server serves one
// client at a time, each with buffers of its own).  What is remembered is dropped when a buffer is
// freed (a GET into a freed buffer makes the server drop the connection, or, where the address was
// reused by a smaller buffer, abort); wrong guesses then cost only bytes.
//
// The framing is that of the pinned llama.cpp's ggml-rpc (protocol RPC_PROTO_MAJOR_VERSION):
//   request:  | cmd (1 byte) | size (8 bytes) | payload (size bytes) |
//   response: | size (8 bytes) | payload (size bytes) |   (only the commands listed below)
#include "dflash.h"

#include "common.h"

#include "ggml-backend.h"
#include "ggml-rpc.h"
#include "ggml.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

// ggml-rpc's commands (its enum rpc_cmd) and what each answers
enum {
    CMD_ALLOC_BUFFER = 0, CMD_GET_ALIGNMENT, CMD_GET_MAX_SIZE, CMD_BUFFER_GET_BASE, CMD_FREE_BUFFER,
    CMD_BUFFER_CLEAR, CMD_SET_TENSOR, CMD_SET_TENSOR_HASH, CMD_GET_TENSOR, CMD_COPY_TENSOR,
    CMD_GRAPH_COMPUTE, CMD_GET_DEVICE_MEMORY, CMD_INIT_TENSOR, CMD_GET_ALLOC_SIZE, CMD_HELLO,
    CMD_DEVICE_COUNT, CMD_GRAPH_RECOMPUTE, CMD_MEMSET_TENSOR, CMD_COUNT_KNOWN
};
#define CAPS_SIZE 24               // RPC_CONN_CAPS_SIZE: transport capabilities in HELLO
#define HELLO_RSP_SIZE (4 + CAPS_SIZE)
// sizeof(rpc_tensor), packed: id, type, buffer, ne[], nb[], op, op_params, flags, src[], view_src,
// view_offs, data, name, use_count
#define RPC_TENSOR_SIZE (8 + 4 + 8 + 4 * GGML_MAX_DIMS * 2 + 4 + GGML_MAX_OP_PARAMS + 4 + 8 * GGML_MAX_SRC + 8 * 3 + \
                         GGML_MAX_NAME + 4)
#define SMALL 4096                 // requests up to this size are read whole (inspected); larger are streamed
#define GET_REQ_SIZE (RPC_TENSOR_SIZE + 16)  // rpc_msg_get_tensor_req: tensor, offset, size
_Static_assert(GET_REQ_SIZE == 312, "rpc_msg_get_tensor_req of the pinned ggml-rpc (protocol 7) is 312 bytes");
#define RA_RUN 32                  // GETs of one run read ahead at most
#define RA_RUNS 16                 // runs remembered per connection
#define RA_BYTES (64ull << 20)     // answer bytes one run reads ahead at most

// Response size of a command (-1: none); GET_TENSOR's is in its request.
static int64_t response_size(int cmd, const uint8_t * req, uint64_t req_size) {
    switch (cmd) {
        case CMD_ALLOC_BUFFER: return 16;
        case CMD_GET_ALIGNMENT: case CMD_GET_MAX_SIZE: case CMD_BUFFER_GET_BASE: case CMD_GET_ALLOC_SIZE: return 8;
        case CMD_SET_TENSOR_HASH: case CMD_COPY_TENSOR: return 1;
        case CMD_GET_DEVICE_MEMORY: return 16;
        case CMD_HELLO: return HELLO_RSP_SIZE;
        case CMD_DEVICE_COUNT: return 4;
        case CMD_GET_TENSOR: {
            uint64_t n = 0;
            if (req && req_size >= RPC_TENSOR_SIZE + 16) memcpy(&n, req + RPC_TENSOR_SIZE + 8, 8);
            return (int64_t) n;
        }
        default: return -1;
    }
}

struct dflash_rpc_guard {
    char host[256];
    int32_t port;
    double timeout_s;
    int listen_fd;
    int32_t local_port;
    uint8_t hello[HELLO_RSP_SIZE];  // the server's handshake answer (replayed when it is gone)
    pthread_t acceptor;
    atomic_bool stop;
    atomic_int n_conns;             // connection threads alive
    atomic_llong failures;
    atomic_llong alloc_failures;    // ALLOC_BUFFER answered "no memory" by the server itself
    atomic_llong bytes_up, bytes_down, requests;  // to / from the server; the client's requests
    atomic_llong answers;                         // the client's requests that have an answer
    atomic_llong ahead_used, ahead_wasted;        // GETs read ahead: answered from them / drained
    atomic_bool read_ahead;
    pthread_mutex_t mu;
    char error[512];                // the last failure
    // the server's last real answers to its static queries, per device (replayed when it is gone,
    // so that a model loaded meanwhile fails at its allocations, cleanly, not on a zero alignment)
    uint8_t statics[CMD_COUNT_KNOWN][16][16];
    bool have_static[CMD_COUNT_KNOWN][16];
};

static bool is_static(int cmd) {
    return cmd == CMD_GET_ALIGNMENT || cmd == CMD_GET_MAX_SIZE || cmd == CMD_DEVICE_COUNT || cmd == CMD_GET_DEVICE_MEMORY;
}

static uint32_t device_of(int cmd, const uint8_t * req, uint64_t req_size) {
    uint32_t dev = 0;
    if (cmd != CMD_DEVICE_COUNT && req && req_size >= 4) memcpy(&dev, req, 4);
    return dev;
}

// ---------------------------------------------------------------------------
// sockets

// Waits until fd is readable (POLLIN) or writable; -1 on timeout or error.  timeout_s < 0: for ever,
// waking every 200 ms to look at *stop.
static int wait_fd(int fd, short ev, double timeout_s, atomic_bool * stop) {
    const double t_end = dflash_now() + timeout_s;
    for (;;) {
        if (stop && atomic_load(stop)) return -1;
        double left = timeout_s < 0 ? 0.2 : t_end - dflash_now();
        if (timeout_s >= 0 && left <= 0) return -1;
        if (left > 0.2) left = 0.2;
        struct pollfd p = { fd, ev, 0 };
        int r = poll(&p, 1, (int) (left * 1000) + 1);
        if (r > 0) return (p.revents & (ev | POLLHUP | POLLERR)) ? 0 : -1;
        if (r < 0 && errno != EINTR) return -1;
    }
}

/* all n bytes sent (out) or received, each wait bounded by timeout_s (and stop, when given) */
static bool transfer_full(int fd, uint8_t * p, size_t n, double timeout_s, atomic_bool * stop, bool out) {
    while (n > 0) {
        if (wait_fd(fd, out ? POLLOUT : POLLIN, timeout_s, stop) != 0) return false;
        ssize_t r = out ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (r <= 0) {
            if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            return false;
        }
        p += r;
        n -= (size_t) r;
    }
    return true;
}

static bool read_full(int fd, void * buf, size_t n, double timeout_s, atomic_bool * stop) {
    return transfer_full(fd, buf, n, timeout_s, stop, false);
}

static bool write_full(int fd, const void * buf, size_t n, double timeout_s) {
    return transfer_full(fd, (uint8_t *) buf, n, timeout_s, NULL, true);
}

static void set_nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Connects within timeout_s; -1 with a message.
static int connect_to(const char * host, int32_t port, double timeout_s, char * err, size_t err_len) {
    char ps[16];
    snprintf(ps, sizeof(ps), "%d", port);
    struct addrinfo hints = { 0 }, * res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(host, ps, &hints, &res);
    if (rc != 0) {
        dflash_seterr(err, err_len, "cannot resolve rpc server host '%s': %s", host, gai_strerror(rc));
        return -1;
    }
    int fd = -1, last = 0;
    for (struct addrinfo * a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        int fl = fcntl(fd, F_GETFL);
        fcntl(fd, F_SETFL, fl | O_NONBLOCK);
        int r = connect(fd, a->ai_addr, a->ai_addrlen);
        if (r != 0 && errno == EINPROGRESS) {
            if (wait_fd(fd, POLLOUT, timeout_s, NULL) == 0) {
                socklen_t l = sizeof(last);
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &last, &l);
                r = last == 0 ? 0 : -1;
            } else {
                last = ETIMEDOUT;
            }
        } else if (r != 0) {
            last = errno;
        }
        if (r != 0) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0) {
        dflash_seterr(err, err_len, "cannot reach rpc server %s:%d: %s", host, port,
                      last == ETIMEDOUT ? "no answer within the timeout" : strerror(last));
        return -1;
    }
    set_nodelay(fd);
    return fd;
}

// The handshake: HELLO with no transport upgrade (plain TCP, so every byte passes the guard).
static bool hello(int fd, const char * host, int32_t port, double timeout_s, uint8_t rsp[HELLO_RSP_SIZE],
                  char * err, size_t err_len) {
    uint8_t req[1 + 8 + CAPS_SIZE] = { CMD_HELLO };
    const uint64_t n = CAPS_SIZE;
    memcpy(req + 1, &n, 8);
    uint64_t got = 0;
    if (!write_full(fd, req, sizeof(req), timeout_s) || !read_full(fd, &got, 8, timeout_s, NULL)) {
        dflash_seterr(err, err_len, "%s:%d did not answer llama.cpp's RPC handshake within %.0f s (not an rpc-server?)",
                      host, port, timeout_s);
        return false;
    }
    if (got != HELLO_RSP_SIZE || !read_full(fd, rsp, HELLO_RSP_SIZE, timeout_s, NULL)) {
        dflash_seterr(err, err_len, "%s:%d answered the RPC handshake in another format: an rpc-server of another "
                      "llama.cpp version (this one speaks RPC protocol %d.%d.%d)", host, port,
                      RPC_PROTO_MAJOR_VERSION, RPC_PROTO_MINOR_VERSION, RPC_PROTO_PATCH_VERSION);
        return false;
    }
    if (rsp[0] != RPC_PROTO_MAJOR_VERSION || rsp[1] > RPC_PROTO_MINOR_VERSION) {
        dflash_seterr(err, err_len, "%s:%d is an rpc-server of RPC protocol %d.%d.%d, this llama.cpp speaks %d.%d.%d: "
                      "run the rpc-server built from the same llama.cpp (scripts/setup.sh --rpc)", host, port,
                      rsp[0], rsp[1], rsp[2], RPC_PROTO_MAJOR_VERSION, RPC_PROTO_MINOR_VERSION, RPC_PROTO_PATCH_VERSION);
        return false;
    }
    memset(rsp + 4, 0, CAPS_SIZE);
    return true;
}

int32_t dflash_rpc_probe(const char * host, int32_t port, double timeout_s, int32_t * version, char * err,
                         size_t err_len) {
    int fd = connect_to(host, port, timeout_s, err, err_len);
    if (fd < 0) return -1;
    uint8_t rsp[HELLO_RSP_SIZE];
    bool ok = hello(fd, host, port, timeout_s, rsp, err, err_len);
    close(fd);
    if (ok && version) {
        for (int i = 0; i < 3; i++) version[i] = rsp[i];
    }
    return ok ? 0 : -1;
}

void dflash_rpc_client_version(int32_t * version) {
    version[0] = RPC_PROTO_MAJOR_VERSION;
    version[1] = RPC_PROTO_MINOR_VERSION;
    version[2] = RPC_PROTO_PATCH_VERSION;
}

// ---------------------------------------------------------------------------
// the guard

static void fail(struct dflash_rpc_guard * g, const char * what) {
    pthread_mutex_lock(&g->mu);
    snprintf(g->error, sizeof(g->error), "rpc server %s:%d %s", g->host, g->port, what);
    pthread_mutex_unlock(&g->mu);
    atomic_fetch_add(&g->failures, 1);
}

struct conn {
    struct dflash_rpc_guard * g;
    int client;
};

// Copies n bytes from `from` to `to` (to < 0: drops them); returns the bytes read from `from`
// (< n: it failed).  A failing `to` is reported through *to_ok and then skipped.
static uint64_t pump(int from, int to, uint64_t n, double timeout_s, atomic_bool * stop, bool * to_ok) {
    uint8_t buf[65536];
    uint64_t done = 0;
    while (done < n) {
        size_t k = n - done < sizeof(buf) ? (size_t) (n - done) : sizeof(buf);
        if (!read_full(from, buf, k, timeout_s, stop)) return done;
        if (to >= 0 && *to_ok && !write_full(to, buf, k, 30.0)) *to_ok = false;
        done += k;
    }
    return done;
}

static bool send_zeros(int fd, uint64_t n) {
    static const uint8_t zeros[65536];
    while (n > 0) {
        size_t k = n < sizeof(zeros) ? (size_t) n : sizeof(zeros);
        if (!write_full(fd, zeros, k, 30.0)) return false;
        n -= k;
    }
    return true;
}

// One remembered run: the GETs that followed its first one (key).
struct ra_run {
    bool used;
    int n;
    uint8_t key[GET_REQ_SIZE];
    uint8_t reqs[RA_RUN][GET_REQ_SIZE];
};

struct read_ahead {
    struct ra_run runs[RA_RUNS];
    int next;                      // the slot a new run replaces (round robin)
    bool in_run;
    struct ra_run cur;             // the run being recorded
    int n_ahead, i_ahead;          // requests sent ahead; the next one whose answer is unread
    uint8_t ahead[RA_RUN][GET_REQ_SIZE];
};

static uint64_t get_size(const uint8_t * req) {
    uint64_t n;
    memcpy(&n, req + RPC_TENSOR_SIZE + 8, 8);
    return n;
}

static struct ra_run * ra_find(struct read_ahead * ra, const uint8_t * key) {
    for (int i = 0; i < RA_RUNS; i++) {
        if (ra->runs[i].used && memcmp(ra->runs[i].key, key, GET_REQ_SIZE) == 0) return &ra->runs[i];
    }
    return NULL;
}

// The run being recorded has ended: remember it (a first GET nothing followed: forget it).
static void ra_end_run(struct read_ahead * ra) {
    if (!ra->in_run) return;
    ra->in_run = false;
    struct ra_run * r = ra_find(ra, ra->cur.key);
    if (ra->cur.n == 0) {
        if (r) r->used = false;
        return;
    }
    if (!r) {
        r = &ra->runs[ra->next];
        ra->next = (ra->next + 1) % RA_RUNS;
    }
    r->used = true;
    r->n = ra->cur.n;
    memcpy(r->key, ra->cur.key, GET_REQ_SIZE);
    memcpy(r->reqs, ra->cur.reqs, (size_t) ra->cur.n * GET_REQ_SIZE);
}

// Records a GET of the client's; returns the run to read ahead when it starts a remembered one.
static const struct ra_run * ra_note_get(struct read_ahead * ra, const uint8_t * req) {
    if (ra->in_run) {
        if (ra->cur.n < RA_RUN) memcpy(ra->cur.reqs[ra->cur.n++], req, GET_REQ_SIZE);
        return NULL;
    }
    ra->in_run = true;
    ra->cur.n = 0;
    memcpy(ra->cur.key, req, GET_REQ_SIZE);
    return ra_find(ra, req);
}

static void lose(struct dflash_rpc_guard * g, int * up, const char * what) {
    fail(g, atomic_load(&g->stop) ? "was closed" : what);
    close(*up);
    *up = -1;
}

// Relays the server's answer of `want` bytes (a request already sent) to the client; a server
// lost on the way is counted and the answer completed with zeros.  false: the client is gone.
static bool relay(struct dflash_rpc_guard * g, int * up, int client, uint64_t want) {
    uint64_t got = 0;
    if (*up >= 0 && read_full(*up, &got, 8, g->timeout_s, &g->stop)) {
        if (!write_full(client, &got, 8, 30.0)) return false;
        bool client_ok = true;
        const uint64_t done = pump(*up, client, got, g->timeout_s, &g->stop, &client_ok);
        atomic_fetch_add(&g->bytes_down, (long long) (8 + done));
        if (!client_ok) return false;
        if (done < got) {
            // cut mid-response: the rest as zeros, so the client reads a whole message
            lose(g, up, "disconnected or stopped answering mid-response");
            return send_zeros(client, got - done);
        }
        return true;
    }
    if (*up >= 0) lose(g, up, "disconnected or stopped answering");
    return write_full(client, &want, 8, 30.0) && send_zeros(client, want);
}

// Forgets the requests sent ahead whose answers are still due (counted as read ahead in vain).
static void ra_forget(struct dflash_rpc_guard * g, struct read_ahead * ra) {
    if (ra->n_ahead > ra->i_ahead) atomic_fetch_add(&g->ahead_wasted, ra->n_ahead - ra->i_ahead);
    ra->n_ahead = ra->i_ahead = 0;
}

// Reads and drops the answers still due for requests sent ahead.
static void ra_drain(struct dflash_rpc_guard * g, struct read_ahead * ra, int * up) {
    for (; ra->i_ahead < ra->n_ahead && *up >= 0; ra->i_ahead++) {
        uint64_t got = 0;
        bool ok = true;
        if (!read_full(*up, &got, 8, g->timeout_s, &g->stop)) {
            lose(g, up, "disconnected or stopped answering");
            break;
        }
        const uint64_t done = pump(*up, -1, got, g->timeout_s, &g->stop, &ok);
        atomic_fetch_add(&g->bytes_down, (long long) (8 + done));
        if (done < got) {
            lose(g, up, "disconnected or stopped answering");
            break;
        }
        atomic_fetch_add(&g->ahead_wasted, 1);
    }
    ra_forget(g, ra);
}

// Sends the rest of a remembered run right behind its first GET (already sent).
// (At most RA_RUN requests of GET_REQ_SIZE + 9 bytes, ~10 KB, in one write: they fit the socket's
// buffers while the server may be busy sending the first GET's answer, so this write cannot wait
// on the guard reading that answer.)
static void ra_send(struct dflash_rpc_guard * g, struct read_ahead * ra, int * up, const struct ra_run * r) {
    static const size_t one = 9 + GET_REQ_SIZE;
    uint8_t msg[RA_RUN * (9 + GET_REQ_SIZE)];
    uint64_t bytes = 0;
    int n = 0;
    for (; n < r->n && get_size(r->reqs[n]) <= RA_BYTES - bytes; n++) {
        bytes += get_size(r->reqs[n]);
        uint8_t * m = msg + (size_t) n * one;
        const uint64_t size = GET_REQ_SIZE;
        m[0] = CMD_GET_TENSOR;
        memcpy(m + 1, &size, 8);
        memcpy(m + 9, r->reqs[n], GET_REQ_SIZE);
        memcpy(ra->ahead[n], r->reqs[n], GET_REQ_SIZE);
    }
    if (n > 0 && !write_full(*up, msg, (size_t) n * one, g->timeout_s)) {
        lose(g, up, "disconnected");
        ra->n_ahead = ra->i_ahead = 0;
        return;
    }
    atomic_fetch_add(&g->bytes_up, (long long) ((size_t) n * one));
    ra->n_ahead = n;
    ra->i_ahead = 0;
}

static void * conn_main(void * arg) {
    struct conn * c = arg;
    struct dflash_rpc_guard * g = c->g;
    const int client = c->client;
    free(c);
    struct read_ahead * ra = calloc(1, sizeof(*ra));
    char err[256];
    int up = connect_to(g->host, g->port, g->timeout_s, err, sizeof(err));
    if (up < 0) fail(g, "is unreachable");
    set_nodelay(client);
    uint8_t small[SMALL];
    for (;;) {
        uint8_t cmd;
        uint64_t size;
        // the client's next request (it may idle between decodes: no timeout, only the stop flag)
        if (!read_full(client, &cmd, 1, -1, &g->stop) || !read_full(client, &size, 8, 30.0, &g->stop)) break;
        const bool whole = size <= SMALL;
        if (whole && !read_full(client, small, size, 30.0, &g->stop)) break;
        atomic_fetch_add(&g->requests, 1);
        const bool is_get = cmd == CMD_GET_TENSOR && size == GET_REQ_SIZE;
        if (ra && ra->i_ahead < ra->n_ahead) {
            if (up >= 0 && is_get && memcmp(small, ra->ahead[ra->i_ahead], GET_REQ_SIZE) == 0) {
                // asked for exactly what was read ahead, nothing between: its answer is due next
                ra->i_ahead++;
                atomic_fetch_add(&g->ahead_used, 1);
                atomic_fetch_add(&g->answers, 1);
                ra_note_get(ra, small);
                if (!relay(g, &up, client, get_size(small))) break;
                continue;
            }
            ra_drain(g, ra, &up);
        }
        if (cmd == CMD_HELLO && whole && size >= CAPS_SIZE) memset(small, 0, CAPS_SIZE);  // no transport upgrade
        bool up_ok = up >= 0;
        if (up_ok) {
            uint8_t hdr[9] = { cmd };
            memcpy(hdr + 1, &size, 8);
            up_ok = write_full(up, hdr, 9, g->timeout_s) && (!whole || write_full(up, small, size, g->timeout_s));
        }
        if (!whole && pump(client, up_ok ? up : -1, size, 30.0, &g->stop, &up_ok) < size) break;
        if (up_ok) atomic_fetch_add(&g->bytes_up, (long long) (9 + size));
        if (!up_ok && up >= 0) {
            fail(g, "disconnected");
            close(up);
            up = -1;
        }
        if (ra) {
            if (is_get) {
                const struct ra_run * r = ra_note_get(ra, small);
                if (r && up >= 0 && atomic_load(&g->read_ahead)) ra_send(g, ra, &up, r);
            } else {
                ra_end_run(ra);
                if (cmd == CMD_FREE_BUFFER) memset(ra->runs, 0, sizeof(ra->runs));
            }
        }
        const int64_t want = response_size(cmd, whole ? small : NULL, size);
        if (want < 0) continue;
        atomic_fetch_add(&g->answers, 1);
        if (cmd != CMD_HELLO && cmd != CMD_ALLOC_BUFFER && !is_static(cmd)) {
            if (!relay(g, &up, client, (uint64_t) want)) break;
            continue;
        }
        // small fixed answers, inspected: no transport upgrade; allocations the server refused; the
        // static queries' answers kept (replayed when the server is gone, so that a model loaded
        // meanwhile fails at its allocations, cleanly, not on a zero alignment)
        uint64_t got = 0;
        uint8_t rsp[HELLO_RSP_SIZE > 16 ? HELLO_RSP_SIZE : 16];
        if (up >= 0 && read_full(up, &got, 8, g->timeout_s, &g->stop)) {
            if (got > sizeof(rsp)) break;  // not ggml-rpc's framing: drop the client
            atomic_fetch_add(&g->bytes_down, (long long) (8 + got));
            if (read_full(up, rsp, got, g->timeout_s, &g->stop)) {
                if (cmd == CMD_HELLO && got == HELLO_RSP_SIZE) memset(rsp + 4, 0, CAPS_SIZE);
                uint64_t ptr = 1;
                if (cmd == CMD_ALLOC_BUFFER && got == 16) memcpy(&ptr, rsp, 8);
                if (ptr == 0) atomic_fetch_add(&g->alloc_failures, 1);
                const uint32_t dev = device_of(cmd, small, size);
                if (is_static(cmd) && dev < 16 && got <= 16) {
                    pthread_mutex_lock(&g->mu);
                    memcpy(g->statics[cmd][dev], rsp, got);
                    g->have_static[cmd][dev] = true;
                    pthread_mutex_unlock(&g->mu);
                }
                if (!write_full(client, &got, 8, 30.0) || !write_full(client, rsp, got, 30.0)) break;
                continue;
            }
        }
        if (up >= 0) lose(g, &up, "disconnected or stopped answering");
        // the server is gone: a well-formed empty answer (HELLO: the server's last handshake)
        const uint64_t n = (uint64_t) want;
        if (!write_full(client, &n, 8, 30.0)) break;
        const uint32_t dev = device_of(cmd, whole ? small : NULL, size);
        if (cmd == CMD_HELLO) {
            if (!write_full(client, g->hello, HELLO_RSP_SIZE, 30.0)) break;
        } else if (is_static(cmd) && dev < 16 && n <= 16 && g->have_static[cmd][dev]) {
            pthread_mutex_lock(&g->mu);
            memcpy(rsp, g->statics[cmd][dev], n);
            pthread_mutex_unlock(&g->mu);
            if (!write_full(client, rsp, n, 30.0)) break;
        } else if (!send_zeros(client, n)) {
            break;
        }
    }
    if (up >= 0) close(up);
    close(client);
    if (ra) ra_forget(g, ra);
    free(ra);
    atomic_fetch_sub(&g->n_conns, 1);
    return NULL;
}

static void * acceptor_main(void * arg) {
    struct dflash_rpc_guard * g = arg;
    while (!atomic_load(&g->stop)) {
        if (wait_fd(g->listen_fd, POLLIN, 0.2, NULL) != 0) continue;
        int fd = accept(g->listen_fd, NULL, NULL);
        if (fd < 0) continue;
        struct conn * c = malloc(sizeof(*c));
        pthread_t t;
        c->g = g;
        c->client = fd;
        atomic_fetch_add(&g->n_conns, 1);
        if (pthread_create(&t, NULL, conn_main, c) != 0) {
            atomic_fetch_sub(&g->n_conns, 1);
            close(fd);
            free(c);
            continue;
        }
        pthread_detach(t);
    }
    return NULL;
}

dflash_rpc_guard * dflash_rpc_guard_new(const char * host, int32_t port, double timeout_s, char * err, size_t err_len) {
    if (!host || !*host || strlen(host) >= 256 || port <= 0 || port > 65535) {
        dflash_seterr(err, err_len, "bad rpc server endpoint '%s:%d' (want host:port)", host ? host : "", port);
        return NULL;
    }
    if (timeout_s <= 0) timeout_s = 30.0;
    uint8_t rsp[HELLO_RSP_SIZE];
    int fd = connect_to(host, port, timeout_s, err, err_len);
    if (fd < 0) return NULL;
    bool ok = hello(fd, host, port, timeout_s, rsp, err, err_len);
    close(fd);
    if (!ok) return NULL;
    struct dflash_rpc_guard * g = calloc(1, sizeof(*g));
    snprintf(g->host, sizeof(g->host), "%s", host);
    g->port = port;
    g->timeout_s = timeout_s;
    memcpy(g->hello, rsp, sizeof(rsp));
    atomic_store(&g->read_ahead, true);
    pthread_mutex_init(&g->mu, NULL);
    g->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = { 0 };
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t al = sizeof(a);
    if (g->listen_fd < 0 || bind(g->listen_fd, (struct sockaddr *) &a, sizeof(a)) != 0 || listen(g->listen_fd, 8) != 0 ||
        getsockname(g->listen_fd, (struct sockaddr *) &a, &al) != 0) {
        dflash_seterr(err, err_len, "cannot open a local port for the rpc guard: %s", strerror(errno));
        if (g->listen_fd >= 0) close(g->listen_fd);
        free(g);
        return NULL;
    }
    g->local_port = ntohs(a.sin_port);
    if (pthread_create(&g->acceptor, NULL, acceptor_main, g) != 0) {
        dflash_seterr(err, err_len, "cannot start the rpc guard thread");
        close(g->listen_fd);
        free(g);
        return NULL;
    }
    return g;
}

void dflash_rpc_guard_free(dflash_rpc_guard * g) {
    if (!g) return;
    atomic_store(&g->stop, true);
    pthread_join(g->acceptor, NULL);
    close(g->listen_fd);
    // connection threads notice the stop flag within 200 ms
    for (int i = 0; i < 100 && atomic_load(&g->n_conns) > 0; i++) usleep(20000);
    if (atomic_load(&g->n_conns) > 0) return;  // (a thread still inside a write: leak g rather than free it under it)
    pthread_mutex_destroy(&g->mu);
    free(g);
}

int32_t dflash_rpc_guard_port(const dflash_rpc_guard * g) { return g->local_port; }

int64_t dflash_rpc_guard_failures(dflash_rpc_guard * g, char * err, size_t err_len) {
    const int64_t n = atomic_load(&g->failures);
    if (n > 0 && err) {
        pthread_mutex_lock(&g->mu);
        dflash_seterr(err, err_len, "%s", g->error);
        pthread_mutex_unlock(&g->mu);
    }
    return n;
}

int64_t dflash_rpc_guard_alloc_failures(const dflash_rpc_guard * g) { return atomic_load(&g->alloc_failures); }

int32_t dflash_rpc_guard_connections(const dflash_rpc_guard * g) { return atomic_load(&g->n_conns); }

void dflash_rpc_guard_traffic(const dflash_rpc_guard * g, int64_t * out) {
    out[0] = atomic_load(&g->requests);
    out[1] = atomic_load(&g->bytes_up);
    out[2] = atomic_load(&g->bytes_down);
    out[3] = atomic_load(&g->ahead_used);
    out[4] = atomic_load(&g->ahead_wasted);
    out[5] = atomic_load(&g->answers);
}

void dflash_rpc_guard_read_ahead(dflash_rpc_guard * g, bool on) { atomic_store(&g->read_ahead, on); }

// ---------------------------------------------------------------------------
// registration

void * dflash_rpc_add_server(const char * endpoint, char * err, size_t err_len) {
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    if (!rpc) {
        dflash_seterr(err, err_len, "this llama-cpp-python has no RPC backend: install it with scripts/setup.sh --rpc "
                                    "(llama.cpp built with -DGGML_RPC=ON)");
        return NULL;
    }
    typedef ggml_backend_reg_t (*add_fn)(const char *);
    add_fn add = (add_fn) ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server");
    if (!add) {
        dflash_seterr(err, err_len, "the RPC backend of this libggml has no ggml_backend_rpc_add_server");
        return NULL;
    }
    ggml_backend_reg_t reg = add(endpoint);
    if (!reg) dflash_seterr(err, err_len, "cannot register rpc server %s", endpoint);
    return reg;
}

int32_t dflash_rpc_devices(void * reg, void ** out, int32_t max_out) {
    ggml_backend_reg_t r = reg;
    const int32_t n = (int32_t) ggml_backend_reg_dev_count(r);
    for (int32_t i = 0; i < n && i < max_out; i++) out[i] = ggml_backend_reg_dev_get(r, i);
    return n;
}

bool dflash_rpc_available(void) { return ggml_backend_reg_by_name("RPC") != NULL; }
