"""The native runtime's CPU kernel: a whole forward pass of a Llama-family model in one C++ call.

``kernels/llama_cpu.cpp`` is compiled at first use with the system C++ compiler (about 40 s on 2 cores) into a
per-user cache (``$SPECDEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/specdec``, else ``~/.cache/specdec``),
keyed by the source, the flags and the compiler, and loaded with ctypes. It needs an x86-64 CPU with
AVX2/FMA/F16C and a compiler; where either is missing, or ``SPECDEC_CPU_KERNEL=0`` is set, the runtime
keeps its PyTorch-operator path (``native_ops``) and ``kernel_status()`` says why.

It links the OpenMP runtime PyTorch itself loaded, so the two share one thread pool instead of
fighting over the cores. Activations and the KV cache are fp32; weights stay in the checkpoint's
dtype (bf16 rows are widened exactly; fp16 through F16C), and every dot product of a token is formed
the same way whatever the block size, so a k-token verify pass and k one-token passes agree bit for bit.
"""

from __future__ import annotations

import array
import bisect
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.runtime.cpu import OFF, ON, cpu_flags, cpu_model, last_level_cache_bytes, switched_off
from specdec.runtime.native_config import NativeConfig, rope_tables
from specdec.runtime.native_weights import ModelWeights
from specdec.runtime.pages import arena_for

log = logging.getLogger("specdec.kernel")

SOURCE = Path(__file__).with_name("kernels") / "llama_cpu.cpp"
ABI_VERSION = 22
# sd_forward_rows' profile phases, in the kernel's order (PH_*).
PHASES = ("norm", "qkv_proj", "rope_cache", "attention", "o_proj", "gate_up_proj", "silu_mul", "down_proj", "head")
# -ffp-contract=off: a multiply followed by an add stays two roundings wherever it is inlined (GCC fuses them into
# one FMA by default, differently in different inlining contexts, which made int8 outputs depend on the tile
# shape); the products' FMAs are explicit intrinsics and stay fused.
CXX_FLAGS = ["-O3", "-std=c++17", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-fopenmp", "-ffp-contract=off"]
# On CPUs with AVX512-BF16, bf16 weights multiply activations rounded to bf16 (VDPBF16PS); elsewhere,
# or with SPECDEC_CPU_KERNEL_ISA=avx2, everything runs in fp32 arithmetic on AVX2.
# On CPUs with AMX (Sapphire Rapids and later, where the OS grants the tile state), bf16 weights multiply on the tile
# unit instead (TDPBF16PS, 16 rows x 16 outputs x 32 products per instruction); fp32/fp16/int8 weights as avx512bf16.
_AVX512BF16 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-DSD_AVX512BF16=1"]
ISA_FLAGS = {"avx2": [], "avx512bf16": _AVX512BF16, "amx": [*_AVX512BF16, "-mamx-tile", "-mamx-bf16", "-DSD_AMX=1"]}
# The builds from the least to the most capable; SPECDEC_CPU_KERNEL_ISA names one to stop at (a downgrade only).
ISA_ORDER = ("avx2", "avx512bf16", "amx")
ISA_SWITCH = "SPECDEC_CPU_KERNEL_ISA"
# int8: per-output-channel symmetric int8 with fp32 scales (for draft models: see quantize_int8).
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}
# The KV cache's element types (SdModel.kv_type): 16-bit caches halve the bytes a row's attention reads.
KV_TYPES = {t: WEIGHT_TYPES[t] for t in (torch.float32, torch.bfloat16, torch.float16)}
# Pending tokens a lockstep draft takes in within its call (a longer catch-up is prefilled first), and the fewest rows a
# pass runs in one call, however wide its model (``chunk_rows``).
CHUNK = 128
# A pass of more rows than its model's ``FusedLlama.chunk_rows`` runs in calls of that many, each reading every weight
# again: as many rows as SCRATCH_BUDGET bytes of scratch hold at the model's widths (``sd_scratch_floats``), a multiple
# of AMX_ROWS between CHUNK and CHUNK_MAX. At 128 rows a call, a batch step of 16 sequences x 8 rows with a joining
# prompt (144 rows) paid a second weight stream (Emerald Rapids, the default target: 144 rows 0.85x the time in one
# call). Past 256 rows a call's activations outgrow the caches: prefills of 700-1000 tokens took 1.02-1.04x the time in
# calls of 512 or 1,024 rows (docs/runtime.md, session 63).
CHUNK_MAX = 256
SCRATCH_BUDGET = 64 << 20
# Rows of an AMX tile: the AMX build multiplies bf16 weights in balanced row groups of at most this many rows.
AMX_ROWS = 16
ENV_SWITCH = "SPECDEC_CPU_KERNEL"


