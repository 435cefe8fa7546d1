/* Private to kernels/: the safetensors reader, the thread pool and the CPU kernels. */
#pragma once

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- safetensors ------------------------------------------------------------------------ */

/* F8_E4M3: float8_e4m3fn (bias 7, no infinities, 0x7f and 0xff NaN), only as the weight
 * of a linear layer with a per-128x128-block F32 weight_scale_inv beside it. */
enum ro_dtype { RO_F32, RO_BF16, RO_F16, RO_F8E4M3 };

struct ro_tensor {
	char *name;
	enum ro_dtype dtype;
	uint32_t ndim;
	uint64_t shape[4];
	const void *data; /* inside a mapping, checked to lie within its file */
	uint64_t begin, bytes; /* in the file's data section */
	uint32_t file;	       /* which file of the set */
};

struct ro_st_set; /* every tensor of a model directory, mapped */

/* Map a directory's model.safetensors, or the shards its index names. */
int ro_st_open_dir(const char *dir, struct ro_st_set **ret, char *err, size_t errlen);
struct ro_st_set *ro_st_free(struct ro_st_set *s);
const struct ro_tensor *ro_st_find(const struct ro_st_set *s, const char *name);
size_t ro_st_count(const struct ro_st_set *s);
/* Tensors by position (sorted by name), a tensor's position, and its file's name. */
const struct ro_tensor *ro_st_at(const struct ro_st_set *s, size_t i);
size_t ro_st_index(const struct ro_st_set *s, const struct ro_tensor *t);
const char *ro_st_file(const struct ro_st_set *s, const struct ro_tensor *t);
/* A tensor's bytes read (pread) from the file it is mapped from into dst: for a copy, at
 * a fraction of the cost of faulting the mapping in 4 KiB at a time. */
int ro_st_read(const struct ro_st_set *s, const struct ro_tensor *t, void *dst);

size_t ro_dtype_size(enum ro_dtype t);

/* A regular file of at most max bytes read whole, NUL-terminated (a FIFO, a device or a
 * larger file is refused, and nothing blocks). */
int ro_read_small(const char *path, size_t max, char **ret, size_t *ret_len, char *err,
		  size_t errlen);
struct json_object;
/* text[0..len) as one JSON object; `what` names it in the messages. */
int ro_parse_json_object(const char *what, const char *text, size_t len, struct json_object **ret,
			 char *err, size_t errlen);
