/* tdist_tcp.shared._shmfast's reductions (included by _shmfast.c, its one translation unit):
 * out := in0 op in1 op ... in rank order, for the element types and operators below, with
 * numpy's rules, tile by tile. Needs TILE_BYTES and the T_ and O_ codes of _shmfast.c. */
#ifndef TDIST_SHMFAST_REDUCE_H
#define TDIST_SHMFAST_REDUCE_H

/* numpy's (so the Python steps and these agree bit for bit): a NaN wins, and of two equal
 * values (-0.0 and 0.0) the second */
#define MIN_OF(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))
#define MAX_OF(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))

/* out := in0 op in1 op ... in rank order (every rank computes the same bits); out overlaps
 * none of the inputs */
#define ARITH(T, EXPR)                                                     \
    do {                                                                   \
        T *restrict o_ = (T *)out;                                         \
        const T *restrict a0_ = (const T *)ins[0];                         \
        if (p == 1) {                                                      \
            memcpy(o_, a0_, n * sizeof(T));                                \
            break;                                                         \
        }                                                                  \
        const T *restrict a1_ = (const T *)ins[1];                         \
        for (Py_ssize_t i = 0; i < n; i++) {                               \
            T a = a0_[i], b = a1_[i];                                      \
            o_[i] = (EXPR);                                                \
        }                                                                  \
        for (int q = 2; q < p; q++) {                                      \
            const T *restrict x_ = (const T *)ins[q];                      \
            for (Py_ssize_t i = 0; i < n; i++) {                           \
                T a = o_[i], b = x_[i];                                    \
                o_[i] = (EXPR);                                            \
            }                                                              \
        }                                                                  \
    } while (0)

#define FLOAT_CASES(T)                                                                  \
    switch (eop) {                                                                      \
    case O_SUM: case O_AVG: ARITH(T, a + b); break;                  \
    case O_PRODUCT: ARITH(T, a * b); break;                          \
    case O_MIN: ARITH(T, MIN_OF(a, b)); break;                       \
    case O_MAX: ARITH(T, MAX_OF(a, b)); break;                       \
    default: return 0;                                                                  \
    }                                                                                   \
    if (eop == O_AVG) {                                                                 \
        T *o = (T *)out;                                                                \
        for (Py_ssize_t i = 0; i < n; i++) o[i] = o[i] / (T)p;                         \
    }                                                                                   \
    return 1;

/* integers wrap like numpy's and torch's: the arithmetic is done unsigned */
#define INT_CASES(T, U)                                                                 \
    switch (eop) {                                                                      \
    case O_SUM: ARITH(T, (T)((U)a + (U)b)); break;                   \
    case O_PRODUCT: ARITH(T, (T)((U)a * (U)b)); break;               \
    case O_MIN: ARITH(T, a < b ? a : b); break;                      \
    case O_MAX: ARITH(T, a > b ? a : b); break;                      \
    case O_BAND: ARITH(T, a & b); break;                             \
    case O_BOR: ARITH(T, a | b); break;                              \
    case O_BXOR: ARITH(T, a ^ b); break;                             \
    default: return 0;                                                                  \
    }                                                                                   \
    return 1;

static int reduce(int etype, int eop, char *out, char **ins, int p, Py_ssize_t n) {
    switch (etype) {
    case T_F32: { FLOAT_CASES(float) }
    case T_F64: { FLOAT_CASES(double) }
    case T_I8: { INT_CASES(int8_t, uint8_t) }
    case T_U8: { INT_CASES(uint8_t, uint8_t) }
    case T_I16: { INT_CASES(int16_t, uint16_t) }
    case T_I32: { INT_CASES(int32_t, uint32_t) }
    case T_I64: { INT_CASES(int64_t, uint64_t) }
    }
    return 0;
}

static int element_size(int etype) {
    switch (etype) {
    case T_F32: case T_I32: return 4;
    case T_F64: case T_I64: return 8;
    case T_I16: return 2;
    case T_I8: case T_U8: return 1;
    }
    return 0;
}

/* Whether reduce() applies eop to etype (AVG only to floats, bitwise operators only to integers). */
static int reducible(int etype, int eop) {
    int is_float = etype == T_F32 || etype == T_F64;
    return element_size(etype) && eop >= O_SUM && eop <= O_AVG && !(eop == O_AVG && !is_float) &&
           !(is_float && eop >= O_BAND && eop <= O_BXOR);
}

/* reduce() tile by tile, each small enough that its p inputs and its result stay in the
 * first-level cache: one pass over the inputs from memory, whatever p is. ``also`` (NULL:
 * none) gets a copy of the result while it is still in the cache. */
static void reduce_tiled(int etype, int eop, char *out, char *also, char **ins, int p, Py_ssize_t n) {
    Py_ssize_t es = element_size(etype), tile = TILE_BYTES / es;
    char *at[p];
    for (Py_ssize_t i = 0; i < n; i += tile) {
        Py_ssize_t m = n - i < tile ? n - i : tile;
        for (int q = 0; q < p; q++) at[q] = ins[q] + i * es;
        reduce(etype, eop, out + i * es, at, p, m);
        if (also) memcpy(also + i * es, out + i * es, m * es);
    }
}

#endif
