"""LoRA adapters applied by the runner itself: PEFT folders loaded into slots, every adapter of a step
(and the base model) computed in one forward pass.

An adapter is a PEFT folder (adapter_config.json + adapter_model.safetensors), read here with json and
safetensors; peft itself is not needed at run time and the model is never wrapped by it. For each
targeted module PEFT adds `scaling * B(A(x))` (A: rank x in, B: out x rank) to the module's output.
The runner fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj` (see llama.py), so each
fused projection gets one `LoRALinear` wrapper that adds each sub-module's delta to its slice of the
fused output (q, k, v; gate, up). `scaling` is folded into B when an adapter is loaded.

Slots: `max_loras` adapters are resident at once in per-projection stacks sized for `max_lora_rank`
per sub-module (see `LoRALinear`). Every adapter ever registered stays loaded beside them; a step's
adapters are copied into slots when they are not there already, into an empty slot or the least
recently used one (the scheduler keeps the running requests to at most `max_loras` distinct adapters,
so a step's adapters always fit).

The batched matmul loops over adapter segments of sorted rows. A step's rows (tokens) are sorted so
that each adapter's rows are contiguous (base model rows first, then slot by slot; within one adapter
the steps keep their order), and each projection adds, per segment, `y[a:b] += (x[a:b] @ A_s^T) @ B_s^T`
on views: two matmuls per adapter present, no gather, no scatter, and each row meets only its own
adapter's weights (the fewest flops). The alternatives cost more on the CPU: gathering per-row A/B
stacks (a bmm over (rows, rank, in) copies) moves rows x rank x in weights for every token, and a
dense form (every row through every resident adapter, a 0/1 row mask zeroing the others: 3 ops
whatever the number of adapters) multiplies the LoRA flops by the number of adapters; measured on
SmolLM2 with 4 adapters of rank 16 it was as slow or slower at every batch size, decodes included,
since here the per-op cost is a few microseconds against milliseconds of base matmuls (see
docs/benchmarks.md).
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

# PEFT's module name -> (the runner's fused projection, index of the sub-module within it)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name may stand before .weight)
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                     r"(?:\.[\w-]+)?\.weight$")
# Config fields that change the forward in ways this runner does not compute: refused, never ignored.
_UNSUPPORTED_FIELDS = ("use_dora", "lora_bias", "modules_to_save", "trainable_token_indices", "target_parameters",
                       "layer_replication", "use_qalora", "alora_invocation_tokens", "arrow_config", "kasa_config",
                       "monteclora_config", "use_bdlora")
# Initialisations after which peft rewrites the base weights when it loads the adapter (W - scaling B0 A0: the
# adapter's weights are a residual of the base's principal components, or of its quantization error):
# served on the unmodified base, such an adapter gives other tokens than peft. peft converts one into a plain
# LoRA (`save_pretrained(..., path_initial_model_for_weight_conversion=...)`).
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")


@dataclass(frozen=True)
class ProjectionShape:
    in_features: int
    out_slices: tuple[tuple[int, int], ...]  # per sub-module, its [start, end) in the fused output


def projection_shapes(arch: Any) -> dict[str, ProjectionShape]:
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {"qkv_proj": ProjectionShape(h, ((0, q), (q, q + kv), (q + kv, q + 2 * kv))),
            "o_proj": ProjectionShape(q, ((0, h),)),
            "gate_up_proj": ProjectionShape(h, ((0, i), (i, 2 * i))),
            "down_proj": ProjectionShape(i, ((0, h),))}


@dataclass
class LoRAAdapter:
    """One adapter's weights, ready for the slots: per (layer, projection, sub-module), A (rank, in) and
    B^T (rank, out) with the scaling folded in."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    targets: tuple[str, ...]  # PEFT module names it adapts
    weights: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


def _pattern_value(patterns: dict[str, Any], module_key: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_key):
            return patterns[key]
    return default


