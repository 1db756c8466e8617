/* ---------------------------------------------------------------- thread pool
 * Workers take whole work items (output tiles) from a counter; which thread computes an item
 * changes no bit of it. On the library's own threads one job runs at a time (callers from several
 * Python threads queue); on OpenMP's, each calling thread gets its own team, as a torch op would. */

#define MAX_WORKERS 255

static struct {
    pthread_mutex_t lock, job_lock;
    pthread_cond_t wake, done;
    int n_workers;  /* started */
    int active;     /* workers taking part in the current job */
    unsigned long generation;
    int pending;    /* workers of the current job not yet finished */
    void (*fn)(void *, int64_t);
    void *ctx;
    int64_t n_items;
    atomic_llong next;
    unsigned long born[MAX_WORKERS]; /* the generation when each worker was started */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, 0, 0, {0}};

static void run_items(void) {
    for (;;) {
        int64_t i = atomic_fetch_add(&pool.next, 1);
        if (i >= pool.n_items) return;
        pool.fn(pool.ctx, i);
    }
}

static void *worker_main(void *arg) {
    int index = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.lock);
    /* Not pool.generation: the job it was started for may already have been announced. */
    unsigned long seen = pool.born[index];
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        if (index >= pool.active) continue;
        pthread_mutex_unlock(&pool.lock);
        run_items();
        pthread_mutex_lock(&pool.lock);
        if (--pool.pending == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* torch's own OpenMP threads, when the loader hands us its runtime's GOMP_parallel (ls_use_openmp):
 * a second pool of threads would compete for the cores with OpenMP's, which spin for a while after
 * each torch op, and each pool would lose time to the other. The items are the same either way. */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static gomp_parallel_fn gomp_parallel = NULL;

static void pool_after_fork_in_child(void) {
    /* The workers do not exist in a forked child: start afresh. Nor do OpenMP's, and libgomp does
     * not start them again (a parallel region in the child waits forever), so the child uses the
     * library's own threads. */
    gomp_parallel = NULL;
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.job_lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.n_workers = pool.active = pool.pending = 0;
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void install_atfork(void) { pthread_atfork(NULL, NULL, pool_after_fork_in_child); }

typedef struct {
    void (*fn)(void *, int64_t);
    void *ctx;
    int64_t n_items;
    atomic_llong next;
} omp_job;

static void omp_team_member(void *arg) {
    omp_job *j = (omp_job *)arg;
    for (;;) {
        int64_t i = atomic_fetch_add(&j->next, 1);
        if (i >= j->n_items) return;
        j->fn(j->ctx, i);
    }
}

static void parallel_for(void (*fn)(void *, int64_t), void *ctx, int64_t n_items, int threads) {
    if (threads > n_items) threads = (int)n_items;
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    if (threads <= 1) {
        for (int64_t i = 0; i < n_items; i++) fn(ctx, i);
        return;
    }
    if (gomp_parallel) {
        omp_job j = {fn, ctx, n_items, 0};
        gomp_parallel(omp_team_member, &j, (unsigned)threads, 0);
        return;
    }
    pthread_once(&atfork_once, install_atfork);
    pthread_mutex_lock(&pool.job_lock);
    pthread_mutex_lock(&pool.lock);
    while (pool.n_workers < threads - 1) {
        pthread_t t;
        pool.born[pool.n_workers] = pool.generation;
        if (pthread_create(&t, NULL, worker_main, (void *)(intptr_t)pool.n_workers) != 0) break;
        pthread_detach(t);
        pool.n_workers++;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n_items = n_items;
    atomic_store(&pool.next, 0);
    pool.active = threads - 1 < pool.n_workers ? threads - 1 : pool.n_workers;
    pool.pending = pool.active;
    pool.generation++;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run_items();
    pthread_mutex_lock(&pool.lock);
    while (pool.pending > 0) pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.job_lock);
}

/* Run parallel work on the OpenMP runtime whose GOMP_parallel (GCC's ABI: fn, data, team size,
 * flags) is `fn`, or on the library's own threads when `fn` is NULL. */
void ls_use_openmp(void *fn) {
    pthread_once(&atfork_once, install_atfork);
    gomp_parallel = (gomp_parallel_fn)fn;
}