class _Layer(ctypes.Structure):
    _fields_ = [
        ("wqkv", ctypes.c_void_p),
        ("bqkv", ctypes.c_void_p),
        ("wo", ctypes.c_void_p),
        ("bo", ctypes.c_void_p),
        ("wgu", ctypes.c_void_p),
        ("bgu", ctypes.c_void_p),
        ("wd", ctypes.c_void_p),
        ("bd", ctypes.c_void_p),
        ("window", ctypes.c_int64),
    ]


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process runs torch's and the kernel's parallel regions on (torch's bundled libgomp, which
    the kernel links: ``_openmp_link``), or None where it cannot be found."""
    libs = _bundled_libgomp()
    if not libs:
        try:
            libs = [
                Path(line.split()[-1]) for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line
            ]
        except OSError:
            return None
    for lib in libs:
        try:
            return ctypes.CDLL(str(lib))  # already loaded: the same library, not a second copy
        except OSError:
            continue
    return None


def release_thread_team() -> bool:
    """Let the calling thread's OpenMP helper threads go (``omp_pause_resource_all``, soft): True where released.

    libgomp keeps a team of helper threads for every thread that ran a parallel region on more than one thread, until
    that thread ends. A second thread's team beside it, more threads than CPUs in all, makes libgomp throttle its
    spinning: every barrier of a pass then sleeps and is woken through the kernel. Models loaded on one thread (with
    two or more compute threads: ``serve --threads 2``, a Ray replica of two CPUs, ``auto`` on three or more cores)
    and served from another (the scheduler's worker) ran every pass that way: on this Zen 4, 2 threads, a one-row pass
    of the default target 2.4 ms instead of 1.1, a 16-row pass 4.2 instead of 2.7, a lockstep draft forward of 16
    sequences 1.0 ms instead of 0.35, and ``serve --threads 2`` served 0.67x the tokens of ``--threads auto`` at 1
    client. The loading thread lets its team go once loading is done (``specdec.load``); a thread that runs passes
    again makes a new one at its next parallel region (one thread start, tens of microseconds)."""
    rt = _openmp_runtime()
    pause = getattr(rt, "omp_pause_resource_all", None) if rt is not None else None
    if pause is None:
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(1) == 0  # omp_pause_soft


def pass_threads() -> int:
    """Threads of a pass: torch's thread count (``torch.set_num_threads``; ``specdec serve --threads``)."""
    return max(1, torch.get_num_threads())


_DRAFT_THREADS: int | None = None  # threads of a lockstep draft (``set_draft_threads``); None: ``pass_threads``


def set_draft_threads(threads: int | None) -> None:
    """Run lockstep drafts (``draft_greedy``: a step's draft forwards, one call) on ``threads`` threads, at most the
    compute threads; None: on every compute thread.

    ``specdec serve --draft-threads``. A step's draft runs right after the step before it handed its tokens to the event
    loop, which streams them while the draft runs; a draft on one thread fewer leaves it a core. On 2 cores that served
    0.88-0.99x the tokens of a draft on both (two servers side by side, τ = 2, session 32), so a server drafts on every
    thread unless told (docs/server.md, "Compute threads")."""
    global _DRAFT_THREADS
    if threads is not None and threads < 1:
        raise ValueError(f"set_draft_threads needs a positive count or None, got {threads}")
    _DRAFT_THREADS = threads


def draft_threads() -> int:
    """Threads of a lockstep draft: ``set_draft_threads``'s count (at most ``pass_threads``), else ``pass_threads``."""
    threads = pass_threads()
    return threads if _DRAFT_THREADS is None else min(_DRAFT_THREADS, threads)


class DraftRuleC(ctypes.Structure):
    """The kernel's form of a drafting stop rule (``SdDraftRule``): ReachRule's table and thresholds, and/or
    MinConfidence's threshold. The arrays are kept alive by the instance."""

    _fields_ = [
        ("reach_table", ctypes.POINTER(ctypes.c_double)),
        ("min_reach", ctypes.POINTER(ctypes.c_double)),
        ("n_reach", ctypes.c_int64),
        ("min_top", ctypes.c_double),
    ]

    @classmethod
    def make(
        cls, reach_table: tuple[float, ...] | None = None, min_reach: tuple[float, ...] = (), min_top: float = 0.0
    ) -> DraftRuleC:
        rule = cls()
        rule._arrays = []  # type: ignore[attr-defined]
        if reach_table is not None:
            table = (ctypes.c_double * 10)(*reach_table)
            thresholds = (ctypes.c_double * len(min_reach))(*min_reach)
            rule._arrays = [table, thresholds]  # type: ignore[attr-defined]
            rule.reach_table = ctypes.cast(table, ctypes.POINTER(ctypes.c_double))
            rule.min_reach = ctypes.cast(thresholds, ctypes.POINTER(ctypes.c_double))
            rule.n_reach = len(min_reach)
        rule.min_top = float(min_top)
        return rule


class _Model(ctypes.Structure):
    _fields_ = [
        *((n, ctypes.c_int64) for n in ("wtype", "hidden", "ff", "heads", "kv_heads", "head_dim", "vocab")),
        *((n, ctypes.c_int64) for n in ("n_layers", "max_ctx", "embed_stride")),
        ("eps", ctypes.c_double),
        ("embed", ctypes.c_void_p),
        ("lm_head", ctypes.c_void_p),
        ("rope_cos", ctypes.c_void_p),
        ("rope_sin", ctypes.c_void_p),
        ("layers", ctypes.POINTER(_Layer)),
        ("head_rows", ctypes.c_int64),
        ("head_ids", ctypes.c_void_p),
        ("kv_type", ctypes.c_int64),
        ("stream", ctypes.c_int64),
        *((n, ctypes.c_void_p) for n in ("head_q", "head_qscale", "head_qerr", "head_wnorm", "head_qsum")),
    ]


def cache_dir(name: str) -> Path:
    """specdec's per-user cache folder ``name`` (``kernels``, ``real_shapes``, ...): ``$SPECDEC_CACHE_DIR/name``, else
    ``$XDG_CACHE_HOME/specdec/name``, else ``~/.cache/specdec/name``."""
    if os.environ.get("SPECDEC_CACHE_DIR"):
        return Path(os.environ["SPECDEC_CACHE_DIR"]) / name
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdec" / name


def _bundled_libgomp() -> list[Path]:
    """The OpenMP runtime torch's wheel ships (its ``lib/libgomp*.so*``), which torch loads; empty for other builds."""
    return sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))


def _openmp_link() -> list[str]:
    """Link the OpenMP runtime torch loaded (its bundled libgomp), so both share one thread pool."""
    bundled = _bundled_libgomp()
    if bundled:
        return [str(bundled[0]), f"-Wl,-rpath,{bundled[0].parent}"]
    return ["-fopenmp"]


