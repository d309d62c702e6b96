#!/usr/bin/env python3
"""The torch BF16 baseline of the MoE layer forward (docs/PERF.md).

What a user would write with stock PyTorch, eager (not graphed):

    router GEMM -> softmax -> top-k (renormalised) -> argsort permutation
    -> torch._grouped_mm FC1 -> squared ReLU (or SwiGLU) -> torch._grouped_mm FC2
    -> routing weights -> index_add_ finalize

timed with triton.testing.do_bench (median), rotating through 4 input batches
so that consecutive forwards route to different experts. The weights are
random BF16 at the DeepSeek-V3 MoE layer's shapes by default (hidden 7168,
intermediate 2048, 256 experts, top-8, relu2). Needs torch (2.8 or later, for torch._grouped_mm)
and triton on a CUDA GPU; no network.

    python3 tools/torch_moe_bench.py
    python3 tools/torch_moe_bench.py --activation swiglu --csv torch_swiglu.csv

Prints a table, then the same rows as CSV (also written to --csv FILE).
"""

import argparse
import csv
import io
import sys

try:
    import torch
    import torch.nn.functional as F
    import triton.testing
except ImportError as e:  # pragma: no cover - environment check
    sys.exit(f"torch_moe_bench: needs torch and triton: {e}")

# The H200 ceilings docs/PERF.md states its floors with.
BANDWIDTH = 4.3e12  # bytes/s, copy (read + written)
BF16_FLOPS = 790e12  # FLOP/s, dense BF16 GEMM


def positive_ints(s):
    try:
        vals = [int(f) for f in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of batch sizes")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{s!r}: batch sizes must be positive")
    return vals


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=positive_ints, default=[1, 8, 32, 128, 512, 4096], help="comma-separated batch sizes")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", "--top-k", dest="topk", type=int, default=8)
    p.add_argument("--activation", choices=["relu2", "swiglu"], default="relu2")
    p.add_argument("--inputs", type=int, default=4, help="input batches rotated through (default 4)")
    p.add_argument("--warmup", type=float, default=100, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=500, help="do_bench measuring time, ms")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--csv", metavar="FILE", help="also write the CSV rows to FILE")
    p.add_argument("--no-check", action="store_true", help="skip the check against a per-token loop")
    a = p.parse_args(argv)
    if a.hidden % 8 or a.intermediate % 8:
        p.error("torch._grouped_mm needs hidden and intermediate multiples of 8 (16-byte rows in BF16)")
    if not 1 <= a.topk <= a.experts:
        p.error(f"top-{a.topk} of {a.experts} experts")
    if a.inputs < 1:
        p.error("--inputs must be positive")
    return a


def make_weights(a, device):
    """Random BF16 weights, N(0, 1/fan_in), drawn one expert at a time so
    that no FP32 copy of a whole 7.5 GB stack is ever made. FC1 is
    [gate; up] for SwiGLU, as in the Go layer. Returned as the [E, K, N]
    views that torch._grouped_mm multiplies by (column-major: the weights
    are stored [E, N, K], as a Linear layer stores them)."""
    g = torch.Generator(device=device).manual_seed(a.seed)
    E, H, I = a.experts, a.hidden, a.intermediate
    i1 = 2 * I if a.activation == "swiglu" else I
    router = (torch.randn(E, H, generator=g, device=device) * H**-0.5).to(torch.bfloat16)
    fc1 = torch.empty(E, i1, H, dtype=torch.bfloat16, device=device)
    fc2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=device)
    for e in range(E):
        fc1[e] = torch.randn(i1, H, generator=g, device=device) * H**-0.5
        fc2[e] = torch.randn(H, I, generator=g, device=device) * I**-0.5
    return router, fc1, fc2


def grouped_mm(a, b, offs):
    """torch._grouped_mm(mat_a [rows, K], mat_b [E, K, N], offs int32 [E]
    cumulative row ends) -> [rows, N] BF16, with a clear message when this
    torch or GPU cannot run it."""
    try:
        return torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)
    except (AttributeError, RuntimeError, TypeError, NotImplementedError) as e:
        sys.exit(
            f"torch_moe_bench: torch._grouped_mm failed (torch {torch.__version__}, "
            f"{torch.cuda.get_device_name()}): {e}\n"
            f"  it was given mat_a {tuple(a.shape)} {a.dtype} strides {a.stride()}, mat_b {tuple(b.shape)} "
            f"{b.dtype} strides {b.stride()}, offs {tuple(offs.shape)} {offs.dtype}; it needs BF16 operands, "
            "K and N multiples of 8, offs int32 cumulative ends, and a GPU its kernels support (sm90 for CUTLASS)"
        )


