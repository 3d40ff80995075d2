"""The adapters of one engine: a registry by name, a host cache and the device slots.

Three levels, as vLLM's ``LRUCacheWorkerLoRAManager`` / S-LoRA:

* **registered** adapters (name -> source folder and a ``lora_id`` unique for the engine's
  life, so a name loaded again with new weights never meets the old one's cached KV blocks);
* the **host cache**: up to ``max_cpu_loras`` adapters' tensors in memory, least recently
  used dropped first (re-read from their folder when needed); an adapter with live requests
  is pinned there, so a step never reads the disk;
* **device slots**: ``max_loras`` stacked buffers per target module; a step's adapters are
  put into slots least-recently-used first (the scheduler admits at most ``max_loras``
  distinct adapters among running requests).

Unloading removes the name at once (new requests get 404) but keeps the weights until the
requests that use them finish, so no running request fails.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .layers import LoRABatch, LoRALinearMethod
from .peft_format import TARGET_MODULES, LoRAError, LoRAWeights, load_peft_adapter

log = logging.getLogger(__name__)

# Kiln module -> the Hugging Face modules of its parts, in output order.
_PARTS = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "o_proj": ["o_proj"],
          "gate_up_proj": ["gate_proj", "up_proj"], "down_proj": ["down_proj"]}


@dataclass
class LoRAConfig:
    """``--max-loras`` (device slots), ``--max-lora-rank`` (buffers' rank, 1..64),
    ``--max-cpu-loras`` (host cache; None: ``max_loras``), ``--lora-dir`` (``root``: adapter
    paths are resolved under it and may not leave it; None: any path)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    root: str | None = None

    def resolve(self, path: str | Path) -> Path:
        """The adapter folder ``path`` names: relative to ``root`` when one is set (an absolute
        path must lie inside it).  Raises LoRAError (``InvalidAdapter``) for a path that
        leaves ``root``."""
        p = Path(path)
        if self.root is None:
            return p
        root = Path(self.root).resolve()
        full = (p if p.is_absolute() else root / p).resolve()
        if full != root and root not in full.parents:
            raise LoRAError(f"adapter path {str(path)!r} is outside --lora-dir {self.root}; give a folder inside it "
                            "(a relative path is taken from there)")
        return full

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 64:
            raise ValueError(f"max_lora_rank must be in 1..64, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.root is not None and not Path(self.root).is_dir():  # adapters may be fetched into it later
            log.warning("--lora-dir %s does not exist (yet): adapters load from it once they are there", self.root)


@dataclass
class LoRAInfo:
    """What ``/v1/models`` shows of an adapter."""

    name: str
    lora_id: int
    path: str
    rank: int
    target_modules: list[str]
    created: int


@dataclass
class _Entry:
    info: LoRAInfo
    weights: LoRAWeights | None
    num_requests: int = 0
    removed: bool = False
    extra: dict = field(default_factory=dict)


class LoRAManager:
    """Owns the LoRA transform of ``model`` and its adapters.

    Args:
        model: the loaded base model (``LlamaForCausalLM``); its target linears are wrapped.
        model_config: the base's ``ModelConfig`` (shape checks).
        config: slot, rank and cache sizes.
        max_num_tokens: the most tokens one forward carries.
    """

    def __init__(self, model: nn.Module, model_config, config: LoRAConfig, max_num_tokens: int):
        self.config = config
        self.model_config = model_config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if not self.dtype.is_floating_point or self.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.batch = LoRABatch(max_num_tokens, config.max_loras, self.device)
        # (layer index, kiln module) -> (layer, its LoRA method)
        self.methods: dict[tuple[int, str], tuple[nn.Module, LoRALinearMethod]] = {}
        self._wrap(model)
        self._entries: dict[int, _Entry] = {}
        self._by_name: dict[str, int] = {}
        self._next_id = 1
        self._host_lru: OrderedDict[int, None] = OrderedDict()  # ids whose weights are in memory
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first
        self._free_slots = list(range(config.max_loras))

    def _wrap(self, model: nn.Module) -> None:
        R, S = self.config.max_lora_rank, self.config.max_loras
        for i, layer in enumerate(model.model.layers):
            for name, owner in (("qkv_proj", layer.self_attn), ("o_proj", layer.self_attn),
                                ("gate_up_proj", layer.mlp), ("down_proj", layer.mlp)):
                lin = getattr(owner, name)
                sizes = self._slice_sizes(name, lin)
                row_parallel = name in ("o_proj", "down_proj")
                in_features = lin.in_features // lin.tp_size if row_parallel else lin.in_features
                method = LoRALinearMethod(lin.quant_method, self.batch, in_features, sizes, S, R, self.dtype,
                                          self.device)
                lin.quant_method = method
                self.methods[(i, name)] = (lin, method)

    @staticmethod
    def _slice_sizes(name: str, lin) -> list[int]:
        """This rank's output features of each part of ``lin``."""
        if name == "qkv_proj":
            q, kv = lin.num_heads * lin.head_dim, lin.num_kv_heads * lin.head_dim
            return [q, kv, kv]
        if name == "gate_up_proj":
            return [n // lin.tp_size for n in lin.output_sizes]
        return [lin.out_features]  # row-parallel: whole outputs

    # -- the registry ----------------------------------------------------------------------
    def add_adapter(self, name: str, path: str | Path) -> LoRAInfo:
        """Register (and read) an adapter under ``name``.

        Raises:
            LoRAError: the name is taken (``AlreadyExists``), or the adapter cannot be
                served (see ``load_peft_adapter``).
        """
        if not name or not isinstance(name, str):
            raise LoRAError("an adapter needs a non-empty name")
        if name in self._by_name:
            raise LoRAError(f"an adapter named {name!r} is already loaded; unload it first", "AlreadyExists")
        path = self.config.resolve(path)
        weights = load_peft_adapter(path, self.model_config, self.config.max_lora_rank)
        lora_id = self._next_id
        self._next_id += 1
        info = LoRAInfo(name, lora_id, str(path), weights.rank, weights.target_modules, int(time.time()))
        self._entries[lora_id] = _Entry(info, weights)
        self._by_name[name] = lora_id
        self._touch_host(lora_id)
        log.info("LoRA adapter %s loaded from %s (rank %d, %s)", name, path, weights.rank,
                 ", ".join(info.target_modules))
        return info

    def remove_adapter(self, name: str) -> None:
        """Unregister ``name``: new requests cannot select it; its weights stay until the
        requests using it finish.  Raises LoRAError (``NotFound``) for an unknown name."""
        lora_id = self._by_name.pop(name, None)
        if lora_id is None:
            raise LoRAError(f"no adapter named {name!r} is loaded", "NotFound")
        entry = self._entries[lora_id]
        entry.removed = True
        if entry.num_requests == 0:
            self._drop(lora_id)
        log.info("LoRA adapter %s unloaded", name)

    def _drop(self, lora_id: int) -> None:
        self._entries.pop(lora_id, None)
        self._host_lru.pop(lora_id, None)
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            for _, method in self.methods.values():
                method.clear_slot(slot)
            self._free_slots.append(slot)

    def adapters(self) -> list[LoRAInfo]:
        """The registered adapters, in load order."""
        return [self._entries[i].info for i in self._by_name.values()]

    def lookup(self, name: str) -> int:
        """The ``lora_id`` of a registered adapter.  Raises LoRAError (``NotFound``)."""
        lora_id = self._by_name.get(name)
        if lora_id is None:
            raise LoRAError(f"the model {name!r} does not exist", "NotFound")
        return lora_id

    # -- requests ------------------------------------------------------------------------------
    def acquire(self, name: str) -> int:
        """A request starts using adapter ``name``: its weights are pinned in host memory.
        Returns its ``lora_id``.  Raises LoRAError (``NotFound``, or a folder no longer
        readable)."""
        lora_id = self.lookup(name)
        entry = self._entries[lora_id]
        if entry.weights is None:
            entry.weights = load_peft_adapter(entry.info.path, self.model_config, self.config.max_lora_rank)
        entry.num_requests += 1
        self._touch_host(lora_id)
        return lora_id

    def release(self, lora_id: int) -> None:
        """A request that used ``lora_id`` finished (or was aborted)."""
        entry = self._entries.get(lora_id)
        if entry is None:
            return
        entry.num_requests -= 1
        if entry.num_requests <= 0 and entry.removed:
            self._drop(lora_id)

    def _touch_host(self, lora_id: int) -> None:
        self._host_lru[lora_id] = None
        self._host_lru.move_to_end(lora_id)
        over = len(self._host_lru) - self.config.max_cpu_loras
        for old in list(self._host_lru):
            if over <= 0:
                break
            e = self._entries[old]
            if old != lora_id and e.num_requests == 0 and old not in self._slot_of:
                e.weights = None
                del self._host_lru[old]
                over -= 1

    # -- steps ---------------------------------------------------------------------------------
    def set_batch(self, rows: list[tuple[int, int]], num_tokens: int | None = None, active: bool | None = None) -> None:
        """Map a forward's tokens to slots: ``rows`` are ``(lora_id, num_tokens)`` in model
        row order (lora_id 0: the base); ``num_tokens`` pads with base tokens (a CUDA graph's
        padded rows).

        Raises:
            RuntimeError: more distinct adapters than ``max_loras`` (the scheduler prevents it).
        """
        self.assign_slots({lid for lid, _ in rows if lid})
        slots: list[int] = []
        for lid, n in rows:
            slots.extend([self._slot_of[lid] if lid else -1] * n)
        if num_tokens is not None:
            slots.extend([-1] * (num_tokens - len(slots)))
        self.batch.set(slots, active)

    def assign_slots(self, wanted: set[int]) -> list[tuple[int, int, str]]:
        """Give every adapter of ``wanted`` (lora ids, no 0) a device slot, evicting the least
        recently used ones outside it; returns the slot writes this made as ``(slot, lora_id,
        adapter folder)`` (tensor parallelism: rank 0 sends them to the other ranks, which
        replay them with :meth:`apply_slot_writes`, so every rank holds each adapter in the
        same slot).

        Raises:
            RuntimeError: more distinct adapters than ``max_loras`` (the scheduler prevents it).
        """
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step exceed max_loras {self.config.max_loras}")
        writes: list[tuple[int, int, str]] = []
        for lid in wanted:
            slot = self._ensure_slot(lid, wanted)
            if slot is not None:
                writes.append((slot, lid, self._entries[lid].info.path))
        return writes

    def apply_slot_writes(self, writes: list[tuple[int, int, str]]) -> None:
        """Ranks 1..N-1: write the slots rank 0's :meth:`assign_slots` wrote, reading each
        adapter from its folder (this rank's shard of it), and map its lora id to that slot.

        Raises:
            LoRAError: the folder can no longer be read (rank 0 read it moments before).
        """
        for slot, lid, path in writes:
            for old in [k for k, v in self._slot_of.items() if v == slot]:
                del self._slot_of[old]
            if slot in self._free_slots:
                self._free_slots.remove(slot)
            self._write_slot(slot, load_peft_adapter(path, self.model_config, self.config.max_lora_rank))
            self._slot_of[lid] = slot

    def _ensure_slot(self, lora_id: int, keep: set[int]) -> int | None:
        """The slot ``lora_id`` was written into now, or None when it already had one."""
        if lora_id in self._slot_of:
            self._slot_of.move_to_end(lora_id)
            return None
        if self._free_slots:
            slot = self._free_slots.pop(0)
        else:
            victim = next(i for i in self._slot_of if i not in keep)
            slot = self._slot_of.pop(victim)
        entry = self._entries[lora_id]
        self._write_slot(slot, entry.weights)
        self._slot_of[lora_id] = slot
        return slot

    def _write_slot(self, slot: int, w: LoRAWeights) -> None:
        for (i, name), (lin, method) in self.methods.items():
            method.clear_slot(slot)
            for part, hf in enumerate(_PARTS[name]):
                a = w.a.get((i, hf))
                if a is None:
                    continue
                a, b = _shard(lin, name, part, a, w.b[(i, hf)])
                method.set_part(slot, part, a.to(self.dtype), b.to(self.dtype))


def _shard(lin, name: str, part: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slices of one part's ``A`` [r, in] and ``B`` [out, r] (see ``layers``)."""
    tp, rank = lin.tp_size, lin.tp_rank
    if tp == 1:
        return a, b
    if name in ("o_proj", "down_proj"):  # row-parallel: A on its input columns
        k = a.shape[1] // tp
        return a[:, rank * k:(rank + 1) * k], b
    n = b.shape[0] // tp
    if name == "qkv_proj" and part > 0 and tp > lin.total_num_kv_heads:
        n = lin.num_kv_heads * lin.head_dim
        rank = rank * lin.total_num_kv_heads // tp
    return a, b[rank * n:(rank + 1) * n]


__all__ = ["LoRAConfig", "LoRAError", "LoRAInfo", "LoRAManager", "TARGET_MODULES"]
