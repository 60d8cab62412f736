"""A slot's KV rows cut to a prefix (executors/ggml_kv_rows.prefix): the cells of positions
[0, n) in position order, each layer's K and V rows with them, or a clear error."""

import numpy as np
import pytest

from ultrafast.executors.ggml_kv_rows import KVLayoutError, SlotRows, prefix


def _rows(positions: list[int], v_trans: bool = False) -> SlotRows:
    cells = np.array(positions, dtype=np.int32)
    k = [np.stack([np.full(4, 10 * layer + p, np.float16) for p in positions]) for layer in (1, 2)]
    v = [row.copy() + 100 for row in k]
    return SlotRows(cells, k, [x.T.copy().T for x in v] if v_trans else v, v_trans)


@pytest.mark.parametrize("v_trans", [False, True])
def test_the_prefix_keeps_its_cells_in_position_order_with_their_rows(v_trans):
    rows = _rows([3, 0, 5, 1, 2, 4], v_trans)  # cells as llama.cpp may hold them
    cut = prefix(rows, 3)
    assert cut.positions.tolist() == [0, 1, 2] and cut.v_trans == v_trans
    for layer, (k, v) in enumerate(zip(cut.k, cut.v), start=1):
        assert k[:, 0].tolist() == [10 * layer + p for p in (0, 1, 2)]
        assert v[:, 0].tolist() == [100 + 10 * layer + p for p in (0, 1, 2)]


def test_a_prefix_the_rows_do_not_hold_once_each_is_an_error():
    with pytest.raises(KVLayoutError, match=r"positions \[0, 3\)"):
        prefix(_rows([0, 2, 5]), 3)  # 1 missing
    with pytest.raises(KVLayoutError):
        prefix(_rows([0, 1, 1, 2]), 3)  # 1 twice
