"""cffi (API mode) builder of ``store._reader``, the raw block reader.

Built by ``setup.py`` (it discovers every ``_*_build.py``) or in place with
``python setup.py build_ext --inplace``. The C side is deliberately small:
``pread`` loops that survive short reads and ``EINTR``, an ``O_DIRECT`` path
that reads the aligned body of a request through a second descriptor and any
unaligned tail through the buffered one, and a batched call over many
extents. cffi releases the GIL around every call, so several Python threads
can read at once.

Return convention (no per-call allocation of out-parameters on the hot path):
``czyx_read_one`` returns the bytes read (== length on success, less at end of
file) or ``-errno``; ``czyx_read_many`` returns the index of the first extent
that did not read fully (``-1`` when all did) and stores that extent's
``czyx_read_one`` result in ``*result``. ``czyx_copy_many`` is the same
batch served by ``memcpy`` from a read-only mapping of the file (the warm,
page-cache path without a system call per request).
"""

from __future__ import annotations

from cffi import FFI

CDEF = """
typedef struct { int64_t offset; int64_t length; char *buf; } czyx_extent;
int64_t czyx_read_one(int fd, int dfd, int64_t align, int64_t offset, char *buf, int64_t length);
int64_t czyx_read_many(int fd, int dfd, int64_t align, const czyx_extent *ex, int64_t n,
                       int64_t *result);
int64_t czyx_copy_many(const char *base, int64_t size, const czyx_extent *ex, int64_t n,
                       int64_t *result);
int64_t czyx_copy_one(const char *base, int64_t size, int64_t offset, char *buf, int64_t length);
"""

SOURCE = r"""
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

typedef struct { int64_t offset; int64_t length; char *buf; } czyx_extent;

/* Read exactly len bytes unless end of file comes first. With direct != 0 a
   read that returns a non-multiple of align is the file's (unaligned) end:
   another O_DIRECT pread at the unaligned position would fail with EINVAL. */
static int64_t full_pread(int fd, char *buf, int64_t len, int64_t off, int direct,
                          int64_t align) {
    int64_t done = 0;
    while (done < len) {
        ssize_t r = pread(fd, buf + done, (size_t)(len - done), (off_t)(off + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -(int64_t)errno;
        }
        if (r == 0) break;
        done += r;
        if (direct && (r % align) != 0) break;
    }
    return done;
}

int64_t czyx_read_one(int fd, int dfd, int64_t align, int64_t offset, char *buf,
                      int64_t length) {
    int64_t body = 0, r;
    if (length < 0 || offset < 0) return -EINVAL;
    if (dfd >= 0 && ((uintptr_t)buf % (uintptr_t)align) == 0 && offset % align == 0)
        body = length / align * align;
    if (body) {
        r = full_pread(dfd, buf, body, offset, 1, align);
        if (r != body) return r;
    }
    if (length > body) {
        r = full_pread(fd, buf + body, length - body, offset + body, 0, align);
        if (r < 0) return r;
        return body + r;
    }
    return body;
}

int64_t czyx_read_many(int fd, int dfd, int64_t align, const czyx_extent *ex, int64_t n,
                       int64_t *result) {
    for (int64_t i = 0; i < n; i++) {
        int64_t r = czyx_read_one(fd, dfd, align, ex[i].offset, ex[i].buf, ex[i].length);
        if (r != ex[i].length) {
            *result = r;
            return i;
        }
    }
    *result = 0;
    return -1;
}

/* The mapped path: copy extents out of a read-only mapping of the whole file
   (taken when the reader opened it). A request reaching past the mapped size
   copies what exists and reports a short read, as pread does at end of file. */
int64_t czyx_copy_one(const char *base, int64_t size, int64_t offset, char *buf,
                      int64_t length) {
    int64_t avail;
    if (offset < 0 || length < 0) return -EINVAL;
    avail = offset >= size ? 0 : (size - offset < length ? size - offset : length);
    if (avail > 0) memcpy(buf, base + offset, (size_t)avail);
    return avail;
}

int64_t czyx_copy_many(const char *base, int64_t size, const czyx_extent *ex, int64_t n,
                       int64_t *result) {
    for (int64_t i = 0; i < n; i++) {
        int64_t r = czyx_copy_one(base, size, ex[i].offset, ex[i].buf, ex[i].length);
        if (r != ex[i].length) {
            *result = r;
            return i;
        }
    }
    *result = 0;
    return -1;
}
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source("czyx.store.io._reader", SOURCE, extra_compile_args=["-O2", "-std=c99"])

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