int ro_errf(char *err, size_t errlen, int r, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static inline float ro_bf16_to_f32(uint16_t h)
{
	union {
		uint32_t u;
		float f;
	} v = {.u = (uint32_t)h << 16};
	return v.f;
}

static inline uint16_t ro_f32_to_bf16(float f)
{
	union {
		float f;
		uint32_t u;
	} v = {.f = f};
	/* round to nearest even; NaN stays NaN */
	if ((v.u & 0x7fffffff) > 0x7f800000)
		return (uint16_t)((v.u >> 16) | 0x40);
	return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

/* float8_e4m3fn as f32, exactly: the seven low bits placed as an f32's exponent and
 * mantissa (bias 127 - 120) and scaled by 2^120, which also gets the subnormals right; NaN
 * codes are refused at load, so they never reach this. */
static inline float ro_f8e4m3_to_f32(uint8_t b)
{
	union {
		uint32_t u;
		float f;
	} v = {.u = (uint32_t)(b & 0x7f) << 20};
	float f = v.f * 0x1p120f;

	return b & 0x80 ? -f : f;
}

/* e4m3fn's seven low bits (0-127) as bf16's high byte (less the sign) and low byte: exact
 * (4 significant bits, 2^-9 to 448), for the VPERMI2B table lookups of amx.c and gemm.c.
 * Filled once by ro_f8_bf16_tables(). */
extern uint8_t ro_f8_bf16_hi[128], ro_f8_bf16_lo[128];
void ro_f8_bf16_tables(void);

/* FP8 block size of weight_scale_inv (rows and columns), the only one implemented */
#define RO_FP8_BLOCK 128

float ro_f16_to_f32(uint16_t h);
uint16_t ro_f32_to_f16(float f);

/* ---- thread pool -------------------------------------------------------------------------- */

struct ro_pool;
int ro_pool_new(uint32_t threads, struct ro_pool **ret);
struct ro_pool *ro_pool_free(struct ro_pool *p);
uint32_t ro_pool_size(const struct ro_pool *p);
/* fn(arg, i) for i in [0, n), spread over the pool; returns when all are done. */
void ro_pool_for(struct ro_pool *p, uint32_t n, void (*fn)(void *arg, uint32_t i), void *arg);
/* This thread's scratch of at least `bytes` (64-byte aligned), kept between calls and freed
 * at thread exit; NULL without the memory. One user at a time: the matrix kernels (AMX's
 * packed activations, the AVX-512 panels packed from row-major weights). */
void *ro_thread_scratch(size_t bytes);
/* malloc for a large scratch buffer: the 2 MiB-aligned part of it asked for transparent
 * huge pages, so that its first touch faults a page per 2 MiB, not per 4 KiB (the first
 * 4,096-token prefill of a process: 77,600-77,800 page faults -> 1,650-1,700) */
void *ro_malloc_huge(size_t bytes);
#define RO_HUGE_PAGE ((size_t)2 << 20) /* a transparent huge page (x86-64; arm64 with 4 KiB pages) */
/* len bytes (whole pages) of anonymous memory from a 2 MiB boundary, `before` bytes (whole
 * pages) mapped just below it, the len advised MADV_HUGEPAGE (*madv_err, if given: 0, or
 * madvise's errno: the memory is there either way). NULL with errno set without the
 * memory. munmap(p - before, before + len) gives it back. */
void *ro_map_huge(size_t len, size_t before, int *madv_err);

/* ---- CPU kernels ---------------------------------------------------------------------------- */

/* A weight matrix [rows][cols], row-major as Hugging Face stores nn.Linear (out, in). */
struct ro_mat {
	const void *w;
	enum ro_dtype dtype; /* F32, BF16 or F8E4M3 (F16 is widened at load) */
	uint32_t rows, cols;
	/* F8E4M3: W[r][k] = w[r][k] * scale[(r / 128) * scale_cols + k / 128], in f32 */
	const float *scale;
	uint32_t scale_cols;
	/* the tensors w and scale are, in place in their mapping; NULL once copied or owned
	 * (the loader's huge pages) */
	const struct ro_tensor *src, *src_scale;
	/* in 16-row panels (ro_panel_pack) rather than row-major; set by the loader's copy
	 * when ro_panel_wanted */
	bool panel;
};

/* y[t][r0..r1) = W[r0..r1) . x[t] for t < T. Every (row, token) dot product runs the same
 * instructions in the same order whatever T, r0 and r1 are: batch invariance rests here. */
void ro_gemm_rows(const struct ro_mat *W, const float *x, uint32_t T, float *y, uint32_t ldy,
		  uint32_t r0, uint32_t r1);
/* The same for rows anywhere: token t's input is x[t] (cols floats), its output row y[t]
 * (y[t][r] for r in [r0, r1)). The expert layer runs its tokens in place this way. */
void ro_gemm_ptrs(const struct ro_mat *W, const float *const *x, uint32_t T, float *const *y,
		  uint32_t r0, uint32_t r1);
bool ro_cpu_has_avx2(void);
void ro_kernels_force_scalar(bool scalar);
const char *ro_kernels_name(void);
/* The AVX2 kernels are in use (the CPU has them and the portable ones are not forced). */
bool ro_kernels_avx2(void);
/* The AVX-512 kernels are in use. */
bool ro_kernels_avx512(void);
/* AMX-BF16 runs the bf16 and FP8 matrices it fits (kernels/cpu/amx.c). */
bool ro_kernels_amx(void);
/* The CPU has AMX-BF16 (and AVX512-BF16) and the kernel granted this process its tile
 * state. */
bool ro_amx_available(void);
/* W runs on AMX when it is in use: row-major bf16, or FP8 with its block scales; inputs a
 * multiple of 32, at least 16 rows. (AMX is used only where the CPU also has AVX512-VBMI,
 * for FP8's byte tables: every AMX CPU has it.) */
bool ro_amx_fits(const struct ro_mat *W);
/* W runs on AMX (weights as B tiles) when it is in use: in panels, bf16 or FP8 with its
 * block scales, inputs a multiple of 32 (as ro_amx_fits for the same matrix row-major). */
bool ro_amx_panel_fits(const struct ro_mat *W);
/* The AVX-512 kernels run W faster in panels: 16 rows at a time, each 32-bit word the
 * next 4 bytes of one row (two BF16 or four F8E4M3 inputs), word (p, q, i) = bytes
 * [4q, 4q + 4) of row 16p + i, so one 64-byte load is 16 rows x 2 or 4 inputs, widened in
 * registers and summed with broadcast inputs, no horizontal sums. Wanted for a row-major
 * BF16 (FP8) matrix of rows a multiple of 16 and cols of 2 (4) when the AVX-512 kernels
 * are in use, with or without AMX (which runs the panels it fits itself). */
bool ro_panel_wanted(const struct ro_mat *W);
/* src (row-major rows x cols elements of es bytes) into dst in panels. */
void ro_panel_pack(const void *src, uint32_t rows, uint32_t cols, size_t es, void *dst);
/* The row-major index of element i of a panelled rows x cols matrix of es-byte elements. */
uint64_t ro_panel_index(uint64_t i, uint32_t cols, size_t es);
/* ro_gemm_ptrs on AMX (row-major or in panels); -1 (nothing written) when its packing
 * buffer cannot be had. */
int ro_gemm_amx(const struct ro_mat *W, const float *const *x, uint32_t T, float *const *y,
		uint32_t r0, uint32_t r1);
/* Two matrices of the same shape on the same inputs (an expert's gate and up), the inputs
 * prepared once; -1 as ro_gemm_amx. */
int ro_gemm_amx2(const struct ro_mat *W1, const struct ro_mat *W2, const float *const *x,
		 uint32_t T, float *const *y1, float *const *y2, uint32_t r0, uint32_t r1);
/* The matrix this thread runs next (NULL: none known): the panel kernel asks for its first
 * panels while it runs the last of the current one's (ro_gemm_ptrs2 chains its two). */
void ro_gemm_then(const struct ro_mat *W);
/* From this many tokens the AVX-512 panels run an FP8 matrix as bf16, converting each
 * 128-row block once per call; below, they widen the FP8 bytes on every pass. The same
 * bits either way (tests and benchmarks set it to compare the two; default 20). */
extern uint32_t ro_f8_via_bf16;
/* ro_gemm_ptrs for W1 into y1 and W2 into y2 (same shape, same inputs): bitwise the two
 * calls, with the inputs prepared once where the kernel prepares them. */
void ro_gemm_ptrs2(const struct ro_mat *W1, const struct ro_mat *W2, const float *const *x,
		   uint32_t T, float *const *y1, float *const *y2, uint32_t r0, uint32_t r1);
