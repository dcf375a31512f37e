/* tdist_tcp.shared._shmfast: the shared-memory engine's small collectives in one C call.
 *
 * Optional: tdist_tcp.shared.native loads it and the engine falls back to its Python steps
 * when it is missing or disabled ($TDIST_TCP_NATIVE=0). It follows the segment layout
 * and step protocol of tdist_tcp/shm.py exactly (the two can never be mixed within
 * one collective, but a group may mix ranks with and without it):
 *
 *   per rank, at ctrl + rank * 256: uint32 counter, uint32 "sleeping" flag, uint32 pid,
 *   and at +16 + 24 * (seq & 1) the descriptor <QQIBBBx (seq, nbytes, root, op, redop,
 *   dtype); per rank, at data + (2 * rank + b) * slot, two data buffers. A group made by
 *   shrink_group keeps the segment of the group it came from: member q then uses the
 *   control block and buffers of that group's rank slots[q] (the "slots" argument).
 *
 * A collective here is one step: write the descriptor (and this rank's data), post
 * the step (counter := k), wake sleeping peers, spin until every peer has posted k,
 * compare descriptors, then read. The spin is bounded; when it runs out the call
 * returns WAIT with the collective posted and pending: the caller waits for the peers
 * in Python (futex sleep, liveness checks, timeout) and then calls finish(). Nothing
 * here blocks without bound and nothing here raises on a peer's behalf.
 *
 * The spin follows tdist_tcp/shmwait.py's policy: spin_ns 0 (more ranks on the host than
 * CPUs) checks once and returns WAIT; "adaptive" stops spinning as soon as the host has
 * more runnable threads than online CPUs (the fourth field of /proc/loadavg, read with
 * one pread a few microseconds into the spin and then every CHECK_NS).
 *
 * x86-64 only (like the Python engine): the counter is stored with a full fence, and
 * loads are acquire loads, so a peer that sees the counter sees the data before it.
 *
 * Also here, for the Python engine's larger collectives: combine() (a rank's slice of a
 * two-step all_reduce, every input in one pass), and cma_combine()/cma_probe() (a large
 * all_reduce through the peers' own memory, tdist_tcp/shared/cma.py). The reductions are
 * in _shmfast_reduce.h.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <fcntl.h>
#include <stdlib.h>
#include <errno.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define CTRL_BYTES 256
#define DESC_AT 16 /* two descriptors, by parity, in the counter's cache line */
#define DESC_BYTES 24
#define HALF 0x80000000u
#define GIL_SPIN_NS 10000 /* spin this long holding the GIL, the rest of the spin without it */
#define CHECK_NS 20000    /* an adaptive spin checks this often that a CPU is still free */
#define TILE_BYTES 4096   /* a reduction's tile: p of them and the result fit the L1 cache */
#define NOGIL_BYTES (64 << 10) /* combine() releases the GIL for reductions this large */
#define MAX_INPUTS 4096 /* combine()'s inputs at most: a segment's ranks at most (see Fast) */
#define CMA_BYTES (256 << 10) /* cma_combine()'s tiles (the peers' and the result) together, at most */

enum { DONE = 0, WAIT = 1, MISMATCH = 2 };
enum { K_NONE = 0, K_BARRIER, K_BROADCAST, K_REDUCE };
/* element types and operators of the reductions done here (everything else: Python) */
enum { T_F32 = 1, T_F64, T_I8, T_U8, T_I16, T_I32, T_I64 };
enum { O_SUM = 1, O_PRODUCT, O_MIN, O_MAX, O_BAND, O_BOR, O_BXOR, O_AVG };

typedef struct {
    PyObject_HEAD
    char *base;
    Py_ssize_t ctrl, data, slot;
    int rank, size;
    long long spin_ns;
    int yield;
    int adaptive; /* spin only while no thread waits for a CPU */
    /* the pending collective (posted, waiting for its peers) */
    int kind, b, root, etype, eop;
    uint64_t seq;
    /* the engine's counters (tdist_tcp.shared.shm advances them too): steps posted, rounds begun */
    unsigned int k;
    unsigned long long rounds;
    unsigned long long runs; /* collectives run() has started */
    char *dst;
    Py_ssize_t nbytes;
    int *slots; /* member q's place in the segment (NULL: q) */
} Fast;

