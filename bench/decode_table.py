#!/usr/bin/env python3
"""Turns bench_decode's JSON output into the README's decoding tables, and
checks the decoding targets against it.

    ./build/bench/bench_decode --benchmark_min_time=0.3 --benchmark_repetitions=3 \\
        --benchmark_report_aggregates_only=true \\
        --benchmark_out=decode.json --benchmark_out_format=json
    python3 bench/decode_table.py decode.json [more runs.json ...]

With several files (runs of the same binary), the tables show the first
run, and the targets table gives each target's figure in every run and how
many runs meet it. Every
figure is a ratio measured within one benchmark (step against the probe read
between its steps, layer against the baseline alternated step by step, two
threads against one), so that a shared host's drift between benchmarks does
not enter it.
"""
import json
import sys

# (benchmark name, table label, short name)
LAYERS = [("V1", "V1, 8 DIFF heads, 8 kv pairs", "V1"),
          ("V2", "V2, 16 q heads on 8 kv heads", "V2"),
          ("Plain8", "GQA 8 q on 8 kv", "GQA 8 q"),
          ("Plain16", "GQA 16 q on 8 kv", "GQA 16 q")]
PROBE_TARGET = 0.80     # every step at M >= 32k, 2 threads, against the probe
BASELINE_TARGET = 1.10  # V2's time over GQA 8 q's
THREADS_TARGET = 1.7    # MQA, 2 threads against 1


def load(path):
    """The median (or only) figures of each benchmark, by name without suffixes."""
    runs = {}
    for b in json.load(open(path))["benchmarks"]:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        name = b.get("run_name", b["name"])
        for suffix in ("/manual_time", "/real_time"):
            name = name.replace(suffix, "")
        runs[name] = b
    return runs


def gbs(b):
    return b["bytes"] / 1e9


def tables(runs):
    probe = {t: runs.get(f"BM_ReadBandwidth/{t}") for t in (1, 2)}
    if probe[1] and probe[2]:
        print(f"`BM_ReadBandwidth`: {gbs(probe[1]):.1f} GB/s with 1 thread, "
              f"{gbs(probe[2]):.1f} GB/s with 2\n")
    print("| decode step, B = 1 | M = 4k | M = 32k | M = 128k "
          "| 32k GB/s (of probe) | 128k GB/s (of probe) |")
    print("|---|---:|---:|---:|---:|---:|")
    for key, label, _ in LAYERS:
        step = {m: runs.get(f"BM_Decode_{key}/{m}/1/2/0") for m in (4096, 32768, 131072)}
        ms = lambda b: f"{b['real_time']:.3g} ms" if b else "-"
        rate = lambda b: f"{gbs(b):.1f} ({b['of_probe']:.2f})" if b else "-"
        print(f"| {label} | {ms(step[4096])} | {ms(step[32768])} | {ms(step[131072])} "
              f"| {rate(step[32768])} | {rate(step[131072])} |")
    b8 = [(short, runs.get(f"BM_Decode_{key}/4096/8/2/0")) for key, _, short in LAYERS]
    b8 = [f"{name} {b['real_time']:.3g} ms ({b['of_probe']:.2f})" for name, b in b8 if b]
    if b8:
        print("\nB = 8 at M = 4k, 2 threads (of probe): " + ", ".join(b8))
    print("\n| `vs_baseline`, 2 threads | M = 32k | M = 128k | B = 8, M = 4k |")
    print("|---|---:|---:|---:|")
    for key, label in (("V2", "V2"), ("Plain16", "GQA 16 q"), ("V1", "V1 (twice V2's bytes)")):
        cells = [runs.get(f"BM_DecodeVsBaseline_{key}/{a}/2") for a in ("32768/1", "131072/1",
                                                                          "4096/8")]
        print(f"| {label} | " + " | ".join(f"{c['vs_baseline']:.2f}" if c else "-" for c in cells)
              + " |")
    one, two = runs.get("BM_Decode_MQA/262144/1/1/0"), runs.get("BM_Decode_MQA/262144/1/2/0")
    if one and two:
        print(f"\nMQA (8 q heads on 1 kv head of 128, M = 256k): {one['real_time']:.3g} ms on 1 "
              f"thread, {two['real_time']:.3g} ms on 2 ({one['real_time'] / two['real_time']:.2f}x)")


def targets(all_runs):
    """Each target's figure in every run, and how many runs meet it."""
    rows = []
    for key, _, short in LAYERS:
        for m, mk in ((32768, "32k"), (131072, "128k")):
            vals = [r.get(f"BM_Decode_{key}/{m}/1/2/0") for r in all_runs]
            rows.append((f"{short} at {mk}: of the probe >= {PROBE_TARGET:.2f}",
                         [v["of_probe"] if v else None for v in vals], lambda x: x >= PROBE_TARGET))
    for a, label in (("32768/1", "at 32k"), ("131072/1", "at 128k"), ("4096/8", "with B = 8 at 4k")):
        vals = [r.get(f"BM_DecodeVsBaseline_V2/{a}/2") for r in all_runs]
        rows.append((f"V2 {label}: time over GQA 8 q's <= {BASELINE_TARGET:.2f}",
                     [v["vs_baseline"] if v else None for v in vals],
                     lambda x: x <= BASELINE_TARGET))
    vals = [r.get("BM_DecodeThreads_MQA/262144/1") for r in all_runs]
    rows.append((f"MQA at 256k: 2 threads over 1 >= {THREADS_TARGET}",
                 [v["speedup"] if v else None for v in vals], lambda x: x >= THREADS_TARGET))
    print(f"\n| target | {' | '.join(f'run {i + 1}' for i in range(len(all_runs)))} | met |")
    print("|---|" + "---:|" * (len(all_runs) + 1))
    for name, vals, ok in rows:
        got = [v for v in vals if v is not None]
        if not got:
            continue
        met = sum(1 for v in got if ok(v))
        cells = " | ".join(f"{v:.3f}" if v is not None else "-" for v in vals)
        print(f"| {name} | {cells} | {met} of {len(got)} |")


def main(paths):
    all_runs = [load(p) for p in paths]
    tables(all_runs[0])
    targets(all_runs)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
