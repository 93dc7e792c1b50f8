"""Which LoRA adapter sits in which device slot: an LRU cache of `max_loras` slots over the
adapters held on the host (an LRU cache of `max_cpu_loras`), over the adapters registered by name.

A sequence gets its adapter's slot when the scheduler admits it (`acquire`) and gives it back when
it stops running (`release`); a slot with running sequences is never replaced, so the rows of a
step always read the adapter they were admitted with. A request whose adapter finds no free or
idle slot waits. Loading into a slot is the engine's `write` callback (the runner's donated update
of that slot's rows of the stacks, lora/stacks.py): it is queued behind the steps already
dispatched, which read the slot's old contents, and the running rows of other slots go on.

The prefix cache keys each block with `namespace(adapter)`: a block computed under adapter A is
never matched by a request of adapter B or of the base model (namespace None), nor after A's
weights changed (`update`, which bumps A's version).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

from jaxinfer.errors import InvalidRequestError
from jaxinfer.lora_request import LoRARequest
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.lora.peft import LoRAAdapter, LoRAAdapterError, check_lora_name, load_adapter
from jaxinfer.sampling_params import short_repr


@dataclasses.dataclass
class _Registered:
    request: LoRARequest
    rank: int
    scaling: float
    version: int = 0
    pinned: bool = False  # weights set by `update` (no file holds them): never dropped from host


class LoRASlots:
    def __init__(self, cfg: ModelConfig, *, max_loras: int, max_rank: int, max_cpu_loras: int,
                 write: Callable[[int, LoRAAdapter | None], None]):
        self.cfg = cfg
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self._write = write
        self.registered: dict[int, _Registered] = {}
        self._by_name: dict[str, int] = {}
        self._host: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self._slot_of: dict[int, int] = {}           # adapter id -> slot (1..max_loras)
        self._slots: list[int | None] = [None] * (max_loras + 1)  # slot -> adapter id
        self._refs = [0] * (max_loras + 1)
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # idle slots
        self.num_loads = 0

    # ---- registry ---------------------------------------------------------------------------
    def id_of(self, name: str) -> int | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def register(self, request: LoRARequest) -> None:
        """Know `request`'s adapter (reading and checking it if new). Raises LoRAAdapterError or
        InvalidRequestError (a bad name, or a name or id taken by another adapter), changing
        nothing."""
        check_lora_name(request.lora_name)
        if (not isinstance(request.lora_int_id, int) or isinstance(request.lora_int_id, bool)
                or request.lora_int_id < 1):
            raise InvalidRequestError(f"lora_int_id must be a positive integer, got "
                                      f"{short_repr(request.lora_int_id)}", "lora_int_id")
        known = self.registered.get(request.lora_int_id)
        if known is not None:
            if known.request.lora_name != request.lora_name:
                raise InvalidRequestError(f"lora_int_id {request.lora_int_id} is already adapter "
                                          f"'{known.request.lora_name}'", "lora_int_id")
            return
        if request.lora_name in self._by_name:
            raise InvalidRequestError(f"a LoRA adapter named '{request.lora_name}' is already "
                                      f"loaded", "lora_name")
        adapter = load_adapter(request.lora_path, self.cfg, self.max_rank, request.lora_name)
        self.registered[request.lora_int_id] = _Registered(request, adapter.rank, adapter.scaling)
        self._by_name[request.lora_name] = request.lora_int_id
        self._keep_on_host(request.lora_int_id, adapter)

    def unregister(self, name: str) -> None:
        """Forget an adapter no unfinished request uses (the caller checks). Its slot becomes free."""
        lora_id = self._by_name.pop(name)
        del self.registered[lora_id]
        self._host.pop(lora_id, None)
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self._slots[slot] = None
            self._lru.pop(slot, None)

    def update(self, name: str, adapter: LoRAAdapter) -> None:
        """New weights for a registered adapter (same model, rank <= max): kept on the host, pinned,
        and written into its slot at once if it has one (the running rows of that adapter see
        them from the next step)."""
        lora_id = self._by_name.get(name)
        if lora_id is None:
            raise InvalidRequestError(f"no LoRA adapter named '{name}' is loaded", "lora_name")
        entry = self.registered[lora_id]
        entry.version += 1
        entry.pinned = True
        self._keep_on_host(lora_id, adapter)
        slot = self._slot_of.get(lora_id)
        if slot is not None:
            self._write(slot, adapter)

    def namespace(self, lora_id: int) -> tuple | None:
        """The prefix cache's key prefix of an adapter's blocks (None: the base model's)."""
        return None if not lora_id else ("lora", lora_id, self.registered[lora_id].version)

    # ---- slots ------------------------------------------------------------------------------
    def acquire(self, seq) -> bool:
        """Give `seq` its adapter's slot (loading it into a free or idle one); False when every
        slot is in use by running sequences. `seq.lora_slot` is set (0: no adapter)."""
        lora_id = seq.request.lora_id
        if not lora_id:
            seq.lora_slot = 0
            return True
        slot = self._slot_of.get(lora_id)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self._load(slot, lora_id)
        self._refs[slot] += 1
        self._lru.pop(slot, None)
        seq.lora_slot = slot
        return True

    def release(self, seq) -> None:
        slot = getattr(seq, "lora_slot", 0)
        if slot:
            self._refs[slot] -= 1
            if self._refs[slot] == 0:
                self._lru[slot] = None  # most recently used idle slot last
            seq.lora_slot = 0

    def slot_of(self, name: str) -> int | None:
        lora_id = self._by_name.get(name)
        return None if lora_id is None else self._slot_of.get(lora_id)

    def _free_slot(self) -> int | None:
        for slot in range(1, self.max_loras + 1):
            if self._slots[slot] is None:
                return slot
        if not self._lru:
            return None
        slot, _ = self._lru.popitem(last=False)
        del self._slot_of[self._slots[slot]]
        self._slots[slot] = None
        return slot

    def _load(self, slot: int, lora_id: int) -> None:
        adapter = self._host.get(lora_id)
        if adapter is None:  # dropped from the host cache: read it again
            req = self.registered[lora_id].request
            try:
                adapter = load_adapter(req.lora_path, self.cfg, self.max_rank, req.lora_name)
            except LoRAAdapterError as e:
                raise InvalidRequestError(f"LoRA adapter '{req.lora_name}' can no longer be read: "
                                          f"{e}", "model") from e
            self._keep_on_host(lora_id, adapter)
        self._host.move_to_end(lora_id)
        self._write(slot, adapter)
        self._slots[slot] = lora_id
        self._slot_of[lora_id] = slot
        self.num_loads += 1

    def _keep_on_host(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self._host[lora_id] = adapter
        self._host.move_to_end(lora_id)
        droppable = [i for i in self._host if not self.registered[i].pinned and i != lora_id]
        while len(self._host) > self.max_cpu_loras and droppable:
            del self._host[droppable.pop(0)]
