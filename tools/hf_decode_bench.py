#!/usr/bin/env python3
"""Time a decode step of Hugging Face transformers on Qwen3-30B-A3B shapes.

The baseline a user would reach for first: a Qwen3-MoE model built from a
config with the real shapes (hidden 2048, 128 experts top-8, expert
intermediate 768, 32 query / 4 KV heads of 128, vocabulary 151936) and a
cut of its layers, random BF16 weights on the GPU, the `grouped_mm` experts
backend (torch grouped GEMMs), the default dynamic KV cache, eager mode.
After one untimed warm-up point, for each context and batch it prefills
`context` random tokens a sequence, then times decode steps (one token a
sequence, greedy) with torch.cuda.synchronize around each step, and prints
the mean step time.

Usage (GPU machine, torch and transformers installed):

    python3 tools/hf_decode_bench.py --layers 4 --batches 1,64,256 --contexts 128,1024 --csv hf.csv

The script needs no checkpoint and writes nothing but the optional CSV.
"""
import argparse
import csv
import statistics
import sys
import time


def parse_list(s):
    return [int(x) for x in s.split(",") if x.strip()]


def build_model(layers, experts_impl):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    fields = dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
        max_position_embeddings=40960, decoder_sparse_step=1, mlp_only_layers=[],
        attention_bias=False, tie_word_embeddings=False, use_sliding_window=False)
    try:
        cfg = Qwen3MoeConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **fields)
    except TypeError:
        cfg = Qwen3MoeConfig(rope_theta=1e6, **fields)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    impl = "default"
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(experts_impl)
        impl = experts_impl
    return model, impl


def time_point(model, batch, context, steps, warmup):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + context)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda", generator=gen)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=past, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    del past, out
    torch.cuda.empty_cache()
    return statistics.mean(times), statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the cut")
    ap.add_argument("--batches", default="1,64,256", help="comma-separated sequences per step")
    ap.add_argument("--contexts", default="128,1024", help="comma-separated tokens in each sequence's cache")
    ap.add_argument("--steps", type=int, default=16, help="timed steps per point")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps before each point")
    ap.add_argument("--experts", default="grouped_mm", help="transformers experts backend")
    ap.add_argument("--csv", default="", help="also write the points to this CSV file")
    a = ap.parse_args()

    import torch
    import transformers

    model, impl = build_model(a.layers, a.experts)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"{a.layers} layers, experts {impl}, dynamic cache, eager")
    # One untimed point first: the first forward passes load kernels and
    # fill allocator caches, which would otherwise land on the first point.
    time_point(model, 1, 16, 2, 2)
    rows = []
    print(f"{'context':>8} {'batch':>6} {'step ms':>9} {'median':>9} {'tokens/s':>10}")
    for context in parse_list(a.contexts):
        for batch in parse_list(a.batches):
            mean, med = time_point(model, batch, context, a.steps, a.warmup)
            rows.append(dict(layers=a.layers, context=context, batch=batch, step_ms=round(mean, 4),
                             median_ms=round(med, 4), tokens_per_s=round(batch / mean * 1e3, 1), experts=impl))
            print(f"{context:>8} {batch:>6} {mean:>9.3f} {med:>9.3f} {batch / mean * 1e3:>10.1f}", flush=True)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
