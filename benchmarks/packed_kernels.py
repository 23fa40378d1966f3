"""The packed 4/8-bit products (``kernels``) against the float32 BLAS and MLX's quantized matmul.

    python -m benchmarks.packed_kernels                      # the 270M's shapes, 1 to 512 rows
    python -m benchmarks.packed_kernels --rows 1 --shapes 262144x640 --threads 1,2
    python -m benchmarks.packed_kernels --smoke             # one small shape, one repeat (benchmarks.smoke)

For each weight shape ``N x K`` (output x input; the 270M's head, MLP and attention projections),
bits (8, 4) and rows of ``x``: milliseconds per product (median of ``--repeats``, each timing
``--batch`` products evaluated together, so the per-call overhead of a Python loop is shared) for

- ``kernel``: ``zoo_packed.packed_matmul`` (what ``PackedLinear`` uses up to ``KERNEL_ROWS`` rows);
- ``dequant+BLAS``: ``x @ zoo_packed.packed_dequantize(...).T`` (what it uses above);
- ``fp32 BLAS``: ``x @ W.T`` with the float32 weight stored transposed (the float32 model's path);
- ``MLX qmm``: ``mx.quantized_matmul`` with float32 scales (MLX's own CPU kernel);

and the kernel's effective read rate (packed weight + scales + biases bytes / time). Weights are
random (``mx.quantize`` of a normal matrix, group 64), activations too; one process, the variants
interleaved. On a shared machine, read ratios within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import zoo_cpu  # noqa: F401  (before mlx)

import mlx.core as mx

from benchmarks import smoke
from zoo_cpu import extension, packed as zoo_packed

SHAPES = "262144x640,2048x640,640x2048,1024x640,256x640,640x1024"


def timed(fn, batch: int, repeats: int) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` rounds of ``batch`` calls evaluated together."""
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(batch)])
        times.append((time.perf_counter() - start) / batch)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated NxK")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,512")
    parser.add_argument("--bits", default="8,4")
    parser.add_argument("--threads", default="", help="comma-separated kernel thread counts (default: all CPUs)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--mlx-qmm-rows", type=int, default=4, help="time MLX's quantized matmul up to this many rows (slow)")
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.rows, args.repeats, args.mlx_qmm_rows = "256x128", "1,8", 1, 8
    record = smoke.Record("packed_kernels")
    status = extension.status()
    if not status.available:
        raise SystemExit(extension.describe())
    module = status.module
    all_threads = module.threads()
    thread_counts = [int(t) for t in args.threads.split(",") if t] or [all_threads]
    print(f"{extension.describe()}; {zoo_cpu.blas.describe()}")
    print("| N x K | bits | rows | threads | kernel ms | kernel GB/s | dequant+BLAS ms | fp32 BLAS ms | MLX qmm ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        N, K = (int(d) for d in shape.split("x"))
        weight = mx.random.normal((N, K)) * 0.02
        transposed = mx.contiguous(weight.T)
        mx.eval(weight, transposed)
        for bits in (int(b) for b in args.bits.split(",")):
            w, s, b = mx.quantize(weight, group_size=64, bits=bits)
            mx.eval(w, s, b)
            nbytes = w.nbytes + s.nbytes + b.nbytes
            for rows in (int(r) for r in args.rows.split(",")):
                x = mx.random.normal((rows, K))
                mx.eval(x)
                # few repeats of the big products: each already takes tens of milliseconds
                batch = max(1, min(20, int(2e7 // (N * K * max(rows, 4) // 4 + 1))))
                dense = timed(lambda: x @ zoo_packed.packed_dequantize(w, s, b, 64, bits).T, batch, args.repeats)
                fp32 = timed(lambda: x @ transposed, batch, args.repeats)
                qmm = "-"
                if rows <= args.mlx_qmm_rows:
                    qmm = f"{1e3 * timed(lambda: mx.quantized_matmul(x, w, s, b, group_size=64, bits=bits), 1, 3):.3f}"
                label = f"{N}x{K} {bits}-bit {rows} rows"
                record.row(f"{label} dequant+BLAS", dense=dense)
                record.row(f"{label} fp32 BLAS", fp32=fp32)
                # the four products of one weight must agree (to float32 rounding over K terms)
                reference = x @ zoo_packed.packed_dequantize(w, s, b, 64, bits).T
                for threads in thread_counts:
                    module.set_threads(threads)
                    kernel = timed(lambda: zoo_packed.packed_matmul(x, w, s, b, 64, bits), batch, args.repeats)
                    error = float(mx.abs(zoo_packed.packed_matmul(x, w, s, b, 64, bits) - reference).max())
                    if error > 1e-4 * K:
                        record.missing(f"{label} kernel, {threads} threads", f"differs from dequant+BLAS by {error:.2e}")
                    else:
                        record.row(f"{label} kernel, {threads} threads", kernel=kernel)
                    print(
                        f"| {N} x {K} | {bits} | {rows} | {threads} | {1e3 * kernel:.3f} | {nbytes / kernel / 1e9:.1f} | "
                        f"{1e3 * dense:.3f} | {1e3 * fp32:.3f} | {qmm} |",
                        flush=True,
                    )
                module.set_threads(all_threads)
    if args.smoke:
        record.finish()


if __name__ == "__main__":
    main()