def moe_forward(x, router, fc1, fc2, topk, activation):
    """One MoE layer forward of x [T, H] (BF16) -> [T, H] (BF16)."""
    T, H = x.shape
    E = router.shape[0]
    logits = x @ router.t()  # router GEMM, BF16
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, topk, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, k) assignments sorted by expert
    # Row counts per expert without torch.bincount, which syncs with the
    # host to size its output.
    counts = torch.zeros(E, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    token = order // topk
    h = grouped_mm(x.index_select(0, token), fc1.transpose(1, 2), offs)
    if activation == "relu2":
        h = torch.relu(h).square()
    else:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    y = grouped_mm(h, fc2.transpose(1, 2), offs)
    y = y * weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return torch.zeros(T, H, dtype=y.dtype, device=x.device).index_add_(0, token, y)


def reference(x, router, fc1, fc2, topk, activation):
    """The same layer one token and expert at a time, in FP32."""
    probs = torch.softmax((x @ router.t()).float(), dim=-1)
    weights, ids = torch.topk(probs, topk, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(topk):
            e = int(ids[t, j])
            h = fc1[e].float() @ x[t].float()
            if activation == "relu2":
                h = torch.relu(h).square()
            else:
                gate, up = h.chunk(2)
                h = F.silu(gate) * up
            out[t] += weights[t, j] * (fc2[e].float() @ h)
    return out


def expected_touched(E, k, T):
    return E * (1 - (1 - k / E) ** T)


def floors_us(a, T):
    """The NVFP4 floor of docs/PERF.md (0.5625 B per weight of the touched
    experts + activations) and the same with BF16 weights (2 B per weight)."""
    i1 = 2 * a.intermediate if a.activation == "swiglu" else a.intermediate
    pad = lambda k: (k + 15) // 16 * 16
    weights = i1 * pad(a.hidden) + a.hidden * pad(a.intermediate)
    touched = expected_touched(a.experts, a.topk, T)
    acts = 2 * T * a.hidden * 2
    flops = 2 * T * a.topk * (i1 * a.hidden + a.hidden * a.intermediate)
    nvfp4 = max((touched * weights * 0.5625 + acts) / BANDWIDTH, flops / BF16_FLOPS)
    bf16 = max((touched * (i1 * a.hidden + a.hidden * a.intermediate) * 2 + acts) / BANDWIDTH, flops / BF16_FLOPS)
    return touched, nvfp4 * 1e6, bf16 * 1e6


def main(argv=None):
    a = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("torch_moe_bench: no CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(a.seed)
    router, fc1, fc2 = make_weights(a, dev)
    print(
        f"torch {torch.__version__} on {torch.cuda.get_device_name()}: hidden {a.hidden}, intermediate "
        f"{a.intermediate}, {a.experts} experts, top-{a.topk}, {a.activation}; eager, median of "
        f"triton.testing.do_bench, {a.inputs} rotating inputs",
        file=sys.stderr,
    )
    g = torch.Generator(device=dev).manual_seed(a.seed + 1)
    if not a.no_check:
        T = min(8, min(a.tokens))
        x = torch.randn(T, a.hidden, generator=g, device=dev).to(torch.bfloat16)
        got = moe_forward(x, router, fc1, fc2, a.topk, a.activation).float()
        ref = reference(x, router, fc1, fc2, a.topk, a.activation)
        cos = F.cosine_similarity(got, ref, dim=-1)
        print(f"check: {T} tokens against a per-token FP32 loop: cosine min {cos.min().item():.5f}", file=sys.stderr)
        if cos.min().item() < 0.99:
            sys.exit("torch_moe_bench: the grouped forward disagrees with the per-token loop")
    rows = []
    for T in a.tokens:
        xs = [torch.randn(T, a.hidden, generator=g, device=dev).to(torch.bfloat16) for _ in range(a.inputs)]
        step = [0]

        def fn():
            i = step[0] % len(xs)
            step[0] += 1
            moe_forward(xs[i], router, fc1, fc2, a.topk, a.activation)

        ms = triton.testing.do_bench(fn, warmup=a.warmup, rep=a.rep, return_mode="median")
        touched, nv, bf = floors_us(a, T)
        rows.append(
            {
                "tokens": T,
                "experts_touched": f"{touched:.1f}",
                "nvfp4_floor_us": f"{nv:.1f}",
                "bf16_floor_us": f"{bf:.1f}",
                "torch_bf16_us": f"{ms * 1e3:.1f}",
                "torch_vs_bf16_floor": f"{ms * 1e3 / bf:.2f}",
            }
        )
        print(f"  tokens {T:5d}  torch bf16 {ms * 1e3:10.1f} us", file=sys.stderr)
    cols = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    print()
    print(buf.getvalue(), end="")
    if a.csv:
        with open(a.csv, "w") as f:
            f.write(buf.getvalue())


if __name__ == "__main__":
    main()
