"""What every ragshard optimizer shares as a `torch.optim.Optimizer`: param groups in torch's
form over a ShardedModule's own parameters, checked by name, and the optimizer state dict in
torch's layout.

A group's `"params"` holds the module's parameters, as `model.parameters()` or
`model.named_parameters()` yields them after fully_shard (the same objects as before it, with
their original names, shapes and `ndim`), or (name, parameter) pairs. Its other keys are the
optimizer's options; each applies to every piece of the group's parameters on every rank, and
is read again at every step, so a change by the user or by a `torch.optim.lr_scheduler` takes
effect at the next step.

`state_dict()` is torch's layout: {"state": {i: {key: value}}, "param_groups": [{option: value,
"params": [i, ...]}]}, i numbering the parameters in group order. A state tensor that is
elementwise holds this rank's elements of the parameter (its pieces in the optimizer range,
in order), flat; scalars (a step count) are as torch keeps them. `load_state_dict` takes what
`state_dict` gave under the same plan; a checkpoint for another world size or plan is
`ragshard.checkpoint.save_dcp` / `load_dcp`.
"""
import torch

__all__ = ["ModuleOptimizer", "piece_ranges"]


def _name(model, p):
    return getattr(p, "_ragshard_name", None) or f"<tensor of shape {list(p.shape)}>"


def piece_ranges(model, skip_matrices=False):
    """{parameter index: [(unit, lo, hi)]}: this rank's pieces of each parameter in its optimizer
    ranges, in tensor order (none on a rank that does not step: another local rank steps the
    same memory)."""
    out = {}
    for ui in model.units() if model.steps else ():
        for pc in model.pieces(ui):
            if skip_matrices and pc.matrix:
                continue
            out.setdefault(pc.index, []).append((ui, pc.lo, pc.hi))
    return out


class ModuleOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer over the parameters of ShardedModule `model`; `defaults` are its
    options (every key a group may set), `params` torch's params or param groups (None: every
    parameter of the module, in one group)."""

    # Whether the optimizer keeps all of its state in the module's state tensors, so that a job
    # that recovers lost ranks in place (docs/recovery.md) can run it.
    recovers = False

    def __init__(self, model, params, defaults):
        self.model = model
        self._owner_name = type(self).__name__
        if model.recovery.enabled and not self.recovers:
            raise ValueError(
                f"{self._owner_name}: the job recovers lost ranks in place, which needs every "
                "optimizer state in the daemon's pool; this optimizer keeps some in the rank "
                "process (docs/recovery.md: every optimizer ragshard offers keeps it there, this "
                "subclass does not): create the job without a recovery deadline to use it")
        if params is None:
            params = list(model.parameters())
        if isinstance(params, torch.Tensor):
            raise TypeError(f"{self._owner_name}: params must be an iterable of parameters or of "
                            f"param groups (dicts), not a {torch.typename(params)}")
        params = list(params)
        if not params:
            raise ValueError(f"{self._owner_name}: got an empty parameter list")
        self._grouped = {}  # parameter index -> its group's index
        super().__init__(params, defaults)

    # -- steps --------------------------------------------------------------------------------

    # Why a closure is refused (step(closure) re-evaluates the loss, which none of these needs).
    _closure_why = "the optimizer needs no re-evaluation of the loss"

    @torch.no_grad()
    def step(self, closure=None, **options):
        """One optimizer step, inside the module's step transaction (ShardedModule.
        optimizer_step), once an asynchronous checkpoint write no longer reads the state."""
        if closure is not None:
            raise ValueError(f"{self._owner_name}: step(closure) is not supported: "
                             f"{self._closure_why}")
        self.model.wait_for_checkpoint_write()
        with self.model.optimizer_step():
            self._step_all(self.model, **options)

    def _step_all(self, model, **options):
        """The step's own work (each optimizer's)."""
        raise NotImplementedError

    # -- groups -------------------------------------------------------------------------------

    def add_param_group(self, param_group):
        """torch's add_param_group, after checking that every parameter is the module's and in
        no other group, and that every option is one of this optimizer's."""
        if not isinstance(param_group, dict):
            raise TypeError(f"{self._owner_name}: a param group must be a dict, got "
                            f"{type(param_group).__name__}")
        unknown = sorted(k for k in param_group
                         if k not in ("params", "param_names") and k not in self.defaults)
        if unknown:
            raise ValueError(f"{self._owner_name}: unknown option '{unknown[0]}' in param group "
                             f"{len(self.param_groups)} (its options: "
                             f"{', '.join(sorted(self.defaults))})")
        given = param_group["params"]
        if isinstance(given, set):
            raise TypeError(f"{self._owner_name}: a group's params must be an ordered collection "
                            "(a list), not a set")
        listed = [given] if isinstance(given, torch.Tensor) else list(given)
        here = set()
        for item in listed:
            p = item[1] if isinstance(item, tuple) else item
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{self._owner_name}: param group {len(self.param_groups)} holds "
                                f"a {type(p).__name__}, not a parameter")
            if not self.model.is_param(p):
                raise ValueError(
                    f"{self._owner_name}: param group {len(self.param_groups)} holds a parameter "
                    f"that is not the sharded module's ({_name(self.model, p)}); pass the "
                    "module's own parameters (model.parameters() or model.named_parameters() "
                    "after fully_shard)")
            index = self.model.param_index(p)
            if index in self._grouped or index in here:
                where = self._grouped.get(index, len(self.param_groups))
                raise ValueError(f"{self._owner_name}: parameter '{_name(self.model, p)}' is in "
                                 f"param group {where} and again in param group "
                                 f"{len(self.param_groups)}; each parameter belongs to one group")
            here.add(index)
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        for p in self.param_groups[-1]["params"]:
            self._grouped[self.model.param_index(p)] = gi
        self._groups_changed()

    def _groups_changed(self):
        """Called after each add_param_group: the subclass updates what it derives from groups."""

    def group_of(self, index):
        """The param group of parameter `index` (the module's numbering), None if in none."""
        gi = self._grouped.get(index)
        return None if gi is None else self.param_groups[gi]

    def _param_ids(self):
        """{parameter index: its number in torch's state dict} (group order)."""
        ids = {}
        for g in self.param_groups:
            for p in g["params"]:
                ids[self.model.param_index(p)] = len(ids)
        return ids

    # -- state dicts in torch's layout -------------------------------------------------------

    def param_state(self, index):
        """This rank's state of parameter `index` as {key: tensor or number} (elementwise tensors
        flat over this rank's elements), or an empty dict where it has none."""
        raise NotImplementedError

    def set_param_state(self, index, state):
        """Loads what param_state(index) returned (under the same plan)."""
        raise NotImplementedError

    def state_dict(self):
        ids = self._param_ids()
        state = {}
        for index, i in ids.items():
            st = self.param_state(index)
            if st:
                state[i] = st
        groups = []
        for g in self.param_groups:
            out = {k: v for k, v in g.items() if k != "params"}
            out["params"] = [ids[self.model.param_index(p)] for p in g["params"]]
            groups.append(out)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or "state" not in state_dict:
            raise ValueError(f"{self._owner_name}.load_state_dict: not an optimizer state dict "
                             "(needs 'state' and 'param_groups')")
        if len(groups) != len(self.param_groups):
            raise ValueError(f"{self._owner_name}.load_state_dict: the state dict has "
                             f"{len(groups)} param groups, this optimizer {len(self.param_groups)}")
        for gi, (saved, g) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(g["params"]):
                raise ValueError(f"{self._owner_name}.load_state_dict: param group {gi} has "
                                 f"{len(saved['params'])} parameters there, {len(g['params'])} "
                                 "here")
        ids = self._param_ids()
        by_id = {i: index for index, i in ids.items()}
        for gi, (saved, g) in enumerate(zip(groups, self.param_groups)):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
            for i in saved["params"]:
                if i not in by_id:
                    raise ValueError(f"{self._owner_name}.load_state_dict: parameter id {i} is "
                                     "not one of this optimizer's")
        for i, st in state_dict["state"].items():
            self.set_param_state(by_id[int(i)], st)

    # -- steps -------------------------------------------------------------------------------

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)
