#!/usr/bin/env python3
"""Turns bench_attention's JSON output into the README's tables.

    ./build/bench/bench_attention --benchmark_out=bench.json --benchmark_out_format=json
    python3 bench/table.py bench.json

Every rate is also given as a fraction of the FMA peak probe of the same run
(the widest vectors the build targets), so tables from different machines
compare. The bfloat16 kernels (BM_Bf16_*) are given against their float
kernels of the same run and as a fraction of the bf16 peak probe
(BM_Bf16Peak, vdpbf16ps), where the build targets AVX512-BF16.
"""
import json
import sys


def main(path):
    runs = {}
    for b in json.load(open(path))["benchmarks"]:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        name = b["name"].replace("/real_time", "").replace("_median", "").replace("bench::", "")
        runs[name] = b
    peak = {t: runs[f"BM_FmaPeak/{t}"]["GFLOPS"] / 1e9 for t in (1, 2)}
    print(f"FMA peak: 1 thread {peak[1]:.0f} GFLOP/s, 2 threads {peak[2]:.0f} GFLOP/s\n")
    print("| N | threads | V1 ms | V2 ms | plain ms | reference V1 ms "
          "| V1 GFLOP/s (of peak) | V2 (of peak) | plain (of peak) | V1 / plain | V2 / plain "
          "| reference / V1 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    ms = lambda b: b["real_time"]  # the benchmarks report milliseconds
    rate = lambda b, t: f"{b['GFLOPS'] / 1e9:.0f} ({100 * b['GFLOPS'] / 1e9 / peak[t]:.0f}%)"
    for threads in (1, 2):
        for n in (256, 1024, 2048, 4096, 16384):
            get = lambda kind: runs.get(f"BM_{kind}/{n}/{threads}")
            v1, v2, plain, ref = get("Fused_V1"), get("Fused_V2"), get("Fused_Plain"), get("Reference_V1")
            if not (v1 and v2 and plain):
                continue
            ref_ms = f"{ms(ref):.1f}" if ref else "-"
            ratio = f"{ms(ref) / ms(v1):.1f}x" if ref else "-"
            print(f"| {n} | {threads} | {ms(v1):.1f} | {ms(v2):.1f} | {ms(plain):.1f} | {ref_ms} "
                  f"| {rate(v1, threads)} | {rate(v2, threads)} | {rate(plain, threads)} "
                  f"| {ms(v1) / ms(plain):.2f} | {ms(v2) / ms(plain):.2f} | {ratio} |")
    rows = []
    for kind in ("V1Backward", "PlainBackward"):
        for threads in (1, 2):
            for n in (1024, 4096):
                b = runs.get(f"BM_Fused_{kind}/{n}/{threads}")
                if b:
                    rows.append(f"| {kind} | {n} | {threads} | {ms(b):.1f} | {rate(b, threads)} |")
    if rows:
        print("\n| backward | N | threads | ms | GFLOP/s (of peak) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        print("\n".join(rows))
    bf16_table(runs, ms)


def bf16_table(runs, ms):
    """bfloat16 storage against float, and against the bf16 peak probe: the forward, then the
    backward."""
    for suffix in ("", "Backward"):
        bf16_rows(runs, ms, suffix)


def bf16_rows(runs, ms, suffix):
    probe = {t: runs.get(f"BM_Bf16Peak/{t}") for t in (1, 2)}
    bf16_peak = {t: b["GFLOPS"] / 1e9 for t, b in probe.items() if b and "GFLOPS" in b}
    kinds = tuple(k + suffix for k in ("V1", "V2", "Plain"))
    rows = []
    for threads in (1, 2):
        for n in (256, 1024, 2048, 4096, 16384):
            pairs = [(runs.get(f"BM_Bf16_{k}/{n}/{threads}"), runs.get(f"BM_Fused_{k}/{n}/{threads}"))
                     for k in kinds]
            if not all(b and f for b, f in pairs):
                continue
            cells = []
            for b, f in pairs:
                of = (f" ({100 * b['GFLOPS'] / 1e9 / bf16_peak[threads]:.0f}%)"
                      if threads in bf16_peak else "")
                cells.append(f"{ms(b):.1f} | {ms(f) / ms(b):.2f}x | {b['GFLOPS'] / 1e9:.0f}{of}")
            rows.append(f"| {n} | {threads} | " + " | ".join(cells) + " |")
    if not rows:
        return
    if suffix:
        print("\nbackward:")
    elif bf16_peak:
        print("\nbf16 peak (vdpbf16ps): " +
              ", ".join(f"{t} thread{'s' if t > 1 else ''} {p:.0f} GFLOP/s" for t, p in bf16_peak.items()))
    else:
        print("\nbf16 peak: not measured (the build does not target AVX512-BF16)")
    print("\n| N | threads | bf16 V1 ms | V1 float / bf16 | V1 GFLOP/s (of bf16 peak) "
          "| bf16 V2 ms | V2 float / bf16 | V2 GFLOP/s (of bf16 peak) "
          "| bf16 plain ms | plain float / bf16 | plain GFLOP/s (of bf16 peak) |")
    print("| ---: | ---: |" + " ---: |" * 9)
    print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1])
