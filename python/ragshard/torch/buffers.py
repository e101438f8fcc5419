"""fully_shard's buffers: parameters and gradients bound to a unit's unsharded buffers while
it is unsharded, and saved activations that refer to a unit by place, not address."""
from .._core import BUFFER_PLACES_KEPT
from .params import Saved, set_live
from .views import tensor_of


class BuffersMixin:
    """ShardedModule's binding of parameters and gradients to the daemon's buffers."""

    def _views_of(self, ui, array, kind):
        """(the tensor over `array`, unit `ui`'s parameters' views of it), built once per place
        of the buffer: the client returns the same array while the daemon places the unit's
        buffer at the same address, and the tensors over it are reused."""
        places = self._view_cache.setdefault((kind, ui), [])
        for cached, full, views in places:
            if cached is array:
                return full, views
        full = tensor_of(array, self.param_dtype)
        views = [full[off:off + numel].view(empty.shape)
                 for (_, off, numel), empty in zip(self._views[ui], self._empty[ui])]
        if len(places) >= BUFFER_PLACES_KEPT:
            places.pop(0)
        places.append((array, full, views))
        return full, views

    def _bind(self, ui):
        """Points unit `ui`'s parameters into its unsharded buffer (once it is unsharded)."""
        full, views = self._views_of(ui, self.client.unsharded(ui), "unsharded")
        self.op_counts["gather"][self._units[ui][0]] += 1
        self._full[ui] = full
        self.peak_unsharded = max(self.peak_unsharded, len(self._full))
        self._by_storage[full.untyped_storage().data_ptr()] = ui
        for (p, _, _), view in zip(self._views[ui], views):
            set_live(p, True)  # first: the assignment below then runs no __torch_function__
            p.data = view

    def _free(self, ui):
        """Leaves unit `ui`'s parameters without storage (once it is resharded)."""
        full = self._full.pop(ui, None)
        if full is not None:
            self._by_storage.pop(full.untyped_storage().data_ptr(), None)
        for (p, _, _), empty in zip(self._views[ui], self._empty[ui]):
            p.data = empty
            set_live(p, False)

    def _bind_grads(self, ui):
        """Points unit `ui`'s .grad into this rank's gradient buffer (once allocated)."""
        _, views = self._views_of(ui, self.client.grad(ui), "grad")
        self._grads.add(ui)
        for (p, _, _), view in zip(self._views[ui], views):
            if p.requires_grad:
                p.grad = view

    def _drop_grads(self, ui):
        self._grads.discard(ui)
        for p, _, _ in self._views[ui]:
            p.grad = None

    def _allocate_grads(self, ui):
        if ui not in self._grads:
            self.client.allocate_grad(ui).wait()
        self._bind_grads(ui)  # again after zero_grad(set_to_none=True) under no_sync

    def _reshard(self, ui, keep=0):
        if ui in self._full:
            self.client.reshard(ui, 0 if ui in self._q else keep).wait()
            self._free(ui)

    def _pack(self, t):
        """saved_tensors_hooks: a tensor that lies in a unit's unsharded buffer is saved as its
        place in the unit, since backward may find the unit unsharded at another address."""
        try:
            ui = self._by_storage.get(t.untyped_storage().data_ptr())
        except RuntimeError:
            return t
        if ui is None:
            return t
        return Saved(ui, t.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def _unpack(self, x):
        if not isinstance(x, Saved):
            return x
        full = self._full.get(x.unit)
        if full is None:
            raise RuntimeError(f"ragshard: backward needs the parameters of unit "
                               f"'{self._units[x.unit][0]}' while it is resharded (was its "
                               "backward reached without its forward's outputs?)")
        return full.as_strided(x.size, x.stride, x.offset)

    def _unshard(self, ui):
        if ui in self._full:
            return
        if ui in self._q:
            self.unshard(ui, self.quantize)
            return
        h = self._handles.pop(("unshard", ui), None) or self.client.unshard(ui)
        h.wait()
        self._bind(ui)

    def _prefetch(self, ui):
        if not self.prefetch or not 0 <= ui < len(self._units) or ui == self._root or \
                ui in self._full or ("unshard", ui) in self._handles or \
                ("qgather", ui) in self._handles:
            return
        if ui in self._q:
            self._handles[("qgather", ui)] = self._q_start(ui)
        else:
            self._handles[("unshard", ui)] = self.client.unshard(ui)
