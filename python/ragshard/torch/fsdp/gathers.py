"""fully_shard's gathers: a unit unsharded (plain or quantized) and bound, prefetched ahead of
its use, and resharded; the hooks say when."""


class UnitGathers:
    """Unshards and reshards a ShardedModule's units, plain or through the quantized gathers.

    `client`: the attached ragshard.Client; `binding`: the UnitBuffers; `quantized`: the
    QuantizedGathers (covering no unit without quantize=); `units`: the ModuleUnits;
    `prefetch`: how many units are unsharded ahead of the one in use (0: on demand). A plain
    prefetch that no forward or backward used is bound and resharded in `drop_prefetches`."""

    def __init__(self, client, binding, quantized, units, prefetch):
        self._client, self._binding, self._quantized = client, binding, quantized
        self._nunits, self._root = len(units), units.root
        self._prefetch = prefetch
        self._started = {}  # unit -> the handle of its plain unshard started ahead

    def is_unsharded(self, ui):
        return self._binding.is_bound(ui)

    def unshard(self, ui):
        """Unit `ui` unsharded and bound (through a prefetch already started, if any)."""
        if self._binding.is_bound(ui):
            return
        if self._quantized.covers(ui):
            self._quantized.gather(ui)
            return
        h = self._started.pop(ui, None) or self._client.unshard(ui)
        h.wait()
        self._binding.bind(ui)

    def prefetch(self, ui):
        """Starts unit `ui`'s unshard ahead of its use, where there is such a unit, prefetching
        is on, and it is not the root, unsharded or started already."""
        if not self._prefetch or not 0 <= ui < self._nunits or ui == self._root or \
                self._binding.is_bound(ui) or ui in self._started or \
                self._quantized.is_started(ui):
            return
        if self._quantized.covers(ui):
            self._quantized.prefetch(ui)
        else:
            self._started[ui] = self._client.unshard(ui)

    def start(self, ui):
        """Starts unit `ui`'s unshard (the root's too) unless it is unsharded or started: the
        next `unshard` binds it (FSDPModule.unshard(async_op=True))."""
        if self._binding.is_bound(ui) or ui in self._started or self._quantized.is_started(ui):
            return
        if self._quantized.covers(ui):
            self._quantized.prefetch(ui)
        else:
            self._started[ui] = self._client.unshard(ui)

    def reshard(self, ui, keep=0):
        """Reshards unit `ui` where it is unsharded; `keep` > 1 keeps it within groups of that
        many local ranks (reshard_after_forward=n; not for quantized units)."""
        if self._binding.is_bound(ui):
            self._client.reshard(ui, 0 if self._quantized.covers(ui) else keep).wait()
            self._binding.free(ui)

    def gather_exact(self, ui):
        """All-gathers unit `ui`'s exact values (a quantized unit's from its fp32 master) and
        binds them."""
        if self._quantized.covers(ui):
            self._quantized.restore_exact(ui)
        self._client.unshard(ui).wait()
        self._binding.bind(ui)

    def drop_prefetches(self):
        """After a backward: the prefetches that no backward used, waited for and resharded."""
        for ui in list(self._started):
            self._started.pop(ui).wait()
            self._binding.bind(ui)
            self.reshard(ui)
        self._quantized.drop_started()

    def wait_releases(self):
        """Waits for the releases that quantized gathers started."""
        self._quantized.wait_releases()
