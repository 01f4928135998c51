// The hardware bound for experiments/bench/ring.py: the same two-process
// transfer as the shared-memory ring, written in C with no interpreter (and,
// in its plain modes, no checksum), so that what it cannot reach no Python
// ring can.
//
//   ring_native SIZE LANE_BYTES COUNT MODE     (MODE: copy | view)
//
// Built with -DRING_NATIVE_XXH3 and xxhash.h on the include path, MODE may
// also be copy_xxh3 | view_xxh3: the ring's own checksum, at native speed and
// fused with the copies (16 KiB chunks hashed while in L1): the producer
// hashes each chunk of the payload and copies it into the lane, the consumer
// copies each chunk out and hashes the copy (copy_xxh3) or hashes the record
// in place (view_xxh3), and compares with the producer's digest.
//
// A producer process (fork) copies a page-aligned random payload of SIZE bytes
// into slots of a MAP_SHARED lane of LANE_BYTES (records 64-byte aligned after
// a 64-byte header, as in sao_jax/ipc/ring.py) and publishes each with a
// release store of `head`; the consumer waits on `head` (sched_yield, as the
// ring's first waits do), then either copies the record out into a private
// buffer (`copy`, like RingReader.read()) or reads every byte in place
// (`view`, the bound of a zero-copy consumer whose checksum reads every
// byte), and
// frees it with a release store of `tail`. One untimed pass over the lane
// first (page faults). The consumer checks every record's sequence number and
// its bytes: the 64-bit word sum of each record (view), of the last copy
// (copy), or the producer's XXH3 digest (*_xxh3). Prints one JSON object:
// {"seconds": wall time of the COUNT timed records,
//  "consumer_cpu_s": ..., "producer_cpu_s": ...}; exits 1 on a wrong byte.

#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifdef RING_NATIVE_XXH3
#define XXH_INLINE_ALL
#include "xxhash.h"

enum { kChunk = 16384 };

// XXH3-64 of src[0:n), copied to dst on the way (each chunk hashed, then
// copied while it is in L1). hash_dst: hash the copy instead of the source.
static uint64_t copy_xxh3(uint8_t* dst, const uint8_t* src, size_t n,
                          int hash_dst) {
  XXH3_state_t st;
  XXH3_64bits_reset(&st);
  for (size_t o = 0; o < n; o += kChunk) {
    size_t k = n - o < kChunk ? n - o : kChunk;
    if (!hash_dst) XXH3_64bits_update(&st, src + o, k);
    memcpy(dst + o, src + o, k);
    if (hash_dst) XXH3_64bits_update(&st, dst + o, k);
  }
  return XXH3_64bits_digest(&st);
}
#endif

typedef struct {
  _Alignas(128) uint64_t head;  // Written by the producer only.
  _Alignas(128) uint64_t tail;  // Written by the consumer only.
  _Alignas(128) uint64_t go;
  double producer_cpu_s;
} Control;

