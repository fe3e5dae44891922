/* A linked list kept in recoverable memory. Nodes come from a bump heap in one segment and
 * point at each other with plain pointers, which stay valid across recovery because the
 * segment comes back at the same address.
 *
 *   list BACKEND add N     append nodes 1..N (continuing after recovery), one commit each,
 *                          printing "added K" after each commit returns
 *   list BACKEND check     print "count C sum S head H" of the recovered list
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "rvm.h"

#define HEAP_BYTES (1 << 20)

struct node {
    int64_t value;
    struct node *next;
};

struct heap {
    uint64_t used; /* bytes handed out after this header */
    int64_t count;
};

static int die(const char *what) {
    fprintf(stderr, "list: %s: %s\n", what, rvm_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: list BACKEND add N | check\n");
        return 2;
    }
    rvm_cfg_t *cfg = rvm_cfg_create(argv[1], "clist", 1);
    if (!cfg) return die("rvm_cfg_create");
    struct heap *heap = rvm_segment(cfg, "heap");
    if (!heap) {
        heap = rvm_alloc(cfg, "heap", HEAP_BYTES);
        if (!heap) return die("rvm_alloc");
    }
    if (strcmp(argv[2], "check") == 0) {
        int64_t count = 0, sum = 0, expect = heap->count;
        for (struct node *n = rvm_get_root(cfg); n; n = n->next) {
            if (n->value != expect - count) {
                printf("broken at %lld: value %lld\n", (long long)count, (long long)n->value);
                return 3;
            }
            count++;
            sum += n->value;
        }
        printf("count %lld sum %lld head %lld\n", (long long)count, (long long)sum,
               (long long)heap->count);
        rvm_cfg_destroy(cfg);
        return 0;
    }
    if (strcmp(argv[2], "add") != 0 || argc < 4) return 2;
    long n = atol(argv[3]);
    for (long i = 0; i < n; i++) {
        rvm_txn_t *t = rvm_txn_begin(cfg);
        if (!t) return die("rvm_txn_begin");
        struct node *node = (struct node *)((char *)(heap + 1) + heap->used);
        if ((char *)(node + 1) > (char *)heap + HEAP_BYTES) {
            fprintf(stderr, "list: heap full\n");
            return 1;
        }
        if (rvm_set_range(t, heap, sizeof *heap) || rvm_set_range(t, node, sizeof *node))
            return die("rvm_set_range");
        node->value = heap->count + 1;
        node->next = rvm_get_root(cfg);
        heap->used += sizeof *node;
        heap->count += 1;
        if (rvm_set_root(t, node)) return die("rvm_set_root");
        if (rvm_txn_commit(t)) return die("rvm_txn_commit");
        printf("added %lld\n", (long long)heap->count);
        fflush(stdout);
    }
    rvm_cfg_destroy(cfg);
    return 0;
}
