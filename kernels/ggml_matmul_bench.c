// A micro-benchmark and kernel test of ggml's CPU matmuls on a deployment's real weights (#24).
//
// Built against one llama.cpp engine tree's static ggml libraries (stock's, or a candidate's rebuilt tree:
// costmodel/kernels.py compiles and runs it, in the sandbox for a candidate), it loads a GGUF, groups its
// 2-D weight tensors by (type, rows in, rows out) and, for each group and each width w, multiplies every
// tensor of the group by the same deterministic activations x[k, w] in one graph, the way a forward
// streams one layer's weights after another (so a small tensor is not timed hot in L1 alone).
//
//   ggml_matmul_bench MODEL.gguf --threads N --widths 1,2,4,8,16 [--min-ms 40] [--check] [--dump DIR]
//
// One JSON object per line: {"type", "k", "n", "count", "tensor", "width", "us" (median per tensor),
// "runs", "weight_bytes" (one tensor), "hash", "sum_abs"} per group and width, then one {"type": "forward",
// "width", "us", "runs"} per width: every group's matmuls in one graph, the whole model's weights streamed
// once per run as in a forward. The hash is FNV-1a 64 over every output float's bits, so a candidate kernel
// is bit-exact with stock exactly when the hashes are equal. `--check` runs each group once and skips the
// timing; `--dump DIR` writes each group's outputs at each width as raw float32
// (DIR/<type>-<k>x<n>-w<width>.f32, the group's tensors one after another) for a tolerance check.
// Exit status: 0; 2 for bad arguments; 3 when the model cannot be read; 4 when a dump cannot be written.

#include "ggml.h"
#include "ggml-cpu.h"
#include "gguf.h"

#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_GROUPS 64
#define MAX_PER_GROUP 512
#define MAX_WIDTHS 32

