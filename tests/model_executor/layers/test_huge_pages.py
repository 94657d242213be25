"""Weight buffers in huge pages (layers/huge_pages.py): shapes, alignment, sharing, freeing."""
import gc

import pytest
import torch

from specserve.model_executor.layers import huge_pages
from specserve.model_executor.layers.huge_pages import HUGE_PAGE_BYTES, cat_rows, empty_in_huge_pages

needs_thp = pytest.mark.skipif(not huge_pages._kernel_allows(), reason="no transparent huge pages here")


@pytest.fixture
def huge_on(monkeypatch):
    monkeypatch.delenv("SPECSERVE_HUGE_PAGES", raising=False)


@needs_thp
def test_a_large_tensor_starts_on_a_huge_page_and_holds_what_is_written(huge_on):
    t = empty_in_huge_pages((300, 20000))                 # 6 MB: a mapping of its own
    assert t.shape == (300, 20000) and t.dtype == torch.uint8 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    t.fill_(7)
    t[299, 19999] = 9
    assert int(t.sum()) == 7 * 300 * 20000 + 2


@needs_thp
def test_small_tensors_share_a_region_without_overlapping(huge_on):
    a = empty_in_huge_pages((1000, 3), torch.float32)
    b = empty_in_huge_pages((5,), torch.uint8)
    c = empty_in_huge_pages((100, 100), torch.int16)
    for t in (a, b, c):
        assert t.data_ptr() % 64 == 0
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (a, b, c))
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    a.fill_(1.5), b.fill_(2), c.fill_(-3)
    assert float(a.sum()) == 4500.0 and int(b.sum()) == 10 and int(c.sum()) == -30000


@needs_thp
def test_a_region_is_unmapped_once_its_tensors_are_gone(huge_on):
    t = empty_in_huge_pages((1 << 10,))
    region = huge_pages._filling[0]
    assert region() is not None
    del t
    gc.collect()
    assert region() is None
    own = empty_in_huge_pages((1 << 10,), shared=False)
    address = own.data_ptr()
    assert address % HUGE_PAGE_BYTES == 0 and huge_pages._filling[0]() is None and is_mapped(address)
    del own
    gc.collect()
    assert not is_mapped(address)


def is_mapped(address: int) -> bool:
    with open("/proc/self/maps") as fh:
        for line in fh:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


def test_off_gives_ordinary_tensors(monkeypatch):
    monkeypatch.setenv("SPECSERVE_HUGE_PAGES", "off")
    assert not huge_pages.huge_pages_enabled()
    t = empty_in_huge_pages((4 << 20,))
    assert t.shape == (4 << 20,)
    assert cat_rows([torch.ones(2, 3), torch.zeros(1, 3)]).tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 0]]


@pytest.mark.parametrize("env", ["", "off"])
def test_cat_rows_is_torch_cat(monkeypatch, env):
    monkeypatch.setenv("SPECSERVE_HUGE_PAGES", env)
    parts = [torch.randint(0, 255, (n, 144), dtype=torch.uint8) for n in (1536, 256, 256)]
    assert torch.equal(cat_rows(parts), torch.cat(parts))