static inline Py_ssize_t place(Fast *f, int q) { return f->slots ? f->slots[q] : q; }

static inline char *control(Fast *f, int q) { return f->base + f->ctrl + place(f, q) * CTRL_BYTES; }

static inline volatile uint32_t *counter(Fast *f, int q) { return (volatile uint32_t *)control(f, q); }

static inline char *buffer(Fast *f, int q, int b) {
    return f->base + f->data + (2 * place(f, q) + b) * f->slot;
}

static inline int reached(Fast *f, int q, uint32_t k) {
    uint32_t v = __atomic_load_n(counter(f, q), __ATOMIC_ACQUIRE);
    return (uint32_t)(v - k) < HALF;
}

static inline long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void put_desc(Fast *f, uint64_t seq, uint64_t nbytes, uint32_t root, int op, int redop, int dtype) {
    unsigned char d[DESC_BYTES];
    memcpy(d, &seq, 8);
    memcpy(d + 8, &nbytes, 8);
    memcpy(d + 16, &root, 4);
    d[20] = (unsigned char)op;
    d[21] = (unsigned char)redop;
    d[22] = (unsigned char)dtype;
    d[23] = 0;
    memcpy(control(f, f->rank) + DESC_AT + DESC_BYTES * (seq & 1), d, DESC_BYTES);
}

/* Post step k and wake any peer that sleeps on our counter. */
static void post(Fast *f, uint32_t k) {
    volatile uint32_t *mine = counter(f, f->rank);
    __atomic_store_n(mine, k, __ATOMIC_SEQ_CST);
    for (int q = 0; q < f->size; q++) {
        if (q != f->rank && __atomic_load_n(counter(f, q) + 1, __ATOMIC_ACQUIRE)) {
            syscall(SYS_futex, (uint32_t *)mine, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
            break;
        }
    }
}

static int all_reached(Fast *f, uint32_t k) {
    for (int q = 0; q < f->size; q++)
        if (q != f->rank && !reached(f, q, k)) return 0;
    return 1;
}

/* /proc/loadavg, opened once per process (-2: it cannot be) */
static int loadavg_fd = -1;
static long online_cpus = 0;

/* Whether some thread waits for a CPU: more runnable threads on the host than online CPUs
 * (0 when that cannot be read). */
static int host_busy(void) {
    int fd = __atomic_load_n(&loadavg_fd, __ATOMIC_ACQUIRE);
    if (fd == -1) {
        int mine = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
        int expected = -1;
        if (!__atomic_compare_exchange_n(&loadavg_fd, &expected, mine < 0 ? -2 : mine, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE)) {
            if (mine >= 0) close(mine); /* another thread opened it first */
        }
        fd = __atomic_load_n(&loadavg_fd, __ATOMIC_ACQUIRE);
    }
    if (fd < 0 || online_cpus <= 0) return 0;
    char text[128];
    ssize_t got = pread(fd, text, sizeof text - 1, 0);
    if (got <= 0) return 0;
    text[got] = 0;
    const char *at = text; /* "0.52 0.58 0.59 3/712 12345": the fourth field's numerator */
    for (int spaces = 0; spaces < 3; at++) {
        if (!*at) return 0;
        if (*at == ' ') spaces++;
    }
    return strtol(at, NULL, 10) > online_cpus;
}

/* Spin (at most budget_ns; when adaptive, only while a CPU is free) until every peer has
 * posted k; 1 if they have. */
static int spin(Fast *f, uint32_t k, long long budget_ns) {
    long long start = 0, end = 0, check = 0;
    for (unsigned n = 1;; n++) {
        if (all_reached(f, k)) return 1;
        if (!(n & 63)) {
            long long t = now_ns();
            if (!start) {
                start = check = t;
                end = t + budget_ns;
            }
            if (t >= end) return 0;
            if (f->adaptive && t >= check) {
                if (host_busy()) return 0;
                check = t + CHECK_NS;
            }
            if (f->yield) sched_yield();
        }
        __builtin_ia32_pause();
    }
}

static int wait_peers(Fast *f, uint32_t k) {
    if (f->spin_ns <= 0) return all_reached(f, k);
    long long held = f->spin_ns < GIL_SPIN_NS ? f->spin_ns : GIL_SPIN_NS;
    if (spin(f, k, held)) return 1;
    if (f->spin_ns <= held) return 0;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = spin(f, k, f->spin_ns - held);
    Py_END_ALLOW_THREADS
    return ok;
}

static int descs_agree(Fast *f) {
    Py_ssize_t at = DESC_AT + DESC_BYTES * (f->seq & 1);
    const char *mine = control(f, f->rank) + at;
    for (int q = 0; q < f->size; q++)
        if (q != f->rank && memcmp(mine, control(f, q) + at, DESC_BYTES)) return 0;
    return 1;
}

#include "_shmfast_reduce.h"

/* ------------------------------------------------------------------ stepping */
/* The positional integer arguments of a method (addresses, sizes and codes all fit). */
static int int_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *name, long long *out) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return 0;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return 0;
    }
    return 1;
}