struct group {
    enum ggml_type type;
    int64_t k, n;
    int count;
    struct ggml_tensor * t[MAX_PER_GROUP];
};

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp_double(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

// Deterministic activations: a fixed LCG, roughly N(0, 1) by the sum of four uniforms, the same on
// every build so stock and candidate multiply the same numbers.
static void fill_activations(float * x, int64_t n, uint64_t seed) {
    uint64_t s = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    for (int64_t i = 0; i < n; i++) {
        float acc = 0.0f;
        for (int j = 0; j < 4; j++) {
            s = s * 6364136223846793005ULL + 1442695040888963407ULL;
            acc += (float) ((s >> 40) & 0xFFFFFF) / (float) 0x1000000 - 0.5f;
        }
        x[i] = acc * 1.7320508f;
    }
}

// The median time of one compute of `gf` in microseconds (after `warm` untimed runs: at least 5 runs and
// `min_ms` milliseconds); the number of runs in *runs.
static double median_us(struct ggml_cgraph * gf, struct ggml_cplan * plan, int warm, double min_ms, int * runs) {
    static double samples[100000];
    int n = 0;
    for (int r = 0; r < warm; r++) {
        ggml_graph_compute(gf, plan);
    }
    const double start = now_us();
    while (n < 100000 && (n < 5 || now_us() - start < min_ms * 1000.0)) {
        const double t0 = now_us();
        ggml_graph_compute(gf, plan);
        samples[n++] = now_us() - t0;
    }
    qsort(samples, n, sizeof(double), cmp_double);
    *runs = n;
    return samples[n / 2];
}

static int parse_widths(const char * s, int * out) {
    int n = 0;
    const char * p = s;
    while (*p) {
        char * end;
        const long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > 512 || n >= MAX_WIDTHS) {
            return -1;
        }
        out[n++] = (int) v;
        p = end;
        if (*p == ',') {
            p++;
        } else if (*p) {
            return -1;
        }
    }
    return n;
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.gguf [--threads N] [--widths 1,2,4] [--min-ms MS] [--check]\n", argv[0]);
        return 2;
    }
    const char * model = argv[1];
    int threads = 1;
    int widths[MAX_WIDTHS] = {1, 2, 4, 8, 16};
    int n_widths = 5;
    double min_ms = 40.0;
    int check = 0;
    const char * dump = NULL;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            threads = atoi(argv[++i]);
            if (threads < 1 || threads > 256) {
                fprintf(stderr, "bad --threads %s: give 1-256\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(argv[i], "--widths") && i + 1 < argc) {
            n_widths = parse_widths(argv[++i], widths);
            if (n_widths < 1) {
                fprintf(stderr, "bad --widths %s: give a comma-separated list of 1-512\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(argv[i], "--min-ms") && i + 1 < argc) {
            min_ms = atof(argv[++i]);
            if (!(min_ms > 0 && min_ms < 600000)) {
                fprintf(stderr, "bad --min-ms %s: give a positive number of milliseconds\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(argv[i], "--dump") && i + 1 < argc) {
            dump = argv[++i];
        } else if (!strcmp(argv[i], "--check")) {
            check = 1;
        } else {
            fprintf(stderr, "unknown argument %s\n", argv[i]);
            return 2;
        }
    }

    struct ggml_context * wctx = NULL;
    struct gguf_init_params gp = { /*.no_alloc =*/ false, /*.ctx =*/ &wctx };
    struct gguf_context * g = gguf_init_from_file(model, gp);
    if (!g || !wctx) {
        fprintf(stderr, "cannot read %s as a GGUF model\n", model);
        return 3;
    }

    static struct group groups[MAX_GROUPS];
    int n_groups = 0;
    for (struct ggml_tensor * t = ggml_get_first_tensor(wctx); t; t = ggml_get_next_tensor(wctx, t)) {
        if (ggml_n_dims(t) != 2 || t->type == GGML_TYPE_F32 || t->ne[1] < 8) {
            continue;  // norms and biases are not matmul weights
        }
        int gi = 0;
        for (; gi < n_groups; gi++) {
            if (groups[gi].type == t->type && groups[gi].k == t->ne[0] && groups[gi].n == t->ne[1]) {
                break;
            }
        }
        if (gi == n_groups) {
            if (n_groups == MAX_GROUPS) {
                continue;
            }
            groups[n_groups].type = t->type;
            groups[n_groups].k = t->ne[0];
            groups[n_groups].n = t->ne[1];
            groups[n_groups].count = 0;
            n_groups++;
        }
        if (groups[gi].count < MAX_PER_GROUP) {
            groups[gi].t[groups[gi].count++] = t;
        }
    }

    for (int gi = 0; gi < n_groups; gi++) {
        const struct group * gr = &groups[gi];
        for (int wi = 0; wi < n_widths; wi++) {
            const int w = widths[wi];
            const size_t mem = ggml_tensor_overhead() * (2 * gr->count + 8) + ggml_graph_overhead()
                + (size_t) gr->k * w * sizeof(float) + (size_t) gr->n * w * sizeof(float) * gr->count + (1 << 20);
            struct ggml_init_params ip = { mem, NULL, false };
            struct ggml_context * ctx = ggml_init(ip);
            struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, gr->k, w);
            fill_activations((float *) x->data, gr->k * w, (uint64_t) (gr->k * 1000003 + w));
            struct ggml_cgraph * gf = ggml_new_graph(ctx);
            struct ggml_tensor * y[MAX_PER_GROUP];
            for (int j = 0; j < gr->count; j++) {
                y[j] = ggml_mul_mat(ctx, gr->t[j], x);
                ggml_build_forward_expand(gf, y[j]);
            }
            struct ggml_cplan plan = ggml_graph_plan(gf, threads, NULL);
            uint8_t * work = plan.work_size ? malloc(plan.work_size) : NULL;
            plan.work_data = work;

            int runs = 0;
            double us = 0.0;  // per tensor of the group
            if (check) {
                ggml_graph_compute(gf, &plan);
            } else {
                us = median_us(gf, &plan, 3, min_ms, &runs) / gr->count;
            }

            uint64_t h = 1469598103934665603ULL;
            double sum_abs = 0.0;
            for (int j = 0; j < gr->count; j++) {
                const float * v = (const float *) y[j]->data;
                for (int64_t i = 0; i < gr->n * w; i++) {
                    uint32_t bits;
                    memcpy(&bits, &v[i], sizeof bits);
                    for (int b = 0; b < 4; b++) {
                        h ^= (bits >> (8 * b)) & 0xFF;
                        h *= 1099511628211ULL;
                    }
                    sum_abs += fabs((double) v[i]);
                }
            }
            if (dump) {
                char path[4096];
                snprintf(path, sizeof path, "%s/%s-%" PRId64 "x%" PRId64 "-w%d.f32", dump, ggml_type_name(gr->type),
                         gr->k, gr->n, w);
                FILE * f = fopen(path, "wb");
                if (!f) {
                    fprintf(stderr, "cannot write %s\n", path);
                    return 4;
                }
                for (int j = 0; j < gr->count; j++) {
                    fwrite(y[j]->data, sizeof(float), (size_t) (gr->n * w), f);
                }
                fclose(f);
            }
            printf("{\"type\": \"%s\", \"k\": %" PRId64 ", \"n\": %" PRId64 ", \"count\": %d, \"tensor\": \"%s\", "
                   "\"width\": %d, \"us\": %.3f, \"runs\": %d, \"weight_bytes\": %zu, \"hash\": \"%016" PRIx64 "\", "
                   "\"sum_abs\": %.6e}\n",
                   ggml_type_name(gr->type), gr->k, gr->n, gr->count, ggml_get_name(gr->t[0]), w,
                   us, runs, ggml_nbytes(gr->t[0]), h, sum_abs);
            fflush(stdout);
            free(work);
            ggml_free(ctx);
        }
    }
    // The whole forward's matmuls in one graph at each width: every weight streams once per run, as in a
    // real forward (a group alone may stay in a cache the whole model does not fit in).
    for (int wi = 0; wi < n_widths && !check; wi++) {
        const int w = widths[wi];
        size_t mem = ggml_graph_overhead_custom(4096, false) + (1 << 20);
        int n_nodes = 0;
        for (int gi = 0; gi < n_groups; gi++) {
            mem += ggml_tensor_overhead() * (groups[gi].count + 1) + (size_t) groups[gi].k * w * sizeof(float)
                 + (size_t) groups[gi].n * w * sizeof(float) * groups[gi].count;
            n_nodes += groups[gi].count + 1;
        }
        struct ggml_init_params ip = { mem, NULL, false };
        struct ggml_context * ctx = ggml_init(ip);
        struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, 4096, false);
        if (n_nodes > 4000) {
            fprintf(stderr, "too many weight tensors for one graph (%d)\n", n_nodes);
            return 3;
        }
        for (int gi = 0; gi < n_groups; gi++) {
            struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, groups[gi].k, w);
            fill_activations((float *) x->data, groups[gi].k * w, (uint64_t) (groups[gi].k * 1000003 + w));
            for (int j = 0; j < groups[gi].count; j++) {
                ggml_build_forward_expand(gf, ggml_mul_mat(ctx, groups[gi].t[j], x));
            }
        }
        struct ggml_cplan plan = ggml_graph_plan(gf, threads, NULL);
        uint8_t * work = plan.work_size ? malloc(plan.work_size) : NULL;
        plan.work_data = work;
        int runs = 0;
        const double us = median_us(gf, &plan, 2, min_ms, &runs);
        printf("{\"type\": \"forward\", \"width\": %d, \"us\": %.3f, \"runs\": %d}\n", w, us, runs);
        fflush(stdout);
        free(work);
        ggml_free(ctx);
    }
    gguf_free(g);
    ggml_free(wctx);
    return 0;
}
