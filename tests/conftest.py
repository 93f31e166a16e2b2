"""Fixtures shared by the tests (helpers live in helpers.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tests that run thousands of tiny-model steps: one thread avoids paying for thread start-up each time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2():
    from assistgen import load_model

    return load_model("smollm2-135m", backend="torch", fast_linear=False)
