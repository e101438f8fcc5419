"""The FSDP units of a ShardedModule: the policy's submodules and "root", the modules that borrow
tied weights across units, the inventory fully_shard registers for them, and the units as the
job's plan groups them (ModuleUnits, which every part of the module reads)."""
import torch

from .params import storageless
from .views import DTYPES


def policy_units(module, units, ignored=()):
    """[(name, submodule or None, [(fqn, parameter)])]: the submodules `units(module)` returns,
    each with its parameters not in an earlier one, then "root" (None) with the parameters left
    over; units without parameters are left out, and so are the parameters whose id is in
    `ignored` (fully_shard's ignored_params: they stay plain parameters of the module, neither
    sharded nor reduced, as FSDP2 leaves them). Raises ValueError for a unit that is not a
    submodule or whose forward is never called (a container)."""
    names = {id(p): n for n, p in module.named_parameters()}
    seen = set(ignored)
    out = []
    for sub in units(module):
        sub_name = next((n for n, m in module.named_modules() if m is sub), None)
        if sub_name is None:
            raise ValueError(f"fully_shard: unit {type(sub).__name__} is not a submodule of "
                             "the module")
        if type(sub).forward is torch.nn.Module.forward:
            # A container (ModuleList, ModuleDict): its forward is never called, so its hooks
            # would never gather it.
            raise ValueError(
                f"fully_shard: unit '{sub_name}' is a {type(sub).__name__}, whose forward is "
                f"never called (its children are called one by one); pass its children as "
                f"units instead, e.g. units=lambda m: list(m.{sub_name or 'layers'})")
        params = [(names[id(p)], p) for p in sub.parameters() if id(p) not in seen]
        seen.update(id(p) for _, p in params)
        if params:
            out.append((sub_name, sub, params))
    rest = [(n, p) for n, p in module.named_parameters() if id(p) not in seen]
    if rest:
        out.append(("root", None, rest))
    return out


def find_ties(module, units):
    """Tied weights: [(m, [parameters], inside)] for every module m that holds, as its own
    parameter, one that a unit of `units` (policy_units) outside it owns (an output head holding
    the embedding's weight); `inside`: m is inside a unit. Such a module gathers that unit for
    its forward and its backward. Inside a unit it reshards it after its forward as the unit
    does; outside every unit (in the root) it keeps it until the unit's post-backward, since its
    backward comes next (FSDP2 keeps its root unsharded after forward for the same reason)."""
    owner = {id(p): sub for _, sub, params in units if sub is not None for _, p in params}
    subs = [sub for _, sub, _ in units if sub is not None]
    out = []
    for m in module.modules():
        tied = [p for p in m.parameters(recurse=False)
                if id(p) in owner and not _nested(m, owner[id(p)])]
        if tied:
            inside = any(any(x is m for x in sub.modules()) for sub in subs)
            out.append((m, tied, inside))
    return out


def _nested(a, b):
    """True when module a contains module b or b contains a."""
    return any(m is b for m in a.modules()) or any(m is a for m in b.modules())


def unit_inventory(units, param_dtype, granule, optimizer):
    """The inventory entries of `units` (policy_units): each parameter with its shape, dtype,
    granule(name, p) and, for matrices, optimizer(name, p)."""
    return [{"name": uname, "tensors": [
        {"name": n, "shape": list(p.shape), "dtype": param_dtype, "granule": granule(n, p),
         "optimizer": optimizer(n, p) if p.dim() == 2 else "elementwise"}
        for n, p in params]} for uname, _, params in units]


def group_units(plan, units, quantized):
    """`units` (policy_units) as `plan` covers them: policy auto may cover several consecutive
    units with one plan unit (its "members"), which is gathered before its first member's
    forward, resharded after its last member's, and reduce-scattered once every parameter of
    the group has its gradient. Returns [(plan unit name, [submodules] or None (root),
    [(fqn, parameter)])]. `quantized`: quantized gathers, which need one plan unit per unit."""
    groups, i = [], 0
    for up in plan["units"]:
        if i >= len(units):
            break
        members = list(up.get("members") or [up["unit"]])
        here = [u[0] for u in units[i:i + len(members)]]
        if here != members:
            raise RuntimeError(f"plan unit {up['unit']} covers {members}; this module's units "
                               f"there are {here} (do all ranks wrap the same model?)")
        if len(members) > 1 and quantized:
            raise ValueError("quantize: needs one plan unit per module unit; create the job "
                             "with policy ragged")
        subs = [u[1] for u in units[i:i + len(members)]]
        params = [p for u in units[i:i + len(members)] for p in u[2]]
        groups.append((up["unit"], None if subs[0] is None else subs, params))
        i += len(members)
    if i != len(units):
        raise RuntimeError(f"the plan covers {i} of this module's {len(units)} units")
    return groups


class ModuleUnits:
    """A ShardedModule's units as the plan groups them, and its parameters in unit order: the
    context every part of the module reads; none changes it after construction.

    Fields:
    * groups: [(plan unit name, [submodules] or None for the root, [(fqn, parameter)])];
    * root: the index of the root unit (the parameters outside every policy unit), or None;
    * borrowers: find_ties's tied weights, [(module, [parameters], inside a unit)];
    * views: per unit, [(parameter, offset, numel)]: where each parameter lies in its unit;
    * empty: per unit, each parameter's shape as a tensor with no storage (of the parameter
      dtype), what a parameter holds while its unit is resharded;
    * names, offsets: by parameter index (unit order), its name and its offset in its unit;
    * nparams: the number of parameters.
    """

    def __init__(self, groups, borrowers, places, param_dtype):
        """`places`: tensor_places of the plan (layout.py)."""
        self.groups = groups
        self.borrowers = borrowers
        self.root = len(groups) - 1 if groups and groups[-1][1] is None else None
        self.views, self.empty, self.names, self.offsets = [], [], [], []
        self._index = {}  # id(parameter) -> its index
        for _, _, params in groups:
            views = []
            for n, p in params:
                place = places[n]
                self._index[id(p)] = len(self.names)
                self.names.append(n)
                self.offsets.append(place.offset)
                views.append((p, place.offset, place.numel))
            self.views.append(views)
            self.empty.append([storageless(p.shape, DTYPES[param_dtype]) for p, _, _ in views])
        self.nparams = len(self.names)

    def __len__(self):
        return len(self.groups)

    def name(self, ui):
        return self.groups[ui][0]

    def params(self, ui):
        """[(fqn, parameter)] of unit `ui`, in plan order."""
        return self.groups[ui][2]

    def index_of(self, p):
        """The index of parameter `p` in unit order, or None where it is not the module's."""
        return self._index.get(id(p))