static int complete(Fast *f) {
    int kind = f->kind;
    f->kind = K_NONE;
    if (!descs_agree(f)) return MISMATCH;
    if (kind == K_BROADCAST) {
        if (f->rank != f->root && f->nbytes) memcpy(f->dst, buffer(f, f->root, f->b), f->nbytes);
    } else if (kind == K_REDUCE) {
        if (f->nbytes && (f->root < 0 || f->root == f->rank)) {
            char *ins[f->size];
            for (int q = 0; q < f->size; q++) ins[q] = buffer(f, q, f->b);
            reduce_tiled(f->etype, f->eop, f->dst, NULL, ins, f->size, f->nbytes / element_size(f->etype));
        }
    }
    return DONE;
}

static int idle(Fast *f) {
    if (f->kind != K_NONE) {
        PyErr_SetString(PyExc_RuntimeError, "tdist_tcp.shared._shmfast: a collective is still pending");
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(run_doc,
             "run(kind, seq, op, redop, dtype, address, nbytes, root, etype, eop) -> DONE, WAIT or MISMATCH\n\n"
             "Run one one-step collective as the next step (k + 1; a broadcast or reduction\n"
             "through buffer rounds & 1, advancing rounds). kind: BARRIER, BROADCAST (nbytes at\n"
             "address from root) or REDUCE (nbytes at address := the reduction over ranks,\n"
             "everywhere when root < 0, else only on root; etype/eop: this module's element type\n"
             "and operator codes, see tdist_tcp.shared.native). seq, op, redop, dtype: the descriptor's\n"
             "wire codes. Sizes are at most a buffer, and a reduction's at most what the caller\n"
             "reduces in one step.");

static PyObject *Fast_run(Fast *f, PyObject *const *args, Py_ssize_t nargs) {
    long long a[10]; /* kind, seq, op, redop, dtype, address, nbytes, root, etype, eop */
    if (!int_args(args, nargs, 10, "run", a) || !idle(f)) return NULL;
    int kind = (int)a[0], etype = (int)a[8], eop = (int)a[9];
    long long nbytes = a[6], root = a[7];
    if (kind == K_BARRIER) {
        nbytes = 0;
        root = 0;
    } else if (kind == K_BROADCAST) {
        if (nbytes < 0 || nbytes > f->slot || root < 0 || root >= f->size) {
            PyErr_SetString(PyExc_ValueError, "tdist_tcp.shared._shmfast.run: bad broadcast size or root");
            return NULL;
        }
    } else if (kind == K_REDUCE) {
        int es = element_size(etype);
        if (!reducible(etype, eop)) {
            PyErr_SetString(PyExc_ValueError, "tdist_tcp.shared._shmfast.run: unsupported element type or operator");
            return NULL;
        }
        if (nbytes < 0 || nbytes > f->slot || nbytes % es || root >= f->size) {
            PyErr_SetString(PyExc_ValueError, "tdist_tcp.shared._shmfast.run: bad reduction size or root");
            return NULL;
        }
        if (root < 0) root = -1;
    } else {
        PyErr_SetString(PyExc_ValueError, "tdist_tcp.shared._shmfast.run: unknown kind");
        return NULL;
    }
    f->kind = kind;
    f->runs += 1;
    f->k += 1;
    if (kind != K_BARRIER) f->b = (int)(f->rounds++ & 1);
    f->seq = (uint64_t)a[1];
    f->dst = (char *)(uintptr_t)a[5];
    f->nbytes = (Py_ssize_t)nbytes;
    f->root = (int)root;
    f->etype = etype;
    f->eop = eop;
    put_desc(f, f->seq, (uint64_t)nbytes, (uint32_t)(root < 0 ? 0 : root), (int)a[2], (int)a[3], (int)a[4]);
    if (nbytes && kind == K_REDUCE) memcpy(buffer(f, f->rank, f->b), f->dst, f->nbytes);
    if (nbytes && kind == K_BROADCAST && f->rank == f->root) memcpy(buffer(f, f->root, f->b), f->dst, f->nbytes);
    post(f, f->k);
    if (!wait_peers(f, f->k)) return PyLong_FromLong(WAIT);
    return PyLong_FromLong(complete(f));
}

PyDoc_STRVAR(finish_doc,
             "finish() -> DONE or MISMATCH\n\n"
             "Complete the pending collective once every peer has posted its step.");

static PyObject *Fast_finish(Fast *f, PyObject *Py_UNUSED(ignored)) {
    if (f->kind == K_NONE) {
        PyErr_SetString(PyExc_RuntimeError, "tdist_tcp.shared._shmfast.finish: nothing is pending");
        return NULL;
    }
    if (!all_reached(f, f->k)) {
        PyErr_SetString(PyExc_RuntimeError, "tdist_tcp.shared._shmfast.finish: a peer has not posted its step");
        return NULL;
    }
    return PyLong_FromLong(complete(f));
}

PyDoc_STRVAR(abandon_doc, "abandon()\n\nForget the pending collective (it failed while waiting).");

static PyObject *Fast_abandon(Fast *f, PyObject *Py_UNUSED(ignored)) {
    f->kind = K_NONE;
    Py_RETURN_NONE;
}

static int Fast_init(Fast *f, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"address", "ctrl", "data", "slot", "rank",     "size",
                             "spin_ns", "yield_", "adaptive", "slots", NULL};
    unsigned long long addr;
    long long spin_ns;
    int yield, adaptive = 0;
    PyObject *slots = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KnnniiLp|pO:Fast", kwlist, &addr, &f->ctrl, &f->data, &f->slot,
                                     &f->rank, &f->size, &spin_ns, &yield, &adaptive, &slots))
        return -1;
    if (!addr || f->size < 1 || f->size > 4096 || f->rank < 0 || f->rank >= f->size || f->slot < 0) {
        PyErr_SetString(PyExc_ValueError, "tdist_tcp.shared._shmfast.Fast: bad segment geometry");
        return -1;
    }
    PyMem_Free(f->slots);
    f->slots = NULL;
    if (slots != Py_None) { /* a sequence of size distinct places, each below 4096 */
        PyObject *seq = PySequence_Fast(slots, "tdist_tcp.shared._shmfast.Fast: slots must be a sequence");
        if (!seq) return -1;
        int ok = PySequence_Fast_GET_SIZE(seq) == f->size;
        f->slots = ok ? PyMem_New(int, f->size) : NULL;
        for (Py_ssize_t q = 0; ok && f->slots && q < f->size; q++) {
            long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, q));
            ok = v >= 0 && v < 4096 && !PyErr_Occurred();
            for (Py_ssize_t o = 0; ok && o < q; o++) ok = f->slots[o] != v;
            if (ok) f->slots[q] = (int)v;
        }
        Py_DECREF(seq);
        if (!ok || !f->slots) {
            PyMem_Free(f->slots);
            f->slots = NULL;
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "tdist_tcp.shared._shmfast.Fast: bad slots");
            return -1;
        }
    }
    f->base = (char *)(uintptr_t)addr;
    f->spin_ns = spin_ns;
    f->yield = yield;
    f->adaptive = adaptive;
    f->kind = K_NONE;
    f->k = 0;
    f->rounds = 0;
    f->runs = 0;
    return 0;
}

