/* Far memory from C: a region four or more times larger than its local memory, used as
 * plain memory. Writes a pattern over every 64-bit word, then reads every word back
 * (backwards, so the pages come from the server rather than from the ones still local)
 * and counts the words that differ.
 *
 *   pattern SERVER BYTES LOCAL_BYTES [POLICY [PREFETCH]]
 *
 * prints "words W wrong X faults F evictions E written_back B read_bytes R" and exits 0
 * when no word is wrong, 3 when some are. Built with -DCHECK_WRONG_PATTERN it checks
 * against a pattern it did not write: the test that runs it uses that to show its check
 * can fail. The token comes from CAMELOT_TOKEN, if set.
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "farmem.h"

static uint64_t pattern(uint64_t i) {
    uint64_t x = i * 0x9E3779B97F4A7C15ull;
    return x ^ (x >> 29);
}

static uint64_t expected(uint64_t i) {
#ifdef CHECK_WRONG_PATTERN
    return pattern(i) ^ (i == 12345);
#else
    return pattern(i);
#endif
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: pattern SERVER BYTES LOCAL_BYTES [POLICY [PREFETCH]]\n");
        return 2;
    }
    size_t bytes = strtoull(argv[2], NULL, 10);
    size_t local = strtoull(argv[3], NULL, 10);
    farmem_region_t *r = farmem_open(argv[1], getenv("CAMELOT_TOKEN"), bytes, local,
                                     argc > 4 ? argv[4] : NULL, argc > 5 ? argv[5] : NULL);
    if (!r) {
        fprintf(stderr, "pattern: farmem_open: %s\n", farmem_last_error());
        return 1;
    }
    uint64_t *words = farmem_addr(r);
    uint64_t n = farmem_len(r) / sizeof(uint64_t);
    for (uint64_t i = 0; i < n; i++) words[i] = pattern(i);
    uint64_t wrong = 0;
    for (uint64_t i = n; i-- > 0;)
        if (words[i] != expected(i)) wrong++;
    farmem_stats_t s;
    if (farmem_stats(r, &s) != 0) {
        fprintf(stderr, "pattern: farmem_stats: %s\n", farmem_last_error());
        return 1;
    }
    printf("words %" PRIu64 " wrong %" PRIu64 " faults %" PRIu64 " evictions %" PRIu64
           " written_back %" PRIu64 " read_bytes %" PRIu64 "\n",
           n, wrong, s.missing_faults, s.evictions, s.written_back, s.read_bytes);
    if (farmem_close(r) != 0) {
        fprintf(stderr, "pattern: farmem_close: %s\n", farmem_last_error());
        return 1;
    }
    return wrong == 0 ? 0 : 3;
}
