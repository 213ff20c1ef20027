"""distributed.py without a launcher, and under one without mpi4py (no MPI needed)."""
import sys

import numpy as np
import pytest

from minitf import distributed
from minitf.errors import ConfigError


def test_without_a_launcher_everything_is_the_identity(monkeypatch):
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(sys.modules, "mpi4py", None)   # importing it would fail: it is never tried
    world = distributed.init()
    assert (world.rank, world.size, world.local_rank) == (0, 1, 0)
    buf = np.arange(4.0)
    assert world.allreduce_sum(buf) is buf and buf.tolist() == [0, 1, 2, 3]
    assert world.allreduce_numbers([1, 2.5]) == [1.0, 2.5]
    assert world.allgather({"a": 1}) == [{"a": 1}] and world.bcast(3) == 3


def test_a_launcher_without_mpi4py_says_what_to_install(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[dist\]"'):
        distributed.init()


def test_cpu_ranks_of_one_machine_split_its_cores(monkeypatch):
    from minitf import backend
    for var in distributed._THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    asked = []
    monkeypatch.setattr(backend, "set_blas_threads", lambda n: asked.append(n) or True)
    monkeypatch.setattr(backend, "usable_cores", lambda: 8)
    world = distributed.World()
    assert world.share_cores() is None and asked == []          # one process keeps every core
    world.local_size = 3
    assert world.share_cores() == 2 and asked == [2]            # 8 cores // 3 ranks
    world.local_size = 16
    assert world.share_cores() == 1                             # never fewer than one
    monkeypatch.setenv("OMP_NUM_THREADS", "4")                  # the user's setting wins
    assert world.share_cores() is None and asked == [2, 1]
