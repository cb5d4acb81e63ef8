"""diffattn.torch against eager PyTorch math: forward + backward, CPU.

Cases (each in its own process, so that its peak memory is its own):
  v2_kernel   the V2 kernel: 16 query heads on 8 kv heads of 64, causal, B = 1
  v1_layer    a V1 layer, E = 1024, 8 DIFF heads (d = 64), causal, B = 1: the
              projections are torch's in both; only the attention differs
for diffattn.torch and for the papers' eager math on the same tensors (or the
same state_dict): two materialised N x N maps per DIFF head, torch autograd.

    PYTHONPATH=build/python python3 examples/python/bench_torch.py [--threads 2] [--n 4096]
        [--long 16384] [--reps 3] [--keep-memory]

With --breakdown it prints instead where diffattn's forward + backward spends
its time: the fused kernels' forward and backward calls (timed around the
bindings) and everything else (autograd, the Python glue; for the layer also
the projections, rotary embedding, lambda and norm), wall and CPU time.

Otherwise it prints the median time of --reps runs (after one warm-up) and each process's
peak resident memory, then runs both implementations alternated step by step in
one process (the fairer comparison on a machine shared with other work). At --long only diffattn runs: the eager math's peak grows
as N^2 and is extrapolated from its peak at --n.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python", "tests"))


# OpenBLAS's names of the cores whose kernels use AVX2 or AVX-512.
AVX2_CORES = {"Haswell", "SkylakeX", "Cooperlake", "SapphireRapids", "Zen", "Excavator"}


def cpu_flags():
    """The CPU's feature flags (/proc/cpuinfo), empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def openblas_core():
    """The kernels OpenBLAS chose for this CPU (openblas_get_corename), if torch's BLAS
    is OpenBLAS and it is loaded; None otherwise."""
    import ctypes
    import torch
    torch.mm(torch.ones(2, 2), torch.ones(2, 2))  # loads the BLAS
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if len(line.split()) >= 6}
    except OSError:
        return None
    for path in sorted(paths):
        if "openblas" not in path and "libblas.so" not in path:
            continue
        try:
            name = ctypes.CDLL(path).openblas_get_corename
        except (OSError, AttributeError):
            continue
        name.restype = ctypes.c_char_p
        return name().decode()
    return None


def make_step(case, impl, n, threads):
    """One forward + backward of `case` by `impl` ("diffattn" or "eager")."""
    import torch
    import diffattn.torch as dt
    import eager_modules as eager

    torch.manual_seed(0)
    if case == "v2_kernel":
        q = torch.randn(1, n, 16, 64, requires_grad=True)
        k = torch.randn(1, n, 8, 64, requires_grad=True)
        v = torch.randn(1, n, 8, 64, requires_grad=True)
        logit = torch.randn(1, n, 8, requires_grad=True)
        g = torch.randn(1, n, 8, 64)

        def step():
            for t in (q, k, v, logit):
                t.grad = None
            if impl == "diffattn":
                out = dt.diff_attention_v2(q, k, v, logit, causal=True, num_threads=threads)
            else:
                out = eager.eager_v2(q, k, v, logit, causal=True)
            out.backward(g)
        return step
    e = 1024
    ref = eager.EagerDiffAttnV1(e, 3, 8)
    if impl == "diffattn":
        layer = dt.MultiheadDiffAttnV1(e, 3, 8, num_threads=threads)
        layer.load_state_dict(ref.state_dict())
    else:
        layer = ref
    x = torch.randn(1, n, e, requires_grad=True)
    g = torch.randn(1, n, e)

    def step():
        layer.zero_grad()
        x.grad = None
        layer(x).backward(g)
    return step


