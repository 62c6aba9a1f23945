"""Which int8 setting is exact enough on this CPU (issue 19): :func:`int8_setting`.

x86 int8 kernels multiply u8 activations by s8 weights. With VNNI (AVX512-VNNI, AVX-VNNI)
or AMX, ``VPDPBUSD`` / ``TDPBUSD`` add the products straight into int32: exact. Without
it (SSE4.1, AVX2, AVX-512 without VNNI) the kernels use ``VPMADDUBSW``, which adds each
*pair* of u8*s8 products into a saturating int16: ``2 * 255 * 127 = 64770 > 32767``, so
where large activations meet large weights the sum is silently clipped. ONNX Runtime's
MLAS U8S8 kernels and oneDNN's int8 convolutions / linears (what the torchao PT2E path
lowers to) both do this: measured on an AVX2-only machine, it cost the built-in ``mlp``
up to 9 points of top-1 agreement and a ResNet-18 about thirty. Two cures:

* **7-bit activations** (torch's ``reduce_range``): ``2 * 127 * 128 = 32512`` fits. The
  one torchao's ``X86InductorQuantizer`` offers (oneDNN has no u8*u8 kernels).
* **u8 weights** (ONNX Runtime's U8U8 kernels): they widen both factors to 16 bits and
  use ``VPMADDWD`` into int32, never ``VPMADDUBSW``. Measured here they keep the precision
  of 8-bit weights (ORT's other cure, 7-bit weights, lost 0.6 points of agreement on the
  ``mlp``, up to 2 on some seeds; see tests/test_deploy_export.py), so ORT uses them.

The decision is made separately for the two runtimes, because they see different CPUs:

* **ONNX Runtime**: MLAS reads cpuid itself and ignores the environment caps below, so
  only the CPU flags count (``avx512_vnni``, ``avx_vnni``, ``amx_int8``).
* **torch** (PT2E -> inductor -> oneDNN): oneDNN reads cpuid capped by
  ``ONEDNN_MAX_CPU_ISA`` (older name ``DNNL_MAX_CPU_ISA``), inductor's generated code
  follows ``ATEN_CPU_CAPABILITY`` (:func:`torch.backends.cpu.get_cpu_capability`); VNNI
  counts only when the CPU has a VNNI form that every cap admits.

ONNX Runtime *static* int8 uses u8 weights on every CPU: ORT quantizes s8 weights
symmetrically, and on the deploy benchmark's ResNet-18 that lost 2.7 points of agreement
against u8's asymmetric per-channel weights (91.4% vs 94.1%, same calibration; its
U8S8 kernels are faster where VNNI exists, so ``for_vnni=True`` forces them). Off x86
nothing saturates (ARM's dot-product kernels widen first) and the VNNI setting is kept.
The CPU is read once per process; every input can be given explicitly (tests do).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

import torch

__all__ = ["Int8Setting", "cpu_flags", "int8_setting"]

_VNNI_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")  # /proc/cpuinfo spellings
# oneDNN ISA cap -> the VNNI forms it still lets oneDNN use (its cpu_isa_t hierarchy:
# avx512_core_vnni is not a superset of avx2_vnni, so an AVX-512 cap drops AVX-VNNI).
# An unknown value counts as no VNNI (oneDNN would ignore it; reduced is the safe side).
_ONEDNN_CAPS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("SSE41", "AVX", "AVX2", "AVX512_CORE"), ()),
    **dict.fromkeys(("AVX2_VNNI", "AVX2_VNNI_2"), ("avx_vnni",)),
    **dict.fromkeys(("AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512"),
                    ("avx512_vnni",)),
    **dict.fromkeys(("AVX512_CORE_AMX", "AVX10_1_512_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16",
                     "AVX10_2_512", "AVX10_2_512_AMX_2"), ("avx512_vnni", "amx_int8")),
    **dict.fromkeys(("ALL", "DEFAULT"), _VNNI_FLAGS),
}
# ATen capability -> the VNNI forms inductor's own generated kernels can use under it (its
# vector ISA follows ATEN_CPU_CAPABILITY; the VNNI / AMX micro-kernels need AVX-512).
_ATEN_CAPS: dict[str, tuple[str, ...]] = {"AVX512": _VNNI_FLAGS, "AVX2": ("avx_vnni",)}
_RUNTIMES = ("torch", "onnxruntime", "onnxruntime-static")


@dataclass(frozen=True)
class Int8Setting:
    """The int8 setting chosen for one runtime on this CPU, and why (one line).

    ``for_vnni``: the setting is the one for kernels with VNNI (8-bit u8 activations x s8
    weights) rather than the saturation-free one for kernels without. ``reduce_range``
    (torch): activations quantized to 0..127. ``weight_type`` / ``activation_type``: the
    integer types the kernels get. ``vnni``: this runtime's int8 kernels have VNNI/AMX
    here (None off x86). ``forced``: the caller chose ``for_vnni`` instead of this function.
    """

    runtime: str  # "torch" | "onnxruntime" (dynamic) | "onnxruntime-static"
    for_vnni: bool
    reduce_range: bool
    weight_type: str
    activation_type: str
    vnni: bool | None
    forced: bool
    reason: str

    def describe(self) -> str:
        if self.reduce_range:
            what = "reduce_range=True (7-bit activations, 0..127)"
        else:
            what = "full 8-bit range"
        return f"{what}, {self.activation_type} activations x {self.weight_type} weights: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def int8_setting(
    runtime: str,
    for_vnni: bool | None = None,
    *,
    flags: Iterable[str] | None = None,
    capability: str | None = None,
    env: Mapping[str, str] | None = None,
    machine: str | None = None,
) -> Int8Setting:
    """The int8 setting that is exact enough for ``runtime`` here.

    ``runtime``: ``"torch"`` (PT2E static int8), ``"onnxruntime"`` (ORT dynamic int8) or
    ``"onnxruntime-static"``. ``for_vnni``: None chooses (see the module docstring), True /
    False force the setting for kernels with / without VNNI (the reason then says so, and
    what the choice would have been). ``flags`` (``/proc/cpuinfo`` flags), ``capability``
    (ATen's, e.g. ``"AVX2"``), ``env`` (for ``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA``)
    and ``machine`` (``platform.machine()``) default to this machine's.
    """
    if runtime not in _RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(_RUNTIMES)}, not {runtime!r}")
    vnni, why = _vnni_here(runtime, flags, capability, env, machine)
    auto = vnni is not False
    if runtime == "onnxruntime-static":
        auto = False
        why = ("u8 weights on every CPU: asymmetric per channel, more exact than ORT's symmetric s8 ones, and "
               "ORT's U8U8 kernels never use VPMADDUBSW (this CPU: " + why + ")")
    chosen, forced, why = _chosen(auto, for_vnni, why)
    torch_side = runtime == "torch"
    return Int8Setting(
        runtime=runtime, for_vnni=chosen, reduce_range=torch_side and not chosen,
        weight_type="int8" if torch_side or chosen else "uint8", activation_type="uint8",
        vnni=vnni, forced=forced, reason=why,
    )


def _vnni_here(runtime: str, flags: Iterable[str] | None, capability: str | None, env: Mapping[str, str] | None,
               machine: str | None) -> tuple[bool | None, str]:
    """(whether ``runtime``'s int8 kernels use VNNI on this CPU, None off x86; why)."""
    machine = (machine if machine is not None else platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return None, f"{machine or 'this'} CPU is not x86: its int8 kernels widen the products before adding, exactly"
    return _x86_vnni(runtime, set(flags) if flags is not None else cpu_flags(), capability, env)


def _chosen(auto: bool, for_vnni: bool | None, why: str) -> tuple[bool, bool, str]:
    """(for VNNI, forced, why): the automatic choice, or the caller's, which the reason then says."""
    if for_vnni is None:
        return auto, False, why
    why = f"forced by the caller (auto would pick the {'VNNI' if auto else 'no-VNNI'} setting: {why})"
    return bool(for_vnni), True, why


def _x86_vnni(runtime: str, have: set[str], capability: str | None,
              env: Mapping[str, str] | None) -> tuple[bool, str]:
    """(whether ``runtime``'s int8 kernels use VNNI on this x86 CPU, why): its flags, cut by the kernels' ISA caps."""
    have_vnni = [f for f in _VNNI_FLAGS if f in have]
    caps = _isa_caps(capability, env) if runtime == "torch" else []
    usable = [f for f in have_vnni if _admitted(f, caps)]
    if usable:
        return True, _vnni_used(usable[0], caps)
    return False, f"{_no_vnni_where(have, have_vnni, caps)}: u8*s8 pair sums could saturate VPMADDUBSW's int16, " + (
        "so 7-bit activations (pair sums <= 2*127*128 = 32512 fit)" if runtime == "torch" else
        "so u8 weights (ORT's U8U8 kernels widen both to 16 bits and add into int32)")


def _vnni_used(flag: str, caps: list[tuple[str, tuple[str, ...]]]) -> str:
    why = f"{flag} in the CPU flags" + (f", allowed by {' and '.join(n for n, _ in caps)}" if caps else "")
    return why + ": u8*s8 products add straight into int32, exactly"


def _admitted(flag: str, caps: list[tuple[str, tuple[str, ...]]]) -> bool:
    """Whether every ISA cap lets the kernels use the VNNI form ``flag``."""
    return all(flag in admits for _, admits in caps)


def _no_vnni_where(have: set[str], have_vnni: list[str], caps: list[tuple[str, tuple[str, ...]]]) -> str:
    """Why no VNNI form is usable: none in the CPU flags, or the caps that cut them off."""
    if not have_vnni:
        return "no VNNI in the CPU flags (" + (", ".join(sorted(have & {"avx2", "avx512f"})) or "pre-AVX2") + ")"
    return f"{'/'.join(have_vnni)} cut off by " + " and ".join(
        n for n, admits in caps if not all(f in admits for f in have_vnni))


def _isa_caps(capability: str | None, env: Mapping[str, str] | None) -> list[tuple[str, tuple[str, ...]]]:
    """The ISA caps torch's int8 kernels run under (oneDNN's env cap, ATen's capability): (what, VNNI flags admitted)."""
    caps = []
    environ = os.environ if env is None else env
    cap_name, cap = next(((k, environ[k]) for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
                          if environ.get(k)), (None, None))
    if cap is not None:
        caps.append((f"oneDNN's ISA ({cap_name}={cap})", _ONEDNN_CAPS.get(cap.strip().upper(), ())))
    aten = (capability if capability is not None else torch.backends.cpu.get_cpu_capability()).upper()
    caps.append((f"ATen's capability {aten}", _ATEN_CAPS.get(aten, ())))
    return caps


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The ``flags`` of ``/proc/cpuinfo`` (empty where there is none: then no VNNI is assumed
    on x86, the safe side), with torch's own cpuinfo checks added for AVX2/AVX-512/VNNI."""
    flags = _cpuinfo_flags()
    for name, flag in (("_is_avx2_supported", "avx2"), ("_is_avx512_supported", "avx512f"),
                       ("_is_vnni_supported", "avx512_vnni")):
        if torch_cpu_flag(name):
            flags.add(flag)
    return frozenset(flags)


def _cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def torch_cpu_flag(name: str) -> bool:
    """``torch.cpu.<name>()`` (e.g. ``_is_amx_fp16_supported``), False where torch lacks it."""
    fn = getattr(torch.cpu, name, None)
    try:
        return bool(fn()) if fn is not None else False
    except Exception:
        return False
