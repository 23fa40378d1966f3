"""The attention every read ends in, and the argument checks shared by every read.

On a GPU (and with ``GEMMA_ZOO_FAST_MATH=0``) attention is MLX's fused kernel. On the CPU that
kernel falls back to matmuls around ``mx.softmax``, whose ``exp`` is a scalar loop; there
``attend`` runs the same products itself, with GQA folded into rows (one product per kv head, the
stored keys never broadcast) and ``zoo_cpu.fast_math.softmax``, in blocks of queries
(``BLOCK_SCORES``; a causal block skips the keys after its last query). An unmasked read (the
vision tower's bidirectional image, an encoder read) runs one kv head at a time in blocks of at
most ``BLOCK_SCORES_UNMASKED`` scores: with no mask to slice, a block can hold many more queries of
one head than of all heads together, so the products are larger and there are fewer of them
(measured faster than both the all-heads blocks and MLX's fused kernel at vision-tower budgets
70 to 560 soft tokens, and than the all-heads blocks at 1120). A single query (decode) keeps MLX's kernel, which is the faster
of the two there. Where the backend runs the zoo's C++ kernels (``zoo_cpu.backend``), float32
queries of a chunk go instead through its fused attention: per block of 32 query rows of one head,
the scores, masked softmax and product with the values on both cores, the blocks above unused;
and a single float32 query through its decode attention (``zoo_cpu.decode``: one node; float or
8-/4-bit quantized planes), a batch's rows of single queries over their own caches through its rows
form (one node for every row: ``attend_query_rows``).
``docs/speed.md`` has the measurements.
"""

from __future__ import annotations

import math
import numbers

import mlx.core as mx

from zoo_cpu import backend, decode, fast_math, prefill


# Scores per block of queries on the CPU: MLX's CPU kernels slow down sharply on arrays past about
# half a million elements, so a chunk's queries are attended in blocks of at most this many scores
# (2^16 to 2^18 measure alike, 2^19 slower: docs/speed.md).
BLOCK_SCORES = 1 << 17

# Scores per block of an unmasked read, per kv head (2^18 and 2^19 measure alike on the vision
# tower's shapes; each block is one kv head's [rows, T] product: docs/speed.md).
BLOCK_SCORES_UNMASKED = 1 << 18


