#!/usr/bin/env python3
"""Turns bench_attention's JSON output into the README's table.

    ./build/bench/bench_attention --benchmark_out=bench.json --benchmark_out_format=json
    python3 bench/table.py bench.json
"""
import json
import sys


def main(path):
    runs = {}
    for b in json.load(open(path))["benchmarks"]:
        runs[b["name"].replace("/real_time", "")] = b
    peak = {t: runs[f"BM_FmaPeak/{t}"]["GFLOPS"] / 1e9 for t in (1, 2)}
    print(f"FMA peak: 1 thread {peak[1]:.0f} GFLOP/s, 2 threads {peak[2]:.0f} GFLOP/s\n")
    print("| N | threads | V1 ms | V2 ms | plain ms | reference V1 ms "
          "| V1 GFLOP/s (of peak) | V1 / plain | V2 / plain | reference / V1 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for threads in (1, 2):
        for n in (256, 1024, 2048, 4096, 16384):
            get = lambda kind: runs.get(f"BM_{kind}/{n}/{threads}")
            v1, v2, plain, ref = get("Fused_V1"), get("Fused_V2"), get("Fused_Plain"), get("Reference_V1")
            if not (v1 and v2 and plain):
                continue
            ms = lambda b: b["real_time"]  # the benchmarks report milliseconds
            gflops = v1["GFLOPS"] / 1e9
            ref_ms = f"{ms(ref):.1f}" if ref else "-"
            ratio = f"{ms(ref) / ms(v1):.1f}x" if ref else "-"
            print(f"| {n} | {threads} | {ms(v1):.1f} | {ms(v2):.1f} | {ms(plain):.1f} | {ref_ms} "
                  f"| {gflops:.0f} ({100 * gflops / peak[threads]:.0f}%) | {ms(v1) / ms(plain):.2f} "
                  f"| {ms(v2) / ms(plain):.2f} | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1])
