"""`Buffers`: flat message buffers lent again at every step."""

from __future__ import annotations

import torch

from singd_curvlinops.distributed.buffers import Buffers

CPU = torch.device("cpu")


def test_a_slot_is_lent_again_while_its_message_fits() -> None:
    buffers = Buffers()
    first = buffers.take("gather", 10, torch.float32, CPU)
    assert first.shape == (10,) and first.dtype == torch.float32
    smaller = buffers.take("gather", 4, torch.float32, CPU)
    assert smaller.shape == (4,)
    assert smaller.data_ptr() == first.data_ptr()  # a prefix of the same storage
    assert buffers.nbytes == 10 * 4


def test_a_larger_message_grows_the_slot() -> None:
    buffers = Buffers()
    buffers.take("gather", 4, torch.float32, CPU)
    larger = buffers.take("gather", 12, torch.float32, CPU)
    assert larger.shape == (12,)
    again = buffers.take("gather", 8, torch.float32, CPU)
    assert again.data_ptr() == larger.data_ptr()
    assert buffers.nbytes == 12 * 4


def test_slots_and_dtypes_do_not_share_storage() -> None:
    buffers = Buffers()
    a = buffers.take(("half", "sent"), 6, torch.float32, CPU)
    b = buffers.take(("half", "received"), 6, torch.float32, CPU)
    c = buffers.take(("half", "sent"), 6, torch.float64, CPU)
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3
    assert c.dtype == torch.float64
    assert buffers.nbytes == 6 * 4 + 6 * 4 + 6 * 8


def test_clear_releases_every_slot() -> None:
    buffers = Buffers()
    buffers.take("statistics", 5, torch.float32, CPU)
    buffers.clear()
    assert buffers.nbytes == 0
    assert buffers.take("statistics", 5, torch.float32, CPU).shape == (5,)
