"""OpenAI's cursor-paged list (openai_format.list_page), shared by the Conversations items and
the stored chat completions routes: order, after, limit, and the ids of an empty page."""

from __future__ import annotations

import pytest

from ultrafast.server.errors import APIError
from ultrafast.server.openai_format import list_object, list_page

ITEMS = [{"id": f"i{k}"} for k in range(5)]  # oldest first
EMPTY = {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


def ids(page: dict) -> list[str]:
    return [item["id"] for item in page["data"]]


def test_order_after_and_limit_pick_the_page():
    page = list_page({"limit": "2"}, ITEMS, "asc")
    assert ids(page) == ["i0", "i1"]
    assert (page["first_id"], page["last_id"], page["has_more"]) == ("i0", "i1", True)
    page = list_page({"order": "desc", "after": "i3", "limit": "5"}, ITEMS, "asc")
    assert ids(page) == ["i2", "i1", "i0"] and page["has_more"] is False
    assert ids(list_page({}, ITEMS, "desc")) == ["i4", "i3", "i2", "i1", "i0"]
    assert ids(list_page({"order": "asc"}, ITEMS, "desc")) == ["i0", "i1", "i2", "i3", "i4"]


def test_an_empty_page_has_null_ids():
    for page in (
        list_page({}, [], "asc"),
        list_page({"after": "i4"}, ITEMS, "asc"),  # past the last item
        list_page({"after": "unknown"}, ITEMS, "desc"),
        list_object([], False),
    ):
        assert page == EMPTY


@pytest.mark.parametrize(
    "query, param",
    [
        ({"order": "up"}, "order"),
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"limit": "two"}, "limit"),
    ],
)
def test_a_bad_query_is_a_400_naming_its_parameter(query, param):
    with pytest.raises(APIError) as info:
        list_page(query, ITEMS, "asc")
    assert (info.value.status, info.value.code, info.value.param) == (400, "invalid_value", param)
