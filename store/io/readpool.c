/* The native read pool: reader threads that never take Python's GIL.
 *
 * Compiled into store._iopaths after the transfer kernels (see
 * _iopaths_build.py), whose czyx_pread_xfer / czyx_mmap_copy / czyx_uring_read
 * it runs. store/readpool.py is the Python face; inference/planner.py the user.
 *
 * One job per destination slot (at most one transfer is in flight into a
 * slot, the planner's rule), so a job index is the slot index and needs no
 * allocation. Queued jobs wait in a binary heap ordered by (priority, seq):
 * demand reads (priority 0) overtake prefetches. A prefetch is held back
 * (up to 100 ms) while a demand read is queued or running: a consumer blocked
 * on a demand read gains nothing from a concurrent speculative read that
 * shares the device.
 *
 * A worker reads straight into the job's buffer, then checks that the source
 * file is still the one that was opened (fstat: size and mtime; stat of the
 * path: device and inode), stamps CLOCK_MONOTONIC times (Python's
 * time.monotonic_ns) and marks the job done under the pool's mutex; waiters
 * sleep on a condition variable. Where the pool was given the store's checksum
 * function (czyx_pool_set_hash: XXH3-64, store/core/checksum.py) and the job a
 * length to hash, the worker also hashes the bytes it read, so the consumer's
 * verification (store.io.experts) is a comparison, not a pass over the extent on
 * the thread that computes; the consumer compares before first use either way.
 * A consumer that finds its job still
 * queued takes it out of the heap and runs it on its own thread: a blocked
 * consumer gains nothing from a thread hand-off.
 */
#include <pthread.h>

#define CZYX_JOB_FREE 0
#define CZYX_JOB_QUEUED 1
#define CZYX_JOB_RUNNING 2
#define CZYX_JOB_DONE 3

#define CZYX_E_REWRITTEN (-100001) /* size or mtime of the open file changed */
#define CZYX_E_REPLACED (-100002)  /* the path names another inode */
#define CZYX_E_GONE (-100003)      /* the path no longer exists */

#define CZYX_SRC_PREAD 0
#define CZYX_SRC_MMAP 1
#define CZYX_SRC_URING 2

typedef struct {
    int64_t offset; int64_t length; char *buf;
    int64_t done; int64_t err; int64_t t_start_ns; int64_t t_first_ns; int64_t t_done_ns;
    int64_t seq; int32_t src; int32_t priority; int32_t state; int32_t demand;
    int64_t hash_len; uint64_t hash; /* hash_len 0: not hashed (by the pool) */
} czyx_job;

typedef uint64_t (*czyx_hash_fn)(const void *data, size_t len);

typedef struct {
    int kind; int fd; int direct; int id_fd; int64_t align;
    const char *map; int64_t map_size;
    uint64_t dev, ino; int64_t size, mtime_ns;
    char *path;
} czyx_src;

typedef struct czyx_pool {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    czyx_job *jobs; int n_jobs;
    int *heap; int heap_n;
    czyx_src *srcs; int n_srcs, cap_srcs;
    int demands, paused, stop;
    int64_t seq;
    pthread_t *threads; int n_threads;
    unsigned uring_entries;
    czyx_ring *inline_ring; int inline_busy; /* the consumer's own ring, one user at a time */
    czyx_hash_fn hash; /* the store's checksum, or NULL: the consumer hashes */
} czyx_pool;

static int job_before(czyx_pool *p, int a, int b) {
    czyx_job *x = &p->jobs[a], *y = &p->jobs[b];
    return x->priority != y->priority ? x->priority < y->priority : x->seq < y->seq;
}

static void heap_up(czyx_pool *p, int i) {
    while (i > 0) {
        int up = (i - 1) / 2;
        if (!job_before(p, p->heap[i], p->heap[up])) break;
        int t = p->heap[i]; p->heap[i] = p->heap[up]; p->heap[up] = t;
        i = up;
    }
}

static void heap_down(czyx_pool *p, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < p->heap_n && job_before(p, p->heap[l], p->heap[m])) m = l;
        if (r < p->heap_n && job_before(p, p->heap[r], p->heap[m])) m = r;
        if (m == i) return;
        int t = p->heap[i]; p->heap[i] = p->heap[m]; p->heap[m] = t;
        i = m;
    }
}

/* Remove heap entry i (the top, or a job a consumer takes over). */
static int heap_take(czyx_pool *p, int i) {
    int j = p->heap[i];
    p->heap[i] = p->heap[--p->heap_n];
    if (i < p->heap_n) { heap_down(p, i); heap_up(p, i); }
    return j;
}