static void Fast_dealloc(Fast *f) {
    PyMem_Free(f->slots);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

PyDoc_STRVAR(combine_doc,
             "combine(etype, eop, n, out, also, in0, in1, ...)\n\n"
             "out[:n] := in0 op in1 op ... (n elements at each address, in that order: the same bits as\n"
             "the one-step reduction), in one pass over the inputs; also (0: none) gets a copy of the\n"
             "result, tile by tile as each is reduced: also may be one of the inputs (the same\n"
             "address: the rank's own tensor), out overlaps none. AVG divides by the number of\n"
             "inputs. etype/eop: the element type and operator codes of tdist_tcp.shared.native.\n"
             "Releases the GIL for large reductions.");

static PyObject *combine(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t p = nargs - 5; /* etype, eop, n, out, also, then the inputs */
    if (p < 1 || p > MAX_INPUTS) {
        PyErr_Format(PyExc_TypeError, "tdist_tcp.shared._shmfast.combine: takes 1 to %d inputs", MAX_INPUTS);
        return NULL;
    }
    long long *a = PyMem_New(long long, nargs);
    char **ins = PyMem_New(char *, p);
    PyObject *result = NULL;
    if (!a || !ins) {
        PyErr_NoMemory();
        goto done;
    }
    if (!int_args(args, nargs, nargs, "combine", a)) goto done;
    int etype = (int)a[0], eop = (int)a[1];
    Py_ssize_t n = (Py_ssize_t)a[2];
    int ok = reducible(etype, eop) && n >= 0 && a[3];
    for (Py_ssize_t q = 0; ok && q < p; q++) ok = a[5 + q] != 0;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "tdist_tcp.shared._shmfast.combine: bad type, operator, size or address");
        goto done;
    }
    for (Py_ssize_t q = 0; q < p; q++) ins[q] = (char *)(uintptr_t)a[5 + q];
    char *out = (char *)(uintptr_t)a[3], *also = (char *)(uintptr_t)a[4];
    if (n * element_size(etype) < NOGIL_BYTES) {
        reduce_tiled(etype, eop, out, also, ins, (int)p, n);
    } else {
        Py_BEGIN_ALLOW_THREADS
        reduce_tiled(etype, eop, out, also, ins, (int)p, n);
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(a);
    PyMem_Free(ins);
    return result;
}

