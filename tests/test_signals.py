"""Stop signals as exceptions: exit codes, the chain a signal inside torch.save leaves, deferral."""

from __future__ import annotations

import os
import signal

import pytest

from thinwire.signals import Stopped, deferred, signum_of, stop_signals_raise


def test_exit_codes_follow_the_shell_convention():
    assert [Stopped(s).exit_code for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)] == [130, 143, 129]
    assert str(Stopped(signal.SIGTERM)) == "stopped by SIGTERM"


def test_signal_is_found_behind_the_error_it_caused():
    try:
        try:
            raise Stopped(signal.SIGHUP)
        except Stopped:
            raise RuntimeError("unexpected pos 80960 vs 80912")  # torch.save's zip writer, unwinding
    except RuntimeError as e:
        assert signum_of(e) == signal.SIGHUP
    assert signum_of(KeyboardInterrupt()) == signal.SIGINT
    assert signum_of(ValueError("x")) is None


def test_sigterm_raises_inside_and_handlers_are_restored_after():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped, match="SIGTERM"):
        with stop_signals_raise():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**6):  # the handler runs between bytecodes
                pass
    assert signal.getsignal(signal.SIGTERM) is before


def test_deferred_holds_a_signal_until_cleanup_is_done():
    done = []
    with pytest.raises(Stopped, match="SIGHUP"):
        with stop_signals_raise():
            with deferred():
                os.kill(os.getpid(), signal.SIGHUP)
                for _ in range(10**5):
                    pass
                done.append("cleanup finished")
    assert done == ["cleanup finished"]
