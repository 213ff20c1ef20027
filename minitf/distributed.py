"""Data-parallel training over MPI: the handful of verbs the training loop calls.

Launched as w ranks (the world size) with `mpiexec -n w python train_wmt.py ...` (or `srun --mpi=pmix`), every process (rank)
holds the whole model, plans the same global stream of batches, and takes its share of every
update's batches; gradients are summed over the ranks on the flat gradient buffer (MPI Allreduce
on NumPy; NCCL on CuPy, its unique id broadcast over MPI, as chainermn and cupyx.distributed do).
Run without a launcher, `init` returns the one-process `World` and mpi4py is never imported.

The verbs: `rank`, `size`, `local_rank`, `local_size`, `allreduce_sum(buf)` (in place),
`allreduce_numbers`, `allgather(obj)`, `barrier()`, `abort(code)`, `share_cores()`, and `use_gpu()` (MPIWorld's
only: the GPU ranks of a multi-rank run), and `bcast(obj)`, which the tests use. Paper 5.2: the base model was
trained on 8 GPUs of one machine.
"""
import os
import sys
import time

import numpy as np

from .errors import ConfigError, signals_held

# what the common launchers put in the environment of every process they start: its rank, and beside it the job's
# size (MPICH's hydra, Open MPI's mpirun, PMIx under Open MPI or srun: the step's tasks)
_LAUNCHER_VARS = {"PMI_RANK": ("PMI_SIZE",), "OMPI_COMM_WORLD_RANK": ("OMPI_COMM_WORLD_SIZE",),
                  "PMIX_RANK": ("OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")}


def launched_by_mpi():
    """True when an MPI launcher (mpiexec, mpirun, srun --mpi=...) started this process."""
    return any(v in os.environ for v in _LAUNCHER_VARS)


def launcher_rank():
    """This process's rank as its MPI launcher's environment gives it, before MPI is started; None outside one."""
    for name in _LAUNCHER_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def launcher_size():
    """The job's number of ranks as its MPI launcher's environment gives it, before MPI is started; None outside one
    or where the launcher does not say (PMIx alone)."""
    for rank_var, size_vars in _LAUNCHER_VARS.items():
        if rank_var in os.environ:
            for name in size_vars:
                value = os.environ.get(name, "")
                if value.isdigit():
                    return int(value)
    return None


_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