# The config's numbers are checked before any is used: a scaling is alpha / r, and a null, a string or
# a zero there would otherwise surface as a TypeError or ZeroDivisionError (a server's 500, a traceback
# at `serve --lora-modules`) instead of a ValueError naming the field.


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_rank(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _checked_config(cfg: dict[str, Any], where: str
                    ) -> tuple[int | None, float, bool, dict[str, int], dict[str, float]]:
    """The config's r (None when absent: the tensors' rank), lora_alpha, use_rslora, rank_pattern and
    alpha_pattern, with their types and ranges checked as PEFT's LoraConfig declares them."""
    r = cfg.get("r")
    if "r" in cfg and not _is_rank(r):
        raise ValueError(f"{where}: r must be an int >= 1, got {r!r}")
    alpha = cfg.get("lora_alpha", 8)  # PEFT's default
    if not _is_number(alpha):
        raise ValueError(f"{where}: lora_alpha must be a finite number, got {alpha!r}")
    rslora = cfg.get("use_rslora") or False  # (null: PEFT reads it as false too)
    if not isinstance(rslora, bool):  # a string "false" would be true: a 1/sqrt(r) scaling not asked for
        raise ValueError(f"{where}: use_rslora must be true or false, got {rslora!r}")
    rank_pattern = _checked_pattern(cfg, "rank_pattern", _is_rank, "an int >= 1", where)
    alpha_pattern = _checked_pattern(cfg, "alpha_pattern", _is_number, "a finite number", where)
    return r, alpha, rslora, rank_pattern, alpha_pattern


def _checked_pattern(cfg: dict[str, Any], name: str, valid: Callable[[Any], bool], kind: str,
                     where: str) -> dict[str, Any]:
    """A rank_pattern or alpha_pattern: module name patterns (regular expressions) to values."""
    pattern = cfg.get(name) or {}
    if not isinstance(pattern, dict):
        raise ValueError(f"{where}: {name} must be a JSON object (module name pattern -> value), "
                         f"got {type(pattern).__name__} {pattern!r}")
    for key, value in pattern.items():
        try:
            re.compile(rf"(.*\.)?({key})$")  # as _pattern_value matches it
        except re.error as e:
            raise ValueError(f"{where}: {name} key {key!r} is not a valid regular expression ({e})") from None
        if not valid(value):
            raise ValueError(f"{where}: {name}[{key!r}] must be {kind}, got {value!r}")
    return pattern


def load_adapter(name: str, path: str | Path, arch: Any, *, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder against the model; ValueError naming what is wrong."""
    from safetensors import safe_open

    where = f"lora_request: adapter {name!r} at {str(path)!r}"
    folder = Path(path)
    cfg_file, st_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not folder.is_dir():
        raise ValueError(f"{where}: no such folder")
    if not cfg_file.is_file():
        raise ValueError(f"{where}: no adapter_config.json (not a PEFT adapter folder)")
    if not st_file.is_file():
        bin_only = (folder / "adapter_model.bin").is_file()
        raise ValueError(f"{where}: no adapter_model.safetensors" + (" (.bin adapters are not read; save it with "
                                                                      "safe_serialization=True)" if bin_only else ""))
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: adapter_config.json is not a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not supported (LORA only)")
    for key in _UNSUPPORTED_FIELDS:
        if cfg.get(key):
            raise ValueError(f"{where}: {key}={cfg[key]!r} is not supported")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise ValueError(f"{where}: init_lora_weights={init!r} is not supported: peft rewrites the base model's "
                         "weights when it loads such an adapter; convert it into a plain LoRA first "
                         "(peft's save_pretrained with path_initial_model_for_weight_conversion)")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={cfg['bias']!r} is not supported (only 'none')")
    r_default, alpha, rslora, rank_pattern, alpha_pattern = _checked_config(cfg, where)
    shapes = projection_shapes(arch)

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(st_file), framework="pt", device="cpu") as st:
        for tname in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
            m = _TENSOR.match(tname)
            if m is None or m.group(2) not in TARGETS:
                module = m.group(2) if m else _module_of(tname)
                raise ValueError(f"{where}: target module {module!r} (tensor {tname!r}) is not supported; "
                                 f"supported: {', '.join(TARGETS)}")
            layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
            if layer >= arch.num_layers:
                raise ValueError(f"{where}: tensor {tname!r} is for layer {layer}; the model has {arch.num_layers}")
            pairs.setdefault((layer, module), {})[ab] = st.get_tensor(tname)
    if not pairs:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    weights: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    top = 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        proj, sub = TARGETS[module]
        shape = shapes[proj]
        lo, hi = shape.out_slices[sub]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != shape.in_features or b.shape != (hi - lo, r):
            raise ValueError(f"{where}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}; this model needs ({r}, {shape.in_features}) and ({hi - lo}, {r}) "
                             f"(an adapter for another base model?)")
        if r < 1:
            raise ValueError(f"{where}: layer {layer} {module} has rank {r} (lora_A {tuple(a.shape)}); a rank "
                             "must be >= 1")
        if r > max_rank:
            raise ValueError(f"{where}: rank {r} (layer {layer} {module}) is over max_lora_rank={max_rank}")
        top = max(top, r)
        key = f"model.layers.{layer}.{_PARENT[module]}.{module}"
        r_cfg = _pattern_value(rank_pattern, key, r if r_default is None else r_default)
        a_cfg = _pattern_value(alpha_pattern, key, alpha)
        if r_cfg != r:
            raise ValueError(f"{where}: layer {layer} {module} has rank {r}, its config says {r_cfg}")
        scaling = a_cfg / (math.sqrt(r) if rslora else r)
        bt = (b.float() * scaling).t()
        weights[(layer, proj, sub)] = (a.to(device=device, dtype=dtype).contiguous(),
                                       bt.to(device=device, dtype=dtype).contiguous())
    targets = tuple(t for t in TARGETS if any(m == t for _, m in pairs))
    return LoRAAdapter(name, str(path), top, targets, weights)


def _module_of(tensor_name: str) -> str:
    parts = [p for p in tensor_name.split(".") if not p.startswith("lora_") and p not in ("weight", "bias")]
    return parts[-1] if parts else tensor_name


@dataclass
class LoRAPlan:
    """How one step's rows meet the adapters (rows already sorted by slot: base rows first)."""

    num_rows: int
    segments: list[tuple[int, int, int]]  # (first row, end row, slot) of each adapter's rows


class LoRALinear(nn.Module):
    """A fused projection plus the LoRA deltas of the adapters in the current step (see the module doc).

    Per slot, the adapter's sub-modules stacked along the rank: A (sum of ranks, in) and B^T (sum of
    ranks, out), where sub-module j's rows of B^T are nonzero only in its own output slice. So one
    matmul adds every sub-module's delta to the segment's rows of the fused output, in place (whole
    rows: contiguous), instead of one strided add per sub-module; and a slot computes its adapter's
    true ranks, not max_lora_rank per sub-module (the buffers are sized for that worst case)."""

    def __init__(self, base: nn.Module, shape: ProjectionShape, manager: LoRAManager) -> None:
        super().__init__()
        self.base = base
        self.shape = shape
        self.manager = manager
        n_sub, slots, rank = len(shape.out_slices), manager.max_loras, manager.max_rank
        out = shape.out_slices[-1][1]
        dt, dev = manager.dtype, manager.device
        self.register_buffer("a", torch.zeros(slots, n_sub * rank, shape.in_features, dtype=dt, device=dev),
                             persistent=False)
        self.register_buffer("bt", torch.zeros(slots, n_sub * rank, out, dtype=dt, device=dev), persistent=False)
        self.rows = [0] * slots  # rows of slot s's stacks in use (0: its adapter leaves this projection alone)

    def load_slot(self, slot: int, mats: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        self.bt[slot].zero_()
        n = 0
        for j, m in enumerate(mats):
            if m is not None:
                a, bt = m
                lo, hi = self.shape.out_slices[j]
                self.a[slot, n:n + a.shape[0]].copy_(a)
                self.bt[slot, n:n + a.shape[0], lo:hi].copy_(bt)
                n += a.shape[0]
        self.rows[slot] = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        plan = self.manager.plan
        if plan is None:
            return y
        rows = self.rows
        for start, end, s in plan.segments:
            n = rows[s]
            if n:
                y[start:end].addmm_(torch.mm(x[start:end], self.a[s, :n].t()), self.bt[s, :n])
        return y


class LoRAManager:
    """The runner's adapters: registry, slots and the per-step plan read by every `LoRALinear`."""

    def __init__(self, model: nn.Module, *, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, max_cpu_loras: int | None = None) -> None:
        from kvpool.runner.models.llama import LlamaForCausalLM

        if type(model) is not LlamaForCausalLM:
            raise ValueError(f"enable_lora: LoRA adapters are supported for Llama-family models (llama, mistral, "
                             f"qwen2), not {type(model).__name__}")
        if not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"max_loras: must be an int >= 1, got {max_loras!r}")
        if not isinstance(max_rank, int) or max_rank < 1:
            raise ValueError(f"max_lora_rank: must be an int >= 1, got {max_rank!r}")
        self.arch = model.arch  # type: ignore[attr-defined]
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype, self.device = dtype, device
        # Every slot's A and B^T buffers are allocated now, sized for the largest rank: say so when they
        # cannot be, before any is (past the machine's memory the kernel would kill the process instead).
        elem = torch.empty((), dtype=dtype).element_size()
        shapes = projection_shapes(self.arch)
        need = max_loras * max_rank * elem * len(model.layers) * sum(  # type: ignore[attr-defined,arg-type]
            len(sh.out_slices) * (sh.in_features + sh.out_slices[-1][1]) for sh in shapes.values())
        from kvpool.runner.model_runner import memory_of, release_cached_memory

        ram, where = memory_of(torch.device(device))
        if ram is not None and need > ram // 2:
            raise ValueError(f"max_loras, max_lora_rank: {max_loras} adapter slots of rank {max_rank} "
                             f"need {need / 2**30:.1f} GiB of buffers, more than half {where} "
                             f"({ram / 2**30:.1f} GiB)")
        # name -> weights, least recently used first; at most max_cpu_loras of them once `unload_idle` ran
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.max_cpu_loras = max_cpu_loras
        self.num_unloads = 0
        self._lock = threading.Lock()  # registration may come from another thread than the steps
        self.slots: list[str | None] = [None] * max_loras
        self._last_used = [0] * max_loras
        self._clock = 0
        self.plan: LoRAPlan | None = None
        self.num_slot_loads = 0
        failure = None
        try:
            self.wrappers: list[dict[str, LoRALinear]] = [
                {name: LoRALinear(getattr(layer, name), shapes[name], self) for name in PROJECTIONS}
                for layer in model.layers]  # type: ignore[attr-defined]
        except (RuntimeError, MemoryError) as e:  # (torch's out-of-memory errors are RuntimeErrors)
            failure = str(e).splitlines()[0]
        if failure is not None:
            # Raised outside the handler, so that no frame holding the buffers made so far stays alive with
            # the error (on a GPU they would stay allocated, cached in this process, as long as it lives).
            release_cached_memory(torch.device(device))
            raise ValueError(f"max_loras, max_lora_rank: {max_loras} adapter slots of rank {max_rank} could not be "
                             f"allocated ({failure})")
        for layer, mine in zip(model.layers, self.wrappers, strict=True):  # type: ignore[attr-defined]
            for name, w in mine.items():  # (only once every buffer is there: a failure leaves the model whole)
                setattr(layer, name, w)

    # -- registry (any thread) -------------------------------------------------------------------------

    def register(self, name: str, path: str) -> LoRAAdapter:
        """Load the adapter at `path` as `name` (once; the same name again must be the same folder)."""
        with self._lock:
            have = self.adapters.get(name)
            if have is not None:
                self.adapters.move_to_end(name)
                return self._same_folder(have, path)
        adapter = load_adapter(name, path, self.arch, max_rank=self.max_rank, dtype=self.dtype, device=self.device)
        with self._lock:
            have = self.adapters.setdefault(name, adapter)
        if have is not adapter:  # another thread registered the name meanwhile
            return self._same_folder(have, path)
        log.info("LoRA adapter %s loaded from %s (rank %d; %s)", name, path, adapter.rank, ", ".join(adapter.targets))
        return adapter

    def forget(self, name: str) -> None:
        """Drop a registered adapter no step has used yet (its registration failed a later check)."""
        with self._lock:
            if name not in self.slots:
                self.adapters.pop(name, None)

    def loaded(self, name: str) -> bool:
        with self._lock:
            return name in self.adapters

    def unload_idle(self, busy: set[str]) -> list[str]:
        """Past `max_cpu_loras` adapters, unload the least recently used ones not in `busy` (the adapters of
        the requests in flight: their weights must stay for their slots); returns their names."""
        out: list[str] = []
        with self._lock:
            if self.max_cpu_loras is None:
                return out
            for name in list(self.adapters):
                if len(self.adapters) <= self.max_cpu_loras:
                    break
                if name not in busy:
                    self._drop(name)  # (its slot's copy goes too: a reload must fill it again)
                    out.append(name)
            self.num_unloads += len(out)
        for name in out:
            log.info("LoRA adapter %s unloaded (max_cpu_loras=%d)", name, self.max_cpu_loras)
        return out

    def unload(self, name: str) -> None:
        """Drop an adapter's weights and empty its slot (no step may need it: the engine checked)."""
        with self._lock:
            self._drop(name)

    def _drop(self, name: str) -> None:
        """(with the lock held)"""
        self.adapters.pop(name, None)
        if name in self.slots:
            self.slots[self.slots.index(name)] = None

    @staticmethod
    def _same_folder(have: LoRAAdapter, path: str) -> LoRAAdapter:
        if Path(have.path).resolve() != Path(path).resolve():
            raise ValueError(f"lora_request: adapter name {have.name!r} is already loaded from {have.path!r}; "
                             f"a name always means one adapter (its cached blocks are keyed by it)")
        return have

    # -- steps (the engine thread) ---------------------------------------------------------------------

    def _slot_for(self, name: str, needed: set[str]) -> int:
        if name in self.slots:
            with self._lock:  # (used: the most recently used, for unload_idle)
                if name in self.adapters:
                    self.adapters.move_to_end(name)
            return self.slots.index(name)
        free = [s for s, n in enumerate(self.slots) if n is None or n not in needed]
        if not free:
            raise RuntimeError(f"LoRA: a step needs {len(needed)} adapters; max_loras={self.max_loras} slots")
        # An empty slot first, else the one least recently used.
        slot = min(free, key=lambda s: (self.slots[s] is not None, self._last_used[s], s))
        with self._lock:
            adapter = self.adapters[name]
            self.adapters.move_to_end(name)
        for layer, wrappers in enumerate(self.wrappers):
            for proj, w in wrappers.items():
                w.load_slot(slot, [adapter.weights.get((layer, proj, j)) for j in range(len(w.shape.out_slices))])
        self.slots[slot] = name
        self.num_slot_loads += 1
        return slot

    def begin_step(self, steps: Sequence[Any]) -> list[Any]:
        """Put the step's adapters in slots, plan the step, and return the steps in row order (by slot,
        base model first; stable). `steps[i].lora` is an adapter name or None."""
        needed = {s.lora for s in steps if s.lora is not None}
        if not needed:
            self.plan = None
            return list(steps)
        self._clock += 1
        slot_of = {}
        for name in sorted(needed, key=lambda n: n not in self.slots):  # resident ones keep their slots
            slot_of[name] = self._slot_for(name, needed)
            self._last_used[slot_of[name]] = self._clock
        ordered = sorted(steps, key=lambda s: -1 if s.lora is None else slot_of[s.lora])
        segments: list[tuple[int, int, int]] = []
        t = 0
        for s in ordered:
            n = len(s.token_ids)
            if s.lora is not None:
                slot = slot_of[s.lora]
                if segments and segments[-1][2] == slot and segments[-1][1] == t:
                    segments[-1] = (segments[-1][0], t + n, slot)
                else:
                    segments.append((t, t + n, slot))
            t += n
        self.plan = LoRAPlan(t, segments)
        return ordered

    def end_step(self) -> None:
        self.plan = None


def write_random_adapter(path: str | Path, model_dir: str | Path, *, rank: int = 16,
                         targets: Sequence[str] = tuple(TARGETS), seed: int = 0, alpha: float | None = None) -> Path:
    """A PEFT LoRA folder with random weights for the model at `model_dir` (benchmarks, examples): the
    layout `PeftModel.save_pretrained` writes, A and B drawn as nn.Linear's default initialisation
    draws them (what PEFT's init_lora_weights=False leaves)."""
    from safetensors.torch import save_file

    from kvpool.runner.models.llama import LlamaArch

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    arch = LlamaArch.from_hf_config(cfg)
    shapes = projection_shapes(arch)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(arch.num_layers):
        for module in targets:
            proj, sub = TARGETS[module]
            fan_in = shapes[proj].in_features
            lo, hi = shapes[proj].out_slices[sub]
            prefix = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.rand(rank, fan_in, generator=g) * 2 - 1) / math.sqrt(fan_in)
            tensors[f"{prefix}.lora_B.weight"] = (torch.rand(hi - lo, rank, generator=g) * 2 - 1) / math.sqrt(rank)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir), "r": rank,
              "lora_alpha": alpha if alpha is not None else 2 * rank, "lora_dropout": 0.0,
              "target_modules": list(targets), "bias": "none", "use_rslora": False, "use_dora": False,
              "fan_in_fan_out": False, "modules_to_save": None, "init_lora_weights": False, "inference_mode": True,
              "rank_pattern": {}, "alpha_pattern": {}}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