def attend(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """``softmax(q k^T * scale + mask) v`` with GQA; ``mask`` as ``cache.masks`` builds it."""
    if q.shape[2] == 1:
        out = attend_query_run(q, keys, values, FIRST_ROW, keys.shape[2], scale, mask)
        if out is not None:
            return out
    chosen = backend.active()
    if q.shape[2] == 1 or not chosen.fast_math:
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    if chosen.prefill and prefill.takes(q, keys, values, mask):
        return prefill.attention(q, keys, values, scale, mask)
    if mask is None:
        return _attend_unmasked(q, keys, values, scale)
    B, Hq, L, _ = q.shape
    T = keys.shape[2]
    block = max(1, BLOCK_SCORES // (B * Hq * T))
    if block >= L:
        return _attend_rows(q, keys, values, scale, mask)
    outs = []
    for start in range(0, L, block):
        end = min(L, start + block)
        if isinstance(mask, str):
            # "causal" aligns the last query with the last key, so a block of queries sees only the
            # keys up to its own last one: the products skip the masked upper-right part.
            seen = T - (L - end)
            outs.append(_attend_rows(q[:, :, start:end], keys[:, :, :seen], values[:, :, :seen], scale, mask))
        else:
            rows = None if mask is None else mask[..., start:end, :]
            outs.append(_attend_rows(q[:, :, start:end], keys, values, scale, rows))
    return mx.concatenate(outs, axis=2)


FIRST_ROW = mx.array(0, dtype=mx.int32)  # a read of whole planes as a run from their first row


def attend_query_run(q: mx.array, keys: mx.array, values: mx.array, start: mx.array, size: int, scale: float, mask):
    """One float32 query per row over rows ``[start, start + size)`` of ``keys``/``values`` (whole
    planes, read in place) through the decode kernel (``zoo_cpu.decode``), or None where the backend
    does not run it or it does not take the read (then the caller attends a slice its own way)."""
    rows = _decode_rows(q, mask)
    if rows is False or not keys.dtype == values.dtype == mx.float32:
        return None
    return decode.attention(q, keys, values, start, size, scale, rows)


def attend_quantized_query_run(q: mx.array, keys: tuple, values: tuple, start: mx.array, size: int, scale: float,
                               mask, bits: int, group_size: int):
    """``attend_query_run`` over ``mx.quantize``'s (packed, scales, biases) planes: the quantized
    decode kernel reads the codes in place (4 or 8 bits, float32 scales and biases), or None."""
    rows = _decode_rows(q, mask)
    if rows is False or bits not in decode.QUANTIZED_BITS or any(p.dtype != mx.float32 for p in (*keys[1:], *values[1:])):
        return None
    return decode.attention_quantized(q, keys, values, start, size, scale, rows, bits, group_size)


def attend_query_rows(q: mx.array, keys: list, values: list, starts: list, sizes: list, scale: float,
                      bits: int | None = None, group_size: int = 64):
    """One float32 query per batch row of ``q [B, Hq, 1, D]``, row ``r`` over rows ``[starts[r],
    starts[r] + sizes[r])`` of its own planes ``keys[r]``/``values[r]`` (one float32 plane each, or
    ``mx.quantize``'s three at ``bits``), unmasked and read in place, in one call of the decode
    kernel's rows form (``zoo_cpu.decode.attention_rows``); None where the backend does not run it
    or it does not take the read (then the caller attends each row its own way)."""
    if _decode_rows(q, None) is False or (bits is not None and bits not in decode.QUANTIZED_BITS):
        return None
    floats = (planes if bits is None else planes[1:] for planes in (*keys, *values))  # quantized: scales, biases
    if any(p.dtype != mx.float32 for planes in floats for p in planes):
        return None
    return decode.attention_rows(q, keys, values, starts, sizes, scale, bits, group_size)


def prefill_reads_dequantized(q: mx.array, keys: tuple) -> bool:
    """Whether a read of many float32 queries over ``mx.quantize``'s planes dequantizes the run and
    attends it as float rows (``attend``: the prefill kernel, key blocks with an online softmax):
    on the CPU plan. MLX's CPU ``quantized_matmul`` is a plain loop there (an 8k-token prompt with
    8-bit keys and values prefilled at 32 tok/s against 620 float), and the dequantized run
    ([B, Hkv, T, D] keys and values, one layer at a time) is smaller than the [B, Hkv, L * G, T]
    scores the two quantized products would make."""
    chosen = backend.active()
    return chosen.fast_math and chosen.prefill and q.dtype == mx.float32 and keys[1].dtype == mx.float32


def _decode_rows(q: mx.array, mask):
    """The mask as the decode kernels take it, or False where they do not run (backend off, more
    than one query, a query that is not float32, a mask form they do not take)."""
    if not backend.active().decode or q.shape[2] != 1 or q.dtype != mx.float32:
        return False
    return _query_mask(mask, q.shape[0])


def _query_mask(mask, batch: int):
    """A single query's mask as the decode kernel takes it (None, or bool ``[1 or B, T]``), or False
    for a form it does not take."""
    if mask is None or isinstance(mask, str):
        return None if mask in (None, "causal") else False  # "causal": the one query sees every key
    if mask.dtype != mx.bool_:
        return False
    if mask.ndim == 2 and mask.shape[0] == 1:
        return mask
    if mask.ndim == 4 and mask.shape[0] in (1, batch) and mask.shape[1:3] == (1, 1):
        return mask.reshape(mask.shape[0], mask.shape[3])
    return False


def _attend_unmasked(q: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Unmasked attention, one kv head at a time: its folded query rows in blocks of at most
    ``BLOCK_SCORES_UNMASKED // (B * T)``, each one ``[rows, T]`` product, softmax and ``@ v``."""
    B, Hkv, T, _ = keys.shape
    rows = fold_queries(q, scale, Hkv)
    block = max(1, BLOCK_SCORES_UNMASKED // (B * T))
    heads = []
    for h in range(Hkv):
        k_t, v = keys[:, h : h + 1].swapaxes(-1, -2), values[:, h : h + 1]
        outs = []
        for start in range(0, rows.shape[2], block):
            probs = fast_math.softmax(rows[:, h : h + 1, start : start + block] @ k_t)
            outs.append(probs.astype(q.dtype) @ v)
        heads.append(outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2))
    return unfold_queries(heads[0] if Hkv == 1 else mx.concatenate(heads, axis=1), q.shape[1])


def _attend_rows(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    rows = fold_queries(q, scale, keys.shape[1])
    probs = masked_softmax(rows @ keys.swapaxes(-1, -2), mask, q.shape[2])
    return unfold_queries(probs.astype(q.dtype) @ values, q.shape[1])


def fold_queries(q: mx.array, scale: float, kv_heads: int) -> mx.array:
    """``q * scale`` as ``[B, Hkv, groups * L, D]``: each kv head's query heads stacked as rows."""
    B, Hq, L, D = q.shape
    return (q * scale).reshape(B, kv_heads, (Hq // kv_heads) * L, D)


def unfold_queries(out: mx.array, q_heads: int) -> mx.array:
    """``[B, Hkv, groups * L, Dv]`` back to ``[B, Hq, L, Dv]``."""
    B, _, rows, Dv = out.shape
    return out.reshape(B, q_heads, rows * out.shape[1] // q_heads, Dv)


def masked_softmax(scores: mx.array, mask, L: int) -> mx.array:
    """Float32 softmax over keys of folded ``scores [B, Hkv, groups * L, T]``, masked keys at 0.

    ``mask`` is ``None``, ``"causal"`` (the last query aligned with the last key, MLX's convention)
    or a boolean ``[L, T]`` / ``[B, 1, L, T]`` array (True = attend).
    """
    B, Hkv, rows, T = scores.shape
    scores = scores.astype(mx.float32)
    if mask is not None:
        if isinstance(mask, str):
            mask = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
        if mask.ndim == 4:  # [B, 1, L, T] -> [B, 1, 1, L, T]
            mask = mask[:, :, None]
        scores = mx.where(mask, scores.reshape(B, Hkv, rows // L, L, T), -mx.inf).reshape(B, Hkv, rows, T)
    softmax = fast_math.softmax if fast_math.active() else lambda s: mx.softmax(s, axis=-1)
    return softmax(scores)


def check_qkv(read: str, q: mx.array, k: mx.array, v: mx.array) -> None:
    """Raise ``ValueError`` naming the argument, the expected and the actual value (``TypeError``
    for a non-floating dtype: integer or boolean attention inputs would give silently wrong sums)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_query(read, name, x)
    B, Hq, L, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"{read}: batch size of k {k.shape[0]} / v {v.shape[0]} must equal q's {B}")
    if k.shape[2] != L or v.shape[2] != L:
        raise ValueError(f"{read}: k has L={k.shape[2]} and v has L={v.shape[2]}; both must equal q's L={L}")
    if L < 1:
        raise ValueError(f"{read}: q must hold at least 1 new position, got L={L}")
    Hkv = k.shape[1]
    if v.shape[1] != Hkv:
        raise ValueError(f"{read}: v has {v.shape[1]} kv heads, expected k's {Hkv}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{read}: q heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if k.shape[3] != D:
        raise ValueError(f"{read}: k head dim {k.shape[3]} must equal q head dim {D}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{read}: q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def check_query(read: str, name: str, x) -> None:
    """One attention input: an ``mx.array`` of rank 4 ``[B, H, L, D]`` with a floating dtype."""
    if not isinstance(x, mx.array):
        raise ValueError(f"{read}: {name} must be an mx.array, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{read}: {name} must have rank 4 [B, H, L, D], got rank {x.ndim} shape {tuple(x.shape)}")
    if not mx.issubdtype(x.dtype, mx.floating):
        raise TypeError(f"{read}: {name} must have a floating dtype (float32, float16, bfloat16), got {x.dtype}")


def check_scale(read: str, scale) -> float:
    """The softmax scale as a float: a finite positive real number (not a bool or a string)."""
    if scale is None:
        raise ValueError(f"{read}: scale is required (Gemma 4 uses 1.0)")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"{read}: scale must be a real number, got {type(scale).__name__} {scale!r}")
    value = float(scale)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{read}: scale must be finite and > 0, got {scale!r}")
    return value


def check_blocks(read: str, blocks, B: int, L: int) -> mx.array:
    """``blocks`` is ``[B, L]`` of image indices per new position, -1 for text."""
    if not isinstance(blocks, mx.array):
        blocks = mx.array(blocks)
    if tuple(blocks.shape) != (B, L):
        raise ValueError(f"{read}: blocks must have shape [B, L] = {[B, L]}, got {list(blocks.shape)}")
    if not mx.issubdtype(blocks.dtype, mx.integer):
        raise ValueError(f"{read}: blocks must be an integer array, got dtype {blocks.dtype}")
    return blocks