static void run_job(czyx_pool *p, czyx_job *j, czyx_ring **ring) {
    czyx_src *s = &p->srcs[j->src];
    czyx_xfer x;
    x.offset = j->offset; x.length = j->length; x.buf = j->buf;
    j->t_start_ns = czyx_now_ns();
    if (s->kind == CZYX_SRC_MMAP) {
        czyx_mmap_copy(s->id_fd, s->map, s->map_size, &x, 1);
    } else if (s->kind == CZYX_SRC_URING) {
        if (!*ring) {
            int err = 0;
            *ring = czyx_uring_open(p->uring_entries, &err);
            if (!*ring) { x.done = 0; x.err = -(int64_t)err; x.t_first_ns = 0; }
        }
        if (*ring) czyx_uring_read(*ring, s->fd, s->direct, s->align, &x, 1);
    } else {
        czyx_pread_xfer(s->fd, s->direct, s->align, &x);
    }
    j->done = x.done; j->err = x.err; j->t_first_ns = x.t_first_ns;
    if (!j->err) {
        struct stat st;
        if (fstat(s->id_fd, &st) != 0) j->err = -(int64_t)errno;
        else if ((int64_t)st.st_size != s->size ||
                 (int64_t)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec != s->mtime_ns)
            j->err = CZYX_E_REWRITTEN;
        else if (stat(s->path, &st) != 0) j->err = errno == ENOENT ? CZYX_E_GONE : -(int64_t)errno;
        else if ((uint64_t)st.st_dev != s->dev || (uint64_t)st.st_ino != s->ino)
            j->err = CZYX_E_REPLACED;
    }
    j->t_done_ns = czyx_now_ns(); /* the read's completion: hashing is not I/O time */
    if (j->hash_len > 0 && (j->err || j->done < j->hash_len)) j->hash_len = 0;
    if (j->hash_len > 0) j->hash = p->hash(j->buf, (size_t)j->hash_len);
}

static void finish_locked(czyx_pool *p, czyx_job *j) {
    j->state = CZYX_JOB_DONE;
    if (j->demand && --p->demands == 0) pthread_cond_broadcast(&p->work);
    pthread_cond_broadcast(&p->done);
}

static void *worker(void *arg) {
    czyx_pool *p = arg;
    czyx_ring *ring = NULL;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && (p->paused || p->heap_n == 0))
            pthread_cond_wait(&p->work, &p->mu);
        if (p->stop) break;
        czyx_job *top = &p->jobs[p->heap[0]];
        if (!top->demand && p->demands > 0) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 100000000L;
            if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
            int rc = 0;
            while (!p->stop && !p->paused && p->heap_n && p->demands > 0 &&
                   !p->jobs[p->heap[0]].demand && rc == 0)
                rc = pthread_cond_timedwait(&p->work, &p->mu, &ts);
            if (rc == 0) continue; /* re-evaluate: a demand read, a pause, a stop */
            if (p->stop || p->paused || !p->heap_n) continue;
        }
        czyx_job *j = &p->jobs[heap_take(p, 0)];
        j->state = CZYX_JOB_RUNNING;
        pthread_mutex_unlock(&p->mu);
        run_job(p, j, &ring);
        pthread_mutex_lock(&p->mu);
        finish_locked(p, j);
    }
    pthread_mutex_unlock(&p->mu);
    czyx_uring_close(ring);
    return NULL;
}

void czyx_pool_free(czyx_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
    for (int i = 0; i < p->n_srcs; i++) free(p->srcs[i].path);
    czyx_uring_close(p->inline_ring);
    pthread_cond_destroy(&p->work);
    pthread_cond_destroy(&p->done);
    pthread_mutex_destroy(&p->mu);
    free(p->threads); free(p->srcs); free(p->heap); free(p->jobs); free(p);
}

czyx_pool *czyx_pool_new(int n_jobs, int n_threads, unsigned uring_entries, int *err) {
    czyx_pool *p = calloc(1, sizeof *p);
    if (!p || n_jobs < 1 || n_threads < 1) { free(p); *err = p ? EINVAL : ENOMEM; return NULL; }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->done, NULL);
    p->n_jobs = n_jobs;
    p->uring_entries = uring_entries ? uring_entries : 1;
    p->jobs = calloc((size_t)n_jobs, sizeof *p->jobs);
    p->heap = calloc((size_t)n_jobs, sizeof *p->heap);
    p->threads = calloc((size_t)n_threads, sizeof *p->threads);
    if (!p->jobs || !p->heap || !p->threads) { czyx_pool_free(p); *err = ENOMEM; return NULL; }
    for (int i = 0; i < n_threads; i++) {
        int rc = pthread_create(&p->threads[i], NULL, worker, p);
        if (rc) { czyx_pool_free(p); *err = rc; return NULL; }
        p->n_threads++;
    }
    *err = 0;
    return p;
}

