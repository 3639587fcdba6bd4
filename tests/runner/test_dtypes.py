"""What `dtype="auto"` picks: bf16 only where the CPU multiplies it natively; names checked."""

import platform
from pathlib import Path

import pytest
import torch

from kvpool.runner.dtypes import auto_dtype, cpu_has_native_bf16, resolve_dtype

ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx fma avx2 bmi2 vaes\n"
ZEN5 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512vl avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f amx_tile amx_bf16 amx_int8\n"
NEOVERSE_N1 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics asimdhp\n"
NEOVERSE_V1 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm svebf16\n"


@pytest.mark.parametrize(("machine", "cpuinfo", "native"), [
    ("x86_64", ZEN3, False), ("x86_64", ZEN5, True), ("x86_64", SAPPHIRE_RAPIDS, True),
    ("aarch64", NEOVERSE_N1, False), ("aarch64", NEOVERSE_V1, True), ("riscv64", ZEN5, False),
])
def test_native_bf16_is_read_from_the_cpu_flags(machine: str, cpuinfo: str, native: bool) -> None:
    assert cpu_has_native_bf16(machine, cpuinfo) is native


def test_auto_follows_this_machine_and_names_resolve() -> None:
    # On x86 `auto` asks torch; the expectation comes from this machine's /proc/cpuinfo, so the two agree.
    cpu = torch.device("cpu")
    native = cpu_has_native_bf16(platform.machine(), Path("/proc/cpuinfo").read_text())
    assert auto_dtype(cpu) == ("bfloat16" if native else "float32")
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("bf16", cpu) == torch.bfloat16 and resolve_dtype("float32", cpu) == torch.float32


def test_an_unknown_dtype_is_a_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"dtype: 'float64' is not one of \['auto', "):
        resolve_dtype("float64", torch.device("cpu"))