class World:
    """One process: every verb is the identity (no MPI)."""
    rank, size, local_rank, local_size = 0, 1, 0, 1

    def share_cores(self):
        """CPU ranks on one machine split its cores: this rank's BLAS gets cores / local ranks
        threads (each rank's BLAS would otherwise start a thread per core, and r ranks x c
        spinning threads fight over c cores), unless the environment already sets them.
        Returns the threads set, or None."""
        from .backend import set_blas_threads, usable_cores
        if self.local_size == 1 or any(v in os.environ for v in _THREAD_VARS):
            return None
        threads = max(1, usable_cores() // self.local_size)
        return threads if set_blas_threads(threads) else None

    def allreduce_sum(self, buf):
        return buf

    def allreduce_numbers(self, values):
        return [float(v) for v in values]

    def bcast(self, obj):
        return obj

    def allgather(self, obj):
        return [obj]

    def barrier(self):
        pass

    def quiet_barrier(self):
        pass

    def wait_for_lead(self, grace=5.0):
        return [], True

    def abort(self, code=1):
        sys.exit(code)


class MPIWorld(World):
    """The processes of MPI.COMM_WORLD; gradients of CuPy arrays go through NCCL."""

    def __init__(self, MPI):
        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)   # the ranks of this machine
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        self._nccl = None
        self._wide = None   # the float32 buffer 16-bit gradients are summed in (allreduce_sum)

    def use_gpu(self):
        """Take the GPU of this rank's local rank, and open the NCCL communicator (its unique id
        made on rank 0 and broadcast over MPI)."""
        from .backend import nccl_module, select_gpu
        select_gpu(self.local_rank)
        nccl = nccl_module()
        uid = self.comm.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        self._nccl = (nccl, nccl.NcclCommunicator(self.size, uid, self.rank))

    def allreduce_sum(self, buf):
        """Sum `buf` (a contiguous NumPy or CuPy array) over the ranks, in place."""
        if isinstance(buf, np.ndarray):
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
            return buf
        if self._nccl is None:
            raise ConfigError("allreduce of a GPU array before use_gpu(): call world.use_gpu() first")
        nccl, comm = self._nccl
        from .backend import current_stream_ptr
        if buf.dtype.name == "bfloat16":   # --bf16: summed in float32, rounded once
            # NCCL sums a 16-bit buffer in 16 bits, rounding after each rank's addition: up to 2^-9 relative per rank
            # in bfloat16's 8 bits (a sum over 8 ranks off by several of its units); the sum goes through a float32
            # buffer instead (two casts, 4 bytes a parameter kept, twice the bytes over the links). float16's 11
            # bits keep the 16-bit sum (as PyTorch's fp16 compression hook): its loss scale keeps the values in range
            wide = self._wide
            if wide is None or wide.size != buf.size:
                wide = self._wide = buf.astype("float32")
            else:
                wide[...] = buf
            comm.allReduce(wide.data.ptr, wide.data.ptr, wide.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                           current_stream_ptr())
            buf[...] = wide
            return buf
        kind = {"float16": nccl.NCCL_FLOAT16, "float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64}[buf.dtype.name]
        comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, kind, nccl.NCCL_SUM, current_stream_ptr())
        return buf

    def allreduce_numbers(self, values):
        """Sum a few host numbers over the ranks (float64)."""
        a = np.asarray(values, dtype=np.float64)
        self.comm.Allreduce(self.MPI.IN_PLACE, a, op=self.MPI.SUM)
        return a.tolist()

    def bcast(self, obj):
        return self.comm.bcast(obj, root=0)

    def allgather(self, obj):
        return self.comm.allgather(obj)

    def barrier(self):
        self.comm.Barrier()

    def quiet_barrier(self):
        """A barrier whose waiting ranks sleep between looks (MPI_Barrier spins: a rank waiting while rank 0 prepared
        the data took a core from it, and the preparation ran 1.5x as long on 2 cores)."""
        req = self.comm.Ibarrier()
        while not req.Test():
            time.sleep(0.02)

    def wait_for_lead(self, grace=5.0):
        """A rank other than 0 after training: wait (asleep) at a quiet_barrier for rank 0 to end the run, with Ctrl-C
        and SIGTERM recorded, not fatal (the Python handlers would be gone at the interpreter's exit, and a signal
        there had ended the job with a launcher's error, rank 0's scoring cut without a word). Returns (the signals
        that arrived, by name, whether rank 0 ended the run): rank 0 has `grace` seconds after a signal to end the
        job first (it says why and aborts with 130 or 143) or to finish, after which the wait gives up (the caller
        ends the job)."""
        import signal
        with signals_held() as got:
            req, since = self.comm.Ibarrier(), None
            while not (done := req.Test()):
                if got and since is None:
                    since = time.monotonic()
                if since is not None and time.monotonic() - since > grace:
                    break
                time.sleep(0.05)
        return [signal.Signals(s).name for s in got], done

    def abort(self, code=1):
        # The launcher forwards each rank's output through a pipe, and MPI_Abort kills every rank
        # at once: give it a moment to read this rank's message first, or the job can end silently.
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(0.5)
        self.comm.Abort(code)
        # MPICH's MPI_Abort may return while its launcher ends the job (seen with the mpich wheel's hydra): this
        # process must not go on meanwhile (a flag error had then gone on to argparse's own exit and said it again)
        os._exit(code)


def said_once(world, message):
    """`rank R: message` on stderr, on a rank other than 0 after 2 s: an error every rank meets alike (flags, files,
    the ranks disagreeing, a signal mpiexec forwarded to each) is said by rank 0, whose MPI Abort ends the job
    meanwhile (64 ranks had printed it 64 times); an error of this rank's own is said after the wait."""
    if world.rank != 0:
        with signals_held():   # a second signal mpiexec forwards meanwhile: this rank still ends the job
            time.sleep(2.0)
    sys.stderr.write(f"rank {world.rank}: {message}\n")   # one write: the lines of several ranks never run together
    sys.stderr.flush()


def end_job(message, status):
    """Ends the whole job from a rank that stops before it joined MPI (a flag its command line refuses): the other
    ranks would wait for it in MPI's start or in their first collective for ever (MPICH's launcher does not end a job
    whose process exits before MPI starts). This rank joins MPI, says `message` once (`said_once`: rank 0 alone when
    every rank refuses the same flags) and aborts with `status`. Without mpi4py it says the message and exits."""
    try:
        world = init()
    except ConfigError:
        world = World()
    if world.size == 1:
        sys.stderr.write(f"{message}\n")
        sys.stderr.flush()
        sys.exit(status)
    said_once(world, message)
    world.abort(status)


def init():
    """The World of this process: MPI when an MPI launcher started it, else one process."""
    if not launched_by_mpi():
        return World()
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ConfigError(f"started by an MPI launcher, but mpi4py cannot be imported ({e}): "
                          f"pip install -e \".[dist]\" (mpi4py and the mpich wheel)") from None
    return MPIWorld(MPI)
