"""The native runtime's one-call CPU kernel: block invariance, chunked prefill, threads, switches and errors.

Agreement with ``transformers`` (fp32, relative error < 1e-4) is in test_native_runtime.py, which runs
every checkpoint family on both back ends.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import specdec.runtime.native_kernel as nk
from specdec.errors import UnsupportedError
from specdec.runtime.native import NativeRunner

pytestmark = pytest.mark.skipif(not nk.kernel_available(), reason=f"CPU kernel unavailable: {nk.kernel_status()}")


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


def prefill(runner: NativeRunner, ids: torch.Tensor) -> torch.Tensor:
    return runner.forward(ids, runner.new_cache())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_block_and_single_token_passes_agree_bit_for_bit(
    tiny_models: dict[str, Path], arch: str, dtype: torch.dtype
) -> None:
    """A verify block of k tokens gives exactly the logits of k one-token steps (so greedy speculation can never
    flip a near-tie against plain decoding), and so does a long prefill."""
    runner = NativeRunner.from_pretrained(tiny_models[arch], dtype=dtype, kernel=True)
    ids = torch.randint(0, runner.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    cache = runner.new_cache()
    runner.forward(ids[:20], cache)
    for k in (1, 2, 5, 6, 7, 9, 13):
        block = runner.forward(ids[20 : 20 + k], cache)
        cache.crop(20)
        singles = torch.cat([runner.forward(ids[i : i + 1], cache) for i in range(20, 20 + k)])
        cache.crop(20)
        assert torch.equal(block, singles), f"k={k}"
    # A prefill of any length too (one product for every row count).
    steps = runner.new_cache()
    singles = torch.cat([runner.forward(ids[i : i + 1], steps) for i in range(40)])
    assert torch.equal(prefill(runner, ids[:32]), singles[:32])
    assert torch.equal(prefill(runner, ids), singles)


def test_chunked_prefill_equals_one_pass(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    runner = NativeRunner.from_pretrained(tiny_models["llama"], dtype=torch.float32, kernel=True)
    ids = torch.randint(0, runner.vocab_size, (50,), generator=torch.Generator().manual_seed(4))
    whole, last = prefill(runner, ids), runner.forward(ids, runner.new_cache(), last_only=True)
    assert torch.equal(last, whole[-1:])  # the head of one row equals the last of 50 rows
    fused = runner._fused
    for chunk in (7, 25):  # 50 tokens: 7 chunks with a short last one; 2 chunks of 25
        monkeypatch.setattr(fused, "chunk_rows", chunk)
        assert torch.equal(prefill(runner, ids), whole)
        chunked_last = runner.forward(ids, runner.new_cache(), last_only=True)
        assert chunked_last.shape == (1, runner.vocab_size) and torch.equal(chunked_last, last)
    # Blocks of three sequences in one pass (9 + 12 + 5 rows), keeping 2, all and 1 of their rows: chunks of 7 cut
    # through blocks and between asked rows alike.
    blocks = [ids[:9].tolist(), ids[9:21].tolist(), ids[21:26].tolist()]
    keep = [2, 12, 1]
    got = []
    for chunk in (7, 128):
        monkeypatch.setattr(fused, "chunk_rows", chunk)
        got.append(runner.forward_blocks([(b, runner.new_cache()) for b in blocks], keep))
    assert got[0].shape == (15, runner.vocab_size) and torch.equal(got[0], got[1])
    assert torch.equal(got[1][:2], whole[7:9])  # the first block is the prompt's first 9 tokens


def test_a_pass_runs_in_as_few_calls_as_its_scratch_allows(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch pass of more than 128 rows (16 sequences x 8 rows and a joining prompt) is one kernel call, not one per
    128 rows (each call reads every weight again); rows a call takes are bounded by the scratch they need."""
    runner = NativeRunner.from_pretrained(tiny_models["llama"], dtype=torch.float32, kernel=True)
    fused = runner._fused
    assert fused.chunk_rows == nk.CHUNK_MAX  # a tiny model: the scratch of CHUNK_MAX rows is far within the budget
    # The bounds: at least CHUNK rows however wide the model, at most CHUNK_MAX, whole AMX row groups in between.
    assert nk.chunk_rows(nk.SCRATCH_BUDGET) == nk.CHUNK
    assert nk.chunk_rows(1) == nk.CHUNK_MAX
    mid = nk.chunk_rows(nk.SCRATCH_BUDGET // 300)
    assert nk.CHUNK < mid <= 300 and mid % nk.AMX_ROWS == 0
    calls: list[int] = []
    lib = fused._lib
    real = lib.sd_forward_rows

    def counted(*args: object) -> int:
        calls.append(int(args[4]))  # the call's rows
        return int(real(*args))

    monkeypatch.setattr(lib, "sd_forward_rows", counted)
    ids = torch.randint(0, runner.vocab_size, (200,), generator=torch.Generator().manual_seed(6)).tolist()
    blocks = [ids[8 * i : 8 * i + 8] for i in range(16)] + [ids[128:144]]  # 144 rows
    one = runner.forward_blocks([(b, runner.new_cache()) for b in blocks], [1] * len(blocks))
    assert calls == [144]
    calls.clear()
    monkeypatch.setattr(fused, "chunk_rows", 64)
    pieces = runner.forward_blocks([(b, runner.new_cache()) for b in blocks], [1] * len(blocks))
    assert calls == [64, 64, 16] and torch.equal(one, pieces)


def test_every_prefill_length_equals_one_token_passes(tiny_models: dict[str, Path]) -> None:
    """Prefills of 33..45 tokens (fp32): every remainder of the row groups, against one-token passes."""
    runner = NativeRunner.from_pretrained(tiny_models["qwen2"], dtype=torch.float32, kernel=True)
    ids = torch.randint(0, runner.vocab_size, (45,), generator=torch.Generator().manual_seed(9))
    steps = runner.new_cache()
    singles = torch.cat([runner.forward(ids[i : i + 1], steps) for i in range(45)])
    for k in range(33, 46):
        assert torch.equal(prefill(runner, ids[:k]), singles[:k]), k


def test_thread_count_does_not_change_results(tiny_models: dict[str, Path]) -> None:
    runner = NativeRunner.from_pretrained(tiny_models["qwen2"], dtype=torch.bfloat16, kernel=True)
    ids = torch.randint(0, runner.vocab_size, (30,), generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prefill(runner, ids)
        torch.set_num_threads(3)
        three = prefill(runner, ids)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, three)


def test_kernel_and_operator_paths_agree_in_fp32(tiny_models: dict[str, Path]) -> None:
    ids = torch.randint(0, 64, (33,), generator=torch.Generator().manual_seed(6))
    a = prefill(NativeRunner.from_pretrained(tiny_models["mistral"], dtype=torch.float32, kernel=True), ids)
    b = prefill(NativeRunner.from_pretrained(tiny_models["mistral"], dtype=torch.float32, kernel=False), ids)
    assert float((a - b).abs().max() / b.abs().max()) < 1e-5


def test_default_is_the_kernel_on_cpu_and_not_with_compile(tiny_models: dict[str, Path]) -> None:
    assert NativeRunner.from_pretrained(tiny_models["llama"]).backend == "cpu-kernel"
    with pytest.raises(UnsupportedError, match="CPU kernel cannot run"):
        NativeRunner.from_pretrained(tiny_models["llama"], kernel=True, compile=True)


def test_switched_off_by_environment(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nk.ENV_SWITCH, "0")
    nk._load.cache_clear()
    try:
        assert not nk.kernel_available() and nk.kernel_status() == f"disabled by {nk.ENV_SWITCH}"
        runner = NativeRunner.from_pretrained(tiny_models["llama"])
        assert runner.backend.startswith("torch-")
        with pytest.raises(UnsupportedError, match=f"disabled by {nk.ENV_SWITCH}"):
            NativeRunner.from_pretrained(tiny_models["llama"], kernel=True)
    finally:
        monkeypatch.delenv(nk.ENV_SWITCH)
        nk._load.cache_clear()
    assert nk.kernel_available()


def test_a_failing_compiler_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "broken-c++"
    fake.write_text("#!/bin/sh\necho 'broken-c++: fatal error: nothing works' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    nk._load.cache_clear()
    try:
        assert not nk.kernel_available()
        assert "compiling the CPU kernel failed" in nk.kernel_status() and "nothing works" in nk.kernel_status()
    finally:
        monkeypatch.undo()
        nk._load.cache_clear()
    assert nk.kernel_available()


def test_out_of_range_token_is_an_error(tiny_models: dict[str, Path]) -> None:
    runner = NativeRunner.from_pretrained(tiny_models["llama"], kernel=True)
    with pytest.raises(ValueError, match="CPU kernel refused"):
        runner.forward(torch.tensor([runner.vocab_size + 3]), runner.new_cache())


def test_status_names_the_instruction_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX512-BF16 products where the CPU has them; SPECDEC_CPU_KERNEL_ISA=avx2 forces the fp32 AVX2 build."""
    assert nk.kernel_status().startswith(f"available ({nk.kernel_isa()}")
    monkeypatch.setenv(nk.ISA_SWITCH, "avx2")  # (the build the tests on every build load too: compiled once)
    nk._load.cache_clear()
    try:
        assert nk.kernel_isa() == "avx2" and nk.kernel_status() == "available (avx2)"
    finally:
        monkeypatch.undo()
        nk._load.cache_clear()


def test_the_build_is_the_best_the_cpu_and_os_allow_and_only_a_downgrade_is_forced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
    amx = avx512 | {"amx_tile", "amx_bf16"}
    cases = [  # CPU flags, OS grants the tiles, SPECDEC_CPU_KERNEL_ISA -> build
        ({"avx2", "fma", "f16c"}, True, "", "avx2"),
        ({"avx2", "fma", "f16c"}, True, "amx", "avx2"),  # no upgrade
        (avx512, True, "", "avx512bf16"),
        (avx512, True, "amx", "avx512bf16"),
        (avx512, True, "avx2", "avx2"),
        (amx, True, "", "amx"),
        (amx, False, "", "avx512bf16"),  # the OS refuses the tile state (kernel < 5.16, some hypervisors)
        (amx, True, "avx512bf16", "avx512bf16"),
        (amx, True, " AVX2 ", "avx2"),
        (amx, True, "bogus", "amx"),
    ]
    for flags, granted, asked, want in cases:
        monkeypatch.setattr(nk, "cpu_flags", lambda flags=flags: frozenset(flags))
        monkeypatch.setattr(nk, "amx_permitted", lambda granted=granted: granted)
        monkeypatch.setenv(nk.ISA_SWITCH, asked)
        assert nk.kernel_isa() == want, (sorted(flags), granted, asked)


def test_tuning_flags_turn_the_bf16_prefetch_off_on_zen4_only() -> None:
    ahead = [f"-DBF16DP_AHEAD_ROWS={nk.ZEN4_AHEAD_ROWS}"]  # Zen 4: only full row groups fetch the next block
    groups = [f"-DBF16DP_GROUP_ROWS={nk.ZEN4_GROUP_ROWS}"]  # Zen 4: row groups of 8, whatever the prefetch switch
    off = ["-DBF16DP_PREFETCH=0", *ahead, *groups]
    assert nk.tuning_flags("avx512bf16", "AuthenticAMD", 25) == off  # Zen 4 (family 25 with AVX512-BF16)
    assert nk.tuning_flags("avx512bf16", "AuthenticAMD", 26) == []  # Zen 5
    assert nk.tuning_flags("avx512bf16", "GenuineIntel", 6) == []  # Sapphire Rapids and later
    assert nk.tuning_flags("avx2", "AuthenticAMD", 25) == []  # Zen 3: the AVX2 build has no bf16 tiles
    assert nk.tuning_flags("avx512bf16", "AuthenticAMD", 25, env="1") == ahead + groups  # the switch, either way
    both = ["-DBF16DP_PREFETCH=0", "-DBF16DP_BLOCK_AHEAD=0"]  # the switch off: the next block's fetch off too
    assert nk.tuning_flags("avx512bf16", "GenuineIntel", 6, env="off") == both
    assert nk.tuning_flags("avx512bf16", "AuthenticAMD", 25, env="0") == both + groups
    assert nk.tuning_flags("avx2", "GenuineIntel", 6, env="0") == []


def test_tuning_flags_turn_the_amx_one_row_group_prefetch_off_on_model_167_only() -> None:
    off = ["-DAMX_PREFETCH_ONE=0"]
    assert nk.tuning_flags("amx", "GenuineIntel", 6, model=167) == off  # the Xeon of session 73
    assert nk.tuning_flags("amx", "GenuineIntel", 6, model=207) == []  # Emerald Rapids
    assert nk.tuning_flags("amx", "GenuineIntel", 6, model=143) == []  # Sapphire Rapids
    assert nk.tuning_flags("avx512bf16", "GenuineIntel", 6, model=167) == []  # no tiles: nothing to turn off
    assert nk.tuning_flags("amx", "GenuineIntel", 6, env="1", model=167) == []  # the switch, either way
    assert nk.tuning_flags("amx", "GenuineIntel", 6, env="0", model=207) == off


def builds_up_to(isa: str) -> bool:
    """Whether this CPU can run the kernel build ``isa`` (a downgrade from its best is forced by ISA_SWITCH)."""
    return nk.ISA_ORDER.index(nk.kernel_isa()) >= nk.ISA_ORDER.index(isa)


@contextmanager
def prefetch_build(
    monkeypatch: pytest.MonkeyPatch,
    isa: str | None,
    setting: str | None,
    cpu: tuple[str, int, int] | None = None,
) -> Iterator[None]:
    """The kernel loaded as built with SPECDEC_CPU_KERNEL_PREFETCH=``setting`` (``None``: unset; the build ``isa``
    forced, else this CPU's best; tuned as for ``cpu``, a (vendor, family, model), else this CPU), from the kernel
    cache (each build under a key of its flags: one of them may be this process's own); the process's own kernel
    again afterwards."""
    if isa is not None:
        monkeypatch.setenv(nk.ISA_SWITCH, isa)
    if setting is None:
        monkeypatch.delenv(nk.PREFETCH_SWITCH, raising=False)
    else:
        monkeypatch.setenv(nk.PREFETCH_SWITCH, setting)
    if cpu is not None:
        monkeypatch.setattr(nk, "cpu_model", lambda: cpu)
    nk._load.cache_clear()
    try:
        yield
    finally:
        monkeypatch.undo()
        nk._load.cache_clear()


Variant = tuple[str | None, str | None, tuple[str, int, int] | None]  # prefetch_build's isa, setting and cpu


def prebuild(monkeypatch: pytest.MonkeyPatch, variants: list[Variant]) -> None:
    """The builds ``prefetch_build`` will load for ``variants``, compiled now two at a time: a build is one compiler
    process on one core (~50 s), and one after another they took ~280 s of a 2-core CI run."""
    cxx = nk.compiler()
    assert cxx is not None
    builds = []
    for isa, setting, cpu in variants:
        with prefetch_build(monkeypatch, isa, setting, cpu):
            builds.append(nk.build_flags())
    root = nk.cache_dir("kernels")
    with ThreadPoolExecutor(max_workers=2) as pool:
        for path in pool.map(lambda b: nk.compile_kernel(cxx, b[0], b[1], root), builds):
            assert path.exists()


def runs_by_prefetch(
    path: Path, monkeypatch: pytest.MonkeyPatch, isa: str | None, ks: tuple[int, ...]
) -> dict[str, tuple[str, list[torch.Tensor]]]:
    """The kernel built with SPECDEC_CPU_KERNEL_PREFETCH=1 and =0 (``prefetch_build``), each build's status and its
    logits of a 30-token prefill and then of blocks of ``ks`` rows after it."""
    prebuild(monkeypatch, [(isa, "1", None), (isa, "0", None)])
    runs = {}
    for setting in ("1", "0"):
        with prefetch_build(monkeypatch, isa, setting):
            runner = NativeRunner.from_pretrained(path, dtype=torch.bfloat16, kernel=True)
            status = nk.kernel_status()
            cache = runner.new_cache()
            outs = [runner.forward(torch.arange(30) * 7 % 97, cache)]
            for k in ks:
                outs.append(runner.forward(torch.arange(k) * 5 % 97, cache))
                cache.crop(30)
            runs[setting] = (status, outs)
    return runs


@pytest.mark.skipif(not builds_up_to("avx512bf16"), reason="bf16 dot-product tiles are built only on AVX512-BF16 CPUs")
def test_the_prefetch_setting_never_changes_a_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Builds with and without the bf16 tiles' prefetch (SPECDEC_CPU_KERNEL_PREFETCH): prefill and verify blocks of
    1..16 rows (every tile height, two row groups) give the same logits bit for bit."""
    ks = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)
    # the AMX build has no bf16 dot-product tiles: the AVX512-BF16 build forced
    runs = runs_by_prefetch(odd_checkpoint(tmp_path), monkeypatch, "avx512bf16", ks)
    assert runs["1"][0] == "available (avx512bf16)"
    assert runs["0"][0] == "available (avx512bf16; bf16 tiles without prefetch or block ahead)"
    for a, b in zip(runs["1"][1], runs["0"][1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not builds_up_to("avx512bf16"), reason="bf16 dot-product tiles are built only on AVX512-BF16 CPUs")
def test_the_block_ahead_never_changes_a_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """Products of several row groups over a matrix of several L2 blocks a thread (2,950 x 203 bf16: 6.5 KB panels,
    blocks of 40, 185 panels: the last group of panels holds one, the last panel 6 outputs), whose later row groups
    fetch the thread's next block (BF16DP_BLOCK_AHEAD), against the build without any prefetch, on 1-3 threads: equal bit for bit at 8-33 rows (two to six row groups, every tail),
    and each row equal to the same row alone. Both ways the block ahead is built: every later row group fetching
    (the build tuned as for a Zen 5: groups of 6) and only the full ones of groups of 8 (as for a Zen 4: the 8 x 4
    tile, and an 8 x 1 one over the last group; 8 rows are one group, 9 are 5 + 4 and fetch nothing, 13's group of
    5 does not, 16's second group of 8 does, 25 and 33 end in 5 + 4), whatever this CPU is. The reference is built
    without any prefetch, in groups of 6 (as for a Zen 5)."""
    gen = torch.Generator().manual_seed(74)
    w = torch.randn(2950, 203, generator=gen) * 0.1
    x = torch.randn(33, 203, generator=gen)
    ks = (8, 9, 13, 16, 25, 33)
    # name: (the switch, the CPU the build is tuned for, the rows a later group needs to fetch; None: no block ahead),
    # SPECDEC_CPU_KERNEL_PREFETCH=0 building no prefetch at all
    zen5, zen4 = ("AuthenticAMD", 26, 2), ("AuthenticAMD", 25, 17)
    builds = {
        "every group": ("1", zen5, 1),
        "full groups": (None, zen4, nk.ZEN4_AHEAD_ROWS),
        "none": ("0", zen5, None),
    }
    prebuild(monkeypatch, [("avx512bf16", setting, cpu) for setting, cpu, _ in builds.values()])
    outs: dict[str, list[torch.Tensor]] = {}
    for name, (setting, cpu, rows) in builds.items():
        with prefetch_build(monkeypatch, "avx512bf16", setting, cpu):
            lib = nk._library()
            assert lib is not None and lib.sd_bf16dp_block_ahead() == (rows is not None)
            if rows is not None:
                assert lib.sd_bf16dp_ahead_rows() == rows
            assert lib.sd_bf16dp_group_rows() == (nk.ZEN4_GROUP_ROWS if cpu == zen4 else 6)
            packed = nk.PackedWeight(w, torch.bfloat16)
            outs[name] = []
            for threads in (1, 2, 3):
                outs[name] += [packed.matmul(x[:k], threads=threads) for k in ks]
                outs[name].append(torch.cat([packed.matmul(x[t : t + 1], threads=threads) for t in range(33)]))
    for name in ("every group", "full groups"):
        for a, b in zip(outs[name], outs["none"], strict=True):
            assert torch.equal(a, b), name
    alone = outs["none"][len(ks)]  # one thread, row by row
    for out in outs["every group"] + outs["full groups"]:
        assert torch.equal(out, alone[: out.shape[0]])


@pytest.mark.skipif(not builds_up_to("amx"), reason="the AMX build runs only where the CPU and the OS grant the tiles")
def test_the_amx_prefetch_setting_never_changes_a_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The AMX build with and without its one-row-group prefetch (SPECDEC_CPU_KERNEL_PREFETCH): a prefill (two row
    groups, which keep their prefetch of the next group) and verify blocks of 1..16 rows give the same logits."""
    path = odd_checkpoint(tmp_path, hidden=128)  # 64 column pairs: whole 16-pair steps, the tiles' own loop
    runs = runs_by_prefetch(path, monkeypatch, None, (1, 2, 3, 5, 8, 16))
    assert runs["1"][0] == "available (amx)"
    assert runs["0"][0] == "available (amx; one row group without prefetch)"
    for a, b in zip(runs["1"][1], runs["0"][1], strict=True):
        assert torch.equal(a, b)


def odd_checkpoint(root: Path, heads: int = 4, kv_heads: int = 2, hidden: int = 72, name: str = "odd") -> Path:
    """hidden 72, head_dim 18, intermediate 100, vocab 97: none a multiple of the vector widths, the 16-output
    panels or the AVX512 build's 64."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=97,
        hidden_size=hidden,
        intermediate_size=100,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(7)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
            else:
                p.mul_(8.0)
    model.save_pretrained(str(root / name), safe_serialization=True)
    return root / name


def test_odd_sizes_take_the_tail_paths_and_still_match_transformers(tmp_path: Path) -> None:
    """hidden 72, head_dim 18, intermediate 100, vocab 97: none a multiple of the 16-wide strides (nor of the
    AVX512 build's 64), so every product, RoPE and attention runs its remainder code."""
    from specdec.runtime.hf import HFRunner

    odd_checkpoint(tmp_path)
    ids = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(8))
    kernel = NativeRunner.from_pretrained(tmp_path / "odd", dtype=torch.float32, kernel=True)
    hf = HFRunner.from_pretrained(tmp_path / "odd", dtype=torch.float32)
    got, want = prefill(kernel, ids), hf.forward(ids, hf.new_cache())
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    bf = NativeRunner.from_pretrained(tmp_path / "odd", dtype=torch.bfloat16, kernel=True)
    cache = bf.new_cache()
    bf.forward(ids[:20], cache)
    block = bf.forward(ids[20:27], cache)
    cache.crop(20)
    assert torch.equal(block, torch.cat([bf.forward(ids[i : i + 1], cache) for i in range(20, 27)]))


def test_many_query_heads_per_kv_head_and_tiny_heads(tmp_path: Path) -> None:
    """20 query heads on one KV head (more than one attention work item holds: the heads are split) with head_dim 4
    (no 8-lane column stride at all): blocks equal one-token passes bit for bit, and match transformers."""
    from specdec.runtime.hf import HFRunner

    path = odd_checkpoint(tmp_path, heads=20, kv_heads=1, hidden=80, name="mqa")
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(9))
    kernel = NativeRunner.from_pretrained(path, dtype=torch.float32, kernel=True)
    hf = HFRunner.from_pretrained(path, dtype=torch.float32)
    got, want = prefill(kernel, ids), hf.forward(ids, hf.new_cache())
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    steps = kernel.new_cache()
    singles = torch.cat([kernel.forward(ids[i : i + 1], steps) for i in range(40)])
    assert torch.equal(got, singles)
    cache = kernel.new_cache()
    kernel.forward(ids[:25], cache)
    assert torch.equal(kernel.forward(ids[25:33], cache), singles[25:33])


def test_units_of_seven_and_eight_queries_and_sharp_softmax(tmp_path: Path, isa: str) -> None:
    """head_dim 64 with 4 query heads per KV head: a block of 2 rows is one attention unit of 8 queries (the value sums
    in 32-column chunks on AVX512 builds), 3 rows two units of 6, 7 rows four of 7; several sequences' blocks in one
    pass make units of their own. Weights x8 make the softmax sharp: a fifth of the causal weights (16-22% by layer in
    transformers) fall below the kernel's floor (2^-64 of the largest, set to 0). Every row's logits equal its one-token pass bit for bit, in blocks and in a batch
    of sequences, and the prefill matches transformers; on every build the CPU runs (AVX2: items of up to 3)."""
    from specdec.runtime.hf import HFRunner

    path = odd_checkpoint(tmp_path, heads=8, kv_heads=2, hidden=512, name="g4")
    ids = torch.randint(0, 97, (48,), generator=torch.Generator().manual_seed(10))
    kernel = NativeRunner.from_pretrained(path, dtype=torch.bfloat16, kernel=True)
    hf = HFRunner.from_pretrained(path, dtype=torch.float32)
    fp32 = NativeRunner.from_pretrained(path, dtype=torch.float32, kernel=True)
    got, want = prefill(fp32, ids), hf.forward(ids, hf.new_cache())
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    steps = kernel.new_cache()
    singles = torch.cat([kernel.forward(ids[i : i + 1], steps) for i in range(48)])
    for lo, k in ((20, 2), (22, 3), (25, 7), (32, 8)):
        cache = kernel.new_cache()
        kernel.forward(ids[:lo], cache)
        assert torch.equal(kernel.forward(ids[lo : lo + k], cache), singles[lo : lo + k]), (lo, k)
    # Three sequences at different lengths, blocks of 2, 4 and 1 rows, in one pass.
    caches, blocks, keep, want_rows = [], [], [], []
    for lo, k in ((10, 2), (30, 4), (40, 1)):
        cache = kernel.new_cache()
        kernel.forward(ids[:lo], cache)
        caches.append(cache)
        blocks.append((ids[lo : lo + k].tolist(), cache))
        keep.append(k)
        want_rows.append(singles[lo : lo + k])
    assert torch.equal(kernel.forward_blocks(blocks, keep), torch.cat(want_rows))


# ---------------------------------------------------------------------------------------------
# The products: one arithmetic for every row count (row independence), on each instruction set.

ISAS = ["avx2", "avx512bf16", "amx"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test body runs on the AVX2 build (forced), on the AVX512-BF16 build where the CPU has it (forced where the
    CPU has AMX too) and on the AMX build where the CPU and the OS allow it."""
    name = str(request.param)
    if not builds_up_to(name):
        pytest.skip(f"this CPU cannot run the {name} build (or {nk.ISA_SWITCH} stops below it)")
    if name != nk.kernel_isa():
        monkeypatch.setenv(nk.ISA_SWITCH, name)
    nk._load.cache_clear()
    assert nk.kernel_status().startswith(f"available ({name}")
    yield name
    monkeypatch.undo()
    nk._load.cache_clear()


def reference(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, isa: str) -> torch.Tensor:
    """x @ w.T in float64 from the values the kernel multiplies (bf16 dot products round x to bf16)."""
    xr = x.to(torch.bfloat16) if dtype == torch.bfloat16 and isa != "avx2" else x
    return xr.double() @ w.to(dtype).double().T


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_product_rows_are_independent_of_the_row_count(isa: str, dtype: torch.dtype) -> None:
    """Every row count 1..70 (every tile row tail, several row groups), rows in any order, 1..3 threads: a row's
    output is the same bit for bit; shapes cover every output-panel tail (m mod 16), reduction tails (odd n,
    n below a vector), panel-group tails (grouped layouts: 7, 13 and 31 panels, a thread with no group) and
    row groups re-reading L2 blocks of panels (481 x 2049: blocks of 12 panels, of one group in a grouped layout);
    AMX: reductions of whole 16-pair steps only (96), steps and pairs after them (72, 100, 2049), none (1, 17).
    Cut columns (``cut``) at 1-26 rows: chunks of 32 columns and a last one of 1 (2049, 257), 4 (100) or 8 (72), strips
    of three panels and a strip's tail (481 outputs: 31 panels), the same sums bit for bit."""
    gen = torch.Generator().manual_seed(11)
    for m, n in [(97, 72), (16, 17), (33, 1), (200, 100), (5, 257), (70, 96), (481, 2049)]:
        w = torch.randn(m, n, generator=gen)
        b = torch.randn(m, generator=gen)
        x = torch.randn(70, n, generator=gen)
        pw = nk.PackedWeight(w, dtype)
        whole = pw.matmul(x, bias=b, threads=2)
        ref = reference(x, w, dtype, isa) + b.double()
        assert float((whole - ref).abs().max() / ref.abs().max()) < 1e-5, (m, n)
        for k in range(1, 71):
            assert torch.equal(pw.matmul(x[:k], bias=b, threads=1 + k % 3), whole[:k]), (m, n, k)
        for k in range(1, 27):  # cut columns (a model whose weights outgrow the cache): 3..18 (AVX2) or 24 rows
            assert torch.equal(pw.matmul(x[:k], bias=b, threads=1 + k % 3, cut=True), whole[:k]), (m, n, k, "cut")
        perm = torch.randperm(70, generator=gen)
        assert torch.equal(pw.matmul(x[perm], bias=b, threads=3), whole[perm]), (m, n)
        for t in (0, 33, 69):  # a row alone, from the middle and the end of the call
            assert torch.equal(pw.matmul(x[t : t + 1], bias=b, threads=1), whole[t : t + 1]), (m, n, t)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_products_without_a_bias_are_the_sums_a_bias_is_added_to(isa: str, dtype: torch.dtype) -> None:
    """A product with nothing added to its sums (no bias, not accumulating) stores them as they are, straight from the
    tile unit on the AMX build where a group's panels are all outputs and the reduction is whole 16-pair steps (n a
    multiple of 32): the same sums bit for bit as the product with a bias has before adding it, for every row count
    1..70 (several row groups, paired and alone), and panel-group tails (m = 200, 130) taking the buffered path."""
    gen = torch.Generator().manual_seed(12)
    for m, n in [(200, 96), (130, 64), (64, 32), (97, 72)]:
        w = torch.randn(m, n, generator=gen)
        b = torch.randn(m, generator=gen)
        x = torch.randn(70, n, generator=gen)
        pw = nk.PackedWeight(w, dtype)
        with_bias = pw.matmul(x, bias=b, threads=2)
        bare = pw.matmul(x, threads=2)
        assert torch.equal(bare + b, with_bias), (m, n)
        for k in (1, 15, 16, 17, 31, 32, 33, 48, 64, 65, 70):
            assert torch.equal(pw.matmul(x[:k], threads=1 + k % 3), bare[:k]), (m, n, k)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.int8], ids=["fp32", "bf16", "fp16", "int8"])
def test_a_late_threads_share_taken_by_the_others_gives_the_same_sums_once(isa: str, dtype: torch.dtype) -> None:
    """A product's units are shared out with stealing: with the team's first thread held back 3 ms before its own
    share (as a thread whose core another process took would be), the others take units of its share, and every
    output is still computed once (the products add into ``out``: a unit taken twice would add twice) and the same
    bit for bit as on one thread; one row groups, several row groups (cut into chunks of columns too), and output-panel
    tails."""
    gen = torch.Generator().manual_seed(17)
    before = nk.units_taken()
    try:
        for m, n, k in [(1000, 96, 1), (481, 200, 7), (2000, 64, 40)]:
            w = torch.randn(m, n, generator=gen)
            b = torch.randn(m, generator=gen)
            x = torch.randn(k, n, generator=gen)
            base = torch.randn(k, m, generator=gen)
            pw = nk.PackedWeight(w, dtype)
            nk.set_share_lag(0)
            alone = pw.matmul(x, bias=b, out=base.clone(), threads=1)
            nk.set_share_lag(3000)
            for threads, cut in ((2, False), (3, False), (2, True)):
                taken = nk.units_taken()
                # With 3 threads on 2 cores the others may be done before the first has set out its share (it waits for
                # a core): retry, for seconds rather than a count of tries. On a 2-vCPU Xeon (session 73) the 3-thread
                # one-row product needed more than 20 tries in 14-27 of 50 trials (with and without the AMX prefetch),
                # at most 220 tries, 0.52 s: the count of 20 failed CI now and then.
                deadline = time.monotonic() + 10.0
                while True:
                    late = pw.matmul(x, bias=b, out=base.clone(), threads=threads, cut=cut)
                    assert torch.equal(late, alone), (m, n, k, threads)
                    if nk.units_taken() > taken or time.monotonic() > deadline:
                        break
                assert nk.units_taken() > taken, (m, n, k, threads)  # the lag made the others take some
    finally:
        nk.set_share_lag(0)
    assert nk.units_taken() > before


def test_a_pass_with_a_late_thread_gives_the_same_logits(tiny_models: dict[str, Path]) -> None:
    """A whole pass (prefill and a verify block) with the team's first thread held back before each product's share:
    the same logits bit for bit as without."""
    runner = NativeRunner.from_pretrained(tiny_models["qwen2"], dtype=torch.bfloat16, kernel=True)
    ids = torch.randint(0, runner.vocab_size, (30,), generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cache = runner.new_cache()
        want = torch.cat([runner.forward(ids[:21], cache), runner.forward(ids[21:], cache)])
        nk.set_share_lag(1000)
        taken = nk.units_taken()
        cache = runner.new_cache()
        got = torch.cat([runner.forward(ids[:21], cache), runner.forward(ids[21:], cache)])
    finally:
        nk.set_share_lag(0)
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    assert nk.units_taken() > taken


@pytest.mark.parametrize("dtype", [*DTYPES, torch.int8], ids=["fp32", "bf16", "fp16", "int8"])
def test_streamed_one_row_products_are_the_same_bit_for_bit(isa: str, dtype: torch.dtype) -> None:
    """A model whose weights stream from memory takes its one-row products one panel at a time (``stream``): the
    same outputs bit for bit as the four-panel tiles, and as those rows inside longer calls, on every panel tail."""
    gen = torch.Generator().manual_seed(13)
    for m, n in [(97, 72), (16, 17), (200, 100), (64, 257), (5, 3)]:
        w = torch.randn(m, n, generator=gen)
        b = torch.randn(m, generator=gen)
        x = torch.randn(9, n, generator=gen)
        pw = nk.PackedWeight(w, dtype)
        whole = pw.matmul(x, bias=b, threads=2)
        for t in range(9):
            for threads in (1, 2, 3):
                one = pw.matmul(x[t : t + 1], bias=b, threads=threads, stream=True)
                assert torch.equal(one, whole[t : t + 1]), (m, n, t, threads)
        assert torch.equal(pw.matmul(x, bias=b, threads=2, stream=True), whole), (m, n)  # more rows: unchanged


def test_a_model_streams_its_weights_where_they_outgrow_the_last_level_cache(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule, the switch (SPECDEC_CPU_KERNEL_STREAM) and a model run both ways: one-token passes, blocks and a
    prefill give the same logits bit for bit."""
    amd = "AuthenticAMD"
    assert nk.streams_weights(48 << 20, cache_bytes=32 << 20, vendor=amd)
    assert not nk.streams_weights(6 << 20, cache_bytes=32 << 20, vendor=amd)
    assert not nk.streams_weights(48 << 20, cache_bytes=0, vendor=amd)  # unknown cache: the four-panel tiles
    assert not nk.streams_weights(48 << 20, cache_bytes=32 << 20, vendor="GenuineIntel")  # four streams read faster
    assert nk.streams_weights(1, "1", cache_bytes=32 << 20, vendor="GenuineIntel")
    assert not nk.streams_weights(1 << 40, "off", cache_bytes=1, vendor=amd)
    outs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(nk.STREAM_SWITCH, setting)
        runner = NativeRunner.from_pretrained(tiny_models["llama"], dtype=torch.bfloat16, kernel=True)
        assert runner._fused.stream == (setting == "1")
        cache = runner.new_cache()
        got = [runner.forward(torch.arange(20) * 7 % 50, cache)]
        got += [runner.forward(torch.tensor([t]), cache) for t in (3, 9, 27)]
        got.append(runner.forward(torch.tensor([1, 2, 3, 4]), cache))
        outs[setting] = got
    for a, b in zip(outs["0"], outs["1"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_model_cuts_its_columns_where_its_weights_outgrow_the_last_level_cache(
    isa: str, dtype: torch.dtype, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule (any CPU), the switch (SPECDEC_CPU_KERNEL_CUT) and a model run both ways: a prefill, one-token passes,
    blocks of 3-18 rows and a batch of sequences give the same logits bit for bit (the tiny target's 64 and 128 inputs
    in chunks of 32; the fp32-arithmetic tiles cut: bf16 weights on the AVX2 build, fp16 on every build)."""
    assert nk.cuts_columns(48 << 20, cache_bytes=8 << 20)
    assert not nk.cuts_columns(48 << 20, cache_bytes=480 << 20)
    assert not nk.cuts_columns(48 << 20, cache_bytes=0)  # unknown cache: whole columns
    assert nk.cuts_columns(1, "1", cache_bytes=32 << 20)
    assert not nk.cuts_columns(1 << 40, "off", cache_bytes=1)
    outs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(nk.CUT_SWITCH, setting)
        runner = NativeRunner.from_pretrained(tiny_models["llama"], dtype=dtype, kernel=True)
        assert runner._fused.cut == (setting == "1")
        caches = [runner.new_cache() for _ in range(3)]
        got = [runner.forward(torch.arange(40) * 7 % 50, caches[0])]
        got += [runner.forward(torch.tensor([t]), caches[0]) for t in (3, 9)]
        got += [runner.forward(torch.arange(k) * 5 % 50, caches[0]) for k in (3, 6, 8, 13, 18)]
        got += runner.forward_batch([(torch.arange(k) * 3 % 50, c) for k, c in zip((4, 7, 5), caches)])
        outs[setting] = got
    for a, b in zip(outs["0"], outs["1"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_product_accumulates_into_the_output(isa: str, dtype: torch.dtype) -> None:
    """The residual form Y += X W^T + b: the product plus bias is computed first, then added to Y."""
    gen = torch.Generator().manual_seed(12)
    w, x, b = torch.randn(40, 24, generator=gen), torch.randn(9, 24, generator=gen), torch.randn(40, generator=gen)
    y0 = torch.randn(9, 40, generator=gen)
    pw = nk.PackedWeight(w, dtype)
    assert torch.equal(pw.matmul(x, bias=b, out=y0.clone()), y0 + pw.matmul(x, bias=b))


def test_product_refuses_bad_input() -> None:
    pw = nk.PackedWeight(torch.randn(8, 4), torch.float32)
    with pytest.raises(ValueError, match="x must be float32"):
        pw.matmul(torch.randn(2, 5))
    with pytest.raises(ValueError, match="x must be float32"):
        pw.matmul(torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="CPU kernel refused"):
        pw.matmul(torch.randn(0, 4))
    with pytest.raises(ValueError, match="out must be"):
        pw.matmul(torch.randn(2, 4), out=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="bias must have 8"):
        pw.matmul(torch.randn(2, 4), bias=torch.zeros(7))
    with pytest.raises(ValueError, match="not torch.float64"):
        nk.PackedWeight(torch.randn(8, 4), torch.float64)


def test_pack_weight_layout() -> None:
    """Panels of outputs, interleaved along the reduction (pairs for bf16 dot products), zero padded."""
    w = torch.arange(3 * 5, dtype=torch.float32).view(3, 5)
    single = nk.pack_weight(w, torch.float32, panel=2, pairs=1)  # [panels, n, panel, 1]
    assert single.shape == (2, 5, 2, 1)
    assert single[0, :, 0, 0].tolist() == w[0].tolist() and single[0, :, 1, 0].tolist() == w[1].tolist()
    assert single[1, :, 0, 0].tolist() == w[2].tolist() and single[1, :, 1, 0].abs().sum() == 0
    pairs = nk.pack_weight(w, torch.float32, panel=2, pairs=2)  # [panels, n/2, panel, 2], n padded to 6
    assert pairs.shape == (2, 3, 2, 2)
    assert pairs[0, 1, 1].tolist() == [w[1, 2], w[1, 3]] and pairs[0, 2, 0].tolist() == [w[0, 4], 0.0]
    # Panels in groups of 2, interleaved pair by pair: [groups, n/2, group, panel, 2], panels padded to 4.
    grouped = nk.pack_weight(w, torch.float32, panel=1, pairs=2, group=2)
    assert grouped.shape == (2, 3, 2, 1, 2)
    assert grouped[0, 1, 1, 0].tolist() == [w[1, 2], w[1, 3]] and grouped[1, 2, 0, 0].tolist() == [w[2, 4], 0.0]
    assert grouped[1, :, 1].abs().sum() == 0  # the padding panel
    assert torch.equal(nk.pack_weight(w, torch.float32, panel=2, pairs=1, group=1), single)
    # A panel's two halves interleaved (the AVX2 build's bf16 layout): place 2i + h holds output (panel / 2) h + i.
    w8 = torch.arange(6 * 3, dtype=torch.float32).view(6, 3)
    halves = nk.pack_weight(w8, torch.float32, panel=4, pairs=1, halves=True)  # [panels, n, panel, 1], 6 -> 8 rows
    assert halves.shape == (2, 3, 4, 1)
    for c in range(3):
        assert halves[0, c, :, 0].tolist() == [w8[0, c], w8[2, c], w8[1, c], w8[3, c]]
        assert halves[1, c, :, 0].tolist() == [w8[4, c], 0.0, w8[5, c], 0.0]
    with pytest.raises(ValueError, match="interleaved halves"):
        nk.pack_weight(w8, torch.float32, panel=4, pairs=2, halves=True)
    with pytest.raises(ValueError, match="pack_weight needs"):
        nk.pack_weight(w, torch.float32, panel=16, pairs=3)
    with pytest.raises(ValueError, match="pack_weight needs"):
        nk.pack_weight(w, torch.float32, panel=16, pairs=1, group=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_long_blocks_equal_one_token_passes(isa: str, dtype: torch.dtype, tmp_path: Path) -> None:
    """Every prefill and verify block length 1..70 gives the logits of one-token passes bit for bit (the model's
    odd sizes run every tail: hidden 72, head_dim 18, MLP 100, vocab 97), on this instruction set and dtype."""
    path = odd_checkpoint(tmp_path)
    runner = NativeRunner.from_pretrained(path, dtype=dtype, kernel=True)
    ids = torch.randint(0, 97, (70,), generator=torch.Generator().manual_seed(13))
    steps = runner.new_cache()
    singles = torch.cat([runner.forward(ids[i : i + 1], steps) for i in range(70)])
    for k in (1, 2, 3, 5, 7, 8, 9, 13, 17, 31, 33, 49, 70):
        assert torch.equal(prefill(runner, ids[:k]), singles[:k]), k
    cache = runner.new_cache()
    runner.forward(ids[:10], cache)
    for k in (1, 4, 6, 11, 25, 60):
        assert torch.equal(runner.forward(ids[10 : 10 + k], cache), singles[10 : 10 + k]), k
        cache.crop(10)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_a_row_in_a_batch_equals_the_row_alone(isa: str, dtype: torch.dtype, tmp_path: Path) -> None:
    """Blocks of 1..7 rows of 12 sequences at different positions, 46 rows in one pass (several row groups): each
    sequence's logits equal its block run alone, bit for bit (odd-size model: every tail)."""
    runner = NativeRunner.from_pretrained(odd_checkpoint(tmp_path), dtype=dtype, kernel=True)
    gen = torch.Generator().manual_seed(14)
    seqs = [torch.randint(0, 97, (40,), generator=gen) for _ in range(12)]
    starts = [3 + 2 * i for i in range(12)]
    sizes = [1 + i % 7 for i in range(12)]
    caches = []
    for s, n in zip(seqs, starts):
        caches.append(runner.new_cache())
        runner.forward(s[:n], caches[-1])
    alone = []
    for s, n, k, c in zip(seqs, starts, sizes, caches):
        alone.append(runner.forward(s[n : n + k], c))
        c.crop(n)
    together = runner.forward_batch([(s[n : n + k], c) for s, n, k, c in zip(seqs, starts, sizes, caches)])
    for i, (a, b) in enumerate(zip(alone, together)):
        assert torch.equal(a, b), i
    assert [c.length for c in caches] == [n + k for n, k in zip(starts, sizes)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_rows_not_asked_skip_the_last_layer_and_change_nothing(isa: str, dtype: torch.dtype, tmp_path: Path) -> None:
    """A pass asking fewer rows than it holds (a prompt's rest, a draft's catch-up, a prompt piece asking none) takes
    only the asked rows through its last layer past the keys and values: the asked rows' logits equal those of the
    same pass asking every row, bit for bit, wherever the unasked rows sit among them (the asked ones move to the
    front), and every cache holds the same keys and values after it, read back by a pass asking every row. Also a pass
    asking no row at all. On every build (the sliding window's model too: a moved row attends its own window)."""
    for path in (odd_checkpoint(tmp_path), gqa_checkpoint(tmp_path)):
        runner = NativeRunner.from_pretrained(path, dtype=dtype, kernel=True)
        gen = torch.Generator().manual_seed(23)
        sizes = [9, 3, 6, 2, 12, 1]  # a prompt's rest, a verify block, a piece, a block, a prompt, one row
        keep = [1, 3, 0, 2, 1, 1]
        seqs = [torch.randint(0, 97, (n + 30,), generator=gen).tolist() for n in sizes]
        starts = [4, 11, 7, 15, 2, 20]
        both = []
        for _ in range(2):
            caches = [runner.new_cache() for _ in seqs]
            for s, n, c in zip(seqs, starts, caches):
                runner.forward(torch.tensor(s[:n]), c)
            both.append(caches)
        asked, full_caches = both
        blocks = [s[n : n + k] for s, n, k in zip(seqs, starts, sizes)]
        got = runner.forward_blocks(list(zip(blocks, asked)), keep)
        full = runner.forward_blocks(list(zip(blocks, full_caches)), sizes)
        rows, at = [], 0
        for k, kept in zip(sizes, keep):
            rows += range(at + k - kept, at + k)
            at += k
        assert got.shape[0] == len(rows) == sum(keep)
        assert torch.equal(got, full[rows])
        # The caches: the next rows of every sequence, every row asked, read the same keys and values.
        nxt = [s[n + k : n + k + 3] for s, n, k in zip(seqs, starts, sizes)]
        assert torch.equal(
            runner.forward_blocks(list(zip(nxt, asked)), [3] * len(seqs)),
            runner.forward_blocks(list(zip(nxt, full_caches)), [3] * len(seqs)),
        )
        # A pass asking no row (prompt pieces only), then one asking every row.
        piece = [s[n + k + 3 : n + k + 8] for s, n, k in zip(seqs, starts, sizes)]
        assert runner.forward_blocks(list(zip(piece, asked)), [0] * len(seqs)).shape[0] == 0
        runner.forward_blocks(list(zip(piece, full_caches)), [5] * len(seqs))
        last = [s[n + k + 8 : n + k + 10] for s, n, k in zip(seqs, starts, sizes)]
        assert torch.equal(
            runner.forward_blocks(list(zip(last, asked)), [2] * len(seqs)),
            runner.forward_blocks(list(zip(last, full_caches)), [2] * len(seqs)),
        )


def gqa_checkpoint(root: Path, heads: int = 14, kv_heads: int = 2) -> Path:
    """14 query heads on 2 key/value heads (7 per group: the AVX512 build scores them in chunks of 4 + 3, AVX2 in
    3 + 2 + 2), head_dim 80 (one 64-column value chunk, then 8-column strides), a sliding window of 21 positions
    (windows that start inside a 16-position key block), max_position_embeddings 100 (not a whole number of key
    blocks: the cache is rounded up)."""
    import transformers as tf

    cfg = tf.MistralConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=80,
        sliding_window=21,
        max_position_embeddings=100,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(17)
    model = tf.MistralForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(6.0)
    out = root / f"gqa{heads}-{kv_heads}"
    model.save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.mark.parametrize("heads", [(14, 2), (6, 3), (3, 3)], ids=["7-per-group", "2-per-group", "mha"])
def test_attention_tiles_are_row_independent_and_match_transformers(
    isa: str, tmp_path: Path, heads: tuple[int, int]
) -> None:
    """The attention's tiles (keys in transposed 16-position blocks, a KV head's queries scored together: 7 per group
    in two chunks, 2, or one head alone), each row over its own window: blocks and prefills of every length up to the
    window's end equal one-token passes bit for bit, a forked cache continues like the original, the last position
    of the context works, and fp32 matches transformers."""
    from specdec.runtime.hf import HFRunner

    path = gqa_checkpoint(tmp_path, *heads)
    runner = NativeRunner.from_pretrained(path, dtype=torch.float32, kernel=True)
    assert runner.max_context == 100 and runner.cache_positions == 112 and runner.new_cache().kv.shape[3] == 112
    ids = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(18))
    steps = runner.new_cache()
    singles = torch.cat([runner.forward(ids[i : i + 1], steps) for i in range(100)])  # up to the last position
    hf = HFRunner.from_pretrained(path, dtype=torch.float32)
    assert rel_err(singles[:60], hf.forward(ids[:60], hf.new_cache())) < 1e-4
    for k in (1, 5, 16, 17, 33, 60):
        assert torch.equal(prefill(runner, ids[:k]), singles[:k]), k
    cache = runner.new_cache()
    runner.forward(ids[:37], cache)
    for k in (1, 2, 7, 9, 16):
        assert torch.equal(runner.forward(ids[37 : 37 + k], cache), singles[37 : 37 + k]), k
        cache.crop(37)
    fork = runner.fork_cache(cache, ids[:37].tolist())
    assert torch.equal(runner.forward(ids[37:45], fork), singles[37:45])


def test_fp32_attention_is_the_same_on_both_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In fp32 the AVX2 and the AVX512 builds run the same arithmetic (every score and value sum one chain in
    position order, whatever the vector width): a GQA model's logits are equal bit for bit."""
    if not builds_up_to("avx512bf16"):
        pytest.skip("this CPU lacks AVX512-BF16: only one build to compare")
    path = gqa_checkpoint(tmp_path)
    ids = torch.randint(0, 97, (50,), generator=torch.Generator().manual_seed(19))
    runs = []
    for forced in ("avx2", None):
        if forced:
            monkeypatch.setenv(nk.ISA_SWITCH, forced)
        else:
            monkeypatch.delenv(nk.ISA_SWITCH, raising=False)
        nk._load.cache_clear()
        runner = NativeRunner.from_pretrained(path, dtype=torch.float32, kernel=True)
        cache = runner.new_cache()
        runs.append(torch.cat([runner.forward(ids[:40], cache), runner.forward(ids[40:], cache)]))
    nk._load.cache_clear()
    assert torch.equal(runs[0], runs[1])


# ---------------------------------------------------------------------------------------------
# 16-bit KV caches (kv_dtype)

KV16 = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("kv_dtype", KV16, ids=["bf16-cache", "fp16-cache"])
def test_a_16_bit_cache_keeps_every_row_independent(isa: str, kv_dtype: torch.dtype, tmp_path: Path) -> None:
    """With keys and values kept in 16 bits, blocks and prefills of every length equal one-token passes bit for bit,
    a row in a batch of 12 sequences equals its block alone, and a forked cache continues like the original, on
    the odd-size model (head_dim 18: the 8-column and single-column value sums) and on the GQA model (head_dim 80:
    the 64-column value tiles, 7 queries per key/value head, a sliding window starting inside a key block)."""
    gen = torch.Generator().manual_seed(31)
    for path, vocab, n in ((odd_checkpoint(tmp_path), 97, 70), (gqa_checkpoint(tmp_path), 97, 100)):
        runner = NativeRunner.from_pretrained(path, dtype=torch.bfloat16, kernel=True, kv_dtype=kv_dtype)
        assert runner.cache_dtype == kv_dtype and runner.new_cache().kv.dtype == kv_dtype
        ids = torch.randint(0, vocab, (n,), generator=gen)
        steps = runner.new_cache()
        singles = torch.cat([runner.forward(ids[i : i + 1], steps) for i in range(n)])
        for k in (1, 5, 16, 17, 33, n):
            assert torch.equal(prefill(runner, ids[:k]), singles[:k]), (path.name, k)
        cache = runner.new_cache()
        runner.forward(ids[:37], cache)
        for k in (1, 2, 7, 9, 16):
            assert torch.equal(runner.forward(ids[37 : 37 + k], cache), singles[37 : 37 + k]), (path.name, k)
            cache.crop(37)
        fork = runner.fork_cache(cache, ids[:37].tolist())
        assert torch.equal(runner.forward(ids[37:45], fork), singles[37:45])
        seqs = [torch.randint(0, vocab, (50,), generator=gen) for _ in range(12)]
        caches, alone = [], []
        for i, sq in enumerate(seqs):
            caches.append(runner.new_cache())
            runner.forward(sq[: 3 + 3 * i], caches[-1])
            alone.append(runner.forward(sq[3 + 3 * i : 4 + 3 * i + i % 7], caches[-1]))
            caches[-1].crop(3 + 3 * i)
        together = runner.forward_batch(
            [(sq[3 + 3 * i : 4 + 3 * i + i % 7], c) for i, (sq, c) in enumerate(zip(seqs, caches))]
        )
        for i, (a, b) in enumerate(zip(alone, together)):
            assert torch.equal(a, b), (path.name, i)


@pytest.mark.parametrize("kv_dtype", KV16, ids=["bf16-cache", "fp16-cache"])
def test_a_16_bit_cache_holds_the_values_rounded_to_nearest(isa: str, kv_dtype: torch.dtype, tmp_path: Path) -> None:
    """The first layer's keys and values (the same inputs whatever the cache) are the fp32 cache's rounded to the
    nearest 16-bit value, ties to even (as torch rounds), and the logits stay close to the fp32 cache's."""
    path = odd_checkpoint(tmp_path)
    ids = torch.randint(0, 97, (32,), generator=torch.Generator().manual_seed(32))  # two whole key blocks
    wide = NativeRunner.from_pretrained(path, dtype=torch.bfloat16, kernel=True, kv_dtype="fp32")
    narrow = NativeRunner.from_pretrained(path, dtype=torch.bfloat16, kernel=True, kv_dtype=kv_dtype)
    wc, nc = wide.new_cache(), narrow.new_cache()
    ref, got = wide.forward(ids, wc), narrow.forward(ids, nc)
    assert torch.equal(nc.kv[0, :, :, :32], wc.kv[0, :, :, :32].to(kv_dtype))
    assert not torch.equal(nc.kv[0, :, :, :32].float(), wc.kv[0, :, :, :32])  # rounding did happen
    assert rel_err(got, ref) < 0.02


@pytest.mark.parametrize("kv_dtype", KV16, ids=["bf16-cache", "fp16-cache"])
def test_a_cache_entry_rounds_the_same_eight_at_a_time(isa: str, kv_dtype: torch.dtype) -> None:
    """The kernel writes a row's keys and values to a 16-bit cache eight entries at a time; each entry must be what the
    one-at-a-time rounding gives, on the cases that differ between roundings (ties to even either way, the largest
    finite values, which round to infinity, infinities, subnormals, signed zeros, NaNs of every sign and payload) and
    random bit patterns, at lengths with and without a tail; and, NaN aside, torch's rounding."""
    f32 = torch.tensor(
        [
            0.0,
            -0.0,
            1.0,
            -1.0,
            float("inf"),
            float("-inf"),
            3.4028235e38,
            -3.4028235e38,
            1e-40,
            -1e-45,
            65504.0,
            65520.0,
            65519.996,
            6.0e-8,
            2.98e-8,
            1e-5,
        ]
    )
    ties = torch.tensor(
        [0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7F8000, 0x7F7FFFFF, 0x00008000, 0x00018000],
        dtype=torch.int32,
    ).view(torch.float32)  # bf16 ties (even and odd), near ties, the largest
    nans = (
        torch.tensor(
            [0x7FC00000, 0xFFC00000 - 2**32, 0x7F800001, 0x7FBFFFFF, 0xFF800001 - 2**32, 0x7FFFFFFF], dtype=torch.int64
        )
        .to(torch.int32)
        .view(torch.float32)
    )
    gen = torch.Generator().manual_seed(16)
    noise = torch.randint(-(2**31), 2**31 - 1, (4096,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = torch.cat([f32, ties, nans, noise.view(torch.float32), torch.randn(1000, generator=gen) * 1e3])
    for n in (x.numel(), x.numel() - 3, 7, 8, 9):
        vec, one = nk.kv_round(x[:n], kv_dtype)
        assert torch.equal(vec, one), n
    vec, _ = nk.kv_round(x, kv_dtype)
    finite = ~torch.isnan(x)
    assert torch.equal(vec[finite], x[finite].to(kv_dtype).view(torch.int16))
    got = vec[~finite].view(kv_dtype)
    assert torch.isnan(got).all()  # a NaN stays a NaN
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        nk.kv_round(x, torch.float32)


def test_the_cache_dtype_follows_the_weights_unless_named(tiny_models: dict[str, Path]) -> None:
    """ "auto": 16 bits for 16-bit weights (bf16 for bf16 and int8 weights, fp16 for fp16), fp32 for fp32; a named
    type wins; a bad name is refused; the operator path keeps its compute dtype and refuses another by name."""
    from specdec.errors import ModelLoadError
    from specdec.runtime.native import kv_cache_dtype, kv_dtype_of

    for weights, want in ((torch.bfloat16, torch.bfloat16), (torch.int8, torch.bfloat16)):
        assert kv_cache_dtype("auto", weights) == want and kv_cache_dtype(None, weights) == want
    assert kv_cache_dtype("auto", torch.float16) == torch.float16
    assert kv_cache_dtype("auto", torch.float32) == torch.float32
    assert kv_cache_dtype("fp16", torch.bfloat16) == torch.float16
    assert kv_cache_dtype("float32", torch.bfloat16) == torch.float32
    assert kv_cache_dtype(torch.bfloat16, torch.float32) == torch.bfloat16
    for bad in ("int8", "fp8", torch.int8, 16):
        with pytest.raises(ModelLoadError, match="kv_dtype must be"):
            kv_cache_dtype(bad, torch.bfloat16)  # type: ignore[arg-type]
    path = tiny_models["llama"]
    assert kv_dtype_of(NativeRunner.from_pretrained(path, dtype=torch.float32)) == "fp32"
    assert kv_dtype_of(NativeRunner.from_pretrained(path, dtype=torch.bfloat16)) == "bf16"
    ops = NativeRunner.from_pretrained(path, dtype=torch.float32, kernel=False, kv_dtype="fp32")
    assert ops.cache_dtype == torch.float32
    with pytest.raises(UnsupportedError, match="kv_dtype bf16 runs only on the CPU kernel"):
        NativeRunner.from_pretrained(path, dtype=torch.float32, kernel=False, kv_dtype="bf16")
    assert kv_dtype_of(object()) is None


@pytest.mark.parametrize("kv_dtype", ["fp16", "fp32"])
def test_speculation_is_exact_whatever_the_cache_type(tiny_models: dict[str, Path], kv_dtype: str) -> None:
    """Greedy speculative output equals target-only output with the same cache type (fp16 here, bf16 being the
    default for these bf16 models), alone and batched with ragged τ; the option reaches both models; where it cannot
    run it is refused by name."""
    import specdec
    from specdec.errors import InvalidRequestError

    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="bfloat16", kv_dtype=kv_dtype)
    plain = specdec.load(tiny_models["llama"], dtype="bfloat16", kv_dtype=kv_dtype)
    want = {"fp16": torch.float16, "fp32": torch.float32}[kv_dtype]
    assert engine.target.cache_dtype == want and engine.drafter.runner.cache_dtype == want  # type: ignore[union-attr]
    prompts = ["the cat sat", "a b c d e f", "once upon a time there was", "x"]
    expected = [plain.generate(p, max_new_tokens=24).token_ids for p in prompts]
    for p, e in zip(prompts, expected):
        assert engine.generate(p, max_new_tokens=24, tau=5).token_ids == e
    batch = [engine.start(p, max_new_tokens=24, tau=1 + i) for i, p in enumerate(prompts)]
    while not all(g.done for g in batch):
        engine.step(batch)
    assert [g.result().token_ids for g in batch] == expected
    with pytest.raises(InvalidRequestError, match="kv_dtype must be auto, fp32, bf16, fp16, got 'fp8'"):
        specdec.load(tiny_models["llama"], kv_dtype="fp8")
    with pytest.raises(UnsupportedError, match="kv_dtype.*native runtime"):
        specdec.load(tiny_models["llama"], runtime="hf", kv_dtype=kv_dtype)
    specdec.load(tiny_models["llama"], runtime="hf", kv_dtype="auto")  # auto: the runtime's own


def test_cli_takes_the_cache_type_and_refuses_a_bad_one_in_one_line(tiny_models: dict[str, Path]) -> None:
    import subprocess
    import sys

    base = [sys.executable, "-m", "specdec.cli", "generate", "x = 1", "--target", str(tiny_models["llama"])]
    base += ["--draft", str(tiny_models["draft"]), "--max-new-tokens", "4", "--json", "--kv-dtype"]
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    ok = subprocess.run(base + ["fp16"], capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(base + ["int4"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr
    assert "kv_dtype must be auto, fp32, bf16, fp16, got 'int4'" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_the_kernels_argmax_is_torchs() -> None:
    """Every row's first index of its maximum, as torch.argmax: ties (the first wins), a maximum in the tail beyond
    the last 8-lane stride, rows of -inf, +inf, widths below a stride; rows holding a NaN are torch's answer too. On one
    thread and on two (from 8 rows the rows are shared among the pass's threads), and below 8 rows (one thread)."""
    gen = torch.Generator().manual_seed(41)
    before = torch.get_num_threads()
    try:
        for threads, v, rows in itertools.product((1, 2), (1, 5, 8, 40, 71, 97, 8192), (40, 8, 7)):
            torch.set_num_threads(threads)
            x = torch.randn(rows, v, generator=gen)
            x[1] = float("-inf")
            x[2, : min(v, 3)] = 7.0  # ties: the first
            x[3, -1] = 50.0  # in the tail
            x[4, v // 2] = float("inf")
            x[5, v - 1] = float("nan")
            x[6] = torch.round(x[6])  # many ties
            x[rows - 1, 0] = float("nan")
            x[rows - 1, -1] = 99.0
            assert nk.argmax_rows(x) == x.argmax(dim=-1).tolist(), (threads, v, rows)
    finally:
        torch.set_num_threads(before)
    wide = torch.randn(6, 300, generator=gen)
    assert nk.argmax_rows(wide[:, :100]) == wide[:, :100].argmax(dim=-1).tolist()  # not contiguous: torch
    assert nk.argmax_rows(torch.empty(0, 8)) == []


def tied_head_checkpoint(root: Path, nan_token: int | None = None) -> Path:
    """vocab 300 (the head's last group of 64 outputs and its last panel of 16 part-filled), a tied head whose rows
    70, 71 and 250 are one large row and rows 260 and 270 another, so wherever one of them is a row's maximum its
    twins tie with it exactly (within a slot of the argmax in parts, across slots, and in the part-filled last one),
    and, with ``nan_token``, that head row NaN."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=300,
        hidden_size=72,
        intermediate_size=100,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(9)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[70] = emb[71] = emb[250] = torch.randn(72) * 3.0
        emb[260] = emb[270] = torch.randn(72) * 3.0
        if nan_token is not None:
            emb[nan_token] = float("nan")
    name = "tied" if nan_token is None else f"tied_nan{nan_token}"
    model.save_pretrained(str(root / name), safe_serialization=True)
    return root / name


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_a_pass_takes_each_rows_argmax_as_torch_would(isa: str, dtype: torch.dtype, tmp_path: Path) -> None:
    """A pass's argmax, taken in parts as the head's product finishes each group of outputs, is torch's argmax of the
    pass's logits row by row: the first of tied maxima (within a group and across groups), the part-filled last group
    and panel, a batch of several sequences' blocks and one row alone; greedy verification reads it. A row holding a
    NaN gets torch's answer (the NaN's index)."""
    path = tied_head_checkpoint(tmp_path)
    runner = NativeRunner.from_pretrained(path, dtype=dtype, kernel=True)
    gen = torch.Generator().manual_seed(10)
    ids = torch.randint(1, 300, (60,), generator=gen).tolist()
    caches = [runner.new_cache() for _ in range(5)]
    for c, lo in zip(caches, range(0, 50, 10)):
        runner.forward_blocks([(ids[lo : lo + 6], c)], [1])
    tied = 0
    for blocks in ([(ids[lo + 6 : lo + 9], c) for c, lo in zip(caches, range(0, 50, 10))], [(ids[55:56], caches[0])]):
        logits = runner.forward_blocks(blocks, [len(b) for b, _ in blocks])
        want = logits.argmax(dim=-1).tolist()
        assert runner._pass_best == want  # taken in the pass
        assert runner.pass_argmax(logits) == runner.argmax_rows(logits) == want
        tied += sum(w in (70, 260) for w in want)
    assert tied > 0  # the tied rows were some rows' maximum: the first of them won
    for bad in (123, 290):  # a NaN in a whole group's slot, and in the part-filled last one
        nan = NativeRunner.from_pretrained(tied_head_checkpoint(tmp_path, nan_token=bad), dtype=dtype, kernel=True)
        cache = nan.new_cache()
        logits = nan.forward_blocks([(ids[:7], cache)], [7])
        assert nan._pass_best == [-1] * 7
        assert nan.pass_argmax(logits) == nan.argmax_rows(logits) == logits.argmax(dim=-1).tolist() == [bad] * 7


# ---------------------------------------------------------------------------------------------
# The int8 head: greedy passes' argmax from an int8 copy of the head and the exact logits of a few panels


def near_tie_checkpoint(root: Path, nan_token: int | None = None) -> Path:
    """vocab 300 (a part-filled last panel and group), hidden 70 (not a multiple of the int8 head's 4 inputs a lane),
    an untied head with exact twins (rows 70, 71 and 250; rows 260 and 270) and near twins (rows 100 + j and 180 + j, in
    other panels, a thousandth apart: closer than the int8 copy can tell), all large enough to be rows' maxima; with ``nan_token``
    that token's embedding NaN (its row's inputs to the head are then NaN; the head itself stays finite)."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=300,
        hidden_size=70,
        intermediate_size=100,
        num_hidden_layers=1,
        num_attention_heads=5,
        num_key_value_heads=5,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(12)
    model = tf.LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(13)
    with torch.no_grad():
        head = model.lm_head.weight
        head[70] = head[71] = head[250] = torch.randn(70, generator=gen) * 0.3
        head[260] = head[270] = torch.randn(70, generator=gen) * 0.3
        for r in range(100, 120):
            head[r] = torch.randn(70, generator=gen) * 0.3
            head[r + 80] = head[r] + torch.randn(70, generator=gen) * 3e-4
        if nan_token is not None:
            model.get_input_embeddings().weight[nan_token] = float("nan")
    name = "near_tie" if nan_token is None else f"near_tie_nan{nan_token}"
    model.save_pretrained(str(root / name), safe_serialization=True)
    return root / name


def test_the_int8_head_gives_the_full_heads_argmax(isa: str, tmp_path: Path) -> None:
    """A greedy pass without logits (``forward_rows(logits=False)``, what greedy verification asks for) gives every
    row the full head's argmax bit for bit, on heads made to defeat an int8 copy: exact twins (the first wins), near
    twins a thousandth apart (only the exact logits tell them apart), a part-filled last panel, inputs not a multiple
    of 4; in one pass of many sequences and a row alone. It computes only a few panels exactly. The AMX build has no
    int8 head: it computes every logit and gives the same answers."""
    path = near_tie_checkpoint(tmp_path)
    runner = NativeRunner.from_pretrained(path, dtype=torch.bfloat16, kernel=True)
    fused = runner._fused
    assert fused.prunes_head == (isa != "amx")
    gen = torch.Generator().manual_seed(14)
    ids = torch.randint(1, 300, (400,), generator=gen).tolist()
    caches = [runner.new_cache() for _ in range(8)]
    for c, lo in zip(caches, range(0, 400, 50)):
        runner.forward_blocks([(ids[lo : lo + 10], c)], [1])
    kv = [c.kv_at for c in caches]
    rows0, panels0 = nk.head_stats()
    seen, twins = 0, set()
    for step in range(30):
        n = 1 if step == 29 else 8  # a row alone last (the other caches then lack its position)
        toks = [ids[lo + 10 + step] for lo in range(0, 50 * n, 50)]
        pos, out = [10 + step] * n, list(range(n))
        full: list[int] = []
        logits = fused.forward_rows(toks, pos, kv[:n], out, best=full)  # (both write the same keys and values)
        assert full == logits.argmax(dim=-1).tolist()
        pruned: list[int] = []
        got = fused.forward_rows(toks, pos, kv[:n], out, best=pruned, logits=False)
        assert got.shape == ((n, 0) if fused.prunes_head else (n, 300))
        assert pruned == full, step
        seen += n
        twins |= {b for b in full if b in (70, 260) or 100 <= b < 120 or 180 <= b < 200}
    assert {70, 260} & twins and len(twins - {70, 260}) >= 3  # twins and near twins were rows' maxima
    rows, panels = (a - b for a, b in zip(nk.head_stats(), (rows0, panels0)))
    if fused.prunes_head:
        assert rows == seen and panels < rows * 19 / 3  # of 19 panels a row: a third at most
    else:
        assert rows == 0


def test_the_int8_head_takes_a_row_with_nan_inputs_whole(tmp_path: Path) -> None:
    """A row whose inputs to the head are NaN is computed over every panel: the full head's answer, torch's argmax of a
    row of NaN (its first index). A head holding a NaN gets no int8 copy."""
    if nk.kernel_isa() == "amx":
        pytest.skip("the AMX build has no int8 head")
    runner = NativeRunner.from_pretrained(near_tie_checkpoint(tmp_path, nan_token=9), dtype=torch.bfloat16, kernel=True)
    assert runner._fused.prunes_head
    cache = runner.new_cache()
    runner.forward_blocks([([3, 4, 5], cache)], [0])
    kv = [cache.kv_at] * 2
    full: list[int] = []
    logits = runner._fused.forward_rows([9, 6], [3, 4], kv, [0, 1], best=full)
    pruned: list[int] = []
    runner._fused.forward_rows([9, 6], [3, 4], kv, [0, 1], best=pruned, logits=False)
    assert full == [-1, -1] and bool(logits.isnan().all())  # the NaN reaches the next row through the cache
    assert pruned == logits.argmax(dim=-1).tolist() == [0, 0]
    nan_head = NativeRunner.from_pretrained(tied_head_checkpoint(tmp_path, nan_token=5), dtype=torch.bfloat16)
    assert not nan_head._fused.prunes_head


def test_the_int8_head_switch_and_greedy_output(
    default_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy generation on the shipped pair reads its argmax from the int8 head (where the build has one) and gives
    the same tokens as with it switched off (``SPECDEC_CPU_KERNEL_HEAD_I8=0``), speculating and not, batched and not."""
    import specdec

    target, draft = default_pair
    prompts = ["def quicksort(items):\n", "import os\nimport sys\n\n\ndef main(argv):\n", "class Stack:\n"]
    outs = []
    for switch in ("1", "0"):
        monkeypatch.setenv(nk.HEAD_I8_SWITCH, switch)
        engine = specdec.load(target, draft)
        fused = engine.target._fused
        assert fused.prunes_head == (switch == "1" and nk.kernel_isa() != "amx")
        rows0 = nk.head_stats()[0]
        tokens = [engine.generate(p, max_new_tokens=40, tau=tau).token_ids for p in prompts for tau in (0, 3)]
        gens = [engine.start(p, max_new_tokens=40, tau=2) for p in prompts]
        while any(not g.done for g in gens):
            engine.step(gens)
        tokens += [g.new_tokens for g in gens]
        assert (nk.head_stats()[0] > rows0) == fused.prunes_head
        outs.append(tokens)
    assert outs[0] == outs[1]


def test_a_sampled_draft_in_the_kernel_draws_as_the_loop_would(tiny_models: dict[str, Path]) -> None:
    """``draft_rows``: a temperature-only sequence's whole draft in one kernel call draws the tokens, probabilities and
    distributions (bit for bit) that the drafting loop's per-position path (a pass, then ``draw_rows``) draws from the
    same generator, each uniform in turn; a greedy sequence in the same call drafts what ``draft_greedy`` drafts; each
    cache holds as many tokens as the loop leaves in it."""
    from specdec.sampling_params import SamplingParams

    runner = NativeRunner.from_pretrained(tiny_models["draft"], dtype=torch.float32, kernel=True)
    v = runner.vocab_size
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(1, v, (9 + 3 * s,), generator=gen).tolist() for s in range(3)]
    temps, tau = [0.8, 0.0, 1.3], 5

    def prefilled() -> list:
        caches = [runner.new_cache() for _ in prompts]
        for p, c in zip(prompts, caches):
            runner.forward_blocks([(p[:-1], c)], [0])
        return caches

    kernel_caches = prefilled()
    gens = [torch.Generator().manual_seed(100 + s) for s in range(3)]
    tokens, tops, probs, dists = runner.draft_rows(
        [(p[-1:], c) for p, c in zip(prompts, kernel_caches)], [tau] * 3, [None] * 3, v, temps, gens
    )
    greedy, _ = runner.draft_greedy([(prompts[1][-1:], prefilled()[1])], [tau], [None], v)
    assert tokens[1] == greedy[0] and dists[1] is None and probs[1] == tops[1]
    loop_caches = prefilled()
    for s in (0, 2):  # the loop's path: a pass for each position, then one draw from the request's generator
        g, params = torch.Generator().manual_seed(100 + s), SamplingParams(temperature=temps[s])
        fed, want, want_p, want_q = prompts[s][-1:], [], [], []
        for _ in range(tau):
            logits = runner.forward_blocks([(fed, loop_caches[s])], [1])
            ys, ps, tp, q = runner.draw_rows([logits], [params], [g])
            want.append(ys[0]), want_p.append(ps[0]), want_q.append(q)
            fed = ys
        assert tokens[s] == want and probs[s] == want_p and len(tops[s]) == tau
        dist = dists[s]
        assert dist is not None and torch.equal(dist, torch.cat(want_q))
        assert kernel_caches[s].length == loop_caches[s].length  # every token fed but the last drafted


def test_sampled_drafts_in_the_kernel_stop_where_the_loop_stops(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drafting loop with sampled requests drafted in the kernel (``draft_rows``) against the same loop with every
    pick made in Python (the runner's ``drafts_natively`` off): the same drafts, token by token, with the same
    probabilities, tops and distributions, under no rule, a ReachRule (which reads each token's own probability)
    and a MinConfidence rule (which reads the top one), greedy and sampled requests side by side."""
    from specdec.drafters.loop import DraftAsk
    from specdec.drafters.model import ModelDrafter
    from specdec.policy.base import MinConfidence, ReachRule
    from specdec.sampling_params import SamplingParams

    runner = NativeRunner.from_pretrained(tiny_models["draft"], dtype=torch.float32, kernel=True)
    drafter = ModelDrafter(runner, runner.vocab_size)
    gen = torch.Generator().manual_seed(22)
    contexts = [torch.randint(1, runner.vocab_size, (8 + 5 * s,), generator=gen).tolist() for s in range(4)]
    # (low temperatures: a drawn token's probability often in another tenth than the top one)
    params = [SamplingParams(temperature=t) for t in (0.2, 0.0, 0.25, 0.2)]
    # (falling with the probability: where the kernel read the top probability for the token's, it stopped earlier)
    reach = ReachRule(accept_by_tenth=(0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1), min_reach=(0.9, 0.8, 0.7))
    stopped = 0
    for rule in (None, reach, MinConfidence(0.2)):
        drafts = {}
        for natively in (True, False):
            monkeypatch.setattr(type(runner), "drafts_natively", property(lambda self, on=natively: on))
            asks = []
            for s, (ctx, p) in enumerate(zip(contexts, params)):
                state = drafter.new_state()
                drafter.prefill(state, ctx)
                g = torch.Generator().manual_seed(300 + s)
                asks.append(DraftAsk(state=state, context=ctx, tau=6, params=p, generator=g, rule=rule))
            drafts[natively] = drafter.propose(asks)
        for a, b, p in zip(drafts[True], drafts[False], params):
            assert a.tokens == b.tokens
            if p.greedy:  # (the kernel's top probability and torch's softmax may differ in the last place)
                assert a.probs is None and b.probs is None
                assert a.tops == pytest.approx(b.tops, rel=1e-5) and a.token_probs == pytest.approx(
                    b.token_probs, rel=1e-5
                )
                continue
            assert a.token_probs == b.token_probs and a.tops == b.tops
            if a.tokens:  # (a draft whose first token was dropped has no distributions)
                assert a.probs is not None and b.probs is not None and torch.equal(a.probs, b.probs)
            stopped += rule is not None and len(a.tokens) < 6
    assert stopped > 0  # the rules stopped some drafts early


# ---------------------------------------------------------------------------------------------
# int8 draft weights (per-output-channel scales)


def test_int8_product_is_the_dequantized_product_and_row_independent(isa: str) -> None:
    gen = torch.Generator().manual_seed(15)
    w, b = torch.randn(97, 72, generator=gen), torch.randn(97, generator=gen)
    x = torch.randn(40, 72, generator=gen)
    q, s = nk.quantize_int8(w)
    assert q.dtype == torch.int8 and float((q.float() * s[:, None] - w).abs().max()) <= float(s.max()) / 2 + 1e-6
    pw = nk.PackedWeight(w, torch.int8)
    whole = pw.matmul(x, bias=b)
    ref = x.double() @ (q.double() * s.double()[:, None]).T + b.double()
    assert float((whole - ref).abs().max() / ref.abs().max()) < 1e-5
    for k in (1, 2, 3, 7, 9, 17, 40):
        assert torch.equal(pw.matmul(x[:k], bias=b, threads=1 + k % 2), whole[:k]), k


def test_int8_draft_never_changes_the_output(tiny_models: dict[str, Path]) -> None:
    """The draft only proposes: with int8 draft weights greedy output is token-identical to target-only decoding
    (and the int8 draft proposes from its own, slightly different, distribution)."""
    import specdec

    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="bf16", draft_dtype="int8")
    engine.eos_ids = frozenset()
    assert engine.drafter.runner.dtype == torch.int8 and engine.drafter.runner.backend == "cpu-kernel"
    for prompt in ("def fibonacci(n):", "class Stack:\n    def push(self, item):"):
        expected = engine.generate(prompt, max_new_tokens=24, tau=0).token_ids
        for tau in (1, 3, 6):
            assert engine.generate(prompt, max_new_tokens=24, tau=tau).token_ids == expected, tau
    bf = NativeRunner.from_pretrained(tiny_models["draft"], dtype=torch.bfloat16)
    i8 = engine.drafter.runner
    ids = torch.randint(0, bf.vocab_size, (12,), generator=torch.Generator().manual_seed(16))
    a, b = bf.forward(ids, bf.new_cache()), i8.forward(ids, i8.new_cache())
    assert 0 < float((a - b).abs().max() / a.abs().max()) < 0.1  # close, not equal: a different draft


def test_int8_is_refused_where_it_cannot_run(tiny_models: dict[str, Path]) -> None:
    import specdec
    from specdec.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="int8 weights are for the draft model only"):
        specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="int8")
    with pytest.raises(UnsupportedError, match="int8 weights need the native runtime"):
        specdec.load(tiny_models["llama"], tiny_models["draft"], draft_dtype="int8", runtime="hf")
    with pytest.raises(UnsupportedError, match="int8 weights run only on the CPU kernel"):
        NativeRunner.from_pretrained(tiny_models["draft"], dtype=torch.int8, kernel=False)


def test_a_build_says_it_is_compiling_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first use on a machine compiles the kernel (~40 s on 2 cores): the build logs a note naming the cache as it
    starts, and a second call finds the build cached and says nothing. (A stand-in compiler writes the files.)"""
    cxx = tmp_path / "cxx"
    cxx.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do if [ "$1" = -o ]; then : > "$2"; fi; shift; done\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="specdec.kernel")
    first = nk._build(str(cxx))
    notes = [r.getMessage() for r in caplog.records if r.name == "specdec.kernel"]
    assert len(notes) == 1 and "compiling the CPU kernel" in notes[0] and str(tmp_path / "cache") in notes[0]
    caplog.clear()
    assert nk._build(str(cxx)) == first and first.exists()
    assert not [r for r in caplog.records if r.name == "specdec.kernel"]


def _reference_cdf(row: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(row / T)'s distribution function in float64 (unnormalised), the reference for ``sd_sample_rows``."""
    y = row.double() / temperature
    return torch.exp(y - y.max()).cumsum(0)


@pytest.mark.parametrize("vocab", [8192, 8195, 37])  # 8195, 37: the scalar tail after the 8-lane loop
def test_the_kernels_draws_invert_the_distribution_function_of_softmax(vocab: int) -> None:
    """Each draw with uniform u is the token whose reference cumulative mass brackets u * total (float64 exp against
    the kernel's exp8, ~2e-7 relative: a draw within 1e-5 of the total from a bracket's edge may fall either side).
    Uniforms on an even grid over [0, 1) and the first and last, so every token of visible mass is drawn in its
    share: the distribution itself, without a statistical test."""
    lib = nk._library()
    assert lib is not None
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g) * 4
    logits[1, ::3] = float("-inf")  # masked tokens: never drawn
    temps = [0.7, 1.0, 1.6]
    grid = [i / 4000 for i in range(4000)] + [1 - 2**-53]
    for r, t in enumerate(temps):
        got = nk.kernel_sample_rows(lib, logits, [r] * len(grid), [t] * len(grid), grid)
        cdf = _reference_cdf(logits[r], t)
        total = float(cdf[-1])
        for u, tok in zip(grid, got):
            assert 0 <= tok < vocab and logits[r, tok] > float("-inf")
            below = float(cdf[tok - 1]) if tok else 0.0
            assert below - 1e-5 * total <= u * total <= float(cdf[tok]) + 1e-5 * total, (r, u, tok)
        counts = torch.bincount(torch.tensor(got), minlength=vocab).double() / len(grid)
        probs = torch.softmax(logits[r].double() / t, 0)
        assert float((counts - probs).abs().max()) <= 2 / len(grid) + 1e-5


def test_the_kernels_draws_refuse_a_row_without_a_finite_maximum() -> None:
    lib = nk._library()
    assert lib is not None
    logits = torch.zeros(3, 64)
    logits[1] = float("-inf")
    logits[2, 5] = float("nan")
    assert nk.kernel_sample_rows(lib, logits, [0, 0], [1.0, 1.0], [0.0, 0.999]) == [0, 63]
    for row in (1, 2):
        with pytest.raises(ValueError, match=f"row {row} has none"):
            nk.kernel_sample_rows(lib, logits, [0, row], [1.0, 1.0], [0.5, 0.5])


def test_sample_plain_draws_each_request_by_its_own_rule(tiny_models: dict[str, Path]) -> None:
    """The native runner draws temperature-only requests with the kernel and top-k / top-p / min-p ones as every
    runtime does (torch's ``sample_rows_at``), each at its own uniform, whatever else is in the call."""
    from specdec.runtime.base import ModelRunner
    from specdec.sampling import SamplingParams

    runner = NativeRunner.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    cache = runner.new_cache()
    logits = runner.forward_blocks([(list(range(5, 12)), cache)], [4])
    params = [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.2),
        SamplingParams(temperature=0.9, top_p=0.8),
    ]
    us = [0.1, 0.5, 0.7, 0.95]
    mixed = runner.sample_plain(logits, [0, 1, 2, 3], params, us)
    assert mixed == [runner.sample_plain(logits, [r], [p], [u])[0] for r, p, u in zip(range(4), params, us)]
    shaped = ModelRunner.sample_plain(runner, logits, [1, 3], [params[1], params[3]], [us[1], us[3]])
    assert [mixed[1], mixed[3]] == shaped  # the shaped ones: torch's draws
    assert [mixed[0], mixed[2]] == nk.kernel_sample_rows(nk._library(), logits, [0, 2], [0.8, 1.2], [us[0], us[2]])
    # the torch path at the same uniform where the kernel's sums agree with the reference (not at a bracket's edge)
    torch_drawn = ModelRunner.sample_plain(runner, logits, [0, 2], [params[0], params[2]], [us[0], us[2]])
    cdfs = [_reference_cdf(logits[r], t) for r, t in ((0, 0.8), (2, 1.2))]
    for tok, ref, u, cdf in zip([mixed[0], mixed[2]], torch_drawn, [us[0], us[2]], cdfs):
        edge = (cdf / cdf[-1] - u).abs().min()
        assert tok == ref or edge < 1e-5


def test_draw_rows_gives_each_draft_pick_its_distribution_whatever_is_beside_it(tiny_models: dict[str, Path]) -> None:
    """A sampled draft's picks on the kernel: a temperature-only request's token, its probability and the likeliest
    one's come from the distribution written with it (each row summing to 1, the token's entry its probability); a
    top-k request's from torch's; each request's pick the same alone as beside others (its own generator, one
    uniform)."""
    from specdec.runtime.base import ModelRunner
    from specdec.sampling import SamplingParams

    runner = NativeRunner.from_pretrained(tiny_models["draft"], dtype=torch.float32)
    logits = runner.forward_blocks([(list(range(5, 12)), runner.new_cache())], [3])
    rows = [logits[j : j + 1] for j in range(3)]
    params = [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.3),
    ]

    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(s) for s in (3, 4, 5)]

    tokens, probs, tops, q = runner.draw_rows(rows, params, gens())
    assert torch.allclose(q.double().sum(-1), torch.ones(3, dtype=torch.float64), atol=1e-5)
    for i in range(3):
        assert probs[i] == float(q[i, tokens[i]]) and tops[i] == float(q[i].max())
        alone = runner.draw_rows([rows[i]], [params[i]], [gens()[i]])
        assert alone[0] == [tokens[i]] and torch.equal(alone[3][0], q[i])
    torch_pick = ModelRunner.draw_rows(runner, [rows[1]], [params[1]], [gens()[1]])
    assert torch_pick[0] == [tokens[1]] and torch.equal(torch_pick[3][0], q[1])
    for i in (0, 2):  # the kernel's distribution is softmax(x / T) to its exp's precision
        ref = torch.softmax(rows[i][0].double() / params[i].temperature, -1)
        assert float((q[i].double() - ref).abs().max()) < 1e-6


def test_the_kernels_sampled_verdicts_are_the_acceptance_rules(tiny_models: dict[str, Path]) -> None:
    """``sd_verify_sampled`` against ``verify_blocks`` on the same rows, draft and generator seeds (300 seeds, τ = 3,
    a draft partly accepted): the same flags, n̂, last token and draws from the generator. The two take p with
    different exps (~2e-7 apart), so only a uniform within ~1e-6 of an edge could tell them apart: with these fixed
    seeds none does (a disagreement would show as a failure every run, not now and then)."""
    from specdec.sampling import SamplingParams, logits_to_probs
    from specdec.verify import SampledBlock, verify_blocks

    runner = NativeRunner.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    logits = runner.forward_blocks([(list(range(5, 12)), runner.new_cache())], [4])
    params = SamplingParams(temperature=0.9)
    g = torch.Generator().manual_seed(0)
    q = torch.softmax((logits[:3] + torch.randn(logits[:3].shape, generator=g)) / 0.9, -1).contiguous()
    p = logits_to_probs(logits, params)
    outcomes = set()
    for seed in range(300):
        tokens = torch.multinomial(q, 1, generator=torch.Generator().manual_seed(1000 + seed)).flatten().tolist()
        mine, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        decided = runner.sampled_verdict(logits, 0, params, tokens, q, mine)
        assert decided is not None
        flags, n, token, ptok = decided
        (v,) = verify_blocks([SampledBlock(tokens, q, p, theirs)])
        assert (flags, n, [*tokens[:n], token]) == (v.accept_flags, v.n_accepted, v.tokens), seed
        assert ptok == pytest.approx(v.target_token_probs, rel=1e-5)
        assert torch.equal(mine.get_state(), theirs.get_state())
        outcomes.add(n)
    assert outcomes == {0, 1, 2, 3}  # rejections at every position and whole acceptances
    assert runner.sampled_verdict(logits, 0, SamplingParams(temperature=0.9, top_k=5), tokens, q, mine) is None
