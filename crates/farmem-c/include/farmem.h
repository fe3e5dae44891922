/* Camelot far memory: the C API (libfarmem_c.so / libfarmem_c.a).
 *
 * farmem_open maps `bytes` of this process's address space whose pages live in a region
 * on a Camelot memory server. The pointer farmem_addr returns is ordinary memory: loads
 * and stores work on it directly, unmodified code can take it. At most `local_bytes` of
 * it is present at once; touching a page that is not present blocks the thread while a
 * fault handler brings the page from the server (evicting another, written back first if
 * it was changed). The region is private to the process and freed with it: it is memory,
 * not storage.
 *
 * If the server fails, a fault cannot be served and the faulting thread gets SIGBUS (as
 * from a failed swap-in); farmem_flush and farmem_close then return -1 with the reason.
 * Functions returning int give 0 on success and -1 on failure; pointer-returning ones
 * give NULL. farmem_last_error() then describes the failure (per thread). Needs
 * userfaultfd: root, CAP_SYS_PTRACE, access to /dev/userfaultfd or
 * vm.unprivileged_userfaultfd=1 (the error says which).
 */
#ifndef CAMELOT_FARMEM_H
#define CAMELOT_FARMEM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct farmem_region farmem_region_t;

typedef struct farmem_stats {
    uint64_t missing_faults; /* faults that read a page from the server */
    uint64_t write_faults;   /* first writes to a present page */
    uint64_t prefetched;     /* pages brought ahead of use */
    uint64_t evictions;
    uint64_t written_back;   /* changed pages written to the server */
    uint64_t read_bytes;     /* bytes read from the server */
    uint64_t written_bytes;  /* bytes written to the server */
} farmem_stats_t;

/* server: "HOST:PORT" of a memory server. token: the cluster token, or NULL for none.
 * bytes: the region's size (rounded up to 4 KiB pages, at most 1 TiB). local_bytes:
 * local memory for its pages (at least one page). policy: eviction policy ("lru",
 * "clock", "fifo", "random", "s3fifo", "arc") or NULL for clock; prefetch: "none",
 * "sequential", "trend" or NULL for sequential. The bytes start as zeros. */
farmem_region_t *farmem_open(const char *server, const char *token, size_t bytes,
                             size_t local_bytes, const char *policy, const char *prefetch);
/* The region's first byte (page-aligned) and its length in bytes. */
void *farmem_addr(farmem_region_t *region);
size_t farmem_len(farmem_region_t *region);
/* Writes every changed page to the server. */
int farmem_flush(farmem_region_t *region);
int farmem_stats(farmem_region_t *region, farmem_stats_t *out);
/* Unmaps the region and frees its pages on the server; no byte of it may be touched
 * afterwards. Returns -1 if the region had failed (the memory is released either way). */
int farmem_close(farmem_region_t *region);

const char *farmem_last_error(void);

#ifdef __cplusplus
}
#endif

#endif
