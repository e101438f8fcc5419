"""FSDP2's ranks of one run forked from one process (ragshard.launch --preload's mechanism,
ragshard/_preload.py): tests/python/test_porting.py --fsdp2-launch and bench/fsdp2_report.py
--fsdp2-launch start torch's FSDP2 ranks this way, so that each `import torch` and
`import transformers` is paid once per run rather than once per rank."""
import os
import signal


def fsdp2_launch(world, script, args, preload):
    """`world` processes forked from this one once it has imported the modules `preload`, each
    running `script` with `args` and RANK, WORLD_SIZE and one intra-op thread; when a rank fails
    the others are stopped. Returns the first failing rank's exit code, else 0."""
    from ragshard import _preload
    _preload.import_modules(preload)
    procs = [_preload.fork_rank(script, args, dict(os.environ, RANK=str(r),
                                                   WORLD_SIZE=str(world), OMP_NUM_THREADS="1"),
                                "1") for r in range(world)]
    for p in procs:
        p.start()
    running, code = {p.pid: p for p in procs}, 0
    while running:
        pid, status = os.waitpid(-1, 0)  # the next rank to end
        if running.pop(pid, None) is None:
            continue
        rc = os.waitstatus_to_exitcode(status)
        if rc != 0 and code == 0:
            code = rc if rc > 0 else 128 - rc
            for p in running.values():  # the others may wait for it in a collective
                os.kill(p.pid, signal.SIGKILL)
    return code
