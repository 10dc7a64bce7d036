"""Where the engine's threads run on a CPU device: the thread that steps the engine on a core of its
own, the runtime's native threads (XLA's worker pools, the native decode step's OpenMP team, LLVM's
compile workers) on the other cores (`EngineConfig.cpu_binding="on"`; off by default).

On a CPU backend the "device" is those native threads, on the same cores as the engine's host
thread. Left to the OS, the host thread's Python (scheduling, handing tokens out) lands on a core a
step is running on and preempts it mid-step; the host work the pipelining should hide then slows
the step it overlaps. Bound apart, each keeps its core, and the computation has one core fewer: on
the 2-vCPU VM of docs/benchmarks.md section 2 the engine served the tiny model's bursts 1.07x (64
rows) and 1.12x (256 rows) faster bound, and SmolLM2-135M's 0.70x - a compute-bound step on one
core instead of two. Hence off by default: it pays where the host's work is large next to the step
and cores are many. vLLM's CPU backend binds its OpenMP threads to chosen cores the same way
(VLLM_CPU_OMP_THREADS_BIND) and likewise reserves no core for a single rank by default
(VLLM_CPU_NUM_OF_RESERVED_CPU: 0 when world_size is 1).

    binding = ThreadBinding()
    binding.bind()        # from the stepping thread: True once bound (also when this thread already is)
    binding.release()     # every thread back where it was

The placement is process-wide, so one thread holds it at a time: several engines stepped by one
thread share it, and an engine stepped by another thread while it is held is left unbound (one log
line). Where the OS refuses (no sched_setaffinity, a seccomp profile, one usable core) the engine
runs unbound, with one log line. The engine binds whichever thread steps it (its own loop thread,
or a caller's: `generate`, `step`), on its first step there.
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("serve.cpu_binding")

_lock = threading.Lock()
_holder: int | None = None          # the native id of the bound stepping thread
_holders: set = set()               # the ThreadBinding objects bound to it
_cores: tuple | None = None         # (original cores, host cores, compute cores) while bound
_said: set = set()                  # log lines already written (each once per process)


def split(cores) -> tuple[frozenset, frozenset] | None:
    """(host cores, compute cores) of the usable `cores`: the highest-numbered one for the stepping
    thread (the OS tends to put interrupts and stray work on the first), the rest for the native
    threads; None with fewer than two (nothing to split)."""
    cores = sorted(cores)
    if len(cores) < 2:
        return None
    return frozenset(cores[-1:]), frozenset(cores[:-1])


def native_threads() -> list[int]:
    """Native ids of this process's threads that Python did not start (the runtime's own)."""
    python = {t.native_id for t in threading.enumerate()}
    return [tid for tid in _threads() if tid not in python]


def _threads() -> list[int]:
    """Native ids of every thread of this process (OSError without /proc)."""
    return list(map(int, os.listdir("/proc/self/task")))


def _alive() -> list[int]:
    """`_threads()`, none without /proc."""
    try:
        return _threads()
    except OSError:
        return []


def _say(line: str, level: int = logging.INFO) -> None:
    if line not in _said:
        _said.add(line)
        log.log(level, line)


class ThreadBinding:
    """One engine's claim on the process-wide placement (see the module docstring)."""

    def __init__(self):
        self.bound_to: int | None = None        # the native id of the thread this binding holds
        self.tried: int | None = None           # threading.get_ident() of the last thread `bind` was called
                                                # from (each thread is tried once)

    def bind(self) -> bool:
        """Binds the calling thread as the stepping thread (once per thread: a refused or failed try
        is not repeated). True when this thread holds the placement."""
        global _holder
        ident = threading.get_ident()
        if self.tried == ident:                      # the engine asks every step: one comparison
            return self.bound_to is not None
        self.release()                               # this engine's claim from another thread first
        self.tried, tid = ident, threading.get_native_id()
        with _lock:
            if _holder is not None and _holder != tid:
                if _holder in _alive():
                    _say(f"cpu binding: thread {_holder} already holds the host core; thread {tid} that "
                         f"steps another engine is not bound")
                    return False
                _holders.clear()                     # its thread ended unreleased: this one takes over
            if _holder != tid:
                if not _place(tid):
                    return False
                _holder = tid
            _holders.add(self)
            self.bound_to = tid
            return True

    def release(self) -> None:
        """Gives up this binding's claim; the last one to go puts every thread the placement moved
        (and those started since on the bound cores) back on the original cores."""
        global _holder, _cores
        with _lock:
            mine, self.bound_to, self.tried = self.bound_to, None, None
            if mine is None or mine != _holder:
                return
            _holders.discard(self)
            if _holders or _cores is None:
                return
            _restore(_cores[0], (_cores[1], _cores[2]))
            _holder, _cores = None, None


def _place(tid: int) -> bool:
    """Moves thread `tid` to the host core and every native thread to the others (under _lock)."""
    global _cores
    try:
        original = frozenset(os.sched_getaffinity(0)) if _cores is None else _cores[0]
    except (AttributeError, OSError) as e:           # no sched_getaffinity on this OS
        _say(f"cpu binding unavailable ({type(e).__name__}: {e}); threads are not bound", logging.WARNING)
        return False
    plan = split(original)
    if plan is None:
        _say(f"cpu binding: {len(original)} usable core(s); threads are not bound")
        return False
    host, compute = plan
    try:
        others = native_threads()
        os.sched_setaffinity(tid, host)
        for t in others:
            try:
                os.sched_setaffinity(t, compute)
            except ProcessLookupError:               # the thread ended meanwhile
                pass
    except OSError as e:                             # no /proc, or the OS refused (a seccomp profile)
        _say(f"cpu binding unavailable ({type(e).__name__}: {e}); threads are not bound", logging.WARNING)
        _restore(original)                           # undo a partial placement
        _cores = None
        return False
    _cores = (original, host, compute)
    _say(f"cpu binding: the engine's stepping thread on core {_ranges(host)}, {len(others)} runtime "
         f"threads on cores {_ranges(compute)}")
    return True


def _restore(original, moved=None) -> None:
    """Every thread whose cores are one of `moved` (None: any) back on `original` (without /proc none:
    nothing was moved through it either)."""
    for tid in _alive():
        try:
            if moved is None or frozenset(os.sched_getaffinity(tid)) in moved:
                os.sched_setaffinity(tid, original)
        except OSError:
            pass


def _ranges(cores) -> str:
    """'0-6' for a contiguous set, else the list."""
    cores = sorted(cores)
    if len(cores) > 2 and cores[-1] - cores[0] == len(cores) - 1:
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))
