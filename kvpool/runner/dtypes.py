"""The dtype names the engine takes, and what `auto` picks on this machine.

Why `auto` is the default: bfloat16 halves the weights' and the KV cache's memory, but it is fast only
where the hardware multiplies bf16 natively (x86 with AVX-512 BF16 or AMX, Arm with the BF16 extension,
CUDA from Ampere on). Elsewhere every bf16 product is widened to fp32 in software: on an AVX2-only AMD EPYC
(Zen 3) torch's bf16 linear layer ran at 0.016 TFLOP/s against 0.12 for fp32, so a bf16 engine there is
several times slower than the same engine in fp32. `auto` therefore means bf16 where it is native and
float32 where it is not; a user who wants the memory saving anyway names bfloat16.
"""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
# What a KV cache may hold besides: vLLM's fp8 names. e4m3 (3 mantissa bits, up to 448) is vLLM's `fp8`;
# e5m2 (2 bits, fp16's range) is coarser. Both with a scale of 1, as vLLM's default: no calibration pass.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
KV_DTYPES = {**DTYPES, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# KV dtypes whose range is narrower than fp32's: a key or value past it is stored as the largest finite
# value of its sign (as vLLM's fp8 writes saturate), not as inf or NaN, which would poison every
# attention row that reads it. bf16 has fp32's range and needs no clamp.
_SATURATED = (torch.float16, *FP8_DTYPES)


def cpu_has_native_bf16(machine: str | None = None, cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (arguments: for tests, another machine's
    `platform.machine()` and /proc/cpuinfo text)."""
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64", "i686", "x86"):
        if cpuinfo is None:
            return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        flags = _cpuinfo_flags(cpuinfo, "flags")
        return "avx512_bf16" in flags or "amx_bf16" in flags
    if machine in ("aarch64", "arm64"):
        if cpuinfo is None:
            cpuinfo = _read_cpuinfo()
        return "bf16" in _cpuinfo_flags(cpuinfo, "features")
    return False


def auto_dtype(device: torch.device) -> str:
    """The dtype `auto` stands for on `device`: bfloat16 where its products are native, else float32."""
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if _cpu_bf16() else "float32"


def resolve_dtype(name: str, device: torch.device, field: str = "dtype") -> torch.dtype:
    """The torch dtype of a dtype name (`auto`: see `auto_dtype`); a ValueError names the `field`."""
    if name == "auto":
        name = auto_dtype(device)
    if name not in DTYPES:
        raise ValueError(f"{field}: {name!r} is not one of {['auto', *sorted(DTYPES)]}")
    return DTYPES[name]


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a `kv_cache_dtype` name (`auto`: the model's); a ValueError names the field."""
    if name == "auto":
        return model_dtype
    if name not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype: {name!r} is not one of {['auto', *sorted(KV_DTYPES)]}")
    return KV_DTYPES[name]


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` rounded (to nearest even) to `dtype`, saturating where `dtype`'s range ends (see _SATURATED): how
    every path, the kernels' writes included, stores keys and values in a KV cache of that dtype."""
    if x.dtype == dtype:
        return x
    if dtype in _SATURATED:
        limit = torch.finfo(dtype).max
        # (In fp32: bf16 cannot hold fp16's largest value, and would round the bound up past it. NaN stays NaN.)
        x = x.float().clamp(-limit, limit)
    return x.to(dtype)


def indexable(t: torch.Tensor) -> torch.Tensor:
    """`t`, or for one-byte float dtypes its uint8 view: torch's CPU `index_copy_` has no fp8 kernel, and a
    copy of whole elements is the same copy of their bytes."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


@cache
def _cpu_bf16() -> bool:
    return cpu_has_native_bf16()


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpuinfo_flags(cpuinfo: str, key: str) -> set[str]:
    """The flags of the first `key : ...` line of /proc/cpuinfo (x86 calls them flags, Arm features)."""
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip().lower() == key:
            return set(value.split())
    return set()
