"""Preemption: a SIGTERM ends a training run at a step every process agrees on, with a checkpoint
of that step, and the same command resumes it.

A SIGTERM is how schedulers give notice (Kubernetes and SLURM before the kill, spot / preemptible
TPU and GPU VMs). Without this, one process died at once and lost every step since its last
checkpoint; and in a multi-process run jax.distributed's own preemption notifier takes SIGTERM, so
the signal was ignored and the run went on until the scheduler's SIGKILL.

    notice = Preemption(install=True)      # one process: a SIGTERM handler (main thread only)
    ...after every step, in every process:
    if notice.reached(step): save a checkpoint of `step`, then raise Preempted(step, ...)
    notice.close()                         # the previous handler back

* one process: the handler only records the notice; the step running finishes and is the one
  saved. A second SIGTERM while that step finishes ends the process at once (the default action).
* several processes (jax.distributed initialized): jax's preemption sync manager, which receives
  the notice of any process, picks the step: `multihost_utils.reached_preemption_sync_point(step)`,
  called by every process after every step, is true at the same step everywhere (the largest step
  any process had reached, plus one), so every process saves the same checkpoint and stops.
"""
from __future__ import annotations

import logging
import os
import signal
import threading

import jax

log = logging.getLogger("train")

EXIT_STATUS = 128 + signal.SIGTERM          # a preempted run's exit status (a shell's "killed by SIGTERM")


class Preempted(Exception):
    """The run stopped at a preemption notice after saving step `step` (`checkpoint`: its folder,
    None when the run had no checkpoint folder)."""

    def __init__(self, step: int, until: int, checkpoint):
        self.step, self.until, self.checkpoint = step, until, checkpoint
        where = (f"checkpoint of step {step} saved in {checkpoint}; the same command resumes from it"
                 if checkpoint is not None else "no checkpoint folder: nothing saved")
        super().__init__(f"preempted (SIGTERM) after step {step} of {until}: {where}")


class Preemption:
    """The preemption notice of this run (see the module docstring). `install`: take SIGTERM in a
    one-process run (a trainer with somewhere to save); a multi-process run always asks jax's sync
    point, whatever `install` says, since jax has taken SIGTERM already."""

    def __init__(self, install: bool = True):
        self.multi = jax.distributed.is_initialized() and jax.process_count() > 1
        self.noticed = False
        self._previous = None
        if install and not self.multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if self.noticed:                        # a second notice: stop now, as SIGTERM does by default
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.noticed = True
        log.warning("SIGTERM: the run stops after this step, with a checkpoint of it (a second SIGTERM "
                    "stops it at once)")

    def reached(self, step: int) -> bool:
        """Whether the run stops after `step` (every process calls this after every step)."""
        if self.multi:
            from jax.experimental import multihost_utils
            try:
                return bool(multihost_utils.reached_preemption_sync_point(step))
            except RuntimeError:                # the preemption service is off (jax_enable_preemption_service)
                return False
        return self.noticed

    def close(self) -> None:
        """Puts back the SIGTERM handler this one replaced."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
