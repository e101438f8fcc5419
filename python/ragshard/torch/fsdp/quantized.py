"""fully_shard's quantized gathers (quantize="int8" or "fp8"): each rank sends its shard as
block-quantized codes and scales through a byte unit of its own, and every rank dequantizes the
whole unit into the unsharded buffer."""
import json

import torch

from ... import quant
from ..._core import plan_local
from .views import as_tensor


def strategy_sizes(strategy, world):
    """(|p|, |os|) of an AMSP strategy ("k=1,p=AxB,g=AxB,os=AxB" or "k=1,shard=AxB",
    docs/strategy.md), or (world, world) without one. Quantized gathers need one plan unit per
    module unit: k must be 1."""
    if not strategy:
        return world, world
    parts = dict(p.split("=", 1) for p in strategy.split(",") if "=" in p)
    if parts.get("k", "1") != "1":
        raise ValueError(f"quantize: strategy '{strategy}' groups units (k > 1); quantized "
                         "gathers need one plan unit per module unit")

    def size(shape):
        a, b = shape.split("x")
        return int(a) * int(b)
    if "shard" in parts:
        return size(parts["shard"]), size(parts["shard"])
    return size(parts["p"]), size(parts["os"])


def plan_quantized_units(inventory, n_units, world, strategy=None):
    """Adds one byte unit per module unit to `inventory`, sized from the plan the planner will
    make (planning is deterministic): the parameters' plan over |p| positions, the coarsening of
    the os plan under a pinned AMSP strategy (engine/plan_nesting.h). Position r's slice holds
    the codes of its shard (a byte per element) and then one fp32 scale per block of its shard;
    the slice is a multiple of 16 * |os| / |p| bytes, so that the byte unit nests as well.
    Returns {unit: sizes}."""
    q = {}
    p, os_ = strategy_sizes(strategy, world)
    local = json.loads(plan_local(json.dumps(inventory), os_))
    for ui, up in enumerate(local["units"][:n_units]):
        s = int(up["shard_elems"]) * (os_ // p)
        blocks = max(quant.shard_block_ids(up, r, s)[1] for r in range(p))
        s4 = (s + 3) // 4 * 4
        align = 16 * (os_ // p)
        sq = (s4 + 4 * blocks + align - 1) // align * align
        q[ui] = {"S": s, "S4": s4, "SQ": sq, "B": blocks, "index": len(inventory["units"])}
        inventory["units"].append({"name": up["unit"] + ".__q", "tensors": [
            {"name": up["unit"] + ".__q.bytes", "shape": [p * sq], "dtype": "uint8"}]})
    return q


class QuantizedGathers:
    """A ShardedModule's quantized all-gathers of the units that `sizes` (plan_quantized_units)
    covers; none where it is empty (no quantize=).

    `client`: the attached ragshard.Client; `mode`: "int8" or "fp8" (None without units);
    `layout`: the ShardLayout; `binding`: the UnitBuffers that bind a gathered unit; `shards`:
    the RankShards, which keep the exact fp32 master of each quantized unit's whole shard.
    Checks the job's plan against the local one. A gather's byte-unit release is started when
    the gather ends and waited for at the unit's next gather or in `wait_releases`.

    Attribute `gathered_bytes`: {"quantized": bytes the quantized gathers moved, "full": what
    fp32 gathers of the same units would have}."""

    def __init__(self, client, mode, sizes, layout, binding, shards):
        self._client, self.mode, self._q = client, mode, sizes
        self._world, self._binding, self._shards = layout.world, binding, shards
        self._started = {}  # unit -> the handles of a gather started ahead (a prefetch)
        self._releases = {}  # unit -> the handle of its byte unit's release
        self.gathered_bytes = {"quantized": 0, "full": 0}
        for ui, q in sizes.items():
            if layout.shard_elems[ui] != q["S"] or layout.shard_elems[q["index"]] != q["SQ"]:
                raise RuntimeError(
                    f"quantize: the job's plan differs from the local plan for unit {ui} "
                    f"(shard {layout.shard_elems[ui]} vs {q['S']}); create the job with the "
                    "default policy (ragged) and alignment, or with policy auto and a pinned "
                    "strategy of k=1 that fully_shard knows (strategy=, or RAGSHARD_STRATEGY, "
                    "which ragshard.launch --strategy sets)")
            ids = [quant.shard_block_ids(layout.plan["units"][ui], r, q["S"])[0]
                   for r in range(layout.world)]
            q["ids"] = ids
            q["own_ids"] = ids[layout.pos]
            shards.keep_whole_master(ui)

    def covers(self, ui):
        """True where unit `ui` is gathered quantized."""
        return ui in self._q

    def is_started(self, ui):
        return ui in self._started

    def gather(self, ui):
        """Gathers unit `ui` (taking a gather started ahead) and binds it."""
        started = self._started.pop(ui, None) or self._start(ui)
        self._finish(ui, started)

    def prefetch(self, ui):
        """Starts unit `ui`'s gather ahead of its use (`gather` finishes it)."""
        if ui not in self._started:
            self._started[ui] = self._start(ui)

    def _start(self, ui):
        """Starts unit `ui`'s quantized gather: this rank's shard quantized from its fp32
        master into its slice of the byte unit, then the byte unit's all-gather and the unit's
        unsharded buffer, both in flight. Returns their handles."""
        q = self._q[ui]
        pending = self._releases.pop(ui, None)
        if pending is not None:
            pending.wait()  # the last gather's release of the byte unit
        master = self._shards.masters[ui]
        # The byte unit's shard persists: where the master has not changed since it was
        # quantized (a backward's gather after its forward's), its codes are still there. Every
        # write to the master (the optimizer's, through views, a load's) moves its version.
        if q.get("quantized") != (id(master), master.data_ptr(), master._version):
            codes, scales = quant.quantize(master, q["own_ids"], q["B"], self.mode)
            mine = as_tensor(self._client.param_shard(q["index"]))
            mine[:q["S"]] = codes.view(torch.uint8)
            if q["B"]:
                mine[q["S4"]:q["S4"] + 4 * q["B"]] = scales.contiguous().view(torch.uint8)
            q["quantized"] = (id(master), master.data_ptr(), master._version)
        return self._client.unshard(q["index"]), self._client.allocate_unsharded(ui)

    def _finish(self, ui, started):
        """Waits for a started quantized gather, dequantizes every rank's codes into the
        unit's unsharded buffer and binds the unit. The byte unit's release is started and
        waited for later (the daemon runs a job's operations in order): at the unit's next
        gather or at the end of the backward."""
        q, qi = self._q[ui], self._q[ui]["index"]
        for h in started:
            h.wait()
        allq = as_tensor(self._client.unsharded(qi)).view(self._world, q["SQ"])
        full = as_tensor(self._client.unsharded(ui))
        s, s4, b = q["S"], q["S4"], q["B"]
        for r, ids in enumerate(q["ids"]):
            # Rank r's codes and scales where the gather put them (no copy: S4 and SQ keep the
            # scales 4-byte aligned), into rank r's slots of the unit.
            quant.dequantize(allq[r, :s], allq[r, s4:s4 + 4 * b].view(torch.float32), ids,
                             self.mode, out=full[r * s:(r + 1) * s])
        self._releases[ui] = self._client.reshard(qi)
        self._binding.bind(ui)
        self.gathered_bytes["quantized"] += self._world * q["SQ"]
        self.gathered_bytes["full"] += self._world * q["S"] * 4

    def drop_started(self):
        """Gathers started ahead that no forward or backward used: waited for, and their
        buffers released."""
        for ui in list(self._started):
            for h in self._started.pop(ui):
                h.wait()
            self._client.reshard(self._q[ui]["index"]).wait()
            self._client.reshard(ui).wait()

    def wait_releases(self):
        """Waits for the byte units' releases started so far."""
        for ui in list(self._releases):
            self._releases.pop(ui).wait()

    def restore_exact(self, ui):
        """Puts the exact fp32 values back into quantized unit `ui`'s parameter shard (not the
        last dequantized ones), for a gather of the unit's exact values."""
        as_tensor(self._client.param_shard(ui)).copy_(self._shards.masters[ui])
