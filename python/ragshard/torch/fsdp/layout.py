"""Where this rank's shards lie in a job's plan: what a ShardedModule reads from its client once,
when attached, and what its parts share, read-only, from then on."""
import collections
import dataclasses

from .params import WHOLE_MATRIX

# A tensor's place in the plan: its unit, its elements [offset, offset + numel) of the unit, its
# whole-matrix optimizer kind (WHOLE_MATRIX's 'matrix' or 'shampoo'; None for elementwise), the
# owner (an os position) of a whole-matrix tensor, its offset in that owner's buffer (the
# owner's matrices packed in plan order) and Shampoo's block side (0: one block).
Place = collections.namedtuple("Place", "unit offset numel kind owner packed block")


def tensor_places(plan):
    """{tensor name: Place} of every tensor of `plan`."""
    places = {}
    os_units = next((f["units"] for f in plan.get("factors", [])
                     if f["component"] == "os"), plan["units"])
    for ui, (up, ou) in enumerate(zip(plan["units"], os_units)):
        owned = {}  # owner -> the elements of its matrices packed so far
        for t, ot in zip(up["tensors"], ou["tensors"]):
            kind = WHOLE_MATRIX.get(ot.get("optimizer"))
            owner, packed = int(ot.get("owner_rank", -1)), 0
            if kind is not None:
                packed = owned.get(owner, 0)
                owned[owner] = packed + int(t["numel"])
            places[t["name"]] = Place(ui, int(t["offset"]), int(t["numel"]), kind, owner,
                                      packed, int(ot.get("shampoo_block", 0)))
    return places


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """This rank's place in the job's plan, under the job's AMSP factors (engine/sharding.h).

    The parameter shard is position `pos` of the plan's `world` (p); the gradient shard is
    position `gpos` of the g layout, and this rank's optimizer range position `ospos` of the os
    layout, inside both. With p = g = os (HSDP or FSDP) the three are one shard of a group
    repeated `replicas` times.

    Fields:
    * plan: the job's plan (ragshard.plan_of), and places: tensor_places(plan);
    * world, rank: the job's world size and this rank;
    * replicas: W / |g|, the gradients' replicas (all-reduced);
    * pos, gpos, ospos: this rank's positions in the p, g and os layouts;
    * steps: False where another local rank steps this rank's optimizer range in the same memory;
    * os_group: this rank's os group (group 0 holds every os position once);
    * shard_elems, grad_elems: each plan unit's parameter and gradient shard, in elements;
    * os_elems, os_at: each plan unit's optimizer range on this rank: os_elems[u] elements at
      os_at[u] = (offset in the parameter shard, offset in the gradient shard);
    * group_sizes: (|p|, |g|, |os|).
    """
    plan: dict
    places: dict
    world: int
    rank: int
    replicas: int
    pos: int
    gpos: int
    ospos: int
    steps: bool
    os_group: int
    shard_elems: list
    grad_elems: list
    os_elems: list
    os_at: list
    group_sizes: tuple

    @property
    def factored(self):
        """True where the optimizer range is less than the parameter shard (separate factors:
        an update gather follows each step)."""
        return self.os_elems != self.shard_elems

    @classmethod
    def read(cls, client, plan):
        """The layout of attached `client` under `plan`."""
        units = range(len(plan["units"]))
        layouts = [client.layout(u) for u in units]
        first = layouts[0]
        world = client.world_size
        sizes = {f["component"]: int(f["world_size"]) for f in plan.get("factors", [])}
        return cls(plan=plan, places=tensor_places(plan), world=world, rank=client.rank,
                   replicas=client.replicas, pos=first["p"], gpos=first["g"],
                   ospos=first["os"], steps=first["steps"], os_group=first["os_group"],
                   shard_elems=[client.shard_elems(u) for u in units],
                   grad_elems=[lay["grad_elems"] for lay in layouts],
                   os_elems=[lay["os_elems"] for lay in layouts],
                   os_at=[(lay["os_param"], lay["os_grad"]) for lay in layouts],
                   group_sizes=(world, sizes.get("g", world), sizes.get("os", world)))