/* ------------------------------------------------ reading and writing the peers' memory */
PyDoc_STRVAR(cma_probe_doc,
             "cma_probe(pid, remote, local, nbytes) -> int\n\n"
             "Read nbytes at address remote of process pid (process_vm_readv) and compare them with\n"
             "the nbytes at local: 0 if they are equal, -1 if they differ, else the errno of the read\n"
             "(EPERM: not permitted here, ESRCH: no such process).");

static PyObject *cma_probe(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    long long a[4];
    char got[64];
    if (!int_args(args, nargs, 4, "cma_probe", a)) return NULL;
    size_t n = (size_t)a[3];
    if (n == 0 || n > sizeof got || !a[2]) {
        PyErr_SetString(PyExc_ValueError, "tdist_tcp.shared._shmfast.cma_probe: 1 to 64 bytes from a local address");
        return NULL;
    }
    struct iovec mine = {got, n}, theirs = {(void *)(uintptr_t)a[1], n};
    ssize_t done = process_vm_readv((pid_t)a[0], &mine, 1, &theirs, 1, 0);
    if (done < 0) return PyLong_FromLong(errno ? errno : EIO);
    return PyLong_FromLong((size_t)done == n && memcmp(got, (char *)(uintptr_t)a[2], n) == 0 ? 0 : -1);
}

