"""The GPU bundle's Python checks, run by run.sh (scripts/gpu/run.sh) with the machine's python3.

    python3 checks.py BUNDLE OUTDIR nccl|package|training|recovery|quant

Each check writes OUTDIR/checks/<name>.json: {"name", "status": passed|failed|skipped,
"reason", "figures"}; `nccl` prints the NCCL library it finds instead. The package comes from
BUNDLE/python (the client library through ctypes: no numpy or torch needed to import it), the
programs from BUNDLE/bin (on PATH), the training script from BUNDLE/examples.
"""
import glob
import json
import math
import os
import subprocess
import sys
import tempfile
import traceback

BUNDLE, OUT, WHAT = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, os.path.join(BUNDLE, "python"))
EXAMPLE = os.path.join(BUNDLE, "examples", "train_tiny.py")
SMALL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
         "--vocab", "32", "--steps", "5", "--quiet"]
def child_env():
    """This process's environment (read now: LocalCluster sets RAGSHARD_TOKEN_FILE while it runs)
    with the bundle's package on the path."""
    return dict(os.environ, PYTHONPATH=os.path.join(BUNDLE, "python"))
# run.sh found a GPU (nvidia-smi): the CUDA checks are this script's; otherwise run.sh reports
# them as skipped.
GPU = os.environ.get("RAGSHARD_BUNDLE_GPU") == "1"
INV = {"units": [{"name": "a", "tensors": [{"name": "w", "shape": [64, 8], "dtype": "fp32"}]},
                 {"name": "b", "tensors": [{"name": "v", "shape": [96], "dtype": "bf16"}]}]}


