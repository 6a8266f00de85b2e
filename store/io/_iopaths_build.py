"""cffi (API mode) builder of ``store._iopaths``: the timed transfer kernels.

Built by ``setup.py`` (it discovers every ``_*_build.py``) or in place with
``python setup.py build_ext --inplace``. Three mechanisms, one record type:

- ``czyx_pread_xfer``: ``pread`` loop (buffered or ``O_DIRECT``), surviving
  short reads and ``EINTR``;
- ``czyx_mmap_copy``: ``madvise(MADV_WILLNEED)`` over a mapped range, then
  ``memcpy`` into the destination in 1 MiB steps;
- ``czyx_uring_*``: io_uring through the raw system calls (no liburing
  needed), ``IORING_OP_READ`` at a chosen queue depth, short reads resubmitted;
- ``czyx_pool_*``: the native read pool (``readpool.c``, next to this file):
  POSIX reader threads that run those kernels without the GIL, a priority
  heap of queued reads, per-read completion and source-identity checks, and
  the extent's checksum where the pool is given the store's hash function
  (:mod:`store.readpool`).

Every transfer is a ``czyx_xfer``: the kernels fill ``done`` (bytes read),
``err`` (``0`` or ``-errno``) and two ``CLOCK_MONOTONIC`` stamps, the first
bytes' arrival and completion, which :mod:`store.iopaths` turns into X-Ray
times (Python's ``time.monotonic_ns`` reads the same clock). cffi releases
the GIL around every call, so reader threads overlap.
"""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

CDEF = """
typedef struct {
    int64_t offset; int64_t length; char *buf;
    int64_t done; int64_t err; int64_t t_first_ns; int64_t t_done_ns;
} czyx_xfer;
typedef struct czyx_ring czyx_ring;

int64_t czyx_now_ns(void);
int64_t czyx_pread_xfer(int fd, int direct, int64_t align, czyx_xfer *x);
void *czyx_map(int fd, int64_t size, int *err);
int czyx_unmap(void *base, int64_t size);
int64_t czyx_mmap_copy(int fd, const char *base, int64_t size, czyx_xfer *x, int willneed);
czyx_ring *czyx_uring_open(unsigned entries, int *err);
void czyx_uring_close(czyx_ring *r);
unsigned czyx_uring_entries(czyx_ring *r);
int64_t czyx_uring_read(czyx_ring *r, int fd, int direct, int64_t align, czyx_xfer *xs,
                        int64_t n);

typedef struct {
    int64_t offset; int64_t length; char *buf;
    int64_t done; int64_t err; int64_t t_start_ns; int64_t t_first_ns; int64_t t_done_ns;
    int64_t seq; int32_t src; int32_t priority; int32_t state; int32_t demand;
    int64_t hash_len; uint64_t hash;
} czyx_job;
typedef struct czyx_pool czyx_pool;
czyx_pool *czyx_pool_new(int n_jobs, int n_threads, unsigned uring_entries, int *err);
void czyx_pool_free(czyx_pool *p);
int czyx_pool_add_source(czyx_pool *p, int kind, int fd, int direct, int64_t align, int id_fd,
                         const char *map, int64_t map_size, uint64_t dev, uint64_t ino,
                         int64_t size, int64_t mtime_ns, const char *path);
int czyx_pool_submit(czyx_pool *p, int j, int src, int64_t offset, int64_t length, char *buf,
                     int priority, int demand, int64_t hash_len);
void czyx_pool_set_hash(czyx_pool *p, void *fn);
int czyx_pool_wait(czyx_pool *p, int j);
int czyx_pool_state(czyx_pool *p, int j);
czyx_job *czyx_pool_job(czyx_pool *p, int j);
void czyx_pool_pause(czyx_pool *p, int paused);
"""

