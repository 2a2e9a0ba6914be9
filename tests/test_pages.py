"""The kernel's weights in transparent huge pages (runtime/pages.py): the arena keeps every byte, shape and type, the
switch and the OS setting decide, and a model's logits are the same bit for bit either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import specdec.runtime.native_kernel as nk
from specdec.runtime import pages
from specdec.runtime.native import NativeRunner


def test_the_arena_keeps_bytes_shapes_and_types_on_aligned_starts() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(37, 5, generator=g).to(torch.bfloat16),
        torch.randint(-127, 127, (13,), generator=g, dtype=torch.int8),
        torch.randn(3, 64, 2, generator=g),
        torch.randn(8, 8, generator=g).t(),  # not contiguous: placed as its contiguous copy
    ]
    arena = pages.HugePageArena(sum(t.numel() * t.element_size() + pages.ALIGN for t in tensors))
    placed = [arena.place(t) for t in tensors]
    assert placed[0].data_ptr() % pages.HUGE_PAGE == 0  # the first one on a huge-page boundary
    for src, out in zip(tensors, placed, strict=True):
        assert out.dtype == src.dtype and out.shape == src.shape and out.is_contiguous()
        assert torch.equal(out, src)
        assert out.data_ptr() % pages.ALIGN == 0
    ends = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in placed]
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))  # back to back, no overlap
    with pytest.raises(ValueError, match="bytes left"):
        arena.place(torch.zeros(arena.nbytes))


def test_the_thp_setting_is_read_from_the_os(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = tmp_path / "enabled"
    monkeypatch.setattr(pages, "THP_SETTING", setting)
    assert pages.thp_mode() is None and not pages.wanted()  # no such file: no huge pages
    for text, mode in (("always [madvise] never\n", "madvise"), ("[always] madvise never", "always")):
        setting.write_text(text)
        assert pages.thp_mode() == mode
        assert pages.wanted()
    setting.write_text("always madvise [never]\n")
    assert pages.thp_mode() == "never" and not pages.wanted()
    setting.write_text("always [madvise] never\n")
    monkeypatch.setenv(pages.SWITCH, "0")
    assert not pages.wanted()
    assert pages.arena_for([100, 200]) is None  # switched off: the tensors stay where they are
    monkeypatch.delenv(pages.SWITCH)
    arena = pages.arena_for([100, 200])
    assert arena is not None and arena.nbytes >= 300
    assert pages.arena_for([]) is None


@pytest.mark.skipif(not nk.kernel_available(), reason=f"CPU kernel unavailable: {nk.kernel_status()}")
@pytest.mark.skipif(not pages.wanted(), reason="the OS offers no transparent huge pages here")
def test_a_model_in_huge_pages_gives_the_same_logits(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = torch.randint(0, 200, (24,), generator=torch.Generator().manual_seed(1))
    outs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(pages.SWITCH, setting)
        runner = NativeRunner.from_pretrained(tiny_models["llama"], dtype=torch.bfloat16, kernel=True)
        assert runner._fused.huge_pages is (setting == "1")
        cache = runner.new_cache()
        outs[setting] = [runner.forward(ids[:16], cache), runner.forward(ids[16:], cache)]
    for a, b in zip(outs["1"], outs["0"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not nk.kernel_available(), reason=f"CPU kernel unavailable: {nk.kernel_status()}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_the_arena_is_sized_without_packing(dtype: torch.dtype) -> None:
    """``packed_nbytes`` (what the arena is sized by before any weight is packed) is the size of the packed weight,
    odd sizes included, for every layout (single columns, bf16 column pairs, panels in groups)."""
    for m, n in ((16, 8), (37, 5), (100, 71), (8, 1)):
        w = torch.randn(m, n)
        for pairs, group in ((1, 1), (2, 1), (2, 4), (1, 3)):
            if dtype == torch.int8:
                if (pairs, group) != (1, 1):
                    continue
                t = nk.pack_weight_int8(w, 16)
            else:
                t = nk.pack_weight(w, dtype, 16, pairs, group)
            size = t.numel() * t.element_size()
            assert nk.packed_nbytes(m, n, dtype, 16, pairs, group) == size, (m, n, pairs, group)