def finite(v):
    """v with every non-finite float written as a string (JSON has no NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite(x) for x in v]
    return v


def record(name, status, reason="", **figures):
    os.makedirs(os.path.join(OUT, "checks"), exist_ok=True)
    with open(os.path.join(OUT, "checks", name + ".json"), "w") as f:
        json.dump({"name": name, "status": status, "reason": reason,
                   "figures": finite(figures)}, f, allow_nan=False)
    print(f"{name}: {status}" + (f" ({reason})" if reason else ""), flush=True)


def guarded(name, body):
    """Runs body(); an exception fails the check with its last line."""
    try:
        body()
    except Exception as e:  # every failure is the check's result, not a crash of run.sh
        traceback.print_exc()
        lines = str(e).strip().splitlines() or [""]
        record(name, "failed", f"{type(e).__name__}: {lines[-1]}")


def find_nccl():
    """RAGSHARD_NCCL_LIBRARY, the nvidia-nccl wheel of this python's torch, or the system's."""
    if os.environ.get("RAGSHARD_NCCL_LIBRARY"):
        return os.environ["RAGSHARD_NCCL_LIBRARY"]
    try:
        import nvidia
        for root in nvidia.__path__:
            hits = sorted(glob.glob(os.path.join(root, "**", "libnccl.so*"), recursive=True))
            if hits:
                return hits[0]
    except ImportError:
        pass
    r = subprocess.run(["sh", "-c", "PATH=$PATH:/sbin:/usr/sbin ldconfig -p 2>/dev/null | "
                        "grep -m1 'libnccl.so.2 '"], capture_output=True, text=True)
    return r.stdout.rsplit("=> ", 1)[-1].strip() if "=>" in r.stdout else ""


def package():
    """The package imports under this CPython and a client talks to a bundled planner and a host
    daemon: create a job, register, attach, unshard, reshard, read the pool figures."""
    import ragshard
    from ragshard.cluster import LocalCluster
    with LocalCluster(None, daemons=1, pool_bytes=64 << 20) as c:
        ragshard.create_job(c.planner, "bundle-package", 1)
        client = ragshard.Client(c.planner, c.sockets[0], "bundle-package", 0, c.nodes[0], 30000)
        client.register(json.dumps(INV), True)
        client.attach()
        for u in range(client.units):
            client.unshard(u).wait()
            client.reshard(u).wait()
        st = client.stats()
        if st["pool_peak"] <= 0 or client.units != 2:
            raise RuntimeError(f"unexpected figures: units {client.units}, stats {st}")
        record("python_package", "passed", python=sys.version.split()[0],
               units=client.units, pool_peak_bytes=st["pool_peak"])


def launch(cluster, tmp, job, world, extra, launcher=()):
    out = os.path.join(tmp, job)
    cmd = [sys.executable, "-m", "ragshard.launch", "--planner", cluster.planner, "--job", job,
           "--nproc", str(world), "--sockets", ",".join(cluster.sockets), "--create-job",
           *launcher, EXAMPLE, "--out", out] + SMALL + extra
    r = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{job}: exit {r.returncode}: {(r.stdout + r.stderr)[-1500:]}")
    with open(out + ".json") as f:
        return json.load(f)


def reference(tmp, world, device):
    out = os.path.join(tmp, f"ref-{device}")
    r = subprocess.run([sys.executable, EXAMPLE, "--reference", "--world", str(world),
                        "--device", device, "--out", out] + SMALL, env=child_env(),
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"reference: exit {r.returncode}: {r.stderr[-1500:]}")
    with open(out + ".json") as f:
        return json.load(f)


def worst(a, b):
    """The largest |a - b| / max(1, |b|) over the steps' losses (inf if a loss is not finite,
    which max() alone would skip past)."""
    if len(a) != len(b) or not a:
        raise RuntimeError(f"{len(a)} losses against {len(b)}")
    if not all(math.isfinite(x) for x in a + b):
        return math.inf
    return max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b))


def training():
    cuda_checks = ("training_cuda", "memory_cuda") if GPU else ()
    try:
        import torch
    except ImportError:
        for name in ("training_host",) + cuda_checks:
            record(name, "skipped", f"{sys.executable} has no torch")
        return
    from ragshard.cluster import LocalCluster
    tmp = tempfile.mkdtemp(prefix="ragshard-bundle-")
    host = {}

    def on_host():
        with LocalCluster(None, daemons=1, pool_bytes=128 << 20) as c:
            host["w2"] = launch(c, tmp, "host-w2", 2, [])
            host["w1"] = launch(c, tmp, "host-w1", 1, [])
        diff = worst(host["w2"]["losses"], reference(tmp, 2, "cpu")["losses"])
        status = "passed" if diff <= 1e-5 else "failed"
        record("training_host", status, "" if status == "passed" else
               f"losses differ from one-process PyTorch by {diff:.3g} (> 1e-5)",
               ranks=2, steps=len(host["w2"]["losses"]), max_relative_loss_difference=diff)
    guarded("training_host", on_host)
    if not GPU:
        return
    if not torch.cuda.is_available():
        for name in cuda_checks:
            record(name, "failed", f"nvidia-smi lists a GPU but torch.cuda.is_available() is "
                   f"False in {sys.executable}")
        return
    if "w1" not in host:
        for name in cuda_checks:
            record(name, "skipped", "the host run to compare with failed (training_host)")
        return

    def on_cuda():
        torch.cuda.init()
        free0, total = torch.cuda.mem_get_info()
        with LocalCluster(None, daemons=1, pool_bytes=128 << 20, backend="cuda") as c:
            run = launch(c, tmp, "cuda-w1", 1, ["--device", "cuda"])
            free1, _ = torch.cuda.mem_get_info()  # the daemon's slab is still allocated
        diff = worst(run["losses"], host["w1"]["losses"])
        status = "passed" if diff <= 1e-4 else "failed"
        record("training_cuda", status, "" if status == "passed" else
               f"losses differ from the host backend's by {diff:.3g} (> 1e-4)",
               ranks=1, steps=len(run["losses"]), max_relative_loss_difference=diff,
               cuda_losses=run["losses"], host_losses=host["w1"]["losses"])
        record("memory_cuda", "passed", "", pool_peak_bytes=run["pool_peak_bytes"],
               pool_used_bytes=run["pool_used_bytes"], device_total_bytes=total,
               device_bytes_held_by_the_daemon=free0 - free1,
               note="cudaMemGetInfo (torch.cuda.mem_get_info) before the daemon started and "
               "after training, the rank gone and the daemon still up: its slab and context")
    guarded("training_cuda", on_cuda)


def recovery():
    """A rank lost mid-training recovers in place (docs/recovery.md): SIGKILLed in its backward
    at step 3, restarted by the launcher, it finds its optimizer state and undo copies where it
    left them (on the CUDA backend, in its GPU's slab, as CUDA tensors), rolls back, and the run
    ends with the uninterrupted run's parameters within 1e-6. With a GPU: recovery_cuda, one rank
    on the CUDA backend; without one: recovery_host, 2 ranks on the device-shaped backend (the
    same code, memory reached through copies)."""
    name = "recovery_cuda" if GPU else "recovery_host"
    try:
        import torch
    except ImportError:
        return record(name, "skipped", f"{sys.executable} has no torch")
    from ragshard.cluster import LocalCluster
    if GPU and not torch.cuda.is_available():
        return record(name, "failed", f"nvidia-smi lists a GPU but torch.cuda.is_available() is "
                      f"False in {sys.executable}")
    backend, world, train = ("cuda", 1, ["--device", "cuda"]) if GPU else \
        ("device-shaped", 2, [])
    tmp = tempfile.mkdtemp(prefix="ragshard-bundle-")
    mark = os.path.join(tmp, "killed")
    launcher = ["--max-restarts", "1", "--recovery-deadline", "60"]
    with LocalCluster(None, daemons=1, pool_bytes=128 << 20, backend=backend) as c:
        ref = launch(c, tmp, "rec-ref", world, train, launcher)
        killed = launch(c, tmp, "rec-kill", world,
                        train + ["--kill-at", f"{world - 1}:3:backward:{mark}"], launcher)
    if not os.path.exists(mark):
        return record(name, "failed", "the rank was not killed")
    a = torch.load(os.path.join(tmp, "rec-kill.pt"), map_location="cpu")
    b = torch.load(os.path.join(tmp, "rec-ref.pt"), map_location="cpu")
    delta = max(float((a[k] - b[k]).abs().max()) for k in b) if a.keys() == b.keys() else math.inf
    status = "passed" if delta <= 1e-6 else "failed"
    record(name, status, "" if status == "passed" else
           f"the recovered run's parameters differ from the uninterrupted run's by {delta:.3g}",
           backend=backend, ranks=world, steps=len(killed["losses"]), killed="rank "
           f"{world - 1}, step 3, backward (SIGKILL)", max_abs_parameter_difference=delta,
           losses=killed["losses"], reference_losses=ref["losses"])


def quant():
    """ragshard.quant's int8 and FP8 128x128 block quantize and dequantize on the GPU, on the path
    the quantized gathers take (a shard's Layout from shard_block_ids: 128 x 128 tiles of a 2-D
    tensor, runs of 16,384 of a 1-D one), 64 M elements, against the device's copy bandwidth
    (bytes read + written per second, torch.cuda events, median of 5); the codes and scales
    compared bit for bit with the CPU path's (the client library's kernel) on the same input."""
    try:
        import torch
    except ImportError:
        record("quant_bandwidth", "skipped", f"{sys.executable} has no torch")
        return
    if not torch.cuda.is_available():
        record("quant_bandwidth", "failed", "nvidia-smi lists a GPU but torch.cuda.is_available() "
               f"is False in {sys.executable}")
        return
    from ragshard import quant, quant_gpu
    n, side = 64 << 20, 8192

    def median_seconds(fn, calls=1):
        """The median over 5 (after a warm-up) of the seconds per call of `calls` calls made
        back to back between two events: with 1, each call's host time (Python, the launch)
        is in it; with 10, the host runs ahead as in a training step and the device's time
        per call is what is left."""
        times = []
        for i in range(6):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(calls):
                fn()
            b.record()
            torch.cuda.synchronize()
            if i:
                times.append(a.elapsed_time(b) / 1e3 / calls)
        return sorted(times)[len(times) // 2]

    torch.manual_seed(0)
    x = torch.randn(n, device="cuda")
    xc = x.cpu()
    copy = median_seconds(lambda: x.clone())
    copy_b2b = median_seconds(lambda: x.clone(), 10)
    shapes = {"tiles": {"shape": [side, n // side], "granule_elems": quant.BLOCK * (n // side)},
              "runs": {"shape": [n]}}
    rows, bad = [], []
    for layout, t in shapes.items():
        unit = {"tensors": [dict(t, offset=0, numel=n)]}
        ids, blocks = quant.shard_block_ids(unit, 0, n)
        lay = quant.layout_of(ids)
        path = "triton kernels" if lay is not None and quant_gpu.usable(x) and \
            quant_gpu.fused(lay) else "torch ops"
        if path != "triton kernels":
            bad.append(f"{layout}: the torch path ran, not the Triton kernels (Triton "
                       f"{'missing' if quant_gpu.triton is None else 'present'})")
        for kind in ("int8", "fp8"):
            codes, scales = quant.quantize(x, ids, blocks, kind)
            back = quant.dequantize(codes, scales, ids, kind)
            ccodes, cscales = quant.quantize(xc, ids, blocks, kind)
            cback = quant.dequantize(ccodes, cscales, ids, kind)
            same_codes = torch.equal(codes.cpu().view(torch.uint8), ccodes.view(torch.uint8))
            same_scales = torch.equal(scales.cpu().view(torch.int32), cscales.view(torch.int32))
            same_back = torch.equal(back.cpu().view(torch.int32), cback.view(torch.int32))
            rel = float((back - x).norm() / x.norm())
            q = median_seconds(lambda: quant.quantize(x, ids, blocks, kind))
            d = median_seconds(lambda: quant.dequantize(codes, scales, ids, kind))
            qb = median_seconds(lambda: quant.quantize(x, ids, blocks, kind), 10)
            db = median_seconds(lambda: quant.dequantize(codes, scales, ids, kind), 10)
            rows.append({"layout": layout, "kind": kind, "blocks": blocks, "path": path,
                         "quantize_gbps": 5 * n / q / 1e9, "dequantize_gbps": 5 * n / d / 1e9,
                         "quantize_vs_copy": copy / q * 5 / 8,
                         "dequantize_vs_copy": copy / d * 5 / 8,
                         "quantize_seconds": q, "dequantize_seconds": d,
                         "back_to_back_quantize_vs_copy": copy_b2b / qb * 5 / 8,
                         "back_to_back_dequantize_vs_copy": copy_b2b / db * 5 / 8,
                         "back_to_back_quantize_seconds": qb,
                         "back_to_back_dequantize_seconds": db,
                         "codes_identical_to_cpu": same_codes,
                         "scales_identical_to_cpu": same_scales,
                         "dequantized_identical_to_cpu": same_back,
                         "round_trip_relative_error": rel})
            if not (same_codes and same_scales and same_back):
                bad.append(f"{layout} {kind}: the GPU's codes, scales or values differ from the "
                           "CPU path's")
            if rel > (0.05 if kind == "fp8" else 0.015):
                bad.append(f"{layout} {kind}: round-trip relative error {rel:.3g}")
    record("quant_bandwidth", "failed" if bad else "passed", "; ".join(bad), elements=n,
           copy_gbps=8 * n / copy / 1e9, copy_seconds=copy,
           back_to_back_copy_gbps=8 * n / copy_b2b / 1e9, back_to_back_copy_seconds=copy_b2b,
           kinds=rows,
           note="bytes counted: fp32 in and out for the copy (8 per element), fp32 and one code "
           "byte for quantize and dequantize (5 per element); scales not counted. *_seconds: one "
           "call between two events (its host time in it); back_to_back_*: 10 calls between "
           "two events, per call (the host running ahead, as in a training step); each the "
           "median of 5")


if WHAT == "nccl":
    print(find_nccl())
elif WHAT == "package":
    guarded("python_package", package)
elif WHAT == "training":
    training()
elif WHAT == "recovery":
    guarded("recovery_cuda" if GPU else "recovery_host", recovery)
elif WHAT == "quant":
    guarded("quant_bandwidth", quant)
else:
    sys.exit(f"checks.py: unknown check '{WHAT}'")
