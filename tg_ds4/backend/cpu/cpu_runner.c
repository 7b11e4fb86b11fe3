/* Replays a list of compiled tinygrad CPU kernels natively, on every core.

   tinygrad splits a large CPU kernel into `parts` calls that differ only in their `core_id` argument (the THREAD
   opt); its synchronous CPU executor makes those calls one after another from Python. Here the main thread and
   nthreads-1 workers share each split kernel's parts, meeting at a spin barrier after it. A wave (consecutive unsplit
   kernels that touch no bytes another of them writes, found by replay.py: a batched step's per-row attention kernels)
   is shared the same way, each thread running whole kernels of it; any other unsplit kernel runs on the main thread
   alone. Kernels are called as tinygrad's own CPU worker calls them: through one 63-argument
   prototype, every argument a 64-bit word (unused trailing words are ignored by the callee). */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>

#define MAX_ARGS 63
#define U uint64_t
#define U8 U, U, U, U, U, U, U, U
typedef void (*kernel_fn)(U8, U8, U8, U8, U8, U8, U8, U, U, U, U, U, U, U);
#define A8(i) a[i], a[i + 1], a[i + 2], a[i + 3], a[i + 4], a[i + 5], a[i + 6], a[i + 7]

typedef struct {
  kernel_fn fn;
  int32_t nargs, parts, core_slot;        /* core_slot: argument index of core_id, -1 when the kernel is not split */
  int32_t wave;                           /* > 1: this op and the wave - 1 after it run at once (each unsplit) */
  uint64_t args[MAX_ARGS];                /* fixed words: buffer addresses */
  int16_t slot[MAX_ARGS];                 /* >= 0: the word is slots[slot[i]] of this run (inputs, symbolic values) */
} op_t;

typedef struct {
  const op_t *ops;
  const uint64_t *slots;
  int32_t nthreads;
  int64_t seq;  /* bumped once per dispatched split kernel; workers follow it */
  int64_t cur;  /* index of the dispatched kernel, -1 to stop */
  int64_t done; /* workers finished with the dispatched kernel */
} run_t;

static inline void relax(unsigned *spins) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
  if (++*spins > 4096) { *spins = 0; sched_yield(); }  /* stay polite when another process wants the core */
}

static void exec_part(const op_t *op, const uint64_t *slots, int part) {
  uint64_t a[MAX_ARGS] = {0};
  for (int i = 0; i < op->nargs; i++) a[i] = op->slot[i] >= 0 ? slots[op->slot[i]] : op->args[i];
  if (op->core_slot >= 0) a[op->core_slot] = (uint64_t)part;
  op->fn(A8(0), A8(8), A8(16), A8(24), A8(32), A8(40), A8(48), a[56], a[57], a[58], a[59], a[60], a[61], a[62]);
}

typedef struct { run_t *r; int tid; } worker_arg;

static void *worker(void *p) {
  worker_arg *w = (worker_arg *)p;
  run_t *r = w->r;
  int64_t seen = 0;
  for (;;) {
    unsigned spins = 0;
    int64_t s;
    while ((s = __atomic_load_n(&r->seq, __ATOMIC_ACQUIRE)) == seen) relax(&spins);
    seen = s;
    int64_t i = __atomic_load_n(&r->cur, __ATOMIC_RELAXED);
    if (i < 0) return 0;
    const op_t *op = &r->ops[i];
    if (op->wave > 1) for (int k = w->tid; k < op->wave; k += r->nthreads) exec_part(op + k, r->slots, 0);
    else for (int part = w->tid; part < op->parts; part += r->nthreads) exec_part(op, r->slots, part);
    __atomic_fetch_add(&r->done, 1, __ATOMIC_ACQ_REL);
  }
}

/* Runs ops[0..n) in order. Returns 0, or -1 if a worker thread could not be started (then all ran on one thread). */
int tg_ds4_run(const op_t *ops, int32_t n, const uint64_t *slots, int32_t nthreads) {
  enum { MAX_THREADS = 64 };
  run_t r = {ops, slots, 1, 0, 0, 0};
  pthread_t th[MAX_THREADS];
  worker_arg wa[MAX_THREADS];
  int status = 0, split = 0;
  for (int i = 0; i < n; i++) split |= ops[i].parts > 1 || ops[i].wave > 1;
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  for (int t = 1; split && t < nthreads; t++) {
    wa[t] = (worker_arg){&r, t};
    if (pthread_create(&th[t], 0, worker, &wa[t]) != 0) { status = -1; break; }
    r.nthreads = t + 1;
  }
  for (int i = 0; i < n; i++) {
    const op_t *op = &ops[i];
    if ((op->parts == 1 && op->wave <= 1) || r.nthreads == 1) {
      for (int part = 0; part < op->parts; part++) exec_part(op, slots, part);
      continue;
    }
    __atomic_store_n(&r.cur, i, __ATOMIC_RELAXED);
    __atomic_store_n(&r.done, 0, __ATOMIC_RELAXED);
    __atomic_fetch_add(&r.seq, 1, __ATOMIC_RELEASE);
    if (op->wave > 1) {
      for (int k = 0; k < op->wave; k += r.nthreads) exec_part(op + k, slots, 0);
      i += op->wave - 1;
    } else for (int part = 0; part < op->parts; part += r.nthreads) exec_part(op, slots, part);
    unsigned spins = 0;
    while (__atomic_load_n(&r.done, __ATOMIC_ACQUIRE) != r.nthreads - 1) relax(&spins);
  }
  if (r.nthreads > 1) {
    __atomic_store_n(&r.cur, -1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&r.seq, 1, __ATOMIC_RELEASE);
    for (int t = 1; t < r.nthreads; t++) pthread_join(th[t], 0);
  }
  return status;
}
