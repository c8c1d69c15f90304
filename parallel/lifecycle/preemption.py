"""Stop requests: SIGTERM, SIGUSR1 or SIGINT during training only sets a flag, which the train loop
exchanges once per step on the gloo control group, so every rank stops after the same step, saves a
checkpoint and exits. Outside the loop a signal stops the process (SIGTERM after a short delay), and
while a failure is being reported signals are only noted. run_entrypoint (parallel/lifecycle/entrypoint.py)
owns the one StopRequest of a process and installs its handler; the Runtime reaches it as `runtime.stop`.
"""

import signal
import threading
import time

from parallel.lifecycle import startup


class StopRequest:
    """SIGTERM / SIGUSR1 / SIGINT while training: remember the signal and let the train loop stop after
    the step it is in, with a checkpoint. Outside the loop a signal stops the process: SIGINT (Ctrl-C) at
    once, SIGTERM after DEFER_S, because torchrun sends SIGTERM to every rank when one of them failed,
    and a rank that is about to reach the same refusal, or to learn which rank failed, must print that
    first. A second signal more than a few seconds after the first stops at once: the user insists.
    While a failure is being reported (`hold`), signals are only noted: nothing pre-empts the error line."""

    SIGNALS = tuple(s for s in (getattr(signal, n, None) for n in ("SIGTERM", "SIGUSR1", "SIGINT")) if s)
    INSIST_AFTER_S = (
        3.0  # torchrun forwards the signal it got: the copy arriving right after is no second request
    )
    DEFER_S = 5.0  # SIGTERM outside the training loop: the time left to reach this rank's own error line

    def __init__(self):
        self.watchdog = None  # the runtime's, once it exists: a signal in the loop notes its step
        self.accepting = False
        self.held = False
        self.signum = 0
        self.received_at = 0.0
        self.received_in_step: int | None = None
        self._deferred: threading.Timer | None = None
        self._redelivering = False

    def handler(self, signum, frame):
        now = time.monotonic()
        if self._redelivering:  # the deferred SIGTERM, sent again to the main thread after DEFER_S
            self._redelivering = False
            if self.held or self.accepting:  # reporting a failure, or the loop (it stops after this step)
                return
            raise Terminated(signum)
        if self.held:
            self.signum = self.signum or signum
            return
        if self.accepting and (not self.signum or now - self.received_at < self.INSIST_AFTER_S):
            if not self.signum:  # no message here: torchrun also sends SIGTERM when another rank died
                self.signum, self.received_at = signum, now
                self.received_in_step = self.watchdog.step if self.watchdog is not None else None
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == signal.SIGTERM and self._deferred is None and not self.accepting:
            self.signum, self.received_at = signum, now
            # The signal comes again to the main thread after DEFER_S (a real signal interrupts a sleep or
            # a gloo wait) and this handler then raises. (On NCCL the main thread may be blocked in a CUDA
            # wait, where no Python handler runs: a peer that died is named by the watchdog thread.)
            self._deferred = threading.Timer(self.DEFER_S, self._redeliver, args=(signum,))
            self._deferred.daemon = True
            self._deferred.start()
            return
        raise Terminated(signum)

    def _redeliver(self, signum: int) -> None:
        self._redelivering = True
        signal.pthread_kill(threading.main_thread().ident, signum)

    def hold(self) -> None:
        """A failure is being reported: from now on stop signals are noted, never raised."""
        self.held = True
        self._stop_deferral()

    def _stop_deferral(self) -> None:
        """Cancel the deferred SIGTERM and wait for its thread: once this returns it cannot arrive."""
        if self._deferred is not None:
            self._deferred.cancel()
            if self._deferred is not threading.current_thread():
                self._deferred.join()

    def install(self):
        self.accepting, self.held, self.signum, self.received_at, self.received_in_step = (
            False,
            False,
            0,
            0.0,
            None,
        )
        self._deferred, self._redelivering = None, False
        previous = {s: signal.signal(s, self.handler) for s in self.SIGNALS}
        # startup.py's handler only bridged the imports: after the run a SIGTERM ends the process again
        previous = {s: signal.SIG_DFL if h is startup.note else h for s, h in previous.items()}
        if startup.take_noted():  # a SIGTERM during the imports: deferred from now, as if it came now
            self.handler(signal.SIGTERM, None)

        def restore():
            self._stop_deferral()
            for s, h in previous.items():
                signal.signal(s, h)

        return restore


class Terminated(BaseException):
    """A stop signal outside the training loop, e.g. torchrun stopping the survivors after a rank failed."""

    def __init__(self, signum: int):
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


class Stopped(BaseException):
    """The training loop stopped on request after saving; run_entrypoint exits with 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
