"""fully_shard's quantized gathers (quantize="int8" or "fp8"): each rank sends its shard as
block-quantized codes and scales through a byte unit of its own, and every rank dequantizes the
whole unit into the unsharded buffer."""
import json

import torch

from .. import quant
from .._core import plan_local
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


class QuantizedGatherMixin:
    """ShardedModule's quantized all-gather."""

    def _check_quantized_units(self):
        """Checks the job's plan against the local one and sets up the block ids and the fp32
        masters of the quantized units."""
        for ui, q in self._q.items():
            if self.shard_elems[ui] != q["S"] or \
                    self.shard_elems[q["index"]] != q["SQ"]:
                raise RuntimeError(
                    f"quantize: the job's plan differs from the local plan for unit {ui} "
                    f"(shard {self.shard_elems[ui]} vs {q['S']}); create the job with the "
                    "default policy (ragged) and alignment, or with policy auto and a pinned "
                    "strategy of k=1 that fully_shard knows (strategy=, or RAGSHARD_STRATEGY, "
                    "which ragshard.launch --strategy sets)")
            ids = [quant.shard_block_ids(self.plan["units"][ui], r, q["S"])[0]
                   for r in range(self.world)]
            q["ids"] = ids
            q["own_ids"] = ids[self.pos]
            # The exact fp32 master of this rank's shard: the unsharded buffer's slots hold
            # dequantized values once a quantized gather has run.
            self.masters[ui] = as_tensor(self.client.param_shard(ui)).clone()

    def unshard(self, ui, quantize=None):
        """All-gathers unit `ui`; with quantize="int8" or "fp8" each rank sends its shard as
        block-quantized codes and scales (about a quarter of the bytes) and every rank
        dequantizes the whole unit into the unsharded buffer."""
        q = self._q.get(ui)
        if quantize is None or q is None:
            if quantize is not None:
                raise ValueError(f"unit {ui} was not set up for quantized gathers")
            self.client.unshard(ui).wait()
            self._bind(ui)
            return
        if quantize != self.quantize:
            raise ValueError(f"quantize: this module gathers {self.quantize}, not {quantize}")
        started = self._handles.pop(("qgather", ui), None) or self._q_start(ui)
        self._q_finish(ui, started)

    def _q_start(self, ui):
        """Starts unit `ui`'s quantized gather (at once, or as a prefetch): this rank's shard
        quantized from its fp32 master into its slice of the byte unit, then the byte unit's
        all-gather and the unit's unsharded buffer, both in flight. Returns their handles."""
        q = self._q[ui]
        pending = self._handles.pop(("qreshard", ui), None)
        if pending is not None:
            pending.wait()  # the last gather's release of the byte unit
        master = self.masters[ui]
        # The byte unit's shard persists: where the master has not changed since it was
        # quantized (a backward's gather after its forward's), its codes are still there. Every
        # write to the master (the optimizer's, through views, a load's) moves its version.
        if q.get("quantized") != (id(master), master.data_ptr(), master._version):
            codes, scales = quant.quantize(master, q["own_ids"], q["B"], self.quantize)
            mine = as_tensor(self.client.param_shard(q["index"]))
            mine[:q["S"]] = codes.view(torch.uint8)
            if q["B"]:
                mine[q["S4"]:q["S4"] + 4 * q["B"]] = scales.contiguous().view(torch.uint8)
            q["quantized"] = (id(master), master.data_ptr(), master._version)
        return self.client.unshard(q["index"]), self.client.allocate_unsharded(ui)

    def _q_finish(self, ui, started):
        """Waits for a started quantized gather, dequantizes every rank's codes into the
        unit's unsharded buffer and binds the unit. The byte unit's release is started and
        waited for later (the daemon runs a job's operations in order): at the unit's next
        gather or at the end of the backward."""
        q, qi = self._q[ui], self._q[ui]["index"]
        for h in started:
            h.wait()
        allq = as_tensor(self.client.unsharded(qi)).view(self.world, q["SQ"])
        full = as_tensor(self.client.unsharded(ui))
        s, s4, b = q["S"], q["S4"], q["B"]
        for r, ids in enumerate(q["ids"]):
            # Rank r's codes and scales where the gather put them (no copy: S4 and SQ keep the
            # scales 4-byte aligned), into rank r's slots of the unit.
            quant.dequantize(allq[r, :s], allq[r, s4:s4 + 4 * b].view(torch.float32), ids,
                             self.quantize, out=full[r * s:(r + 1) * s])
        self._handles[("qreshard", ui)] = self.client.reshard(qi)
        self._bind(ui)
        self.gathered_bytes["quantized"] += self.world * q["SQ"]
        self.gathered_bytes["full"] += self.world * q["S"] * 4

    def _q_drop_started(self):
        """Quantized prefetches that no forward or backward used: waited for, and their
        buffers released."""
        for key in [k for k in self._handles if k[0] == "qgather"]:
            for h in self._handles.pop(key):
                h.wait()
            self.client.reshard(self._q[key[1]]["index"]).wait()
            self.client.reshard(key[1]).wait()