def run_breakdown(case, n, threads, reps):
    """Per step of diffattn: time in the kernels' forward and backward bindings and
    the rest, wall (perf_counter) and CPU (process_time, all threads)."""
    import torch
    import diffattn.torch as dt
    torch.set_num_threads(threads)
    acc = {"forward": [0.0, 0.0], "backward": [0.0, 0.0]}

    def timed(name, f):
        def g(*args, **kw):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return f(*args, **kw)
            finally:
                a = acc["backward" if name.endswith("_backward") else "forward"]
                a[0] += time.perf_counter() - t0
                a[1] += time.process_time() - c0
        return g
    for name in ("diff_attention_v1", "diff_attention_v2", "diff_attention_v1_backward",
                 "diff_attention_v2_backward"):
        setattr(dt._C, name, timed(name, getattr(dt._C, name)))
    step = make_step(case, "diffattn", n, threads)
    step()  # warm-up
    for a in acc.values():
        a[:] = [0.0, 0.0]
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        step()
    wall, cpu = (time.perf_counter() - t0) / reps, (time.process_time() - c0) / reps
    out = {"case": case, "impl": "breakdown", "n": n, "threads": threads, "step_s": wall,
           "step_cpu_s": cpu}
    for k, (w, c) in acc.items():
        out[k + "_s"], out[k + "_cpu_s"] = w / reps, c / reps
    out["other_s"] = wall - out["forward_s"] - out["backward_s"]
    out["other_cpu_s"] = cpu - out["forward_cpu_s"] - out["backward_cpu_s"]
    return out


