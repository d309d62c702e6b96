#!/usr/bin/env python3
"""ncusass summarises an ncu per-SASS source export of one kernel.

Make the export on the GPU machine (one kernel, source counters on):

    ncu --clock-control none -k KERNEL -c 1 --section SourceCounters \
        --section WarpStateStats -o /tmp/K <command>
    ncu -i /tmp/K.ncu-rep --page source --csv --print-source sass > K_src.csv

Then, anywhere with Python 3:

    python3 tools/ncusass/ncusass.py K_src.csv --per N [--hot]

--per N divides every count by N (for example blocks x warps x chunks, to
get instructions per warp and chunk). It prints the instructions executed
by opcode, the stall samples by reason, and with --hot every instruction
of the most executed count (the steady-state loop) with its samples.
--groups N prints the N execution counts with the most stall samples: the
instructions that ran equally often (a loop body, a block's prologue),
their share of instructions and samples, and their largest stall reasons.
"""
import argparse
import collections
import csv
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--per", type=float, default=1, help="divide counts by this (e.g. warps x chunks)")
    ap.add_argument("--top", type=int, default=25, help="opcodes to print")
    ap.add_argument("--hot", action="store_true", help="list the instructions of the hottest execution count")
    ap.add_argument("--groups", type=int, default=0, help="summarise the N execution counts with the most stall samples")
    a = ap.parse_args()

    rows = list(csv.reader(open(a.csv, newline="")))
    # The export starts with a kernel-name line, then the header.
    hi = next(i for i, r in enumerate(rows) if "Source" in r and "Instructions Executed" in r)
    hdr, data = rows[hi], rows[hi + 1:]
    ix = {h: i for i, h in enumerate(hdr)}
    ie, isrc = ix["Instructions Executed"], ix["Source"]
    isamp = ix.get("Warp Stall Sampling (All Samples)")
    stalls = [h for h in hdr if h.startswith("stall_") and "(Not Issued)" not in h]

    ops, reasons = collections.Counter(), collections.Counter()
    total = 0
    parsed = []
    groups = {}  # execution count -> [instructions, samples, stall reasons]
    for r in data:
        try:
            n = int(r[ie])
        except (ValueError, IndexError):
            continue
        words = r[isrc].split()
        if not words:
            continue
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        op = op.split(".")[0]
        ops[op] += n
        total += n
        row = collections.Counter()  # this instruction's stall samples by reason
        for h in stalls:
            try:
                row[h[6:]] += int(r[ix[h]])
            except ValueError:
                pass
        reasons.update(row)
        parsed.append((r, n))
        g = groups.setdefault(n, [0, 0, collections.Counter()])
        g[0] += 1
        if isamp is not None and r[isamp]:
            g[1] += int(r[isamp])
        g[2].update(row)

    print(f"instructions executed: {total / a.per:.1f} per unit (--per {a.per:g})")
    for op, n in ops.most_common(a.top):
        print(f"  {op:12s} {n / a.per:9.1f}")
    tot = sum(reasons.values()) or 1
    print("stall samples by reason:")
    for h, n in reasons.most_common():
        if n:
            print(f"  {h:20s} {100 * n / tot:5.1f}%")
    if a.hot:
        hot = max(groups, key=lambda n: n * groups[n][0])
        print(f"hottest execution count {hot}: {groups[hot][0]} instructions")
        for r, n in parsed:
            if n == hot:
                s = r[isamp] if isamp is not None else ""
                print(f"  {r[0][-5:]} {s:>6s}  {r[isrc].strip()}")
    if a.groups:
        samples = sum(g[1] for g in groups.values()) or 1
        print("execution counts with the most stall samples:")
        for n, g in sorted(groups.items(), key=lambda kv: -kv[1][1])[: a.groups]:
            st = sum(g[2].values()) or 1
            top = ", ".join(f"{k} {100 * v / st:.0f}%" for k, v in g[2].most_common(3))
            print(f"  count {n:>10d}: {g[0]:4d} instructions, {100 * n * g[0] / (total or 1):5.1f}% executed, "
                  f"{100 * g[1] / samples:5.1f}% of samples ({top})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