/* Register a source; returns its index, or -errno. */
int czyx_pool_add_source(czyx_pool *p, int kind, int fd, int direct, int64_t align, int id_fd,
                         const char *map, int64_t map_size, uint64_t dev, uint64_t ino,
                         int64_t size, int64_t mtime_ns, const char *path) {
    int idx;
    pthread_mutex_lock(&p->mu);
    if (p->n_srcs == p->cap_srcs) {
        int cap = p->cap_srcs ? 2 * p->cap_srcs : 4;
        czyx_src *s = realloc(p->srcs, (size_t)cap * sizeof *s);
        if (!s) { pthread_mutex_unlock(&p->mu); return -ENOMEM; }
        p->srcs = s; p->cap_srcs = cap;
    }
    idx = p->n_srcs;
    czyx_src *s = &p->srcs[idx];
    s->path = strdup(path);
    if (!s->path) { pthread_mutex_unlock(&p->mu); return -ENOMEM; }
    s->kind = kind; s->fd = fd; s->direct = direct; s->align = align; s->id_fd = id_fd;
    s->map = map; s->map_size = map_size;
    s->dev = dev; s->ino = ino; s->size = size; s->mtime_ns = mtime_ns;
    p->n_srcs++;
    pthread_mutex_unlock(&p->mu);
    return idx;
}

/* Queue a read into job j; -EBUSY while j is queued or running, -EINVAL on a bad index. */
int czyx_pool_submit(czyx_pool *p, int j, int src, int64_t offset, int64_t length, char *buf,
                     int priority, int demand, int64_t hash_len) {
    if (j < 0 || j >= p->n_jobs) return -EINVAL;
    pthread_mutex_lock(&p->mu);
    czyx_job *job = &p->jobs[j];
    if (src < 0 || src >= p->n_srcs) { pthread_mutex_unlock(&p->mu); return -EINVAL; }
    if (job->state == CZYX_JOB_QUEUED || job->state == CZYX_JOB_RUNNING) {
        pthread_mutex_unlock(&p->mu);
        return -EBUSY;
    }
    job->offset = offset; job->length = length; job->buf = buf;
    job->done = 0; job->err = 0; job->t_start_ns = job->t_first_ns = job->t_done_ns = 0;
    job->src = src; job->priority = priority; job->demand = demand ? 1 : 0;
    job->hash_len = p->hash && hash_len > 0 && hash_len <= length ? hash_len : 0;
    job->hash = 0;
    job->seq = p->seq++;
    job->state = CZYX_JOB_QUEUED;
    if (job->demand) p->demands++;
    p->heap[p->heap_n++] = j;
    heap_up(p, p->heap_n - 1);
    /* One worker is enough: any woken worker takes the new top (a parked prefetch
       holder re-evaluates too). Waking them all costs context switches on few CPUs. */
    pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->mu);
    return 0;
}

/* Block until job j is done. A job no worker has started (and the pool not
   paused) is run here. Returns 1 if this thread ran it, 0 if a worker did,
   -EINVAL if j was never submitted. */
int czyx_pool_wait(czyx_pool *p, int j) {
    if (j < 0 || j >= p->n_jobs) return -EINVAL;
    pthread_mutex_lock(&p->mu);
    czyx_job *job = &p->jobs[j];
    if (job->state == CZYX_JOB_FREE) { pthread_mutex_unlock(&p->mu); return -EINVAL; }
    while (job->state == CZYX_JOB_QUEUED && p->paused) pthread_cond_wait(&p->done, &p->mu);
    if (job->state == CZYX_JOB_QUEUED) {
        for (int i = 0; i < p->heap_n; i++)
            if (p->heap[i] == j) { heap_take(p, i); break; }
        job->state = CZYX_JOB_RUNNING;
        int own = !p->inline_busy;
        p->inline_busy = 1;
        czyx_ring *ring = own ? p->inline_ring : NULL;
        pthread_mutex_unlock(&p->mu);
        run_job(p, job, &ring);
        pthread_mutex_lock(&p->mu);
        if (own) { p->inline_ring = ring; p->inline_busy = 0; }
        else czyx_uring_close(ring);
        finish_locked(p, job);
        pthread_mutex_unlock(&p->mu);
        return 1;
    }
    while (job->state != CZYX_JOB_DONE) pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
    return 0;
}

/* The job's state without waiting (a plain read: the mutex orders it after
   the worker's writes of the job's results). */
int czyx_pool_state(czyx_pool *p, int j) {
    int s;
    pthread_mutex_lock(&p->mu);
    s = p->jobs[j].state;
    pthread_mutex_unlock(&p->mu);
    return s;
}

czyx_job *czyx_pool_job(czyx_pool *p, int j) { return &p->jobs[j]; }

/* Have the workers hash what they read with fn (NULL: they do not). Set before any
   submission: a job's hash_len is decided when it is queued. */
void czyx_pool_set_hash(czyx_pool *p, void *fn) { p->hash = (czyx_hash_fn)fn; }

/* Hold queued jobs (1) or let them run (0): a slow device, for fault injection. */
void czyx_pool_pause(czyx_pool *p, int paused) {
    pthread_mutex_lock(&p->mu);
    p->paused = paused;
    pthread_cond_broadcast(&p->work);
    pthread_cond_broadcast(&p->done);
    pthread_mutex_unlock(&p->mu);
}