def run_case(case, impl, n, threads, reps):
    """impl "diffattn" or "eager"; or "both": the two alternated step by step, so
    that the load of a shared machine weighs on both alike."""
    import torch
    torch.set_num_threads(threads)
    impls = ["diffattn", "eager"] if impl == "both" else [impl]
    steps = {i: make_step(case, i, n, threads) for i in impls}
    times = {i: [] for i in impls}
    cpu = {i: [] for i in impls}
    for i in impls:
        steps[i]()  # warm-up
    for _ in range(reps):
        for i in impls:
            t0, c0 = time.perf_counter(), time.process_time()
            steps[i]()
            times[i].append(time.perf_counter() - t0)
            cpu[i].append(time.process_time() - c0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss in KiB)
    out = {"case": case, "impl": impl, "n": n, "threads": threads, "peak_gib": peak}
    for i in impls:
        t = sorted(times[i])
        c = sorted(cpu[i])
        out[i] = {"median_s": t[len(t) // 2], "min_s": t[0], "all_s": times[i],
                  "cpu_median_s": c[len(c) // 2]}
    if impl != "both":
        out.update(out.pop(impl))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--long", type=int, default=16384, help="0: skip")
    p.add_argument("--only-interleaved", action="store_true")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--keep-memory", action="store_true",
                   help="let glibc keep freed memory (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) "
                        "so that the eager math's big tensors reuse pages instead of faulting "
                        "fresh ones in")
    p.add_argument("--breakdown", action="store_true",
                   help="time diffattn's kernel forward, kernel backward and the rest of a step")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--impl", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.case:
        if a.impl == "breakdown":
            print(json.dumps(run_breakdown(a.case, a.n, a.threads, a.reps)))
        else:
            print(json.dumps(run_case(a.case, a.impl, a.n, a.threads, a.reps)))
        return 0

    def child(case, impl, n, reps):
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
        if a.keep_memory:
            env.update(MALLOC_MMAP_THRESHOLD_=str(2**34), MALLOC_TRIM_THRESHOLD_=str(2**36))
        r = subprocess.run([sys.executable, __file__, "--case", case, "--impl", impl, "--n", str(n),
                            "--threads", str(a.threads), "--reps", str(reps)],
                           capture_output=True, text=True, env=env)
        if r.returncode != 0:
            return {"case": case, "impl": impl, "n": n, "error": r.stderr.strip().splitlines()[-1]}
        return json.loads(r.stdout.strip().splitlines()[-1])

    import diffattn
    import torch
    print(f"diffattn {diffattn.__version__} ({diffattn.isa()}), torch {torch.__version__}, "
          f"{a.threads} threads, forward + backward, medians of {a.reps}"
          + (", glibc keeping freed memory" if a.keep_memory else ""))
    blas = openblas_core()
    if blas:
        print(f"torch's BLAS: OpenBLAS, {blas} kernels"
              + (f" (OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']})"
                 if "OPENBLAS_CORETYPE" in os.environ else ""))
        if blas not in AVX2_CORES and "avx2" in cpu_flags():
            print(f"warning: OpenBLAS does not know this CPU and multiplies with its {blas} "
                  "kernels, without AVX2: the eager math and the layers' projections run "
                  "slower than they could; set OPENBLAS_CORETYPE (SkylakeX where the CPU has "
                  "AVX-512, else Haswell) for a fair comparison")
    rows = []
    if a.breakdown:
        for case in ("v2_kernel", "v1_layer"):
            b = child(case, "breakdown", a.n, a.reps)
            rows.append(b)
            if "error" in b:
                print(f"{case:10s} N={a.n} breakdown: {b['error']}")
                continue
            print(f"{case:10s} N={a.n} per step, wall (CPU): total {b['step_s'] * 1e3:.1f} "
                  f"({b['step_cpu_s'] * 1e3:.1f}) ms = kernel forward {b['forward_s'] * 1e3:.1f} "
                  f"({b['forward_cpu_s'] * 1e3:.1f}) + kernel backward {b['backward_s'] * 1e3:.1f} "
                  f"({b['backward_cpu_s'] * 1e3:.1f}) + everything else {b['other_s'] * 1e3:.1f} "
                  f"({b['other_cpu_s'] * 1e3:.1f}) ms")
        print(json.dumps(rows))
        return 0
    for case in (() if a.only_interleaved else ("v2_kernel", "v1_layer")):
        d = child(case, "diffattn", a.n, a.reps)
        e = child(case, "eager", a.n, a.reps)
        rows += [d, e]
        speed = e["median_s"] / d["median_s"] if "median_s" in e and "median_s" in d else None
        print(f"{case:10s} N={a.n}: diffattn {d.get('median_s', 0) * 1e3:8.1f} ms "
              f"(peak {d.get('peak_gib', 0):.2f} GiB), eager {e.get('median_s', 0) * 1e3:8.1f} ms "
              f"(peak {e.get('peak_gib', 0):.2f} GiB)" +
              (f", diffattn {speed:.1f}x faster" if speed else f", eager: {e.get('error')}"))
        if a.long:
            dl = child(case, "diffattn", a.long, 1)
            need = e.get("peak_gib", 0) * (a.long / a.n) ** 2
            rows.append(dl)
            print(f"{case:10s} N={a.long}: diffattn {dl.get('median_s', 0) * 1e3:8.1f} ms "
                  f"(peak {dl.get('peak_gib', 0):.2f} GiB); eager would need about "
                  f"{need:.0f} GiB ({e.get('peak_gib', 0):.2f} GiB x ({a.long}/{a.n})^2), "
                  f"this machine has {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB")
    for case in ("v2_kernel", "v1_layer"):
        b = child(case, "both", a.n, a.reps)
        rows.append(b)
        if "error" in b:
            print(f"{case:10s} N={a.n} interleaved: {b['error']}")
            continue
        d, e = b["diffattn"], b["eager"]
        print(f"{case:10s} N={a.n} interleaved step by step: diffattn {d['median_s'] * 1e3:8.1f} ms, "
              f"eager {e['median_s'] * 1e3:8.1f} ms, diffattn {e['median_s'] / d['median_s']:.1f}x "
              f"faster (medians; per pair: "
              + ", ".join(f"{y / x:.1f}" for x, y in zip(d["all_s"], e["all_s"])) + "); CPU time "
              f"(both threads) {d['cpu_median_s']:.2f} s against {e['cpu_median_s']:.2f} s, "
              f"{e['cpu_median_s'] / d['cpu_median_s']:.1f}x")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