static double clock_s(clockid_t id) {
  struct timespec t;
  clock_gettime(id, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t word_sum(const uint8_t* p, size_t n) {
  const uint64_t* w = (const uint64_t*)p;
  uint64_t s = 0;
  for (size_t i = 0; i < n / 8; i++) s += w[i];
  for (size_t i = n / 8 * 8; i < n; i++) s += p[i];
  return s;
}

static uint64_t load(uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static void store(uint64_t* p, uint64_t v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

int main(int argc, char** argv) {
  const char* modes[] = {"copy", "view", "copy_xxh3", "view_xxh3"};
  int mode = -1;
  for (int m = 0; argc == 5 && m < 4; m++) {
    if (!strcmp(argv[4], modes[m])) mode = m;
  }
#ifndef RING_NATIVE_XXH3
  if (mode >= 2) mode = -1;
#endif
  if (mode < 0) {
    fprintf(stderr, "usage: %s SIZE LANE_BYTES COUNT copy|view"
#ifdef RING_NATIVE_XXH3
            "|copy_xxh3|view_xxh3"
#endif
            "\n", argv[0]);
    return 2;
  }
  size_t size = strtoull(argv[1], 0, 10), lane = strtoull(argv[2], 0, 10);
  uint64_t count = strtoull(argv[3], 0, 10);
  const int copy = mode == 0 || mode == 2, hashed = mode >= 2;
  size_t stride = (64 + size + 63) & ~(size_t)63;
  uint64_t slots = lane / stride;
  if (size == 0 || slots < 2) {
    fprintf(stderr, "LANE_BYTES must hold >= 2 records of SIZE\n");
    return 2;
  }
  Control* ctl = mmap(0, sizeof(Control), PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  uint8_t* data = mmap(0, slots * stride, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  uint8_t* payload = aligned_alloc(4096, (size + 4095) & ~(size_t)4095);
  uint8_t* out = aligned_alloc(4096, (size + 4095) & ~(size_t)4095);
  if (ctl == MAP_FAILED || data == MAP_FAILED || !payload || !out) {
    perror("allocation");
    return 2;
  }
  memset(ctl, 0, sizeof(Control));
  srand(0);
  for (size_t i = 0; i < size; i++) payload[i] = (uint8_t)rand();
  memset(out, 0, size);
  const uint64_t want = word_sum(payload, size);
  const uint64_t warm = slots, total = warm + count;

  pid_t pid = fork();
  if (pid == 0) {  // Producer.
    double c0 = 0;
    for (uint64_t i = 0; i < total; i++) {
      if (i == warm) {
        while (!load(&ctl->go)) sched_yield();
        c0 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
      }
      while (i - load(&ctl->tail) >= slots) sched_yield();  // Full.
      uint8_t* rec = data + (i % slots) * stride;
      uint64_t digest = 0;
#ifdef RING_NATIVE_XXH3
      if (hashed) digest = copy_xxh3(rec + 64, payload, size, 0);
#endif
      if (!hashed) memcpy(rec + 64, payload, size);
      memcpy(rec, &i, sizeof i);
      memcpy(rec + 8, &digest, sizeof digest);
      store(&ctl->head, i + 1);  // The commit.
    }
    ctl->producer_cpu_s = clock_s(CLOCK_PROCESS_CPUTIME_ID) - c0;
    _exit(0);
  }
  double t0 = 0, c0 = 0;
  int bad = 0;
  for (uint64_t i = 0; i < total; i++) {
    if (i == warm) {
      t0 = clock_s(CLOCK_MONOTONIC);
      c0 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
      store(&ctl->go, 1);
    }
    while (load(&ctl->head) == i) sched_yield();  // Empty.
    const uint8_t* rec = data + (i % slots) * stride;
    uint64_t seq, digest;
    memcpy(&seq, rec, sizeof seq);
    memcpy(&digest, rec + 8, sizeof digest);
    (void)digest;
    if (hashed) {
#ifdef RING_NATIVE_XXH3
      uint64_t got = copy ? copy_xxh3(out, rec + 64, size, 1)
                          : XXH3_64bits(rec + 64, size);
      bad |= seq != i || got != digest;
#endif
    } else if (copy) {
      memcpy(out, rec + 64, size);
      bad |= seq != i || (i + 1 == total && word_sum(out, size) != want);
    } else {
      bad |= seq != i || word_sum(rec + 64, size) != want;
    }
    store(&ctl->tail, i + 1);
  }
  double wall = clock_s(CLOCK_MONOTONIC) - t0;
  double cpu = clock_s(CLOCK_PROCESS_CPUTIME_ID) - c0;
  int status = 0;
  waitpid(pid, &status, 0);
  if (bad || !WIFEXITED(status) || WEXITSTATUS(status)) {
    fprintf(stderr, "ring_native: wrong bytes or producer failed\n");
    return 1;
  }
  printf("{\"seconds\": %.9f, \"consumer_cpu_s\": %.9f, "
         "\"producer_cpu_s\": %.9f}\n", wall, cpu, ctl->producer_cpu_s);
  return 0;
}
