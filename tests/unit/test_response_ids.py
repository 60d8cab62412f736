"""Response ids: fresh per call, or fixed by the call's Idempotency-Key (per tenant)."""

import pytest

from ultrafast.server.errors import APIError
from ultrafast.server.frontends.responses import response_id_for


def test_a_keyed_call_keeps_its_id_and_an_unkeyed_one_gets_a_new_one():
    keyed = response_id_for("acme", "k-1")
    assert keyed == response_id_for("acme", "k-1") and keyed.startswith("resp_")
    assert response_id_for("acme", "k-2") != keyed
    assert response_id_for("other", "k-1") != keyed  # tenants never share an id
    assert response_id_for("acme", None) != response_id_for("acme", None)


def test_a_malformed_key_is_a_clear_error():
    with pytest.raises(APIError) as exc:
        response_id_for("acme", "not a key")
    assert exc.value.status == 400 and exc.value.param == "Idempotency-Key"
