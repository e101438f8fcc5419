"""fully_shard's buffers: parameters and gradients bound to a unit's unsharded buffers while
it is unsharded, and saved activations that refer to a unit by place, not address."""
import collections

from ..._core import BUFFER_PLACES_KEPT
from .params import Saved, set_live, storageless
from .views import tensor_of


class UnitBuffers:
    """The binding of a ShardedModule's parameters and gradients to the daemon's buffers.

    It binds and frees; the operations that fill and release the buffers (unshard, reshard,
    allocate_grad) are the caller's, except `allocate_grads`. `client`: the attached
    ragshard.Client; `param_dtype`: "fp32" or "bf16"; `units`: the ModuleUnits.

    Attributes: `gathers`, a Counter of the units bound to their unsharded buffer (each a
    gather) by unit name; `peak_unsharded`, the most units bound at once so far."""

    def __init__(self, client, param_dtype, units):
        self._client, self._dtype, self._units = client, param_dtype, units
        self._view_cache = {}  # (kind, unit) -> [(array, tensor, views)] (_views_of)
        self._full = {}  # unit -> its unsharded buffer, while bound
        self._by_storage = {}  # the data address of a bound unsharded buffer -> its unit
        self._grads = set()  # units whose gradient buffers are allocated
        self.gathers = collections.Counter()
        self.peak_unsharded = 0

    def _views_of(self, ui, array, kind):
        """(the tensor over `array`, unit `ui`'s parameters' views of it), built once per place
        of the buffer: the client returns the same array while the daemon places the unit's
        buffer at the same address, and the tensors over it are reused."""
        places = self._view_cache.setdefault((kind, ui), [])
        for cached, full, views in places:
            if cached is array:
                return full, views
        full = tensor_of(array, self._dtype)
        views = [full[off:off + numel].view(empty.shape)
                 for (_, off, numel), empty in zip(self._units.views[ui], self._units.empty[ui])]
        if len(places) >= BUFFER_PLACES_KEPT:
            places.pop(0)
        places.append((array, full, views))
        return full, views

    def is_bound(self, ui):
        """True while unit `ui`'s parameters are views of its unsharded buffer."""
        return ui in self._full

    def bind(self, ui):
        """Points unit `ui`'s parameters into its unsharded buffer (once it is unsharded)."""
        full, views = self._views_of(ui, self._client.unsharded(ui), "unsharded")
        self.gathers[self._units.name(ui)] += 1
        self._full[ui] = full
        self.peak_unsharded = max(self.peak_unsharded, len(self._full))
        self._by_storage[full.untyped_storage().data_ptr()] = ui
        for (p, _, _), view in zip(self._units.views[ui], views):
            set_live(p, True)  # first: the assignment below then runs no __torch_function__
            p.data = view

    def free(self, ui):
        """Leaves unit `ui`'s parameters without storage (once it is resharded)."""
        full = self._full.pop(ui, None)
        if full is not None:
            self._by_storage.pop(full.untyped_storage().data_ptr(), None)
        for (p, _, _), empty in zip(self._units.views[ui], self._units.empty[ui]):
            p.data = empty
            set_live(p, False)

    def _bind_grads(self, ui):
        """Points unit `ui`'s .grad into this rank's gradient buffer (once allocated)."""
        _, views = self._views_of(ui, self._client.grad(ui), "grad")
        self._grads.add(ui)
        for (p, _, _), view in zip(self._units.views[ui], views):
            if p.requires_grad:
                if p.device != view.device:
                    # A resharded parameter (a unit that got no gradient reduces zeros) holds a
                    # storageless placeholder; torch takes a .grad only on the same device.
                    p.data = storageless(p.shape, p.dtype, view.device)
                p.grad = view

    def allocate_grads(self, ui):
        """Allocates unit `ui`'s gradient buffer where it is not, and binds the .grad of its
        parameters that require gradients to it."""
        if ui not in self._grads:
            self._client.allocate_grad(ui).wait()
        self._bind_grads(ui)  # again after zero_grad(set_to_none=True) under no_sync

    def scale_grads(self, ui, factor):
        """Multiplies this rank's gradients of unit `ui` (allocated) by `factor`."""
        full, _ = self._views_of(ui, self._client.grad(ui), "grad")
        full.mul_(factor)

    def drop_grads(self, ui):
        """Forgets unit `ui`'s gradient buffer (its reduce-scatter releases it): .grad None."""
        self._grads.discard(ui)
        for p, _, _ in self._units.views[ui]:
            p.grad = None

    def zero_grads(self, set_to_none):
        """Zeroes the gradients bound now (accumulated under no_sync); `set_to_none`: the
        parameters' .grad become None too, bound again when a backward reaches their unit."""
        for ui in self._grads:
            for p, _, _ in self._units.views[ui]:
                if p.grad is not None:
                    p.grad.zero_()
                    if set_to_none:
                        p.grad = None

    def pack(self, t):
        """saved_tensors_hooks: a tensor that lies in a unit's unsharded buffer is saved as its
        place in the unit, since backward may find the unit unsharded at another address."""
        try:
            ui = self._by_storage.get(t.untyped_storage().data_ptr())
        except RuntimeError:
            return t
        if ui is None:
            return t
        return Saved(ui, t.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def unpack(self, x):
        if not isinstance(x, Saved):
            return x
        full = self._full.get(x.unit)
        if full is None:
            raise RuntimeError(f"ragshard: backward needs the parameters of unit "
                               f"'{self._units.name(x.unit)}' while it is resharded (was its "
                               "backward reached without its forward's outputs?)")
        return full.as_strided(x.size, x.stride, x.offset)