SOURCE = r"""
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <linux/io_uring.h>

typedef struct {
    int64_t offset; int64_t length; char *buf;
    int64_t done; int64_t err; int64_t t_first_ns; int64_t t_done_ns;
} czyx_xfer;

int64_t czyx_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void start(czyx_xfer *x) { x->done = 0; x->err = 0; x->t_first_ns = 0; x->t_done_ns = 0; }

/* Fill x->buf[0:length) from x->offset. A direct read that returns a
   non-multiple of align has hit the (unaligned) end of file: stop there,
   another O_DIRECT pread at an unaligned position would be EINVAL. */
int64_t czyx_pread_xfer(int fd, int direct, int64_t align, czyx_xfer *x) {
    start(x);
    if (x->length < 0 || x->offset < 0) { x->err = -EINVAL; goto out; }
    while (x->done < x->length) {
        ssize_t r = pread(fd, x->buf + x->done, (size_t)(x->length - x->done),
                          (off_t)(x->offset + x->done));
        if (r < 0) {
            if (errno == EINTR) continue;
            x->err = -(int64_t)errno;
            break;
        }
        if (r == 0) break;
        if (!x->t_first_ns) x->t_first_ns = czyx_now_ns();
        x->done += r;
        if (direct && (r % align) != 0) break;
    }
out:
    x->t_done_ns = czyx_now_ns();
    return x->done;
}

void *czyx_map(int fd, int64_t size, int *err) {
    void *p = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { *err = errno; return NULL; }
    *err = 0;
    return p;
}

int czyx_unmap(void *base, int64_t size) { return munmap(base, (size_t)size); }

/* Copy from a mapping. The file's current size is checked first: touching a
   mapped page past end of file raises SIGBUS, so a truncated file must be
   refused (as a short read) before the copy, not discovered by it. */
int64_t czyx_mmap_copy(int fd, const char *base, int64_t size, czyx_xfer *x, int willneed) {
    struct stat st;
    int64_t avail, n, step = 1 << 20;
    start(x);
    if (x->length < 0 || x->offset < 0) { x->err = -EINVAL; goto out; }
    if (fstat(fd, &st) != 0) { x->err = -(int64_t)errno; goto out; }
    avail = (int64_t)st.st_size < size ? (int64_t)st.st_size : size;
    n = x->offset >= avail ? 0 : avail - x->offset;
    if (n > x->length) n = x->length;
    if (n > 0 && willneed) {
        long pg = sysconf(_SC_PAGESIZE);
        uintptr_t a = (uintptr_t)(base + x->offset) & ~(uintptr_t)(pg - 1);
        madvise((void *)a, (size_t)((uintptr_t)(base + x->offset + n) - a), MADV_WILLNEED);
    }
    while (x->done < n) {
        int64_t c = n - x->done < step ? n - x->done : step;
        memcpy(x->buf + x->done, base + x->offset + x->done, (size_t)c);
        if (!x->t_first_ns) x->t_first_ns = czyx_now_ns();
        x->done += c;
    }
out:
    x->t_done_ns = czyx_now_ns();
    return x->done;
}

/* ---- io_uring through the raw system calls ---------------------------------------- */

typedef struct czyx_ring {
    int fd;
    unsigned entries;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_ptr, *cq_ptr;
    size_t sq_sz, cq_sz, sqes_sz;
} czyx_ring;

void czyx_uring_close(czyx_ring *r) {
    if (!r) return;
    if (r->sqes && r->sqes != MAP_FAILED) munmap(r->sqes, r->sqes_sz);
    if (r->cq_ptr && r->cq_ptr != MAP_FAILED && r->cq_ptr != r->sq_ptr) munmap(r->cq_ptr, r->cq_sz);
    if (r->sq_ptr && r->sq_ptr != MAP_FAILED) munmap(r->sq_ptr, r->sq_sz);
    if (r->fd >= 0) close(r->fd);
    free(r);
}

czyx_ring *czyx_uring_open(unsigned entries, int *err) {
#ifndef __NR_io_uring_setup
    *err = ENOSYS;
    return NULL;
#else
    struct io_uring_params p;
    czyx_ring *r;
    memset(&p, 0, sizeof p);
    int fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (fd < 0) { *err = errno; return NULL; }
    r = calloc(1, sizeof *r);
    if (!r) { close(fd); *err = ENOMEM; return NULL; }
    r->fd = fd;
    r->entries = p.sq_entries;
    r->sq_sz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_sz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_sz > r->sq_sz) r->sq_sz = r->cq_sz;
        r->cq_sz = r->sq_sz;
    }
    r->sq_ptr = mmap(NULL, r->sq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                     IORING_OFF_SQ_RING);
    if (r->sq_ptr == MAP_FAILED) goto fail;
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_ptr = r->sq_ptr;
    } else {
        r->cq_ptr = mmap(NULL, r->cq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                         IORING_OFF_CQ_RING);
        if (r->cq_ptr == MAP_FAILED) goto fail;
    }
    r->sqes_sz = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                   IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) goto fail;
    r->sq_head = (unsigned *)((char *)r->sq_ptr + p.sq_off.head);
    r->sq_tail = (unsigned *)((char *)r->sq_ptr + p.sq_off.tail);
    r->sq_mask = (unsigned *)((char *)r->sq_ptr + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)((char *)r->sq_ptr + p.sq_off.array);
    r->cq_head = (unsigned *)((char *)r->cq_ptr + p.cq_off.head);
    r->cq_tail = (unsigned *)((char *)r->cq_ptr + p.cq_off.tail);
    r->cq_mask = (unsigned *)((char *)r->cq_ptr + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)((char *)r->cq_ptr + p.cq_off.cqes);
    *err = 0;
    return r;
fail:
    *err = errno;
    czyx_uring_close(r);
    return NULL;
#endif
}

unsigned czyx_uring_entries(czyx_ring *r) { return r->entries; }

static void push_read(czyx_ring *r, int fd, czyx_xfer *x, uint64_t ud) {
    unsigned tail = *r->sq_tail;
    unsigned idx = tail & *r->sq_mask;
    struct io_uring_sqe *s = &r->sqes[idx];
    int64_t left = x->length - x->done;
    memset(s, 0, sizeof *s);
    s->opcode = IORING_OP_READ;
    s->fd = fd;
    s->addr = (uint64_t)(uintptr_t)(x->buf + x->done);
    s->len = (unsigned)(left > (1LL << 30) ? (1LL << 30) : left);
    s->off = (uint64_t)(x->offset + x->done);
    s->user_data = ud;
    r->sq_array[idx] = idx;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

/* Read n transfers with up to r->entries in flight. Returns the index of the
   first transfer that did not complete fully (err set, or done < length at end
   of file), or -1. */
int64_t czyx_uring_read(czyx_ring *r, int fd, int direct, int64_t align, czyx_xfer *xs,
                        int64_t n) {
    int64_t next = 0, finished = 0, inflight = 0, bad = -1;
    unsigned to_submit = 0;
    for (int64_t i = 0; i < n; i++) {
        start(&xs[i]);
        if (xs[i].length < 0 || xs[i].offset < 0) xs[i].err = -EINVAL;
    }
    while (finished < n) {
        while (next < n && inflight < (int64_t)r->entries) {
            if (xs[next].err || xs[next].length == 0) {
                xs[next].t_done_ns = czyx_now_ns();
                finished++; next++;
                continue;
            }
            push_read(r, fd, &xs[next], (uint64_t)next);
            next++; inflight++; to_submit++;
        }
        if (!inflight) continue;
        int ret = (int)syscall(__NR_io_uring_enter, r->fd, to_submit, 1,
                               IORING_ENTER_GETEVENTS, NULL, 0);
        if (ret < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EBUSY) continue;
            int64_t e = -(int64_t)errno;
            /* The ring is unusable: fail every unfinished transfer. */
            for (int64_t i = 0; i < n; i++)
                if (!xs[i].t_done_ns) { xs[i].err = e; xs[i].t_done_ns = czyx_now_ns(); }
            break;
        }
        to_submit -= (unsigned)ret < to_submit ? (unsigned)ret : to_submit;
        unsigned head = *r->cq_head;
        unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        while (head != tail) {
            struct io_uring_cqe *c = &r->cqes[head & *r->cq_mask];
            czyx_xfer *x = &xs[c->user_data];
            int res = c->res;
            head++;
            if (res == -EINTR || res == -EAGAIN) {
                push_read(r, fd, x, c->user_data);
                to_submit++;
                continue;
            }
            if (res > 0) {
                if (!x->t_first_ns) x->t_first_ns = czyx_now_ns();
                x->done += res;
                if (x->done < x->length && !(direct && (res % align) != 0)) {
                    push_read(r, fd, x, c->user_data);  /* short read: ask for the rest */
                    to_submit++;
                    continue;
                }
            } else if (res < 0) {
                x->err = res;
            }
            x->t_done_ns = czyx_now_ns();
            inflight--; finished++;
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
    for (int64_t i = 0; i < n; i++)
        if (xs[i].err || xs[i].done != xs[i].length) { bad = i; break; }
    return bad;
}
"""

# The pool's C lives in its own file; cffi runs this builder with __file__ set.
POOL_SOURCE = (Path(__file__).resolve().parent / "readpool.c").read_text()

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "czyx.store.io._iopaths",
    SOURCE + POOL_SOURCE,
    extra_compile_args=["-O2", "-std=gnu99", "-pthread"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