/* Move n bytes between this process (local) and process pid (remote); 0 or the errno. */
static int cma_move(pid_t pid, char *local, char *remote, size_t n, int write) {
    while (n) {
        struct iovec mine = {local, n}, theirs = {remote, n};
        ssize_t done = write ? process_vm_writev(pid, &mine, 1, &theirs, 1, 0)
                             : process_vm_readv(pid, &mine, 1, &theirs, 1, 0);
        if (done <= 0) return done < 0 && errno ? errno : EIO;
        local += done;
        remote += done;
        n -= (size_t)done;
    }
    return 0;
}

PyDoc_STRVAR(cma_combine_doc,
             "cma_combine(etype, eop, n, r, own, *pids_then_addresses) -> None or (member, errno)\n\n"
             "Member r's slice of an all_reduce read from its peers' own memory: for the p members\n"
             "(p pids, then p addresses, each the slice's first element in that member's address\n"
             "space; r's own is own), tile by tile, read each peer's n elements (process_vm_readv),\n"
             "reduce in member order into own, and write the result into every peer's slice\n"
             "(process_vm_writev), without the GIL. The caller makes sure no one else touches these\n"
             "slices meanwhile. None when done, else the member a transfer failed with and its errno.");

static PyObject *cma_combine(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t p = (nargs - 5) / 2;
    if (nargs < 9 || (nargs - 5) % 2 || p > MAX_INPUTS) {
        PyErr_SetString(PyExc_TypeError, "tdist_tcp.shared._shmfast.cma_combine: takes 5 + 2 x (2 to 4096 members) arguments");
        return NULL;
    }
    long long *a = PyMem_New(long long, nargs);
    char **ins = PyMem_New(char *, p);
    char *tiles = NULL;
    PyObject *result = NULL;
    if (!a || !ins) {
        PyErr_NoMemory();
        goto done;
    }
    if (!int_args(args, nargs, nargs, "cma_combine", a)) goto done;
    int etype = (int)a[0], eop = (int)a[1];
    Py_ssize_t n = (Py_ssize_t)a[2], r = (Py_ssize_t)a[3], es = element_size(etype);
    char *own = (char *)(uintptr_t)a[4];
    long long *pids = a + 5, *addrs = a + 5 + p;
    if (!reducible(etype, eop) || n < 0 || r < 0 || r >= p || !own) {
        PyErr_SetString(PyExc_ValueError, "tdist_tcp.shared._shmfast.cma_combine: bad type, operator, size, member or address");
        goto done;
    }
    /* p tiles (the peers' and the result) of whole pages, together about CMA_BYTES */
    Py_ssize_t tile_bytes = (CMA_BYTES / p) & ~(Py_ssize_t)4095;
    if (tile_bytes < 4096) tile_bytes = 4096;
    Py_ssize_t tile = tile_bytes / es;
    tiles = PyMem_Malloc((size_t)(tile_bytes * p));
    if (!tiles) {
        PyErr_NoMemory();
        goto done;
    }
    int failed = -1, err = 0;
    Py_BEGIN_ALLOW_THREADS
    char *out = tiles + (size_t)r * tile_bytes; /* member r's tile is the result's */
    for (Py_ssize_t i = 0; i < n && failed < 0; i += tile) {
        Py_ssize_t m = n - i < tile ? n - i : tile;
        size_t nb = (size_t)(m * es);
        for (Py_ssize_t q = 0; q < p && failed < 0; q++) {
            if (q == r) {
                ins[q] = own + i * es;
                continue;
            }
            ins[q] = tiles + (size_t)q * tile_bytes;
            err = cma_move((pid_t)pids[q], ins[q], (char *)(uintptr_t)addrs[q] + i * es, nb, 0);
            if (err) failed = (int)q;
        }
        if (failed >= 0) break;
        reduce_tiled(etype, eop, out, own + i * es, ins, (int)p, m);
        for (Py_ssize_t q = 0; q < p && failed < 0; q++) {
            if (q == r) continue;
            err = cma_move((pid_t)pids[q], out, (char *)(uintptr_t)addrs[q] + i * es, nb, 1);
            if (err) failed = (int)q;
        }
    }
    Py_END_ALLOW_THREADS
    result = failed < 0 ? Py_BuildValue("") : Py_BuildValue("(ii)", failed, err);
done:
    PyMem_Free(a);
    PyMem_Free(ins);
    PyMem_Free(tiles);
    return result;
}

