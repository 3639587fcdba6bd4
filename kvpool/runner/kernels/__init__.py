"""Native CPU kernels, compiled on first use and cached; the pure-torch paths are the fallback.

Paged decode and prefill attention (decode_attention.cpp, prefill_attention.cpp in bf16, prefill_f32.cpp)
read keys and values in place through block tables; elementwise.cpp fuses the norm, rotary and
SiLU-and-multiply; linear_bf16.cpp is a bf16 model's linear layers (AVX-512 BF16).
The library is compiled once per machine and source version with torch's own extension builder into
`<kvpool cache>/kernels/` (`kvpool build-kernels` or `scripts/install.sh` do it ahead of time), then
loaded as torch ops. Set KVPOOL_KERNELS=0 to run without it; if the build fails (no C++ compiler),
kvpool logs why once and keeps to torch.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvpool.runner.dtypes import FP8_DTYPES

log = logging.getLogger(__name__)

# What an fp32 model's KV cache may hold besides fp32, read and written by the fp32 kernels (common.h's
# narrow_kv): a `kv_cache_dtype` of bf16, fp16 or fp8.
NARROW_KV_DTYPES = (torch.bfloat16, torch.float16, *FP8_DTYPES)

HERE = Path(__file__).parent
SOURCES = [HERE / "decode_attention.cpp", HERE / "prefill_attention.cpp", HERE / "prefill_f32.cpp",
           HERE / "elementwise.cpp",
           HERE / "kv_write.cpp", HERE / "argmax.cpp", HERE / "linear_bf16.cpp"]
HEADERS = [HERE / "common.h"]
# -march=native: the library is built on the machine that runs it (the build dir is keyed by its CPU).
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
          "-fassociative-math", "-fopenmp"]
# torch's own libgomp (same soname) is already loaded, so the kernels share torch's thread pool.
LDFLAGS = ["-fopenmp"]


def _cpu_key() -> str:
    """The CPU's model and feature flags: a library built with -march=native runs only where they match."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def build_dir() -> Path:
    from kvpool.runner.model_files import cache_dir

    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_key().encode())
    return cache_dir() / "kernels" / h.hexdigest()[:16]


def build(verbose: bool = False) -> Path:
    """Compile the kernels (if not yet built for this machine) and load them; returns the library path."""
    out = build_dir()
    lib = out / "kvpool_kernels.so"
    if not lib.exists():
        from torch.utils import cpp_extension

        # The ninja wheel installs into the venv's bin/, which need not be on PATH.
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        out.mkdir(parents=True, exist_ok=True)
        log.info("compiling kvpool's CPU kernels into %s", out)
        cpp_extension.load(name="kvpool_kernels", sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS,
                           extra_ldflags=LDFLAGS, build_directory=str(out), is_python_module=False, verbose=verbose)
    else:
        torch.ops.load_library(str(lib))
    return lib


@functools.cache
def _library() -> bool:
    """Whether the compiled library is loaded (built first if need be)."""
    setting = os.environ.get("KVPOOL_KERNELS", "1").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting not in ("1", "true", "yes", "on", ""):
        raise ValueError(f"KVPOOL_KERNELS: 0 (off) or 1 (on), got {os.environ['KVPOOL_KERNELS']!r}")
    try:
        build()
    except Exception as e:  # a missing compiler or ninja must not stop the engine: torch computes the same
        lines = str(e).strip().splitlines()
        log.warning("kvpool's CPU kernels are unavailable (%s); attention runs on the torch path",
                    lines[-1] if lines else type(e).__name__)
        return False
    return True


def paged_decode_attention() -> Callable[..., torch.Tensor] | None:
    """The compiled decode op, or None when disabled (KVPOOL_KERNELS=0) or not buildable here."""
    return torch.ops.kvpool.paged_decode_attention if _library() else None


def paged_prefill_attention() -> Callable[..., torch.Tensor] | None:
    """The compiled prefill op (bf16 or fp32; see `prefill_supported`), or None as above."""
    return torch.ops.kvpool.paged_prefill_attention if _library() else None


def fused_ops() -> Any:
    """torch.ops.kvpool, whose rms_norm, silu_and_mul and rotary are fused bf16 versions of
    kvpool.runner.models.llama's ops (elementwise.cpp), or None as above."""
    return torch.ops.kvpool if _library() else None


def linear_bf16_supported() -> bool:
    """Whether `torch.ops.kvpool.linear_bf16` runs here (the library is built with AVX-512 BF16)."""
    return _library() and bool(torch.ops.kvpool.linear_bf16_supported())


def prefill_supported(head_dim: int, block_size: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this CPU and these shapes suit the prefill kernel in `dtype`: bf16 needs AVX-512 BF16 and
    blocks a multiple of 16 tokens, fp32 AVX2 and FMA and blocks a multiple of 8; both head_dim 64/128/256."""
    if dtype not in (torch.bfloat16, torch.float32):
        return False
    return _library() and bool(torch.ops.kvpool.prefill_supported(head_dim, block_size, dtype == torch.float32))


def packed_layout(k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of standard (kv_heads, blocks, block_size, head_dim) caches in the layout `write_kv_packed`
    writes and the kernels read with `packed=True` (the reference for that layout, in torch ops). "packed16"
    (bf16 models): per 16 tokens, keys as [head_dim / 2][16] pairs of elements, values as [8][head_dim] pairs
    of tokens. "packed8" (fp32 models, whose caches are fp32 or bf16): per 8 tokens, keys as [head_dim][8];
    values unchanged. `layout` None: the one of the caches' dtype (bf16: packed16)."""
    h, nb, bs, d = k_cache.shape
    if layout is None:
        layout = "packed8" if k_cache.dtype == torch.float32 else "packed16"
    if layout == "packed8":
        k = k_cache.reshape(h, nb, bs // 8, 8, d).permute(0, 1, 2, 4, 3)
        return k.contiguous().view(h, nb, bs, d), v_cache.clone()
    k = k_cache.reshape(h, nb, bs // 16, 16, d // 2, 2).permute(0, 1, 2, 4, 3, 5)
    v = v_cache.reshape(h, nb, bs // 16, 8, 2, d).permute(0, 1, 2, 3, 5, 4)
    return k.contiguous().view(h, nb, bs, d), v.contiguous().view(h, nb, bs, d)
