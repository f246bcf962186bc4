"""Fair quarantine (issue 27) from the Python client, on the shared daemon:
a kernel that crashes [exec] quarantine_after (3) times in a row is refused
(KERNEL_QUARANTINED); an admin's clear_quarantine lifts it, and so does
registering the identical definition again. The shrunk-region and
neighbour-corruption cases are IsolationIT's (tests/integration)."""

import numpy as np
import pytest

import opjit

from conftest import unary_kernel, unary_spec

SEGV = unary_spec("q27_segv",
                  unary_kernel("* 2.0f", pre="*static_cast<volatile int*>(nullptr) = 1;"))


def crash_until_quarantined(c, x):
    for _ in range(3):
        with pytest.raises(opjit.Aborted) as e:
            c.op("q27_segv")(x)
        assert e.value.reason == "KERNEL_CRASHED", e.value
    with pytest.raises(opjit.FailedPrecondition) as e:
        c.op("q27_segv")(x)
    assert e.value.reason == "KERNEL_QUARANTINED", e.value


def test_admin_and_identical_registration_lift_a_quarantine(client):
    x = np.ones(4, np.float32)
    first = client.register(SEGV)
    crash_until_quarantined(client, x)
    # The local caller of the embedded default is an admin.
    assert client.clear_quarantine("q27_segv") == 1
    with pytest.raises(opjit.Aborted):
        client.op("q27_segv")(x)
    # Nothing left to lift for an op without a quarantine; an unknown op is NOT_FOUND.
    assert client.clear_quarantine("q27_segv") == 0
    with pytest.raises(opjit.NotFound):
        client.clear_quarantine("q27_no_such_op")
    # Quarantined again, then the identical definition again: the same version, lifted.
    crash_until_quarantined(client, x)
    again = client.register(SEGV)
    assert again.record.version == first.record.version
    with pytest.raises(opjit.Aborted) as e:
        client.op("q27_segv")(x)
    assert e.value.reason == "KERNEL_CRASHED", e.value
    client.delete("q27_segv")