static PyMethodDef module_functions[] = {
    {"combine", (PyCFunction)(void (*)(void))combine, METH_FASTCALL, combine_doc},
    {"cma_probe", (PyCFunction)(void (*)(void))cma_probe, METH_FASTCALL, cma_probe_doc},
    {"cma_combine", (PyCFunction)(void (*)(void))cma_combine, METH_FASTCALL, cma_combine_doc},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef Fast_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Fast_run, METH_FASTCALL, run_doc},
    {"finish", (PyCFunction)Fast_finish, METH_NOARGS, finish_doc},
    {"abandon", (PyCFunction)Fast_abandon, METH_NOARGS, abandon_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Fast_members[] = {
    {"spin_ns", T_LONGLONG, offsetof(Fast, spin_ns), 0, "how long a step spins before returning WAIT"},
    {"adaptive", T_INT, offsetof(Fast, adaptive), 0, "spin only while no thread waits for a CPU (1) or always (0)"},
    {"k", T_UINT, offsetof(Fast, k), 0, "steps posted (the last step's number)"},
    {"rounds", T_ULONGLONG, offsetof(Fast, rounds), 0, "rounds begun (the next round's buffer: rounds & 1)"},
    {"runs", T_ULONGLONG, offsetof(Fast, runs), READONLY, "collectives run() has started"},
    {"pending", T_INT, offsetof(Fast, kind), READONLY, "the pending collective's kind (0: none)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject FastType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tdist_tcp.shared._shmfast.Fast",
    .tp_basicsize = sizeof(Fast),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("Fast(address, ctrl, data, slot, rank, size, spin_ns, yield_, adaptive=False, slots=None): one "
                        "rank's view of a group's shared segment, for its one-step collectives (slots: each "
                        "member's place in the segment, default its rank). The caller keeps the mapping "
                        "alive as long as this object is used."),
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Fast_dealloc,
    .tp_init = (initproc)Fast_init,
    .tp_methods = Fast_methods,
    .tp_members = Fast_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tdist_tcp.shared._shmfast",
    .m_doc = "The shared-memory engine's one-step collectives in C (see tdist_tcp.shared.native).",
    .m_size = -1,
    .m_methods = module_functions,
};

PyMODINIT_FUNC PyInit__shmfast(void) {
    if (PyType_Ready(&FastType) < 0) return NULL;
    online_cpus = sysconf(_SC_NPROCESSORS_ONLN);
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&FastType);
    if (PyModule_AddObject(m, "Fast", (PyObject *)&FastType) < 0) {
        Py_DECREF(&FastType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "DONE", DONE);
    PyModule_AddIntConstant(m, "WAIT", WAIT);
    PyModule_AddIntConstant(m, "MISMATCH", MISMATCH);
    PyModule_AddIntConstant(m, "BARRIER", K_BARRIER);
    PyModule_AddIntConstant(m, "BROADCAST", K_BROADCAST);
    PyModule_AddIntConstant(m, "REDUCE", K_REDUCE);
    return m;
}
