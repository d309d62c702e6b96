#!/usr/bin/env python3
"""Write tiny random Qwen3-MoE and Mixtral checkpoints with transformers, plus
reference log-probabilities (fp32 and bf16 eager), for the Go policy tests.

Output (relative to --out, the repo root): policy/testdata/reference/{qwen3_moe,mixtral}/
  model.safetensors, config.json (both written by save_pretrained), reference.json.
See README.md next to this file. Tested with transformers 5.17; written to cope with 4.x.
"""
import argparse, copy, inspect, json, math, os, re, sys
from pathlib import Path

LENGTHS = (1, 7, 33, 100)
NORM_JITTER = 0.1  # norm weights = 1 + 0.1*N(0,1): catches an engine that ignores them
COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, max_position_embeddings=256,
              tie_word_embeddings=False)
MODELS = [  # (dir, model class, config class, rope theta, expert intermediate size, config fields)
    ("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", 10000.0, 32, dict(
        COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=8, norm_topk_prob=True,
        rms_norm_eps=1e-6, decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False,
        use_sliding_window=False)),
    ("mixtral", "MixtralForCausalLM", "MixtralConfig", 1e6, 32, dict(
        COMMON, intermediate_size=32, num_local_experts=8, rms_norm_eps=1e-5, sliding_window=None)),
]


def rope_theta_of(cfg):
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    return getattr(cfg, "rope_theta", None)


def make_config(cls, fields, theta):
    """transformers 5 spells RoPE as rope_parameters={...}; 4.x as rope_theta=. Try the likely one first."""
    try:
        has_rp = "rope_parameters" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        has_rp = True
    tries = [("rope_parameters", lambda: {"rope_type": "default", "rope_theta": theta}), ("rope_theta", lambda: theta)]
    for key, val in (tries if has_rp else tries[::-1]):
        try:
            cfg = cls(**copy.deepcopy(fields), **{key: val()}, attn_implementation="eager")
        except (TypeError, ValueError) as e:
            print(f"  {cls.__name__}({key}=...) rejected: {e}")
            continue
        bad = {k: getattr(cfg, k, "<missing>") for k, v in fields.items() if getattr(cfg, k, "<missing>") != v}
        if rope_theta_of(cfg) != theta:
            bad["rope_theta"] = rope_theta_of(cfg)
        if not bad:
            print(f"  {cls.__name__}: RoPE given as {key}")
            return cfg
        print(f"  {cls.__name__}({key}=...) did not take: {bad}")
    sys.exit(f"ERROR: could not build {cls.__name__} with the wanted fields; see messages above")


def force_eager(model):
    """Eager attention and (transformers 5) eager experts: the plain reference code paths."""
    for meth in ("set_attn_implementation", "set_experts_implementation"):
        fn = getattr(model, meth, None)
        if fn is not None:
            try:
                fn("eager")
            except Exception as e:  # noqa: BLE001 - report and fall back
                print(f"  WARNING: {meth}('eager') failed: {e!r}")
    if getattr(model.config, "_attn_implementation", "eager") != "eager":
        model.config._attn_implementation = "eager"
    return getattr(model.config, "_attn_implementation", None), getattr(model.config, "_experts_implementation", None)


