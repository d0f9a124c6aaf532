import pytest

from coordinator.page_allocator import PageAllocator


def test_allocate_and_free_return_every_page():
    a = PageAllocator(8)
    pages = a.allocate(5)
    assert len(set(pages)) == 5 and a.n_used == 5 and a.n_free == 3
    a.free(pages)
    assert a.n_used == 0 and sorted(a.free_pages) == list(range(8))


def test_can_allocate_never_mutates():
    a = PageAllocator(4)
    assert a.can_allocate(4) and not a.can_allocate(5)
    assert a.n_free == 4


def test_shared_pages_return_after_last_holder():
    a = PageAllocator(4)
    pages = a.allocate(2)
    a.share(pages)
    a.free(pages)
    assert a.n_used == 2
    a.free(pages)
    assert a.n_used == 0


def test_double_free_is_caught():
    a = PageAllocator(2)
    p = a.allocate(1)
    a.free(p)
    with pytest.raises(AssertionError):
        a.free(p)