def _cpu_ok() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU kernel is x86-64 only (this machine: {platform.machine()})"
    missing = [f for f in ("avx2", "fma", "f16c") if f not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    return None


def kernel_isa() -> str:
    """The kernel build for this CPU: ``"amx"`` where it has AMX-BF16 tiles and the OS grants their state,
    ``"avx512bf16"`` where it has AVX512-BF16 (bf16 dot products), else ``"avx2"``. ``SPECDEC_CPU_KERNEL_ISA=avx2``
    or ``=avx512bf16`` stops at that build where the CPU could do more (only a downgrade can be forced)."""
    flags = cpu_flags()
    best = "avx2"
    if flags >= {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}:  # (every such CPU has VNNI)
        best = "avx512bf16"
        if flags >= {"amx_tile", "amx_bf16"} and amx_permitted():
            best = "amx"
    asked = os.environ.get(ISA_SWITCH, "").strip().lower()
    if asked in ISA_ORDER and ISA_ORDER.index(asked) < ISA_ORDER.index(best):
        return asked
    return best


@functools.cache
def amx_permitted() -> bool:
    """Whether Linux grants this process the AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``, asked
    once per process; kernels before 5.16 and some hypervisors refuse it). A process using the tiles without it
    faults, so the AMX build is chosen only after this succeeds."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
        return int(libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata)) == 0
    except (OSError, AttributeError):
        return False


PREFETCH_SWITCH = "SPECDEC_CPU_KERNEL_PREFETCH"
STREAM_SWITCH = "SPECDEC_CPU_KERNEL_STREAM"
CUT_SWITCH = "SPECDEC_CPU_KERNEL_CUT"
HEAD_I8_SWITCH = "SPECDEC_CPU_KERNEL_HEAD_I8"  # off: greedy passes compute every logit (FusedLlama.prunes_head)
STREAM_ONE_PANEL, STREAM_CUT = 1, 2  # SdModel::stream's bits (and sd_matmul's `stream`)


def stream_bits(one_panel: bool, cut: bool) -> int:
    """``SdModel::stream`` for a model's products: one-row products one panel at a time (``streams_weights``), blocks
    cut into chunks of columns (``cuts_columns``)."""
    return (STREAM_ONE_PANEL if one_panel else 0) | (STREAM_CUT if cut else 0)


def _switch(env: str | None) -> bool | None:
    """An environment switch's setting: True (on), False (off) or None (unset, or neither: the kernel decides)."""
    choice = (env or "").strip().lower()
    return False if choice in OFF else True if choice in ON else None


def _outgrows_cache(weight_bytes: int, cache_bytes: int | None = None) -> bool:
    """Whether ``weight_bytes`` outgrow the last-level cache (``cache_bytes``, else this CPU's; unknown: no)."""
    cache = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    return cache > 0 and weight_bytes > cache


def streams_weights(
    weight_bytes: int, env: str | None = None, cache_bytes: int | None = None, vendor: str | None = None
) -> bool:
    """Whether a model's one-row products should read one panel at a time (``SdModel::stream``): on AMD CPUs, where
    its products' weights outgrow the last-level cache, every pass streams them from memory, and one sequential read
    per thread kept up with a fast memory better than four side by side (Qwen2.5-0.5B body on a Zen 4, interleaved:
    0.91x the time with the memory at ~56 GB/s, alike at ~35); a model the cache holds (a draft) keeps the four chains,
    which its one-row pass needs (1.33x the time with one). On Intel CPUs the four side by side read faster (an
    Emerald Rapids, memory at ~22-30 GB/s, the AVX2 build: the Qwen2.5-0.5B body's one-row pass 1.25x the time with
    one panel, alternating in one process), so only AMD CPUs (``vendor``, else this CPU's) stream.
    ``SPECDEC_CPU_KERNEL_STREAM=0`` / ``=1`` (``env``) decides on any model and CPU. Speed only: results are the same
    bit for bit."""
    forced = _switch(env)
    if forced is not None:
        return forced
    if (cpu_model()[0] if vendor is None else vendor) != "AuthenticAMD":
        return False
    return _outgrows_cache(weight_bytes, cache_bytes)


def cuts_columns(weight_bytes: int, env: str | None = None, cache_bytes: int | None = None) -> bool:
    """Whether a model's products of 3 or more rows (up to three row groups) should cut their reduction into chunks
    (``SdModel::stream``'s ``STREAM_CUT``; the kernel's "Cut columns"): where its products' weights outgrow the
    last-level cache, on any CPU. A one-panel tile of many rows alone reads one stream of weights at a time, which left
    the memory's read waiting on its arithmetic; three panels taken a chunk of columns at a time keep three streams
    going (an Emerald Rapids, the AVX2 build, weights from memory: 3-8 rows 0.64-0.91x the time, 12-16 rows
    0.85-0.99x). Over weights the caches hold the chunks' bookkeeping cost more than that saves (the default target
    in a 480 MB L3: 1.05-1.17x the time at 3-16 rows), so a model the cache holds keeps whole columns.
    ``SPECDEC_CPU_KERNEL_CUT=0`` / ``=1`` (``env``) decides on any model and CPU. Speed only: results are the same
    bit for bit."""
    forced = _switch(env)
    return _outgrows_cache(weight_bytes, cache_bytes) if forced is None else forced


ZEN4_AHEAD_ROWS = 6  # on a Zen 4, only row groups of 6 rows after the first fetch the next block (tuning_flags)
ZEN4_GROUP_ROWS = 8  # on a Zen 4, row groups of 8 rows (an 8 x 4 tile) over grouped panels, elsewhere 6 (tuning_flags)


def tuning_flags(isa: str, vendor: str, family: int, env: str | None = None, model: int = 0) -> list[str]:
    """Build flags tuned to the CPU (they change speed, never a result). The bf16 dot-product tiles of 2+ rows
    prefetch their weight panels ahead (``BF16DP_PREFETCH``): on a Zen 5 blocks of 4-16 rows at real shapes took
    10-30% longer without; on a Zen 4 (AMD family 25 with AVX512-BF16: its 512-bit instructions run on 256-bit
    units) they took 10-25% longer *with* it (Qwen2.5-0.5B body, 2 threads, interleaved: 2 rows 0.78x, 3-4 rows
    ~0.75x, 5-6 rows 0.81-0.84x, 12 rows 0.88x the time without; 16 rows and one row alike), so there it is off.
    The AMX build's passes of one row group (1-16 rows) prefetch their weights into L2 (``AMX_PREFETCH_ONE``): on an
    Emerald Rapids (family 6 model 207) one-row passes took 1.4x as long without (session 45, before the weight tiles
    were loaded with TILELOADDT1); on a Xeon of family 6 model 167 (session 73) 1.05-1.18x as long *with* it, so there
    it is off. The bf16 dot-product products of several row groups fetch each thread's next block of weights into L2
    while the row groups after the first run (``BF16DP_BLOCK_AHEAD``, on every CPU; measured on a Zen 5 only, session
    74: products of 16-64 rows 0.84-0.99x the time by the machine's state, batched passes of 16-64 rows 0.92-0.97x,
    Qwen2.5-0.5B-shaped blocks of 8-16 rows 0.92-1.00x). On a Zen 4 only full row groups (``ZEN4_AHEAD_ROWS``) after
    the first take part in that fetch (``BF16DP_AHEAD_ROWS``): with every group fetching, a short last group's fast
    steps each issuing a fetch, passes of 8-11 rows took 1.03-1.23x the time of no fetch at all (session 75, family 25
    model 17); with full groups only, 8-16 rows 0.95-1.00x, 16 x 4 rows 0.96. On a Zen 4 the bf16 dot-product products
    cut their rows into groups of 8 (``BF16DP_GROUP_ROWS``, an 8-row x 4-panel tile) where elsewhere they take 6: 8 rows
    are then one read of the weights instead of a read and a second pass of 2 rows from L2 (session 76: Llama-3.2-1B-
    and Qwen2.5-0.5B-shaped blocks of 8 rows 0.89-0.93x the time, 16 rows 0.94-0.97x; weights in the caches alike).
    ``SPECDEC_CPU_KERNEL_PREFETCH=0`` / ``=1`` (``env``) turns every prefetch off / the tile prefetches on, on any CPU
    (the row groups stay as tuned)."""
    forced = _switch(env)
    if isa == "amx":
        on = not (vendor == "GenuineIntel" and family == 6 and model == 167) if forced is None else forced
        return [] if on else ["-DAMX_PREFETCH_ONE=0"]
    if isa != "avx512bf16":
        return []
    zen4 = vendor == "AuthenticAMD" and family == 25
    groups = [f"-DBF16DP_GROUP_ROWS={ZEN4_GROUP_ROWS}"] if zen4 else []
    if forced is False:
        return ["-DBF16DP_PREFETCH=0", "-DBF16DP_BLOCK_AHEAD=0", *groups]
    on = not zen4 if forced is None else forced
    return (
        ([] if on else ["-DBF16DP_PREFETCH=0"]) + ([f"-DBF16DP_AHEAD_ROWS={ZEN4_AHEAD_ROWS}"] if zen4 else []) + groups
    )


def build_flags() -> tuple[str, list[str]]:
    """The build this process would load, and its compiler flags: the best instruction set the CPU, the OS and
    SPECDEC_CPU_KERNEL_ISA allow, tuned to the CPU (``tuning_flags``; SPECDEC_CPU_KERNEL_PREFETCH)."""
    isa = kernel_isa()
    vendor, family, model = cpu_model()
    return isa, CXX_FLAGS + ISA_FLAGS[isa] + tuning_flags(isa, vendor, family, os.environ.get(PREFETCH_SWITCH), model)


def _build(cxx: str) -> Path:
    isa, flags = build_flags()
    return compile_kernel(cxx, isa, flags, cache_dir("kernels"))


def compile_kernel(cxx: str, isa: str, flags: list[str], root: Path) -> Path:
    """The kernel built by ``cxx`` with ``flags`` (``build_flags``), compiled unless ``root`` holds it already
    (``root/KEY/llama_cpu.so``, KEY a hash of the source, the flags, the link and the compiler's version). Reads no
    setting of the process, so several builds may run at once on threads of one process (tests of other builds)."""
    src = SOURCE.read_bytes()
    link = _openmp_link()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(b"\0".join([src, " ".join(flags + link).encode(), version.encode()])).hexdigest()[:16]
    out = root / key / "llama_cpu.so"
    if out.exists():
        return out
    # A build takes ~40 s on 2 cores (the many tile shapes): say so where someone is watching, as it starts.
    note = f"compiling the CPU kernel for this CPU ({isa}; once, cached in {out.parent.parent}, ~40 s on 2 cores)"
    log.info(note)
    if sys.stderr.isatty():
        print(f"specdec: {note}", file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        for cmd in (
            [cxx, *flags, "-c", str(SOURCE), "-o", str(obj)],
            [cxx, "-shared", str(obj), "-o", str(lib), *link],
        ):
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
                raise RuntimeError(f"compiling the CPU kernel failed: {' | '.join(tail)}")
        os.replace(lib, out)  # atomic: concurrent builders each write a complete file
    return out


def compiler() -> str | None:
    """The C++ compiler the kernel is built with: $CXX, else the first of c++, g++, clang++ on the PATH."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """The built kernel library, or None and why not (cached: decided once per process)."""
    if switched_off(ENV_SWITCH):
        return None, f"disabled by {ENV_SWITCH}"
    why = _cpu_ok()
    if why is not None:
        return None, why
    cxx = compiler()
    if cxx is None:
        return None, "no C++ compiler found (set CXX)"
    try:
        path = str(_build(cxx))
        lib = ctypes.CDLL(path)
        held = ctypes.PyDLL(path)  # the same library (loaded once), its calls holding the GIL: ``_HELD``
    except (OSError, RuntimeError) as e:
        return None, str(e)
    if lib.sd_abi_version() != ABI_VERSION:
        return None, "stale kernel build (ABI version mismatch)"
    fn = lib.sd_forward_rows
    fn.restype = ctypes.c_int
    # model, ids, pos, kv pointers, k, out_idx, n_out, logits, scratch, threads, argmax, prof
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    fn.argtypes += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.sd_scratch_floats.restype = ctypes.c_int64
    lib.sd_weight_pairs.restype = ctypes.c_int
    lib.sd_weight_pairs.argtypes = [ctypes.c_int64]
    lib.sd_panel_width.restype = ctypes.c_int
    lib.sd_panel_group.restype = ctypes.c_int
    lib.sd_panel_group.argtypes = [ctypes.c_int64]
    lib.sd_panel_halves.restype = ctypes.c_int
    lib.sd_panel_halves.argtypes = [ctypes.c_int64]
    lib.sd_key_block.restype = ctypes.c_int
    lib.sd_amx.restype = ctypes.c_int
    lib.sd_matmul.restype = ctypes.c_int
    lib.sd_matmul.argtypes = [ctypes.c_int64, *[ctypes.c_void_p] * 4, *[ctypes.c_int64] * 4, ctypes.c_void_p]
    lib.sd_matmul.argtypes += [ctypes.c_int64, ctypes.c_int64]
    lib.sd_scratch_floats.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    for handle in (lib, held):
        handle.sd_argmax_rows.restype = None
        handle.sd_argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        handle.sd_argmax_rows.argtypes += [ctypes.c_int64]
        handle.sd_sample_rows.restype = ctypes.c_int64
        handle.sd_sample_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        handle.sd_sample_rows.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        handle.sd_sample_rows.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        handle.sd_verify_sampled.restype = ctypes.c_int64
        handle.sd_verify_sampled.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
        handle.sd_verify_sampled.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_double]
        handle.sd_verify_sampled.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    _HELD[id(lib)] = held
    lib.sd_draft_greedy.restype = ctypes.c_int
    # model, n, ids, off, pos0, kv, tau, max_tau, rules, vocab_used, tokens, tops, drafted, fed, logits, scratch, threads
    lib.sd_draft_greedy.argtypes = [ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 5, ctypes.c_int64]
    lib.sd_draft_greedy.argtypes += [ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 6, ctypes.c_int64]
    lib.sd_draft_greedy.argtypes += [ctypes.c_void_p] * 4  # temps, uniforms, q, probs (sampled picks; NULL: none)
    lib.sd_units_taken.restype = ctypes.c_int64
    lib.sd_head_i8.restype = ctypes.c_int
    lib.sd_head_stats.restype = None
    lib.sd_head_stats.argtypes = [ctypes.c_void_p]
    lib.sd_set_share_lag.restype = None
    lib.sd_set_share_lag.argtypes = [ctypes.c_int64]
    return lib, None


# The kernel's short calls (tens of microseconds) through a handle that keeps the GIL, by the CDLL handle's id. A
# ctypes call through a CDLL lets the GIL go for its duration, which suits a pass (milliseconds: a server's event loop
# runs meanwhile) but not a call between passes: the event loop took the GIL for its whole burst of work whenever the
# step's thread let it go, and the step waited for it with the other core idle (see ``FusedLlama.forward_rows``).
_HELD: dict[int, ctypes.PyDLL] = {}


def _library() -> ctypes.CDLL | None:
    return _load()[0]


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first index of its maximum, as ``torch.argmax``) of a 2-D fp32 tensor, by the kernel
    where it is available and the tensor is contiguous in CPU memory; rows holding a NaN, and everything else, by
    torch."""
    lib = _library()
    if (
        lib is None
        or logits.device.type != "cpu"
        or logits.dim() != 2
        or logits.dtype != torch.float32
        or not logits.is_contiguous()
        or logits.numel() == 0
    ):
        return logits.argmax(dim=-1).tolist()
    return kernel_argmax_rows(lib, logits)


def kernel_argmax_rows(lib: ctypes.CDLL, logits: torch.Tensor) -> list[int]:
    """``argmax_rows`` of logits known to suit the kernel (a contiguous 2-D fp32 CPU tensor: a pass's logits), without
    the checks: each torch call costs microseconds on the caches a pass has just flushed."""
    n, v = logits.shape
    out = array.array("q", bytes(8 * n))
    (_HELD.get(id(lib)) or lib).sd_argmax_rows(logits.data_ptr(), n, v, out.buffer_info()[0], pass_threads())
    return nan_rows_by_torch(out.tolist(), logits)


def kernel_sample_rows(
    lib: ctypes.CDLL,
    logits: torch.Tensor,
    rows: Sequence[int],
    temperatures: Sequence[float],
    uniforms: Sequence[float],
) -> list[int]:
    """One draw from ``softmax(logits[r] / T)`` for each row ``r`` of ``rows`` with its temperature and its uniform in
    [0, 1) (``sd_sample_rows``: the inverse of the row's distribution function, float64 sums), for logits known to suit
    the kernel (a contiguous 2-D fp32 CPU tensor: a pass's logits). ValueError for a row without a finite maximum."""
    return _sample_rows(lib, logits, rows, temperatures, uniforms, None)[0]


def kernel_sample_with_probs(
    lib: ctypes.CDLL,
    logits: torch.Tensor,
    rows: Sequence[int],
    temperatures: Sequence[float],
    uniforms: Sequence[float],
    probs: torch.Tensor,
) -> tuple[list[int], list[float], list[float]]:
    """``kernel_sample_rows``, each row's distribution drawn from also written to ``probs`` (a contiguous fp32 CPU
    ``[len(rows), V]``): the tokens, each one's probability there and the likeliest token's."""
    return _sample_rows(lib, logits, rows, temperatures, uniforms, probs)


def kernel_verify_sampled(
    lib: ctypes.CDLL,
    logits: torch.Tensor,
    row0: int,
    temperature: float,
    tokens: Sequence[int],
    draft_probs: torch.Tensor,
    rs: Sequence[float],
    u: float,
) -> tuple[list[bool], int, int, list[float]]:
    """A temperature-only request's sampled verdict (``sd_verify_sampled``) from the target's rows ``row0 ..
    row0 + τ`` of ``logits`` (a contiguous fp32 CPU tensor: a pass's), its draft ``tokens`` drawn from ``draft_probs``
    (contiguous fp32 ``[τ, V]``), the acceptance uniforms ``rs`` in (0, 1] and the last draw's ``u`` in [0, 1): each
    test's outcome, n̂, the last token, and p(ŷ) of each draft token. ValueError for a row without a finite maximum."""
    tau, v = len(tokens), logits.shape[1]
    d, r = array.array("q", tokens), array.array("f", rs)
    flags, ptok, token = array.array("B", bytes(tau)), array.array("f", bytes(4 * tau)), array.array("q", [0])
    n = (_HELD.get(id(lib)) or lib).sd_verify_sampled(
        logits.data_ptr() + 4 * row0 * v,
        v,
        tau,
        temperature,
        d.buffer_info()[0],
        draft_probs.data_ptr(),
        r.buffer_info()[0],
        u,
        flags.buffer_info()[0],
        ptok.buffer_info()[0],
        token.buffer_info()[0],
    )
    if n < 0:
        raise ValueError(
            f"sampling needs finite probabilities with a positive total in every row (row {row0 - 1 - n} has none)"
        )
    return [bool(f) for f in flags], int(n), int(token[0]), ptok.tolist()


def _sample_rows(
    lib: ctypes.CDLL,
    logits: torch.Tensor,
    rows: Sequence[int],
    temperatures: Sequence[float],
    uniforms: Sequence[float],
    probs: torch.Tensor | None,
) -> tuple[list[int], list[float], list[float]]:
    n, v = len(rows), logits.shape[1]
    idx, temps, us = array.array("q", rows), array.array("f", temperatures), array.array("d", uniforms)
    out = array.array("q", bytes(8 * n))
    prob, top = array.array("f", bytes(4 * n)), array.array("f", bytes(4 * n))
    bad = (_HELD.get(id(lib)) or lib).sd_sample_rows(
        logits.data_ptr(),
        idx.buffer_info()[0],
        n,
        v,
        temps.buffer_info()[0],
        us.buffer_info()[0],
        out.buffer_info()[0],
        pass_threads(),
        None if probs is None else probs.data_ptr(),
        prob.buffer_info()[0],
        top.buffer_info()[0],
    )
    if bad:
        raise ValueError(
            f"sampling needs finite probabilities with a positive total in every row (row {rows[bad - 1]} has none)"
        )
    return out.tolist(), prob.tolist(), top.tolist()


def nan_rows_by_torch(best: list[int], logits: torch.Tensor) -> list[int]:
    """The kernel's argmax of each row of ``logits`` (``best``; -1 for a row holding a NaN) with such rows' torch's
    answer instead (the index of its first NaN); a new list either way. With no such row (every pass that is not broken)
    a copy of ``best``, without a look at any row."""
    if not best or min(best) >= 0:
        return list(best)
    return [b if b >= 0 else int(logits[r].argmax()) for r, b in enumerate(best)]


def kv_round(x: torch.Tensor, kv_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """For tests: the fp32 entries of ``x`` rounded to a 16-bit cache type (``torch.bfloat16`` or ``torch.float16``)
    as the kernel writes them to a cache, eight at a time (the vector path, with the one-at-a-time path for a tail)
    and one at a time; each as raw 16-bit patterns (int16). Requires the kernel."""
    lib = _library()
    if lib is None:
        raise RuntimeError("kv_round needs the CPU kernel")
    if kv_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"kv_round rounds to bfloat16 or float16, not {kv_dtype}")
    x = x.detach().to(torch.float32).contiguous().reshape(-1)
    vec, one = torch.empty(x.numel(), dtype=torch.int16), torch.empty(x.numel(), dtype=torch.int16)
    fn = lib.sd_kv_round
    fn.restype, fn.argtypes = (
        ctypes.c_int,
        [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p],
    )
    if fn(KV_TYPES[kv_dtype], x.data_ptr(), x.numel(), vec.data_ptr(), one.data_ptr()) != 0:
        raise RuntimeError("sd_kv_round refused its arguments")
    return vec, one


def chunk_rows(row_bytes: int) -> int:
    """Rows a pass runs in one call for a model whose scratch grows by ``row_bytes`` a row (``SCRATCH_BUDGET``)."""
    fit = SCRATCH_BUDGET // max(1, row_bytes) // AMX_ROWS * AMX_ROWS
    return max(CHUNK, min(CHUNK_MAX, fit))


def units_taken() -> int:
    """Units of a product's work one thread has taken from another's share since the kernel loaded (its products are
    shared out with stealing: a thread done with its own share goes on with the others' units). 0 without the kernel."""
    lib = _library()
    return int(lib.sd_units_taken()) if lib is not None else 0


def set_share_lag(microseconds: int) -> None:
    """For tests: the team's first thread waits ``microseconds`` before its own share of every product, as a thread
    that another process took the core from would, so the others take part of its share. 0 turns it off."""
    lib = _library()
    if lib is not None:
        lib.sd_set_share_lag(int(microseconds))


def head_stats() -> tuple[int, int]:
    """Rows whose argmax this process's passes took from the int8 head, and the head's panels (16 columns) they
    computed exactly for them (``forward_rows(logits=False)``)."""
    lib = _library()
    if lib is None:
        return 0, 0
    out = array.array("q", [0, 0])
    lib.sd_head_stats(out.buffer_info()[0])
    return out[0], out[1]


def kernel_available() -> bool:
    return _library() is not None


def kernel_status() -> str:
    """``"available (avx2)"`` / ``"available (avx512bf16)"`` / ``"available (amx)"`` (``"...; bf16 tiles without
    prefetch"`` / ``"...; one row group without prefetch"`` where ``tuning_flags`` turned it off, ``"...; bf16 tiles
    without prefetch or block ahead"`` where ``SPECDEC_CPU_KERNEL_PREFETCH=0`` turned both off), or why the CPU kernel
    is not used (for logs and ``specdec bench``'s JSON)."""
    lib, why = _load()
    if lib is None:
        return why or "unavailable"
    if not lib.sd_bf16_dot():
        return "available (avx2)"
    if lib.sd_amx():
        return "available (amx)" if lib.sd_amx_prefetch_one() else "available (amx; one row group without prefetch)"
    if lib.sd_bf16dp_prefetch():
        return "available (avx512bf16)"
    if lib.sd_bf16dp_block_ahead():
        return "available (avx512bf16; bf16 tiles without prefetch)"
    return "available (avx512bf16; bf16 tiles without prefetch or block ahead)"


def pack_weight(
    w: torch.Tensor, dtype: torch.dtype, panel: int, pairs: int, group: int = 1, halves: bool = False
) -> torch.Tensor:
    """``w`` ``[m, n]`` (outputs x inputs) in the kernel's panel layout, as ``dtype``.

    The outputs are cut into panels of ``panel`` (the last padded with zero rows); a panel stores its outputs
    interleaved along the reduction dimension: ``pairs == 1``: ``P[p][c][j] = w[panel*p + j][c]``;
    ``pairs == 2`` (bf16 dot products): ``P[p][c // 2][j][c % 2]``, ``n`` padded to even with a zero column.
    ``group > 1`` (``sd_panel_group``): the panels in groups of ``group`` (their number padded with zero panels), a
    group's panels interleaved pair by pair, ``G[p // group][c // pairs][p % group][j][c % pairs]``: a tile of one
    group's panels reads one sequential stream.
    ``halves`` (``sd_panel_halves``: bf16 on the AVX2 build): each panel's two halves of outputs interleaved, its
    ``j``-th place holding output ``j // 2 + (panel // 2) * (j % 2)``, so one load widens to both halves in fp32.
    """
    if w.dim() != 2 or pairs not in (1, 2) or panel < 1 or group < 1:
        raise ValueError(f"pack_weight needs a matrix, pairs 1 or 2, a positive panel and group, got {tuple(w.shape)}")
    if halves and (pairs != 1 or group != 1 or panel % 2):
        raise ValueError("pack_weight: interleaved halves are for single columns, one panel a group, an even panel")
    m, n = (int(s) for s in w.shape)
    rows, cols = -(-m // (panel * group)) * panel * group, -(-n // pairs) * pairs
    w = torch.nn.functional.pad(w.to(dtype), (0, cols - n, 0, rows - m))
    if halves:  # [p][h][i] -> [p][i][h]: place 2i + h holds output (panel / 2) h + i
        w = w.view(rows // panel, 2, panel // 2, cols).transpose(1, 2).reshape(rows, cols)
    panels = w.view(rows // panel, panel, cols // pairs, pairs).transpose(1, 2)  # [p][c // pairs][j][c % pairs]
    if group == 1:
        return panels.contiguous()
    return panels.reshape(rows // (panel * group), group, cols // pairs, panel, pairs).transpose(1, 2).contiguous()


def packed_nbytes(m: int, n: int, dtype: torch.dtype, panel: int, pairs: int, group: int = 1) -> int:
    """Bytes of ``pack_weight`` (or, for int8, ``pack_weight_int8``) of an ``[m, n]`` matrix, without packing it."""
    if dtype == torch.int8:
        rows = -(-m // panel) * panel
        return rows * n + rows * 4  # int8 panels (single columns), then the fp32 scales
    rows = -(-m // (panel * group)) * panel * group
    return rows * (-(-n // pairs) * pairs) * dtype.itemsize


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: ``q = round(w / s)`` with ``s = max|w[r]| / 127`` per row ``r`` (rows of
    zeros get ``s = 1``); returns ``(q int8 [m, n], s float32 [m])``, ``w ≈ q * s[:, None]``."""
    w = w.float()
    s = w.abs().amax(dim=1) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s


def pack_weight_int8(w: torch.Tensor, panel: int) -> torch.Tensor:
    """``w`` quantized (``quantize_int8``) in the panel layout, followed by the fp32 scales of the padded outputs
    (zeros for padding), as one byte buffer: the kernel finds the scales right after the panels."""
    q, s = quantize_int8(w)
    panels = pack_weight(q, torch.int8, panel, 1).reshape(-1)
    scales = torch.zeros(-(-int(w.shape[0]) // panel) * panel, dtype=torch.float32)
    scales[: s.numel()] = s
    return torch.cat([panels.view(torch.uint8), scales.view(torch.uint8)])


def head_int8(head: torch.Tensor) -> dict[str, torch.Tensor]:
    """The int8 copy of a model's head ``[V, d]`` for greedy passes (the kernel's "The head's argmax from an int8
    copy"): ``q`` int8 in panels of 16 columns by 4 inputs (``[V64 / 16][n4][16][4]``, V64 = V rounded up to 64,
    n4 = ceil(d / 4), zeros beyond), and per column (V64 entries, zeros beyond V) the scale ``s`` (``w ≈ s q``), the
    quantization's error ``|w - s q|`` and ``|w|`` (both rounded up: the kernel's bounds rest on them) and the sum of
    ``q``."""
    v, d = (int(x) for x in head.shape)
    v64, n4 = -(-v // 64) * 64, -(-d // 4)
    packed = torch.zeros(v64, 4 * n4, dtype=torch.int8)
    cols = {name: torch.zeros(v64, dtype=torch.float32) for name in ("s", "err", "norm")}
    qsum = torch.zeros(v64, dtype=torch.int32)
    grow = 1.0 + 1e-6  # over float32's rounding of the float64 norms (2^-24 relative)
    for lo in range(0, v, 8192):  # in slices: a real vocabulary's head in float64 would take gigabytes at once
        q8, s = quantize_int8(head[lo : lo + 8192])  # (the int8 drafts' quantization; any q and s serve the bound)
        w, q = head[lo : lo + 8192].double(), q8.double()  # (bf16, float32 and int8 are exact in float64)
        hi = lo + int(w.shape[0])
        packed[lo:hi, :d] = q8
        cols["s"][lo:hi] = s
        cols["err"][lo:hi] = ((w - s.double()[:, None] * q).norm(dim=1) * grow).float()
        cols["norm"][lo:hi] = (w.norm(dim=1) * grow).float()
        qsum[lo:hi] = q8.sum(dim=1, dtype=torch.int32)
    return {"q": packed.view(v64 // 16, 16, n4, 4).transpose(1, 2).contiguous(), **cols, "qsum": qsum}


@dataclass(frozen=True)
class PanelLayout:
    """The layout the kernel reads a weight type in (``sd_panel_width``, ``sd_weight_pairs``, ``sd_panel_group``)."""

    dtype: torch.dtype
    panel: int
    pairs: int
    group: int
    halves: bool = False

    @classmethod
    def of(cls, lib: ctypes.CDLL, dtype: torch.dtype) -> PanelLayout:
        wtype = WEIGHT_TYPES[dtype]
        pairs, group = int(lib.sd_weight_pairs(wtype)), int(lib.sd_panel_group(wtype))
        return cls(dtype, int(lib.sd_panel_width()), pairs, group, bool(lib.sd_panel_halves(wtype)))

    def nbytes(self, m: int, n: int) -> int:
        """Bytes of ``pack`` of an ``[m, n]`` matrix, without packing it."""
        return packed_nbytes(m, n, self.dtype, self.panel, self.pairs, self.group)

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.int8:
            return pack_weight_int8(w, self.panel)
        return pack_weight(w, self.dtype, self.panel, self.pairs, self.group, self.halves)


class PackedWeight:
    """One weight matrix ``[m, n]`` laid out for the kernel's products, to run products outside a forward pass
    (tests, micro-benchmarks): ``PackedWeight(w, torch.bfloat16).matmul(x)`` is ``x @ w.T`` as the kernel
    computes it inside a pass."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype) -> None:
        lib = _library()
        if lib is None:
            raise RuntimeError(f"CPU kernel unavailable: {kernel_status()}")
        if dtype not in WEIGHT_TYPES:
            raise ValueError(f"the kernel's weights are fp32, bf16, fp16 or int8, not {dtype}")
        self._lib, self.wtype = lib, WEIGHT_TYPES[dtype]
        self.rows, self.cols = (int(s) for s in w.shape)
        self.data = PanelLayout.of(lib, dtype).pack(w)

    def matmul(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        threads: int | None = None,
        stream: bool = False,
        cut: bool = False,
    ) -> torch.Tensor:
        """``x @ w.T + bias`` for fp32 ``x`` ``[k, n]``; with ``out`` (fp32 ``[k, m]``) the result is added to it.
        ``stream``: one-row products one panel at a time, as a model whose weights outgrow the cache runs them
        (``streams_weights``); ``cut``: products of several rows in chunks of columns, as such a model runs them
        (``cuts_columns``). The same results either way."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.cols:
            raise ValueError(f"x must be float32 [k, {self.cols}], got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        k = int(x.shape[0])
        accumulate = out is not None
        if out is None:
            out = torch.empty(k, self.rows, dtype=torch.float32)
        elif out.dtype != torch.float32 or tuple(out.shape) != (k, self.rows) or not out.is_contiguous():
            raise ValueError(f"out must be contiguous float32 [{k}, {self.rows}]")
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
            if tuple(bias.shape) != (self.rows,):
                raise ValueError(f"bias must have {self.rows} entries")
        xb = torch.empty(k * self.cols + 2, dtype=torch.int16)
        rc = self._lib.sd_matmul(
            self.wtype,
            x.data_ptr(),
            self.data.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            k,
            self.cols,
            self.rows,
            int(accumulate),
            xb.data_ptr(),
            threads or max(1, torch.get_num_threads()),
            stream_bits(stream, cut),
        )
        if rc != 0:
            raise ValueError("CPU kernel refused the product (empty matrix or rows)")
        return out


class FusedLlama:
    """A checkpoint's weights laid out for ``sd_forward_rows``; one instance per runner, shared by its caches."""

    ARGMAX_IN_PASS = True  # forward_rows(best=...): the pass takes its rows' argmax

    def __init__(
        self,
        cfg: NativeConfig,
        weights: ModelWeights,
        dtype: torch.dtype,
        max_context: int,
        head_ids: Sequence[int] | None = None,
        kv_dtype: torch.dtype = torch.float32,
    ) -> None:
        """``head_ids``: the tokens the output head keeps (ascending; None: every token). Logits then have one column
        per kept token, in that order, and ``draft_greedy`` returns token ids. ``kv_dtype``: the element type of
        the caches this model reads and writes (``KV_TYPES``; keys and values are rounded to it when written)."""
        if kv_dtype not in KV_TYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(str(t) for t in KV_TYPES)}, got {kv_dtype}")
        self.kv_dtype = kv_dtype
        lib = _library()
        if lib is None:
            raise RuntimeError(f"CPU kernel unavailable: {kernel_status()}")
        self._lib = lib
        self.vocab_size = int(weights.lm_head.shape[0])
        keep: list[torch.Tensor] = []
        head = weights.lm_head
        self.head_ids: list[int] | None = None
        if head_ids is not None:
            self.head_ids = [int(t) for t in head_ids]
            if not self.head_ids or any(not 0 <= t < self.vocab_size for t in self.head_ids):
                raise ValueError(f"head_ids must be non-empty token ids below {self.vocab_size}")
            if any(b <= a for a, b in zip(self.head_ids, self.head_ids[1:])):
                raise ValueError("head_ids must be ascending and distinct")
            head = head[torch.tensor(self.head_ids)]
        self.head_rows = int(head.shape[0])

        def ptr(t: torch.Tensor | None, want: torch.dtype) -> int | None:
            if t is None:
                return None
            t = t.to(want).contiguous()
            keep.append(t)
            return t.data_ptr()

        # The products' weights in the kernel's panel layout.
        layout = PanelLayout.of(lib, dtype)

        # Every product's weights (what a pass streams from memory), in the order the pass reads them, each packed and
        # placed in one huge-page arena where the OS has them (runtime/pages.py), one at a time.
        sources = [w for lw in weights.layers for w in (lw.wqkv, lw.wo, lw.wgu, lw.wd)] + [head]
        sizes = [layout.nbytes(int(w.shape[0]), int(w.shape[1])) for w in sources]
        arena = arena_for(sizes)
        mats = []
        for w, size in zip(sources, sizes):
            t = layout.pack(w)
            assert t.numel() * t.element_size() == size
            mats.append(t if arena is None else arena.place(t))
        keep.extend(mats)
        self.huge_pages = arena is not None and arena.advised
        self.stream = streams_weights(sum(sizes), os.environ.get(STREAM_SWITCH))
        self.cut = cuts_columns(sum(sizes), os.environ.get(CUT_SWITCH))

        # The kernel keeps keys in blocks of sd_key_block() positions: a cache holds a whole number of blocks.
        self.key_block = block = int(lib.sd_key_block())
        self.positions = -(-max_context // block) * block
        half = cfg.head_dim // 2
        cos, sin = rope_tables(cfg.rope, cfg.head_dim, self.positions)  # [T, 1, hd], sin signed
        rope_cos, rope_sin = cos[:, 0, :half].contiguous(), sin[:, 0, half:].contiguous()
        layers = (_Layer * cfg.layers)()
        for i, (lw, win) in enumerate(zip(weights.layers, cfg.windows)):
            layers[i] = _Layer(
                mats[4 * i].data_ptr(),
                ptr(lw.bqkv, torch.float32),
                mats[4 * i + 1].data_ptr(),
                ptr(lw.bo, torch.float32),
                mats[4 * i + 2].data_ptr(),
                ptr(lw.bgu, torch.float32),
                mats[4 * i + 3].data_ptr(),
                ptr(lw.bd, torch.float32),
                0 if win is None else int(win),
            )
        self._model = _Model(
            WEIGHT_TYPES[dtype],
            cfg.hidden,
            cfg.intermediate,
            cfg.heads,
            cfg.kv_heads,
            cfg.head_dim,
            self.vocab_size,
            cfg.layers,
            self.positions,
            int(weights.embed.shape[1]),
            float(cfg.eps),
            ptr(weights.embed, torch.float32 if dtype == torch.int8 else dtype),  # int8 models: fp32 table
            mats[-1].data_ptr(),
            ptr(rope_cos, torch.float32),
            ptr(rope_sin, torch.float32),
            layers,
            self.head_rows,
            None if self.head_ids is None else ptr(torch.tensor(self.head_ids, dtype=torch.int64), torch.int64),
            KV_TYPES[kv_dtype],
            stream_bits(self.stream, self.cut),
        )
        # Greedy passes' argmax from an int8 copy of the head (a build with VNNI int8 products, bf16 weights, the whole
        # head, finite weights): the same answer as every logit, from half the head's bytes (``forward_rows(logits=)``).
        self.prunes_head = (
            bool(lib.sd_head_i8())
            and dtype == torch.bfloat16
            and self.head_ids is None
            and not switched_off(HEAD_I8_SWITCH)
            and bool(torch.isfinite(head).all())
        )
        if self.prunes_head:
            i8 = head_int8(head)
            keep.extend(i8.values())
            self._model.head_q, self._model.head_qscale = i8["q"].data_ptr(), i8["s"].data_ptr()
            self._model.head_qerr, self._model.head_wnorm = i8["err"].data_ptr(), i8["norm"].data_ptr()
            self._model.head_qsum = i8["qsum"].data_ptr()
        self._layers, self._keep = layers, keep
        self._scratch = threading.local()  # per calling thread: concurrent requests never share scratch
        self._scratch_floats: dict[tuple[int, int], int] = {}
        self._model_ref = ctypes.byref(self._model)
        floats = self._lib.sd_scratch_floats
        self.chunk_rows = chunk_rows(4 * int(floats(self._model_ref, 2, 1) - floats(self._model_ref, 1, 1)))

    def profile(self, ids: torch.Tensor, kv: torch.Tensor, pos: int, last_only: bool, steps: int) -> dict[str, float]:
        """Seconds per call of each phase, and of the whole call (``"total"``), over ``steps`` calls at ``pos``."""
        acc = torch.zeros(len(PHASES), dtype=torch.float64)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.forward(ids, kv, pos, last_only, profile=acc)
        total = (time.perf_counter() - t0) / steps
        out = {name: float(v) / steps for name, v in zip(PHASES, acc)}
        out["outside phases (call, embedding, thread start)"] = total - sum(out.values())
        out["total"] = total
        return out

    def _scratch_for(self, k: int, threads: int) -> torch.Tensor:
        need = self._scratch_floats.get((k, threads))
        if need is None:
            need = self._scratch_floats[(k, threads)] = int(self._lib.sd_scratch_floats(self._model_ref, k, threads))
        return self._buffer("buf", need)

    def _buffer(self, name: str, floats: int) -> torch.Tensor:
        """A per-thread fp32 buffer of at least ``floats`` entries, reused across calls (contents undefined)."""
        buf = getattr(self._scratch, name, None)
        if buf is None or buf.numel() < floats:
            buf = torch.empty(floats, dtype=torch.float32)
            setattr(self._scratch, name, buf)
        return buf

    def draft_greedy(
        self,
        pending: list[list[int]],
        positions: list[int],
        caches: list[int],
        taus: list[int],
        rules: list[DraftRuleC | None],
        vocab_used: int,
        temps: Sequence[float] | None = None,
        uniforms: Sequence[Sequence[float]] | None = None,
    ) -> tuple[list[list[int]], list[list[float]], list[int], tuple[torch.Tensor, list[float]] | None]:
        """A whole greedy lockstep draft of several sequences in one call: sequence s feeds ``pending[s]`` (at
        least one token) at ``positions[s]..`` into the cache tensor at address ``caches[s]``, then drafts up to ``taus[s]`` tokens (argmax over
        the first ``vocab_used`` logits), stopping early where ``rules[s]`` says (evaluated as the drafting loop
        does). Returns each sequence's tokens and their top probabilities (every token an argmax was taken for: the
        drafted ones, and one a MinConfidence rule dropped), and how many tokens it wrote to its cache (its pending
        tokens and every drafted token but the last). Pending tokens must fit one chunk.

        ``temps`` (one per sequence, 0: greedy) with ``uniforms`` (``taus[s]`` of them in [0, 1) per sequence): a
        sequence with a temperature draws each token from softmax(logits / t) over those rows at its next uniform
        (``sd_sample_rows``' draw) instead. The fourth value is then the distributions drawn from, ``[n, max_tau,
        head_rows]``, and each token's probability ``[n * max_tau]`` (a greedy token's: its top probability); else
        None."""
        n = len(pending)
        off = [0]
        total = 0
        for p in pending:
            total += len(p)
            off.append(total)
        if total > CHUNK:
            raise ValueError(f"draft_greedy: {off[-1]} pending tokens exceed one chunk ({CHUNK})")
        max_tau = max(taus)
        # One int64 array in: offsets, positions, taus, cache addresses, then the pending ids; one out: tokens
        # [n][max_tau] (-1 where none was drafted), drafted [n], fed [n]. Arrays, not tensors: torch's calls cost tens
        # of microseconds on the caches a pass has just flushed.
        meta = array.array("q", off)
        meta.extend(positions)
        meta.extend(taus)
        meta.extend(caches)
        for p in pending:
            meta.extend(p)
        out_i = array.array("q", [-1]) * (n * max_tau + 2 * n)
        tops = array.array("f", bytes(4 * n * max_tau))
        logits = self._buffer("draft_logits", n * self.head_rows)
        threads = draft_threads()
        scratch = self._scratch_for(max(off[-1], n), threads)
        rule_ptrs = None
        if any(r is not None for r in rules):
            rule_ptrs = (ctypes.c_void_p * n)(*(None if r is None else ctypes.addressof(r) for r in rules))
        base, eight, out_at = meta.buffer_info()[0], 8, out_i.buffer_info()[0]
        sampled = temps is not None and any(t > 0 for t in temps)
        if sampled:
            assert temps is not None and uniforms is not None
            t_arr = array.array("f", temps)
            u_arr = array.array("d", bytes(8 * n * max_tau))
            for s, us in enumerate(uniforms):
                u_arr[s * max_tau : s * max_tau + len(us)] = array.array("d", us)
            q = torch.from_numpy(np.empty((n, max_tau, self.head_rows), dtype=np.float32))
            p_arr = array.array("f", bytes(4 * n * max_tau))
            extra: list[int | None] = [
                t_arr.buffer_info()[0],
                u_arr.buffer_info()[0],
                q.data_ptr(),
                p_arr.buffer_info()[0],
            ]
        else:
            extra = [None] * 4
        rc = self._lib.sd_draft_greedy(
            self._model_ref,
            n,
            base + eight * (4 * n + 1),
            base,
            base + eight * (n + 1),
            base + eight * (3 * n + 1),
            base + eight * (2 * n + 1),
            max_tau,
            rule_ptrs,
            vocab_used,
            out_at,
            tops.buffer_info()[0],
            out_at + eight * n * max_tau,
            out_at + eight * (n * max_tau + n),
            logits.data_ptr(),
            scratch.data_ptr(),
            threads,
            *extra,
        )
        if rc <= -2:
            raise ValueError(f"draft_greedy: sequence {-2 - rc}'s draft logits have no finite maximum to sample from")
        if rc != 0:
            raise ValueError(
                "CPU kernel refused the draft call (token ids out of range or a position beyond the cache)"
            )
        flat, top_l = out_i.tolist(), tops.tolist()
        picked = (q, p_arr.tolist()) if sampled else None
        fed = flat[n * max_tau + n :]
        tokens, probs = [], []
        for s in range(0, n * max_tau, max_tau):  # the tokens computed: before the first -1 (drafted, or dropped last)
            row = flat[s : s + max_tau]
            computed = row.index(-1) if -1 in row else max_tau
            tokens.append(row if computed == max_tau else row[:computed])
            probs.append(top_l[s : s + computed])
        return tokens, probs, fed, picked

    def forward(
        self, ids: torch.Tensor, kv: torch.Tensor, pos: int, last_only: bool, profile: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``[k or 1, vocab]`` of one sequence's ``ids`` at ``pos..``; writes the keys/values into ``kv``.

        ``profile``: a float64 tensor of ``len(PHASES)`` to which each phase's seconds are added.
        """
        k = int(ids.shape[0])
        out = [k - 1] if last_only else list(range(k))
        return self.forward_rows(ids.tolist(), list(range(pos, pos + k)), [kv.data_ptr()] * k, out, profile=profile)

    def forward_rows(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        caches: Sequence[int],
        out_idx: Sequence[int],
        profile: torch.Tensor | None = None,
        best: list[int] | None = None,
        logits: bool = True,
    ) -> torch.Tensor:
        """One pass over rows from any number of sequences: row t is token ``ids[t]`` at ``positions[t]`` of the
        sequence whose cache tensor starts at address ``caches[t]`` (a sequence's rows consecutive and in position
        order). Returns the logits of rows ``out_idx`` (ascending; ``[len(out_idx), head_rows]``).

        ``best``: a list the call fills with each returned row's argmax over its head rows (the first index of its
        maximum, torch's rule; -1 for a row holding a NaN), taken in parts as the head's product finishes each group
        of its outputs, while they are in the computing core's cache (``ArgParts`` in the kernel).
        ``logits=False`` (with ``best``, where ``prunes_head``): only the argmax, from the int8 copy of the head and the
        exact logits of the few panels that can hold the maximum: the same answer (a row holding a NaN: its first NaN,
        torch's); the tensor returned then has no columns.

        Every row's result is independent of the other rows in the pass, bit for bit.
        Passes of more than ``chunk_rows`` rows run in calls of that many (bounded scratch; a sequence's later rows see
        the keys its earlier calls wrote). The indices go to the kernel as one int64 array: a Python-side call costs
        a few microseconds, not a tensor operation per row (a one-token pass of the default target is ~1 ms).
        """
        k, n_out = len(ids), len(out_idx)
        if not (len(positions) == len(caches) == k):
            raise ValueError(f"forward_rows: {k} ids, {len(positions)} positions and {len(caches)} caches")
        # The indices in one int64 buffer: an array, not a tensor (torch's call costs ~20 µs on the caches a pass has
        # just flushed, the array's ~3).
        meta = array.array("q", ids)
        meta.extend(positions)
        meta.extend(caches)
        meta.extend(out_idx)
        base = meta.buffer_info()[0]
        ids_at, pos_at, kv_at, out_at = base, base + 8 * k, base + 16 * k, base + 24 * k
        threads = pass_threads()
        # Allocated by numpy, which keeps the GIL: ``torch.empty`` lets it go, and in a server the event loop then took
        # it for its whole burst of work (mean 0.29 ms a step at 16 clients, p90 1.3 ms, with the other core idle). The
        # pass's own call lets the GIL go for its milliseconds, when the event loop's work costs the step least.
        argmax_only = not logits and best is not None and self.prunes_head
        out = torch.from_numpy(np.empty((n_out, 0 if argmax_only else self.head_rows), dtype=np.float32))
        # A chunk's first row by address (a torch slice for it cost ~13 µs on the caches a pass has just flushed).
        out_base, row_bytes = (0, 0) if argmax_only else (out.data_ptr(), 4 * self.head_rows)
        prof = None if profile is None else profile.data_ptr()
        found = None if best is None else array.array("q", bytes(8 * n_out))
        found_at = 0 if found is None else found.buffer_info()[0]
        step = self.chunk_rows
        if k <= step:
            chunks = [(0, k, 0, n_out)]
        else:  # the asked rows (ascending) that fall in each chunk, relative to it
            chunks, first = [], 0
            for done in range(0, k, step):
                n = min(step, k - done)
                stop = bisect.bisect_left(out_idx, done + n, lo=first)
                chunks.append((done, n, first, stop))
                first = stop
            local = [r - done for done, _, first, stop in chunks for r in out_idx[first:stop]]
            rel = array.array("q", local)  # a local: alive until the calls are done, like meta
            out_at = rel.buffer_info()[0]
        for done, n, first, stop in chunks:
            rc = self._lib.sd_forward_rows(
                self._model_ref,
                ids_at + 8 * done,
                pos_at + 8 * done,
                kv_at + 8 * done,
                n,
                out_at + 8 * first,
                stop - first,
                None if argmax_only else out_base + row_bytes * first,
                self._scratch_for(n, threads).data_ptr(),
                threads,
                None if found is None else found_at + 8 * first,
                prof,
            )
            if rc != 0:
                raise ValueError(
                    "CPU kernel refused the call (token ids out of range, a position beyond the cache, "
                    "or an asked row outside the pass)"
                )
        if best is not None and found is not None:
            best[:] = found.tolist()
        return out