def reinit(torch, model, hidden, moe_inter, seed):
    """Re-draw every parameter so activations are O(1); then round to bf16 values (kept in fp32)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "embed_tokens" in name:
                v = z
            elif name.endswith("norm.weight"):
                v = 1.0 + NORM_JITTER * z
            elif name.endswith(".bias"):
                v = torch.zeros_like(z)
            elif re.search(r"(mlp|block_sparse_moe)\.gate\.weight$", name):  # router
                v = z / math.sqrt(hidden)
            elif p.dim() == 3:  # fused experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
                fan_in = moe_inter if "down" in name else hidden
                assert fan_in in p.shape[1:], f"{name}: unexpected shape {tuple(p.shape)}"
                v = z / math.sqrt(fan_in)
            elif p.dim() == 2:  # nn.Linear [out, in]
                v = z / math.sqrt(p.shape[1])
            else:
                sys.exit(f"ERROR: no init rule for parameter {name} {tuple(p.shape)}")
            p.copy_(v.to(torch.bfloat16).float())


def load(cls, path, dtype):
    kw = dict(attn_implementation="eager", local_files_only=True)
    try:
        return cls.from_pretrained(path, dtype=dtype, **kw)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        return cls.from_pretrained(path, torch_dtype=dtype, **kw)


def score(torch, model, seqs, device):
    lps, greedy, margin, ent = [], [], [], []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s], dtype=torch.long, device=device)
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            logits = out.logits if hasattr(out, "logits") else out[0]
            lp = torch.log_softmax(logits[0].float(), dim=-1)  # [L, V]
            lps.append([None] + lp[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist())
            top = lp.topk(2, dim=-1)
            greedy.append(top.indices[:, 0].tolist())
            margin.append((top.values[:, 0] - top.values[:, 1]).tolist())
            ent.append(float(-(lp.exp() * lp).sum(-1).mean()))
    return lps, greedy, margin, sum(ent) / len(ent)


def save_checkpoint(torch, model, outdir, fused_dir):
    """save_pretrained in bf16; print what it wrote. Returns False if some tensor is not BF16."""
    from safetensors import safe_open
    for d in (outdir, fused_dir):
        if d is not None and d.is_dir():  # drop stale files from an earlier run
            for f in d.iterdir():
                if f.is_file() and f.suffix in (".safetensors", ".json"):
                    f.unlink()
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    sig = inspect.signature(m16.save_pretrained).parameters
    m16.save_pretrained(str(outdir), **({"safe_serialization": True} if "safe_serialization" in sig else {}))
    if fused_dir is not None:
        if "save_original_format" in sig:  # transformers 5: keep the runtime (fused) names
            m16.save_pretrained(str(fused_dir), save_original_format=False)
        else:
            print("  --fused: this transformers has no save_original_format; skipped")
    names = []
    for st in sorted(outdir.glob("*.safetensors")):
        with safe_open(str(st), framework="pt") as sf:
            for k in sf.keys():
                sl = sf.get_slice(k)
                names.append((k, list(sl.get_shape()), sl.get_dtype()))
    print(f"  tensors written ({len(names)}):")
    for k, shape, dt in names:
        print(f"    {k} {shape} {dt}")
    fused = any(re.search(r"experts\.(gate_up_proj|up_proj|down_proj)$", k) for k, _, _ in names)
    print(f"  expert layout on disk: {'FUSED' if fused else 'per-expert'}")
    print("  config.json:", json.dumps(json.loads((outdir / "config.json").read_text()), sort_keys=True))
    if any(dt != "BF16" for _, _, dt in names):
        print("  ERROR: not every tensor is BF16")
        return False
    return True


def load_pair(torch, mcls, model, outdir):
    """fp32 and bf16 models loaded back from the checkpoint the Go side reads. Returns (m32, m16, ok)."""
    ok = True
    try:
        m32 = load(mcls, str(outdir), torch.float32).float().eval()
        ref, got = model.state_dict(), m32.state_dict()
        diff = [k for k, v in got.items() if k not in ref or not torch.equal(v.cpu(), ref[k].cpu())]
        if diff or len(ref) != len(got):
            print(f"  ERROR: reloaded fp32 weights differ from the saved ones: {diff[:5]}")
            ok = False
        m16 = load(mcls, str(outdir), torch.bfloat16).eval()
        not16 = [n for n, p in m16.named_parameters() if p.dtype != torch.bfloat16]
        if not16:  # e.g. modules transformers keeps in fp32; left as transformers loads them
            print(f"  NOTE: bf16 load kept {len(not16)} parameters in another dtype: {not16[:5]}")
    except Exception as e:  # noqa: BLE001 - fall back to the in-memory weights (identical values)
        print(f"  WARNING: from_pretrained failed ({e!r}); using the in-memory model instead")
        m32, m16 = model, copy.deepcopy(model).to(torch.bfloat16)
    return m32, m16, ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2], help="repo root")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--fused", action="store_true",
                    help="also write <model>_fused/ with save_original_format=False (transformers 5 only)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network there; set before importing HF code
    import numpy as np
    import safetensors
    import torch
    import transformers

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch.set_float32_matmul_precision("highest")  # no TF32 in the fp32 reference
    except Exception as e:  # noqa: BLE001
        print(f"WARNING: set_float32_matmul_precision: {e!r}")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"safetensors {safetensors.__version__}, numpy {np.__version__}, device {dev}"
          + (f" ({torch.cuda.get_device_name(0)})" if dev.startswith("cuda") else ""))
    rng = np.random.default_rng(args.seed)
    seqs = [[int(t) for t in rng.integers(0, 256, size=n)] for n in LENGTHS]
    out = args.out.resolve()
    root = out / "policy" / "testdata" / "reference"
    failed = False
    for idx, (sub, mname, cname, theta, moe_inter, fields) in enumerate(MODELS):
        print(f"\n=== {sub}: {mname}")
        mcls, ccls = getattr(transformers, mname, None), getattr(transformers, cname, None)
        if mcls is None or ccls is None:
            sys.exit(f"ERROR: transformers {transformers.__version__} has no {mname}/{cname}")
        cfg = make_config(ccls, fields, theta)
        torch.manual_seed(args.seed + idx)
        model = mcls(cfg).float().eval()
        reinit(torch, model, fields["hidden_size"], moe_inter, args.seed + idx)
        outdir, fused_dir = root / sub, (root / f"{sub}_fused" if args.fused else None)
        outdir.mkdir(parents=True, exist_ok=True)
        failed |= not save_checkpoint(torch, model, outdir, fused_dir)
        m32, m16, ok = load_pair(torch, mcls, model, outdir)
        failed |= not ok
        impl32, impl16 = force_eager(m32), force_eager(m16)
        print(f"  implementations (attn, experts): fp32 {impl32}, bf16 {impl16}")
        lp32, greedy, margin, h32 = score(torch, m32.to(dev), seqs, dev)
        lp16, _, _, _ = score(torch, m16.to(dev), seqs, dev)

        a = [x for row in lp32 for x in row[1:]]
        b = [x for row in lp16 for x in row[1:]]
        d = [abs(x - y) for x, y in zip(a, b)]
        finite = all(math.isfinite(x) for x in a + b)
        mean_d, max_d = sum(d) / len(d), max(d)
        print(f"  fp32 mean token logprob {sum(a) / len(a):.4f} (uniform {-math.log(256):.4f}), "
              f"mean entropy {h32:.4f} nats")
        print(f"  fp32 vs bf16 logprobs: mean |diff| {mean_d:.6f}, max |diff| {max_d:.6f}, finite {finite}")
        if not finite or not mean_d < 0.1:
            print("  SANITY FAIL: logprobs not finite or fp32/bf16 mean |diff| >= 0.1")
            failed = True
        doc = {"model": mname, "transformers": transformers.__version__, "torch": torch.__version__,
               "device": dev, "seed": args.seed, "attn_implementation": impl32[0],
               "experts_implementation": impl32[1], "sequences": seqs, "logprobs_fp32": lp32,
               "logprobs_bf16": lp16, "greedy_fp32": greedy, "greedy_margin_fp32": margin}
        text = json.dumps(doc) + "\n"  # json writes floats with repr: full double precision
        for dst in (outdir, fused_dir):
            if dst is not None and (dst / "config.json").is_file():
                (dst / "reference.json").write_text(text)

    total = 0
    print("\nfiles written:")
    for p in sorted(q for m in MODELS for q in root.glob(f"{m[0]}*/*") if q.is_file()):
        total += p.stat().st_size
        print(f"  {p.relative_to(out)} {p.stat().st_size} bytes")
    print(f"total {total} bytes")
    print("RESULT:", "FAIL (see messages above)" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
