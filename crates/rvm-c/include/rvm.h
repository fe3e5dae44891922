/* Camelot recoverable virtual memory: the C API (librvm_c.so / librvm_c.a).
 *
 * Segments are mapped at the same virtual address in every process that recovers them,
 * so pointers stored inside recoverable memory stay valid. Declare bytes with
 * rvm_set_range before writing them; rvm_txn_commit returns once the backend holds them:
 * in the memory of the pool server(s) (surviving this process's crash and, mirrored, the
 * loss of one server), acknowledged by Redis (its AOF/fsync settings decide power-loss
 * survival), or fsync'd to the file.
 * Functions returning int give 0 on success and -1 on failure; pointer-returning ones
 * give NULL. rvm_last_error() then describes the failure (per thread).
 */
#ifndef CAMELOT_RVM_H
#define CAMELOT_RVM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rvm_cfg rvm_cfg_t;
typedef struct rvm_txn rvm_txn_t;

/* backend: "pool://HOST:PORT[,HOST:PORT]", "redis://HOST:PORT" or "file:///DIR".
 * name: the instance on that backend ([A-Za-z0-9._-], at most 64 bytes).
 * recover: non-zero brings every segment back at its old address; zero starts empty. */
rvm_cfg_t *rvm_cfg_create(const char *backend, const char *name, int recover);
void rvm_cfg_destroy(rvm_cfg_t *cfg);

/* A new zeroed, page-aligned segment of at least `bytes`, committed to the backend on
 * return. */
void *rvm_alloc(rvm_cfg_t *cfg, const char *tag, size_t bytes);
/* The segment tagged `tag` (e.g. after recovery), or NULL. */
void *rvm_segment(rvm_cfg_t *cfg, const char *tag);

rvm_txn_t *rvm_txn_begin(rvm_cfg_t *cfg);
/* Declares [addr, addr + len) of one segment about to change. */
int rvm_set_range(rvm_txn_t *txn, void *addr, size_t len);
/* Frees the segment starting at `segment` when the transaction commits. */
int rvm_free(rvm_txn_t *txn, void *segment);
/* Both end the transaction and release `txn`. */
int rvm_txn_commit(rvm_txn_t *txn);
void rvm_txn_abort(rvm_txn_t *txn);

/* A root pointer to find data after recovery; set it inside a transaction. */
int rvm_set_root(rvm_txn_t *txn, void *root);
void *rvm_get_root(rvm_cfg_t *cfg);

const char *rvm_last_error(void);

#ifdef __cplusplus
}
#endif

#endif
